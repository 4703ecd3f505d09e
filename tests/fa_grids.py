"""FlashAttention 2's and 3's `test_flash_attn_varlen_output` parameter grids, in float32, and
their accuracy rule: a kernel's max error against the float64 reference, over a naive float32
computation's (FlashAttention's `attention_ref(..., upcast=False, reorder_ops=True)` and its
autograd gradients, in PyTorch).

The grids are FlashAttention's own (tests/test_flash_attn.py for FA2, hopper/test_flash_attn.py
for FA3): their (seqlen_q, seqlen_k) pairs, head dims, causal, local windows drawn in
[0, seqlen_k), MHA/MQA/GQA, softcap (FA2: 50 with q scaled by it; FA3: 15 with q scaled by a
quarter of it), FA3's value head dims and unused rows (`add_unused_qkv`: rows inside a
sequence's buffer that its length leaves out), random per-sequence lengths in
[seqlen - 20, seqlen] (FA3's keys: zero lengths every fifth sequence and the last; two more
sequences where the batch is smaller than FA3's 9). Each
(seqlen_q, seqlen_k) pair is taken twice with the other parameters cycled, not crossed; batch
and heads are smaller than FlashAttention's for the long pairs so the float64 reference stays
quick on a CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

import varlen
from varlen import reference

FA2_SEQLENS = [(1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512),
               (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]
FA2_HDIMS = [32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
FA3_SEQLENS = [(1, 1), (1, 3), (2, 1), (511, 1), (3, 513), (64, 128), (128, 128), (256, 256),
               (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (307, 256),
               (640, 128), (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048),
               (4096, 4096)]
FA3_HDIMS = [64, 96, 128, 192, 256]
MHA = ("mha", "mqa", "gqa")


@dataclass(frozen=True)
class Case:
    suite: str            # "fa2" or "fa3"
    seqlen_q: int
    seqlen_k: int
    d: int
    dv: int
    causal: bool
    local: bool
    softcap: float
    mha: str
    unused: bool          # FA3's add_unused_qkv

    @property
    def id(self):
        flags = [f for f, on in (("causal", self.causal), ("local", self.local),
                                 ("softcap", self.softcap > 0), ("unused", self.unused)) if on]
        dims = f"d{self.d}" + (f"-dv{self.dv}" if self.dv != self.d else "")
        return "-".join([self.suite, f"q{self.seqlen_q}-k{self.seqlen_k}", dims, self.mha,
                         *flags])

    @property
    def slow(self):
        return max(self.seqlen_q, self.seqlen_k) >= 2048


def _fa3_dv(d, i):
    """FA3's value head dims for head dim `d` with a backward (dv <= 256)."""
    vals = [128, d] if 128 < d <= 192 else ([256, d] if d <= 64 else [d])
    return vals[i % len(vals)]


def cases():
    """Both grids, each (seqlen_q, seqlen_k) pair twice, the other parameters cycled so that
    every value of every parameter appears."""
    out = []
    for suite, seqlens, hdims, cap in (("fa2", FA2_SEQLENS, FA2_HDIMS, 50.0),
                                       ("fa3", FA3_SEQLENS, FA3_HDIMS, 15.0)):
        n = 0
        for sq, sk in seqlens:
            for _ in range(2):
                d = hdims[(7 * n) % len(hdims)]
                flags = (3 * n) % 8              # (causal, local, softcap): all 8 in 8 cases
                dv = d if suite == "fa2" else _fa3_dv(d, n // len(hdims))
                out.append(Case(suite, sq, sk, d, dv, bool(flags & 1), bool(flags & 2),
                                cap if flags & 4 else 0.0, MHA[n % 3],
                                suite == "fa3" and (n // 2) % 2 == 1))
                n += 1
    return out


def _sizes(case):
    """(batch, heads, kv heads): FlashAttention's (FA2 4 x 9, FA3 9 x 6) for short pairs,
    fewer for long ones."""
    longest = max(case.seqlen_q, case.seqlen_k)
    batch, heads = (4, 9) if case.suite == "fa2" else (9, 6)
    if longest > 256:
        batch, heads = (2, 6) if case.suite == "fa3" else (2, 3)
    if longest > 1024:
        batch = 1
    if longest > 2048:
        heads = 2
    kv = {"mha": heads, "mqa": 1, "gqa": 3 if case.suite == "fa2" else 2}[case.mha]
    if heads % kv:
        kv = 1
    return batch, heads, kv


def _lengths(rng, seqlen, batch, zero_lengths):
    """FlashAttention's `generate_random_padding_mask(mode="random")` lengths."""
    lengths = rng.integers(max(0 if zero_lengths else 1, seqlen - 20), seqlen + 1, size=batch)
    if zero_lengths:
        lengths[::5] = 0
        lengths[-1] = 0
    return lengths


@dataclass
class Inputs:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    off_q: np.ndarray | None
    off_k: np.ndarray | None
    mask: varlen.Mask
    window: tuple

    @property
    def layout(self):
        return dict(seq_offsets_q=self.off_q, seq_offsets_k=self.off_k, mask=self.mask)


def inputs(case: Case, seed: int = 0) -> Inputs:
    """Packed float32 q, k, v, dout with the case's lengths, window and scaling."""
    rng = np.random.default_rng([seed, case.seqlen_q, case.seqlen_k, case.d, case.dv,
                                 case.causal, case.local, int(case.softcap), MHA.index(case.mha),
                                 case.unused, case.suite == "fa3"])
    batch, heads, kv = _sizes(case)
    if case.suite == "fa3" and batch < 9:     # room for FA3's zero-length key sequences
        batch += 2
    lq = _lengths(rng, case.seqlen_q, batch, False)
    lk = _lengths(rng, case.seqlen_k, batch, case.suite == "fa3")
    off_q = off_k = None
    rows_q, rows_k = lq, lk
    if case.unused:        # a buffer per sequence the union of two lengths, its own the smaller
        other_q = _lengths(rng, case.seqlen_q, batch, False)
        other_k = _lengths(rng, case.seqlen_k, batch, False)
        rows_q, rows_k = np.maximum(lq, other_q), np.maximum(lk, other_k)
        lq, lk = np.minimum(lq, other_q), np.minimum(lk, other_k)
        off_q = np.concatenate([[0], np.cumsum(rows_q)]).astype(np.int32)
        off_k = np.concatenate([[0], np.cumsum(rows_k)]).astype(np.int32)
    window = tuple(int(x) for x in rng.integers(0, case.seqlen_k, 2)) if case.local else (-1, -1)
    left, right = window
    if case.causal:
        right = 0
    mask = varlen.Mask(window_left=left, window_right=right, bottom_right=True)
    Tq, Tk = int(rows_q.sum()), int(rows_k.sum())
    f32 = np.float32
    q = rng.standard_normal((Tq, heads, case.d)).astype(f32)
    if case.softcap > 0:      # FA2: q * softcap, FA3: q * softcap / 4
        q = (q * f32(case.softcap / (1 if case.suite == "fa2" else 4))).astype(f32)
    k = rng.standard_normal((Tk, kv, case.d)).astype(f32)
    v = rng.standard_normal((Tk, kv, case.dv)).astype(f32)
    dout = rng.standard_normal((Tq, heads, case.dv)).astype(f32)
    cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk)]
    return Inputs(q, k, v, dout, cu[0], cu[1], off_q, off_k, mask, window)


def _sequences(x: Inputs):
    starts_q = x.cu_q[:-1] if x.off_q is None else x.off_q[:-1]
    starts_k = x.cu_k[:-1] if x.off_k is None else x.off_k[:-1]
    masks = reference.sequence_masks(x.cu_q, x.cu_k, x.mask)
    for b, ok in enumerate(masks):
        yield (slice(starts_q[b], starts_q[b] + ok.shape[0]),
               slice(starts_k[b], starts_k[b] + ok.shape[1]), ok)


def naive_float32(x: Inputs, softcap: float):
    """FlashAttention's `attention_ref(upcast=False, reorder_ops=True)` in float32 PyTorch,
    per sequence, and its autograd gradients of `sum(out * dout)`: `(out, dq, dk, dv)`."""
    import torch
    q, k, v, do = (torch.from_numpy(a) for a in (x.q, x.k, x.v, x.dout))
    out, dq, dk, dv = (torch.zeros_like(a) for a in (do, q, k, v))
    G = q.shape[1] // k.shape[1]
    d = q.shape[2]
    for rq, rk, ok in _sequences(x):
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q[rq], k[rk], v[rk]))
        kx, vx = ks.repeat_interleave(G, dim=1), vs.repeat_interleave(G, dim=1)
        scores = torch.einsum("thd,shd->hts", qs, kx / math.sqrt(d))
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        hidden = torch.from_numpy(~ok)
        scores = scores.masked_fill(hidden, float("-inf"))
        attn = torch.softmax(scores, dim=-1).masked_fill(hidden.all(-1, keepdim=True), 0.0)
        o = torch.einsum("hts,shd->thd", attn, vx)
        o.backward(do[rq])
        out[rq], dq[rq], dk[rk], dv[rk] = o.detach(), qs.grad, ks.grad, vs.grad
    return tuple(t.numpy() for t in (out, dq, dk, dv))


def reference_float64(x: Inputs, softcap: float):
    """`varlen.reference` in float64: `(out, dq, dk, dv)`."""
    out, _ = reference.attention_dense(x.q, x.k, x.v, x.cu_q, x.cu_k, **x.layout,
                                       softcap=softcap)
    grads = reference.attention_dense_backward(x.dout, x.q, x.k, x.v, x.cu_q, x.cu_k,
                                               **x.layout, softcap=softcap)
    return (out, *grads)


def run_backend(x: Inputs, softcap: float, backend: str = "cpu"):
    out, lse = varlen.attention_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **x.layout,
                                        softcap=softcap, backend=backend)
    grads = varlen.attention_backward(x.dout, x.q, x.k, x.v, out, lse, x.cu_q, x.cu_k,
                                      **x.layout, softcap=softcap, backend=backend)
    return (out, *grads)


def _rounding_floor(ref):
    """FA3's atol: twice the error of any float32 arithmetic on the reference
    (`(ref + 0.3 - 0.3 - ref).abs().max()`)."""
    r32 = ref.astype(np.float32)
    return 2.0 * float(np.abs((r32 + np.float32(0.3) - np.float32(0.3)).astype(np.float64)
                              - ref).max(initial=0.0))


@lru_cache(maxsize=None)
def ratios(case: Case, backend: str = "cpu"):
    """`{name: (error, naive error, floor)}` for out, dq, dk, dv (max abs errors against the
    float64 reference over the used rows; unused rows must be 0 and are checked apart)."""
    x = inputs(case)
    got = run_backend(x, case.softcap, backend)
    ref = reference_float64(x, case.softcap)
    naive = naive_float32(x, case.softcap)
    result = {}
    for name, g, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        g = np.asarray(g, np.float64)
        result[name] = (float(np.abs(g - r).max(initial=0)),
                        float(np.abs(n.astype(np.float64) - r).max(initial=0)),
                        _rounding_floor(r))
    return result

