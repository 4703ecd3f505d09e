"""MaskMod and ScoreMod through `varlen.torch.varlen_attention`: the gallery against the float64
reference (forward, gradients, gradients of float aux tensors), learnable aux, determinism,
the fake implementation, `torch.compile(fullgraph=True)` without recompiles, and the errors a
caller meets."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import varlen  # noqa: E402
import varlen.torch as vt  # noqa: E402
from varlen import MaskMod, ScoreMod  # noqa: E402
from varlen.reference import attention_dense, attention_dense_backward  # noqa: E402
from varlen.testing import _covered  # noqa: E402

from adapter_cases import needs_numba_simulator  # noqa: E402
from helpers import assert_close, cases  # noqa: E402
from mods_cases import (MASK_IDS, SCORE_IDS, alibi, mask_cases, prefix_lm,  # noqa: E402
                        relative_bias, score_cases)

# (lengths, Hq, Hk, gap rows after each sequence): zero-length first and last, length 1, GQA
LAYOUTS = {"L0-1-13-29-0-Hq4-Hk1": ([0, 1, 13, 29, 0], 4, 1, 0),
           "L17-5-0-11-Hq2-Hk2-gap3": ([17, 5, 0, 11], 2, 2, 3)}


def _batch(lengths, Hq, Hk, gap, dtype, seed=0, D=8):
    """Packed q/k/v/dout (NumPy) with `gap` padding rows after each sequence."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    off = np.concatenate([[0], np.cumsum(lengths + gap)]).astype(np.int32)
    T = int(off[-1])
    q, k, v, do = (rng.standard_normal((T, h, D)).astype(dtype) for h in (Hq, Hk, Hk, Hq))
    return cu, (off if gap else None), q, k, v, do


def _torch_mod(mod, requires_grad=False):
    """`mod` over torch copies of its aux arrays (float ones requiring grad if asked)."""
    if mod is None:
        return None
    aux = [torch.from_numpy(np.array(a)) for a in mod.aux]
    return mod.with_aux([a.requires_grad_(requires_grad and a.is_floating_point())
                         for a in aux])


def _t(a, requires_grad=False):
    return None if a is None else torch.from_numpy(np.array(a)).requires_grad_(requires_grad)


def _run(q, k, v, do, cu, off, mask, score_mod, **kw):
    """Forward and backward through the adapter; returns out, lse, (dq, dk, dv), daux."""
    tq, tk, tv = (_t(x, True) for x in (q, k, v))
    tmask = mask if isinstance(mask, str) else _torch_mod(mask)
    tsm = _torch_mod(score_mod, requires_grad=True)
    out, lse = vt.varlen_attention(tq, tk, tv, _t(cu), _t(cu), seq_offsets_q=_t(off),
                                   seq_offsets_k=_t(off), mask=tmask, score_mod=tsm,
                                   return_lse=True, **kw)
    out.backward(_t(do))
    daux = () if tsm is None else tuple(a.grad for a in tsm.aux)
    return out, lse, (tq.grad, tk.grad, tv.grad), daux


def _check(label, got, want, dtype, rows):
    out, lse, grads, daux = got
    w_out, w_lse = want[0]
    w_grads = want[1]
    assert_close(f"{label} out", out.detach().numpy()[rows], w_out[rows], dtype=dtype)
    lse = lse.numpy()[:, rows]
    assert np.array_equal(np.isneginf(lse), np.isneginf(w_lse[:, rows])), f"{label} lse -inf"
    fin = np.isfinite(w_lse[:, rows])
    np.testing.assert_allclose(lse[fin], w_lse[:, rows][fin],
                               atol=1e-12 if dtype == "float64" else 1e-5,
                               err_msg=f"{label} lse")
    for name, g, w in zip(("dq", "dk", "dv"), grads, w_grads[:3]):
        assert_close(f"{label} {name}", g.numpy()[rows], w[rows], dtype=dtype, factor=3.0,
                     floor=16.0)
    for i, (g, w) in enumerate(zip(daux, w_grads[3] if len(w_grads) > 3 else ())):
        assert (g is None) == (w is None), f"{label} aux {i}: a gradient on one side only"
        if g is not None:
            # float32 accumulation (the core's contract for aux gradients)
            np.testing.assert_allclose(g.numpy(), w, rtol=2e-5, atol=2e-5 * np.abs(w).max(),
                                       err_msg=f"{label} daux {i}")


def _reference(q, k, v, do, cu, off, mask, score_mod, **kw):
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    kw = dict(seq_offsets_q=off, seq_offsets_k=off, mask=mask, score_mod=score_mod, **kw)
    fwd = attention_dense(q, k, v, cu, cu, **kw)
    bwd = attention_dense_backward(do, q, k, v, cu, cu, aux_grads=score_mod is not None, **kw)
    return fwd, bwd


# --------------------------------------------------------------------------------------------
# The gallery against the reference
# --------------------------------------------------------------------------------------------

GALLERY = [(lay, m, s) for lay in LAYOUTS for m in MASK_IDS for s in (None, *SCORE_IDS)]
QUICK = [("L0-1-13-29-0-Hq4-Hk1", m, s) for m, s in zip(MASK_IDS, (*SCORE_IDS, None, None))] + \
        [("L17-5-0-11-Hq2-Hk2-gap3", m, s) for m, s in zip(MASK_IDS[::-1], (None, *SCORE_IDS))]


@pytest.mark.parametrize("layout,mask_id,score_id", cases(GALLERY, QUICK),
                         ids=lambda x: str(x))
def test_gallery_matches_the_reference(layout, mask_id, score_id):
    lengths, Hq, Hk, gap = LAYOUTS[layout]
    cu, off, q, k, v, do = _batch(lengths, Hq, Hk, gap, np.float64)
    mask = dict(mask_cases(lengths))[mask_id]
    score_mod = None if score_id is None else dict(score_cases(Hq))[score_id]
    kw = dict(softcap=2.5) if score_id == "t5" else {}
    prev = varlen.set_nan_fill(True)
    try:
        got = _run(q, k, v, do, cu, off, mask, score_mod, **kw)
    finally:
        varlen.set_nan_fill(prev)
    _check(f"{layout} {mask_id} {score_id}", got,
           _reference(q, k, v, do, cu, off, mask, score_mod, **kw), "float64",
           _covered(cu, off, q.shape[0]))


@pytest.mark.parametrize("score_id", ["alibi", "relative-bias"])
def test_float32_with_aux_gradients(score_id):
    lengths, Hq, Hk, gap = LAYOUTS["L0-1-13-29-0-Hq4-Hk1"]
    cu, off, q, k, v, do = _batch(lengths, Hq, Hk, gap, np.float32, seed=1)
    mask = dict(mask_cases(lengths))["prefix-lm"]
    score_mod = dict(score_cases(Hq))[score_id]
    got = _run(q, k, v, do, cu, off, mask, score_mod)
    assert got[0].dtype == torch.float32 and got[3][0].dtype == torch.float32
    _check(f"float32 {score_id}", got, _reference(q, k, v, do, cu, off, mask, score_mod),
           "float32", _covered(cu, off, q.shape[0]))


def test_int_aux_gets_no_gradient_and_aux_without_requires_grad_none():
    lengths, Hq, Hk, gap = LAYOUTS["L0-1-13-29-0-Hq4-Hk1"]
    cu, off, q, k, v, do = _batch(lengths, Hq, Hk, gap, np.float64)
    t5 = _torch_mod(dict(score_cases(Hq))["t5"], requires_grad=True)
    assert not t5.aux[0].requires_grad and t5.aux[1].requires_grad
    out = vt.varlen_attention(_t(q, True), _t(k), _t(v), _t(cu), _t(cu), score_mod=t5)
    out.backward(_t(do))
    assert t5.aux[0].grad is None and t5.aux[1].grad is not None
    fixed = _torch_mod(dict(score_cases(Hq))["alibi"])
    out = vt.varlen_attention(_t(q, True), _t(k), _t(v), _t(cu), _t(cu), score_mod=fixed)
    out.backward(_t(do))
    assert fixed.aux[0].grad is None


def test_aux_gradient_in_the_aux_dtype():
    """A float64 table with float32 data: float32 accumulation, the gradient in float64."""
    cu, off, q, k, v, do = _batch([7, 9], 2, 1, 0, np.float32)
    table = torch.zeros(2, 13, dtype=torch.float64, requires_grad=True)
    out = vt.varlen_attention(_t(q), _t(k), _t(v), _t(cu), _t(cu),
                              score_mod=ScoreMod(relative_bias, table))
    out.backward(_t(do))
    want = attention_dense_backward(do.astype(np.float64), q, k, v, cu, cu, aux_grads=True,
                                    score_mod=ScoreMod(relative_bias, table.detach().numpy()))
    assert table.grad.dtype == torch.float64
    np.testing.assert_allclose(table.grad.numpy(), want[3][0], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Learnable aux, determinism
# --------------------------------------------------------------------------------------------

def test_a_learnable_slope_trained_for_a_step_changes_the_loss_as_predicted():
    """One SGD step on ALiBi slopes: the loss changes by -lr * |grad|^2 to first order."""
    cu, off, q, k, v, do = _batch([0, 12, 5, 20], 4, 2, 0, np.float64, seed=4)
    slopes = torch.full((4,), 0.25, dtype=torch.float64, requires_grad=True)
    score_mod = ScoreMod(alibi, slopes)

    def loss():
        out = vt.varlen_attention(_t(q), _t(k), _t(v), _t(cu), _t(cu), mask="causal",
                                  score_mod=score_mod)
        return (out * _t(do)).sum()
    before = loss()
    before.backward()
    grad = slopes.grad.clone()
    assert grad.abs().min() > 0, "every head's slope has a gradient"
    lr = 1e-3
    with torch.no_grad():
        slopes -= lr * grad                 # in place: the ScoreMod sees the new values
    after = loss().item()
    predicted = before.item() - lr * float(grad.square().sum())
    assert after < before.item()
    assert abs(after - predicted) < 0.05 * lr * float(grad.square().sum()), (after, predicted)


def test_deterministic_repeats_are_bitwise_equal():
    lengths, Hq, Hk, gap = LAYOUTS["L17-5-0-11-Hq2-Hk2-gap3"]
    cu, off, q, k, v, do = _batch(lengths, Hq, Hk, gap, np.float32)
    mask = dict(mask_cases(lengths))["segments"]
    score_mod = dict(score_cases(Hq))["relative-bias"]
    first, second = (_run(q, k, v, do, cu, off, mask, score_mod, deterministic=True)
                     for _ in range(2))
    for a, b in zip((first[0], *first[2], *first[3]), (second[0], *second[2], *second[3])):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# Fake implementation and torch.compile
# --------------------------------------------------------------------------------------------

def test_fake_and_meta_shapes_of_aux_gradients():
    from torch._subclasses.fake_tensor import FakeTensorMode
    for mode, device in ((FakeTensorMode(), "cpu"), (None, "meta")):
        with (mode if mode is not None else torch.device(device)):
            q = torch.empty(9, 4, 16, requires_grad=True)
            k = torch.empty(9, 2, 16, requires_grad=True)
            cu = torch.zeros(3, dtype=torch.int32)
            table = torch.empty(4, 13, dtype=torch.bfloat16, requires_grad=True)
            buckets = torch.zeros(65, dtype=torch.int32)
            bias = torch.empty(4, 32, requires_grad=True)
            score_mod = ScoreMod(relative_bias, table)
            t5 = dict(score_cases(4))["t5"].with_aux([buckets, bias])
            for sm, aux in ((score_mod, table), (t5, bias)):
                out = vt.varlen_attention(q, k, k, cu, cu, mask=MaskMod(prefix_lm, cu[1:]),
                                          score_mod=sm)
                dq, daux = torch.autograd.grad(out.sum(), (q, aux))
                assert dq.shape == q.shape and daux.shape == aux.shape, device
                assert daux.dtype == aux.dtype, device


def test_opcheck_with_mods_and_aux_gradients():
    """Schema, fake and real implementations agree, autograd registration included."""
    from varlen._torch_ops import _META_NAMES
    from varlen.mods.text import graph_text
    lengths = [0, 5, 9]
    cu, off, q, k, v, do = _batch(lengths, 4, 2, 0, np.float32)
    mask = _torch_mod(dict(mask_cases(lengths))["prefix-lm"])
    t5 = _torch_mod(dict(score_cases(4))["t5"], requires_grad=True)
    meta = dict(cu_seqlens_q=_t(cu), cu_seqlens_k=_t(cu), seq_offsets_q=None,
                seq_offsets_k=None, window_left=None, window_right=None, bottom_right=None,
                window_left_int=-1, window_right_int=-1, bottom_right_int=0,
                softmax_scale=None, softcap=0.0, max_seqlen_q=None, max_seqlen_k=None,
                backend=None, deterministic=False, plan=0,
                mask_mod=graph_text(mask.graph), mask_aux=list(mask.aux),
                score_mod=graph_text(t5.graph), score_aux=list(t5.aux),
                sinks=None, dropout_p=0.0, seed=None, offset=0)
    meta = [meta[name] for name in _META_NAMES]
    x = [_t(a, True) for a in (q, k, v)]
    result = torch.library.opcheck(torch.ops.varlen.attention_forward.default, (*x, *meta))
    assert all(r == "SUCCESS" for r in result.values()), ("forward", result)
    out, lse = torch.ops.varlen.attention_forward(*x, *meta)
    # (detached: the backward op has no gradient of its own)
    meta = [[a.detach() for a in m] if isinstance(m, list) else m for m in meta]
    args = (_t(do), *(a.detach() for a in x), out.detach(), lse.detach(), *meta, True)
    result = torch.library.opcheck(torch.ops.varlen.attention_backward.default, args)
    assert all(r == "SUCCESS" for r in result.values()), ("backward", result)
    daux = torch.ops.varlen.attention_backward(*args)[3]
    assert [g.shape for g in daux] == [t5.aux[1].shape], "one gradient, of the float aux"


def _compile_counter():
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    return CompileCounter()


def test_compile_fullgraph_new_mods_each_batch_without_recompiling():
    """Same T and B, new lengths, new MaskMod/ScoreMod objects over new aux values (a
    Parameter's, as in a module): one compiled graph, and its gradients (aux included) are the
    eager ones."""
    counter = _compile_counter()

    def step(q, k, v, cu, mask, score_mod):
        return vt.varlen_attention(q, k, v, cu, cu, mask=mask, score_mod=score_mod).square().sum()
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    rng = np.random.default_rng(0)
    table = torch.nn.Parameter(torch.zeros(4, 13))
    for lengths in ([5, 3, 12], [2, 9, 9], [20, 0, 0]):
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        q, k, v = (torch.randn(20, h, 8, requires_grad=True) for h in (4, 2, 2))
        with torch.no_grad():
            table.normal_()
        mask = varlen.Mask(window_left=4) & MaskMod(
            prefix_lm, torch.tensor(rng.integers(0, 6, 3), dtype=torch.int32))
        score_mod = ScoreMod(relative_bias, table)
        grads = []
        for fn in (compiled, step):
            for x in (q, k, v, table):
                x.grad = None
            fn(q, k, v, cu, mask, score_mod).backward()
            grads.append([x.grad.clone() for x in (q, k, v, table)])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 batches"


def test_compile_with_aux_inside_the_compiled_function():
    """A ScoreMod built once, given each step's tensors with `with_aux` inside the graph."""
    counter = _compile_counter()
    template = ScoreMod(alibi, torch.zeros(2))

    def step(q, cu, slopes):
        return vt.varlen_attention(q, q, q, cu, cu, score_mod=template.with_aux([slopes]))
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    cu = torch.tensor([0, 6, 11], dtype=torch.int32)
    for _ in range(2):
        q, slopes = torch.randn(11, 2, 8), torch.rand(2)
        torch.testing.assert_close(compiled(q, cu, slopes), step(q, cu, slopes))
    assert counter.frame_count == 1


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

def _small():
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return torch.randn(6, 2, 8), cu


@pytest.mark.parametrize("make,err,match", [
    pytest.param(lambda: dict(score_mod=ScoreMod(alibi, np.ones(2, np.float32))), TypeError,
                 r"score_mod aux argument 0 is a numpy.ndarray; varlen.torch takes aux arrays "
                 r"as torch tensors", id="numpy-aux"),
    pytest.param(lambda: dict(mask=MaskMod(prefix_lm, torch.ones(2, dtype=torch.int32,
                                                                 device="meta"))),
                 ValueError, r"mask_mod aux argument 0 is on meta but q is on cpu",
                 id="aux-on-another-device"),
    pytest.param(lambda: dict(score_mod=ScoreMod(alibi, torch.ones(2)).with_aux(
        [torch.ones(2, dtype=torch.float64)])), TypeError,
        r"score_mod aux argument 0 is a 1-D float64 tensor but score_mod was traced with a "
        r"1-D float32 array", id="aux-dtype-changed"),
    pytest.param(lambda: dict(score_mod=lambda s, b, h, i, j: s), TypeError,
                 "score_mod must be a varlen.ScoreMod", id="score-mod-callable"),
])
def test_errors_name_the_aux_argument(make, err, match):
    q, cu = _small()
    with pytest.raises(err, match=match):
        vt.varlen_attention(q, q, q, cu, cu, **make())


@needs_numba_simulator
def test_numba_kernels_behind_the_op_in_the_simulator():
    """`backend="numba"`: the CUDA kernels (simulated) run the functions and the aux
    gradients behind the op; with deterministic=True too (fixed-point aux gradients), bitwise
    equal from run to run."""
    cu, off, q, k, v, do = _batch([5, 0, 7], 2, 1, 0, np.float32)
    mask = dict(mask_cases([5, 0, 7]))["prefix-lm"]
    score_mod = dict(score_cases(2))["relative-bias"]
    want = _reference(q, k, v, do, cu, off, mask, score_mod)
    rows = _covered(cu, off, q.shape[0])
    got = _run(q, k, v, do, cu, off, mask, score_mod, backend="numba")
    _check("numba", got, want, "float32", rows)
    runs = [_run(q, k, v, do, cu, off, mask, score_mod, backend="numba", deterministic=True)
            for _ in range(2)]
    _check("numba deterministic", runs[0], want, "float32", rows)
    for name, a, b in zip(("dq", "dk", "dv", "daux"), (*runs[0][2], runs[0][3][0]),
                          (*runs[1][2], runs[1][3][0])):
        assert a.numpy().tobytes() == b.numpy().tobytes(), f"deterministic {name} differs"
