"""Dropout through the PyTorch adapter (`varlen.torch.varlen_attention`) and FlashAttention 2's
drop-in functions: the same pairs as the core API for a given seed, gradients by autograd
against finite differences and the float64 reference, seeds drawn from torch's generator, and
the arguments it refuses."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import varlen  # noqa: E402
import varlen.torch as vt  # noqa: E402
from helpers import check_against_reference, make_batch  # noqa: E402

pytestmark = pytest.mark.quick

SEED = 0xFEDC_BA98_7654_3210         # above 2**63: the op's signed int carries it whole


def _torch(x, requires_grad=False):
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.requires_grad_(requires_grad) if requires_grad else t


def _run(batch, fn, **kw):
    q, k, v = (_torch(x, True) for x in (batch.q, batch.k, batch.v))
    out = fn(q, k, v, **kw)
    out.backward(_torch(batch.dout))
    return out.detach().numpy(), [x.grad.numpy() for x in (q, k, v)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_varlen_attention_matches_the_reference(dtype):
    rng = np.random.default_rng(4)
    bt = make_batch(rng, [0, 33, 1, 70], [2, 40, 1, 70], Hq=4, Hk=2, D=16, dtype=dtype,
                    mask="causal", gaps=True)
    kw = dict(seq_offsets_q=_torch(bt.off_q), seq_offsets_k=_torch(bt.off_k), mask="causal",
              dropout_p=0.3, seed=SEED, offset=2)
    q, k, v = (_torch(x, True) for x in (bt.q, bt.k, bt.v))
    out, lse = vt.varlen_attention(q, k, v, _torch(bt.cu_q), _torch(bt.cu_k), return_lse=True,
                                   **kw)
    out.backward(_torch(bt.dout))
    check_against_reference(bt, out.detach().numpy(), lse.numpy(),
                            [x.grad.numpy() for x in (q, k, v)], dropout_p=0.3, seed=SEED,
                            offset=2, label=f"torch {dtype}")


def test_gradcheck_float64_with_dropout():
    rng = np.random.default_rng(2)
    bt = make_batch(rng, [3, 0, 1, 6], [2, 0, 3, 6], Hq=2, Hk=1, D=4, gaps=True)
    q, k, v = (_torch(x, True) for x in (bt.q, bt.k, bt.v))
    with torch.no_grad():                  # padding rows at a normal scale for finite differences
        for x in (q, k, v):
            x.clamp_(-3, 3)
    args = (_torch(bt.cu_q), _torch(bt.cu_k))
    kw = dict(seq_offsets_q=_torch(bt.off_q), seq_offsets_k=_torch(bt.off_k),
              mask="causal_bottom_right", dropout_p=0.5, seed=7)
    assert torch.autograd.gradcheck(lambda q, k, v: vt.varlen_attention(q, k, v, *args, **kw),
                                    (q, k, v), eps=1e-6, atol=1e-7)


def test_same_pairs_as_the_core_api():
    rng = np.random.default_rng(1)
    bt = make_batch(rng, [20, 45], [30, 45], Hq=2, Hk=2, D=8, dtype="float32")
    kw = dict(mask="causal_bottom_right", dropout_p=0.2, seed=SEED)
    core, _ = varlen.attention_forward(bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k, **kw)
    via = vt.varlen_attention(*(_torch(x) for x in (bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k)), **kw)
    assert np.array_equal(via.numpy(), core)
    fa = vt.flash_attn_varlen_func(*(_torch(x) for x in (bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k)),
                                   45, 45, dropout_p=0.2, causal=True, seed=SEED)
    assert np.array_equal(fa.numpy(), core), "flash_attn_varlen_func draws other pairs"


def test_seed_drawn_from_torch_generator():
    rng = np.random.default_rng(0)
    bt = make_batch(rng, [16, 9], Hq=2, Hk=1, D=8, dtype="float32")
    args = [_torch(x) for x in (bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k)]
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(vt.varlen_attention(*args, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    torch.manual_seed(3)
    a = vt.flash_attn_varlen_func(*args, 16, 16, dropout_p=0.5, deterministic=True)
    torch.manual_seed(3)
    b = vt.flash_attn_varlen_func(*args, 16, 16, dropout_p=0.5, deterministic=True)
    assert torch.equal(a, b)


def test_backward_draws_the_forward_pairs():
    """The gradient of a call is that of the same seed's forward, checked through the
    reference; and one call's backward after another call with a new seed still uses its own
    (the seed travels with the autograd node, nothing [rows, keys] is kept)."""
    rng = np.random.default_rng(9)
    bt = make_batch(rng, [12, 25], Hq=2, Hk=1, D=8, dtype="float64")
    cu = _torch(bt.cu_q)
    q, k, v = (_torch(x, True) for x in (bt.q, bt.k, bt.v))
    torch.manual_seed(5)
    first = vt.varlen_attention(q, k, v, cu, cu, dropout_p=0.4)
    torch.manual_seed(5)
    seed = vt.draw_seed()
    vt.varlen_attention(q, k, v, cu, cu, dropout_p=0.4).sum()     # another draw, not used
    first.backward(_torch(bt.dout))
    ref = varlen.reference.attention_dense_backward(bt.dout, bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k,
                                                    dropout_p=0.4, seed=seed)
    for name, x, r in zip("qkv", (q, k, v), ref):
        assert np.allclose(x.grad.numpy(), r, atol=1e-10), f"d{name}"


def test_padded_flash_attn_func_with_dropout():
    rng = np.random.default_rng(6)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 9, 2, 8)).astype(np.float32))
               for _ in range(3))
    out = vt.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, seed=11)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    want = vt.varlen_attention(q.reshape(18, 2, 8), k.reshape(18, 2, 8), v.reshape(18, 2, 8),
                               cu, cu, mask="causal", dropout_p=0.3, seed=11)
    assert torch.equal(out.reshape(18, 2, 8), want)


def test_opcheck_with_dropout():
    """Schema, fake and real implementations agree with dropout on (the seed above 2**63 as
    the op's signed int)."""
    from varlen._torch_ops import _META_NAMES, _seed_arg
    rng = np.random.default_rng(8)
    bt = make_batch(rng, [5, 0, 9], Hq=4, Hk=2, D=8, dtype="float32")
    meta = dict(cu_seqlens_q=_torch(bt.cu_q), cu_seqlens_k=_torch(bt.cu_k), seq_offsets_q=None,
                seq_offsets_k=None, window_left=None, window_right=None, bottom_right=None,
                window_left_int=-1, window_right_int=0, bottom_right_int=0,
                softmax_scale=None, softcap=0.0, max_seqlen_q=None, max_seqlen_k=None,
                backend=None, deterministic=False, plan=0, mask_mod=None, mask_aux=None,
                score_mod=None, score_aux=None, sinks=None, dropout_p=0.25,
                seed=_seed_arg(SEED), offset=4)
    meta = [meta[name] for name in _META_NAMES]
    x = [_torch(a, True) for a in (bt.q, bt.k, bt.v)]
    result = torch.library.opcheck(torch.ops.varlen.attention_forward.default, (*x, *meta))
    assert all(r == "SUCCESS" for r in result.values()), ("forward", result)
    out, lse = torch.ops.varlen.attention_forward(*x, *meta)
    want, _ = varlen.attention_forward(bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k, mask="causal",
                                       dropout_p=0.25, seed=SEED, offset=4)
    assert np.array_equal(out.detach().numpy(), want)
    args = (_torch(bt.dout), *(a.detach() for a in x), out.detach(), lse.detach(), *meta)
    result = torch.library.opcheck(torch.ops.varlen.attention_backward.default, args)
    assert all(r == "SUCCESS" for r in result.values()), ("backward", result)


BAD = [
    (dict(dropout_p=1.5), ValueError, "dropout_p"),
    (dict(dropout_p=float("nan")), ValueError, "dropout_p"),
    (dict(dropout_p=0.1, seed=2.0), TypeError, "seed"),
    (dict(dropout_p=0.1, seed=-3), ValueError, "seed"),
    (dict(dropout_p=0.1, offset=-1), ValueError, "offset"),
    (dict(dropout_p=0.1, deterministic=True), ValueError, "seed is required"),
]


@pytest.mark.parametrize("kw, error, says", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input(kw, error, says):
    q = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(error, match=says):
        vt.varlen_attention(q, q, q, cu, cu, **kw)
    if "deterministic" not in kw and "offset" not in kw:
        with pytest.raises(error, match=says):
            vt.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, **kw)
