"""Attention sinks (`sinks=`): one logit per query head in every row's softmax, with no value.

Every host backend against the float64 reference (which puts the sink in its own softmax, not
through `varlen._sinks`), forward and backward, dsinks included, over packed batches with
zero-length and one-token sequences, padding gaps, GQA, per-sequence windows (rows that see
one key: the cpu backend's P = 1 shortcut must not apply), cross attention with rows that see
no key (out 0, lse = sinks[h]), a sink of -inf (no sink) and a dominant one; NaN in another
sequence; bitwise repeatability; the torch adapter (eager and torch.compile without
recompiling for new sink values), the JAX adapter (jit, grad), the FlashAttention drop-in;
bad input. Context parallelism: tests/comm_workers/sinks_cp.py (test_comm_sinks.py, and
real processes in tests/multiprocess/test_cp_workers.py); Numba: tests/numba; CuPy: emulation.
"""
import numpy as np
import pytest

import varlen
from varlen import reference
from varlen.testing import check_against_reference, covered_rows, make_batch

from helpers import cases

HQ, HK = 4, 2


def _sinks(rng, dtype=np.float32):
    s = rng.standard_normal(HQ) * 2.0
    s[1] = -np.inf          # a head without a sink
    s[2] = 8.0              # a sink that takes most of every row's weight
    return s.astype(dtype)


def _batch(kind, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "windows":   # per-sequence windows: the first rows see one key
        lengths = [0, 1, 37, 5, 70]
        mask = varlen.Mask(window_left=np.array([-1, 0, 3, -1, 0], np.int32), window_right=0)
        return make_batch(rng, lengths, Hq=HQ, Hk=HK, D=16, Dv=8, dtype=dtype, mask=mask,
                          gaps=True), rng
    # cross attention, bottom-right causal: the first rows of a sequence with Lq > Lk (and
    # every row of one with Lk = 0) see no key
    return make_batch(rng, [3, 0, 9, 6, 1], [0, 4, 5, 12, 1], Hq=HQ, Hk=HK, D=16, dtype=dtype,
                      mask="causal_bottom_right", gaps=True), rng


BACKENDS = cases([pytest.param(be, dt, kind, id=f"{be}-{dt}-{kind}")
                  for be, dtypes in (("numpy", ("float64", "float32", "float16")),
                                     ("cpu", ("float64", "float32", "bfloat16")))
                  for dt in dtypes for kind in ("windows", "no-key-rows")],
                 ["numpy-float64-no-key-rows", "numpy-float16-windows", "cpu-float32-windows",
                  "cpu-bfloat16-no-key-rows"])


def _run(b, sinks, backend, deterministic=False):
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                        backend=backend, sinks=sinks)
    grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k,
                                      **b.layout, backend=backend, sinks=sinks,
                                      deterministic=deterministic)
    return out, lse, grads


@pytest.mark.parametrize("backend, dtype, kind", BACKENDS)
def test_backends_match_reference(backend, dtype, kind):
    b, rng = _batch(kind, dtype)
    sinks = _sinks(rng)
    out, lse, grads = _run(b, sinks, backend)
    assert len(grads) == 4 and grads[3].shape == (HQ,)
    check_against_reference(b, out, lse, grads, sinks=sinks, label=f"{backend} {kind}")


def test_rows_without_keys_get_the_sink_and_padding_stays_out():
    b, rng = _batch("no-key-rows", "float64")
    sinks = _sinks(rng, np.float64)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout, sinks=sinks)
    _, plain = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout)
    rows = covered_rows(b)
    no_key = rows & np.isneginf(plain).all(axis=0)
    assert no_key.sum() >= 3
    assert not out[no_key].any()
    assert np.array_equal(lse[:, no_key], np.repeat(sinks[:, None], no_key.sum(), axis=1))
    assert np.isneginf(lse[:, ~rows]).all() and not out[~rows].any()
    # elsewhere lse = log(exp(lse_keys) + exp(sink)), the output scaled by exp(lse_keys - lse)
    seen = rows & ~no_key
    want = np.logaddexp(plain[:, seen], sinks[:, None])
    np.testing.assert_allclose(lse[:, seen], want, rtol=1e-13)


def test_sink_gradient_is_the_softmax_rule():
    """dsinks = -sum_rows P_sink * rowsum(dout * out), and a finite-difference check of it
    (float64, numpy backend)."""
    b, rng = _batch("windows", "float64", seed=3)
    sinks = _sinks(rng, np.float64)
    sinks[1] = 0.5
    out, lse, grads = _run(b, sinks, "numpy")

    def loss(s):
        o, _ = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout, sinks=s)
        return float((o * np.where(covered_rows(b)[:, None, None], b.dout, 0)).sum())
    eps = 1e-6
    for h in range(HQ):
        up, down = sinks.copy(), sinks.copy()
        up[h] += eps
        down[h] -= eps
        fd = (loss(up) - loss(down)) / (2 * eps)
        assert abs(fd - grads[3][h]) <= 1e-6 * max(1.0, abs(fd)), (h, fd, grads[3][h])


def test_nan_in_another_sequence_stays_there():
    b, rng = _batch("windows", "float32", seed=1)
    sinks = _sinks(rng)
    start = int(b.off_q[2])
    b.q[start + 4, 0, 3] = np.nan               # sequence 2, head 0
    out, lse, (dq, dk, dv, dsinks) = _run(b, sinks, "cpu")
    ref = reference.attention_dense(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout, sinks=sinks)
    ref_grads = reference.attention_dense_backward(b.dout, b.q, b.k, b.v, b.cu_q, b.cu_k,
                                                   **b.layout, sinks=sinks, out=out, lse=lse)
    assert np.array_equal(np.isnan(out), np.isnan(ref[0]))
    assert np.array_equal(np.isnan(dsinks), np.isnan(ref_grads[3]))
    assert np.isnan(dsinks[0]) and not np.isnan(dsinks[1:]).any()
    other = slice(int(b.off_q[3]), int(b.off_q[-1]))
    assert np.isfinite(out[other]).all()


def test_bitwise_repeatable():
    b, rng = _batch("windows", "bfloat16", seed=2)
    sinks = _sinks(rng)
    first = _run(b, sinks, "cpu", deterministic=True)
    again = _run(b, sinks, "cpu", deterministic=True)
    for x, y in zip(first[:2] + tuple(first[2]), again[:2] + tuple(again[2])):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_bad_sinks_are_named():
    b, rng = _batch("windows", "float32")
    call = dict(**b.layout)
    with pytest.raises(ValueError, match=r"sinks must have shape \[Hq\] = \[4\]"):
        varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, sinks=np.zeros(3, np.float32),
                                 **call)
    with pytest.raises(ValueError, match=r"sinks must have shape"):
        varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k,
                                 sinks=np.zeros((1, 4), np.float32), **call)
    with pytest.raises(TypeError, match="sinks must be a float array"):
        varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, sinks=np.zeros(4, np.int32),
                                 **call)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="sinks"):
        varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, sinks=torch.zeros(4), **call)


# --------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------

def _reference_and_grads(b, sinks):
    ref = reference.attention_dense(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout, sinks=sinks)
    grads = reference.attention_dense_backward(b.dout, b.q, b.k, b.v, b.cu_q, b.cu_k,
                                               **b.layout, sinks=sinks)
    return ref[0], grads


def test_torch_eager_and_compiled_without_recompiling():
    torch = pytest.importorskip("torch")
    import varlen.torch as vt
    from torch._dynamo.utils import counters
    b, rng = _batch("windows", "float64")
    meta = {k: None if v is None else torch.as_tensor(v) for k, v in
            dict(cu_q=b.cu_q, cu_k=b.cu_k, off_q=b.off_q, off_k=b.off_k).items()}
    mask = varlen.Mask(*(torch.as_tensor(f) if np.ndim(f) else f for f in b.mask.fields()))

    def f(q, k, v, s):
        return vt.varlen_attention(q, k, v, meta["cu_q"], meta["cu_k"],
                                   seq_offsets_q=meta["off_q"], seq_offsets_k=meta["off_k"],
                                   mask=mask, sinks=s)
    compiled = torch.compile(f, fullgraph=True)
    graphs = None
    for step, fn in enumerate((f, compiled, compiled)):
        sinks = _sinks(np.random.default_rng(step), np.float64)
        ref_out, ref_grads = _reference_and_grads(b, sinks)
        q, k, v, s = (torch.tensor(x, requires_grad=True) for x in (b.q, b.k, b.v, sinks))
        out = fn(q, k, v, s)
        (out * torch.as_tensor(np.where(covered_rows(b)[:, None, None], b.dout, 0))).sum() \
            .backward()
        np.testing.assert_allclose(out.detach().numpy(), ref_out, atol=1e-12)
        for t, r in zip((q, k, v, s), ref_grads):
            np.testing.assert_allclose(t.grad.numpy(), r, atol=1e-11)
        if step == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "new sink values recompiled"


def test_torch_sinks_must_be_a_tensor_on_q_device():
    torch = pytest.importorskip("torch")
    import varlen.torch as vt
    q = torch.zeros(4, HQ, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="sinks is a numpy.ndarray"):
        vt.varlen_attention(q, q[:, :HK], q[:, :HK], cu, cu, sinks=np.zeros(HQ))
    with pytest.raises(TypeError, match="sinks must be a float tensor"):
        vt.varlen_attention(q, q[:, :HK], q[:, :HK], cu, cu, sinks=torch.zeros(HQ, dtype=int))


def test_jax_jit_and_grad():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import varlen.jax as vj
    b, rng = _batch("no-key-rows", "float32")
    sinks = _sinks(rng)
    dout = np.where(covered_rows(b)[:, None, None], b.dout, 0)
    ref_out, ref_grads = _reference_and_grads(b, sinks)

    def loss(q, k, v, s):
        out = vj.varlen_attention(q, k, v, b.cu_q, b.cu_k, seq_offsets_q=b.off_q,
                                  seq_offsets_k=b.off_k, mask=b.mask, sinks=s)
        return jnp.sum(out * dout), out
    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        *(jnp.asarray(x) for x in (b.q, b.k, b.v, sinks)))
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), r, atol=2e-4 * max(1, np.abs(r).max()))
    with pytest.raises(ValueError, match=r"sinks must have shape \[Hq\]"):
        vj.varlen_attention(b.q, b.k, b.v, b.cu_q, b.cu_k, sinks=jnp.zeros(3))


def test_flash_attn_drop_in():
    torch = pytest.importorskip("torch")
    from varlen.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func
    rng = np.random.default_rng(4)
    B, S, D = 2, 7, 16
    q, k, v = (rng.standard_normal((B, S, h, D)) for h in (HQ, HK, HK))
    sinks = _sinks(rng, np.float64)
    cu = np.arange(B + 1, dtype=np.int32) * S
    flat = [x.reshape(B * S, *x.shape[2:]) for x in (q, k, v)]
    want, want_lse = reference.attention_dense(*flat, cu, cu, mask="causal", sinks=sinks)
    s = torch.tensor(sinks, requires_grad=True)
    out, lse, _ = flash_attn_varlen_func(*map(torch.tensor, flat), torch.tensor(cu),
                                         torch.tensor(cu), S, S, causal=True, sinks=s,
                                         return_attn_probs=True)
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-12)
    out.sum().backward()
    assert s.grad is not None and s.grad.shape == (HQ,)
    out4 = flash_attn_func(*map(torch.tensor, (q, k, v)), causal=True, sinks=torch.tensor(sinks))
    np.testing.assert_allclose(out4.reshape(B * S, HQ, D).numpy(), want, atol=1e-12)


@pytest.mark.parametrize("backend, dtype", [("numpy", "float64"), ("cpu", "float32")])
def test_sinks_with_dropout(backend, dtype):
    """Dropout scales the kept probabilities, the sink renormalises the row: both at once,
    forward and backward (dsinks included), against the reference drawing the same pairs."""
    b, rng = _batch("windows", dtype, seed=5)
    sinks = _sinks(rng)
    drop = dict(dropout_p=0.2, seed=1234, offset=3)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                        backend=backend, sinks=sinks, **drop)
    grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k,
                                      **b.layout, backend=backend, sinks=sinks, **drop)
    check_against_reference(b, out, lse, grads, sinks=sinks, label=f"{backend} dropout",
                            **drop)
