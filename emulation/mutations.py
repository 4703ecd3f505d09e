"""Mutation test of the strict host emulation: remove each barrier or cp.async wait of the CuPy
kernels in turn and check that the emulation catches the removal.

    python emulation/mutations.py [--sites SUBSTRING ...] [--list] [--timeout S]
    python emulation/mutations.py --keep-bit      # dropout's keep-bit mutations (below)

Each call site of `__syncthreads()`, `__syncwarp()` and `cp_async_wait<N>()` in the kernel
sources (`kernels_cuda/*.cuh`, the emulation's own headers excepted) is removed from a copy of
the sources in a temporary directory, which the emulation then compiles
(`VARLEN_EMULATION_SOURCE_DIR`). The mutated kernels run, until one run fails:

1. `--strict --schedule random`: copies land at seeded random points after their poisoning,
   warps run one at a time in a seeded order (numerical detection, two seeds);
2. `--strict --schedule wait`: copies land only at their wait (random landing lands a copy
   issued chunks ahead long before it is read, hiding a missing wait for it);
3. `--strict --race`: the ThreadSanitizer build (a data race report);
4. the non-finite backward case of tests/emulation/test_cupy_edges.py (NaN in q) under both
   modes above: the barrier that orders the first chunk's delta stores before a NaN flag only
   matters there.

The device plan's kernels (`plan_build.cuh`) run a case of tests/emulation/test_plan_device.py
instead (300 sequences over the shipped scan and tile blocks, several warps each, so that every
thread has partial sums to publish), compared with the NumPy plan: with warps one at a time in a
seeded order, then under ThreadSanitizer.

Dropout's keep bit (`KEEP_BIT_MUTATIONS`, `--keep-bit`): each mutation of kernels_cuda/dropout.cuh
(a lane taking the word of another key, j & 3 off) runs its exact keep-set case of
tests/emulation/test_cupy_dropout.py, which must fail (tests/emulation/test_cupy_dropout.py runs
them too).

A mutation no run catches is a gap of the emulation (exit status 1). The strict cases reach three
partner chunks per block, so the barrier that ends a loop step is exercised (it only matters
from the third). Prints one line per mutation: the site, caught or not, by what, and the time.

The sm_90a kernels (`fwd_sm90.cuh`, `bwd_sm90.cuh`) have sites of their own: every
`mbar_wait`, `wgmma_wait<N>`, `wgmma_fence`, named barrier (`named_bar_sync`/`named_bar_arrive`),
`fence_proxy_async`, `fence_barrier_init` and `__syncthreads()` call. Their runs take cases of
emulation/sm90_cases.py (`SM90_CASES`): the forward's, the pipeline's case (two consumer
warpgroups in ping-pong, 1 to 6 key chunks per query tile, partial chunks whose boxes hold NaN
rows, a NaN in a present key; the persistent loop's 16 work items over 3 blocks, so Q's
handshake and the ring's phases run across items) and a sliding window's (items with a partial
chunk at both ends: the forward walks partial chunks first, so only there does a partial chunk
come after the first, whose `ready` the loop's wait covers); the backward's, four cases (two consumer
warpgroups, four query chunks per key tile: the ring wraps twice; a partial query chunk and a
ragged key tile, NaN in the pad rows; D = 256; then the deterministic mode, whose consumers'
barrier orders the dQ additions), with the threads free-running:

1. TMA copies landing and wgmma operands read at the latest moment (`wait`);
2. both at seeded random points (`random`, seed 1);
3. the ThreadSanitizer build, copies landing at random points.

A removed wait shows as a wrong or NaN output (a wgmma reads a poisoned stage or accumulator),
an abort of the emulated protocol (an arrival on an mbarrier with none pending, a thread
arriving twice at a named barrier in one phase, a wgmma without a fence, a wgmma operand whose
generic-proxy store no fence.proxy.async published or whose reader has not synchronised with
a fence after it, an stmatrix over an operand read by a thread it has not synchronised with;
in ordered dQ, an addition made before its block's turn or a release before every adder fenced),
a deadlock reported after VARLEN_EMULATION_TIMEOUT (20 s here), or a race.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIR = os.path.join(ROOT, "kernels_cuda")
SITE = re.compile(r"\b(__syncthreads\(\)|__syncwarp\(\)|cp_async_wait<[^<>;]+>\(\));")
# The sm_90a kernels' synchronisation: mbarrier waits, wgmma waits and fences, named barriers,
# proxy and barrier-init fences (arguments with one level of parentheses), and __syncthreads.
SM90_FILES = ("fwd_sm90.cuh", "bwd_sm90.cuh")
SM90_SITE = re.compile(
    r"\b((?:sm90::)?(?:mbar_wait|wgmma_wait<\d+>|wgmma_fence|named_bar_sync|named_bar_arrive|"
    r"fence_proxy_async|fence_barrier_init)\((?:[^;()]|\([^;()]*\))*\)|__syncthreads\(\));")
EMULATION = [sys.executable, "-m", "emulation", "--strict", "--fail-fast"]
TESTS = os.path.join(ROOT, "tests")
EDGE_CASE = [sys.executable, os.path.join(TESTS, "emulation", "test_cupy_edges.py"),
             "nonfinite-backward", "q"]
# (label, command, extra environment); the race runs re-execute under the TSan runtime.
RUNS = (("schedule", [*EMULATION, "--schedule", "random", "--seeds", "0,1"], {}),
        ("wait-landing", [*EMULATION, "--schedule", "wait", "--seeds", "0"], {}),
        ("race", [*EMULATION, "--race"], {}),
        ("schedule, NaN case", EDGE_CASE, {"VARLEN_EMULATION_SCHEDULE": "random"}),
        ("race, NaN case", EDGE_CASE, {"VARLEN_EMULATION_RACE": "1", "LD_PRELOAD": "tsan"}))
# The cases of emulation/sm90_cases.py each sm_90a kernel source's sites run.
SM90_CASES = {"fwd_sm90.cuh": ("B7-bf16-D64-BM128-chunks-1-2-3-6",
                                "B2-fp16-D64-BM128-window-masked-chunks"),
              "bwd_sm90.cuh": ("B2-bf16-D128-BN128-full-gqa", "B3-fp16-D64-BN128-deterministic-gqa",
                               "B3-bf16-D256-softcap-gqa-nan",
                               "B3-bf16-D128-BN128-deterministic-softcap-nan")}
SM90_ENV = {"VARLEN_EMULATION_TIMEOUT": "20", "OPENBLAS_NUM_THREADS": "1"}
# ... and the cases of a kernel's sites that run only with a mask_mod: the forward's class
# tables (tests/emulation/test_cupy_mods.py: chunk classes on 2 SMs, so that each block reuses
# both tables, and items left without a chunk); the backward producer's staged classes (query
# chunks the mask_mod empties, atomic and ordered dQ)
SM90_MOD_CASES = {"fwd_sm90.cuh": [sys.executable,
                                   os.path.join(TESTS, "emulation", "test_cupy_mods.py"),
                                   "sm90-classes", "first-tile"],
                  "bwd_sm90.cuh": [sys.executable, "-m", "emulation.sm90_cases",
                                   "B5-fp16-D64-BN64-prefix-lm-gqa-nan:bwd",
                                   "B3-bf16-D128-BN128-chunked-and-causal-ordered:bwd"]}
PLAN_CASE = [sys.executable, os.path.join(TESTS, "emulation", "test_plan_device.py"), "layout",
             "B300-many-mixed-16x8-shipped-threads"]
PLAN_RUNS = (("plan schedule", PLAN_CASE, {"VARLEN_EMULATION_SCHEDULE": "random",
                                           "VARLEN_EMULATION_SEED": "1"}),
             ("plan race", PLAN_CASE, {"VARLEN_EMULATION_RACE": "1", "LD_PRELOAD": "tsan"}))


def sm90_runs(name):
    """The runs of the cases of sm_90a kernel source `name`."""
    cases = [("sm90", [sys.executable, "-m", "emulation.sm90_cases", *SM90_CASES[name]])]
    if name in SM90_MOD_CASES:
        cases.append(("sm90 mask_mod", SM90_MOD_CASES[name]))
    return tuple(run for label, case in cases for run in (
        (f"{label} wait-landing", case, {**SM90_ENV, "VARLEN_EMULATION_SCHEDULE": "wait"}),
        (f"{label} random-landing", case, {**SM90_ENV, "VARLEN_EMULATION_SCHEDULE": "random",
                                           "VARLEN_EMULATION_SEED": "1"}),
        (f"{label} race", case, {**SM90_ENV, "VARLEN_EMULATION_RACE": "1",
                                 "LD_PRELOAD": "tsan"})))


# Waits that removing leaves correct, so that no run can catch it: (file, call, what the next
# line holds). The sm_90a backward's consumers wait for K and V to land (kv_full), to be
# sanitised (kv_ready), then for their first query chunk (ready of stage 0) before any read of
# K or V; every producer thread arrives on that ready only after it has waited on kv_full,
# sanitised its key rows, fenced and arrived on kv_ready (bwd_sm90_producer, in program order).
# So the ready wait alone orders the copy's bytes and the sanitising stores before the
# consumers' reads (release and acquire chain through the producer threads): the first two
# waits are defensive. (Each was removed in the sweep: no run failed.)
REDUNDANT = (("bwd_sm90.cuh", 'sm90::mbar_wait(sm.kv_full(), 0, "kv_full")',
              "mbar_wait(sm.kv_ready(), 0"),
             ("bwd_sm90.cuh", 'sm90::mbar_wait(sm.kv_ready(), 0, "kv_ready")',
              "for (int i = 0;; ++i)"))

# Waits that are needed but that no run of the emulation can catch removed: (file, call, what
# the next line holds, why). Left out of the sweep, named here rather than called redundant.
NOT_CATCHABLE = (
    ("fwd_sm90.cuh",
     'sm90::mbar_wait(sm.cls_empty(table), ring.table_parity() ^ 1u, "cls_empty")',
     "classify_chunks<Cfg>(sm.cls(table)",
     "the consumers overwrite a class table the item two back still reads only when that item "
     "kept no chunk and the producer lags a whole item behind; the emulation's free-running "
     "threads never lag that far, and its mbarriers share one lock per block, which "
     "ThreadSanitizer sees as ordering"),
)

# Mutations of dropout's keep bit (kernels_cuda/dropout.cuh), each caught by a case of
# tests/emulation/test_cupy_dropout.py (its keep set checked exactly against the rule):
# (file, text, replacement, what it breaks, the case that catches it).
KEEP_BIT_MUTATIONS = (
    ("dropout.cuh", "mine, half ^ p) >> (2 * p);", "mine, half ^ p) >> (2 - 2 * p);",
     "the forward takes the other lane pair's words (key j & 3 off by 2)", "keep-set"),
    ("dropout.cuh", "mine, 4 * (c ^ s)) >> s;", "mine, 4 * (c ^ s)) >> (s ^ 1);",
     "the dK/dV kernel takes a neighbour key's word (j & 3 ^ 1)", "keep-set"),
)


def sites(source_dir=SOURCE_DIR):
    """Every (file, line number, call) of a barrier or wait in the kernels, comments aside,
    but the REDUNDANT and NOT_CATCHABLE ones."""
    found = []
    for name in sorted(os.listdir(source_dir)):
        if not name.endswith(".cuh") or name.startswith("host_emulation"):
            continue
        site = SM90_SITE if name in SM90_FILES else SITE
        with open(os.path.join(source_dir, name)) as f:
            lines = f.readlines()
        for i, line in enumerate(lines, 1):
            m = site.search(line.split("//")[0])
            following = lines[i] if i < len(lines) else ""
            if m and not any(name == r[0] and m.group(1) == r[1] and r[2] in following
                             for r in (*REDUNDANT, *NOT_CATCHABLE)):
                found.append((name, i, m.group(1)))
    return found


def runs_for(site):
    """The runs that exercise the kernel of `site`."""
    if site[0] in SM90_FILES:
        return sm90_runs(site[0])
    return PLAN_RUNS if site[0] == "plan_build.cuh" else RUNS


def site_id(site):
    name, line, call = site
    return f"{name}:{line}:{call}"


def mutate(site, dst):
    """Copies the kernel sources to `dst` with `site` removed (line numbers kept)."""
    for name in os.listdir(SOURCE_DIR):
        if name.endswith((".cu", ".cuh")):
            shutil.copy(os.path.join(SOURCE_DIR, name), dst)
    name, line, call = site
    path = os.path.join(dst, name)
    with open(path) as f:
        lines = f.readlines()
    assert call + ";" in lines[line - 1], f"{site_id(site)} not found"
    lines[line - 1] = lines[line - 1].replace(call + ";", "/* removed */;", 1)
    with open(path, "w") as f:
        f.writelines(lines)


def _env(source_dir, extra):
    from emulation.cupy import TSAN_OPTIONS, tsan_runtime
    env = dict(os.environ, VARLEN_EMULATION_SOURCE_DIR=source_dir, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    for k in ("VARLEN_EMULATION_RACE", "VARLEN_EMULATION_SCHEDULE", "LD_PRELOAD"):
        env.pop(k, None)
    env.update(extra)
    if env.get("LD_PRELOAD") == "tsan":
        env["LD_PRELOAD"] = tsan_runtime()
        env.setdefault("TSAN_OPTIONS", TSAN_OPTIONS)
    return env


def verdict(output):
    """What a failed run's output says caught the mutation."""
    if "ThreadSanitizer" in output:
        kernel = re.search(r"ThreadSanitizer report \(above\) in kernel (\w+)", output)
        return f"TSan data race ({kernel.group(1) if kernel else 'report'})"
    m = re.search(r"host emulation: kernel (\w+).*?: (.{0,80})", output)
    if m:
        return f"emulation check in {m.group(1)}: {m.group(2)}"
    if "FAILED" in output or "AssertionError" in output or "Error" in output:
        return "numerical mismatch"
    return "failed run"


def check(site, runs=None, timeout=900):
    """Runs the mutated kernels (`runs`, by default those of the site's kernel); returns
    (caught by, seconds) with caught by None if missed."""
    runs = runs_for(site) if runs is None else runs
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="varlen_mutant_") as tmp:
        mutate(site, tmp)
        for label, cmd, extra in runs:
            try:
                proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp, extra), capture_output=True,
                                      text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return f"{label}: timed out after {timeout} s (a hang)", time.time() - t0
            if proc.returncode != 0:
                return f"{label}: {verdict(proc.stdout + proc.stderr)}", time.time() - t0
    return None, time.time() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", nargs="*", help="only sites whose file:line:call contains one of these")
    p.add_argument("--list", action="store_true", help="list the sites and exit")
    p.add_argument("--runs", nargs="*", help="only the runs whose label contains one of these "
                   "(labels: " + ", ".join(r[0] for r in RUNS + sm90_runs(SM90_FILES[0])
                                           + PLAN_RUNS) + ")")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--keep-bit", action="store_true",
                   help="run dropout's keep-bit mutations (KEEP_BIT_MUTATIONS) instead")
    args = p.parse_args(argv)
    if args.keep_bit:
        return keep_bit_main(args.timeout)
    todo = [s for s in sites()
            if not args.sites or any(x in site_id(s) for x in args.sites)]
    if args.list:
        print("\n".join(map(site_id, todo)))
        return 0
    missed = 0
    for site in todo:
        runs = [r for r in runs_for(site) if not args.runs or any(x in r[0] for x in args.runs)]
        by, seconds = check(site, runs, timeout=args.timeout)
        missed += by is None
        print(f"{'caught' if by else 'MISSED'}  {site_id(site)}: {by or 'no run failed'} "
              f"({seconds:.0f} s)", flush=True)
    print(f"{len(todo) - missed} of {len(todo)} removals caught")
    return 1 if missed else 0


def keep_bit_main(timeout=900):
    """Each of KEEP_BIT_MUTATIONS on a copy of the sources, its case run: caught or not."""
    case_file = os.path.join(TESTS, "emulation", "test_cupy_dropout.py")
    missed = 0
    for name, old, new, what, case in KEEP_BIT_MUTATIONS:
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="varlen_mutant_") as tmp:
            for f in os.listdir(SOURCE_DIR):
                if f.endswith((".cu", ".cuh")):
                    shutil.copy(os.path.join(SOURCE_DIR, f), tmp)
            path = os.path.join(tmp, name)
            with open(path) as f:
                text = f.read()
            assert text.count(old) == 1, f"{old!r} is not in {name} once"
            with open(path, "w") as f:
                f.write(text.replace(old, new))
            proc = subprocess.run([sys.executable, case_file, case], cwd=ROOT,
                                  env=_env(tmp, {}), capture_output=True, text=True,
                                  timeout=timeout)
        caught = proc.returncode != 0 and "keep bits differ" in proc.stdout + proc.stderr
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {name}: {what} ({case}, "
              f"{time.time() - t0:.0f} s)", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
