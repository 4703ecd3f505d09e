"""Views are read where they lie, on every backend: q, k, v, dout and out given as the
transpose of `[H, T, D]` arrays, or as slices of one packed `[T, Hq + 2 Hk, D]` (or
`[T, 2 Hk, D]`) buffer, against the float64 reference (forward and gradients, STYLE.md
tolerances, fresh outputs NaN-filled by the suite).

* numpy, cpu, numba (the CUDA simulator on a CPU) through the public API, and the setup step,
  which hands the backend the caller's views uncopied;
* numba on device arrays: views of Numba device arrays, read through their strides;
* cupy, mma.sync and sm_90a, through the host emulation (`emulation/`), each case in its own
  process (the emulation replaces `cupy`), run by this file's __main__: no copy and no warning
  for an aligned view; an unaligned one copied with a RuntimeWarning naming it and why, once
  per argument and reason.
"""
from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import pytest

import varlen
from varlen.testing import check_against_reference, make_batch

from helpers import emulate_script, needs_cxx

# --------------------------------------------------------------------------------------------
# Views of a batch
# --------------------------------------------------------------------------------------------


def transposed(x):
    """`x` [T, H, D] as the transpose of an [H, T, D] array: the same values, rows D and heads
    T * D elements apart."""
    return np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)


def packed_slices(*arrays):
    """`arrays` [T, H_i, D] as consecutive head slices of one [T, sum H_i, D] buffer (QKV
    packing): rows sum H_i * D elements apart."""
    T, _, D = arrays[0].shape
    buf = np.empty((T, sum(a.shape[1] for a in arrays), D), arrays[0].dtype)
    views, h = [], 0
    for a in arrays:
        view = buf[:, h:h + a.shape[1]]
        view[...] = a
        views.append(view)
        h += a.shape[1]
    return views


def views_of(b, kind):
    """`(q, k, v, dout)` of batch `b` as views of `kind`: "transposed" (every array the
    transpose of an [H, T, D] array), "kv-slices" (q and dout transposed, k and v slices of one
    [Tk, 2 Hk, D] buffer) or "qkv-slices" (q, k, v slices of one [T, Hq + 2 Hk, D] buffer, dout
    transposed; self-attention: Tq == Tk)."""
    if kind == "transposed":
        views = [transposed(x) for x in (b.q, b.k, b.v, b.dout)]
    elif kind == "kv-slices":
        views = [transposed(b.q), *packed_slices(b.k, b.v), transposed(b.dout)]
    else:
        assert kind == "qkv-slices" and b.q.shape[0] == b.k.shape[0], kind
        views = [*packed_slices(b.q, b.k, b.v), transposed(b.dout)]
    for x, view in zip((b.q, b.k, b.v, b.dout), views):
        assert np.array_equal(view, x, equal_nan=True)
        assert x.shape[1] == 1 or not view.flags.c_contiguous, "a view laid out as a copy"
    return views


def _batch(kind, dtype, D, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "qkv-slices":             # one layout for queries and keys
        return make_batch(rng, [37, 0, 21], Hq=4, Hk=2, D=D, dtype=dtype, mask="causal")
    return make_batch(rng, [37, 0, 21], [50, 3, 21], Hq=4, Hk=2, D=D, dtype=dtype,
                      mask="causal_bottom_right", gaps=True)


def _api_step(b, views, backend, **kw):
    """Forward and backward through the public API on the views; out goes back in as a view
    too (transposed)."""
    q, k, v, dout = views
    out, lse = varlen.attention_forward(q, k, v, b.cu_q, b.cu_k, **b.layout, backend=backend,
                                        **kw)
    grads = varlen.attention_backward(dout, q, k, v, transposed(np.asarray(out)), lse, b.cu_q,
                                      b.cu_k, **b.layout, backend=backend, **kw)
    return out, lse, grads


# --------------------------------------------------------------------------------------------
# Host backends and the setup step
# --------------------------------------------------------------------------------------------

HOST_CASES = [("numpy", "float64", 16), ("numpy", "float16", 16), ("cpu", "float32", 32),
              ("cpu", "bfloat16", 32)]


@pytest.mark.parametrize("backend, dtype, D", HOST_CASES,
                         ids=[f"{b}-{t}-D{d}" for b, t, d in HOST_CASES])
@pytest.mark.parametrize("kind", ["transposed", "kv-slices", "qkv-slices"])
def test_host_backends_read_views(backend, dtype, D, kind):
    if backend == "cpu":
        pytest.importorskip("numba")
    b = _batch(kind, dtype, D)
    out, lse, grads = _api_step(b, views_of(b, kind), backend)
    check_against_reference(b, out, lse, grads, label=f"{backend} {kind}")


def test_setup_hands_the_backend_the_views_themselves():
    """The setup step (`to_working`, the checks) copies no view: the backend gets the caller's
    arrays, strides and memory."""
    from varlen._setup import setup
    b = _batch("transposed", "float16", 16)
    views = views_of(b, "kv-slices")
    q, k, v, dout = views
    call = setup(q, k, v, b.cu_q, b.cu_k, **b.layout, backend="numpy",
                 grads=(dout, transposed(b.q), np.zeros((4, b.q.shape[0]), np.float32)))
    for name, got, want in (("q", call.q, q), ("k", call.k, k), ("v", call.v, v),
                            ("dout", call.grads[0], dout)):
        assert got is want or (np.shares_memory(got, want) and got.strides == want.strides), (
            f"{name}: setup copied the view (strides {want.strides} -> {got.strides})")


def test_cpu_backend_packs_views_where_they_lie():
    """The CPU backend's packing kernels read a view of the working dtype in place (Numba
    compiles them for its strides); only another dtype is converted."""
    from varlen.backends import cpu_backend
    x = transposed(np.ones((5, 3, 8), np.float32))
    assert cpu_backend._as(x, np.dtype(np.float32)) is x
    half = cpu_backend._as(x.astype(np.float16), np.dtype(np.float32))
    assert half.dtype == np.float32 and half.flags.c_contiguous


# --------------------------------------------------------------------------------------------
# numba (the CUDA simulator on a CPU)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["transposed", "kv-slices", "qkv-slices"])
def test_numba_reads_views(kind):
    """Host views through the public API (packed on their way to the device, the one copy a
    transfer needs)."""
    pytest.importorskip("numba")
    from varlen.backends.numba_backend import simulated
    if not simulated():
        pytest.skip("the views of device arrays are tested on a GPU by tests/numba")
    rng = np.random.default_rng(3)
    if kind == "qkv-slices":
        b = make_batch(rng, [9, 0, 5], Hq=2, Hk=1, D=8, dtype="float32", mask="causal")
    else:
        b = make_batch(rng, [9, 0, 5], [6, 2, 11], Hq=2, Hk=1, D=8, dtype="float32",
                       mask="causal_bottom_right", gaps=True)
    out, lse, grads = _api_step(b, views_of(b, kind), "numba")
    check_against_reference(b, out, lse, grads, label=f"numba {kind}")


def test_numba_reads_device_views_where_they_lie():
    """Views of Numba device arrays (the simulator's) go to the kernels as they are: q and dout
    transposed, k and v slices of one buffer, with a plan built on the device; both backward
    modes against the reference."""
    pytest.importorskip("numba")
    from numba import cuda

    from varlen.backends.numba_backend import BACKEND as NUMBA, plan_from_cu_seqlens, simulated
    if not simulated():
        pytest.skip("runs in the CUDA simulator")
    rng = np.random.default_rng(4)
    b = make_batch(rng, [9, 0, 5], [6, 2, 11], Hq=2, Hk=1, D=8, dtype="float32",
                   mask="causal_bottom_right", gaps=True)
    q_t, dout_t = (cuda.to_device(np.ascontiguousarray(x.transpose(1, 0, 2)))
                   for x in (b.q, b.dout))
    kv = cuda.to_device(np.concatenate([b.k, b.v], axis=1))
    q, dout = q_t.transpose((1, 0, 2)), dout_t.transpose((1, 0, 2))
    k, v = kv[:, :1], kv[:, 1:]
    assert q.strides != cuda.to_device(b.q).strides and k.strides[0] == 2 * k.strides[1]
    dev = {n: cuda.to_device(getattr(b, n)) for n in ("cu_q", "cu_k", "off_q", "off_k")}
    plan = plan_from_cu_seqlens(dev["cu_q"], dev["cu_k"], seq_offsets_q=dev["off_q"],
                                seq_offsets_k=dev["off_k"], mask=b.mask,
                                num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], block_m=8,
                                block_n=8)
    kw = dict(softmax_scale=1.0 / math.sqrt(8), softcap=0.0)
    out, lse = NUMBA.forward(plan, q, k, v, **kw)
    for det in (False, True):
        grads = NUMBA.backward(plan, dout, q, k, v, out, lse, deterministic=det, **kw)
        check_against_reference(b, out.copy_to_host(), lse.copy_to_host(),
                                [g.copy_to_host() for g in grads],
                                label=f"numba device views (deterministic={det})")


# --------------------------------------------------------------------------------------------
# cupy: what `launch.data` decides, and the kernels through the host emulation
# --------------------------------------------------------------------------------------------

def test_strides_past_32_bits_are_a_reason_to_copy():
    """`Strides` are 32-bit: a view whose heads (or rows) lie 2^31 elements or more apart is
    copied (judged from the strides alone, nothing read)."""
    from varlen.backends.cupy import launch
    base = np.zeros(16, np.float16)
    far = np.lib.stride_tricks.as_strided(base, (2, 2, 8), (16, 2 ** 31 * 2, 2))
    key, why = launch._copy_reason(far, launch.CHUNK_ALIGN, tma=False)
    assert key == "stride" and "32-bit" in why, why
    near = np.lib.stride_tricks.as_strided(base, (2, 2, 8), (16, (2 ** 31 - 8) * 2, 2))
    assert launch._copy_reason(near, 1, tma=False) is None


EMULATED = {
    # label: (implementation, views, dtype, D, block_m, block_n)
    "mma-kv-slices-fp16-D64": ("mma", "kv-slices", "float16", 64, 64, 64),
    "mma-qkv-slices-bf16-D64-BM128": ("mma", "qkv-slices", "bfloat16", 64, 128, 64),
    "sm90a-kv-slices-fp16-D64": ("sm90a", "kv-slices", "float16", 64, 64, 64),
    "sm90a-qkv-slices-bf16-D64": ("sm90a", "qkv-slices", "bfloat16", 64, 64, 64),
}


@needs_cxx
@pytest.mark.parametrize("label", list(EMULATED))
def test_cupy_kernels_read_views_on_host_emulation(label):
    emulate_script(__file__, "views", label)


@needs_cxx
def test_cupy_copies_an_unaligned_view_with_a_warning():
    emulate_script(__file__, "unaligned")


# --------------------------------------------------------------------------------------------
# Emulated side: python tests/emulation/test_views.py views LABEL | unaligned
# --------------------------------------------------------------------------------------------

def _install(impl, block_m, block_n):
    """The stand-in cupy (and for sm_90a its runtime); the implementation's backend."""
    import emulation.cupy as emu
    emu.install_fake_cupy(block_m, block_n)
    if impl == "sm90a":
        import emulation.sm90
        emulation.sm90.install()
    from varlen.backends.cupy import BACKEND, launch
    launch._warned.clear()
    return BACKEND.implementation(impl)


def _copies(caught):
    """The launchers' copy warnings among `caught`."""
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning) and "; copied" in str(w.message)]


def _case_views(label):
    impl, kind, dtype, D, block_m, block_n = EMULATED[label]
    backend = _install(impl, block_m, block_n)
    b = _batch(kind, dtype, D)
    q, k, v, dout = views_of(b, kind)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=block_m, block_n=block_n)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = backend.forward(plan, q, k, v, **kw)
        results = [(det, backend.backward(plan, dout, q, k, v, transposed(out), lse,
                                          deterministic=det, **kw)) for det in (False, True)]
    assert not _copies(caught), f"{label}: an aligned view was copied: {_copies(caught)}"
    for det, grads in results:
        check_against_reference(b, out, lse, grads,
                                label=f"{label} (emulated, deterministic={det})")
    print(label, "ok")


def _unaligned(x, offset_bytes):
    """A copy of `x` whose first element lies `offset_bytes` past a 16-byte boundary."""
    n = x.size * x.itemsize
    raw = np.zeros(n + 32, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset_bytes
    y = raw[start:start + n].view(x.dtype).reshape(x.shape)
    y[...] = x
    return y


def _case_unaligned():
    """mma.sync: q 8 bytes off a 16-byte boundary and k with a strided last dim are copied, one
    warning each that names them and says why, none on a second call; v with its rows in
    reverse memory order (a negative row stride) is read in place. sm_90a: the same v is
    copied (a tensor map's strides are unsigned). Both against the reference."""
    rng = np.random.default_rng(5)
    b = make_batch(rng, [20, 9], [33, 9], Hq=2, Hk=1, D=64, dtype="float16", mask="causal")
    q = _unaligned(b.q, 8)
    k = np.repeat(b.k[..., None], 2, axis=-1)[..., 0]                 # last dim 4 bytes apart
    v = np.ascontiguousarray(b.v[::-1])[::-1]                          # row stride < 0
    assert q.ctypes.data % 16 == 8 and k.strides[-1] == 4 and v.strides[0] < 0
    kw = dict(softmax_scale=1.0 / math.sqrt(64), softcap=0.0)
    unaligned = {"q": "is not 16-byte aligned", "k": "last dim is not contiguous"}
    for impl, want in (("mma", unaligned), ("sm90a", {**unaligned, "v": "not all positive"})):
        backend = _install(impl, 64, 64)
        plan = varlen.plan(b.cu_q, b.cu_k, mask=b.mask, block_m=64, block_n=64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, lse = backend.forward(plan, q, k, v, **kw)
            first = _copies(caught)
            backend.forward(plan, q, k, v, **kw)
        said = {m.split(":")[0]: m for m in first}
        assert set(said) == set(want), f"{impl}: copy warnings {first}, expected for {set(want)}"
        for name, why in want.items():
            assert why in said[name] and said[name].endswith("; copied"), said[name]
        assert _copies(caught) == first, f"{impl}: warned again on the second call: {caught}"
        check_against_reference(b, out, lse, label=f"unaligned views ({impl}, emulated)")
    print("unaligned ok")


def _main(argv):
    kind, *rest = argv
    {"views": _case_views, "unaligned": _case_unaligned}[kind](*rest)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
