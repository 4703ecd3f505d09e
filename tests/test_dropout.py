"""Attention dropout (`varlen.dropout`): the Philox 4x32-10 generator against Random123's
known answers, the documented keep rule, the keep set every host backend draws (bitwise the
reference's), forward and gradients against the float64 reference, seeds, statistics, the
backends that refuse it and bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest

import varlen
from helpers import check_against_reference, fwd_bwd, make_batch
from varlen import backends
from varlen.dropout import SEQ_MIX, keep_bits, make_dropout, philox4x32_10
from varlen.reference import dropout_keep

pytestmark = pytest.mark.quick

HOST = ["numpy", "cpu"]
SEED = 0x1234_5678_9ABC_DEF0          # both 32-bit halves non-zero


# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter[4], key[2] -> out[4].
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("ctr, key, want", KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(ctr, key, want):
    got = tuple(int(w) for w in philox4x32_10(*ctr, *key))
    assert got == want, f"philox4x32_10({ctr}, {key}) = {[hex(w) for w in got]}"


def test_cpu_kernels_record_the_shared_philox_source():
    """The cpu kernels' disk cache is keyed on `_cpu_kernels.py` alone: the digest it records of
    `_philox.py` must be that file's, so an edit of the shared rounds reaches the cached kernels."""
    import hashlib
    from varlen.backends import _cpu_kernels as K, _philox
    with open(_philox.__file__, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    assert K.PHILOX_SOURCE_SHA256 == digest, (
        f"_philox.py changed (sha256 {digest}): set _cpu_kernels.PHILOX_SOURCE_SHA256 to it")


def test_cpu_kernels_philox_known_answers():
    from varlen.backends import _cpu_kernels as K
    for ctr, key, want in KAT:
        W = np.zeros((4, 1), np.uint32)
        ks0, ks1 = K.philox_keys(np.uint64(key[0]), np.uint64(key[1]))
        K.philox_words(W, np.uint32(ctr[0]), np.array([ctr[1]], np.uint32),
                       np.array([ctr[2]], np.uint32), np.uint32(ctr[3]), ks0, ks1)
        assert tuple(int(w) for w in W[:, 0]) == want, f"cpu kernels' Philox of {ctr}, {key}"


def test_keep_rule_as_documented():
    """docs/semantics.md, "Dropout": counter (k >> 2, q, h, offset), key (seed lo,
    seed hi ^ b * SEQ_MIX mod 2^32), word k & 3, keep iff word >= round(p * 2^32)."""
    d = make_dropout(0.3, SEED, 7)
    threshold = round(0.3 * 2 ** 32)
    for b, h, q, k in [(0, 0, 0, 0), (1, 3, 17, 5), (6, 1, 1000, 1023), (2**20, 7, 3, 2**20 + 2)]:
        key1 = (SEED >> 32) ^ ((b * SEQ_MIX) % 2 ** 32)
        words = philox4x32_10(k >> 2, q, h, 7, SEED & 0xFFFFFFFF, key1)
        assert bool(d.keep(b, h, q, k)) == (int(words[k & 3]) >= threshold), (b, h, q, k)


def _onehot_batch(rng, lengths_q, lengths_k, Hq, Hk, gaps, dtype="float32"):
    """A batch whose attention output shows the kept pairs: q = 0 (every visible key equally
    likely) and v one-hot at each key's position in its sequence, so out[i, h, j] != 0 iff
    query i keeps key j at head h."""
    bt = make_batch(rng, lengths_q, lengths_k, Hq=Hq, Hk=Hk, D=8, Dv=max(lengths_k), dtype=dtype,
                    gaps=gaps)
    bt.q[...] = 0
    bt.v[...] = 0
    off_k = bt.cu_k if bt.off_k is None else bt.off_k
    for b, L in enumerate(lengths_k):
        bt.v[off_k[b] + np.arange(L), :, np.arange(L)] = 1
    return bt


KEEP_CASES = [
    pytest.param([0, 1, 70, 3, 130, 0], [5, 1, 70, 129, 140, 0], "full", True,
                 id="B6-zero-one-ragged-gaps-full"),
    pytest.param([64, 200, 1], [200, 64, 1], "causal_bottom_right", False,
                 id="B3-tiles-crossing-causal-br"),
]


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("lq, lk, mask, gaps", KEEP_CASES)
def test_keep_set_is_the_reference_bitwise(backend, lq, lk, mask, gaps):
    rng = np.random.default_rng(5)
    Hq, Hk = 4, 2
    bt = _onehot_batch(rng, lq, lk, Hq, Hk, gaps)
    p = 0.37
    out, _ = varlen.attention_forward(bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k,
                                      seq_offsets_q=bt.off_q, seq_offsets_k=bt.off_k, mask=mask,
                                      backend=backend, dropout_p=p, seed=SEED, offset=3)
    keep = dropout_keep(bt.cu_q, bt.cu_k, Hq, p, SEED, offset=3)
    seen = varlen.reference.sequence_masks(bt.cu_q, bt.cu_k, mask)
    off_q = bt.cu_q if bt.off_q is None else bt.off_q
    for b, (L, M) in enumerate(zip(lq, lk)):
        got = np.asarray(out[off_q[b]:off_q[b] + L, :, :M]).transpose(1, 0, 2) != 0
        want = keep[b] & seen[b][None]
        assert got.shape == want.shape
        assert np.array_equal(got, want), (
            f"{backend}: sequence {b} keeps {np.argwhere(got != want)[:5]} otherwise than "
            f"reference.dropout_keep")


FB_CASES = [
    pytest.param("numpy", "float64", [0, 37, 1, 100], [3, 37, 1, 90], "causal", True,
                 id="numpy-f64-B4-causal-gaps"),
    pytest.param("cpu", "float32", [0, 37, 1, 300], [3, 37, 1, 290], "causal_bottom_right", True,
                 id="cpu-f32-B4-causal-br-gaps"),
    pytest.param("cpu", "bfloat16", [65, 0, 129], [130, 0, 129], "full", False,
                 id="cpu-bf16-B3-full"),
]


@pytest.mark.parametrize("backend, dtype, lq, lk, mask, gaps", FB_CASES)
def test_forward_and_gradients_match_the_reference(backend, dtype, lq, lk, mask, gaps):
    rng = np.random.default_rng(11)
    bt = make_batch(rng, lq, lk, Hq=6, Hk=2, D=16, Dv=12, dtype=dtype, mask=mask, gaps=gaps)
    kw = dict(dropout_p=0.25, seed=SEED, offset=1)
    out, lse, grads = fwd_bwd(bt, backend=backend, **kw)
    check_against_reference(bt, out, lse, grads, label=f"{backend} {dtype}", **kw)


def test_the_reference_gradients_are_those_of_its_forward():
    """Finite differences of the dense reference with dropout (the keep set is fixed by the
    seed, so the output is a smooth function of q, k and v)."""
    rng = np.random.default_rng(3)
    bt = make_batch(rng, [5, 0, 9], [7, 2, 9], Hq=2, Hk=1, D=4, mask="causal_bottom_right")
    kw = dict(mask=bt.mask, dropout_p=0.4, seed=SEED)
    grads = varlen.reference.attention_dense_backward(bt.dout, bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k,
                                                      **kw)
    eps = 1e-6
    for name, x, g in zip("qkv", (bt.q, bt.k, bt.v), grads):
        for idx in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(6)]:
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args = {name: xp}
            fp = (varlen.reference.attention_dense(**{"q": bt.q, "k": bt.k, "v": bt.v, **args},
                                                   cu_seqlens_q=bt.cu_q, cu_seqlens_k=bt.cu_k,
                                                   **kw)[0] * bt.dout).sum()
            args = {name: xm}
            fm = (varlen.reference.attention_dense(**{"q": bt.q, "k": bt.k, "v": bt.v, **args},
                                                   cu_seqlens_q=bt.cu_q, cu_seqlens_k=bt.cu_k,
                                                   **kw)[0] * bt.dout).sum()
            fd = (fp - fm) / (2 * eps)
            assert abs(fd - g[idx]) <= 1e-6 * (1 + abs(fd)), f"d{name}{idx}: {g[idx]} vs {fd}"


@pytest.mark.parametrize("backend", HOST)
def test_seeds_repeat_and_differ(backend):
    rng = np.random.default_rng(2)
    bt = make_batch(rng, [40, 0, 77], [50, 3, 77], Hq=4, Hk=4, D=16, dtype="float32",
                    mask="causal", gaps=True)
    base = fwd_bwd(bt, backend=backend, dropout_p=0.2, seed=SEED)
    again = fwd_bwd(bt, backend=backend, dropout_p=0.2, seed=SEED)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*base[:2], *base[2]),
                          (*again[:2], *again[2])):
        assert np.array_equal(a, b, equal_nan=True), f"{name} differs with the same seed"
    for other in (dict(seed=SEED + 1), dict(seed=SEED, offset=1)):
        out = fwd_bwd(bt, backend=backend, dropout_p=0.2, **other)[0]
        assert not np.array_equal(out, base[0]), f"{other} gives the same output"
    plain = fwd_bwd(bt, backend=backend)
    zero = fwd_bwd(bt, backend=backend, dropout_p=0.0, seed=SEED)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*plain[:2], *plain[2]),
                          (*zero[:2], *zero[2])):
        assert np.array_equal(a, b, equal_nan=True), f"dropout_p=0 changes {name}"
    assert not np.array_equal(base[0], plain[0]), "dropout_p=0.2 changes nothing"
    assert np.array_equal(base[1], plain[1]), "lse is not that of the softmax without dropout"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_and_independence(p):
    """About 1 - p of the pairs are kept (within 5 sigma), in every sequence and head alike,
    and the bits of two sequences (or two heads) at the same positions are independent."""
    keep = dropout_keep(np.array([0, 300, 600]), np.array([0, 300, 600]), 2, p, SEED)
    n = keep[0].size
    for b, kb in enumerate(keep):
        for h in range(2):
            frac = kb[h].mean()
            sigma = math.sqrt(p * (1 - p) / kb[h].size)
            assert abs(frac - (1 - p)) < 5 * sigma, f"b{b} h{h} keeps {frac:.4f}"
    for a, b in ((keep[0][0], keep[1][0]), (keep[0][0], keep[0][1])):
        both = (a & b).mean()
        sigma = math.sqrt((1 - p) ** 2 * (1 - (1 - p) ** 2) / (n / 2))
        assert abs(both - (1 - p) ** 2) < 5 * sigma, f"correlated bits: {both:.4f}"


def test_output_is_unbiased():
    """With v = 1 every output is sum_j P_ij keep_ij / (1 - p): 1 on average."""
    rng = np.random.default_rng(0)
    bt = make_batch(rng, [256] * 4, Hq=4, Hk=1, D=8, Dv=1)
    bt.v[...] = 1
    out, _ = varlen.attention_forward(bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k, backend="numpy",
                                      dropout_p=0.3, seed=SEED)
    assert abs(out.mean() - 1) < 0.01, f"mean output {out.mean():.4f}"


@pytest.mark.parametrize("name", ["cupy:sm90a"])
def test_device_backends_refuse_dropout(name):
    """Each device backend says why (what `explain` and an error of `backend=` show once it
    could otherwise run the call); the host backends run it."""
    problem = backends.Problem("float16", 64, 64, True, dropout=make_dropout(0.1, 1))
    why = backends.get(name).supports_dropout(problem)
    assert why is not None and "dropout" in why, f"{name}: {why!r}"
    for host in HOST:
        assert backends.get(host).supports_dropout(problem) is None


@pytest.mark.parametrize("name", ["cupy", "cupy:mma"])
def test_cupy_runs_dropout(name):
    """The mma.sync kernels run dropout (tests/emulation/test_cupy_dropout.py), and the family
    with them."""
    problem = backends.Problem("float16", 64, 64, True, dropout=make_dropout(0.1, 1))
    assert backends.get(name).supports_dropout(problem) is None


def test_default_backend_runs_dropout_on_the_host():
    q = np.zeros((4, 2, 8), np.float16)
    cu = np.array([0, 4], np.int32)
    out, _ = varlen.attention_forward(q, q, q, cu, cu, dropout_p=0.1, seed=1)
    assert out.dtype == np.float16
    assert dict(backends.explain(dtype="float32", head_dim=8,
                                 dropout=make_dropout(0.1, 1)))["numpy"] is None


BAD = [
    (dict(dropout_p=-0.1, seed=1), ValueError, "dropout_p"),
    (dict(dropout_p=1.0, seed=1), ValueError, "dropout_p"),
    (dict(dropout_p=float("nan"), seed=1), ValueError, "dropout_p"),
    (dict(dropout_p="0.1", seed=1), TypeError, "dropout_p"),
    (dict(dropout_p=True, seed=1), TypeError, "dropout_p"),
    (dict(dropout_p=0.1, seed=1.5), TypeError, "seed"),
    (dict(dropout_p=0.1, seed="7"), TypeError, "seed"),
    (dict(dropout_p=0.1, seed=-1), ValueError, "seed"),
    (dict(dropout_p=0.1, seed=2 ** 64), ValueError, "seed"),
    (dict(dropout_p=0.1), ValueError, "seed is required"),
    (dict(dropout_p=0.1, seed=1, offset=-1), ValueError, "offset"),
    (dict(dropout_p=0.1, seed=1, offset=2 ** 32), ValueError, "offset"),
    (dict(dropout_p=0.1, seed=1, offset=0.5), TypeError, "offset"),
]


@pytest.mark.parametrize("kw, error, says", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input(kw, error, says):
    q = np.zeros((4, 2, 8), np.float32)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(error, match=says):
        varlen.attention_forward(q, q, q, cu, cu, **kw)
    with pytest.raises(error, match=says):
        varlen.attention_backward(q, q, q, q, q, np.zeros((2, 4), np.float32), cu, cu, **kw)
    with pytest.raises(error, match=says):
        dropout_keep(cu, cu, 2, kw.get("dropout_p", 0.0), kw.get("seed"), kw.get("offset", 0))


def test_keep_bits_take_arrays_of_any_shape():
    d = make_dropout(0.5, SEED)
    k = keep_bits(d, np.zeros((2, 1, 1, 1)), np.arange(3)[:, None, None], np.arange(4)[:, None],
                  np.arange(5))
    assert k.shape == (2, 3, 4, 5) and k.dtype == bool
