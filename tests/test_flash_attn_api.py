"""`varlen.torch.flash_attn_varlen_func` / `flash_attn_func`: FlashAttention 2's contract.

The varlen cases are FlashAttention 2's own `test_flash_attn_varlen_output` parameter sets
(tests/test_flash_attn.py: its eleven (seqlen_q, seqlen_k) mixes, its head dims 32..256,
causal, local windows drawn in [0, seqlen_k), MHA/MQA/GQA, float16/bfloat16, softcap 50 with
q scaled by it, deterministic, random per-sequence lengths in [seqlen - 20, seqlen]), sampled
rather than crossed, plus float32. Each is checked, forward and backward, against the float64
reference with the mask written out independently of the code under test: bottom-right
aligned, `[i + Lk - Lq - left, i + Lk - Lq + right]`.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import varlen.torch as vt  # noqa: E402
from varlen import Mask  # noqa: E402

from helpers import Batch, check_against_reference, np_dtype  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# (seqlen_q, seqlen_k, d, causal, local, mha_type, dtype, softcap, deterministic)
FA2_VARLEN_CASES = [
    (1, 147, 256, True, True, "gqa", "bfloat16", 50.0, True),
    (1, 147, 32, False, False, "mha", "float16", 0.0, False),
    (113, 203, 224, False, True, "mqa", "float16", 50.0, False),
    (113, 203, 59, True, False, "gqa", "bfloat16", 0.0, False),
    (128, 217, 192, False, False, "gqa", "bfloat16", 0.0, False),
    (128, 217, 64, True, True, "mqa", "float16", 0.0, True),
    (113, 211, 160, True, False, "mha", "float16", 50.0, False),
    (113, 211, 80, False, True, "mha", "bfloat16", 0.0, False),
    (108, 256, 111, False, False, "mqa", "bfloat16", 50.0, True),
    (108, 256, 96, True, True, "gqa", "float16", 0.0, False),
    (256, 512, 128, True, False, "mqa", "bfloat16", 0.0, False),
    (256, 512, 59, False, True, "gqa", "float16", 0.0, False),
    (512, 256, 64, True, False, "gqa", "float16", 50.0, False),
    (512, 256, 111, False, True, "mha", "bfloat16", 0.0, True),
    (1024, 1024, 32, True, False, "mqa", "bfloat16", 0.0, False),
    (1024, 1024, 64, False, True, "mha", "float16", 0.0, False),
    (1023, 1024, 64, True, True, "mha", "float16", 0.0, False),
    (1023, 1024, 32, False, False, "mqa", "bfloat16", 50.0, False),
    (1024, 1023, 32, True, False, "mqa", "float16", 50.0, False),
    (1024, 1023, 59, False, True, "mha", "bfloat16", 0.0, False),
    (2048, 2048, 32, True, True, "mqa", "bfloat16", 0.0, False),
    # FlashAttention has no float32 path; varlen's contract includes it.
    (113, 203, 64, True, True, "gqa", "float32", 0.0, False),
    (512, 256, 32, False, False, "mqa", "float32", 50.0, False),
]


def case_id(case):
    sq, sk, d, causal, local, mha, dtype, softcap, det = case
    flags = [f for f, on in (("causal", causal), ("local", local), ("softcap", softcap),
                             ("det", det)) if on]
    return "-".join([f"q{sq}-k{sk}-d{d}", mha, dtype, *flags])


def test_cases_cover_flash_attention_parameter_values():
    columns = list(zip(*FA2_VARLEN_CASES))
    assert set(zip(columns[0], columns[1])) == {
        (1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
        (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)}
    assert set(columns[2]) == {32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256}
    for values, want in zip(columns[3:], ({False, True}, {False, True}, {"mha", "mqa", "gqa"},
                                          {"float16", "bfloat16", "float32"}, {0.0, 50.0},
                                          {False, True})):
        assert set(values) == want


def to_np(t, dtype):
    return t.detach().float().numpy().astype(np_dtype(dtype))


def fa2_inputs(case, seed=0):
    """Packed q, k, v, dout and cu_seqlens drawn the way FlashAttention 2's varlen test draws
    them, with a smaller batch (4 sequences and 6 heads there) so that the float64 reference
    stays quick on a CPU: 2 sequences of 4 heads, 1 of 4 from 512 rows, 1 of 2 from 1024."""
    sq, sk, d, causal, local, mha, dtype, softcap, _ = case
    g = torch.Generator().manual_seed(seed)
    longest = max(sq, sk)
    batch = 2 if longest <= 256 else 1
    nheads = 4 if longest <= 512 else 2
    nheads_k = {"mha": nheads, "mqa": 1, "gqa": 2}[mha]
    lq = torch.randint(max(1, sq - 20), sq + 1, (batch,), generator=g)
    lk = torch.randint(max(1, sk - 20), sk + 1, (batch,), generator=g)
    window = torch.randint(0, sk, (2,), generator=g).tolist() if local else [-1, -1]
    dt = DTYPES[dtype]
    q = torch.randn(int(lq.sum()), nheads, d, generator=g).to(dt)
    if softcap > 0:     # as FlashAttention's test: scores reach into the softcap's range
        q = (q * softcap).to(dt)
    k, v = (torch.randn(int(lk.sum()), nheads_k, d, generator=g).to(dt) for _ in range(2))
    dout = torch.randn(q.shape, generator=g).to(dt)
    cu = [torch.nn.functional.pad(x.cumsum(0), (1, 0)).to(torch.int32) for x in (lq, lk)]
    return q, k, v, dout, cu, (int(lq.max()), int(lk.max())), window


@pytest.mark.parametrize("case", [
    pytest.param(c, id=case_id(c), marks=[pytest.mark.slow] if max(c[:2]) >= 1024 else [])
    for c in FA2_VARLEN_CASES])
def test_flash_attention2_varlen_cases(case):
    sq, sk, d, causal, local, mha, dtype, softcap, deterministic = case
    q, k, v, dout, (cu_q, cu_k), (max_q, max_k), window = fa2_inputs(case)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse, probs = vt.flash_attn_varlen_func(
        *leaves, cu_q, cu_k, max_q, max_k, 0.0, causal=causal, window_size=window,
        softcap=softcap, deterministic=deterministic, return_attn_probs=True)
    assert probs is None
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    out.backward(dout)
    grads = [x.grad for x in leaves]

    left, right = window
    mask = Mask(window_left=left, window_right=0 if causal else right, bottom_right=True)
    batch = Batch(*(to_np(x, dtype) for x in (q, k, v)), cu_q.numpy(), cu_k.numpy(), mask=mask,
                  dtype=dtype, dout=to_np(dout, dtype))
    check_against_reference(batch, out.float().detach().numpy(), lse.numpy(),
                            [g.double().numpy() for g in grads], softcap=softcap,
                            label=case_id(case))
    if deterministic:
        again = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        vt.flash_attn_varlen_func(*again, cu_q, cu_k, max_q, max_k, causal=causal,
                                  window_size=window, softcap=softcap,
                                  deterministic=True).backward(dout)
        for name, g, h in zip(("dq", "dk", "dv"), grads, (x.grad for x in again)):
            assert torch.equal(g, h), f"{name} differs between two deterministic runs"


# --------------------------------------------------------------------------------------------
# The visible keys, read off the output: with q = 0 every visible key gets the same weight,
# and v = one-hot(key index) makes out[i, j] = 1 / (number visible) exactly where i sees j.
# --------------------------------------------------------------------------------------------

def visible(lq, lk, **kw):
    q = torch.zeros(lq, 1, 8, dtype=torch.float64)
    k = torch.zeros(lk, 1, 8, dtype=torch.float64)
    v = torch.eye(lk, dtype=torch.float64)[:, None, :]
    cu_q = torch.tensor([0, lq], dtype=torch.int32)
    cu_k = torch.tensor([0, lk], dtype=torch.int32)
    out, lse, _ = vt.flash_attn_varlen_func(q, k, v, cu_q, cu_k, lq, lk, return_attn_probs=True,
                                            **kw)
    seen = out[:, 0, :] > 0
    assert torch.equal(torch.isneginf(lse[0]), ~seen.any(1)), "lse -inf exactly on empty rows"
    assert (out[~seen.any(1)] == 0).all(), "rows that see no key must be 0"
    return seen


def drawn(picture):
    return torch.tensor([[c == "x" for c in row.split()] for row in picture.strip().split("\n")])


@pytest.mark.parametrize("lq,lk,kw,picture", [
    # FlashAttention's docstring: causal aligned to the bottom-right corner.
    (2, 5, dict(causal=True), """
        x x x x .
        x x x x x"""),
    (5, 2, dict(causal=True), """
        . .
        . .
        . .
        x .
        x x"""),
    (3, 5, dict(window_size=(1, 0)), """
        . x x . .
        . . x x .
        . . . x x"""),
    (3, 5, dict(causal=True, window_size=(1, 1)), """
        . x x . .
        . . x x .
        . . . x x"""),
    (5, 3, dict(window_size=(0, 1)), """
        . . .
        x . .
        x x .
        . x x
        . . x"""),
    (4, 4, dict(window_size=(-1, 1)), """
        x x . .
        x x x .
        x x x x
        x x x x"""),
], ids=["causal-q2-k5", "causal-q5-k2", "window-1-0-q3-k5", "causal-window-1-1-q3-k5",
        "window-0-1-q5-k3", "window-inf-1-q4-k4"])
def test_visibility_as_drawn(lq, lk, kw, picture):
    assert torch.equal(visible(lq, lk, **kw), drawn(picture))


@pytest.mark.parametrize("seed", range(4))
def test_windows_against_flash_attention_formula(seed):
    rng = np.random.default_rng(seed)
    for _ in range(6):
        lq, lk = (int(x) for x in rng.integers(1, 12, 2))
        left, right = (int(x) for x in rng.integers(-1, 6, 2))
        causal = bool(rng.integers(2))
        hi_side = 0 if causal else right
        want = torch.tensor([[(left < 0 or j >= i + lk - lq - left)
                              and (hi_side < 0 or j <= i + lk - lq + hi_side)
                              for j in range(lk)] for i in range(lq)])
        got = visible(lq, lk, causal=causal, window_size=(left, right))
        assert torch.equal(got, want), f"{lq=} {lk=} {left=} {right=} {causal=}"


# --------------------------------------------------------------------------------------------
# flash_attn_func, return values, unsupported arguments
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0)),
                                           (False, (2, 1))])
def test_flash_attn_func_is_the_varlen_call_per_row(causal, window):
    g = torch.Generator().manual_seed(1)
    B, Sq, Sk, Hq, Hk, D = 3, 7, 10, 4, 2, 16
    q = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Sk, Hk, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Sk, Hk, D, generator=g, dtype=torch.float64, requires_grad=True)
    out, lse, _ = vt.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=5.0,
                                     softmax_scale=0.3, return_attn_probs=True)
    assert out.shape == (B, Sq, Hq, D) and lse.shape == (B, Hq, Sq)
    for b in range(B):
        cu_q = torch.tensor([0, Sq], dtype=torch.int32)
        cu_k = torch.tensor([0, Sk], dtype=torch.int32)
        o, l, _ = vt.flash_attn_varlen_func(q[b], k[b], v[b], cu_q, cu_k, Sq, Sk, causal=causal,
                                            window_size=window, softcap=5.0, softmax_scale=0.3,
                                            return_attn_probs=True)
        torch.testing.assert_close(out[b], o, rtol=0, atol=1e-12, msg=f"out of row {b}")
        torch.testing.assert_close(lse[b], l, rtol=0, atol=1e-12, msg=f"lse of row {b}")
    out.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v))


def test_returns_out_alone_and_lse_without_gradient():
    q = torch.randn(5, 2, 8, requires_grad=True)
    k = torch.randn(6, 1, 8, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 6],
                                                                          dtype=torch.int32)
    out = vt.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 4, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == (5, 2, 8)
    _, lse, _ = vt.flash_attn_varlen_func(q, k, k, cu_q, cu_k, torch.tensor(3), torch.tensor(4),
                                          return_attn_probs=True)
    assert lse.shape == (2, 5) and not lse.requires_grad


@pytest.mark.parametrize("fn", ["varlen", "padded"])
def test_dropout_with_attn_probs_is_not_implemented(fn):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="return_attn_probs=True with dropout_p=0.17"):
        if fn == "padded":
            vt.flash_attn_func(q, q, q, dropout_p=0.17, return_attn_probs=True)
        else:
            cu = torch.tensor([0, 4], dtype=torch.int32)
            vt.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, dropout_p=0.17,
                                      return_attn_probs=True)


@pytest.mark.parametrize("window", [(1,), 3, (1.5, 0), None])
def test_window_size_must_be_two_ints(window):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="window_size"):
        vt.flash_attn_func(q, q, q, window_size=window)


def test_flash_attn_func_names_bad_shapes():
    q = torch.randn(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"k must be a 4-D tensor"):
        vt.flash_attn_func(q, q[0], q)
    with pytest.raises(ValueError, match="disagree on batch or seqlen"):
        vt.flash_attn_func(q, q, q[:, :3])
