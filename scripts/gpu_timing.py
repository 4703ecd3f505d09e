#!/usr/bin/env python
"""The timing step of scripts/gpu_check.sh: the CuPy kernels against torch SDPA on one GPU, no
torch.compile, each figure written as one JSON line (and flushed) the moment it is measured,
so a run cut short at its limit keeps every figure it reached.

    python scripts/gpu_timing.py [--runners sm90a,mma,sdpa-flash,sdpa-cudnn] [--json F]
                                 [--iters 10]
    python scripts/gpu_timing.py --launch fwd|bwd --runners sm90a   # one launch (for ncu)
    python scripts/gpu_timing.py --table F        # the table of a results file (no GPU)

Order: the bf16 matmul peak (8192^3, torch.matmul); then per workload (8k and 16k tokens per
sequence, causal and full; 16k tokens, 16 heads, D 128, bf16) the full-size output of each
CuPy runner against SDPA's (relative to max |SDPA out|, bench.FULL_SIZE_TOL), then each
runner's forward and backward: 3 warm-up runs, the median of --iters runs timed with CUDA
events, the L2 flushed before each (scripts/bench.py's Timer). TFLOP/s count visible pairs only
(bench.flops). Runners: sm90a (backend "cupy:sm90a"), mma ("cupy:mma"), sdpa-flash,
sdpa-cudnn. Lines of --json's file ("kind" first):
  {"kind": "matmul_peak", "tflops"}
  {"kind": "check", "workload", "runner", "max_diff", "scale", "ok"}
  {"kind": "timing", "workload", "runner", "phase", "seconds", "tflops", "pct_of_peak",
   "model_tflops"}                     (model_tflops: scripts/perf_model.py's prediction of the
                                        path that ran, for sm90a and mma; else null)
  {"kind": "error", "workload", "runner", "error"}
Exit status 2 when a full-size check failed, 1 when a CuPy runner failed (an SDPA backend that
cannot run is recorded as an error line and fails nothing), else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from varlen._cli import ArgumentParser, name_list, positive_int  # noqa: E402

LENGTHS = (8192, 16384)
TOKENS = 16384
HEADS = 16
HEAD_DIM = 128
RUNNERS = ("sm90a", "mma", "sdpa-flash", "sdpa-cudnn")
CUPY_RUNNERS = {"sm90a": "cupy:sm90a", "mma": "cupy:mma"}
PHASES = ("fwd", "bwd")


class Results:
    """Appends one JSON object per line to `path` (nothing when None), flushed at once. Every
    record names the kernels' poll limit (`$VARLEN_POLL_LIMIT`, 0 when unset): a figure from a
    build with it on is a diagnosis build's (the sm_90a backward spills there, docs/hopper.md
    "Hangs"), not the shipped kernels'."""

    def __init__(self, path: str | None):
        self.path = path
        self.poll_limit = int(os.environ.get("VARLEN_POLL_LIMIT", "").strip() or 0)

    def write(self, **record) -> dict:
        record.setdefault("poll_limit", self.poll_limit)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return record


def workloads():
    """(label, lengths, causal flags) of every timed workload, in order."""
    return [(f"L{L}-{'causal' if c else 'full'}", [L] * (TOKENS // L), [c] * (TOKENS // L))
            for L in LENGTHS for c in (True, False)]


def model_tflops(runner: str, phase: str):
    """The performance model's H100 prediction of the path `runner` runs (None for SDPA)."""
    if runner not in CUPY_RUNNERS:
        return None
    import perf_model
    return round(perf_model.path_prediction(runner, phase), 1)


def sdpa_reference(torch, d):
    """SDPA's output of a uniform workload, back in the packed [T, H, D] layout."""
    import torch.nn.functional as F
    L = d.lengths[0]
    B = len(d.lengths)
    shape = lambda x: x.view(B, L, d.H, d.D).transpose(1, 2)  # noqa: E731
    with torch.no_grad():
        out = F.scaled_dot_product_attention(shape(d.q), shape(d.k), shape(d.v),
                                             is_causal=d.causal[0])
    return out.transpose(1, 2).reshape(d.T, d.H, d.D)


def prepare(torch, bench, d, runner):
    """(fwd, bwd, full-size output or None) of one runner on one workload."""
    if runner in CUPY_RUNNERS:
        return bench.run_cupy(torch, d, backend=CUPY_RUNNERS[runner])
    return bench.run_sdpa(torch, d, runner.split("-")[1])


def measure(args) -> int:
    import bench
    torch, why = bench.gpu_stack()
    if torch is None:
        print(f"gpu_timing: no usable GPU stack ({why}); nothing measured")
        return 1
    out = Results(args.json)
    timer = bench.Timer(torch, args.iters)
    peak = bench.matmul_peak(torch, timer)
    out.write(kind="matmul_peak", tflops=peak)
    print(f"bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    status = 0
    for label, lengths, causal in workloads():
        d = bench.Data(torch, lengths, causal, HEADS, HEAD_DIM, torch.bfloat16)
        fl = bench.flops(lengths, causal, HEADS, HEAD_DIM)
        ref = sdpa_reference(torch, d)
        for runner in args.runners:
            try:
                fwd, bwd, full = prepare(torch, bench, d, runner)
                if full is not None:
                    diff = (full.float() - ref.float()).abs().max().item()
                    scale = ref.float().abs().max().item()
                    ok = diff <= bench.FULL_SIZE_TOL * max(scale, 1e-6)
                    out.write(kind="check", workload=label, runner=runner, max_diff=diff,
                              scale=scale, ok=ok)
                    print(f"{label} {runner} full-size vs SDPA: max |diff| {diff:.3e} "
                          f"({'ok' if ok else 'FAILED'})", flush=True)
                    status = status if ok else 2
                for phase, fn in zip(PHASES, (fwd, bwd)):
                    t = timer(fn)
                    tf = fl[phase] / t / 1e12
                    out.write(kind="timing", workload=label, runner=runner, phase=phase,
                              seconds=t, tflops=tf, pct_of_peak=100.0 * tf / peak,
                              model_tflops=model_tflops(runner, phase))
                    print(f"{label} {runner} {phase} {t * 1e3:.3f} ms {tf:.0f} TFLOP/s",
                          flush=True)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                out.write(kind="error", workload=label, runner=runner,
                          error=f"{type(e).__name__}: {e}")
                if runner in CUPY_RUNNERS:        # a peer that cannot run fails nothing
                    status = status or 1
    if args.json:
        print(table(read(args.json)))
    return status


def launch(args) -> int:
    """One forward (and, for bwd, the backward after it) of the first runner at 8k, full."""
    import bench
    torch, why = bench.gpu_stack()
    if torch is None:
        print(f"gpu_timing: no usable GPU stack ({why})")
        return 1
    runner = args.runners[0]
    d = bench.Data(torch, [8192, 8192], [False, False], HEADS, HEAD_DIM, torch.bfloat16)
    fwd, bwd, _ = prepare(torch, bench, d, runner)
    if args.launch == "bwd":
        bwd()
    else:
        fwd()
    torch.cuda.synchronize()
    print(f"one {args.launch} launch of {runner} done")
    return 0


def read(path: str) -> list:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    rows.append({"kind": "unreadable", "line": line[:80]})
    return rows


def table(rows) -> str:
    """The timing table of a results file: TFLOP/s per workload, phase and runner, the model's
    prediction of each CuPy path that ran beside it, the checks and errors."""
    peak = next((r["tflops"] for r in rows if r.get("kind") == "matmul_peak"), None)
    timed = [r for r in rows if r.get("kind") == "timing"]
    runners = [n for n in RUNNERS if any(r["runner"] == n for r in timed)]
    models = [n for n in runners if n in CUPY_RUNNERS]
    head = (f"{'workload':14} {'ph':3} " + " ".join(f"{n:>10}" for n in runners)
            + "".join(f" {'mdl ' + n:>10}" for n in models))
    lines = [f"timing table (TFLOP/s; bf16 matmul peak "
             f"{'%.0f' % peak if peak else '-'}; model: scripts/perf_model.py, H100, the path "
             "that ran)", head]
    for label, _, _ in workloads():
        for phase in PHASES:
            got = {r["runner"]: r for r in timed
                   if r["workload"] == label and r["phase"] == phase}
            if not got:
                continue
            cells = [f"{got[n]['tflops']:10.0f}" if n in got else f"{'-':>10}" for n in runners]
            mdl = [f" {got[n]['model_tflops']:10.0f}" if n in got and got[n].get("model_tflops")
                   else f" {'-':>10}" for n in models]
            lines.append(f"{label:14} {phase:3} " + " ".join(cells) + "".join(mdl))
    for r in rows:
        if r.get("kind") == "check" and not r.get("ok"):
            lines.append(f"FAILED full-size check: {r['workload']} {r['runner']} max |diff| "
                         f"{r['max_diff']:.3e} (max |SDPA| {r['scale']:.3e})")
        elif r.get("kind") == "error":
            lines.append(f"error: {r['workload']} {r['runner']}: {r['error'][:90]}")
    if not timed:
        lines.append("no timing figure")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runners", type=name_list(RUNNERS), default=list(RUNNERS),
                    help=f"comma-separated, from {', '.join(RUNNERS)} (default: all)")
    ap.add_argument("--json", default=None, help="append the figures to this JSON-lines file")
    ap.add_argument("--iters", type=positive_int, default=10, help="timed runs per figure (median)")
    ap.add_argument("--launch", choices=PHASES, default=None,
                    help="one forward or backward launch of the first runner (8k, full)")
    ap.add_argument("--table", metavar="FILE", default=None,
                    help="print the table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(read(args.table)))
        return 0
    if args.launch:
        if args.runners[0] not in CUPY_RUNNERS:
            ap.error(f"--launch profiles a CuPy runner; --runners starts with "
                     f"{args.runners[0]!r}, expected one of {', '.join(CUPY_RUNNERS)}")
        return launch(args)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
