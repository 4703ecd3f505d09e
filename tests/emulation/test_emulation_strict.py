"""The strict host emulation (emulation/cuda/host_emulation.cuh) catches what a GPU would.

* Each check fires: tiny misbehaving kernels, compiled with the emulation into one test program,
  overrun their shared memory (the guard page), split a warp over two ldmatrix call sites, let
  a lane exit before an mma, load an ldmatrix and copy with cp.async with bank conflicts, read a
  cp.async destination before its wait (poisoned) and race two warps over shared memory
  (ThreadSanitizer); the schedule modes permute warps and move copy landings with the seed.
  Their well-behaved twins pass.
* The shipped kernels pass every mode on the strict case (three partner chunks per block): the
  race build without a report, each copy-landing schedule with permuted warps and several seeds.
* Removing a barrier or a cp.async wait from the kernels is caught (emulation/mutations.py):
  a representative subset here; every site with VARLEN_EMULATION_MUTATIONS=all (slow).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

import emulation.mutations as emulation_mutations
from emulation.cupy import EMULATION_DIR

from helpers import cases, emulate

CXX = os.environ.get("CXX", "g++")
needs_cxx = pytest.mark.skipif(shutil.which(CXX) is None,
                               reason="needs a C++20 compiler (host emulation)")

PROGRAM = r"""
#include "common.cuh"
#include "mma.cuh"
#include <cstdio>
#include <mutex>
#include <string>

using namespace varlen;
constexpr size_t SMEM = 4096;

// Two call sites of the same collective.
__attribute__((noipa)) static void load_a(uint32_t (&r)[4], const void* p) { ldmatrix_x4(r, p); }
__attribute__((noipa)) static void load_b(uint32_t (&r)[4], const void* p) { ldmatrix_x4(r, p); }

// argv: what [landing [seed]]; a seed turns the turnstile on.
int main(int argc, char** argv) {
    const std::string what = argv[1];
    hostemu::g_config = hostemu::Config{argc > 2 ? std::atoi(argv[2]) : 0, argc > 3,
                                        argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 0,
                                        /*strict_copy_banks=*/true};
    if (what == "overrun" || what == "in-bounds") {
        const size_t at = what == "overrun" ? SMEM : SMEM - 1;
        launch("overrun_demo", 1, 1, 32, SMEM, [&] { if (threadIdx.x == 0) smem_raw[at] = 1; });
    } else if (what == "diverge" || what == "converge") {
        const bool diverge = what == "diverge";
        launch("diverge_demo", 1, 1, 32, SMEM, [&] {
            uint32_t r[4];
            const unsigned char* p = smem_raw + (threadIdx.x % 8) * 144;
            if (diverge && threadIdx.x >= 16) load_b(r, p); else load_a(r, p);
        });
    } else if (what == "exited") {
        launch("exit_demo", 1, 1, 32, SMEM, [&] {
            if (threadIdx.x == 5) return;
            float d[4] = {0, 0, 0, 0};
            const uint32_t a[4] = {0, 0, 0, 0};
            mma_16816<__half>(d, a, 0u, 0u);
        });
    } else if (what == "conflict" || what == "padded") {
        const int stride = what == "conflict" ? 128 : 144;     // D = 64 without / with SMEM_PAD
        launch("bank_demo", 1, 1, 32, SMEM, [&] {
            uint32_t r[4];
            ldmatrix_x4(r, smem_raw + (threadIdx.x % 8) * stride + (threadIdx.x / 8) * 16);
        });
    } else if (what == "copy-conflict" || what == "copy-clean") {
        // 16-byte copies of a quarter-warp 128 bytes apart (one bank group) or side by side.
        static uint4 src[32] = {};
        const int step = what == "copy-conflict" ? 128 : 16;
        launch("copy_demo", 1, 1, 32, SMEM, [&] {
            cp_async_16(smem_raw + threadIdx.x * step, src + threadIdx.x, true);
            cp_async_commit();
            cp_async_wait<0>();
        });
    } else if (what == "unwaited" || what == "waited" || what == "unwaited4" || what == "waited4") {
        // Each lane copies 16 (or 4) bytes of zeros and reads them back, before or after its
        // wait.
        static uint4 src[32] = {};
        const bool four = what.back() == '4';
        launch("unwaited_demo", 1, 1, 32, SMEM, [&] {
            uint4* dst = reinterpret_cast<uint4*>(smem_raw) + threadIdx.x;
            if (four) cp_async_4(dst, src + threadIdx.x, true);
            else cp_async_16(dst, src + threadIdx.x, true);
            cp_async_commit();
            __syncwarp();
            __syncwarp();
            if (what[0] == 'w') cp_async_wait<0>();
            if (dst->x != 0) std::printf("poisoned %u\n", threadIdx.x);
            cp_async_wait<0>();
        });
    } else if (what == "race" || what == "no-race") {
        // Warp 0 writes a row that warp 1 reads, with or without a barrier between.
        launch("race_demo", 1, 1, 64, SMEM, [&] {
            if (threadIdx.x < 32) smem_raw[threadIdx.x] = 1;
            if (what == "no-race") __syncthreads();
            volatile unsigned char x = threadIdx.x >= 32 ? smem_raw[threadIdx.x - 32] : 0;
            (void)x;
        });
    } else if (what == "order") {
        // The order in which warps pass the code between two barriers, twice.
        std::mutex m;
        std::string log;
        launch("order_demo", 1, 1, 128, SMEM, [&] {
            for (int phase = 0; phase < 2; ++phase) {
                { std::lock_guard g(m); log += char('0' + threadIdx.x / 32); }
                __syncthreads();
            }
        });
        std::printf("order %s\n", log.c_str());
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The test program, built plain and with ThreadSanitizer."""
    from varlen.kernels_cuda import SOURCE_DIR
    d = tmp_path_factory.mktemp("emulation_checks")
    src = d / "checks.cc"
    src.write_text(PROGRAM)
    built = {}
    for name, flags in (("plain", []), ("tsan", ["-fsanitize=thread", "-fno-builtin"])):
        exe = d / name
        subprocess.run([CXX, "-x", "c++", "-std=c++20", "-O1", "-pthread", *flags,
                        "-DVARLEN_HOST_EMULATION", f"-I{SOURCE_DIR}", f"-I{EMULATION_DIR}",
                        str(src), "-o", str(exe)],
                       check=True)
        built[name] = str(exe)
    return built


def _run(exe, *args):
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env=env)


@needs_cxx
@pytest.mark.parametrize("bad, good, message", [
    ("overrun", "in-bounds", r"overrun_demo, block \(0, 0\), thread 0: shared-memory access at "
                             r"byte 4096, past the 4096 bytes"),
    ("diverge", "converge", r"diverge_demo.*disagree at a warp collective: lane (15|31) at "
                            r"ldmatrix #1 \(call site 0x[0-9a-f]+\), lane (16|0) at ldmatrix #1"),
    ("exited", None, r"exit_demo.*lane 4 at mma.sync #1.*lane 5 at \(exited\)"),
    ("conflict", "padded", r"bank_demo.*ldmatrix matrix 0 has a 8-way bank conflict"),
    ("copy-conflict", "copy-clean", r"copy_demo.*cp.async writes of threads 0\.\.7 have a 8-way "
                                    r"bank conflict"),
], ids=["guard-page", "collective-site", "collective-exited-lane", "ldmatrix-banks",
        "cp.async-banks"])
def test_check_fires_on_a_misbehaving_kernel(programs, bad, good, message):
    proc = _run(programs["plain"], bad)
    assert proc.returncode != 0, f"{bad}: the emulation did not stop it\n{proc.stdout}"
    assert re.search(message, proc.stderr), f"{bad}: unexpected message\n{proc.stderr}"
    if good:
        proc = _run(programs["plain"], good)
        assert proc.returncode == 0, f"{good}: refused\n{proc.stderr}"


@needs_cxx
@pytest.mark.parametrize("size", ["", "4"], ids=["16-byte", "4-byte"])
def test_cp_async_destination_is_poisoned_until_the_wait(programs, size):
    # landing at the wait: every early read sees the poison; after the wait, none does
    assert _run(programs["plain"], "unwaited" + size, "0").stdout.count("poisoned") == 32
    assert "poisoned" not in _run(programs["plain"], "waited" + size, "0").stdout
    # landing at issue: no early read sees it; at random sync points: some do, per seed
    assert "poisoned" not in _run(programs["plain"], "unwaited" + size, "1").stdout
    counts = {_run(programs["plain"], "unwaited" + size, "2", str(s)).stdout.count("poisoned")
              for s in range(4)}
    assert len(counts) > 1 and all(0 < c < 32 for c in counts), counts


@needs_cxx
def test_turnstile_runs_one_warp_at_a_time_in_seeded_orders(programs):
    orders = set()
    for seed in range(6):
        log = _run(programs["plain"], "order", "0", str(seed)).stdout.split()[-1]
        phases = [log[:128], log[128:]]
        for p in phases:
            runs = re.findall(r"(\d)\1*", p)
            assert len(runs) == 4 and all(p.count(w) == 32 for w in runs), (
                f"seed {seed}: warps interleave between barriers: {p}")
            orders.add("".join(runs))
    assert len(orders) >= 4, f"warp orders do not vary with the seed: {orders}"
    free = _run(programs["plain"], "order").stdout.split()[-1]
    assert sorted(free) == sorted(log), "the free-running mode runs every thread too"


@needs_cxx
def test_tsan_reports_a_race_between_warps(programs):
    proc = _run(programs["tsan"], "race")
    assert proc.returncode == 66, f"no race reported\n{proc.stderr[-2000:]}"
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr
    assert "ThreadSanitizer report (above) in kernel race_demo, block (0, 0)" in proc.stderr
    proc = _run(programs["tsan"], "no-race")
    assert proc.returncode == 0, f"a race reported across a barrier\n{proc.stderr[-2000:]}"


def test_strict_cases_reach_three_chunks_per_block():
    """Some block of each kernel meets three partner chunks (the end-of-step barrier matters only
    from the third), in every case a query tile has none and in some case a key tile has none
    (the drains after an empty loop)."""
    import numpy as np
    import varlen
    from emulation.cupy import strict_cases
    from varlen.testing import make_batch
    most_q = most_k = 0
    keyless_k = False
    for c in strict_cases():
        b = make_batch(np.random.default_rng(0), c["lengths_q"], c["lengths_k"], Hq=c["Hq"],
                       Hk=c["Hk"], D=c["D"], dtype=c["dtype"], mask=c["mask"], gaps=c["gaps"])
        plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                           mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                           block_m=c["block_m"], block_n=64)
        used_q = np.asarray(plan.q_tiles)[:, 0] >= 0
        per_q = (np.asarray(plan.q_sched)[..., 3] - np.asarray(plan.q_sched)[..., 0]).sum(-1)
        per_k = (np.asarray(plan.k_sched)[..., 3] - np.asarray(plan.k_sched)[..., 0]).sum(-1)
        assert per_q[used_q].min() == 0, f"{c['label']}: no query tile without keys {per_q}"
        most_q = max(most_q, per_q[used_q].max())
        # dK/dV visits each query chunk once per query head of its key head
        most_k = max(most_k, per_k.max() * c["Hq"] // c["Hk"])
        used_k = np.asarray(plan.k_tiles)[:, 0] >= 0
        keyless_k = keyless_k or per_k[used_k].min() == 0
    assert most_q >= 3, f"key chunks per query tile: at most {most_q}"
    assert most_k >= 3, f"query chunks per key tile: at most {most_k}"
    assert keyless_k, "no key tile without query chunks"


def _emulate(*args, timeout=1200):
    out = emulate(["-m", "emulation", "--strict", *args], timeout=timeout, clean=True)
    counts = re.search(r"ldmatrix (\d+) extra wavefronts in (\d+) phases", out)
    assert counts and counts.group(1) == "0" and int(counts.group(2)) > 0, out
    return out


@needs_cxx
def test_shipped_kernels_have_no_race():
    out = _emulate("--race")
    assert "ok " in out and "[race" in out, out


@needs_cxx
@pytest.mark.parametrize("schedule, seeds", cases(
    [pytest.param("issue", "0", id="issue-0"), pytest.param("wait", "1", id="wait-1"),
     pytest.param("random", "2", id="random-2")], ["random-2"]))
def test_shipped_kernels_pass_every_schedule(schedule, seeds):
    from emulation.cupy import strict_cases
    out = _emulate("--schedule", schedule, "--seeds", seeds)
    assert out.count("ok ") == len(seeds.split(",")) * len(strict_cases()), out


def _ci_sites():
    """A representative subset: the wait in the shared pipeline, the barrier after the dK/dV
    kernel's dS^T tile is staged for the other warps, and the barrier before ordered dQ hands
    its counter on. (The barrier ending each loop step of the shared pipeline is not among
    them: in the shipped kernels, which all add dQ from the dK/dV kernel, the dQ phase's
    barrier already follows every read of the stage.)"""
    chosen = []
    for s in emulation_mutations.sites():
        name, line, call = s
        with open(os.path.join(emulation_mutations.SOURCE_DIR, name)) as f:
            lines = f.readlines()
        if name == "pipeline.cuh" and "cp_async_wait<1>" in call:
            chosen.append(s)
        elif name == "bwd_dq_ordered.cuh" and "__syncthreads" in call:
            chosen.append(s)
        elif name == "bwd_dkdv.cuh" and "stage_rows" in lines[line - 2]:
            chosen.append(s)
    assert len(chosen) == 3, f"representative sites not found (kernels rewritten?): {chosen}"
    return chosen


@needs_cxx
@pytest.mark.parametrize("site", cases(_ci_sites(), lambda s: s[0] == "pipeline.cuh"),
                         ids=emulation_mutations.site_id)
def test_removed_barrier_or_wait_is_caught(site):
    by, seconds = emulation_mutations.check(site, timeout=1200)
    assert by is not None, f"removing {emulation_mutations.site_id(site)} went unnoticed"


@needs_cxx
@pytest.mark.skipif(os.environ.get("VARLEN_EMULATION_MUTATIONS") != "all",
                    reason="the full mutation sweep: VARLEN_EMULATION_MUTATIONS=all")
@pytest.mark.parametrize("site", emulation_mutations.sites(), ids=emulation_mutations.site_id)
def test_every_removed_barrier_or_wait_is_caught(site):
    by, seconds = emulation_mutations.check(site, timeout=1800)
    assert by is not None, f"removing {emulation_mutations.site_id(site)} went unnoticed"
