"""Attention dropout on the CuPy mma.sync kernels, on a CPU: the DROPOUT variants of the forward
and dK/dV kernels (kernels_cuda/dropout.cuh) run through the host emulation (each case in its
own process, as the emulation replaces `cupy`).

* The keep set, exactly: with q = 0 every visible key of a row has the same probability and
  v = one-hot columns of the key position, so `out[i, h, j] > 0` is the keep bit of (i, j); with
  dout = one-hot columns of the query position, `dv[j, h, i] > 0` is the backward's. Both equal
  `varlen.reference.dropout_keep` (the rule of docs/semantics.md, "Dropout") on the visible
  pairs: a zero- and a one-row sequence, lengths no multiple of a tile; then on a shard whose
  queries and keys start at positions 5 and 3 and whose heads start at global head 3 (as under
  context parallelism), where the kernels draw per element instead of once per 4 keys.
* Against the float64 reference with the same seed (the same keep set), STYLE.md tolerances:
  forward and backward (both dQ modes), GQA 4/2, causal with windows, a zero- and a one-row
  sequence, padding gaps; a mask_mod and a score_mod with dropout; sinks with dropout.
* The same seed gives bitwise the same out, lse and gradients (deterministic=True); another
  seed, another out.
* A mutation of the keep bit (emulation/mutations.py, KEEP_BIT_MUTATIONS) fails the exact case.
* What the implementations refuse (no emulation): the sm_90a kernels refuse dropout by name,
  `backend="cupy"` runs it on cupy:mma.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from helpers import emulate_script, mutated_sources, needs_cxx, run_mutated

P, SEED, OFFSET = 0.3, (7 << 40) | 12345, 3


def _emulate(*case, timeout=900):
    emulate_script(__file__, *case, timeout=timeout)


# --------------------------------------------------------------------------------------------
# The emulated cases
# --------------------------------------------------------------------------------------------

def _setup():
    import emulation.cupy as emu
    from varlen.backends.cupy import BACKEND
    from varlen.dropout import make_dropout
    emu.install_fake_cupy(64, 64)
    return BACKEND.implementation("mma"), make_dropout(P, SEED, OFFSET)


def _one_hot_batch(Lq, Lk, H, D, q_pos=0, k_pos=0):
    """q = 0, k random, v[j] = e_(k_pos + j) % D and dout[i] = e_(q_pos + i) % D, float16."""
    rng = np.random.default_rng(3)
    Tq, Tk = sum(Lq), sum(Lk)
    q = np.zeros((Tq, H, D), np.float16)
    k = rng.standard_normal((Tk, H, D)).astype(np.float16)
    v = np.zeros((Tk, H, D), np.float16)
    dout = np.zeros((Tq, H, D), np.float16)
    for lengths, x, pos in ((Lk, v, k_pos), (Lq, dout, q_pos)):
        row = 0
        for n in lengths:
            x[row + np.arange(n), :, (pos + np.arange(n)) % D] = 1.0
            row += n
    return q, k, v, dout


def _check_keep(label, out, dv, keep, visible, q_row, k_row):
    """out [Tq, H, D] and dv [Tk, H, D] of `_one_hot_batch` against the bool keep set
    [H, Lq, Lk] of one sequence whose rows start at q_row and k_row (columns: positions)."""
    H, Lq, Lk = keep.shape
    assert out.shape[2] >= max(Lq, Lk), "one column per query and key position"
    for h in range(H):
        got_fwd = out[q_row:q_row + Lq, h].astype(np.float32)
        got_bwd = dv[k_row:k_row + Lk, h].astype(np.float32).T
        for what, got in (("out", got_fwd), ("dv", got_bwd)):
            assert np.isfinite(got).all(), f"{label} {what}: not finite"
            cols = got[:, :Lk] if what == "out" else got[:Lq, :]
            want = keep[h] & visible
            assert np.array_equal(cols > 0, want), (
                f"{label} {what} head {h}: keep bits differ at "
                f"{np.argwhere((cols > 0) != want)[:6].tolist()}")


def _case_keep_set():
    """The kept pairs of the forward (out) and the backward (dV) are dropout_keep's, exactly:
    sequences of 0, 1, 37 and 64 queries and keys, a causal mask, two heads."""
    import varlen
    from varlen import reference
    impl, drop = _setup()
    lengths, H, D = [0, 1, 37, 64], 2, 64
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, dout = _one_hot_batch(lengths, lengths, H, D)
    plan = varlen.plan(cu, cu, mask="causal", block_m=64, block_n=64)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
    out, lse = impl.forward(plan, q, k, v, dropout=drop, **kw)
    _, _, dv = impl.backward(plan, dout, q, k, v, out, lse, dropout=drop, **kw)
    keeps = reference.dropout_keep(cu, cu, H, P, SEED, OFFSET)
    for b, n in enumerate(lengths):
        visible = np.tril(np.ones((n, n), bool))
        _check_keep(f"sequence {b} (emulated)", out, dv, keeps[b], visible, cu[b], cu[b])
    print("ok keep set")


def _case_keep_set_unaligned():
    """A shard whose queries start at position 5 and keys at 3 of its sequence (context
    parallelism's segments): the kernels draw per element there; the keep set is still the
    rule's at those positions. Its local head 0 is global head 3 (a Ulysses rank's slice of
    the heads, `Dropout.head_offset`): the bits are drawn at heads 3 and 4."""
    from varlen.plan import Segments, build_plan
    impl, drop = _setup()
    drop = drop.for_heads(3)
    Lq, Lk, H, D, q0, k0 = 45, 61, 2, 64, 5, 3

    def seg(n, pos, seqlen):
        i32 = lambda *x: np.array(x, np.int32)  # noqa: E731
        return Segments(i32([0]), i32([n]), i32([pos]), i32(seqlen), n)
    plan = build_plan(seg(Lq, q0, 100), seg(Lk, k0, 100), "full", block_m=64, block_n=64)
    q, k, v, dout = _one_hot_batch([Lq], [Lk], H, D, q0, k0)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
    out, lse = impl.forward(plan, q, k, v, dropout=drop, **kw)
    _, _, dv = impl.backward(plan, dout, q, k, v, out, lse, dropout=drop, **kw)
    h, i, j = np.meshgrid(np.arange(H), q0 + np.arange(Lq), k0 + np.arange(Lk), indexing="ij")
    keep = drop.keep(0, h, i, j)
    # columns of out and dv are positions mod D: roll them back to rows and keys
    out = np.roll(out, -k0, axis=2)
    dv = np.roll(dv, -q0, axis=2)
    _check_keep("shard at positions 5 and 3 (emulated)", out, dv, keep,
                np.ones((Lq, Lk), bool), 0, 0)
    print("ok keep set, unaligned")


def _reference_case(variant, dtype, deterministic):
    """Forward and backward with dropout against the float64 reference (same seed, same keep
    set): `variant` "gqa-window" (causal with per-sequence windows, bottom-right rows without
    a key), "mods" (a window & prefix-LM mask_mod and an ALiBi score_mod), "sinks"."""
    import varlen
    from mods_cases import mask_cases, score_cases
    from varlen._sinks import add_sinks, sink_grads
    from varlen.mods import Mods, split_mask
    from varlen.testing import check_against_reference, make_batch
    impl, drop = _setup()
    Hq, Hk, D = 4, 2, 64
    lengths_q, lengths_k = [3, 1, 70, 0, 20], [0, 1, 70, 0, 9]
    mask = varlen.Mask(window_left=np.array([-1, 0, 3, -1, -1], np.int32), window_right=0,
                       bottom_right=np.array([True, False, False, False, True]))
    mods, score = None, None
    if variant == "mods":
        lengths_q = lengths_k = [0, 1, 70]
        mask = dict(mask_cases(lengths_q))["window&prefix"]
        score = dict(score_cases(Hq))["alibi"]
        mods = Mods(mask=split_mask(mask)[1], score=score)
    b = make_batch(np.random.default_rng(6), lengths_q, lengths_k, Hq=Hq, Hk=Hk, D=D,
                   dtype=dtype, mask=mask, gaps=True)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=mask,
                       num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], block_m=64,
                       block_n=64)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), softcap=0.0)
    extra = {"mods": mods} if mods else {}
    out, lse = impl.forward(plan, b.q, b.k, b.v, dropout=drop, **kw, **extra)
    sinks = None
    if variant == "sinks":
        sinks = np.array([0.5, -np.inf, 7.0, -2.0], np.float32)
        out, lse = add_sinks(out, lse, sinks, plan.q.covered())
    grads = impl.backward(plan, b.dout, b.q, b.k, b.v, out, lse, dropout=drop,
                          deterministic=deterministic == "True", **kw, **extra)
    if sinks is not None:
        grads = tuple(grads) + (sink_grads(b.dout, out, lse, sinks, plan.q.covered()),)
    label = f"{variant} {dtype} deterministic={deterministic} p={P} (emulated)"
    check_against_reference(b, out, lse, grads, score_mod=score, sinks=sinks, label=label,
                            dropout_p=P, seed=SEED, offset=OFFSET, **kw)
    varlen.check_device_errors()
    print(f"ok {label}")


def _case_repeat():
    """deterministic=True: the same seed twice gives bitwise the same out, lse, dq, dk, dv;
    another seed another out (and dropout changes the output at all)."""
    import varlen
    from varlen.dropout import make_dropout
    from varlen.testing import make_batch
    impl, drop = _setup()
    b = make_batch(np.random.default_rng(2), [1, 66], Hq=4, Hk=2, D=64, dtype="bfloat16",
                   mask="causal")
    plan = varlen.plan(b.cu_q, b.cu_k, mask="causal", block_m=64, block_n=64)
    kw = dict(softmax_scale=1.0 / math.sqrt(64), softcap=0.0)

    def run(d, backward=True):
        extra = {} if d is None else {"dropout": d}
        out, lse = impl.forward(plan, b.q, b.k, b.v, **kw, **extra)
        if not backward:
            return out, lse
        return (out, lse, *impl.backward(plan, b.dout, b.q, b.k, b.v, out, lse,
                                         deterministic=True, **kw, **extra))
    first, again = run(drop), run(drop)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), first, again):
        bits = np.uint16 if x.dtype.itemsize == 2 else np.uint32
        assert np.array_equal(x.view(bits), y.view(bits)), (
            f"{name}: two runs with seed {SEED} differ")
    other = run(make_dropout(P, SEED + 1, OFFSET), backward=False)
    none = run(None, backward=False)
    for name, x in (("another seed", other[0]), ("no dropout", none[0])):
        assert not np.array_equal(first[0], x), f"{name} gives the same out"
    print("ok repeat")


CASES = {"keep-set": _case_keep_set, "keep-set-unaligned": _case_keep_set_unaligned,
         "reference": _reference_case, "repeat": _case_repeat}


def _main(argv):
    CASES[argv[0]](*argv[1:])
    return 0


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------

@pytest.mark.smoke
@needs_cxx
def test_keep_set_is_the_rule():
    _emulate("keep-set")


@needs_cxx
def test_keep_set_at_unaligned_positions():
    _emulate("keep-set-unaligned")


@needs_cxx
@pytest.mark.parametrize("variant, dtype, deterministic", [
    pytest.param("gqa-window", "float16", "False", id="gqa-window-fp16"),
    pytest.param("gqa-window", "bfloat16", "True", id="gqa-window-bf16-deterministic"),
    pytest.param("mods", "float16", "False", id="mask-mod-score-mod-fp16"),
    pytest.param("sinks", "float16", "False", id="sinks-fp16"),
])
def test_dropout_matches_reference(variant, dtype, deterministic):
    _emulate("reference", variant, dtype, deterministic)


@needs_cxx
def test_same_seed_bitwise_another_seed_differs():
    _emulate("repeat")


@needs_cxx
@pytest.mark.parametrize("index", [0, 1], ids=["forward-lane", "dkdv-lane"])
def test_keep_bit_mutation_is_caught(tmp_path, index):
    from emulation.mutations import KEEP_BIT_MUTATIONS
    name, old, new, what, case = KEEP_BIT_MUTATIONS[index]
    proc = run_mutated([__file__, case], mutated_sources(tmp_path, name, old, new))
    assert proc.returncode != 0, f"{what}: the mutated kernels passed the {case} case"
    assert "keep bits differ" in proc.stdout + proc.stderr, (
        f"{what}: failed otherwise:\n{proc.stderr[-2000:]}")


def test_refusals():
    """The sm_90a kernels refuse dropout, naming it; the family and cupy:mma run it."""
    from varlen.backends import cupy as cupy_backend
    from varlen.backends.base import Problem
    from varlen.dropout import make_dropout
    call = Problem("float16", 64, 64, True, dropout=make_dropout(P, SEED))
    sm90, mma = (cupy_backend.BACKEND.implementation(n) for n in ("sm90a", "mma"))
    assert "dropout" in sm90.supports_dropout(call)
    assert mma.supports_dropout(call) is None
    assert cupy_backend.BACKEND.supports_dropout(call) is None
    with pytest.raises(ValueError, match="dropout_p=0.3"):
        sm90.forward(None, None, None, None, softmax_scale=1.0, softcap=0.0,
                     dropout=call.dropout)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
