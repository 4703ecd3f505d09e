"""Mutation test of the strict host emulation: remove each barrier or cp.async wait of the CuPy
kernels in turn and check that the emulation catches the removal.

    python scripts/emulation_mutations.py [--sites SUBSTRING ...] [--list] [--timeout S]

Each call site of `__syncthreads()`, `__syncwarp()` and `cp_async_wait<N>()` in the kernel
sources (`kernels_cuda/*.cuh`, the emulation's own headers excepted) is removed from a copy of
the sources in a temporary directory, which the emulation then compiles
(`VARLEN_EMULATION_SOURCE_DIR`). The mutated kernels run, until one run fails:

1. `--strict --schedule random`: copies land at seeded random points after their poisoning,
   warps run one at a time in a seeded order (numerical detection, two seeds);
2. `--strict --schedule wait`: copies land only at their wait (random landing lands a copy
   issued chunks ahead long before it is read, hiding a missing wait for it);
3. `--strict --race`: the ThreadSanitizer build (a data race report);
4. the non-finite backward case of tests/test_cupy_edges.py (NaN in q) under both modes above:
   the barrier that orders the first chunk's delta stores before a NaN flag only matters there.

A mutation no run catches is a gap of the emulation (exit status 1). The strict cases reach three
partner chunks per block, so the barrier that ends a loop step is exercised (it only matters
from the third). Prints one line per mutation: the site, caught or not, by what, and the time.
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
EMULATION = [sys.executable, "-m", "varlen.backends._cupy_emulation", "--strict", "--fail-fast"]
EDGE_CASE = [sys.executable, os.path.join(ROOT, "tests", "test_cupy_edges.py"),
             "nonfinite-backward", "q"]
# (label, command, extra environment); the race runs re-execute under the TSan runtime.
RUNS = (("schedule", [*EMULATION, "--schedule", "random", "--seeds", "0,1"], {}),
        ("wait-landing", [*EMULATION, "--schedule", "wait", "--seeds", "0"], {}),
        ("race", [*EMULATION, "--race"], {}),
        ("schedule, NaN case", EDGE_CASE, {"VARLEN_EMULATION_SCHEDULE": "random"}),
        ("race, NaN case", EDGE_CASE, {"VARLEN_EMULATION_RACE": "1", "LD_PRELOAD": "tsan"}))


def sites(source_dir=SOURCE_DIR):
    """Every (file, line number, call) of a barrier or wait in the kernels, comments aside."""
    found = []
    for name in sorted(os.listdir(source_dir)):
        if not name.endswith(".cuh") or name.startswith("host_emulation"):
            continue
        with open(os.path.join(source_dir, name)) as f:
            for i, line in enumerate(f, 1):
                m = SITE.search(line.split("//")[0])
                if m:
                    found.append((name, i, m.group(1)))
    return found


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
    from varlen.backends._cupy_emulation import TSAN_OPTIONS, tsan_runtime
    env = dict(os.environ, VARLEN_EMULATION_SOURCE_DIR=source_dir, PYTHONUNBUFFERED="1")
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


def check(site, runs=RUNS, timeout=900):
    """Runs the mutated kernels; returns (caught by, seconds) with caught by None if missed."""
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
                   f"(labels: {', '.join(r[0] for r in RUNS)})")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    args = p.parse_args(argv)
    runs = [r for r in RUNS if not args.runs or any(x in r[0] for x in args.runs)]
    todo = [s for s in sites()
            if not args.sites or any(x in site_id(s) for x in args.sites)]
    if args.list:
        print("\n".join(map(site_id, todo)))
        return 0
    missed = 0
    for site in todo:
        by, seconds = check(site, runs, timeout=args.timeout)
        missed += by is None
        print(f"{'caught' if by else 'MISSED'}  {site_id(site)}: {by or 'no run failed'} "
              f"({seconds:.0f} s)", flush=True)
    print(f"{len(todo) - missed} of {len(todo)} removals caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
