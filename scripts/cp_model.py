#!/usr/bin/env python
"""Which context-parallel method to run, before booking the cluster: a cost model of
`varlen.comm`'s methods from 8 to 1024 ranks.

    python scripts/cp_model.py [--preset h100 | h200] [--tokens 1048576 --dist longtail]
        [--heads 32/8 --head-dim 128] [--mask causal | full | sliding:W]
        [--cp 8 16 32 64 128 256 512 1024] [--json out/cp_model/cp_model.json] [--png PATH]

For each cp it predicts one layer's forward and backward time per rank for ring, allgather,
ulysses (when Hq divides by cp) and usp(u) (u a divisor of the GPUs per node and of Hq), each
with the zigzag and the document partition (its default split threshold, which balances the
ranks' work), and prints the best. The terms:

* bytes: exactly what the rank's group counts (`varlen.comm.model.call_traffic`; equal to the
  counted bytes at cp <= 8, tests/test_comm_model.py and the usp worker under mpiexec), split
  into the node's links (NVLink) and the links between nodes (InfiniBand): a flat ring or
  all-gather longer than a node moves at the slowest link's pace; an all-to-all's bytes go to
  peers on the node and off it in proportion;
* compute: the plans' tile counts (the tiles `varlen.plan` keeps for the batch's mask: the
  classification the kernels run), times `BM x BN x (D + Dv) x 2` flops per query head
  (the backward 2.5x), at the preset's attention TFLOP/s; per ring step, the tiles of the
  visiting keys;
* overlap: a ring step takes the longer of its kernels and the next step's transfer (posted
  before the kernels run, as `varlen.comm` does); all-gathers and all-to-alls are not
  overlapped; every message pays the link's latency.

The busiest of the sampled ranks (all up to cp = 64, else 16 spread over the ranks) sets the
layer's time. The compute lower bound is the batch's
tiles over cp ranks with no communication. Presets (per GPU; assumptions, not measurements):
H100/H200 SXM nodes of 8 GPUs, NVLink 450 GB/s and 3 us, InfiniBand NDR 400 Gb/s (50 GB/s)
and 8 us, attention 500 TFLOP/s forward and 400 backward (FlashAttention 3 class, bf16,
D = 128); H200 moves the same over its links and computes as fast (its larger, faster memory
does not change these terms). Override any of them.

Results: a table per cp on stdout (the best method and scheme, each method's best time, bytes
over the links between nodes per rank), JSON with every figure, and a PNG of time per layer
against cp for each method.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from varlen.comm.model import ITEMSIZE, PRESETS, Batch, Cluster, model  # noqa: E402


def lengths_of(dist: str, tokens: int, seed: int = 0) -> list:
    """Document lengths: "uniform" (512..4096), "longtail" (log-normal, 16..8192, many short
    ones), or "single" (one document), `tokens` in all (the workloads of bench_cpu.py)."""
    if dist == "single":
        return [tokens]
    from bench_cpu import lengths_of as workload
    return workload("uniform" if dist == "uniform" else "longtail", tokens, seed)


def best(rows, cp):
    here = [r for r in rows if r["cp"] == cp]
    return min(here, key=lambda r: r["total"])


def name_of(r) -> str:
    return r["method"] + (f"({r['ulysses_size']})" if r["ulysses_size"] else "")


def report(result) -> str:
    rows = result["rows"]
    lines = ["| cp | best | fwd+bwd ms | / lower bound | flat ring ms | ulysses ms | "
             "inter-node MB/rank (best, flat ring) |", "|" + " --- |" * 7]
    for cp in sorted({r["cp"] for r in rows}):
        b = best(rows, cp)
        ring = min((r for r in rows if r["cp"] == cp and r["method"] == "ring"),
                   key=lambda r: r["total"])
        uly = [r for r in rows if r["cp"] == cp and r["method"] == "ulysses"]
        uly_ms = f"{1e3 * min(r['total'] for r in uly):.1f}" if uly else "-"
        lines.append(f"| {cp} | {name_of(b)} {b['scheme']} | {1e3 * b['total']:.1f} | "
                     f"{b['total'] / b['lower_bound']:.2f} | {1e3 * ring['total']:.1f} | "
                     f"{uly_ms} | {b['inter_bytes'] / 2**20:.1f}, "
                     f"{ring['inter_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def targets(result) -> dict:
    """At each cp: the chosen method's time over the compute lower bound, the flat ring's
    (zigzag), and usp(gpus per node)'s bytes over the links between nodes per rank against the
    flat ring's (zigzag); and the order of ring, ulysses and usp (zigzag: the layout of the
    published per-GPU figures)."""
    rows, out = result["rows"], {}
    u = int(result["cluster"]["gpus_per_node"])
    for cp in sorted({r["cp"] for r in rows}):
        here = [r for r in rows if r["cp"] == cp]
        b = best(rows, cp)
        ring = [r for r in here if r["method"] == "ring" and r["scheme"] == "zigzag"][0]
        usp = [r for r in here if r["method"] == "usp" and r["ulysses_size"] == u and
               r["scheme"] == "zigzag"]
        t = {"chosen": f"{name_of(b)} {b['scheme']}",
             "chosen / lower bound": b["total"] / b["lower_bound"],
             "flat ring (zigzag) / lower bound": ring["total"] / ring["lower_bound"]}
        if usp and ring["inter_bytes"]:
            t[f"usp({u}) / flat ring inter-node bytes per rank (zigzag)"] = \
                usp[0]["inter_bytes"] / ring["inter_bytes"]
        order = sorted((r for r in here if r["scheme"] == "zigzag" and r["method"] != "allgather"),
                       key=lambda r: r["total"])
        t["order (zigzag, fastest first)"] = [name_of(r) for r in order]
        out[cp] = t
    return out


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    cps = sorted({r["cp"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = sorted({name_of(r) for r in rows}, key=lambda n: (n[:3], len(n), n))
    for n in names:
        xs, ys = [], []
        for cp in cps:
            here = [r["total"] for r in rows if r["cp"] == cp and name_of(r) == n]
            if here:
                xs.append(cp)
                ys.append(1e3 * min(here))
        ax.plot(xs, ys, marker="o", label=n)
    lb = [1e3 * best(rows, cp)["lower_bound"] for cp in cps]
    ax.plot(cps, lb, "k--", label="compute lower bound")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cp (GPUs)")
    ax.set_ylabel("forward + backward per layer (ms)")
    c, b = result["cluster"], result["batch"]
    ax.set_title(f"{c['name']}\n{len(b['lengths'])} documents, {sum(b['lengths'])} tokens, "
                 f"Hq {b['heads_q']} / Hk {b['heads_k']}, D {b['head_dim']}, {b['mask']}",
                 fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h100")
    for f in ("gpus_per_node", "tflops_fwd", "tflops_bwd", "intra_gbps", "intra_lat_us",
              "inter_gbps", "inter_lat_us"):
        ap.add_argument("--" + f.replace("_", "-"), type=float, default=None,
                        help=f"override the preset's {f}")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--dist", choices=["uniform", "longtail", "single"], default="longtail")
    ap.add_argument("--lengths", default=None,
                    help="comma-separated document lengths (instead of --dist/--tokens)")
    ap.add_argument("--heads", default="32/8", help="Hq/Hk")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-dim-v", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(ITEMSIZE))
    ap.add_argument("--mask", default="causal", help="causal, full or sliding:W")
    ap.add_argument("--cp", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--json", default=os.path.join(ROOT, "out", "cp_model", "cp_model.json"))
    ap.add_argument("--png", default=None, help="plot (default: beside the JSON)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    cl = PRESETS[a.preset]
    over = {f: (int(v) if f == "gpus_per_node" else v) for f in (
        "gpus_per_node", "tflops_fwd", "tflops_bwd", "intra_gbps", "intra_lat_us", "inter_gbps",
        "inter_lat_us") if (v := getattr(a, f)) is not None}
    if over:
        cl = Cluster(**{**asdict(cl), **over, "name": cl.name + " (modified)"})
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else lengths_of(a.dist,
                                                                                 a.tokens)
    hq, hk = (int(x) for x in a.heads.split("/"))
    b = Batch(tuple(lengths), hq, hk, a.head_dim, a.head_dim_v or a.head_dim, a.dtype, a.mask)
    result = model(cl, b, a.cp)
    result["command"] = " ".join(["scripts/cp_model.py"] + (argv or sys.argv[1:]))
    result["targets"] = targets(result)
    print(report(result))
    for cp, t in result["targets"].items():
        print(f"\ncp {cp}:")
        for k, v in t.items():
            print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    png = a.png or os.path.splitext(a.json)[0] + ".png"
    plot(result, png)
    print(f"\nJSON: {a.json}\nPNG: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
