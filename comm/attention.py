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
* `allgather`: K/V all-gathered once (cheap for GQA, whose K/V are small), one kernel call over
  the gathered segments; dK/dV reduce-scattered back.
* `ulysses`: all-to-all from sequence shards to head shards, one kernel call over the whole
  sequence for `Hq / cp` heads, all-to-all back. KV heads are replicated when `Hk` does not
  divide by cp (GQA); `Hq` must.

A step (or a tile) with nothing visible is skipped by the plan's schedule; for host data a
step whose schedule is empty is not even launched.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from varlen import backends
from varlen._setup import working_mask
from varlen._array import array_module, common_origin, host_copy, to_working
from varlen._validate import (check_backward_inputs, check_qkv, dtype_name, scale_and_softcap,
                              validation_enabled)
from varlen.plan import build_plan

from .group import Group, GroupAborted
from .merge import accumulate_dtype, merge_partial
from .partition import Partition

__all__ = ["attention_forward", "attention_backward", "METHODS"]

METHODS = ("ring", "allgather", "ulysses")

# Channel tags: K/V and the travelling dK/dV accumulators are in flight at the same time.
_TAG_KV, _TAG_DKV = 11, 12


@dataclass
class _Ctx:
    """One validated call on one rank."""

    origin: object
    xp: object
    group: Group
    pq: Partition
    pk: Partition
    method: str
    mod: object
    mask: object
    scale: float
    softcap: float
    q: object
    k: object
    v: object
    extra: list
    deterministic: bool = False

    @property
    def rank(self):
        return self.group.rank

    @property
    def cp(self):
        return self.group.size

    @property
    def acc(self):
        return accumulate_dtype(self.q.dtype)

    def plan(self, q_seg, k_seg):
        bm, bn = self.mod.default_blocks(dtype_name(self.q.dtype), self.q.shape[2])
        make = getattr(self.mod, "make_plan", build_plan)
        return make(q_seg, k_seg, self.mask, block_m=bm, block_n=bn)

    def signature(self):
        """What every rank must agree on (host reads: only when validating)."""
        def digest(f):
            if isinstance(f, (bool, int, np.integer)):
                return int(f)
            return zlib.crc32(np.ascontiguousarray(host_copy(f)).tobytes())
        shapes = tuple((tuple(a.shape), dtype_name(a.dtype)) for a in (self.q, self.k, self.v))
        return (self.method, self.pq.fingerprint(), self.pk.fingerprint(), shapes,
                tuple(digest(f) for f in self.mask.fields()), self.scale, self.softcap,
                self.mod.name)


def _parts(part):
    """`part` is a Partition (self-attention) or a pair (queries, keys)."""
    if isinstance(part, Partition):
        return part, part
    if isinstance(part, (tuple, list)) and len(part) == 2 and \
            all(isinstance(p, Partition) for p in part):
        pq, pk = part
        if (pq.cp_size, pq.scheme, pq.batch) != (pk.cp_size, pk.scheme, pk.batch):
            raise ValueError(f"the query partition {pq} and key partition {pk} disagree on "
                             f"cp_size, scheme or batch")
        return pq, pk
    raise TypeError(f"part must be a varlen.comm.partition(...) or a (queries, keys) pair of "
                    f"them, got {type(part).__name__}")


def _prepare(q, k, v, part, group, *, mask, softmax_scale, softcap, method, backend,
             extra=()) -> _Ctx:
    origin = common_origin([("q", q), ("k", k), ("v", v), *extra])
    qw, kw, vw = to_working(q, "q"), to_working(k, "k"), to_working(v, "v")
    Tq, Hq, D, Tk, Hk, Dv = check_qkv(qw, kw, vw)
    xp = array_module(qw)
    pq, pk = (p.on(xp) for p in _parts(part))
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not a known method; expected one of "
                         f"{', '.join(map(repr, METHODS))}")
    if group.size != pq.cp_size:
        raise ValueError(f"group has {group.size} ranks but part was built for "
                         f"cp_size={pq.cp_size}")
    for name, T, p in (("q", Tq, pq), ("k", Tk, pk)):
        if T != p.local_rows:
            raise ValueError(f"{name} has {T} rows but the partition gives every rank "
                             f"{p.local_rows}; pass this rank's shard, part.shard({name}, rank)")
    if method == "ulysses" and Hq % pq.cp_size:
        raise ValueError(f"method='ulysses' splits heads over ranks: q has {Hq} heads, not "
                         f"divisible by cp_size={pq.cp_size}; use 'ring' or 'allgather'")
    mod = backends.select(backend, backends.Problem(dtype_name(qw.dtype), D, Dv, xp is not np))
    softmax_scale, softcap = scale_and_softcap(softmax_scale, softcap, D)
    ew = [to_working(x, n) for n, x in extra]
    return _Ctx(origin, xp, group, pq, pk, method, mod, working_mask(mask, pq.batch, xp),
                softmax_scale, softcap, qw, kw, vw, ew)


def _on_device(x) -> bool:
    try:
        return common_origin([("q", x)]).on_device
    except (TypeError, ValueError, AttributeError):
        return False


def _run(group, on_device, prepare, compute):
    """Validate (collectively when validation is on), then compute; abort on failure.

    With validation on, every rank learns whether any rank rejected its inputs or disagrees on
    the partition, mask or method, and all raise the same ValueError: nobody is left waiting.
    Any other failure aborts the group so that no rank hangs.
    """
    if not isinstance(group, Group):
        raise TypeError(f"group must be a varlen.comm group (init() or local_group()), got "
                        f"{type(group).__name__}")
    ctx, err = None, None
    try:
        ctx = prepare()
    except (ValueError, TypeError) as e:
        err = e
    except BaseException as e:   # noqa: B902  (an unexpected failure must not strand peers)
        group.abort(e)
        raise
    # Every rank must take the same branch here; validation defaults follow the data's device.
    if validation_enabled(on_device):
        try:
            mine = (None if err else ctx.signature(),
                    None if err is None else f"{type(err).__name__}: {err}")
        except BaseException as e:   # noqa: B902  (a failing host read must not strand peers)
            group.abort(e)
            raise
        infos = group.allgather_object(mine)
        if err is not None:
            raise err
        bad = [(r, msg) for r, (_, msg) in enumerate(infos) if msg]
        if bad:
            r, msg = bad[0]
            raise ValueError(f"rank {r} rejected its inputs ({msg}); every rank stops")
        sigs = [s for s, _ in infos]
        for r, s in enumerate(sigs):
            if s != sigs[0]:
                what = [name for name, a, b in zip(
                    ("method", "query partition", "key partition", "shapes/dtypes", "mask",
                     "softmax_scale", "softcap", "backend"), sigs[0], s) if a != b]
                raise ValueError(f"ranks 0 and {r} disagree on {', '.join(what)}: every rank "
                                 f"must pass the same partition, mask and method "
                                 f"(rank 0: {sigs[0]}, rank {r}: {s})")
    elif err is not None:
        group.abort(err)
        raise err
    try:
        return compute(ctx)
    except GroupAborted:
        raise
    except BaseException as e:   # noqa: B902  (abort first, whatever it was)
        group.abort(e)
        raise


def _has_work(plan) -> bool:
    """False when no query tile visits any key tile. Device plans are not read (no host
    sync): their kernels skip the empty tiles instead."""
    if not plan.on_host:
        return True
    s = plan.q_sched
    return bool((s[..., 3] > s[..., 0]).any())


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


def _ring_forward(c: _Ctx):
    xp, cp, rank = c.xp, c.cp, c.rank
    nxt, prv = (rank + 1) % cp, (rank - 1) % cp
    q_seg = c.pq.segments(rank)
    ch = c.group.p2p(_TAG_KV)
    k, v = xp.ascontiguousarray(c.k), xp.ascontiguousarray(c.v)
    out = lse = None
    for step in range(cp):
        src = (rank - step) % cp                                # whose K/V this step holds
        incoming = _post_exchange(ch, (k, v), nxt, prv, xp) if step + 1 < cp else None
        plan = c.plan(q_seg, c.pk.segments(src))
        if _has_work(plan):
            o, l = c.mod.forward(plan, c.q, k, v, softmax_scale=c.scale, softcap=c.softcap)
            if out is None:
                out, lse = o.astype(c.acc), l.astype(c.acc)
            else:
                out, lse = merge_partial(out, lse, o, l)
        if incoming is not None:
            ch.wait()
            k, v = incoming
    return _finish_forward(c, out, lse)


def _finish_forward(c: _Ctx, out, lse):
    Tq, Hq, _ = c.q.shape
    if out is None:                                  # nothing visible anywhere on this rank
        out = c.xp.zeros((Tq, Hq, c.v.shape[2]), dtype=c.acc)
        lse = c.xp.full((Hq, Tq), -np.inf, dtype=c.acc)
    lse_dtype = np.float64 if c.q.dtype == np.float64 else np.float32
    return out.astype(c.q.dtype), lse.astype(lse_dtype)


def _ring_backward(c: _Ctx):
    xp, cp, rank = c.xp, c.cp, c.rank
    dout, out, lse = c.extra
    nxt, prv = (rank + 1) % cp, (rank - 1) % cp
    q_seg = c.pq.segments(rank)
    kv_ch, dkv_ch = c.group.p2p(_TAG_KV), c.group.p2p(_TAG_DKV)
    k, v = xp.ascontiguousarray(c.k), xp.ascontiguousarray(c.v)
    dq = xp.zeros(c.q.shape, dtype=c.acc)
    dkv_in = None
    for step in range(cp):
        src = (rank - step) % cp
        incoming = _post_exchange(kv_ch, (k, v), nxt, prv, xp) if step + 1 < cp else None
        plan = c.plan(q_seg, c.pk.segments(src))
        if _has_work(plan):
            dq_s, dk_s, dv_s = c.mod.backward(plan, dout, c.q, k, v, out, lse,
                                              softmax_scale=c.scale, softcap=c.softcap,
                                              deterministic=c.deterministic)
            dq += dq_s
        else:
            dk_s = dv_s = None
        # The accumulators of block `src` arrive from the rank that held it one step earlier.
        if dkv_in is None:
            dk = xp.zeros(k.shape, dtype=c.acc)
            dv = xp.zeros(v.shape, dtype=c.acc)
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
# All-gather
# --------------------------------------------------------------------------------------------

def _gather_rows(group, x):
    """`[cp * T, ...]`: every rank's rows, rank-major (the gathered segments' layout)."""
    g = group.allgather(x)
    return g.reshape((g.shape[0] * g.shape[1],) + tuple(g.shape[2:]))


def _allgather_forward(c: _Ctx):
    k_all, v_all = _gather_rows(c.group, c.k), _gather_rows(c.group, c.v)
    plan = c.plan(c.pq.segments(c.rank), c.pk.gathered_segments())
    o, l = c.mod.forward(plan, c.q, k_all, v_all, softmax_scale=c.scale, softcap=c.softcap)
    return _finish_forward(c, o, l)


def _allgather_backward(c: _Ctx):
    dout, out, lse = c.extra
    k_all, v_all = _gather_rows(c.group, c.k), _gather_rows(c.group, c.v)
    plan = c.plan(c.pq.segments(c.rank), c.pk.gathered_segments())
    dq, dk_all, dv_all = c.mod.backward(plan, dout, c.q, k_all, v_all, out, lse,
                                        softmax_scale=c.scale, softcap=c.softcap,
                                        deterministic=c.deterministic)
    cp, Tk = c.cp, c.k.shape[0]
    dk = c.group.reduce_scatter(dk_all.astype(c.acc).reshape((cp, Tk) + c.k.shape[1:]))
    dv = c.group.reduce_scatter(dv_all.astype(c.acc).reshape((cp, Tk) + c.v.shape[1:]))
    return dq.astype(c.q.dtype), dk.astype(c.k.dtype), dv.astype(c.v.dtype)


# --------------------------------------------------------------------------------------------
# Ulysses
# --------------------------------------------------------------------------------------------

def _seq_to_heads(c: _Ctx, x):
    """`[T, H, d]` sequence shard -> `[cp * T, H / cp, d]`: all ranks' rows, my heads."""
    T, H, d = x.shape
    cp = c.cp
    send = c.xp.ascontiguousarray(x.reshape(T, cp, H // cp, d).transpose(1, 0, 2, 3))
    return c.group.alltoall(send).reshape(cp * T, H // cp, d)


def _heads_to_seq(c: _Ctx, y):
    """`[cp * T, h, d]` head shard -> `[T, cp * h, d]`: my rows, all heads."""
    cp = c.cp
    R, h, d = y.shape
    T = R // cp
    got = c.group.alltoall(c.xp.ascontiguousarray(y.reshape(cp, T, h, d)))   # [cp, T, h, d]
    return got.transpose(1, 0, 2, 3).reshape(T, cp * h, d)


def _lse_to_heads(c: _Ctx, lse):
    """`[H, T]` -> `[H / cp, cp * T]`."""
    H, T = lse.shape
    cp = c.cp
    got = c.group.alltoall(c.xp.ascontiguousarray(lse.reshape(cp, H // cp, T)))
    return got.transpose(1, 0, 2).reshape(H // cp, cp * T)


def _lse_to_seq(c: _Ctx, lse):
    """`[h, cp * T]` -> `[cp * h, T]`."""
    h, R = lse.shape
    cp = c.cp
    send = c.xp.ascontiguousarray(lse.reshape(h, cp, R // cp).transpose(1, 0, 2))
    return c.group.alltoall(send).reshape(cp * h, R // cp)


def _kv_replicas(c: _Ctx) -> int:
    """How many copies of each KV head make the KV heads divisible by cp (GQA)."""
    Hk = c.k.shape[1]
    return c.cp // math.gcd(Hk, c.cp)


def _ulysses_inputs(c: _Ctx):
    f = _kv_replicas(c)
    k, v = c.k, c.v
    if f > 1:
        # Copy j of head h becomes head h*f + j; query head h still reads a copy of h // G.
        k, v = c.xp.repeat(k, f, axis=1), c.xp.repeat(v, f, axis=1)
    plan = c.plan(c.pq.gathered_segments(), c.pk.gathered_segments())
    return plan, _seq_to_heads(c, c.q), _seq_to_heads(c, k), _seq_to_heads(c, v), f


def _ulysses_forward(c: _Ctx):
    plan, q, k, v, _ = _ulysses_inputs(c)
    o, l = c.mod.forward(plan, q, k, v, softmax_scale=c.scale, softcap=c.softcap)
    return _finish_forward(c, _heads_to_seq(c, o), _lse_to_seq(c, l))


def _ulysses_backward(c: _Ctx):
    dout, out, lse = c.extra
    plan, q, k, v, f = _ulysses_inputs(c)
    dq, dk, dv = c.mod.backward(plan, _seq_to_heads(c, dout), q, k, v, _seq_to_heads(c, out),
                                _lse_to_heads(c, lse), softmax_scale=c.scale,
                                softcap=c.softcap, deterministic=c.deterministic)
    dq, dk, dv = _heads_to_seq(c, dq), _heads_to_seq(c, dk), _heads_to_seq(c, dv)
    if f > 1:
        T, Hk = c.k.shape[:2]
        dk = dk.astype(c.acc).reshape(T, Hk, f, -1).sum(axis=2)
        dv = dv.astype(c.acc).reshape(T, Hk, f, -1).sum(axis=2)
    return dq.astype(c.q.dtype), dk.astype(c.k.dtype), dv.astype(c.v.dtype)


_FORWARD = {"ring": _ring_forward, "allgather": _allgather_forward,
            "ulysses": _ulysses_forward}
_BACKWARD = {"ring": _ring_backward, "allgather": _allgather_backward,
             "ulysses": _ulysses_backward}


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------

def attention_forward(q, k, v, part, group, *, mask="full", softmax_scale=None, softcap=0.0,
                      method="ring", backend=None):
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
            fields; positions are global, so the result is the single-process one.
        softmax_scale: default `1/sqrt(D)`. softcap: as in `varlen.attention_forward`.
        method: `"ring"` (K/V travel the ring, overlapped with compute), `"allgather"` (K/V
            gathered once) or `"ulysses"` (all-to-all over heads; `Hq % cp_size == 0`).
        backend: `"numpy"`, `"numba"`, `"cupy"` or None (as in the single-process API).

    Returns:
        out: `[Tq_local, Hq, Dv]` in q's dtype; lse: `[Hq, Tq_local]` float32 (float64 for
        float64). Pad rows (positions past a sequence's global length) get out 0, lse -inf.
        `part.unshard([...])` of all ranks' results is the single-process result.

    Errors: with validation on (the default for host data), argument errors and ranks that
    disagree on partition, mask or method raise the same ValueError on every rank. Any other
    failure on one rank aborts the group, so every rank ends with an error instead of waiting.
    """
    ctx = {}

    def prepare():
        c = _prepare(q, k, v, part, group, mask=mask, softmax_scale=softmax_scale,
                     softcap=softcap, method=method, backend=backend)
        ctx["c"] = c
        return c

    out, lse = _run(group, _on_device(q), prepare, lambda c: _FORWARD[c.method](c))
    wrap = ctx["c"].origin.wrap
    return wrap(out), wrap(lse)


def attention_backward(dout, q, k, v, out, lse, part, group, *, mask="full",
                       softmax_scale=None, softcap=0.0, method="ring", backend=None,
                       deterministic=False):
    """Gradients of `sum(out * dout)` on one rank. Returns this rank's `(dq, dk, dv)`.

    Args:
        dout: `[Tq_local, Hq, Dv]`, this rank's shard of the output gradient (q's dtype).
        out, lse: this rank's results of `attention_forward` (the merged, global ones).
        deterministic: bitwise-repeatable accumulation in the kernels.
        The other arguments as in `attention_forward`, with the same values; any method may
        differentiate any other's output.

    Pad rows get zero gradients; dK/dV of each rank's own key rows come back to it.
    """
    ctx = {}

    def prepare():
        c = _prepare(q, k, v, part, group, mask=mask, softmax_scale=softmax_scale,
                     softcap=softcap, method=method, backend=backend,
                     extra=(("dout", dout), ("out", out), ("lse", lse)))
        check_backward_inputs(c.q, c.v, *c.extra, rows="Tq_local")
        c.deterministic = bool(deterministic)
        ctx["c"] = c
        return c

    grads = _run(group, _on_device(q), prepare, lambda c: _BACKWARD[c.method](c))
    wrap = ctx["c"].origin.wrap
    return tuple(wrap(g) for g in grads)
