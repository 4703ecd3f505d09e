"""The sm_90a kernels' cases: small adversarial packed batches for the forward
(kernels_cuda/fwd_sm90.cuh) and the backward (bwd_sm90.cuh) of `cupy:sm90a`, and the one runner
that checks a case against the float64 reference, through the host emulation or on a Hopper GPU.

    python -m emulation.sm90_cases LABEL[:KIND] ...    # the runs in this process, in the
                                                       # emulation mode of the environment

Lengths keep the work small: the emulation runs one OS thread per CUDA thread (256 or 384 per
block here), block after block. The forward is persistent: the emulation's stand-in device has
`EMULATED_SM_COUNT` (3) SMs, or the `ctas` of a case, so each block loops over several (tile
slot, head) work items; the runner checks that the launch had that many blocks.

A case's fields: the batch (`make_batch`'s lengths, heads, dtype, mask,
gaps; `mask` a name or ("mixed",) / ("window",), or ("mod", name): a mask_mod, alone or
ANDed with a built-in mask; `_mask`), `softcap`, the plan's `block_m` and
`block_n` (64 when absent), `nan_in_pad` (every row outside a sequence holds NaN), `nan`
({tensor: (sequence, row inside it)}: a NaN in k, v or dout before the call, in q after the
reference forward, so that out and lse of its row stay finite; row -1 is the sequence's last),
and per kind: `ctas`, `pack` (an int, or "auto": the launcher's choice, `expect_pack`) for the
forward; `deterministic` for the backward. A run is a case and a kind ("fwd" or "bwd"): the
batches of `BOTH` run through both kernels, the others through one.
"""
from __future__ import annotations

import hashlib
import math
import sys
import time

import numpy as np

# Batches both kernels run.
BOTH = {
    # zero-length sequences (the last one too), length 1, lengths off the tile, a pad gap with
    # NaN in it, causal; backward: two query heads of one key head, four query chunks for the
    # first key tile of the long sequence (the two-stage ring wraps twice)
    "B4-fp16-D64-BM64-causal-gaps-nan": dict(
        lengths_q=[0, 1, 70, 0], lengths_k=[0, 1, 70, 0], Hq=2, Hk=1, D=64, dtype="float16",
        mask="causal", gaps=True, softcap=0.0, block_m=64, nan_in_pad=True),
    # per-sequence masks (full, causal, sliding window bottom-right), GQA 4:2, bf16
    "B3-bf16-D64-BM64-mixed-masks-gqa": dict(
        lengths_q=[5, 33, 17], lengths_k=[9, 33, 80], Hq=4, Hk=2, D=64, dtype="bfloat16",
        mask=("mixed",), gaps=True, softcap=0.0, block_m=64, nan_in_pad=True),
    # key tiles of 128: the forward's key chunks of 128 (wgmma N = 128 for S), a ragged last
    # one; the backward's two consumer warpgroups at D = 64; causal bottom-right
    "B2-bf16-D64-BM64-BN128-causal-gaps-nan": dict(
        lengths_q=[40, 90], lengths_k=[40, 150], Hq=1, Hk=1, D=64, dtype="bfloat16",
        mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64, block_n=128,
        nan_in_pad=True),
}

FORWARD = {
    # two consumer warpgroups, D = 128, three key tiles for one query tile (the ring wraps)
    "B2-bf16-D128-BM128-full-3tiles": dict(
        lengths_q=[3, 100], lengths_k=[150, 2], Hq=1, Hk=1, D=128, dtype="bfloat16",
        mask="full", gaps=True, softcap=0.0, block_m=128, nan_in_pad=True),
    # a NaN in a visible key of one sequence only, softcap, fp16 D = 128
    # (and as many blocks as work items: each block runs one, the grid a non-persistent one has)
    "B2-fp16-D128-BM64-softcap-nan-visible": dict(
        lengths_q=[20, 9], lengths_k=[65, 9], Hq=1, Hk=1, D=128, dtype="float16",
        mask="causal_bottom_right", gaps=False, softcap=5.0, block_m=64, nan_in_pad=False,
        nan={"v": (1, -1)}, ctas=132),
    # D = 256 (four boxes of 64 columns, wgmma N = 256 for P V), one consumer warpgroup
    "B3-fp16-D256-BM64-causal-gaps-nan": dict(
        lengths_q=[1, 0, 70], lengths_k=[1, 0, 70], Hq=2, Hk=1, D=256, dtype="float16",
        mask="causal", gaps=True, softcap=0.0, block_m=64, nan_in_pad=True),
    # the pipeline's prologue and epilogue: key chunks of 128 (pairs of the plan's 64-row key
    # tiles) numbering 1, 2, 3 and 6 per query tile, the last one a lone partial tile; two
    # consumer warpgroups in ping-pong; a query tile without keys; a NaN in the last key of a
    # sequence of its own (a partial chunk: the producer hands the NaN to the key's K row); a
    # tile whose last chunk is full (its V is waited for by the consumers alone)
    "B7-bf16-D64-BM128-chunks-1-2-3-6": dict(
        lengths_q=[3, 64, 129, 40, 0, 5, 10], lengths_k=[100, 200, 300, 700, 0, 70, 256],
        Hq=2, Hk=1, D=64, dtype="bfloat16", mask="full", gaps=True, softcap=0.0, block_m=128,
        nan_in_pad=True, nan={"v": (5, -1)}),
    # sliding windows: in sequence 0 (20 keys back) the second chunk of a query tile is fully
    # masked for the first warpgroup's rows (P = 0 under a finite running max), the first
    # chunk for some rows of the second (their max stays -inf into the pipeline); sequence 1
    # (200 keys back, bottom-right) has three chunks, partial at both ends
    "B2-fp16-D64-BM128-window-masked-chunks": dict(
        lengths_q=[400, 30], lengths_k=[400, 290], Hq=1, Hk=1, D=64, dtype="float16",
        mask=("window",), gaps=True, softcap=0.0, block_m=128, nan_in_pad=True),
    # zero-length and length-1 sequences, GQA 2:1, a softcap, and a NaN in the one key of
    # sequence 1 (its query turns NaN, no other sequence does); D = 128, two warpgroups
    "B5-fp16-D128-BM128-gqa-softcap-nan-key": dict(
        lengths_q=[0, 1, 90, 140, 1], lengths_k=[0, 1, 300, 150, 0], Hq=2, Hk=1, D=128,
        dtype="float16", mask="causal_bottom_right", gaps=True, softcap=5.0, block_m=128,
        nan_in_pad=True, nan={"v": (1, -1)}),
    # The persistent loop. Two blocks over 2 x 3 heads of tiles with 1, 3 and 2 key chunks
    # (pairs of 64-row tiles; the K/V ring's stages and phases run on across items, so items
    # of odd chunk counts wrap it mid-item), zero-length and length-1 sequences, a slot whose
    # tile has no keys, a gap after the last sequence (pad rows written by the blocks before
    # their items, NaN in every row outside a sequence), GQA 3:1 (a block's items alternate
    # over the heads of a slot: the next item's Q is another head's), mixed per-sequence masks,
    # two consumer warpgroups in ping-pong (the turn restarts per item)
    "P6-bf16-D64-BM128-2ctas-gqa-mixed": dict(
        lengths_q=[130, 1, 0, 70, 5, 40], lengths_k=[300, 1, 20, 150, 0, 200], Hq=3, Hk=1,
        D=64, dtype="bfloat16", mask=("mixed",), gaps=True, softcap=0.0, block_m=128,
        nan_in_pad=True, ctas=2),
    # one consumer warpgroup, D = 128 under a softcap, fp16, a NaN in a key of sequence 2 seen
    # by some of its queries, GQA 2:1, three blocks over 18 items (6 of unused slots)
    "P5-fp16-D128-BM64-3ctas-softcap-nan-key": dict(
        lengths_q=[100, 0, 64, 1, 90], lengths_k=[140, 3, 64, 1, 200], Hq=2, Hk=1, D=128,
        dtype="float16", mask="causal_bottom_right", gaps=True, softcap=5.0, block_m=64,
        nan_in_pad=True, nan={"v": (2, -1)}, ctas=3),
    # D = 256 (chunks of 64 keys: 1 to 5 per tile), two blocks, GQA 2:1
    "P4-bf16-D256-BM64-2ctas-causal": dict(
        lengths_q=[130, 1, 0, 60], lengths_k=[250, 1, 0, 60], Hq=2, Hk=1, D=256,
        dtype="bfloat16", mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64,
        nan_in_pad=True, ctas=2),
    # GQA packing (`pack` query heads of one key head per position, the plan's query tiles
    # block_m / pack rows; "auto": the launcher's choice, `expect_pack`). Decoding-like: one to
    # three queries per sequence against up to 200 keys, GQA 8:2 packed by 4 (two consumer
    # warpgroups, 32 positions per tile), a zero-length sequence, NaN in every row outside a
    # sequence and in one visible key, bottom-right causal
    "G6-fp16-D64-BM128-pack4-decode-nan-key": dict(
        lengths_q=[1, 1, 0, 3, 2, 1], lengths_k=[50, 130, 0, 3, 200, 1], Hq=8, Hk=2, D=64,
        dtype="float16", mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=128,
        nan_in_pad=True, nan={"v": (4, -1)}, pack="auto", expect_pack=4),
    # packed by 2 at D = 128 (one consumer warpgroup, tiles of 32 positions: rows g and g + 8
    # 4 positions apart), per-sequence full / causal / sliding masks over sequences longer than
    # a tile, a softcap
    "G4-bf16-D128-BM64-pack2-mixed-softcap": dict(
        lengths_q=[5, 70, 17, 45], lengths_k=[9, 70, 80, 100], Hq=4, Hk=2, D=128,
        dtype="bfloat16", mask=("mixed",), gaps=True, softcap=5.0, block_m=64, nan_in_pad=True,
        pack=2),
    # packed by 8 (GQA 8:1, tiles of 16 positions: rows g and g + 8 one position apart), causal
    # top-left with sequences of 1 to 3 tiles, two blocks of the persistent loop
    "G4-bf16-D64-BM128-pack8-causal-2ctas": dict(
        lengths_q=[20, 7, 1, 40], lengths_k=[20, 7, 1, 40], Hq=8, Hk=1, D=64,
        dtype="bfloat16", mask="causal", gaps=True, softcap=0.0, block_m=128, nan_in_pad=True,
        pack=8, ctas=2),
    # head_dim_v < head_dim (multi-head latent attention): D = 192 (Q K^T over three boxes),
    # V and out of 128 columns (two boxes, wgmma N = 128 for P V), key chunks of 64; a NaN in
    # the last key of a sequence (a partial chunk: V's boxes sanitised), GQA, a sequence
    # without queries, one of a single row
    "B3-fp16-D192-Dv128-BM64-gqa-causal-nan-key": dict(
        lengths_q=[1, 0, 70], lengths_k=[1, 3, 70], Hq=2, Hk=1, D=192, Dv=128,
        dtype="float16", mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64,
        nan_in_pad=True, nan={"v": (2, -1)}),
    # the same in bfloat16 with a softcap, two query heads packed per position, two blocks
    "G3-bf16-D192-Dv128-BM64-pack2-softcap-mixed": dict(
        lengths_q=[9, 40, 1], lengths_k=[20, 70, 0], Hq=4, Hk=2, D=192, Dv=128,
        dtype="bfloat16", mask=("mixed",), gaps=True, softcap=5.0, block_m=64,
        nan_in_pad=True, pack=2, ctas=2),
}

BACKWARD = {
    # softcap, D = 128, a NaN in a key of sequence 1 that only its last query sees, and NaN in
    # a q row and a dout row of sequence 0 (a partial chunk): nothing else may turn NaN
    "B2-fp16-D128-BN64-softcap-nan-k-q-dout": dict(
        lengths_q=[20, 9], lengths_k=[65, 9], Hq=1, Hk=1, D=128, dtype="float16",
        mask="causal_bottom_right", gaps=False, softcap=5.0, block_m=64, block_n=64,
        nan_in_pad=False, nan={"k": (1, 8), "q": (0, 3), "dout": (0, 5)}),
    # two consumer warpgroups (BN = 128), D = 128, plan tiles of 128 queries (two chunks each),
    # GQA 2:1: four chunks per key tile
    "B2-bf16-D128-BN128-full-gqa": dict(
        lengths_q=[100, 3], lengths_k=[150, 2], Hq=2, Hk=1, D=128, dtype="bfloat16",
        mask="full", gaps=True, softcap=0.0, block_m=128, block_n=128, nan_in_pad=True),
    # deterministic dQ: three key tiles meet each query tile of the long sequence (ranks 0-2,
    # sequence 1's tiles after sequence 0's slots), two consumer warpgroups hand each column
    # slice over, GQA 2:1 (the chunks of two query heads per key tile), a softcap
    "B3-fp16-D64-BN128-deterministic-gqa": dict(
        lengths_q=[30, 130, 0], lengths_k=[20, 300, 5], Hq=2, Hk=1, D=64, dtype="float16",
        mask="full", gaps=True, softcap=5.0, block_m=128, block_n=128, nan_in_pad=True,
        deterministic=True),
    # two consumer warpgroups at D = 128 (BN = 128) split dQ's columns, each over the dS of the
    # whole key tile (one reduction per dQ element and chunk), in the ordered mode: three key
    # tiles meet the long sequence's query tiles; a softcap, GQA 2:1, NaN in a key, a q row
    # and a dout row
    "B3-bf16-D128-BN128-deterministic-softcap-nan": dict(
        lengths_q=[30, 130, 0], lengths_k=[20, 300, 5], Hq=2, Hk=1, D=128, dtype="bfloat16",
        mask="full", gaps=True, softcap=5.0, block_m=128, block_n=128, nan_in_pad=False,
        nan={"k": (1, 8), "q": (1, 40), "dout": (1, 50)}, deterministic=True),
    # deterministic dQ with one consumer warpgroup, D = 128, causal: ranks of a triangle
    "B2-bf16-D128-BN64-deterministic-causal": dict(
        lengths_q=[150, 7], lengths_k=[150, 70], Hq=1, Hk=1, D=128, dtype="bfloat16",
        mask="causal_bottom_right", gaps=False, softcap=0.0, block_m=64, block_n=64,
        nan_in_pad=False, deterministic=True),
    # D = 256: two consumer warpgroups share the 64 keys of a tile, each with half the columns
    # of dK, dV and dQ, in two query subtiles of 32 per chunk; lengths off the subtile (a chunk
    # of 20 rows: its second subtile empty), GQA 2:1, a softcap, NaN in the pad rows
    "B3-bf16-D256-softcap-gqa-nan": dict(
        lengths_q=[20, 0, 75], lengths_k=[70, 3, 40], Hq=2, Hk=1, D=256, dtype="bfloat16",
        mask="causal_bottom_right", gaps=True, softcap=5.0, block_m=64, block_n=64,
        nan_in_pad=True),
    # D = 256, deterministic: three key tiles meet the long sequence's query tiles, and NaN in
    # a key, a q row and a dout row
    "B2-fp16-D256-deterministic-nan": dict(
        lengths_q=[130, 9], lengths_k=[150, 9], Hq=1, Hk=1, D=256, dtype="float16",
        mask="full", gaps=False, softcap=0.0, block_m=64, block_n=64, nan_in_pad=False,
        nan={"k": (1, 8), "q": (0, 40), "dout": (0, 50)}, deterministic=True),
}

# The backward with a mask_mod (varlen.MaskMod: every kept chunk tested pair by pair, the
# band AND the mask_mod, kernels_cuda/bwd_sm90.cuh's user_bits)
BACKWARD_MASK_MOD = {
    # prefix-LM (a per-sequence aux array: prefixes 0, 1, 9, 0, 40), zero-length sequences
    # (the first and the last), length 1, lengths off the chunk, pad gaps with NaN, GQA 4:2, one
    # consumer warpgroup; NaN in a key of sequence 2 past its prefix (only the queries at and
    # after it see it) and in a dout row of sequence 4
    "B5-fp16-D64-BN64-prefix-lm-gqa-nan": dict(
        lengths_q=[0, 1, 70, 33, 0], lengths_k=[0, 1, 70, 33, 0], Hq=4, Hk=2, D=64,
        dtype="float16", mask=("mod", "prefix-lm"), gaps=True, softcap=0.0, block_m=64,
        block_n=64, nan_in_pad=True, nan={"k": (2, 50), "dout": (3, 20)}),
    # chunked causal (chunks of 16) ANDed with a bottom-right causal Mask: rows of sequence 0
    # that the pair hides from every key (lse -inf: dq 0, no NaN), query chunks that see no
    # key of a kept key tile (P^T = dS^T = 0 throughout), two consumer warpgroups at D = 128
    # (dQ by columns), ordered dQ (three key tiles meet the last query tile), GQA 2:1, a
    # softcap
    "B3-bf16-D128-BN128-chunked-and-causal-ordered": dict(
        lengths_q=[40, 0, 260], lengths_k=[30, 5, 260], Hq=2, Hk=1, D=128, dtype="bfloat16",
        mask=("mod", "chunked&causal"), gaps=True, softcap=5.0, block_m=128, block_n=128,
        nan_in_pad=True, deterministic=True),
    # D = 256 (two consumer warpgroups, each with half the columns; every chunk tested pair by
    # pair), prefix-LM (prefixes 0, 1, 9, 0), atomic dQ, GQA 2:1, a zero-length and a length-1
    # sequence, pad gaps with NaN, NaN in a key of sequence 2 past its prefix
    "B4-bf16-D256-BN64-prefix-lm-gqa-nan": dict(
        lengths_q=[0, 1, 75, 20], lengths_k=[0, 1, 75, 20], Hq=2, Hk=1, D=256,
        dtype="bfloat16", mask=("mod", "prefix-lm"), gaps=True, softcap=0.0, block_m=64,
        block_n=64, nan_in_pad=True, nan={"k": (2, 50)}),
}
BACKWARD.update(BACKWARD_MASK_MOD)

# label -> case, with the kernels (`kinds`) that run it
CASES = {**{k: dict(c, kinds=("fwd", "bwd")) for k, c in BOTH.items()},
         **{k: dict(c, kinds=("fwd",)) for k, c in FORWARD.items()},
         **{k: dict(c, kinds=("bwd",)) for k, c in BACKWARD.items()}}
assert len(CASES) == len(BOTH) + len(FORWARD) + len(BACKWARD), "a label names two cases"
# every run: (case, kind)
RUNS = [(label, kind) for label, c in CASES.items() for kind in c["kinds"]]

# the forward pipeline's case: two warpgroups, 1 to 6 chunks, partial chunks with NaN in their
# boxes, 16 work items (2 of an unused slot) over 3 blocks
PIPELINE = "B7-bf16-D64-BM128-chunks-1-2-3-6"
# the persistent loop's case: 21 work items (3 of an unused slot) over 2 blocks
PERSISTENT = "P6-bf16-D64-BM128-2ctas-gqa-mixed"
PACKED = "G6-fp16-D64-BM128-pack4-decode-nan-key"
# the first case, both kinds (the sanitizer's, the smoke run's), and the quick run's: those, the
# persistent loop, GQA packing and the backward's mask_mod
FIRST = "B4-fp16-D64-BM64-causal-gaps-nan"
HEAD_DIM_V = "G3-bf16-D192-Dv128-BM64-pack2-softcap-mixed"
MASK_MOD = "B5-fp16-D64-BN64-prefix-lm-gqa-nan"
QUICK = [(FIRST, "fwd"), (FIRST, "bwd"), (PERSISTENT, "fwd"), (PACKED, "fwd"), (HEAD_DIM_V, "fwd"),
         (MASK_MOD, "bwd")]
# the column of a row's NaN (`nan`), by tensor
NAN_COLUMN = {"q": 11, "k": 3, "v": 3, "dout": 7}

def prefix_lm(b, q_idx, k_idx, prefix):
    return (k_idx <= q_idx) | (k_idx < prefix[b])


def chunked(b, q_idx, k_idx, chunk):
    return q_idx // chunk[0] == k_idx // chunk[0]


def _mask_mod(name: str, B: int):
    """The mask of mask_mod case `name` for B sequences: "prefix-lm" (prefixes 0, 1, 9, 0, 40
    in turn), "chunked&causal" (chunks of 16 ANDed with a bottom-right causal Mask)."""
    import varlen
    if name == "prefix-lm":
        return varlen.MaskMod(prefix_lm, np.array([0, 1, 9, 0, 40] * B, np.int32)[:B])
    assert name == "chunked&causal", name
    return varlen.MaskMod(chunked, np.array([16], np.int32)) & "causal_bottom_right"


def _mask(spec, B):
    """A case's mask: a name, or per sequence: ("mixed",) full, causal and a bottom-right
    window of 7 keys in turn; ("window",) windows of 20 keys (top-left) and 200 keys
    (bottom-right) in turn; ("mod", name): `_mask_mod(name, B)`."""
    import varlen
    if spec[0] == "mod":
        return _mask_mod(spec[1], B)
    if spec == ("window",):
        return varlen.Mask(window_left=np.array([20, 200] * B, np.int32)[:B],
                           window_right=np.zeros(B, np.int32),
                           bottom_right=np.array([0, 1] * B, np.int32)[:B])
    if spec != ("mixed",):
        return spec
    return varlen.Mask(window_left=np.array([-1, -1, 7] * B, np.int32)[:B],
                       window_right=np.array([-1, 0, 0] * B, np.int32)[:B],
                       bottom_right=np.array([0, 0, 1] * B, np.int32)[:B])


def _row(b, side, seq, i):
    """Packed row of position i (-1: the last) of sequence `seq` on side "q" or "k"."""
    cu, off = (b.cu_q, b.off_q) if side == "q" else (b.cu_k, b.off_k)
    if i < 0:
        i += int(cu[seq + 1] - cu[seq])
    return int((cu if off is None else off)[seq]) + i


def batch(c):
    """The packed batch of case `c`, NaN in it where the case says (q's NaN aside)."""
    from varlen.testing import covered_rows, make_batch
    b = make_batch(np.random.default_rng(0), c["lengths_q"], c["lengths_k"], Hq=c["Hq"],
                   Hk=c["Hk"], D=c["D"], Dv=c.get("Dv"), dtype=c["dtype"], mask=_mask(c["mask"],
                                                                      len(c["lengths_q"])),
                   gaps=c["gaps"])
    if c["nan_in_pad"]:
        # every row outside a sequence (pad gaps, rows past the last one) holds NaN: a TMA box
        # that reads them must not let them reach a visible score, a P V product or a gradient
        rows_k, rows_q = covered_rows(b, "k"), covered_rows(b, "q")
        for name, rows in (("k", rows_k), ("v", rows_k), ("q", rows_q), ("dout", rows_q)):
            getattr(b, name)[~rows] = np.nan
    for name, (seq, i) in c.get("nan", {}).items():
        if name != "q":
            getattr(b, name)[_row(b, "k" if name in "kv" else "q", seq, i), 0,
                             NAN_COLUMN[name]] = np.nan
    return b


def plan_of(c, b):
    import varlen
    return varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=c["block_m"], block_n=c.get("block_n", 64))


def _nan_pattern(label, got, want):
    bad = np.isnan(want)
    assert np.array_equal(np.isnan(got), bad), (
        f"{label}: NaN pattern differs: {int(np.isnan(got).sum())} NaN, {int(bad.sum())} "
        f"expected, first wrong rows {np.unique(np.argwhere(np.isnan(got) != bad)[:, 0])[:8]}")
    return np.where(bad, 0.0, got), np.where(bad, 0.0, want)


def _forward(label, c, plan, args, runtime):
    """The forward of case `c` (pack as the case says): (out, lse)."""
    from varlen.backends.cupy import sm90
    pack, chosen = c.get("pack", 1), c.get("pack")
    if pack == "auto":
        chosen, pack = None, sm90.pack_for(plan, args[1].shape[0], c["Hq"], c["Hk"],
                                           c["block_m"])
        assert pack == c["expect_pack"], (label, pack, c["expect_pack"])
    out_lse = sm90.forward(plan, *args[1:4], pack=chosen, softmax_scale=1.0 / math.sqrt(c["D"]),
                           softcap=c["softcap"])
    if runtime is not None:
        # one launch of min(work items, SMs) blocks: with fewer SMs than items, blocks loop;
        # packed, over the plan of block_m / pack query rows, a work item per group of heads
        kplan = sm90.packed_plan(plan, pack)
        assert kplan.block_m == c["block_m"] // pack, (label, kplan.block_m)
        items = kplan.num_q_tiles * (c["Hq"] // pack)
        assert runtime.grids == [(max(1, min(items, runtime.sm_count())), 1)], (
            label, runtime.grids, items)
        # the plan of the variant launched (the forward packs heads where it chooses to)
        spec = runtime.last_spec
        walked, reordered = check_chunk_order(label, sm90.packed_plan(plan, spec.pack), args[1],
                                              args[2], runtime.tma_trace(), spec.key_chunk)
        print(f"chunk order {label}: {walked} work items, {reordered} reordered", flush=True)
    return out_lse


def chunk_order(row_sched, kn: int) -> list:
    """The key chunks of one query tile (its row schedule, [segments, 5]) in the order the
    sm_90a forward walks them (PartialsFirstCursor): (first row, full) of each chunk of `kn`
    rows, the partial ones first, then the full ones, each in the schedule's order."""
    chunks = []
    for begin, full_begin, full_end, end, _ in np.asarray(row_sched).tolist():
        chunks += [(r, full_begin <= r <= full_end - kn) for r in range(begin, end, kn)]
    return [x for x in chunks if not x[1]] + [x for x in chunks if x[1]]


def check_chunk_order(label, kplan, q, k, trace, kn: int) -> tuple:
    """The K loads of an emulated forward (`trace`: EmulatedRuntime.tma_trace) against
    `chunk_order`, per work item (the loads of a block after each Q load, its item's tile found
    by the box's first row). Returns (work items checked, items whose order differs from the
    schedule's)."""
    q_addr, k_addr = q.ctypes.data, k.ctypes.data
    tiles = np.asarray(kplan.q_tiles)
    row_sched = np.asarray(kplan.q_row_sched)
    items = {}                                   # (block, item number) -> [q box row, k rows]
    count = {}
    for bx, by, addr, c0, c1, c2 in trace.tolist():
        if addr == q_addr and c0 == 0:
            count[bx] = count.get(bx, -1) + 1
            items[(bx, count[bx])] = [c2, []]
        elif addr == k_addr and c0 == 0:
            items[(bx, count[bx])][1].append(c2)
    # the blocks take items in descending order of work (sm90.work_ordered_plan): the n-th
    # item of block b is item b + n G of the grid's G blocks
    sched = np.asarray(kplan.q_sched)
    work = (sched[:, :, 3] - sched[:, :, 0]).sum(axis=1)
    grid = len(count)
    by_item = {}
    for (bx, n), (row, _) in items.items():
        slot = int(np.flatnonzero((tiles[:, 0] >= 0) & (tiles[:, 2] == row))[0])
        by_item[bx + n * grid] = int(work[slot])
    seq = [by_item[i] for i in sorted(by_item)]
    assert seq == sorted(seq, reverse=True), f"{label}: the items' work in item order: {seq}"
    reordered = 0
    for (bx, n), (row, got) in items.items():
        slot = int(np.flatnonzero((tiles[:, 0] >= 0) & (tiles[:, 2] == row))[0])
        want = chunk_order(row_sched[slot], kn)
        assert got == [r for r, _ in want], (
            f"{label}: block {bx}, item {n} (tile {slot}) loads key chunks at rows {got}, "
            f"expected the partial ones first: {want}")
        reordered += [r for r, _ in want] != sorted(r for r, _ in want)
    return len(items), reordered


def run_case(label: str, kind: str, device: bool = False) -> float:
    """Runs case `label` through the emulated sm_90a kernel of `kind` ("fwd" or "bwd"; on a
    Hopper GPU with `device`: float16 cases only); raises AssertionError on a mismatch. Returns
    the seconds the kernel's pass took. A backward prints the digest of its gradients' bits."""
    import varlen
    from varlen.backends.cupy import sm90
    from varlen.testing import assert_close, assert_lse, covered_rows, naive_same_dtype
    c = CASES[label]
    assert kind in c["kinds"], f"{label} is a case of {c['kinds']}"
    runtime = None
    if not device:
        import emulation.cupy
        import emulation.sm90
        emulation.cupy.install_fake_cupy(c["block_m"])
        runtime = emulation.sm90.install(c.get("ctas", emulation.sm90.EMULATED_SM_COUNT))
    b = batch(c)
    plan = plan_of(c, b)
    why = varlen.backends.get("cupy:sm90a").runs(kind, plan, b.q, c["softcap"], b.v)
    assert why is None, f"{label}: cupy:sm90a has no {kind} variant for it: {why}"
    kw = dict(softmax_scale=1.0 / math.sqrt(c["D"]), softcap=c["softcap"])
    ref_out, ref_lse = (np.asarray(x) for x in b.ref_forward(**kw))
    # the tolerances' scale: a same-dtype computation's error (the naive computation lets a
    # NaN value row reach the rows that hide it: 0 x NaN)
    naive = naive_same_dtype(b, **kw)
    naive_err = float(np.max(np.abs(naive - ref_out)[np.isfinite(naive) & np.isfinite(ref_out)],
                             initial=0.0))
    # a backward is given out and lse of the reference, which carry a NaN of the forward to the
    # query rows
    out, lse = ref_out.astype(b.q.dtype), ref_lse.astype(np.float32)
    if kind == "bwd" and c.get("deterministic"):
        ranks = _ranks(plan)
        assert ranks.max() >= 2, f"{label}: at most {ranks.max() + 1} key tiles per query tile"
    if "q" in c.get("nan", {}):
        b.q[_row(b, "q", *c["nan"]["q"]), 0, NAN_COLUMN["q"]] = np.nan
    args = [b.dout, b.q, b.k, b.v, out, lse]
    if device:
        import cupy
        args = [cupy.asarray(a) for a in args]
    t0 = time.perf_counter()
    if kind == "fwd":
        got = _forward(label, c, plan, args, runtime)
    else:
        mods = _mask_mods(b.mask)
        got = sm90.backward(plan, *args, deterministic=c.get("deterministic", False),
                            **({"mods": mods} if mods else {}), **kw)
    if device:
        cupy.cuda.Device().synchronize()
        got = tuple(cupy.asnumpy(g) for g in got)
    seconds = time.perf_counter() - t0
    got = [np.asarray(g).astype(np.float64) for g in got]
    if kind == "fwd":
        got_out, want_out = _nan_pattern(f"{label} out", got[0], ref_out)
        got_lse, want_lse = _nan_pattern(f"{label} lse", got[1], ref_lse)
        assert_close(f"{label} out", got_out, want_out, dtype=c["dtype"], naive_err=naive_err)
        assert_lse(f"{label} lse", got_lse, want_lse, dtype=c["dtype"])
        return seconds
    # the gradients' bits, for the comparison between schedules
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(g).tobytes() for g in got))
    print("digest", label, digest.hexdigest()[:16], flush=True)
    # check_against_reference's tolerances: a same-dtype computation's error, relative to each
    # gradient's scale
    amax_out = float(np.max(np.abs(ref_out[np.isfinite(ref_out)]), initial=0.0))
    dout_ok = np.where(covered_rows(b)[:, None, None] & np.isfinite(b.dout.astype(np.float64)),
                       b.dout.astype(np.float64), 0.0)
    magnitude = amax_out * float(np.max(np.abs(dout_ok), initial=0.0))
    rel = naive_err / max(amax_out, 1e-30)
    for name, g, want in zip(("dq", "dk", "dv"), got, b.ref_backward(out=out, lse=lse, **kw)):
        g, want = _nan_pattern(f"{label} {name}", g, np.asarray(want))
        assert_close(f"{label} {name}", g, want, dtype=c["dtype"],
                     naive_err=rel * max(float(np.max(np.abs(want), initial=0.0)), 1e-30),
                     factor=3.0, floor=16.0, magnitude=magnitude)
    if mods and runtime is not None:
        loaded, skipped = check_query_loads(label, plan, b.q, runtime.tma_trace(), mods.mask,
                                            c["Hq"] // c["Hk"])
        print(f"query chunks {label}: {loaded} loaded, {skipped} skipped", flush=True)
    return seconds


def check_query_loads(label, plan, q, trace, mask_mod, group: int, bq: int = 64) -> tuple:
    """The Q loads of an emulated backward with a mask_mod (`trace`: EmulatedRuntime.tma_trace)
    against the mask_mod's classes: each block (key tile, key head) loads exactly the query
    chunks of its schedule (bq rows from each range's first row, for each of the `group` query
    heads) whose class against its keys is not empty (`varlen.mods.classify`). Returns (chunks
    loaded, chunks skipped); a case whose mask_mod empties no chunk fails."""
    from varlen.mods import EMPTY, classify
    tiles, row_sched = np.asarray(plan.k_tiles), np.asarray(plan.k_row_sched)
    got = {}
    for bx, by, addr, c0, c1, c2 in trace.tolist():
        if addr == q.ctypes.data and c0 == 0:
            got[(bx, by)] = got.get((bx, by), 0) + 1
    loaded = skipped = 0
    for i, (seq, _, _, rows, pos) in enumerate(tiles.tolist()):
        if seq < 0:
            continue
        want = skip = 0
        for begin, _, _, end, delta in row_sched[i].tolist():
            for r in range(begin, end, bq):
                n = min(bq, end - r)
                cls = classify(mask_mod, seq, r + delta, r + delta + n - 1, pos, pos + rows - 1)
                want += group * int(cls != EMPTY)
                skip += group * int(cls == EMPTY)
        for by in range(q.shape[1] // group):
            assert got.get((i, by), 0) == want, (
                f"{label}: key tile {i}, key head {by} loads {got.get((i, by), 0)} query "
                f"chunks, the mask_mod leaves {want}")
            loaded, skipped = loaded + want, skipped + skip
    assert skipped > 0, f"{label}: the mask_mod empties no query chunk of a key tile"
    return loaded, skipped


def _mask_mods(mask):
    """The `varlen.mods.Mods` of a case's mask (None without a mask_mod)."""
    from varlen.mods import Mods, split_mask
    mask_mod = split_mask(mask)[1]
    return None if mask_mod is None else Mods(mask=mask_mod)


def _ranks(plan):
    """Key tiles per used query tile, minus one: the highest rank of an ordered dQ addition."""
    sched = np.asarray(plan.q_sched)
    used = np.asarray(plan.q_tiles)[:, 0] >= 0
    return (sched[..., 3] - sched[..., 0]).sum(-1)[used] - 1


def parse(arg: str) -> list:
    """The runs `arg` names: LABEL (each kind of the case) or LABEL:KIND."""
    label, _, kind = arg.partition(":")
    return [(label, k) for k in (CASES[label]["kinds"] if not kind else (kind,))]


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for label, kind in parse(arg):
            print("ok", f"{label}:{kind}", f"{run_case(label, kind):.1f} s", flush=True)
