#!/usr/bin/env python
"""Analytical performance model of the CuPy kernels (bf16, D=128): per tile pair, the
shared-memory bytes, tensor-pipe cycles, special-function and FP32 cycles and barriers, for the
current kernels and for the FlashAttention-2 design point, on H100 SXM and A100 SXM; the
ceilings and predicted TFLOP/s they give (docs/cupy_backend.md, "Performance model"). Then the
shipped dK/dV kernel's step at plan tiles (128, 64) and (128, 128) for every head dim up to
128, and the default tiles it implies (`preferred_blocks`). Last, the kernels as they ship
(`shipped`: both paths, forward and dK/dV, bf16, default plan tiles of D 64 and 128, their
tiles, chunks, stages, Q placement and warpgroups read from the variants and
kernels_cuda/fwd.cuh), each priced by its path's rule (`evaluate`, `evaluate_sm90`);
`path_prediction` is the figure put beside a measurement of that path.

    python scripts/perf_model.py                  # the table (the figures of the doc)
    python scripts/perf_model.py --json model.json
    python scripts/perf_model.py --measure [--json bench.json]
        # on a GPU: scripts/bench.py's runners (cupy, torch SDPA flash/cuDNN, varlen_attn,
        # compiled flex_attention) at 8k and 16k tokens per sequence, bf16, D=128, 16 heads,
        # with the measured bf16 matmul peak, each figure beside the model's prediction of
        # the path that ran. Without a GPU it says so and exits 0. (scripts/gpu_check.sh
        # times with scripts/gpu_timing.py instead: no torch.compile, figures as they come.)

Model, per SM and per tile pair (one step of a block's main loop):
  T_tensor = mma.m16n8k16 count * 4096 FLOP / the SM's mma.sync FLOP per clock
  T_smem   = (ldmatrix bytes + cp.async and st.shared bytes) / 128 B per clock
  T_sfu    = exp2 count / 16 per clock;  T_fp32 = FP32 lane operations / FP32 lanes
  T_bar    = barriers * BARRIER_DRAIN / resident CTAs per SM (another CTA fills the drain)
  ceiling:    FLOP / max(T_tensor, T_smem, T_sfu, T_fp32)
  prediction: FLOP / (max(T_tensor, T_smem) + max(T_sfu, T_fp32) + T_bar + exposed latency)
i.e. loads overlap the tensor pipe, the softmax does not (it sits between two dependent GEMMs
of the same warp). TFLOP/s = FLOP per pair / cycles * SMs * clock.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import NamedTuple

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from varlen._cli import ArgumentParser  # noqa: E402
from varlen.backends.cupy.compile import SM_LIMITS, ctas_per_sm  # noqa: E402

D = 128                    # head dim of the model
E = 2                      # bytes per bf16 element
MMA_FLOP = 2 * 16 * 8 * 16  # one mma.m16n8k16
LDSM_X4 = 512              # bytes one ldmatrix.x4 moves for a warp
SMEM_BYTES_PER_CLK = 128   # 32 banks x 4 B per SM
SFU_PER_CLK = 16           # MUFU.EX2 results per SM per clock
BARRIER_DRAIN = 300        # clocks a CTA idles per __syncthreads: the slowest warp's dependent
#                            mma chain (~8 x 35 clk), refilled only by another resident CTA


class Gpu(NamedTuple):
    name: str
    arch: str
    sms: int
    clock_ghz: float       # the clock at which the datasheet's tensor peak is quoted
    mma_flop_per_clk: int  # mma.sync bf16 FLOP per SM per clock
    fp32_lanes: int        # FP32 lanes per SM
    peak_tflops: float     # dense bf16 tensor peak of the datasheet


# H100 SXM5: 132 SMs; 989 TFLOP/s dense bf16 = 132 x 4096 FLOP/clk x 1.83 GHz (wgmma); mma.sync
# reaches about 2/3 of it (FlashAttention-3 paper). A100 SXM4: 108 SMs, 312 TFLOP/s =
# 108 x 2048 x 1.41 GHz, which mma.sync reaches.
GPUS = (Gpu("H100", "sm_90", 132, 1.83, 4096 * 2 // 3, 128, 989.0),
        Gpu("A100", "sm_80", 108, 1.41, 2048, 64, 312.0))


class Design(NamedTuple):
    """One kernel's main-loop step (a tile pair) at D=128, bf16."""

    name: str
    what: str
    pair: tuple            # (query rows, key rows) of the step
    gemms: int             # GEMMs of pair[0] x pair[1] x D in the step
    ldsm_bytes: int        # ldmatrix reads per step, all warps
    smem_write_bytes: int  # cp.async and st.shared writes per step
    exps: int              # exp2 per step
    fp32_ops: int          # FP32 lane operations per step (scale, max, sums, rescale, packs)
    barriers: int
    threads: int
    registers: int         # per thread (compiled for the current kernels; the design's cap)
    smem: int              # shared memory per CTA, bytes
    exposed: int = 0       # clocks of latency nothing hides, per step
    note: str = ""
    head_dim: int = D

    @property
    def flop(self):
        return self.gemms * 2 * self.pair[0] * self.pair[1] * self.head_dim

    @property
    def mma(self):
        return self.flop // MMA_FLOP


KB = 1024
ROW = (D + 8) * E          # a padded shared-memory row
DESIGNS = (
    Design("fwd-current", "8 warps x 16 query rows; Q, K, V fragments from smem each step",
           (128, 64), 2, ldsm_bytes=8 * (16 * KB + 16 * KB + 4 * KB), smem_write_bytes=32 * KB,
           exps=128 * 64, fp32_ops=128 * 64 * 5 + 128 * D, barriers=2, threads=256,
           registers=172, smem=(128 + 2 * 2 * 64) * ROW,
           note="K/V read once per 16 rows; scale and max subtraction separate"),
    Design("fwd-FA2", "4 warps x 32 query rows, Q in registers, K and V waited for apart",
           (128, 64), 2, ldsm_bytes=4 * (16 * KB + 16 * KB), smem_write_bytes=32 * KB,
           exps=128 * 64, fp32_ops=128 * 64 * 4 + 128 * D, barriers=2, threads=128,
           registers=255, smem=(128 + 2 * 2 * 64) * ROW,
           note="each K/V fragment feeds 32 rows: half the smem bytes per FLOP"),
    Design("bwd-current", "dK/dV: BN=64 keys on 4 warps, BQ=32 queries, atomic dQ on 4 warps",
           (32, 64), 5, ldsm_bytes=4 * (12 * KB + 12 * KB + 8 * KB + 8 * KB + 2 * KB + 8 * KB),
           smem_write_bytes=2 * 32 * D * E + 64 * 32 * E + 2 * 32 * 4, exps=32 * 64,
           fp32_ops=32 * 64 * 6, barriers=3, threads=128, registers=254,
           smem=(2 * 64 + 2 * 2 * 32) * ROW + 64 * 40 * E + 2 * 2 * 32 * 4,
           note="dQ on all warps, dS fragments read once; lse/delta by cp.async"),
    Design("bwd-FA2", "BN=128 keys, BQ=64 queries on 8 warps (2 x 4 warp grid per GEMM)",
           (64, 128), 5, ldsm_bytes=(128 + 128 + 96 + 96 + 128) * KB,
           smem_write_bytes=2 * 64 * D * E + 2 * 128 * 64 * E, exps=64 * 128,
           fp32_ops=64 * 128 * 6, barriers=4, threads=256, registers=255,
           smem=2 * 128 * ROW + 2 * 64 * ROW + 128 * 72 * E,
           note="lse/delta by cp.async; dQ on all warps"),
)


def evaluate(design: Design, gpu: Gpu) -> dict:
    occ = ctas_per_sm(gpu.arch, design.registers, design.threads, design.smem)
    ctas = max(occ["ctas_per_sm"], 1)
    t = {"tensor": design.mma * MMA_FLOP / gpu.mma_flop_per_clk,
         "smem": (design.ldsm_bytes + design.smem_write_bytes) / SMEM_BYTES_PER_CLK,
         "sfu": design.exps / SFU_PER_CLK,
         "fp32": design.fp32_ops / gpu.fp32_lanes,
         "barriers": design.barriers * BARRIER_DRAIN / ctas,
         "exposed": design.exposed}
    ceiling_clk = max(t["tensor"], t["smem"], t["sfu"], t["fp32"])
    predicted_clk = (max(t["tensor"], t["smem"]) + max(t["sfu"], t["fp32"]) + t["barriers"]
                     + t["exposed"])
    scale = gpu.sms * gpu.clock_ghz * 1e9 / 1e12
    return {"design": design.name, "gpu": gpu.name, "flop_per_pair": design.flop,
            "mma_per_pair": design.mma, "smem_read_bytes": design.ldsm_bytes,
            "smem_write_bytes": design.smem_write_bytes, "barriers": design.barriers,
            "ctas_per_sm": ctas, "clocks": {k: round(v) for k, v in t.items()},
            "bound": max(("tensor", "smem", "sfu", "fp32"), key=lambda k: t[k]),
            "ceiling_tflops": design.flop / ceiling_clk * scale,
            "predicted_tflops": design.flop / predicted_clk * scale}


def table():
    return [evaluate(d, g) for g in GPUS for d in DESIGNS]


# The targets of issue 16 (H100/H200, bf16, D=128), written before any GPU run.
TARGETS = {"fwd": 350.0, "bwd": 250.0}
# the sm_90a kernels' (backend "cupy:sm90a", docs/hopper.md): H100/H200, bf16, D = 128, 8k-16k
SM90A_TARGETS = {"fwd": 600.0, "bwd": 450.0}


def measured_targets(backend: str) -> dict:
    """The targets the measured cupy runner is held to: the sm_90a kernels' when it names them,
    else the mma.sync kernels'."""
    return SM90A_TARGETS if backend == "cupy:sm90a" else TARGETS


def format_table(rows) -> str:
    head = (f"{'design':12} {'gpu':5} {'MFLOP':>6} {'smem KB':>8} {'tensor':>7} {'smem':>6} "
            f"{'sfu':>5} {'fp32':>5} {'bar':>4} {'expo':>5} {'CTA':>3} {'bound':>6} "
            f"{'ceiling':>8} {'predict':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r["clocks"]
        lines.append(
            f"{r['design']:12} {r['gpu']:5} {r['flop_per_pair'] / 1e6:6.2f} "
            f"{(r['smem_read_bytes'] + r['smem_write_bytes']) / 1024:8.0f} {c['tensor']:7d} "
            f"{c['smem']:6d} {c['sfu']:5d} {c['fp32']:5d} {c['barriers']:4d} {c['exposed']:5d} "
            f"{r['ctas_per_sm']:3d} {r['bound']:>6} {r['ceiling_tflops']:8.0f} "
            f"{r['predicted_tflops']:8.0f}")
    lines.append("clocks per tile pair per SM; TFLOP/s at the datasheet clock (H100 1.83 GHz, "
                 "A100 1.41 GHz); targets on H100/H200: forward >= "
                 f"{TARGETS['fwd']:.0f}, backward >= {TARGETS['bwd']:.0f}")
    return "\n".join(lines)


# ---- head dims above 128: the dK/dV kernel's passes --------------------------------------------

def dkdv_work(head_dim: int) -> dict:
    """GEMM work of one dK/dV tile pair relative to a single pass (KernelSpec.dkdv_parts):
    every pass computes S^T = K Q^T and dP^T = V dO^T over the full head dim and dV, dK over
    its 1 / parts of the columns; dQ += dS K (atomic or ordered: both modes) once."""
    from varlen.backends.cupy.mma import KernelSpec
    parts = KernelSpec("bwd", "bfloat16", head_dim, 64, 64, False).dkdv_parts
    one_pass = 2 + 2 + 1        # GEMMs of pair x D
    done = 2 * parts + 2 + 1
    return {"head_dim": head_dim, "parts": parts, "work": done / one_pass}


def format_wide(rows) -> str:
    lines = ["dK/dV work at head dims above 128 (recomputed S^T and dP^T per pass), relative "
             "to one pass:"]
    for r in rows:
        lines.append(f"  D={r['head_dim']:3d} parts={r['parts']} x{r['work']:.2f}")
    return "\n".join(lines)


def wide_table():
    return [dkdv_work(d) for d in (192, 256)]


# ---- dK/dV key tiles: BN = 64 against BN = 128 -------------------------------------------------

# Registers per thread of the bfloat16 dK/dV kernel (atomic dQ, no softcap) as NVRTC 13.5
# compiles it for (sm_80, sm_90), by (D, BN): with the shared memory they set the CTAs per SM
# (tests/compile/test_cupy_compile.py checks them against scripts/compile_kernels.py's report).
DKDV_REGISTERS = {(32, 64): (192, 164), (64, 64): (243, 253), (96, 64): (244, 248),
                  (128, 64): (255, 255), (32, 128): (217, 219), (64, 128): (255, 253),
                  (96, 128): (236, 239), (128, 128): (255, 254)}
TILE_HEAD_DIMS = (32, 64, 96, 128)
# A difference of predictions below this fraction is not one this uncalibrated model can make.
MARGIN = 0.05


def dkdv_design(head_dim: int, block_n: int, arch: str) -> Design:
    """One step of the shipped dK/dV kernel (kernels_cuda/bwd_dkdv.cuh) at plan tiles
    (128, block_n): BN = block_n keys on BN / 16 warps of 16 key rows, a chunk of BQ queries
    (KernelSpec.bwd_query_chunk), bf16. Per warp, by ldmatrix: its K and V rows (A of S^T and
    dP^T) once per register tile of the chunk (two of 32 columns for BQ = 64 at D > 64:
    DkdvConfig::SUBTILES), the chunk's Q and dO twice each (B of S^T and dP^T, then of dK and
    dV), its dS fragments [16, BN] and a [BN, D / DQ_SPLIT] slice of K for the dQ phase,
    DQ_SPLIT = warps per 16 query rows. Written: Q and dO by cp.async, dS^T, lse2 and delta.
    Three barriers (two of the loop step, the one publishing dS^T)."""
    from varlen.backends.cupy.mma import KernelSpec
    spec = KernelSpec("bwd", "bfloat16", head_dim, 128, block_n, False)
    bq, d = spec.bwd_query_chunk, head_dim
    warps = block_n // 16
    dq_split = warps // (bq // 16)
    subtiles = 2 if d > 64 and bq > 32 else 1
    per_warp = (2 * 16 * d * subtiles + 4 * bq * d + 16 * block_n + block_n * d // dq_split) * E
    regs = DKDV_REGISTERS[(head_dim, block_n)][0 if arch == "sm_80" else 1]
    return Design(f"dkdv-D{d}-BN{block_n}", f"BN={block_n} on {warps} warps, BQ={bq}",
                  (bq, block_n), 5, ldsm_bytes=warps * per_warp,
                  smem_write_bytes=(2 * bq * d + block_n * bq) * E + 2 * bq * 4,
                  exps=bq * block_n, fp32_ops=bq * block_n * 6, barriers=3,
                  threads=warps * 32, registers=regs, smem=spec.dkdv_smem(), head_dim=d)


def tile_rows():
    """The model at tiles (128, 64) and (128, 128) for every head dim up to 128, on each GPU;
    each row also counts the fp32 dQ additions per query-key pair (D / BN: not priced)."""
    rows = []
    for gpu in GPUS:
        for d in TILE_HEAD_DIMS:
            for bn in (64, 128):
                r = evaluate(dkdv_design(d, bn, gpu.arch), gpu)
                r.update(head_dim=d, block_n=bn, block_q=dkdv_design(d, bn, gpu.arch).pair[0],
                         dq_adds_per_pair=d / bn)
                rows.append(r)
    return rows


def preferred_blocks(rows) -> dict:
    """{head dim: plan tiles}: (128, 128) where its predicted dK/dV TFLOP/s beat (128, 64)'s by
    more than MARGIN on every GPU of the model, else (128, 64). (The forward walks both in
    the same key chunks: KernelSpec.fwd_chunk.)"""
    pred = {(r["gpu"], r["head_dim"], r["block_n"]): r["predicted_tflops"] for r in rows}
    return {d: (128, 128) if all(pred[(g.name, d, 128)] > (1 + MARGIN) * pred[(g.name, d, 64)]
                                 for g in GPUS) else (128, 64)
            for d in TILE_HEAD_DIMS}


def format_tiles(rows) -> str:
    head = (f"{'dK/dV':10} {'BQ':>3} {'gpu':5} {'regs':>4} {'CTA':>3} {'KB/MF':>6} "
            f"{'tensor':>7} {'smem':>6} {'bar':>5} {'bound':>6} {'predict':>8} {'dQ+/pair':>8}")
    lines = ["dK/dV kernel per plan key tile, bf16, tiles (128, BN): clocks per step per SM, "
             "predicted TFLOP/s", head, "-" * len(head)]
    for r in rows:
        c = r["clocks"]
        kb_per_mflop = (r["smem_read_bytes"] + r["smem_write_bytes"]) / 1024 / (
            r["flop_per_pair"] / 1e6)
        regs = DKDV_REGISTERS[(r["head_dim"], r["block_n"])][0 if r["gpu"] == "A100" else 1]
        lines.append(
            f"{'D' + str(r['head_dim']) + '-BN' + str(r['block_n']):10} {r['block_q']:3d} "
            f"{r['gpu']:5} {regs:4d} {r['ctas_per_sm']:3d} {kb_per_mflop:6.1f} "
            f"{c['tensor']:7d} {c['smem']:6d} {c['barriers']:5d} {r['bound']:>6} "
            f"{r['predicted_tflops']:8.0f} {r['dq_adds_per_pair']:8.1f}")
    chosen = preferred_blocks(rows)
    lines.append("default plan tiles by the model (dK/dV faster by more than "
                 f"{MARGIN:.0%} on both GPUs): "
                 + ", ".join(f"D={d} {chosen[d]}" for d in TILE_HEAD_DIMS))
    return "\n".join(lines)


# ---- the kernels as they ship ------------------------------------------------------------------

# The tensor pipe's share of the datasheet rate that a bf16 wgmma GEMM reaches: an 8192^3
# torch.matmul ran at 798 TFLOP/s on an H100 SXM of 989 (0.81); the sm_90a rows price their
# GEMMs at it. The mma.sync rows keep `Gpu.mma_flop_per_clk`.
WGMMA_FLOP_PER_CLK = {"H100": 4096}
WGMMA_EFFICIENCY = 0.8
SHIPPED_HEAD_DIMS = (64, 128)
FWD_CUH = os.path.join(ROOT, "kernels_cuda", "fwd.cuh")


def fwd_traits() -> dict:
    """FwdConfig's placement rule of the mma.sync forward (kernels_cuda/fwd.cuh), read from the
    header: warps, the register budget of Q in registers per arch, and the blocks per SM its
    registers must allow (MIN_BLOCKS)."""
    import re
    with open(FWD_CUH) as f:
        text = f.read()
    warps = int(re.search(r"NUM_WARPS = (\d+);", text)[1])
    budgets = [int(x) for x in re.findall(r"Q_BUDGET = (\d+);", text)]
    m = re.search(r"MIN_BLOCKS = MT == 1 && D <= (\d+) \? (\d+) : (\d+);", text)
    if len(budgets) != 2 or m is None:
        raise RuntimeError(f"{FWD_CUH}: FwdConfig's Q_BUDGET / MIN_BLOCKS no longer read as "
                           "this model expects; update perf_model.fwd_traits")
    return {"warps": warps, "q_budget": {"sm_90": budgets[0], "sm_80": budgets[1]},
            "min_blocks": (int(m[1]), int(m[2]), int(m[3]))}


def _entry_registers(threads: int, blocks: int) -> int:
    """Registers per thread ptxas may use at `blocks` CTAs of `threads` per SM (multiples of 8,
    at most 255)."""
    return min(255, 65536 // (threads * blocks) // 8 * 8)


class Shipped(NamedTuple):
    """One kernel as it ships, at the default plan tiles, read from its variant (KernelSpec,
    sm90.FwdSpec, sm90.BwdSpec): what the model prices and what compile_kernels.py builds."""

    path: str               # "mma" | "sm90a"
    kind: str               # "fwd" | "bwd" (the dK/dV kernel)
    head_dim: int
    kernel: str             # the compiled kernel's name
    block_m: int
    block_n: int
    chunk: int              # keys per step (fwd) or query rows per step (bwd)
    stages: int
    q_in: str               # "registers" | "shared" (fwd; "-" for the dK/dV kernels)
    warpgroups: int         # consumer warpgroups (sm90a), 0 for mma.sync
    threads: int
    smem: int               # dynamic shared memory, bytes
    design: Design


def shipped_mma(kind: str, head_dim: int, arch: str = "sm_90") -> Shipped:
    from varlen.backends.cupy.mma import KernelSpec
    from varlen.backends.cupy.traits import default_blocks
    bm, bn = default_blocks(head_dim)
    d = head_dim
    if kind == "bwd":
        spec = KernelSpec("bwd", "bfloat16", d, bm, bn, False)
        design = dkdv_design(d, bn, arch) if (d, bn) in DKDV_REGISTERS else None
        k = spec.kernels()["dkdv_atomic"]
        return Shipped("mma", "bwd", d, k.name, bm, bn, spec.bwd_query_chunk, 2, "-", 0,
                       k.threads, k.smem, design)
    spec = KernelSpec("fwd", "bfloat16", d, bm, bn, False).compiled()
    t = fwd_traits()
    kn, stages, warps = spec.fwd_chunk, spec.fwd_stages, t["warps"]
    mt = bm // (warps * 16)
    q_regs = d <= 192 and mt * d // 4 + mt * (d + kn) // 2 <= t["q_budget"][arch]
    small_d, few, many = t["min_blocks"]
    blocks = few if mt == 1 and d <= small_d else many
    k = spec.kernels()["fwd"]
    # per step of kn keys: each warp reads K and V of the chunk by ldmatrix, and its own Q rows
    # when Q is not in registers; K and V arrive by cp.async, waited for apart (2 barriers)
    per_warp = 2 * kn * d + (0 if q_regs else bm // warps * d)
    design = Design(f"mma-fwd-D{d}", f"{warps} warps x {bm // warps} rows, KN={kn}, "
                    f"Q in {'registers' if q_regs else 'shared memory'}", (bm, kn), 2,
                    ldsm_bytes=warps * per_warp * E, smem_write_bytes=2 * kn * d * E,
                    exps=bm * kn, fp32_ops=bm * kn * 5 + bm * d, barriers=2,
                    threads=k.threads, registers=_entry_registers(k.threads, blocks),
                    smem=k.smem, head_dim=d)
    return Shipped("mma", "fwd", d, k.name, bm, bn, kn, stages,
                   "registers" if q_regs else "shared", 0, k.threads, k.smem, design)


def shipped_sm90(kind: str, head_dim: int) -> Shipped:
    from varlen.backends.cupy import sm90
    from varlen.backends.cupy.traits import SM90_STAGES, WG_ROWS, default_blocks
    bm, bn = default_blocks(head_dim)
    d = head_dim
    if kind == "fwd":
        spec = sm90.FwdSpec("bfloat16", d, bm, bn, False)
        wgs, kn = spec.block_m // WG_ROWS, spec.key_chunk
        # per step of kn keys, per consumer warpgroup: Q [64, D] and K [kn, D] for S = Q K^T
        # (both from shared memory), V [kn, D] for O += P V (P from registers); K and V land
        # by TMA. Two consumers ping-pong: one's softmax runs under the other's GEMMs.
        design = Design(f"sm90a-fwd-D{d}", f"{wgs} consumer warpgroups x 64 rows, KN={kn}",
                        (bm, kn), 2, ldsm_bytes=wgs * (WG_ROWS * d + 2 * kn * d) * E,
                        smem_write_bytes=2 * kn * d * E, exps=bm * kn,
                        fp32_ops=bm * kn * 4 + bm * d, barriers=0, threads=spec.threads,
                        registers=_entry_registers(spec.threads, sm90.CTAS_PER_SM),
                        smem=spec.smem, head_dim=d)
        return Shipped("sm90a", "fwd", d, spec.name, bm, bn, kn, SM90_STAGES, "shared", wgs,
                       spec.threads, spec.smem, design)
    spec = sm90.BwdSpec("bfloat16", d, bn, False)
    wgs, bq = spec.consumers, spec.query_chunk
    cols = d // (2 if d >= sm90.SPLIT_HEAD_DIM else 1)
    rows = bn // wgs if d < sm90.SPLIT_HEAD_DIM else bn
    # per query chunk, per consumer: S^T = K Q^T and dP^T = V dO^T (K, V rows, Q, dO from
    # shared memory), dV += P^T dO and dK += dS^T Q (dO, Q), dQ += dS K (dS, its K slice)
    per_wg = (2 * rows * d + 2 * bq * d + 2 * bq * cols + bq * rows + rows * cols)
    design = Design(f"sm90a-bwd-D{d}", f"{wgs} consumer warpgroups, BN={bn}, BQ={bq}",
                    (bq, bn), 5, ldsm_bytes=wgs * per_wg * E,
                    smem_write_bytes=(2 * bq * d + bq * bn) * E + 2 * bq * 4,
                    exps=bq * bn, fp32_ops=bq * bn * 6, barriers=3, threads=spec.threads,
                    registers=_entry_registers(spec.threads, sm90.CTAS_PER_SM),
                    smem=spec.smem, head_dim=d)
    return Shipped("sm90a", "bwd", d, spec.name, bm, bn, bq, SM90_STAGES, "-", wgs,
                   spec.threads, spec.smem, design)


def shipped():
    """Every shipped kernel the model prices: both paths, forward and dK/dV, bf16, at the
    default plan tiles of D = 64 and 128."""
    return [f(kind, d) for d in SHIPPED_HEAD_DIMS for f in (shipped_mma, shipped_sm90)
            for kind in ("fwd", "bwd")]


def evaluate_sm90(design: Design, gpu: Gpu) -> dict:
    """An sm_90a step on `gpu`: the GEMMs at WGMMA_EFFICIENCY of the wgmma rate; the softmax
    half hidden by the ping-pong of two consumer warpgroups (fully exposed with one); a
    barrier drain per named-barrier sync (one CTA per SM: nothing fills it)."""
    r = evaluate(design, gpu)
    c = r["clocks"]
    tensor = design.mma * MMA_FLOP / (WGMMA_FLOP_PER_CLK[gpu.name] * WGMMA_EFFICIENCY)
    wgs = max(1, design.threads // 128 - 1)
    soft = max(design.exps / SFU_PER_CLK, design.fp32_ops / gpu.fp32_lanes)
    clk = max(tensor, c["smem"]) + soft * (0.5 if wgs >= 2 else 1.0) + c["barriers"]
    scale = gpu.sms * gpu.clock_ghz * 1e9 / 1e12
    c["tensor"] = round(tensor)
    r.update(bound="tensor" if tensor >= c["smem"] else "smem",
             ceiling_tflops=design.flop / max(tensor, c["smem"], soft) * scale,
             predicted_tflops=design.flop / clk * scale)
    return r


def shipped_rows(gpu_name: str = "H100"):
    """The model of each shipped kernel on `gpu_name` (the sm_90a rows on H100 only)."""
    gpu = next(g for g in GPUS if g.name == gpu_name)
    rows = []
    for s in shipped():
        if s.design is None or (s.path == "sm90a" and gpu_name not in WGMMA_FLOP_PER_CLK):
            continue
        r = (evaluate_sm90 if s.path == "sm90a" else evaluate)(s.design, gpu)
        r.update({k: v for k, v in s._asdict().items() if k != "design"})
        rows.append(r)
    return rows


def path_prediction(path: str, phase: str, head_dim: int = D, gpu_name: str = "H100") -> float:
    """The predicted TFLOP/s of the shipped `path` ("mma" | "sm90a") `phase` ("fwd" | "bwd")
    at `head_dim` on `gpu_name`."""
    for r in shipped_rows(gpu_name):
        if r["path"] == path and r["kind"] == phase and r["head_dim"] == head_dim:
            return r["predicted_tflops"]
    raise ValueError(f"path={path!r} phase={phase!r} head_dim={head_dim}: the model has "
                     f"rows for paths mma, sm90a, phases fwd, bwd, head dims "
                     f"{SHIPPED_HEAD_DIMS}")


def format_shipped(rows) -> str:
    head = (f"{'kernel':15} {'BM':>3} {'BN':>3} {'chunk':>5} {'st':>2} {'Q in':>9} {'WG':>2} "
            f"{'thr':>3} {'smem KB':>7} {'CTA':>3} {'tensor':>6} {'smem':>5} {'bound':>6} "
            f"{'ceiling':>7} {'predict':>7}")
    lines = ["the kernels as they ship (bf16, default plan tiles, H100): clocks per step per SM, "
             "TFLOP/s", head, "-" * len(head)]
    for r in rows:
        c = r["clocks"]
        lines.append(
            f"{r['path'] + '-' + r['kind'] + '-D' + str(r['head_dim']):15} {r['block_m']:3d} "
            f"{r['block_n']:3d} {r['chunk']:5d} {r['stages']:2d} {r['q_in']:>9} "
            f"{r['warpgroups']:2d} {r['threads']:3d} {r['smem'] / 1024:7.1f} "
            f"{r['ctas_per_sm']:3d} {c['tensor']:6d} {c['smem']:5d} {r['bound']:>6} "
            f"{r['ceiling_tflops']:7.0f} {r['predicted_tflops']:7.0f}")
    lines.append(f"sm90a: wgmma at {WGMMA_EFFICIENCY:.0%} of 4096 FLOP/clk, softmax half hidden "
                 "by two consumer warpgroups; mma-bwd: the dK/dV table's row (BQ: chunk)")
    return "\n".join(lines)


# ---- against a measurement ----------------------------------------------------------------

MEASURE_LENGTHS = (8192, 16384)
MEASURE_TOKENS = 16384     # one packed size for both lengths: compiled flex_attention compiles once
MEASURE_RUNNERS = ["cupy", "sdpa-flash", "sdpa-cudnn", "varlen", "flex"]


def comparison(report: dict, rows) -> str:
    """Measured TFLOP/s of every runner beside the H100 model's predictions for the current
    kernels (the cupy column) and for the FlashAttention-2 design point (torch's sdpa-flash
    runs FlashAttention-2), and the targets. Causal workloads add partial tiles and a tail."""
    fa2 = {r["design"]: r["predicted_tflops"] for r in rows if r["gpu"] == "H100"}
    peak = report.get("bf16_matmul_peak_tflops") or 0.0
    targets = measured_targets(report.get("cupy_backend", "cupy"))
    path = "sm90a" if targets is SM90A_TARGETS else "mma"
    model = {phase: path_prediction(path, phase) for phase in ("fwd", "bwd")}
    kernels = ("the sm_90a kernels (model: sm90a rows)" if path == "sm90a"
               else "the mma.sync kernels (model: mma rows)")
    lines = [f"predicted vs measured (TFLOP/s over visible pairs; bf16 matmul peak measured: "
             f"{peak:.0f}; model at 1.83 GHz; cupy runs {kernels})",
             f"{'workload':28} {'':4} {'model':>6} {'FA2 mdl':>7} {'target':>6} "
             + " ".join(f"{r:>10}" for r in MEASURE_RUNNERS)]
    for w in report.get("results", []):
        for phase in ("fwd", "bwd"):
            cells = []
            for r in MEASURE_RUNNERS:
                v = w["runners"].get(r, {}).get(phase, {}).get("tflops")
                cells.append(f"{v:10.0f}" if v else f"{'-':>10}")
            lines.append(f"{w['workload']:28} {phase:4} {model[phase]:6.0f} "
                         f"{fa2[phase + '-FA2']:7.0f} {targets[phase]:6.0f} " + " ".join(cells))
    return "\n".join(lines)


def measure(json_path: str, iters: int, backend: str = "cupy") -> int:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import bench
    torch, why = bench.gpu_stack()
    if torch is None:
        print(f"perf_model --measure: no usable GPU stack ({why}); nothing measured")
        return 0
    timer = bench.Timer(torch, iters)
    state = bench.Bench(torch, timer, bench.matmul_peak(torch, timer), 16, D, backend)
    work = [(f"uniform-L{L}-{'causal' if c else 'full'}", [L] * (MEASURE_TOKENS // L),
             [c] * (MEASURE_TOKENS // L)) for L in MEASURE_LENGTHS for c in (True, False)]
    tick = bench.Progress(len(work) * (1 + len(MEASURE_RUNNERS)))
    results = [bench.run_workload(state, w, MEASURE_RUNNERS, tick) for w in work]
    args = types.SimpleNamespace(json=json_path, png=os.path.splitext(json_path)[0] + ".png",
                                 tokens=MEASURE_TOKENS)
    bench.write_report(state, results, args)
    with open(json_path) as f:
        print(comparison(json.load(f), table()))
    if state.failed:
        print("perf_model --measure: a cupy parity check FAILED; its figures are not reported")
        return 2
    return 0


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the table (or, with --measure, the "
                    "benchmark report) as JSON to this path")
    ap.add_argument("--measure", action="store_true",
                    help="time the runners on this GPU and compare with the model")
    ap.add_argument("--iters", type=int, default=5, help="timed runs per figure (--measure)")
    ap.add_argument("--backend", default="cupy", choices=("cupy", "cupy:mma", "cupy:sm90a"),
                    help="what the measured cupy runner names (--measure; default: cupy, "
                         "whose default implementation runs): cupy:sm90a holds it to the "
                         "sm_90a targets")
    args = ap.parse_args(argv)
    rows = table()
    print(format_table(rows))
    print(format_wide(wide_table()))
    print(format_tiles(tile_rows()))
    print(format_shipped(shipped_rows()))
    if args.measure:
        return measure(args.json or os.path.join(ROOT, "out", "bench", "perf_model.json"),
                       args.iters, args.backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpus": [g._asdict() for g in GPUS], "targets": TARGETS,
                       "designs": [d._asdict() for d in DESIGNS], "rows": rows,
                       "wide_head_dims": wide_table(), "dkdv_tiles": tile_rows(),
                       "shipped": shipped_rows(),
                       "preferred_blocks": {str(d): b for d, b in
                                            preferred_blocks(tile_rows()).items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
