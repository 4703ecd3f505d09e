"""The batches the host emulation runs the CuPy kernels on (`python -m
emulation [--quick]`): each a dict of `run_case`'s arguments.

`default_variant_cases()` are the variants of tiles (128, 64) (bfloat16, every head dim up to
128: the backend's default up to D = 64, and at D = 96 and 128 the tiles a 99 KiB GPU falls
back to; BQ = 32 query chunks and the dQ phase with two warps per 16 query rows at D > 64),
forward and both backward modes; `wide_key_tile_cases()` those of (128, 128); among
them a batch with more CTAs than the SMs the emulation stands for (H100_SM_COUNT, an H100
SXM) and blocks that visit three or more partner tiles. CI runs each in its own process
(tests/emulation/test_emulation_variants.py).
"""
from __future__ import annotations

import numpy as np

from varlen.backends.cupy.traits import DEFAULT_BLOCKS
from varlen.masks import Mask

# The GPU the emulation stands for: an H100 SXM (sm_90, 132 SMs). A grid of more CTAs than this
# runs in more than one wave there.
H100_SM_COUNT = 132


def cases(quick: bool):
    per_seq = Mask(window_left=np.array([-1, 3, -1, 0, 5, -1, 40], np.int32),
                   window_right=np.array([0, -1, -1, 0, 0, 2, -1], np.int32),
                   bottom_right=np.array([0, 0, 1, 1, 0, 1, 1], np.int32))
    small = dict(label="B3-gqa-perseq-gaps-fp16-D64", lengths_q=[0, 70, 5],
                 lengths_k=[3, 66, 9], Hq=2, Hk=1, D=64, dtype="float16",
                 mask=Mask(window_left=np.array([-1, 20, -1], np.int32),
                           window_right=np.array([0, -1, 0], np.int32),
                           bottom_right=np.array([0, 1, 1], np.int32)),
                 gaps=True, softcap=0.0, block_m=64)
    if quick:
        return [small]
    return [small,
            dict(label="B7-perseq-bf16-D128-BM128", lengths_q=[0, 9, 1, 200, 0, 97, 2],
                 lengths_k=[4, 9, 3, 129, 1, 0, 150], Hq=4, Hk=2, D=128, dtype="bfloat16",
                 mask=per_seq, gaps=True, softcap=0.0, block_m=128),
            dict(label="B3-mqa-causal_br-fp16-D128", lengths_q=[1, 97, 113],
                 lengths_k=[30, 3, 200], Hq=2, Hk=1, D=128, dtype="float16",
                 mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64),
            *default_variant_cases(), *wide_head_dim_cases(), *wide_key_tile_cases(),
            *head_dim_v_cases()]


def wide_key_tile_cases():
    """Tiles (128, 128): the dK/dV kernel on 8 warps of 16 keys with query chunks of 64 (two
    per query tile; dQ on every warp, two warps per 16 query rows), the forward walking a
    128-key tile in the chunks of a 64-key one. Zero- and one-row sequences, lengths that are
    no multiple of 128, pad gaps holding NaN, GQA, per-sequence masks, a softcap, and a key
    tile that meets 2 query tiles (4 chunks: the barrier ending a loop step matters from the
    third); small enough for a strict run."""
    per_seq = Mask(window_left=np.array([-1, 3, -1, 0], np.int32),
                   window_right=np.array([0, -1, 5, 0], np.int32),
                   bottom_right=np.array([0, 0, 1, 1], np.int32))
    base = dict(block_m=128, block_n=128, gaps=True, garbage=np.nan)
    return [
        dict(label="B4-gqa-perseq-nangaps-bf16-D128-BN128", lengths_q=[0, 1, 100, 9],
             lengths_k=[2, 1, 135, 0], Hq=2, Hk=1, D=128, dtype="bfloat16", mask=per_seq,
             softcap=0.0, **base),
        # bottom-right causal with Lq > Lk: key tile 0 meets query rows 60 .. 199, 2 tiles
        dict(label="B3-causal_br-softcap-fp16-D64-BN128", lengths_q=[1, 200, 0],
             lengths_k=[3, 140, 1], Hq=1, Hk=1, D=64, dtype="float16",
             mask="causal_bottom_right", softcap=5.0, **base),
    ]


def wide_head_dim_cases():
    """D = 192 and 256, whose kernels take (64, 64) tiles only: forward with one m16 tile per
    warp and half-tile key chunks, dK/dV in two passes over the head dim's halves, dQ in
    half- or quarter-tile key chunks. float16 and bfloat16, GQA, per-sequence and causal
    masks, zero- and one-row sequences, pad gaps, a softcap; small enough for a strict run."""
    per_seq = Mask(window_left=np.array([-1, 3, -1, 0, 10], np.int32),
                   window_right=np.array([0, -1, -1, 0, -1], np.int32),
                   bottom_right=np.array([0, 0, 1, 1, 0], np.int32))
    base = dict(block_m=64, gaps=True)
    return [
        dict(label="B5-gqa-perseq-gaps-fp16-D256", lengths_q=[0, 1, 40, 9, 17],
             lengths_k=[3, 1, 70, 0, 20], Hq=2, Hk=1, D=256, dtype="float16", mask=per_seq,
             softcap=0.0, **base),
        dict(label="B3-causal-softcap-bf16-D256", lengths_q=[1, 66, 0], lengths_k=[4, 70, 2],
             Hq=1, Hk=1, D=256, dtype="bfloat16", mask="causal", softcap=5.0, **base),
        dict(label="B4-gqa-causal_br-bf16-D192", lengths_q=[1, 0, 70, 20],
             lengths_k=[1, 5, 90, 0], Hq=2, Hk=1, D=192, dtype="bfloat16",
             mask="causal_bottom_right", softcap=0.0, **base),
        dict(label="B3-perseq-softcap-fp16-D192", lengths_q=[0, 1, 70, 9, 33],
             lengths_k=[2, 1, 66, 4, 0], Hq=1, Hk=1, D=192, dtype="float16", mask=per_seq,
             softcap=3.0, **base),
    ]


def head_dim_v_cases():
    """head_dim_v < head_dim (multi-head latent attention), the pairs of
    traits.HEAD_DIM_V_PAIRS: 192 / 128 in both dtypes (tiles (64, 64): the forward's V and O of
    128 columns in rows of 192, dK/dV in two passes of 96 dK and 64 dV columns), one with a
    softcap, and 128 / 64 on the default tiles (128, 128) (dK/dV on 8 warps, query chunks of
    64 in two register tiles). Zero- and one-row sequences, a sequence of keys without queries
    and one of queries without keys, lengths that are no multiple of a tile, pad gaps, GQA,
    per-sequence and causal masks; small."""
    per_seq = Mask(window_left=np.array([-1, 3, -1, 0], np.int32),
                   window_right=np.array([0, -1, 5, 0], np.int32),
                   bottom_right=np.array([0, 0, 1, 1], np.int32))
    return [
        dict(label="B3-gqa-causal_br-fp16-D192-Dv128", lengths_q=[0, 1, 70],
             lengths_k=[3, 1, 67], Hq=2, Hk=1, D=192, Dv=128, dtype="float16",
             mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64),
        dict(label="B4-gqa-perseq-softcap-bf16-D192-Dv128", lengths_q=[5, 0, 40, 1],
             lengths_k=[70, 3, 0, 1], Hq=2, Hk=1, D=192, Dv=128, dtype="bfloat16",
             mask=per_seq, gaps=True, softcap=5.0, block_m=64, garbage=np.nan),
        dict(label="B4-gqa-perseq-bf16-D128-Dv64-BN128", lengths_q=[1, 70, 0, 9],
             lengths_k=[1, 90, 4, 0], Hq=2, Hk=1, D=128, Dv=64, dtype="bfloat16",
             mask=per_seq, gaps=True, softcap=0.0, block_m=128, block_n=128),
    ]


def default_variant_cases():
    """bfloat16 at every shipped head dim with the default tiles, forward and backward."""
    bm = DEFAULT_BLOCKS[0]
    base = dict(dtype="bfloat16", block_m=bm, softcap=0.0)
    # More query tiles and more key tiles than SMs: 140 one-row queries that see no key and
    # 140 one-row keys that no query sees (blocks with nothing to visit: zero output, -inf lse,
    # zero dK/dV), then 4 sequences of 70 whose blocks, past the first wave, do the work.
    idle = H100_SM_COUNT + 8
    waves_q = [1] * idle + [0] * idle + [70] * 4
    waves_k = [0] * idle + [1] * idle + [70] * 4
    return [
        # 4 key tiles for the second query tile of the 200-row sequence; 4 query chunks
        # (BQ = 32) per query tile in dK/dV; GQA 2:1; a sequence of keys only in the middle.
        dict(label="B3-gqa-full-4tiles-bf16-D128-BM128", lengths_q=[200, 0, 40],
             lengths_k=[200, 5, 40], Hq=2, Hk=1, D=128, mask="full", gaps=True, **base),
        dict(label="B2-sliding-bf16-D96-BM128", lengths_q=[200, 45], lengths_k=None, Hq=1,
             Hk=1, D=96, mask=Mask(window_left=150, window_right=0), gaps=False, **base),
        # bottom-right causal with Lk > Lq: 5 key tiles for the last query tile; 3 query tiles
        # (6 chunks of BQ = 64) for the first key tile in dK/dV.
        dict(label="B2-mqa-causal_br-bf16-D64-BM128", lengths_q=[260, 3], lengths_k=[270, 40],
             Hq=2, Hk=1, D=64, mask="causal_bottom_right", gaps=True, **base),
        # The softcap variants: the tanh of a soft-capped score must stay accurate enough
        # for the lse (tanh.approx.f32's 2^-11 is not).
        dict(label="B2-softcap-bf16-D64-BM128", lengths_q=[40, 130], lengths_k=[140, 1],
             Hq=2, Hk=2, D=64, mask="full", gaps=False, **{**base, "softcap": 5.0}),
        dict(label=f"B{len(waves_q)}-multiwave-causal-bf16-D32-BM128", lengths_q=waves_q,
             lengths_k=waves_k, Hq=1, Hk=1, D=32, mask="causal", gaps=False, **base),
    ]


def case(label: str) -> dict:
    """The case of `label`, from the full list."""
    for c in cases(False):
        if c["label"] == label:
            return c
    raise KeyError(f"no emulation case {label!r}")


def grid_figures(c: dict) -> dict:
    """What case `c` asks of the kernels: CTAs of the forward/dQ grid (query tiles x Hq) and of
    the dK/dV grid (key tiles x Hk), and the most partner tiles one block visits."""
    import varlen
    cu_q = np.concatenate([[0], np.cumsum(c["lengths_q"])]).astype(np.int32)
    lk = c["lengths_k"] if c["lengths_k"] is not None else c["lengths_q"]
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    view = varlen.plan(cu_q, cu_k, mask=c["mask"], block_m=c["block_m"],
                       block_n=c.get("block_n", 64)).view()
    q_sched, k_sched = np.asarray(view.q_sched), np.asarray(view.k_sched)
    return {"q_ctas": int(view.num_q_tiles) * c["Hq"],
            "k_ctas": int(view.num_k_tiles) * c["Hk"],
            "max_key_tiles": int((q_sched[..., 3] - q_sched[..., 0]).sum(-1).max(initial=0)),
            "max_query_tiles": int((k_sched[..., 3] - k_sched[..., 0]).sum(-1).max(initial=0))}
