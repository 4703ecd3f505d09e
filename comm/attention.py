"""Context-parallel attention: ring, all-gather and Ulysses, forward and backward.

Every rank holds its shard of q, k, v (`part.shard(x, rank)`); every method ends in ordinary
backend calls over segments whose positions are global, so each sequence's mask (causal,
bidirectional, sliding window, bottom-right, mixed per sequence) is evaluated exactly as in the
single-process call, and pad rows, which belong to no segment, are never keys and get zero
outputs and gradients.

* `ring`: K/V travel the ring (rank r receives from r-1, sends to r+1). At step i rank r holds
  the K/V of rank `(r - i) % cp`; the transfer for step i+1 is committed before step i's kernel
  runs. Partial outputs merge through their LSE (`merge_partial`). Backward: dQ accumulates
  locally, and the dK/dV accumulators (float32, float64 for float64) travel the ring one hop
  behind K/V and arrive at their owners after the last step.
  On a `"document"` partition step i instead works on compact buffers: only the rows of
  documents split between rank r and rank `(r - i) % cp` (host-known sizes), all of them
  posted before step 0, nothing between ranks that share no document; each step's dK/dV go
  straight back to their owner.
* `allgather`: K/V all-gathered once (cheap for GQA, whose K/V are small), one kernel call over
  the gathered segments; dK/dV reduce-scattered back.
* `ulysses`: all-to-all from sequence shards to head shards, one kernel call over the whole
  sequence for `Hq / cp` heads, all-to-all back. KV heads are replicated when `Hk` does not
  divide by cp (GQA); `Hq` must.
* `usp` (`ulysses_size=u`, cp = u x r): the two levels of a cluster. Inside each group of u
  consecutive ranks (a node) an all-to-all over heads gives every rank the group's rows (its
  u shards, in rank order) for `Hq / u` heads (KV heads replicated as for Ulysses when `Hk`
  does not divide by u); across the r groups the ranks of one head slice run the ring over the
  groups' rows; an all-to-all brings the results back. The groups are `group.split` once and
  kept: their bytes are counted as `"intra"` and `"inter"` in `group.traffic`.

One call on one rank: the setup step (`varlen._setup.setup`, shared with the single-process
API) checks and normalises the arguments, the context-parallel ones included; the rank's step
plans (one per kernel call, see `partition.StepPlans`) come from `plan=` or the partition's
cache, so they are built once per partition, mask, method and tile size; one host exchange
makes every rank agree on what it was called with, or all raise the same error (`_agree`);
then the method runs. A step (or a tile) with nothing visible is skipped by the plan's
schedule; for host data a step whose schedule is empty is not even launched.
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
import zlib
from dataclasses import dataclass, field, replace

import numpy as np

from varlen._array import Origin, digest, host_copy
from varlen._setup import CP_METHODS, Call, setup
from varlen._validate import dtype_name

from .chunked import Partition
from .group import Group, GroupAborted
from .merge import accumulate_dtype, merge_partial
from .model import PRESETS, Cluster, choose
from .plans import (StepPlans, check_step_plans, mask_key, mod_key,
                    step_plans)

__all__ = ["attention_forward", "attention_backward", "METHODS", "TWO_LEVEL_METHODS"]

# The methods that run on one flat group with no further argument, and the two-level ones
# (which take `ulysses_size`); `method=` takes either.
METHODS = tuple(m for m in CP_METHODS if m != "usp")
TWO_LEVEL_METHODS = ("usp",)

# Channel tags: K/V and the travelling dK/dV accumulators are in flight at the same time.
_TAG_KV, _TAG_DKV = 11, 12


@dataclass(frozen=True)
class _RankCall:
    """A checked call running on one rank of its group: the runtime state of one forward or
    backward. What its kernel calls compute (the step plans) is metadata, kept apart."""

    call: Call
    group: Group
    # Backward with aux gradients: this rank's partial sums (float64, one per float aux
    # array, None for the others), added to by every kernel call (`backward`).
    daux: list = field(default_factory=list)
    # The global number of this rank's first query head when its kernels see a slice of the
    # heads (usp's ring, whose `group` is the ring across nodes); None: from the method.
    head_first: int | None = None

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def cp(self) -> int:
        return self.group.size

    @property
    def xp(self):
        return self.call.xp

    @property
    def acc(self):
        return accumulate_dtype(self.call.q.dtype)

    @property
    def first_head(self) -> int:
        """The global query head of the kernels' local head 0: under Ulysses a rank computes
        query heads `[rank * Hq / cp, (rank + 1) * Hq / cp)` (usp: its place in its node);
        0 where the kernels see every head."""
        if self.head_first is not None:
            return self.head_first
        if self.call.method == "ulysses":
            return self.rank * self.call.heads_q // self.cp
        return 0

    @property
    def mods(self) -> dict:
        """The kernels' `mods=` keyword (none without user functions); the score function's
        `h` is made global by a rewrite of its graph (`Mods.for_heads`)."""
        c = self.call
        if not c.mods:
            return {}
        return {"mods": c.mods.for_heads(self.first_head)}

    @property
    def dropout(self) -> dict:
        """The kernels' `dropout=` keyword (none without dropout): the call's, its keep bits
        drawn at the global query head (`Dropout.for_heads`); sequences and positions are
        the batch's in every step plan, so each pair keeps the bit it has at CP=1."""
        d = self.call.dropout
        return {} if d is None else {"dropout": d.for_heads(self.first_head)}

    def forward(self, plan, q, k, v):
        c = self.call
        return c.backend.forward(plan, q, k, v, softmax_scale=c.softmax_scale,
                                 softcap=c.softcap, **self.mods, **self.dropout)

    def backward(self, plan, dout, q, k, v, out, lse):
        """`(dq, dk, dv)` of one kernel call; with aux gradients, the call's aux gradients
        are added into `self.daux`."""
        c = self.call
        grads = c.backend.backward(plan, dout, q, k, v, out, lse, softmax_scale=c.softmax_scale,
                                   softcap=c.softcap, deterministic=c.deterministic,
                                   **self.mods, **c.sinks_flag(c.backend), **self.dropout)
        if c.mods.aux_grads:
            if not self.daux:
                self.daux.extend(None if g is None else self.xp.zeros(g.shape, np.float64)
                                 for g in grads[3])
            for total, g in zip(self.daux, grads[3]):
                if g is not None:
                    total += g
        return grads[:3]

    def valid_rows(self):
        """Bool `[Tq_local]`: this rank's query rows that hold a token."""
        return self.call.part[0].valid(self.rank)

    def group_sum(self, flat):
        """The sum over the group of each rank's flat array (one all-gather, added in rank
        order: the same bits on every rank)."""
        return self.group.allgather(flat).sum(axis=0)

    def aux_grads(self, summed: bool) -> tuple:
        """The aux gradients, float32 like the single-process API: this rank's partial sums,
        or (`summed`) the whole call's on every rank, the partial sums added over the group
        (one all-gather of the flattened sums, added in rank order: the same bits on every
        rank)."""
        c, xp = self.call, self.xp
        shapes = [None if kind != "float" else tuple(a.shape)
                  for (kind, _, _), a in zip(c.mods.score.graph.aux, c.mods.score.aux)]
        mine = self.daux or [None if s is None else xp.zeros(s, np.float64) for s in shapes]
        flat = xp.concatenate([g.reshape(-1) for g in mine if g is not None])
        total = self.group_sum(flat) if summed else flat
        out, at = [], 0
        for s in shapes:
            if s is None:
                out.append(None)
                continue
            n = math.prod(s)
            out.append(total[at:at + n].reshape(s).astype(np.float32))
            at += n
        return tuple(out)


# --------------------------------------------------------------------------------------------
# Setup, agreement, and the guard that keeps every rank moving together
# --------------------------------------------------------------------------------------------

def _warn_outside_autograd(what: str, arrays) -> None:
    """A PyTorch tensor that requires grad, with grad mode on, gets a result autograd does not
    track: say so, and where the differentiable entry point is."""
    if not any(getattr(a, "requires_grad", False) for a in arrays):
        return
    import torch
    if torch.is_grad_enabled():
        warnings.warn(f"varlen.comm.{what} takes tensors that require grad but returns results "
                      f"outside autograd (no gradient flows back through them); use "
                      f"varlen.torch.context_parallel_attention to train", RuntimeWarning,
                      stacklevel=3)


def _checked_call(q, k, v, part, group, plan, **kw) -> tuple[Call, StepPlans]:
    """The setup step on this rank, then the rank's step plans: the given ones (checked), or
    the partition's cached ones."""
    if part is None:
        raise TypeError("part is required: a varlen.comm.partition(...) of this batch (or a "
                        "(queries, keys) pair of them), got None")
    pair = (part, part) if isinstance(part, Partition) else part
    call = setup(q, k, v, part=pair, group_size=group.size, plan=plan, grads_rows="Tq_local",
                 **kw)
    pq, pk = call.part
    where = dict(rank=group.rank, method=call.method, backend=call.backend,
                 blocks=call.blocks(), mask=call.mask, mask_mod=call.mods.mask,
                 ulysses_size=call.ulysses_size)
    if plan is None:
        return call, step_plans(pq, pk, **where)
    check_step_plans(plan, parts=call.part, validate=call.validate, **where)
    return call, plan


# What every rank must agree on: host-known facts (always compared) ...
_FACTS = ("method", "validation", "dtypes", "shapes", "query partition sizes",
          "key partition sizes", "mask", "softmax_scale", "softcap", "backend",
          "mask_mod and score_mod functions", "aux_grads", "sinks", "ulysses_size",
          "dropout (dropout_p, seed, offset)")
# ... and the values behind them (host reads: compared when validation is on).
_VALUES = ("query partition", "key partition", "mask values", "mask_mod and score_mod aux "
           "values", "sinks values")


def _sizes(p) -> tuple:
    return (p.scheme, p.cp_size, p.batch, p.num_rows, p.local_rows, p.seq_offsets is not None)


def _mods_keys(call: Call, values: bool) -> tuple:
    """The user functions' digests (and aux shapes), or with `values` their aux values."""
    keys = []
    for mod in (call.mods.mask, call.mods.score):
        if mod is None:
            keys.append(None)
        elif values:
            keys.append(mod_key(mod.with_aux([host_copy(a) for a in mod.aux]))[1:])
        else:
            keys.append((mod.digest, *(tuple(a.shape) for a in mod.aux)))
    return tuple(keys)


def _signature(call: Call) -> tuple:
    """`(facts, values)` of a call; values only when validating."""
    pq, pk = call.part
    arrays = (call.q, call.k, call.v) + tuple(call.grads or ())
    facts = (call.method, call.validate, tuple(dtype_name(a.dtype) for a in arrays),
             tuple(tuple(a.shape) for a in arrays), _sizes(pq), _sizes(pk),
             mask_key(call.mask, pq.batch), call.softmax_scale, call.softcap, call.backend.name,
             _mods_keys(call, values=False), call.mods.aux_grads, call.sinks is not None,
             call.ulysses_size, None if call.dropout is None else (
                 call.dropout.p, call.dropout.seed, call.dropout.offset))
    values = None
    if call.validate:
        values = (pq.fingerprint(), pk.fingerprint(),
                  tuple(digest(f if isinstance(f, int) else host_copy(f), pq.batch)
                        for f in call.mask.fields()), _mods_keys(call, values=True),
                  None if call.sinks is None else zlib.crc32(
                      np.ascontiguousarray(host_copy(call.sinks)).tobytes()))
    return facts, values


def _disagreement(infos) -> str | None:
    """The first difference between rank 0's signature and another rank's, as a message."""
    for names, i in ((_FACTS, 1), (_VALUES, 2)):
        first = infos[0][i]
        for r, info in enumerate(infos):
            if info[i] != first:
                what = [n for n, a, b in zip(names, first, info[i]) if a != b]
                return (f"ranks 0 and {r} disagree on {', '.join(what)}: every rank must pass "
                        f"the same partition, mask, method and shard shapes and dtypes, with "
                        f"validation set the same way (rank 0: {first}, rank {r}: {info[i]})")
    return None


def _agree(group: Group, call: Call | None, err: Exception | None):
    """Every rank learns whether any rank rejected its arguments, and what the others were
    called with; all raise the same error, or none does. Always on: the host-known facts
    cost one small host exchange and no device read."""
    try:
        mine = (f"{type(err).__name__}: {err}", None, None) if err else (None, *_signature(call))
    except BaseException as e:   # noqa: B902  (a failing host read must not strand peers)
        group.abort(e)
        raise
    infos = group.allgather_object(mine)
    if err is not None:
        raise err
    bad = [(r, info[0]) for r, info in enumerate(infos) if info[0]]
    if bad:
        r, msg = bad[0]
        raise ValueError(f"rank {r} rejected its inputs ({msg}); every rank stops")
    msg = _disagreement(infos)
    if msg:
        raise ValueError(msg)


def _stream_scope(q):
    """The caller's current CUDA stream for the call (PyTorch), as in the single-process API;
    an unusable `q` is reported by the setup step instead."""
    try:
        return Origin.of(q).stream_scope()
    except (TypeError, ValueError, AttributeError):
        return contextlib.nullcontext()


def _run(group, q, prepare, compute):
    """Set up, agree, compute; returns `(call, result)`.

    Argument errors on any rank become the same error on every rank (`_agree`). Any other
    failure aborts the group, so that no rank waits for a peer that has stopped.
    """
    if not isinstance(group, Group):
        raise TypeError(f"group must be a varlen.comm group (init() or local_group()), got "
                        f"{type(group).__name__}")
    with _stream_scope(q):
        call = steps = err = None
        try:
            call, steps = prepare()
        except (ValueError, TypeError) as e:
            err = e
        except BaseException as e:   # noqa: B902  (an unexpected failure must not strand peers)
            group.abort(e)
            raise
        _agree(group, call, err)
        try:
            return call, compute(_RankCall(call, group), steps)
        except GroupAborted:
            raise
        except BaseException as e:   # noqa: B902  (abort first, whatever it was)
            group.abort(e)
            raise


# --------------------------------------------------------------------------------------------
# Ring
# --------------------------------------------------------------------------------------------

def _post_exchange(ch, send, peer_out, peer_in, xp):
    """Post sending each array of `send` to `peer_out` and receiving its twin from `peer_in`;
    returns the receive buffers."""
    recv = [xp.empty_like(a) for a in send]
    for a in send:
        ch.post_send(a, peer_out)
    for b in recv:
        ch.post_recv(b, peer_in)
    ch.commit()
    return recv


def _ring_forward(rc: _RankCall, steps: StepPlans):
    c, xp, cp, rank = rc.call, rc.xp, rc.cp, rc.rank
    nxt, prv = (rank + 1) % cp, (rank - 1) % cp
    ch = rc.group.p2p(_TAG_KV)
    k, v = xp.ascontiguousarray(c.k), xp.ascontiguousarray(c.v)
    out = lse = None
    for step in range(cp):                    # K/V of rank (rank - step) % cp
        incoming = _post_exchange(ch, (k, v), nxt, prv, xp) if step + 1 < cp else None
        if steps.busy[step]:
            o, l = rc.forward(steps.plans[step], c.q, k, v)
            if out is None:
                out, lse = o.astype(rc.acc), l.astype(rc.acc)
            else:
                out, lse = merge_partial(out, lse, o, l)
        if incoming is not None:
            ch.wait()
            k, v = incoming
    return _finish_forward(rc, out, lse)


def _finish_forward(rc: _RankCall, out, lse):
    q = rc.call.q
    Tq, Hq, _ = q.shape
    if out is None:                                  # nothing visible anywhere on this rank
        out = rc.xp.zeros((Tq, Hq, rc.call.head_dim_v), dtype=rc.acc)
        lse = rc.xp.full((Hq, Tq), -np.inf, dtype=rc.acc)
    lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
    return out.astype(q.dtype), lse.astype(lse_dtype)


def _ring_backward(rc: _RankCall, steps: StepPlans):
    c, xp, cp, rank = rc.call, rc.xp, rc.cp, rc.rank
    dout, out, lse = c.grads
    nxt, prv = (rank + 1) % cp, (rank - 1) % cp
    kv_ch, dkv_ch = rc.group.p2p(_TAG_KV), rc.group.p2p(_TAG_DKV)
    k, v = xp.ascontiguousarray(c.k), xp.ascontiguousarray(c.v)
    dq = xp.zeros(c.q.shape, dtype=rc.acc)
    dkv_in = None
    for step in range(cp):
        incoming = _post_exchange(kv_ch, (k, v), nxt, prv, xp) if step + 1 < cp else None
        dk_s = dv_s = None
        if steps.busy[step]:
            dq_s, dk_s, dv_s = rc.backward(steps.plans[step], dout, c.q, k, v, out, lse)
            dq += dq_s
        # The accumulators of this step's K/V block arrive from the rank that held it one
        # step earlier.
        if dkv_in is None:
            dk, dv = xp.zeros(k.shape, dtype=rc.acc), xp.zeros(v.shape, dtype=rc.acc)
        else:
            dkv_ch.wait()
            dk, dv = dkv_in
        if dk_s is not None:
            dk += dk_s
            dv += dv_s
        if incoming is not None:
            kv_ch.wait()
            k, v = incoming
        if cp > 1:
            # After the last step this hop brings each block's accumulators home.
            dkv_in = _post_exchange(dkv_ch, (dk, dv), nxt, prv, xp)
    if cp > 1:
        dkv_ch.wait()
        dk, dv = dkv_in
    return dq.astype(c.q.dtype), dk.astype(c.k.dtype), dv.astype(c.v.dtype)


# --------------------------------------------------------------------------------------------
# Ring over a document partition: only split documents' rows travel, only between sharers
# --------------------------------------------------------------------------------------------
#
# At step i rank r works on the compact buffer of rank (r - i) % cp's K/V rows of the documents
# both hold (`part.ring_rows(src, r)`, host-known size), and rank (r + i) % cp on its own. Every
# step's exchange is posted at once before step 0 (the rank's own documents, most of its work),
# so all of them overlap it; a document that lives whole on one rank is in no buffer, and a
# rank that shares none posts nothing. Backward sends each step's dK/dV of the received rows
# straight back to their owner, which adds them into its own rows.

def _doc_post(ch, sends, recvs):
    """Post the non-empty `(array, peer)` sends and `(buffer, peer)` receives; commit if any.
    Returns whether a batch is in flight."""
    posted = False
    for a, peer in sends:
        if a.shape[0]:
            ch.post_send(a, peer)
            posted = True
    for b, peer in recvs:
        if b.shape[0]:
            ch.post_recv(b, peer)
            posted = True
    if posted:
        ch.commit()
    return posted


def _doc_kv_prefetch(rc, ch, part, k, v):
    """Every step's K/V exchange of the document ring, posted at once before step 0's kernels
    (the buffers are compact and their sizes host-known: the transfers of all steps overlap
    the rank's own documents, which hold most of its work). Returns `({step: (k, v)}, in
    flight)`; step 0 is this rank's own K/V."""
    xp, cp, rank = rc.xp, rc.cp, rc.rank
    got, sends, recvs = {0: (k, v)}, [], []
    for step in range(1, cp):
        dst, src = (rank + step) % cp, (rank - step) % cp
        idx = part.ring_rows(rank, dst)
        n_in = part.ring_count(src, rank)
        k_in = xp.empty((n_in,) + k.shape[1:], dtype=k.dtype)
        v_in = xp.empty((n_in,) + v.shape[1:], dtype=v.dtype)
        sends += [(xp.ascontiguousarray(k[idx]), dst), (xp.ascontiguousarray(v[idx]), dst)]
        recvs += [(k_in, src), (v_in, src)]
        got[step] = (k_in, v_in)
    return got, _doc_post(ch, sends, recvs)


def _doc_ring_forward(rc: _RankCall, steps: StepPlans):
    c, cp = rc.call, rc.cp
    part = steps.parts[1]
    ch = rc.group.p2p(_TAG_KV)
    k, v = rc.xp.ascontiguousarray(c.k), rc.xp.ascontiguousarray(c.v)
    out = lse = None
    kv, flying = _doc_kv_prefetch(rc, ch, part, k, v)
    for step in range(cp):
        if step == 1 and flying:
            ch.wait()
        if steps.busy[step]:
            o, l = rc.forward(steps.plans[step], c.q, *kv[step])
            if out is None:
                out, lse = o.astype(rc.acc), l.astype(rc.acc)
            else:
                out, lse = merge_partial(out, lse, o, l)
    return _finish_forward(rc, out, lse)


def _doc_ring_backward(rc: _RankCall, steps: StepPlans):
    c, xp, cp, rank = rc.call, rc.xp, rc.cp, rc.rank
    dout, out, lse = c.grads
    part = steps.parts[1]
    kv_ch, dkv_ch = rc.group.p2p(_TAG_KV), rc.group.p2p(_TAG_DKV)
    k, v = xp.ascontiguousarray(c.k), xp.ascontiguousarray(c.v)
    dq = xp.zeros(c.q.shape, dtype=rc.acc)
    dk, dv = xp.zeros(k.shape, dtype=rc.acc), xp.zeros(v.shape, dtype=rc.acc)
    kvs, kv_flying = _doc_kv_prefetch(rc, kv_ch, part, k, v)
    back = None                  # (rows of mine, dk in, dv in, in flight) of the last step
    for step in range(cp):
        if step == 1 and kv_flying:
            kv_ch.wait()
        kv = kvs[step]
        dst, src = (rank + step) % cp, (rank - step) % cp
        dk_s = xp.zeros(kv[0].shape, dtype=rc.acc)
        dv_s = xp.zeros(kv[1].shape, dtype=rc.acc)
        if steps.busy[step]:
            dq_s, dk_b, dv_b = rc.backward(steps.plans[step], dout, c.q, kv[0], kv[1], out,
                                           lse)
            dq += dq_s
            dk_s += dk_b
            dv_s += dv_b
        if back is not None:
            _doc_settle(dkv_ch, back, dk, dv)
        if step == 0:
            dk += dk_s
            dv += dv_s
            back = None
        else:
            # The received rows' gradients go straight back to their owner `src`; mine come
            # back from `dst`, which received my rows this step.
            idx = part.ring_rows(rank, dst)
            dk_in = xp.empty((idx.shape[0],) + dk.shape[1:], dtype=rc.acc)
            dv_in = xp.empty((idx.shape[0],) + dv.shape[1:], dtype=rc.acc)
            flying = _doc_post(dkv_ch, ((dk_s, src), (dv_s, src)),
                               ((dk_in, dst), (dv_in, dst)))
            back = (idx, dk_in, dv_in, flying)
    if back is not None:
        _doc_settle(dkv_ch, back, dk, dv)
    return dq.astype(c.q.dtype), dk.astype(c.k.dtype), dv.astype(c.v.dtype)


def _doc_settle(ch, back, dk, dv):
    """Wait for returning dK/dV and add them into this rank's rows (each row once per step)."""
    idx, dk_in, dv_in, flying = back
    if flying:
        ch.wait()
    if idx.shape[0]:
        dk[idx] += dk_in
        dv[idx] += dv_in


# --------------------------------------------------------------------------------------------
# All-gather
# --------------------------------------------------------------------------------------------

def _gather_rows(group, x):
    """`[cp * T, ...]`: every rank's rows, rank-major (the gathered segments' layout)."""
    g = group.allgather(x)
    return g.reshape((g.shape[0] * g.shape[1],) + tuple(g.shape[2:]))


def _allgather_forward(rc: _RankCall, steps: StepPlans):
    c = rc.call
    k_all, v_all = _gather_rows(rc.group, c.k), _gather_rows(rc.group, c.v)
    return _finish_forward(rc, *rc.forward(steps.plans[0], c.q, k_all, v_all))


def _allgather_backward(rc: _RankCall, steps: StepPlans):
    c = rc.call
    k_all, v_all = _gather_rows(rc.group, c.k), _gather_rows(rc.group, c.v)
    dq, dk_all, dv_all = rc.backward(steps.plans[0], c.grads[0], c.q, k_all, v_all,
                                     *c.grads[1:])
    cp, Tk = rc.cp, c.rows_k
    dk = rc.group.reduce_scatter(dk_all.astype(rc.acc).reshape((cp, Tk) + c.k.shape[1:]))
    dv = rc.group.reduce_scatter(dv_all.astype(rc.acc).reshape((cp, Tk) + c.v.shape[1:]))
    return dq.astype(c.q.dtype), dk.astype(c.k.dtype), dv.astype(c.v.dtype)


# --------------------------------------------------------------------------------------------
# Ulysses
# --------------------------------------------------------------------------------------------

def _seq_to_heads(rc: _RankCall, x):
    """`[T, H, d]` sequence shard -> `[cp * T, H / cp, d]`: all ranks' rows, my heads."""
    T, H, d = x.shape
    cp = rc.cp
    send = rc.xp.ascontiguousarray(x.reshape(T, cp, H // cp, d).transpose(1, 0, 2, 3))
    return rc.group.alltoall(send).reshape(cp * T, H // cp, d)


def _heads_to_seq(rc: _RankCall, y):
    """`[cp * T, h, d]` head shard -> `[T, cp * h, d]`: my rows, all heads."""
    cp = rc.cp
    R, h, d = y.shape
    T = R // cp
    got = rc.group.alltoall(rc.xp.ascontiguousarray(y.reshape(cp, T, h, d)))   # [cp, T, h, d]
    return got.transpose(1, 0, 2, 3).reshape(T, cp * h, d)


def _lse_to_heads(rc: _RankCall, lse):
    """`[H, T]` -> `[H / cp, cp * T]`."""
    H, T = lse.shape
    cp = rc.cp
    got = rc.group.alltoall(rc.xp.ascontiguousarray(lse.reshape(cp, H // cp, T)))
    return got.transpose(1, 0, 2).reshape(H // cp, cp * T)


def _lse_to_seq(rc: _RankCall, lse):
    """`[h, cp * T]` -> `[cp * h, T]`."""
    h, R = lse.shape
    cp = rc.cp
    send = rc.xp.ascontiguousarray(lse.reshape(h, cp, R // cp).transpose(1, 0, 2))
    return rc.group.alltoall(send).reshape(cp * h, R // cp)


def _kv_replicas(rc: _RankCall) -> int:
    """How many copies of each KV head make the KV heads divisible by cp (GQA)."""
    return rc.cp // math.gcd(rc.call.heads_k, rc.cp)


def _ulysses_inputs(rc: _RankCall):
    f = _kv_replicas(rc)
    q, k, v = rc.call.q, rc.call.k, rc.call.v
    if f > 1:
        # Copy j of head h becomes head h*f + j; query head h still reads a copy of h // G.
        k, v = rc.xp.repeat(k, f, axis=1), rc.xp.repeat(v, f, axis=1)
    return _seq_to_heads(rc, q), _seq_to_heads(rc, k), _seq_to_heads(rc, v), f


def _ulysses_forward(rc: _RankCall, steps: StepPlans):
    q, k, v, _ = _ulysses_inputs(rc)
    o, l = rc.forward(steps.plans[0], q, k, v)
    return _finish_forward(rc, _heads_to_seq(rc, o), _lse_to_seq(rc, l))


def _ulysses_backward(rc: _RankCall, steps: StepPlans):
    c = rc.call
    dout, out, lse = c.grads
    q, k, v, f = _ulysses_inputs(rc)
    dq, dk, dv = rc.backward(steps.plans[0], _seq_to_heads(rc, dout), q, k, v,
                             _seq_to_heads(rc, out), _lse_to_heads(rc, lse))
    dq, dk, dv = _heads_to_seq(rc, dq), _heads_to_seq(rc, dk), _heads_to_seq(rc, dv)
    if f > 1:
        T, Hk = c.k.shape[:2]
        dk = dk.astype(rc.acc).reshape(T, Hk, f, -1).sum(axis=2)
        dv = dv.astype(rc.acc).reshape(T, Hk, f, -1).sum(axis=2)
    return dq.astype(c.q.dtype), dk.astype(c.k.dtype), dv.astype(c.v.dtype)


# --------------------------------------------------------------------------------------------
# usp: Ulysses inside each group of u ranks, the ring across the groups
# --------------------------------------------------------------------------------------------

def _usp_groups(rc: _RankCall):
    """`(node, ring)`: this rank's group of u consecutive ranks, and the ranks of its head
    slice across the groups (the same position in each), split once and kept by the group."""
    u, cp = rc.call.ulysses_size, rc.cp
    node = rc.group.split([tuple(range(g, g + u)) for g in range(0, cp, u)], level="intra")
    ring = rc.group.split([tuple(range(i, cp, u)) for i in range(u)], level="inter")
    return node, ring


def _usp_ring_call(rc: _RankCall, node, ring, **arrays) -> _RankCall:
    """The ring part of usp: over `ring`, on the node's rows of this rank's heads (`arrays`:
    q, k, v, grads as the node's all-to-all left them)."""
    c = rc.call
    return replace(rc, group=ring, call=replace(c, **arrays),
                   head_first=node.rank * c.heads_q // node.size)


def _usp_forward(rc: _RankCall, steps: StepPlans):
    node, ring = _usp_groups(rc)
    nrc = replace(rc, group=node)
    q, k, v, _ = _ulysses_inputs(nrc)
    o, l = _ring_forward(_usp_ring_call(rc, node, ring, q=q, k=k, v=v), steps)
    return _finish_forward(rc, _heads_to_seq(nrc, o), _lse_to_seq(nrc, l))


def _usp_backward(rc: _RankCall, steps: StepPlans):
    c = rc.call
    node, ring = _usp_groups(rc)
    nrc = replace(rc, group=node)
    dout, out, lse = c.grads
    q, k, v, f = _ulysses_inputs(nrc)
    grads = (_seq_to_heads(nrc, dout), _seq_to_heads(nrc, out), _lse_to_heads(nrc, lse))
    dq, dk, dv = _ring_backward(_usp_ring_call(rc, node, ring, q=q, k=k, v=v, grads=grads),
                                steps)
    dq, dk, dv = _heads_to_seq(nrc, dq), _heads_to_seq(nrc, dk), _heads_to_seq(nrc, dv)
    if f > 1:
        T, Hk = c.k.shape[:2]
        dk = dk.astype(rc.acc).reshape(T, Hk, f, -1).sum(axis=2)
        dv = dv.astype(rc.acc).reshape(T, Hk, f, -1).sum(axis=2)
    return dq.astype(c.q.dtype), dk.astype(c.k.dtype), dv.astype(c.v.dtype)


def _ring_forward_any(rc: _RankCall, steps: StepPlans):
    doc = steps.parts[1].scheme == "document"
    return (_doc_ring_forward if doc else _ring_forward)(rc, steps)


def _ring_backward_any(rc: _RankCall, steps: StepPlans):
    doc = steps.parts[1].scheme == "document"
    return (_doc_ring_backward if doc else _ring_backward)(rc, steps)


_FORWARD = {"ring": _ring_forward_any, "allgather": _allgather_forward,
            "ulysses": _ulysses_forward, "usp": _usp_forward}
_BACKWARD = {"ring": _ring_backward_any, "allgather": _allgather_backward,
             "ulysses": _ulysses_backward, "usp": _usp_backward}


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------

def attention_forward(q, k, v, part, group, *, mask="full", softmax_scale=None, softcap=0.0,
                      method="ring", backend=None, plan=None, score_mod=None, sinks=None,
                      ulysses_size=None, return_stats=False, cluster=None, dropout_p=0.0,
                      seed=None, offset=0):
    """Context-parallel attention forward on one rank. Returns this rank's `(out, lse)`.

    Call it on every rank of `group` with the same partition, mask and method.

    Args:
        q: `[Tq_local, Hq, D]`, this rank's query shard, `part.shard(q_global, rank)`.
        k, v: `[Tk_local, Hk, D]` and `[Tk_local, Hk, Dv]`, this rank's key/value shards;
            `Hq % Hk == 0` (GQA/MQA). Same dtypes as the single-process API.
        part: `varlen.comm.partition(cu_seqlens, cp_size, ...)`; for cross attention with
            different query and key lengths, a pair `(part_q, part_k)`.
        group: a group of `cp_size` ranks (`varlen.comm.init(...)` or `local_group(n)[r]`).
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask` with per-sequence
            fields, or a `varlen.MaskMod` (or `Mask & MaskMod`); positions are global, so the
            result is the single-process one.
        softmax_scale: default `1/sqrt(D)`. softcap: as in `varlen.attention_forward`.
        score_mod: a `varlen.ScoreMod`, as in `varlen.attention_forward`.
            The user functions see single-process coordinates on every rank: `b` the batch's
            sequence index, `q_idx`/`k_idx` positions in the whole sequence (never the shard),
            `h` the global query head (under Ulysses too). Their aux arrays are whole (every
            rank passes the same values), in q's framework and on its device.
        sinks: optional float `[Hq]`, as in `varlen.attention_forward` (every rank passes the
            same values): each row's sink enters once, after the last merge of its partial
            results, whatever the method.
        dropout_p, seed, offset: attention dropout as in `varlen.attention_forward` (`seed`
            required with `dropout_p > 0`; every rank passes the same three values, which are
            compared). Every kernel call draws each pair's keep bit at its single-process
            coordinates (the batch's sequence, whole-document positions, the global query
            head), so any cp size, method and partition drops the pairs the single-process
            call drops.
        method: `"ring"` (K/V travel the ring, overlapped with compute), `"allgather"` (K/V
            gathered once), `"ulysses"` (all-to-all over heads; `Hq % cp_size == 0`) or
            `"usp"` (all-to-all over heads inside each group of `ulysses_size` consecutive
            ranks, the ring across the groups; `Hq % ulysses_size == 0`).
            Or `"auto"`: the method (and ulysses_size) the cost model predicts fastest for this
            partition, shapes and mask on `cluster` (`varlen.comm.model.choose`), said in a
            log line (logger `varlen.comm`, INFO, rank 0) and under `"auto"` in the stats.
        ulysses_size: with `method="usp"`, the ranks of one all-to-all group (a node's GPUs):
            a divisor of cp_size; cp_size / ulysses_size groups form the ring.
        cluster: for `method="auto"`: a `varlen.comm.model.Cluster`, a preset name (`"h100"`,
            `"h200"`), or None: the H100 preset's links with the group's ranks per node.
        return_stats: also return the bytes this rank sent and received in this call, per
            level (`{"flat" | "intra" | "inter": {"sent": n, "received": n}}`, as
            `group.traffic` counts them; docs/context_parallel.md).
        backend: `"numpy"`, `"cpu"`, `"numba"`, `"cupy"` or None (as in the single-process API).
        plan: this rank's step plans, `varlen.comm.plan(part, group.rank, ...)`, built once
            and passed to every layer. Default: the partition's cached plans for this rank,
            mask, method and backend tiles (built on first use; a mask with device arrays is
            not cached, its plans are built once per call).

    Returns:
        out: `[Tq_local, Hq, Dv]` in q's dtype; lse: `[Hq, Tq_local]` float32 (float64 for
        float64). Pad rows (positions past a sequence's global length) get out 0, lse -inf.
        With `return_stats`, a third result: the call's bytes per level.
        `part.unshard([...])` of all ranks' results is the single-process result.

    Errors: argument errors on any rank, and ranks that disagree on the shards' shapes or
    dtypes, the partition's sizes, mask, method or validation setting, raise the same
    ValueError on every rank (the partition's and mask's values are compared too when
    validation is on: the default for host data). Any other failure on one rank aborts the
    group; a rank that never arrives ends the others after the group's timeout.
    """
    _warn_outside_autograd("attention_forward", (q, k, v))

    chosen = {}

    def prepare():
        how, u, chosen["auto"] = _auto(method, ulysses_size, q, k, v, part, group, mask, cluster)
        return _checked_call(q, k, v, part, group, plan, mask=mask, softmax_scale=softmax_scale,
                             softcap=softcap, method=how, backend=backend,
                             score_mod=score_mod, sinks=sinks, ulysses_size=u,
                             dropout_p=dropout_p, seed=seed, offset=offset)

    def compute(rc, steps):
        out, lse = _FORWARD[rc.call.method](rc, steps)
        return rc.call.with_sinks(out, lse, rc.valid_rows()) if rc.call.sinks is not None \
            else (out, lse)

    before = _traffic_before(group)
    call, (out, lse) = _run(group, q, prepare, compute)
    res = (call.origin.wrap(out), call.origin.wrap(lse))
    return res + (_stats(group, before, chosen),) if return_stats else res


def attention_backward(dout, q, k, v, out, lse, part, group, *, mask="full",
                       softmax_scale=None, softcap=0.0, method="ring", backend=None,
                       deterministic=False, plan=None, score_mod=None, aux_grads=False,
                       sinks=None, sinks_grad="group", ulysses_size=None, return_stats=False,
                       cluster=None, dropout_p=0.0, seed=None, offset=0):
    """Gradients of `sum(out * dout)` on one rank. Returns this rank's `(dq, dk, dv)`, then
    with `sinks` their gradient, then with `aux_grads` the aux gradients.

    Args:
        dout: `[Tq_local, Hq, Dv]`, this rank's shard of the output gradient (q's dtype).
        out, lse: this rank's results of `attention_forward` (the merged, global ones).
        deterministic: bitwise-repeatable accumulation in the kernels.
        plan: the step plans of the forward call (the same `varlen.comm.plan(...)`).
        aux_grads: also return the gradients of `score_mod`'s float aux arrays: a fourth
            result, a tuple with one float32 array (the aux's shape) or None per aux array.
            Each rank's kernels see only its share of the pairs: with True the shares are
            added over the group, so every rank returns the whole gradient (the
            single-process one); with `"rank"` each rank returns its share (float32), which
            add up over the group to the gradient, as a replicated parameter's gradients do
            (what the PyTorch and JAX adapters hand to autograd).
        sinks: the forward's sinks (`out` and `lse` are the forward's with them).
        sinks_grad: `"group"`: `dsinks` (float32, float64 for float64) summed over the group,
            the single-process gradient on every rank; `"rank"`: this rank's share (its
            rows'), which the shares of the other ranks add up to.
        dropout_p, seed, offset: the forward's: the keep bits are drawn again (nothing of
            size `[rows, keys]` was kept or travels).
        return_stats: also return the call's bytes per level, last (as in the forward).
        The other arguments as in `attention_forward`, with the same values; any method may
        differentiate any other's output.

    Pad rows get zero gradients; dK/dV of each rank's own key rows come back to it.
    """
    chosen = {}

    def prepare():
        how, u, chosen["auto"] = _auto(method, ulysses_size, q, k, v, part, group, mask, cluster)
        return _checked_call(q, k, v, part, group, plan, mask=mask, softmax_scale=softmax_scale,
                             softcap=softcap, method=how, backend=backend,
                             deterministic=deterministic, grads=(dout, out, lse),
                             score_mod=score_mod, aux_grads=bool(aux_grads), sinks=sinks,
                             ulysses_size=u, dropout_p=dropout_p, seed=seed, offset=offset)

    if aux_grads not in (False, True, "rank"):
        raise ValueError(f"aux_grads must be True, False or 'rank', got {aux_grads!r}")
    if sinks_grad not in ("group", "rank"):
        raise ValueError(f"sinks_grad must be 'group' or 'rank', got {sinks_grad!r}")

    def compute(rc, steps):
        grads = _BACKWARD[rc.call.method](rc, steps)
        dsinks = rc.call.sink_grads(rc.valid_rows())
        if dsinks is not None and sinks_grad == "group":
            dsinks = rc.group_sum(dsinks)
        if rc.call.mods.aux_grads:
            grads += (rc.aux_grads(summed=aux_grads is True),)
        return grads, dsinks

    before = _traffic_before(group)
    call, (grads, dsinks) = _run(group, q, prepare, compute)
    res = call.backward_results(grads, aux_grads, dsinks)
    return res + (_stats(group, before, chosen),) if return_stats else res


def _stats(group, before, chosen) -> dict:
    """A call's bytes per level, and under `"auto"` what `method="auto"` chose and why."""
    out = group.traffic.since(before)
    if chosen.get("auto"):
        out["auto"] = chosen["auto"]
    return out


_LOG = logging.getLogger("varlen.comm")


def _auto(method, ulysses_size, q, k, v, part, group, mask, cluster):
    """`(method, ulysses_size, choice)`: for `method="auto"` what the cost model
    (`varlen.comm.model.choose`) predicts fastest on this partition and group, said once in a
    log line (kept on the partition: the same call chooses the same without recomputing);
    other methods as they are, choice None."""
    if method != "auto":
        return method, ulysses_size, None
    if ulysses_size is not None:
        raise ValueError("method='auto' chooses ulysses_size itself; pass neither or a method")
    if isinstance(cluster, str):
        if cluster not in PRESETS:
            raise ValueError(f"cluster={cluster!r} is not a preset ({', '.join(PRESETS)}); pass "
                             f"one or a varlen.comm.model.Cluster")
        cluster = PRESETS[cluster]
    elif cluster is None:           # the H100 preset's links, the group's nodes
        n = group.gpus_per_node()
        cluster = replace(PRESETS["h100"], gpus_per_node=n, name="the H100 preset's links")
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a preset name or a varlen.comm.model.Cluster, got "
                        f"{type(cluster).__name__}")
    pq = part[0] if isinstance(part, (tuple, list)) else part
    m = mask if isinstance(mask, str) else None       # other masks: costed as full
    dtype = str(q.dtype).rsplit(".", 1)[-1]
    key = (cluster, tuple(q.shape), tuple(k.shape), tuple(v.shape), dtype, m)
    cache = pq.__dict__.setdefault("_auto_choices", {})
    choice = cache.get(key)
    if choice is None:
        choice = choose(pq, heads_q=q.shape[1], heads_k=k.shape[1], head_dim=q.shape[2],
                        head_dim_v=v.shape[2], dtype=dtype if dtype in ("float16", "float32",
                                                                         "float64") else
                        "bfloat16", mask=m, cluster=cluster)
        cache[key] = choice
        if group.rank == 0:
            _LOG.info("method='auto' chose %s%s: %s", choice["method"],
                      f" ulysses_size={choice['ulysses_size']}" if choice["ulysses_size"]
                      else "", choice["why"])
    return choice["method"], choice["ulysses_size"], choice


def _traffic_before(group):
    """`group.traffic`'s snapshot before a call (an empty one for what is not a Group: the
    call reports that)."""
    return group.traffic.snapshot() if isinstance(group, Group) else {}
