#!/usr/bin/env python
"""Compile every CuPy kernel variant with NVRTC for sm_80 and sm_90, and the sm_90a variants the
backend dispatches (`sm90.dispatched_specs`) for sm_90a, and report each one's budget.

    python scripts/compile_kernels.py --json      # JSON list of {kernel, arch, registers,
                                                  #   spill_bytes, shared_bytes, shared_budget,
                                                  #   threads, gpu, ctas_by_registers,
                                                  #   ctas_by_shared, ctas_by_threads,
                                                  #   ctas_per_sm}
    python scripts/compile_kernels.py             # a table; exit status 1 on a spill or an
                                                  #   over-budget kernel
    python scripts/compile_kernels.py --only 'fwd-float16-D64-*' --arch sm_80   # a subset
    python scripts/compile_kernels.py --only '*-dropout'     # the variants with dropout
                                                  #   (`KernelSpec.dropout`: every variant
                                                  #   has a twin with it)
    python scripts/compile_kernels.py --only '*-float16-*' --doc-table
        # the compile-budget table of docs/cupy_backend.md (float16 kernels, both archs)
    python scripts/compile_kernels.py --arch sm_90a --only 'fwd-sm90a-bfloat16-D128-*'
        # sm_90a variants (labels fwd-sm90a-... and bwd-sm90a-..., `sm90.FwdSpec.label`)
    python scripts/compile_kernels.py --list      # the configuration (kernel, arch, threads,
                                                  #   dynamic shared bytes), nothing compiled

Progress (one line per compiled program, with the elapsed time) goes to stderr in both modes.

No GPU is needed: NVRTC produces cubin from the CUDA headers (`$CUDA_HOME/include` or the
nvidia-cuda-runtime wheel). shared_bytes = static + the dynamic shared memory of the launch.
CTAs per SM are for the GPU of each architecture (sm_80: A100, sm_90: H100/H200), from the
compiled registers and shared bytes (`_cupy_compile.ctas_per_sm`). The sm_90a rows (arch
"sm_90a", one NVRTC program per variant, `sm90.compile_report`) give ptxas' registers at entry
(`__launch_bounds__(threads, 1)`; setmaxnreg moves them between warpgroups later) and count
CTAs per SM on an H100.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from varlen._cli import ArgumentParser, positive_int  # noqa: E402
import varlen.backends.cupy.compile as _cupy_compile  # noqa: E402
import varlen.backends.cupy.traits as _cupy_traits  # noqa: E402
import varlen.backends.cupy.mma as _cupy_mma  # noqa: E402
import varlen.backends.cupy.sm90 as _cupy_sm90  # noqa: E402

SM90_ARCH = "sm_90a"
ARCHS = (*_cupy_traits.ARCHS, SM90_ARCH)


def parse_args(argv):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the JSON report on stdout instead of the table")
    ap.add_argument("--arch", action="append", choices=ARCHS,
                    help="an architecture; repeat for several (default: all)")
    ap.add_argument("--only", action="append", metavar="GLOB",
                    help="only the variants whose label matches, e.g. fwd-float16-D64-BM64-BN64 "
                         "or 'bwd-*-D128-*'; repeat for several (default: every variant)")
    ap.add_argument("--doc-table", action="store_true",
                    help="print the Markdown table of docs/cupy_backend.md, \"Compile budget\" "
                         "(float16 kernels, registers on sm_80 and sm_90)")
    ap.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                    help="parallel NVRTC processes (default: the CPU count)")
    ap.add_argument("--list", action="store_true",
                    help="print the configuration of every selected kernel as JSON (kernel, "
                         "arch, threads, dynamic shared bytes) without compiling")
    args = ap.parse_args(argv)
    args.archs = tuple(args.arch) if args.arch else ARCHS
    args.specs = _cupy_mma.all_specs() if set(args.archs) - {SM90_ARCH} else []
    args.sm90_specs = (_cupy_sm90.dispatched_specs()
                       if SM90_ARCH in args.archs and not args.doc_table else [])
    if args.only:
        pick = lambda specs: [s for s in specs  # noqa: E731
                              if any(fnmatch.fnmatchcase(s.label, g) for g in args.only)]
        args.specs, args.sm90_specs = pick(args.specs), pick(args.sm90_specs)
        if not args.specs and not args.sm90_specs:
            ap.error(f"--only {' '.join(args.only)} matches no variant; labels look like "
                     f"{_cupy_mma.all_specs()[0].label} or "
                     f"{_cupy_sm90.dispatched_specs()[0].label}")
    return args


def configuration(specs, sm90_specs, archs=ARCHS) -> list:
    """What each compiled kernel is launched with, without compiling: rows {kernel, arch,
    threads, dynamic_smem}, the mma.sync kernels per arch of `archs` (sm_80, sm_90) and the
    sm_90a variants (arch sm_90a) when `archs` holds it."""
    rows = [{"kernel": name, "arch": arch, "threads": k.threads, "dynamic_smem": k.smem}
            for arch, names, launches in _cupy_compile.compile_groups(
                specs=specs, archs=tuple(a for a in archs if a != SM90_ARCH))
            for name, k in ((n, launches[n]) for n in names)]
    if SM90_ARCH in archs:
        rows += [{"kernel": s.name, "arch": SM90_ARCH, "threads": s.threads,
                  "dynamic_smem": s.smem} for s in sm90_specs]
    return rows


def run_sm90_job(job):
    """Compile one sm_90a variant (`sm90.compile_report`); its row of the JSON report."""
    _, spec = job
    u = _cupy_sm90.compile_report([spec])[spec.name]
    # The dynamic window includes SMEM_ALIGN's slack; ptxas reports no static shared memory.
    shared = u["static_smem"] + spec.smem
    return [{"kernel": spec.name, "arch": SM90_ARCH, "registers": u["registers"],
             "spill_bytes": u["spill_stores"] + u["spill_loads"], "shared_bytes": shared,
             "shared_budget": _cupy_traits.SMEM_BUDGET["sm_90"], "threads": spec.threads,
             "warnings": u["warnings"],
             **_cupy_compile.ctas_per_sm("sm_90", u["registers"], spec.threads, shared)}]


def _run(job):
    return run_sm90_job(job) if job[0] == SM90_ARCH else _cupy_compile.run_group(job)


def compile_all(jobs, workers: int, start: float) -> list:
    """Every job's rows, with a progress line on stderr as each program finishes."""
    total = sum(len(job[1]) if job[0] != SM90_ARCH else 1 for job in jobs)
    workers = max(1, min(workers, len(jobs)))
    print(f"compiling {total} kernel(s) in {len(jobs)} NVRTC program(s), {workers} process(es)",
          file=sys.stderr, flush=True)
    rows = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_run, job) for job in jobs]
        for done, fut in enumerate(as_completed(futures), 1):
            group = fut.result()
            rows.extend(group)
            print(f"[{done}/{len(jobs)}] {group[0]['arch']} {len(group)} kernels "
                  f"({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
    return rows


def _natural(name: str):
    """Sort key of a kernel name with its numbers compared as numbers (D = 32 before 128)."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def doc_table(rows) -> str:
    """The compile-budget table of docs/cupy_backend.md: one line per float16 kernel, its
    registers on sm_80 and sm_90, the larger spill and the shared bytes."""
    by_kernel = {}
    for r in rows:
        if "__half" in r["kernel"] and r["arch"] != SM90_ARCH:
            by_kernel.setdefault(r["kernel"], {})[r["arch"]] = r
    lines = ["| kernel (float16; bfloat16 within a few registers) | sm_80 regs | sm_90 regs | "
             "spills | shared bytes |", "|---|---|---|---|---|"]
    for name in sorted(by_kernel, key=_natural):
        arch = by_kernel[name]
        regs = [str(arch[a]["registers"]) if a in arch else "-" for a in ("sm_80", "sm_90")]
        spills = max(r["spill_bytes"] for r in arch.values())
        shared = max(r["shared_bytes"] for r in arch.values())
        lines.append(f"| `{name}` | {regs[0]} | {regs[1]} | {spills} | {shared} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print(json.dumps(configuration(args.specs, args.sm90_specs, args.archs), indent=1))
        return 0
    jobs = _cupy_compile.compile_groups(
        specs=args.specs, archs=tuple(a for a in args.archs if a != SM90_ARCH))
    # Biggest programs first so the pool stays busy until the end; the sm_90a variants (one
    # program each, the slowest) before them.
    jobs.sort(key=lambda j: -len(j[1]))
    jobs = [(SM90_ARCH, s) for s in args.sm90_specs] + jobs
    start = time.time()
    rows = compile_all(jobs, args.jobs, start)
    rows.sort(key=lambda r: (r["arch"], r["kernel"]))
    bad = [r for r in rows if r["spill_bytes"] or r["shared_bytes"] > r["shared_budget"]]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.doc_table:
        print(doc_table(rows))
    else:
        print(f"{'arch':6} {'regs':>4} {'spill':>5} {'smem':>7} {'CTAs/SM (regs, smem)':>20}"
              f"  kernel")
        for r in rows:
            ctas = (f"{r['gpu']} {r['ctas_per_sm']} ({r['ctas_by_registers']}, "
                    f"{r['ctas_by_shared']})")
            print(f"{r['arch']:6} {r['registers']:4d} {r['spill_bytes']:5d} "
                  f"{r['shared_bytes']:7d} {ctas:>20}  {r['kernel']}")
        print(f"{len(rows)} kernels, {len(bad)} over budget, {time.time() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
