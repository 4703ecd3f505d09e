#!/usr/bin/env python
"""Compile, before any timed GPU step of scripts/gpu_check.sh, every module its later steps
launch, in parallel processes, so that no test, timing or profile compiles inside its limit:

    python scripts/gpu_warm.py --mode sm90a|cupy [--jobs N] [--list]

  --mode cupy   every mma.sync variant without dropout (`mma.all_specs`: the GPU tests take
                every head dim and tile) and the dropout ones the GPU tests run
                (`dropout_specs`) into CuPy's disk cache, and the plan kernels; in a process of
                its own the sm_90a cubin of the primitives' harness (emulation/sm90_primitives.py:
                the check's primitives step, both modes)
  --mode sm90a  the sm_90a cubins the backend dispatches (`sm90.dispatched_specs`) into the
                cubin cache on three quarters of the processes, at the same time as the
                mma.sync modules of the steps that run the mma.sync path beside it (D 64 and
                128 at the default plan tiles, with and without a softcap) and the auxiliary
                modules the sm_90a backward launches (preprocessing and dQ conversion at every
                sm_90a head dim), then the plan kernels
  --list        print what would be compiled and exit (no GPU, no compiler needed)
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from varlen._cli import ArgumentParser, positive_int  # noqa: E402

MMA_HEAD_DIMS_BESIDE_SM90 = (64, 128)     # parity_mma and timing in --sm90a mode


def mma_specs(mode: str) -> list:
    from varlen.backends.cupy import mma
    from varlen.backends.cupy.traits import DTYPES, KINDS, SM90_HEAD_DIMS, default_blocks
    if mode == "cupy":
        # every variant without dropout, and the dropout variants the GPU tests launch
        # (tests/gpu/test_cupy_gpu.py::test_dropout_parity)
        return [s for s in mma.all_specs() if not s.dropout] + dropout_specs()
    # at the default plan tiles, which the parity tests (plan=None) and the timing run with
    specs = [mma.KernelSpec(kind, dtype, d, *default_blocks(d), softcap) for kind in KINDS
             for dtype in DTYPES for d in MMA_HEAD_DIMS_BESIDE_SM90 for softcap in (False, True)]
    # the sm_90a backward's preprocessing and conversion (sm90.backward's `aux` spec)
    aux = [mma.KernelSpec("bwd", dtype, d, 64, 64, False) for dtype in DTYPES
           for d in SM90_HEAD_DIMS]
    return specs + [s for s in aux if s not in specs]


def dropout_specs() -> list:
    """The dropout variants of tests/gpu/test_cupy_gpu.py (D 64 and 128 at the default plan
    tiles, no softcap): warming every dropout twin would double the warm-up."""
    from varlen.backends.cupy import mma
    from varlen.backends.cupy.traits import DTYPES, KINDS, default_blocks
    return [mma.KernelSpec(kind, dtype, d, *default_blocks(d), False, dropout=True)
            for kind in KINDS for dtype in DTYPES for d in MMA_HEAD_DIMS_BESIDE_SM90]


def sm90_specs(mode: str) -> list:
    if mode != "sm90a":
        return []
    from varlen.backends.cupy import sm90
    return sm90.dispatched_specs()


def warm_plan() -> None:
    from varlen.backends.cupy import plan
    for name in plan.KERNELS:
        plan._function(name)


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("cupy", "sm90a"), required=True)
    ap.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                    help="compiling processes (default: the CPU count)")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    args = ap.parse_args(argv)
    mmas, sm90s = mma_specs(args.mode), sm90_specs(args.mode)
    if args.list:
        for s in sm90s:
            print("sm90a", s.label)
        for s in mmas:
            print("mma", s.label)
        print(f"{len(sm90s)} sm_90a cubins, {len(mmas)} mma.sync modules, the plan kernels, "
              "the primitives' harness")
        return 0
    t0 = time.perf_counter()
    # the cubins (NVRTC only, 72 big programs) and CuPy's modules (about 20 small ones)
    # compile at the same time, the CPUs split
    # (with the primitives' harness first among them, or alone)
    sm90_jobs = max(1, args.jobs * 3 // 4) if sm90s else 1
    errors = []

    def cubins():
        # spawned, as CuPy's pool is: no fork of a process with threads
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from emulation.sm90_primitives import harness_cubin
        from varlen.backends.cupy.compile import cubin_path
        try:
            with ProcessPoolExecutor(sm90_jobs,
                                     mp_context=multiprocessing.get_context("spawn")) as pool:
                harness = pool.submit(harness_cubin)
                n = len(list(pool.map(cubin_path, [s.name for s in sm90s])))
                harness.result()
            print(f"{n} sm_90a cubins and the primitives' harness "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as e:  # noqa: BLE001
            errors.append(f"sm_90a cubins: {type(e).__name__}: {e}")

    thread = threading.Thread(target=cubins)
    thread.start()
    try:
        from varlen.backends.cupy import mma
        done = mma.warm_cache(mmas, jobs=max(1, args.jobs - sm90_jobs))
        print(f"{len(done)} mma.sync modules ({time.perf_counter() - t0:.0f} s)", flush=True)
        warm_plan()
        print(f"plan kernels ({time.perf_counter() - t0:.0f} s)", flush=True)
    except Exception as e:  # noqa: BLE001
        errors.append(f"mma.sync modules: {type(e).__name__}: {e}")
    thread.join()
    for e in errors:
        print(e, file=sys.stderr)
    print(f"warm-up {'FAILED' if errors else 'done'} in {time.perf_counter() - t0:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
