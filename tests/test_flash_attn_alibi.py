"""`alibi_slopes` of `varlen.torch.flash_attn_varlen_func` / `flash_attn_func` against a dense
float64 computation of FlashAttention 2's formula, written out here independently of the code
under test: the score of query i and key j gets `-slope * |i + Lk - Lq - j|` after the softmax
scale (and softcap), with per-sequence lengths, causal or not, slopes `[H]` or `[B, H]`."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import varlen.torch as vt  # noqa: E402


def _dense(q, k, v, cu_q, cu_k, slopes, causal, window=(-1, -1), softcap=0.0, scale=None,
           row_bias=False):
    """`(out, lse)` of FlashAttention 2 with ALiBi, in float64 with autograd.

    `row_bias`: FlashAttention's own test reference for causal calls, `slope * (j - Lk + 1)`
    (the same bias up to a constant per row).
    """
    Hq, D = q.shape[1], q.shape[2]
    scale = D ** -0.5 if scale is None else scale
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qb, kb, vb = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        Lq, Lk = qb.shape[0], kb.shape[0]
        rep = Hq // kb.shape[1]
        s = torch.einsum("ihd,jhd->hij", qb, kb.repeat_interleave(rep, 1)) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        slope = (slopes[b] if slopes.dim() == 2 else slopes).double()[:, None, None]
        if row_bias:
            s = s + slope * (j - Lk + 1)
        else:
            s = s - slope * (i + Lk - Lq - j).abs()
        left, right = window[0], 0 if causal else window[1]
        visible = torch.ones(Lq, Lk, dtype=torch.bool)
        if left >= 0:
            visible &= j >= i + Lk - Lq - left
        if right >= 0:
            visible &= j <= i + Lk - Lq + right
        s = s.masked_fill(~visible, -torch.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.masked_fill(lse.isinf(), 0)[..., None])
        outs.append(torch.einsum("hij,jhd->ihd", p, vb.repeat_interleave(rep, 1)))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def _data(lengths_q, lengths_k, Hq, Hk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32)
                  for x in (lengths_q, lengths_k))
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=g, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), Hk, D, generator=g, dtype=dtype)
    v = torch.randn(int(cu_k[-1]), Hk, D, generator=g, dtype=dtype)
    do = torch.randn(int(cu_q[-1]), Hq, D, generator=g, dtype=dtype)
    return q, k, v, do, cu_q, cu_k


def _slopes(per, B, H):
    base = 2.0 ** -torch.arange(1, H + 1, dtype=torch.float32)
    return base if per == "head" else base * torch.linspace(0.5, 2.0, B)[:, None]


def _compare(label, got, want, dtype):
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m: f"{label} {name}: {m}")


# (causal, per-head or per-sequence slopes, dtype, window, softcap)
VARLEN_CASES = [
    (False, "head", torch.float64, (-1, -1), 0.0),
    (True, "head", torch.float64, (-1, -1), 0.0),
    (False, "batch", torch.float64, (-1, -1), 0.0),
    (True, "batch", torch.float32, (4, -1), 0.0),
    (False, "head", torch.float32, (3, 2), 5.0),
]


@pytest.mark.parametrize("causal,per,dtype,window,softcap", VARLEN_CASES, ids=[
    "-".join(filter(None, ["causal" if c else "full", f"slopes-per-{p}", str(d)[6:],
                           "window" if w != (-1, -1) else "", "softcap" if s else ""]))
    for c, p, d, w, s in VARLEN_CASES])
def test_varlen_matches_flash_attention_2_formula(causal, per, dtype, window, softcap):
    # Lq != Lk both ways, a zero-length sequence, a query longer than its keys
    lengths_q, lengths_k = [3, 0, 17, 1, 9], [5, 0, 11, 8, 9]
    q, k, v, do, cu_q, cu_k = _data(lengths_q, lengths_k, 4, 2, 16, dtype)
    slopes = _slopes(per, len(lengths_q), 4)
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse, _ = vt.flash_attn_varlen_func(*x, cu_q, cu_k, 17, 11, causal=causal,
                                            window_size=window, softcap=softcap,
                                            alibi_slopes=slopes, return_attn_probs=True)
    out.backward(do)
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    want, want_lse = _dense(*ref, cu_q, cu_k, slopes, causal, window, softcap)
    want.backward(do.double())
    label = f"causal={causal} slopes per {per}"
    _compare(label, (out, *(t.grad for t in x)), (want, *(t.grad for t in ref)), dtype)
    finite = want_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite), f"{label}: rows with no visible key"
    torch.testing.assert_close(lse[finite].double(), want_lse[finite], rtol=1e-5, atol=1e-5)


def test_causal_output_is_that_of_flash_attention_2_s_test_reference():
    """FlashAttention 2's tests (and its causal kernel) add a bias that differs by a constant
    per row, `slope * (j - Lk + 1)`: the same softmax, so the same output and gradients."""
    q, k, v, do, cu_q, cu_k = _data([6, 13], [9, 13], 2, 1, 8, torch.float64)
    slopes = _slopes("head", 2, 2)
    out = vt.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 13, causal=True,
                                    alibi_slopes=slopes)
    want, _ = _dense(q, k, v, cu_q, cu_k, slopes, True, row_bias=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("per", ["head", "batch"])
def test_padded_batch_with_fewer_queries_than_keys(causal, per):
    B, Sq, Sk, H = 3, 5, 12, 2
    q, k, v, do, cu_q, cu_k = _data([Sq] * B, [Sk] * B, H, H, 8, torch.float64, seed=1)
    slopes = _slopes(per, B, H)
    x = [t.clone().view(B, -1, *t.shape[1:]).requires_grad_(True) for t in (q, k, v)]
    out = vt.flash_attn_func(*x, causal=causal, alibi_slopes=slopes)
    out.backward(do.view(B, Sq, H, 8))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want, _ = _dense(*ref, cu_q, cu_k, slopes, causal)
    want.backward(do)
    _compare(f"padded {per}", (out.reshape(-1, H, 8), *(t.grad.reshape(-1, H, 8) for t in x)),
             (want, *(t.grad for t in ref)), torch.float64)


def test_slopes_get_no_gradient_as_in_flash_attention():
    q, k, v, do, cu_q, cu_k = _data([4, 6], [4, 6], 2, 2, 8, torch.float32)
    slopes = _slopes("head", 2, 2).requires_grad_(True)
    q.requires_grad_(True)
    out = vt.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, alibi_slopes=slopes)
    out.backward(do)
    assert q.grad is not None and slopes.grad is None


def test_compile_fullgraph_new_slopes_without_recompiling():
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    q, k, v, do, cu_q, cu_k = _data([7, 2, 11], [9, 2, 11], 4, 2, 8, torch.float32)

    def fn(q, k, v, cu_q, cu_k, slopes):
        return vt.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 11, causal=True,
                                         alibi_slopes=slopes)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for seed in range(2):
        slopes = torch.rand(4, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(compiled(q, k, v, cu_q, cu_k, slopes),
                                   fn(q, k, v, cu_q, cu_k, slopes))
    assert counter.frame_count == 1


@pytest.mark.parametrize("slopes,err,match", [
    (torch.ones(3), ValueError, r"alibi_slopes has shape \(3,\); expected \(2,\) or \(1, 2\)"),
    (torch.ones(2, dtype=torch.float64), TypeError, "alibi_slopes must be float32"),
    (np.ones(2, np.float32), TypeError, "alibi_slopes must be a torch.Tensor"),
], ids=["shape", "dtype", "numpy"])
def test_bad_slopes_are_named(slopes, err, match):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(err, match=match):
        vt.flash_attn_func(q, q, q, alibi_slopes=slopes)
