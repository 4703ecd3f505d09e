"""The sm_90a kernels of `cupy:sm90a` (kernels_cuda/fwd_sm90.cuh, bwd_sm90.cuh) through the host
emulation, one process per run (the emulation replaces `cupy`): the runs of
`emulation.sm90_cases` (a case through a kernel, which the implementation must have a variant
for) against the float64 reference, under ThreadSanitizer and landing schedules, the
deterministic backward's bits across schedules, and mutations of the kernels that the cases
must catch."""
from __future__ import annotations

import re

import pytest

from emulation.sm90_cases import FIRST, MASK_MOD, PACKED, PERSISTENT, PIPELINE, QUICK, RUNS

from helpers import (assert_mutant_caught, cases, emulate, mutated_sources, needs_cxx,
                     run_mutated)

pytestmark = needs_cxx


def _run(label, kind, env=None):
    return emulate(["-m", "emulation.sm90_cases", f"{label}:{kind}"], env)


def _tsan_env(**extra):
    import emulation.cupy as _cupy_emulation
    return dict(LD_PRELOAD=_cupy_emulation.tsan_runtime(),
                TSAN_OPTIONS=_cupy_emulation.TSAN_OPTIONS, VARLEN_EMULATION_RACE="1",
                OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", **extra)


@pytest.mark.parametrize("label, kind", [
    pytest.param(label, kind, id=f"{label}-{kind}",
                 marks=pytest.mark.smoke if label == FIRST else ())
    for label, kind in cases(RUNS, QUICK)])
def test_case_on_host_emulation(label, kind):
    assert f"ok {label}:{kind}" in _run(label, kind)


@pytest.mark.parametrize("label, kind, schedule", cases([
    pytest.param(FIRST, "fwd", None, id="fwd"),
    pytest.param(PIPELINE, "fwd", None, id="fwd-pipeline"),
    pytest.param(FIRST, "bwd", None, id="bwd"),
    pytest.param("B2-bf16-D64-BM64-BN128-causal-gaps-nan", "bwd", ("issue", "1"),
                 id="bwd-issue-1"),
], ["fwd", "bwd"]))
def test_under_thread_sanitizer(label, kind, schedule):
    """Built with ThreadSanitizer, copies landing and wgmma operands read at random points (or
    at issue, the earliest moment): the mbarrier protocol (the forward's q_full, k_full, v_full,
    ready, k_empty, v_empty; the backward's kv_full, kv_ready, q_full, ready, empty) and the
    named barriers (the ping-pong, the backward's dS buffer) must order every shared-memory
    access of the producer warpgroup, the TMA copies and the consumers' wgmmas (a race stops
    the run)."""
    extra = {} if schedule is None else dict(VARLEN_EMULATION_SCHEDULE=schedule[0],
                                             VARLEN_EMULATION_SEED=schedule[1])
    assert "ok" in _run(label, kind, _tsan_env(**extra))


@pytest.mark.parametrize("label, schedule, seed", cases([
    pytest.param(PIPELINE, "random", "1", id="random-1"),
    pytest.param(PIPELINE, "issue", "0", id="issue-0"),
    pytest.param(PIPELINE, "random", "2", id="random-2"),
    pytest.param(PERSISTENT, "issue", "0", id="persistent-issue-0"),
    pytest.param(PERSISTENT, "random", "1", id="persistent-random-1"),
    pytest.param(PACKED, "random", "1", id="packed-random-1"),
], ["random-1"]))
def test_forward_under_landing_schedules(label, schedule, seed):
    """The forward pipeline's and persistent loop's cases with TMA copies landing, and wgmma
    operands read, at issue or at seeded random points between issue and the wait that needs
    them (the default is the latest moment): a release or a wait out of place changes what a
    wgmma reads. (The one-warp-at-a-time schedule cannot run warpgroup collectives or mbarrier
    waits: docs/hopper.md, "What it does not model".)"""
    assert "ok" in _run(label, "fwd", dict(VARLEN_EMULATION_SCHEDULE=schedule,
                                           VARLEN_EMULATION_SEED=seed))


@pytest.mark.parametrize("label", cases([PIPELINE, PERSISTENT], [PERSISTENT]))
def test_forward_walks_partial_chunks_first(label):
    """Each work item's key chunks in the order of the TMA loads of K: the partial ones (a
    causal diagonal's, a ragged end's) first, then the full ones (emulation.sm90_cases'
    `check_chunk_order` against `chunk_order`, on every emulated forward); here, on cases where
    that order differs from the schedule's for some items."""
    out = _run(label, "fwd")
    walked, reordered = map(int, re.search(rf"chunk order {label}: (\d+) work items, (\d+) "
                                           "reordered", out).groups())
    assert walked > 0 and reordered > 0, f"{label}: {walked} items, {reordered} reordered"


def test_deterministic_backward_is_bitwise_repeatable():
    """The deterministic case gives the same bits under two more schedules (copies landing and
    wgmma operands read at seeded random points, threads free-running). Under these two seeds
    the case's gradients differ in atomic mode, and so they do without the hand-over between
    the two consumer warpgroups (each measured): the order in which the warpgroups add to a
    dQ element changes with the schedule. (The order between key tiles cannot vary in the
    emulation, which runs blocks one after the other; there a rank that waits for a later
    block stops the run.)"""
    label = "B3-fp16-D64-BN128-deterministic-gqa"
    digests = set()
    for seed in ("1", "3"):
        out = _run(label, "bwd",
                   dict(VARLEN_EMULATION_SCHEDULE="random", VARLEN_EMULATION_SEED=seed))
        digests.add(re.search(rf"digest {label} (\w+)", out).group(1))
    assert len(digests) == 1, f"{label}: the gradients differ between schedules: {digests}"


# What the emulation reports for a broken producer/consumer handshake in the forward. The threads
# run free, so which inconsistency it meets first depends on the interleaving: a barrier phase
# that goes wrong (at an mbarrier), a deadlock of the ping-pong's turn (a consumer holding the
# turn waits for a phase that never comes), or a consumer let through early whose wgmma reads a
# chunk's sanitised rows before their fence to the async proxy (seen in a CI run).
HANDSHAKE = ("mbarrier", "(a deadlock?)", "is not yet followed by fence.proxy.async")
# The backward's adds a consumer thread that ran past its warpgroup's last collective and
# returned: reported at that collective or at the exit of a warp that skipped one the others met
# (seen under heavy load), or, with the two consumers' dS barriers shared (dQ by columns), as a
# collective whose threads never all arrive (seen once, in a CI run).
BWD_HANDSHAKE = ("mbarrier", "of the warp has exited", "threads of the warp starting at",
                 "exited without executing it")

# Mutations of the kernels that the cases must catch: name -> (kernel source, old, new, run
# (LABEL or LABEL:KIND), what the failure says). Each is compiled from a mutated copy of the
# kernel sources (VARLEN_EMULATION_SOURCE_DIR).
MUTATIONS = {
    "fwd-no-v-row-zeroing": ("fwd_sm90.cuh", "        if (r < rows && !bad) continue;",
                             "        continue;", f"{FIRST}:fwd", "out: NaN pattern differs"),
    # every chunk taken as a full one: no mask
    "fwd-no-mask": ("fwd_sm90.cuh", "query_rows_mask<Cfg::PACK>(pol, tile, w, c, ",
                    "query_rows_mask<Cfg::PACK>(pol, tile, w, "
                    "[&] { auto f = c; f.full = true; return f; }(), ",
                    "B3-bf16-D64-BM64-mixed-masks-gqa:fwd", "differs"),
    # GQA packing: a packed row's mask taken at position row (not row / pack), its output
    # written as an unpacked tile's
    "fwd-pack-mask-by-row": ("fwd_sm90.cuh", "query_rows_mask<Cfg::PACK>(pol, tile, w, c, ",
                             "query_rows_mask<1>(pol, tile, w, c, ",
                             "G4-bf16-D128-BM64-pack2-mixed-softcap", "max abs error"),
    "fwd-pack-store-unpacked": ("fwd_sm90.cuh", "tile_output<T, DV, Cfg::PACK>(",
                                "tile_output<T, DV, 1>(", PACKED, "differs"),
    # the producer refills a V stage the consumers still read
    "fwd-no-v-empty-wait": ("fwd_sm90.cuh",
                            "    sm90::mbar_wait(sm.v_empty(s), parity ^ 1u, \"v_empty\");\n",
                            "", PIPELINE, HANDSHAKE),
    "fwd-no-deferred-rescale": ("fwd_sm90.cuh", "            rescale(acc_o, corr);\n", "",
                                PIPELINE, "max abs error"),
    # the persistent loop: the next item's Q loaded over the one the consumers still read
    "fwd-no-q-empty-wait": ("fwd_sm90.cuh",
                            "            sm90::mbar_wait(sm.q_empty(), ring.q_parity() ^ 1u, "
                            "\"q_empty\");\n",
                            "", PERSISTENT, HANDSHAKE),
    # the ring restarted at stage 0, round 0 for every item (on both sides)
    "fwd-ring-reset-per-item": ("fwd_sm90.cuh", "void next_item() { ++item; }",
                                "void next_item() { ++item; chunk = 0; }", PERSISTENT,
                                HANDSHAKE),
    # Q's phase taken as the first item's for every item (on both sides)
    "fwd-q-phase-reset-per-item": ("fwd_sm90.cuh",
                                   "        return static_cast<uint32_t>(item) & 1u;",
                                   "        return 0u;", PERSISTENT, HANDSHAKE),
    # K rows past the key tile (NaN padding) meet dS = 0 in dQ += dS K
    "bwd-no-key-row-zeroing": ("bwd_sm90.cuh",
                               "    if (t >= rows || bad) fill_row<Cfg, Cfg::BN>(s_k, t, 0u);",
                               "    if (bad) fill_row<Cfg, Cfg::BN>(s_k, t, 0u);",
                               f"{FIRST}:bwd", "dq: NaN pattern differs"),
    # Q rows past a query chunk (NaN padding) meet dS^T = 0 in dK += dS^T Q
    "bwd-no-query-row-zeroing": ("bwd_sm90.cuh",
                                 "    if (t >= rows || bad_q) fill_row<Cfg, Cfg::BQ>(s_q, t, 0u);",
                                 "    if (bad_q) fill_row<Cfg, Cfg::BQ>(s_q, t, 0u);",
                                 f"{FIRST}:bwd", "dk: NaN pattern differs"),
    # a NaN in a dout row of a partial chunk must reach delta, hence exactly its pairs
    "bwd-no-delta-flag": ("bwd_sm90.cuh", "    if (bad_q || bad_do) s_delta[t] = nan_f();", "",
                          "B2-fp16-D128-BN64-softcap-nan-k-q-dout", "NaN pattern differs"),
    # dS written without the 128B swizzle, which the descriptor of dQ's A assumes
    "bwd-no-ds-swizzle": ("bwd_sm90.cuh",
                          "(((2 * wg_warp + (w.lane / 8) % 2) ^ (ds_row % 8)) << 4)",
                          "((2 * wg_warp + (w.lane / 8) % 2) << 4)",
                          "B3-bf16-D64-BM64-mixed-masks-gqa:bwd", "dq: max abs error"),
    # the producer refills a stage the consumers still read
    "bwd-no-empty-wait": ("bwd_sm90.cuh",
                          "        sm90::mbar_wait(sm.empty(s), parity ^ 1u, \"empty\");\n",
                          "", "B2-bf16-D128-BN128-full-gqa", BWD_HANDSHAKE),
    # D = 256: the second query subtile's dS stored over the first's rows
    "bwd-ds-subtiles-overlap": (
        "bwd_sm90.cuh",
        "sm90::stmatrix_x4_trans(p_ds_row + (col + j * 16) * ROW, ds_frag[j]);",
        "sm90::stmatrix_x4_trans(p_ds_row + j * 16 * ROW, ds_frag[j]);",
        "B3-bf16-D256-softcap-gqa-nan", "dq: NaN pattern differs"),
    # D = 256: the second warpgroup's dK columns stored over the first's
    "bwd-dk-columns-at-0": ("bwd_sm90.cuh", "    dk_rows.p += col_box0 * Cfg::BOX_COLS;\n", "",
                            "B3-bf16-D256-softcap-gqa-nan", "dk: NaN pattern differs"),
    # D = 256: the second subtile's softmax with the lse2 and delta of the chunk's first rows
    "bwd-subtile-stats-at-row-0": ("bwd_sm90.cuh", "ColStats{sm.lse2(s) + col, sm.delta(s) + col}",
                                   "ColStats{sm.lse2(s), sm.delta(s)}",
                                   "B3-bf16-D256-softcap-gqa-nan", "dq: NaN pattern differs"),
    # the mask_mod ignored in the backward (each pair's bit from the built-in band alone), and
    # every chunk taken as one the mask_mod shows whole (TILE_FULL)
    "bwd-mask-mod-ignored": ("bwd_sm90.cuh",
                             "if (visible && (full || user_mask(",
                             "if (visible && (true || user_mask(", f"{MASK_MOD}:bwd",
                             "NaN pattern differs"),
    # a chunk the mask_mod hides whole loaded all the same (the gradients pass; the check of
    # the Q loads against the classes does not)
    "bwd-loads-empty-chunks": ("bwd_sm90.cuh",
                               "            if (cls == TILE_EMPTY) {\n"
                               "                sm90::mbar_arrive(sm.q_full(s));"
                               "           // the phase, with no bytes\n"
                               "            } else {", "            {", f"{MASK_MOD}:bwd",
                               "the mask_mod leaves"),
    # an empty chunk's q_full phase left incomplete: the consumers wait for it
    "bwd-no-empty-chunk-arrive": ("bwd_sm90.cuh",
                                  "                sm90::mbar_arrive(sm.q_full(s));"
                                  "           // the phase, with no bytes\n", "",
                                  f"{MASK_MOD}:bwd", BWD_HANDSHAKE + ("(a deadlock?)",)),
    "bwd-class-taken-as-full": ("bwd_sm90.cuh",
                                "const int cls = chunk_class<Cfg>(mods, c, tile);",
                                "const int cls = TILE_FULL;", f"{MASK_MOD}:bwd",
                                "NaN pattern differs"),
}


@pytest.mark.parametrize("name", cases(MUTATIONS, ["fwd-no-v-row-zeroing",
                                                   "bwd-no-key-row-zeroing"]))
def test_mutation_is_caught(name, tmp_path):
    source, old, new, label, says = MUTATIONS[name]
    src = mutated_sources(tmp_path, source, old, new)
    assert_mutant_caught(run_mutated(["-m", "emulation.sm90_cases", label], src), name, label,
                         says)


# Synchronisation sites (emulation/mutations.py) removed one at a time, each of which the runs
# of its kernel (mutations.sm90_runs) must catch: name -> (kernel source, what marks the call,
# the sites it marks (the first is removed), what the catch must say). The forward's: the wait
# that retires S while P V stays in flight, the ping-pong's bar.sync, the producer's wait for a
# K stage's release, the fence that publishes the sanitised rows to the async proxy (an operand
# store no fence published; also a harness test, tests/emulation/test_emulation_sm90.py), the
# consumers' wait for them (a wgmma reading a fenced store without having synchronised with
# the fence). The backward's: the warpgroup's barrier before it rewrites its dS buffer by
# stmatrix (without it a warp overwrites dS that another warp's dQ product read, with no
# barrier between the read's retirement and the write). The full sweep: emulation/mutations.py,
# or tests/emulation/test_emulation_strict.py with VARLEN_EMULATION_MUTATIONS=all.
SITES = {"fwd-wgmma-wait-1": ("fwd_sm90.cuh", "wgmma_wait<1>", 1, None),
         "fwd-pingpong-sync": ("fwd_sm90.cuh", "named_bar_sync", 1, None),
         "fwd-k-empty-wait": ("fwd_sm90.cuh", "k_empty(s)", 1, None),
         "fwd-proxy-fence": ("fwd_sm90.cuh", "fence_proxy_async", 1, None),
         "fwd-ready-wait": ("fwd_sm90.cuh", "ready(n % STAGES)", 1, None),
         "bwd-ds-barrier": ("bwd_sm90.cuh", "named_bar_sync(ds_bar,", 2, "stmatrix")}


@pytest.mark.parametrize("name", cases(SITES, ["fwd-wgmma-wait-1", "bwd-ds-barrier"]))
def test_removed_synchronisation_is_caught(name):
    import emulation.mutations as emulation_mutations
    source, call, count, says = SITES[name]
    chosen = [s for s in emulation_mutations.sites() if s[0] == source and call in s[2]]
    assert len(chosen) == count, f"{name}: {count} site(s) expected (kernel rewritten?): {chosen}"
    by, seconds = emulation_mutations.check(chosen[0], timeout=900)
    assert by is not None and (says is None or says in by), (
        f"removing {emulation_mutations.site_id(chosen[0])}: {by or 'went unnoticed'}")



# Consumer arrivals removed, the kernels built with a small poll limit (VARLEN_POLL_LIMIT,
# kernels_cuda/common.cuh): the producer, the first to wait on the stage the consumers never
# release, reaches the limit, prints where it waits and traps, and the launch fails (as on a
# GPU) instead of hanging until the emulation's deadlock timeout: name -> (kernel source, the
# arrival removed, case, the producer's wait that must report (its line's text), its barrier).
POLL_LIMIT = "1000"
POLL_MUTATIONS = {
    "fwd-no-k-release": ("fwd_sm90.cuh",
                         "            sm90::mbar_arrive(sm.k_empty(n % STAGES));\n", PIPELINE,
                         "sm90::mbar_wait(sm.k_empty(s)", "k_empty"),
    "bwd-no-stage-release": ("bwd_sm90.cuh", "        sm90::mbar_arrive(sm.empty(s));\n",
                             "B2-bf16-D128-BN128-full-gqa", "sm90::mbar_wait(sm.empty(s)",
                             "empty"),
}


@pytest.mark.parametrize("name", cases(POLL_MUTATIONS, ["fwd-no-k-release",
                                                        "bwd-no-stage-release"]))
def test_poll_limit_names_the_barrier_of_a_removed_arrive(name, tmp_path):
    from varlen.kernels_cuda import SOURCE_DIR
    source, old, label, wait, barrier = POLL_MUTATIONS[name]
    with open(f"{SOURCE_DIR}/{source}") as f:
        line = next(i for i, text in enumerate(f, 1) if wait in text)
    src = mutated_sources(tmp_path, source, old, "")
    proc = run_mutated(["-m", "emulation.sm90_cases", label], src,
                       {"VARLEN_POLL_LIMIT": POLL_LIMIT})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{name}: the mutated kernel passed {label}"
    says = (rf"varlen: poll limit: {re.escape(source)}:{line} \({source[:-4]}_producer<.*\), "
            rf"block \(\d+, \d+\), thread \d+: mbarrier {barrier} at shared 0x[0-9a-f]+: "
            rf"phase of parity [01] not completed after {POLL_LIMIT} polls; trap")
    assert re.search(says, out), f"{name}: no report of the {barrier} wait:\n{out[-3000:]}"
    assert "LaunchError" in out and "(a deadlock?)" not in out, out[-3000:]
