#!/usr/bin/env python
"""Compile every CuPy kernel variant with NVRTC for sm_80 and sm_90 and report its budget.

    python scripts/compile_kernels.py --json      # JSON list of {kernel, arch, registers,
                                                  #   spill_bytes, shared_bytes, shared_budget}
    python scripts/compile_kernels.py             # a table; exit status 1 on a spill or an
                                                  #   over-budget kernel

No GPU is needed: NVRTC produces cubin from the CUDA headers (`$CUDA_HOME/include` or the
nvidia-cuda-runtime wheel). shared_bytes = static + the dynamic shared memory of the launch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from varlen.backends import _cupy_compile, _cupy_spec  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON report only")
    ap.add_argument("--arch", action="append", choices=_cupy_spec.ARCHS,
                    help="architectures (default: all)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="parallel NVRTC processes")
    args = ap.parse_args(argv)
    archs = tuple(args.arch) if args.arch else _cupy_spec.ARCHS
    jobs = _cupy_compile.compile_groups(archs=archs)
    # Biggest programs first so the pool stays busy until the end.
    jobs.sort(key=lambda j: -len(j[1]))
    start = time.time()
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for done, group in enumerate(pool.map(_cupy_compile.run_group, jobs), 1):
            rows.extend(group)
            if not args.json:
                print(f"[{done}/{len(jobs)}] {group[0]['arch']} {len(group)} kernels "
                      f"({time.time() - start:.0f} s)", file=sys.stderr)
    rows.sort(key=lambda r: (r["arch"], r["kernel"]))
    bad = [r for r in rows if r["spill_bytes"] or r["shared_bytes"] > r["shared_budget"]]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'arch':6} {'regs':>4} {'spill':>5} {'smem':>7}  kernel")
        for r in rows:
            print(f"{r['arch']:6} {r['registers']:4d} {r['spill_bytes']:5d} "
                  f"{r['shared_bytes']:7d}  {r['kernel']}")
        print(f"{len(rows)} kernels, {len(bad)} over budget, {time.time() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
