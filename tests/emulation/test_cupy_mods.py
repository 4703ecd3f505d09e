"""User functions in the CuPy kernels, on a CPU: mask_mod and score_mod compiled into the real
kernels (kernels_cuda/mods.cuh, varlen/backends/cupy/mods.py) and run through the host
emulation (each case in its own process, as the emulation replaces `cupy`), against the
float64 reference with the STYLE.md tolerances (`varlen.testing`).

* mma.sync forward and backward (both dQ modes): gallery masks with per-sequence and
  per-token aux arrays, built-in masks combined with them, score mods with per-head and table
  aux arrays and a transcendental one under a softcap; a row that a score_mod leaves without a
  key (out 0, lse -inf); zero- and one-row sequences, lengths that are no multiple of a tile,
  GQA 4/2, D = 64.
* the device tile classes (forward and backward, both dQ modes): the emulation's count of
  mask_mod evaluations equals the pairs of the tiles the plan classifies partial (none in full
  or empty ones), and empty chunks are not loaded (ldmatrix and cp.async counts).
* the forward's skip of key chunks a mask_mod empties: results, and the emulation's ldmatrix
  and cp.async counts against a mask_mod that shows every pair.
* the sm_90a forward with packed query heads (each packed row's score_mod sees its own head).
* aux gradients with deterministic=True (fixed-point sums): bitwise equal across emulation
  schedules, near the reference.
* an aux index out of range: the kernels' flag, raised by `varlen.check_device_errors()`.
* what the implementations refuse and why (`supports_mods`, no emulation).
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from helpers import (assert_mutant_caught, emulate_script, mutated_sources, needs_cxx,
                     run_mutated)

LENGTHS = [0, 1, 70]          # a zero- and a one-row sequence, one of two partial tiles


def _emulate(*case, timeout=900):
    emulate_script(__file__, *case, timeout=timeout)


# --------------------------------------------------------------------------------------------
# The emulated cases
# --------------------------------------------------------------------------------------------

def _hide_row(score, b, h, q_idx, k_idx):
    """A score_mod that leaves query 3 of every sequence without a key, and hides key 0 from
    the other queries after the first."""
    import varlen
    return varlen.where((q_idx == 3) | ((k_idx == 0) & (q_idx > 0)), -np.inf, score)


def _out_of_range(b, q_idx, k_idx, table):
    return (k_idx <= q_idx) & (table[q_idx] >= 0)


def _functions(mask_id: str, score_id: str, lengths, Hq: int):
    """(mask for the plan and the reference, its MaskMod or None, ScoreMod or None)."""
    import varlen
    from mods_cases import mask_cases, score_cases
    from varlen.mods import split_mask
    masks = dict(mask_cases(lengths))
    scores = dict(score_cases(Hq))
    masks["causal-builtin"] = "causal"
    masks["out-of-range"] = varlen.MaskMod(_out_of_range, np.zeros(8, np.int32))
    scores["none"] = None
    scores["hide-row"] = varlen.ScoreMod(_hide_row)
    mask = masks[mask_id]
    return mask, split_mask(mask)[1], scores[score_id]


def _compare(label, b, got, score, *, softmax_scale, softcap, grads=None):
    """The forward (and gradients, aux gradients with a fourth entry) against the float64
    reference with the score_mod (`varlen.testing.check_against_reference`)."""
    from varlen.testing import check_against_reference
    check_against_reference(b, *got, grads, softmax_scale=softmax_scale, softcap=softcap,
                            score_mod=score, label=label)


def _mma_run(mask_id, score_id, dtype, softcap, block_m, *, seed, aux_grads=False,
             deterministic=False):
    """The mma.sync forward and backward of a gallery case on the emulated device, checked
    against the reference (`_compare`); returns the backward's results."""
    import varlen
    from emulation.cupy import install_fake_cupy
    from varlen.backends.cupy import BACKEND
    from varlen.mods import Mods
    from varlen.testing import make_batch
    block_m, softcap = int(block_m), float(softcap)
    install_fake_cupy(block_m, 64)
    Hq, Hk, D = 4, 2, 64
    mask, mask_mod, score = _functions(mask_id, score_id, LENGTHS, Hq)
    b = make_batch(np.random.default_rng(seed), LENGTHS, Hq=Hq, Hk=Hk, D=D, dtype=dtype,
                   mask=mask, gaps=True)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=mask,
                       num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], block_m=block_m,
                       block_n=64)
    mods = Mods(mask=mask_mod, score=score, aux_grads=aux_grads)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=softcap)
    label = (f"{mask_id}+{score_id}{' aux grads' if aux_grads else ''} {dtype} "
             f"softcap={softcap} BM{block_m} (emulated)")
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, mods=mods, **kw)
    grads = BACKEND.backward(plan, b.dout, b.q, b.k, b.v, out, lse, mods=mods,
                             deterministic=deterministic, **kw)
    assert len(grads) == (4 if aux_grads else 3), label
    _compare(label, b, (out, lse), score, grads=grads, **kw)
    varlen.check_device_errors()          # nothing flagged
    print(f"ok {label}")


def _case_mma(mask_id, score_id, dtype, softcap, block_m, deterministic):
    """The mma.sync forward, then the backward (dQ atomic, or ordered with `deterministic`)."""
    _mma_run(mask_id, score_id, dtype, softcap, block_m, seed=1,
             deterministic=deterministic == "True")


def _case_sm90(mask_id, score_id, pack):
    """The sm_90a forward with `pack` query heads per position."""
    import varlen
    from emulation import sm90 as emulated_sm90
    from emulation.cupy import install_fake_cupy
    from varlen.backends.cupy import sm90
    from varlen.mods import Mods
    from varlen.testing import make_batch
    install_fake_cupy(64, 64)
    emulated_sm90.install()
    Hq, Hk, D = 4, 2, 64
    lengths = [0, 1, 40]
    mask, mask_mod, score = _functions(mask_id, score_id, lengths, Hq)
    b = make_batch(np.random.default_rng(2), lengths, Hq=Hq, Hk=Hk, D=D, dtype="bfloat16",
                   mask=mask, gaps=True)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=mask,
                       num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], block_m=64,
                       block_n=64)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
    got = sm90.forward(plan, b.q, b.k, b.v, pack=int(pack), mods=Mods(mask=mask_mod,
                                                                       score=score), **kw)
    _compare(f"sm90a {mask_id}+{score_id} pack={pack} (emulated)", b, got, score, **kw)
    varlen.check_device_errors()
    print("ok sm90a")


def _case_index_error():
    """A mask_mod that reads past its aux array: the forward and the backward flag it, and
    varlen.check_device_errors() raises it (once: the check clears the flag)."""
    import varlen
    from emulation.cupy import install_fake_cupy
    from varlen.backends.cupy import BACKEND
    from varlen.backends.cupy.mods import MOD_INDEX_ERROR
    from varlen.mods import Mods
    from varlen.testing import make_batch
    install_fake_cupy(64, 64)
    lengths = [1, 12]
    mask, mask_mod, _ = _functions("out-of-range", "none", lengths, 2)
    b = make_batch(np.random.default_rng(3), lengths, Hq=2, Hk=1, D=64, dtype="float16",
                   mask=mask)
    plan = varlen.plan(b.cu_q, b.cu_k, mask=mask, block_m=64, block_n=64)
    kw = dict(softmax_scale=0.125, softcap=0.0)
    varlen.check_device_errors()
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, mods=Mods(mask=mask_mod), **kw)
    with pytest.raises(IndexError, match="a mask_mod or score_mod read"):
        varlen.check_device_errors()
    varlen.check_device_errors()          # cleared
    BACKEND.backward(plan, b.dout, b.q, b.k, b.v, out, lse, mods=Mods(mask=mask_mod), **kw)
    with pytest.raises(IndexError, match=MOD_INDEX_ERROR.split(";")[0][:40]):
        varlen.check_device_errors()
    print("ok index error")


def _case_aux_grads(mask_id, score_id, dtype, softcap, block_m):
    """The backward's aux gradients (atomic dQ, float32 atomics), with the forward and dq, dk,
    dv, against the reference's (`aux_grads=True`)."""
    _mma_run(mask_id, score_id, dtype, softcap, block_m, seed=5, aux_grads=True)


def _always(b, q_idx, k_idx):
    return q_idx >= 0


def _first_tile(b, q_idx, k_idx):
    """Causal for the first 64 queries of a sequence; the others see no key."""
    return (q_idx < 64) & (k_idx <= q_idx)


def _case_skip(mask_id):
    """The forward on a plan without a built-in mask, with the mask_mod `mask_id`:
    "chunked", chunked causal with chunks of 32 rows (tiles of 64: every tile off the diagonal
    holds no visible pair), or "always" (every pair shown). Checked against the reference;
    prints the emulation's ldmatrix phases and cp.async writes (`bank_counts`: one kernel
    library per process, which keeps them exact)."""
    import varlen
    from emulation.cupy import bank_counts, install_fake_cupy
    from mods_cases import chunked_causal
    from varlen.backends.cupy import BACKEND
    from varlen.mods import Mods
    from varlen.testing import make_batch
    install_fake_cupy(64, 64)
    lengths, D = [1, 190], 64
    mask_mod = {"chunked": varlen.MaskMod(chunked_causal, np.array([32], np.int32)),
                "always": varlen.MaskMod(_always)}[mask_id]
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
    b = make_batch(np.random.default_rng(4), lengths, Hq=2, Hk=1, D=D, dtype="float16",
                   mask=mask_mod, gaps=True)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], block_m=64,
                       block_n=64)
    mods = Mods(mask=mask_mod)
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, mods=mods, **kw)
    _compare(f"{mask_id} forward (emulated)", b, (out, lse), None, **kw)
    varlen.check_device_errors()
    ldsm, _, copies, _ = bank_counts()
    print(f"counts {ldsm} {copies}")


def _slopes_and_table(score, b, h, q_idx, k_idx, slopes, table):
    """Learnable ALiBi slopes [Hq] and a relative-bias table [Hq, 2R + 1]."""
    import varlen
    R = (table.shape[1] - 1) // 2
    rel = varlen.minimum(varlen.maximum(q_idx - k_idx, -R), R) + R
    return score - slopes[h] * abs(q_idx - k_idx) + table[h, rel]


# The emulation schedules of the repeated deterministic runs: (landing, seed).
AUX_SCHEDULES = (("random", 1), ("random", 2))


def _case_aux_grads_deterministic(dtype):
    """deterministic=True with aux gradients (fixed-point sums): the first run against the
    reference, with no host read of device data (the words' conversion is device array
    code), then one per schedule of AUX_SCHEDULES (copies landing and warps running in seeded
    random orders, so float32 atomics would add in other orders): every gradient, the aux
    ones included, equal bit for bit."""
    import os

    import varlen
    from emulation.cupy import DeviceArray, install_fake_cupy, watch_host_reads
    from varlen.backends.cupy import BACKEND, launch
    from varlen.mods import Mods
    from varlen.testing import make_batch
    install_fake_cupy(64, 64)
    Hq, Hk, D = 4, 2, 64
    rng = np.random.default_rng(6)
    score = varlen.ScoreMod(_slopes_and_table, (0.1 * rng.random(Hq)).astype(np.float32),
                            (0.3 * rng.standard_normal((Hq, 13))).astype(np.float32))
    b = make_batch(rng, LENGTHS, Hq=Hq, Hk=Hk, D=D, dtype=dtype, mask="causal", gaps=True)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask="causal", num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=64, block_n=64)
    mods = Mods(score=score, aux_grads=True)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, mods=mods, **kw)

    def backward():
        return BACKEND.backward(plan, b.dout, b.q, b.k, b.v, out, lse, mods=mods,
                                deterministic=True, **kw)
    with watch_host_reads() as reads:
        first = BACKEND.backward(plan, *(x.view(DeviceArray) for x in (b.dout, b.q, b.k, b.v,
                                                                      out, lse)),
                                 mods=mods, deterministic=True, **kw)
    assert not reads, f"host reads of device data: {dict(reads)}"
    first = (*(np.asarray(g).view(np.ndarray) for g in first[:3]),
             tuple(np.asarray(g).view(np.ndarray) for g in first[3]))
    label = f"slopes+table aux grads deterministic {dtype} (emulated)"
    _compare(label, b, (out, lse), score, grads=first, **kw)
    varlen.check_device_errors()
    names = ("dq", "dk", "dv", "dslopes", "dtable")
    for landing, seed in AUX_SCHEDULES:
        os.environ["VARLEN_EMULATION_SCHEDULE"] = landing
        os.environ["VARLEN_EMULATION_SEED"] = str(seed)
        launch._modules.clear()           # the next launches read the schedule again
        again = backward()
        for name, x, y in zip(names, (*first[:3], *first[3]), (*again[:3], *again[3])):
            x, y = np.asarray(x), np.asarray(y)
            assert x.tobytes() == y.tobytes(), (
                f"{label}: {name} differs under schedule {landing} seed {seed} in "
                f"{int((x != y).sum())} of {x.size} elements")
    print(f"ok {label}")


def _partial_pairs(b, mask_mod, lengths, Hq):
    """Pairs (times the Hq query heads) of the tile pairs the host plan with `mask_mod`
    classifies partial: without a built-in mask, with tiles of 64 = the kernels' chunks at
    D = 64, the pairs the device classes leave to the mask_mod (the same interval rules, aux
    runs under RANGE_CAP)."""
    import varlen
    from varlen.mods import PARTIAL
    h = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                    num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], mask=mask_mod,
                    block_m=64, block_n=64)
    start, classes = h.tile_classes("q")
    q_tiles, q_sched = np.asarray(h.q_tiles), np.asarray(h.q_sched)
    n = 0
    for i, (seq, _, _, rows, _) in enumerate(q_tiles):
        if seq < 0:
            continue
        begin, end = int(q_sched[i, 0, 0]), int(q_sched[i, 0, 3])
        for t in range(begin, end):
            if classes[start[i, 0] + t - begin] == PARTIAL:
                n += int(rows) * min(64, int(lengths[seq]) - 64 * t)
    return Hq * n


def _kept_tiles(b, mask_mod, Hq, pack):
    """Tile pairs the host plan with `mask_mod` schedules and does not classify empty, times
    the work items per query tile (Hq / pack): the sm_90a forward's, whose key chunks with a
    mask_mod are 64 rows and whose query tiles, `pack` heads packed, 64 / pack positions."""
    import varlen
    from varlen.mods import EMPTY
    h = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                    num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], mask=mask_mod,
                    block_m=64 // pack, block_n=64)
    return Hq // pack * int((h.tile_classes("q")[1] != EMPTY).sum())


def _classes_batch(mask_id):
    """The class cases' batch: sequences of a few hundred rows, a zero-length one, NaN padding
    rows between them, GQA 2/1, D = 64, and its mask_mod ("chunked128", "prefix-lm", "always",
    "first-tile")."""
    import varlen
    from mods_cases import chunked_causal, prefix_lm
    from varlen.testing import make_batch
    lengths, Hq, Hk, D = [192, 0, 70, 5], 2, 1, 64
    mask_mod = {"chunked128": varlen.MaskMod(chunked_causal, np.array([128], np.int32)),
                "prefix-lm": varlen.MaskMod(prefix_lm, np.array([70, 0, 64, 2], np.int32)),
                "always": varlen.MaskMod(_always),
                "first-tile": varlen.MaskMod(_first_tile)}[mask_id]
    b = make_batch(np.random.default_rng(6), lengths, Hq=Hq, Hk=Hk, D=D, dtype="float16",
                   mask=mask_mod, gaps=True, garbage=np.nan)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], block_m=64,
                       block_n=64)
    return b, plan, mask_mod, lengths, Hq, dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)


def _case_sm90_classes(mask_id, pack="1"):
    """The sm_90a forward's chunk classes (its consumers classify each work item's key chunks
    into a table in shared memory, one of two by the item's parity) on the class cases' batch,
    on 2 SMs (each block loops over several items, reusing each table), `pack` query heads per
    position (2: two consumer warpgroups in ping-pong): checked against the reference; prints
    the pairs the mask_mod was evaluated on, the pairs (times Hq) of the tiles the plan
    classifies partial, the K loads (TMA) and the kernel's tile pairs the plan does not classify
    empty (`_kept_tiles`)."""
    import varlen
    from emulation import sm90 as emulated_sm90
    from emulation.cupy import install_fake_cupy, user_mask_calls
    from varlen.backends.cupy import sm90
    from varlen.mods import Mods
    install_fake_cupy(64, 64)
    runtime = emulated_sm90.install(2)
    b, plan, mask_mod, lengths, Hq, kw = _classes_batch(mask_id)
    pack = int(pack)
    got = sm90.forward(plan, b.q, b.k, b.v, pack=pack, mods=Mods(mask=mask_mod), **kw)
    calls = user_mask_calls()
    trace = runtime.tma_trace()
    k_loads = int((trace[:, 2] == b.k.ctypes.data).sum())
    _compare(f"sm90a classes {mask_id} (emulated)", b, got, None, **kw)
    varlen.check_device_errors()
    print("counts", calls, _partial_pairs(b, mask_mod, lengths, Hq), k_loads,
          _kept_tiles(b, mask_mod, Hq, pack))


def _case_classes(mask_id, deterministic):
    """The device's tile classes in the mma.sync forward and backward (dQ ordered with
    `deterministic`): chunked causal with chunks of 128 ("chunked128": tiles off the diagonal
    inside a chunk full, across chunks empty), prefix-LM (a per-sequence aux array), or a
    mask_mod that shows every pair ("always": every tile full) over sequences of a few hundred
    rows, a zero-length one and NaN padding rows between them, GQA 2/1. Checked against the
    reference; prints the pairs the mask_mod was evaluated on in the forward and in the
    backward, the pairs (times Hq) of the tiles the plan classifies partial, and the
    emulation's ldmatrix phases and cp.async writes of the forward and of the backward."""
    import varlen
    from emulation.cupy import bank_counts, install_fake_cupy, user_mask_calls
    from varlen.backends.cupy import BACKEND
    from varlen.mods import Mods
    install_fake_cupy(64, 64)
    b, plan, mask_mod, lengths, Hq, kw = _classes_batch(mask_id)
    mods = Mods(mask=mask_mod)
    out, lse = BACKEND.forward(plan, b.q, b.k, b.v, mods=mods, **kw)
    fwd = [user_mask_calls(), *bank_counts()[::2]]
    grads = BACKEND.backward(plan, b.dout, b.q, b.k, b.v, out, lse, mods=mods,
                             deterministic=deterministic == "True", **kw)
    bwd = [user_mask_calls() - fwd[0], *(x - y for x, y in zip(bank_counts()[::2], fwd[1:]))]
    _compare(f"classes {mask_id} (emulated)", b, (out, lse), None, grads=grads, **kw)
    varlen.check_device_errors()
    print("counts", *fwd, *bwd, _partial_pairs(b, mask_mod, lengths, Hq))


CASES = {"mma": _case_mma, "sm90": _case_sm90, "index-error": _case_index_error,
         "skip": _case_skip, "aux-grads": _case_aux_grads,
         "aux-grads-deterministic": _case_aux_grads_deterministic, "classes": _case_classes,
         "sm90-classes": _case_sm90_classes}


def _main(argv):
    CASES[argv[0]](*argv[1:])
    return 0


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------

@pytest.mark.smoke
@needs_cxx
def test_mma_prefix_lm_alibi():
    """Prefix-LM (a per-sequence aux array) and ALiBi (per-head slopes), forward and backward
    with atomic dQ."""
    _emulate("mma", "prefix-lm", "alibi", "float16", "0", "64", "False")


@needs_cxx
@pytest.mark.parametrize("mask_id, score_id, dtype, softcap, block_m, deterministic", [
    pytest.param("chunked", "relative-bias", "bfloat16", "0", "128", "True",
                 id="chunked-relbias-bf16-BM128-ordered"),
    pytest.param("segments", "soft-clip", "float16", "5", "64", "False",
                 id="segments-softclip-softcap-fp16"),
    pytest.param("causal-builtin", "hide-row", "bfloat16", "0", "64", "False",
                 id="causal-hiderow-bf16"),
    pytest.param("window&prefix", "none", "float16", "0", "64", "True",
                 id="window&prefix-fp16-ordered"),
])
def test_mma_gallery(mask_id, score_id, dtype, softcap, block_m, deterministic):
    _emulate("mma", mask_id, score_id, dtype, softcap, block_m, deterministic)


@needs_cxx
def test_mma_forward_skips_chunks_the_mask_mod_empties():
    """Key chunks where the mask_mod hides every pair of the query tile are neither loaded nor
    computed, and the results match."""
    counts = {}
    for mask_id in ("chunked", "always"):
        out = emulate_script(__file__, "skip", mask_id, timeout=900)
        line = [x for x in out.splitlines() if x.startswith("counts ")][-1]
        counts[mask_id] = np.array(line.split()[1:], np.int64)
    # without the skip both compute every tile (equal counts); with it the chunked mask costs
    # about 0.4 of the ldmatrix phases and 0.5 of the cp.async writes
    print("ldmatrix phases, cp.async writes:", counts)
    assert (counts["chunked"] < 0.6 * counts["always"]).all(), counts


def _class_counts(mask_id, deterministic):
    out = emulate_script(__file__, "classes", mask_id, deterministic, timeout=900)
    line = [x for x in out.splitlines() if x.startswith("counts ")][-1]
    fwd_calls, fwd_ldsm, fwd_copies, bwd_calls, bwd_ldsm, bwd_copies, partial = map(
        int, line.split()[1:])
    return dict(fwd_calls=fwd_calls, bwd_calls=bwd_calls, partial=partial,
                fwd=np.array([fwd_ldsm, fwd_copies]), bwd=np.array([bwd_ldsm, bwd_copies]))


@needs_cxx
def test_mma_tile_classes_skip_empty_and_leave_full_unevaluated():
    """With a mask_mod the mma.sync kernels classify each chunk against their tile on the
    device: the mask_mod is evaluated exactly on the pairs of the tiles the classes leave
    partial, in the forward and in the backward (ordered dQ for one mask, atomic for the
    other), not on full ones; empty chunks are neither loaded nor computed (against a mask_mod
    that shows every pair, all tiles full: no pair evaluated); results match the reference."""
    chunked = _class_counts("chunked128", "True")
    prefix = _class_counts("prefix-lm", "False")
    always = _class_counts("always", "False")
    print(chunked, prefix, always)
    for c in (chunked, prefix):
        assert 0 < c["partial"] and c["fwd_calls"] == c["partial"], c
        assert c["bwd_calls"] == c["partial"], c
    assert always["fwd_calls"] == always["bwd_calls"] == always["partial"] == 0, always
    # chunked causal over 192 + 70 + 5 rows computes 7 of the 10 tile pairs a mask_mod showing
    # every pair does (of them 2 full), forward and backward
    assert (chunked["fwd"] < 0.75 * always["fwd"]).all(), (chunked, always)
    assert (chunked["bwd"] < 0.75 * always["bwd"]).all(), (chunked, always)


@needs_cxx
@pytest.mark.parametrize("mask_id, score_id, dtype, softcap, block_m", [
    pytest.param("causal-builtin", "alibi", "float16", "0", "64", id="causal-alibi-fp16"),
    pytest.param("segments", "relative-bias", "bfloat16", "5", "128",
                 id="segments-relbias-softcap-bf16-BM128"),
])
def test_mma_aux_grads(mask_id, score_id, dtype, softcap, block_m):
    """Gradients of the score_mod's float aux arrays (per-head ALiBi slopes, a [Hq, 13]
    relative-bias table), float32 atomics in the dK/dV kernel."""
    _emulate("aux-grads", mask_id, score_id, dtype, softcap, block_m)


@needs_cxx
def test_mma_aux_grads_deterministic():
    """deterministic=True with the gradients of learnable ALiBi slopes and a relative-bias
    table (fixed-point sums): bitwise equal across emulation schedules, and near the
    reference; GQA 4/2, a zero-length sequence, pad gaps."""
    _emulate("aux-grads-deterministic", "float16")


@needs_cxx
def test_sm90a_forward_tile_classes_skip_empty_and_leave_full_unevaluated():
    """The sm_90a forward classifies each work item's key chunks on the device too: the
    mask_mod is evaluated exactly on the pairs of the tiles the classes leave partial, an empty
    chunk's K is not loaded (the TMA loads of K are the tile pairs not classified empty), and
    against a mask_mod that shows every pair no pair is evaluated; results match the
    reference, the queries of items left without a chunk ("first-tile") included; one and two
    consumer warpgroups (two heads packed per position)."""
    for mask_id, pack in (("chunked128", "1"), ("prefix-lm", "2"), ("always", "1"),
                          ("first-tile", "2")):
        out = emulate_script(__file__, "sm90-classes", mask_id, pack, timeout=900)
        line = [x for x in out.splitlines() if x.startswith("counts ")][-1]
        calls, partial, k_loads, kept = map(int, line.split()[1:])
        assert calls == partial, (mask_id, calls, partial)
        assert k_loads == kept, (mask_id, k_loads, kept)
        assert (partial > 0) == (mask_id != "always"), (mask_id, partial)
        if mask_id == "chunked128":
            # 8 of the 14 scheduled tile pairs of 192 + 70 + 5 rows, per head
            assert kept == 8 * 2, kept


# Mutations of the sm_90a forward's chunk classes that its class case ("first-tile": items left
# without a chunk, blocks reusing both tables) must catch: name -> (kernel source, old, new, what
# the failure says).
SM90_CLASS_MUTATIONS = {
    # a partial chunk taken as full: its pairs are not tested against the mask_mod
    "partial-as-full": ("mask.cuh",
                        "const int cls = n < CAP ? static_cast<int>(table[n]) : TILE_PARTIAL;",
                        "const int cls = n < CAP && table[n] != TILE_PARTIAL ? "
                        "static_cast<int>(table[n]) : TILE_FULL;", "max abs error"),
    # the producer loads the chunks the consumers skip: the ring's phases part (reported at
    # an mbarrier, or as a deadlock)
    "producer-loads-empty": ("fwd_sm90.cuh",
                             "(plan, i_tile, ClassTable{sm.cls(table)});\n        Chunk prev{};",
                             "(plan, i_tile, KeepAll{});\n        Chunk prev{};",
                             ("mbarrier", "(a deadlock?)")),
}


@needs_cxx
@pytest.mark.parametrize("name", list(SM90_CLASS_MUTATIONS))
def test_sm90a_forward_class_mutation_is_caught(name, tmp_path):
    source, old, new, says = SM90_CLASS_MUTATIONS[name]
    src = mutated_sources(tmp_path, source, old, new)
    assert_mutant_caught(run_mutated([__file__, "sm90-classes", "first-tile"], src), name,
                         "first-tile", says)


@needs_cxx
def test_sm90a_forward_packed_heads():
    """The sm_90a forward, two query heads packed per position: segments (a per-token aux
    array) and a relative bias table indexed by the packed row's own head."""
    _emulate("sm90", "segments", "relative-bias", "2")


@needs_cxx
def test_out_of_range_aux_index_is_recorded():
    _emulate("index-error")


def test_implementations_say_what_they_refuse():
    """The family and cupy:mma run mask_mod and score_mod forward and backward, and aux
    gradients, with deterministic=True too (fixed-point sums); the sm_90a backward runs a
    mask_mod (alone or ANDed with a Mask, either dQ mode) and no score_mod (the device
    questions answered by a stand-in H100)."""
    import varlen
    from varlen.backends.base import Problem
    from varlen.backends.cupy import BACKEND, DeviceInfo
    from varlen.mods import Mods
    mask = varlen.MaskMod(lambda b, q, k: k <= q)
    score = varlen.ScoreMod(lambda s, b, h, q, k, t: s + t[h], np.zeros(4, np.float32))
    mma, sm90a = BACKEND.implementation("mma"), BACKEND.implementation("sm90a")

    class Backward(Problem):
        grads = ()

    class Deterministic(Backward):
        deterministic = True
    fwd = Problem("float16", 64, 64, True, Mods(mask=mask, score=score))
    bwd = Backward("float16", 64, 64, True, Mods(mask=mask, score=score))
    grads = Backward("float16", 64, 64, True, Mods(score=score, aux_grads=True))
    repeatable = Deterministic("float16", 64, 64, True, Mods(score=score, aux_grads=True))
    with BACKEND.stand_in_device(DeviceInfo((9, 0), 227 * 1024, "H100")):
        for b in (BACKEND, mma):
            assert b.supports_mods(fwd) is None and b.supports_mods(bwd) is None, b
            assert b.supports_mods(grads) is None, b
            assert b.supports_mods(repeatable) is None, b
            assert "aux_grads" in b.runs_mods, b
        assert "sm_90a backward does not compute gradients" in sm90a.supports_mods(grads)
        assert "aux_grads" not in sm90a.runs_mods
        assert sm90a.supports_mods(fwd) is None
        for mods in (Mods(mask=mask), Mods(mask=varlen.Mask(window_left=3) & mask)):
            for b in (Backward, Deterministic):
                assert sm90a.supports_mods(b("float16", 64, 64, True, mods)) is None, mods
        for mods in (Mods(mask=mask, score=score), Mods(score=score)):
            why = sm90a.supports_mods(Backward("float16", 64, 64, True, mods))
            assert why.startswith("its sm_90a backward does not run a score_mod (a mask_mod it "
                                  "runs)") and "backend='cupy'" in why, why
        many = varlen.MaskMod(lambda b, q, k, *a: k <= q, *[np.zeros(1, np.int32)] * 9)
        assert "at most 8 aux arrays" in mma.supports_mods(
            Problem("float16", 64, 64, True, Mods(mask=many)))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
