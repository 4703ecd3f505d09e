"""Step plans: what each kernel call of a context-parallel method computes on one rank.

They are metadata of the partition too: `plan(part, rank, ...)` builds a rank's `StepPlans` (one
`varlen.Plan` per ring step, or one for all-gather and Ulysses), and the partition caches them
by rank, method, mask and tile size, so forward, backward and every layer of a step share one set.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from varlen import backends
from varlen._array import array_module, digest, host_copy, to_working
from varlen._setup import check_context_parallel, working_mask
from varlen._validate import FLOAT_DTYPES, dtype_name
from varlen.dropout import Dropout, check_dropout
from varlen.mods import EMPTY, Mods, ScoreMod, split_mask

from .chunked import Partition, _int_arg

__all__ = ["StepPlans", "plan", "step_plans", "check_step_plans", "mask_key", "mod_key"]

_STEP_CACHE = 8         # step-plan sets kept per partition (least recently used dropped)


@dataclass(frozen=True, eq=False)
class StepPlans:
    """One rank's plans for one partition, mask, method and backend tiles.

    Built once and reused by forward, backward and every layer that attends over the same
    partition with the same mask (`varlen.comm.plan`, or the partition's cache).

    Attributes:
        parts: `(query partition, key partition)` they were built for, with their metadata
            where the plans live (host or device).
        rank, method: the rank and the method (`"ring"`, `"allgather"`, `"ulysses"`, `"usp"`);
            ulysses_size: `u` of `"usp"`.
        backend: name of the backend whose `make_plan` built them; blocks: `(BM, BN)`.
        mask: the working `varlen.Mask` they evaluate; mask_key: its host fingerprint.
        mask_mod: the call's `varlen.MaskMod` (aux arrays where the plans live) or None;
            every plan carries it, so its tile classes skip the tiles it hides;
            mask_mod_key: its fingerprint (`mod_key`).
        plans: one `varlen.Plan` per kernel call. Ring: `plans[i]` is step `i`, this rank's
            query segments against the key segments of rank `(rank - i) % cp`. All-gather:
            one plan against every rank's keys. Ulysses: one plan, all queries against all keys.
            usp (cp = u x r, groups of u consecutive ranks): `plans[i]` is step `i` of the ring
            across groups, the rows of this rank's group (its u shards, in rank order)
            against those of group `(g - i) % r`.
        busy: per plan, False when a host plan's schedule is empty, or every tile it keeps is
            EMPTY under the mask_mod (that step is not launched); always True for device
            plans, which are never read on the host.
    """

    parts: tuple
    rank: int
    method: str
    backend: str
    blocks: tuple
    mask: object
    mask_key: tuple
    plans: tuple
    busy: tuple
    mask_mod: object = None
    mask_mod_key: tuple | None = None
    ulysses_size: int | None = None     # method "usp": u of cp = u x r

    def __repr__(self):
        return (f"StepPlans(rank={self.rank}, method={self.method!r}, backend={self.backend!r}, "
                f"blocks={self.blocks}, plans={len(self.plans)}, "
                f"on_host={self.parts[0].xp is np})")


def mask_key(mask, batch: int) -> tuple:
    """A host fingerprint of a working mask, per field (`varlen._array.digest`: values of
    scalars and host arrays, `("device", shape)` for a device array, whose values are not
    read)."""
    return tuple(digest(f, batch) for f in mask.fields())


def mod_key(mask_mod) -> tuple | None:
    """A host fingerprint of a working mask_mod: its graph's digest (the function and its aux
    dtypes) and a digest of each aux array (values on the host, `("device", shape)` on a
    device); None without one."""
    if mask_mod is None:
        return None
    return (mask_mod.digest, *(digest(a.reshape(-1), int(a.size)) for a in mask_mod.aux))


def _cacheable(key: tuple | None) -> bool:
    """A device mask array (or mask_mod aux array) is not cached: it may be rewritten in place
    between calls, and reading it to tell would be a host synchronisation."""
    return key is None or not any(isinstance(f, tuple) and f[0] == "device" for f in key)


def _step_segments(pq, pk, rank, method, ulysses_size=None):
    """`(query segments, key segments)` of every kernel call `method` makes on `rank`."""
    if method == "usp":
        u = ulysses_size
        r, g = pq.cp_size // u, rank // u

        def rows(p, grp):                       # the u shards of group grp, in rank order
            return p.gathered_segments(range(grp * u, grp * u + u))
        q = rows(pq, g)
        return [(q, rows(pk, (g - i) % r)) for i in range(r)]
    if method == "ring" and pq.scheme == "document":
        if pk.groups != pq.groups:
            raise ValueError("the query and key document partitions place documents on "
                             "different ranks; build the key partition with like=part_q")
        q = pq.segments(rank)
        return [(q, pk.segments(rank))] + [(q, pk.ring_segments((rank - i) % pq.cp_size, rank))
                                           for i in range(1, pq.cp_size)]
    if method == "ring":
        q = pq.segments(rank)
        return [(q, pk.segments((rank - i) % pq.cp_size)) for i in range(pq.cp_size)]
    if method == "allgather":
        return [(pq.segments(rank), pk.gathered_segments())]
    return [(pq.gathered_segments(), pk.gathered_segments())]        # ulysses


def _has_work(plan) -> bool:
    """False when no query tile visits any key tile, or the mask_mod hides every tile visited
    (`Plan.tile_classes`). Device plans are not read (no host sync): their kernels skip the
    empty tiles instead."""
    if not plan.on_host:
        return True
    s = plan.q_sched
    if not (s[..., 3] > s[..., 0]).any():
        return False
    return plan.mask_mod is None or bool((plan.tile_classes("q")[1] != EMPTY).any())


def step_plans(pq, pk, rank, method, backend, blocks, mask, mask_mod=None,
               ulysses_size=None) -> StepPlans:
    """`rank`'s step plans over partitions `pq`, `pk` (already where the data lives) for a
    working `mask` and `mask_mod` (a `varlen.MaskMod` whose aux arrays live there too, or
    None), built by `backend` with tiles `blocks`: from `pq`'s cache, else built and cached
    (not cached when the mask or the mask_mod holds device arrays). Positions in the segments
    are global, and sequence `b` is the batch's sequence `b` on every rank, so the mask_mod
    sees the single-process coordinates."""
    mkey, mod = mask_key(mask, pq.batch), mod_key(mask_mod)
    key = (pk, rank, method, ulysses_size, backend.name, tuple(blocks), mkey, mod)
    cacheable = _cacheable(mkey) and _cacheable(mod)
    if cacheable:
        with pq._lock:
            hit = pq._steps.get(key)
            if hit is not None:
                pq._steps.move_to_end(key)
                return hit
    bm, bn = blocks
    segments = _step_segments(pq, pk, rank, method, ulysses_size)
    plans = tuple(replace(backend.make_plan(q, k, mask, block_m=bm, block_n=bn),
                          mask_mod=mask_mod) for q, k in segments)
    steps = StepPlans(parts=(pq, pk), rank=rank, method=method, backend=backend.name,
                      blocks=(bm, bn), mask=mask, mask_key=mkey, plans=plans,
                      busy=tuple(_has_work(p) and k.num_rows > 0 for p, (_, k) in
                                 zip(plans, segments)),
                      mask_mod=mask_mod, mask_mod_key=mod, ulysses_size=ulysses_size)
    if cacheable:
        with pq._lock:
            pq._steps[key] = steps
            while len(pq._steps) > _STEP_CACHE:
                pq._steps.popitem(last=False)
    return steps


def _where(p) -> str:
    return "the host" if p.xp is np else "a CUDA device"


def check_step_plans(steps, *, parts, rank, method, backend, blocks, mask, validate,
                     mask_mod=None, ulysses_size=None):
    """`steps`, passed as `plan=`, must be the plans this call would use (else an error that
    names what differs). Device mask arrays are compared by value only when validating."""
    if not isinstance(steps, StepPlans):
        raise TypeError(f"plan must be this rank's step plans, from varlen.comm.plan(...), got "
                        f"{type(steps).__name__}")
    pq, pk = parts
    if steps.parts[0].xp is not pq.xp:
        raise ValueError(f"plan lives on {_where(steps.parts[0])} but the data on {_where(pq)};"
                         f" build it with varlen.comm.plan(..., on_device={pq.xp is not np})")
    differs = [f"{name} ({mine!r} in the plan, {want!r} in the call)" for name, mine, want in (
        ("rank", steps.rank, rank), ("method", steps.method, method),
        ("ulysses_size", steps.ulysses_size, ulysses_size),
        ("backend", steps.backend, backend.name), ("blocks", steps.blocks, tuple(blocks)),
        ("mask", steps.mask_key, mask_key(mask, pq.batch)),
        ("mask_mod", steps.mask_mod_key, mod_key(mask_mod))) if mine != want]
    if steps.parts[0] is not pq or steps.parts[1] is not pk:
        differs.insert(0, "partition (another Partition object than the call's part)")
    if not differs and validate and not _cacheable(steps.mask_key):
        for name, a, b in zip(("window_left", "window_right", "bottom_right"),
                              steps.mask.fields(), mask.fields()):
            if not np.array_equal(host_copy(a), host_copy(b)):
                differs.append(f"mask (mask.{name} differs)")
    if not differs and validate and not _cacheable(steps.mask_mod_key):
        for i, (a, b) in enumerate(zip(steps.mask_mod.aux, mask_mod.aux)):
            if not np.array_equal(host_copy(a), host_copy(b)):
                differs.append(f"mask_mod (aux argument {i} differs)")
    if differs:
        raise ValueError(f"plan was built for another call: {'; '.join(differs)}. Build each "
                         f"rank's plans with varlen.comm.plan(part, rank, ...) from this call's "
                         f"partition, mask and method")


def plan(part, rank, *, dtype, head_dim, mask="full", method="ring", backend=None,
         head_dim_v=None, on_device=None, score_mod=None, aux_grads=False,
         ulysses_size=None, dropout_p=0.0) -> StepPlans:
    """Build (or fetch from `part`'s cache) rank `rank`'s step plans, to pass as `plan=`.

    A training step builds them once per batch and passes them to every layer's
    `attention_forward` and `attention_backward`; calls without `plan=` use the same cache.

    Args:
        part: the call's `varlen.comm.partition(...)`, or its `(part_q, part_k)` pair; the
            plans fit calls with this very object.
        rank: this rank (`group.rank`).
        dtype: the data's dtype (`"float16"`, `"bfloat16"`, `"float32"`, `"float64"` or a
            NumPy dtype); head_dim: `D` of q and k; head_dim_v: `Dv` (default `D`). With the
            backend they fix the tile sizes.
        mask, method, backend: as the calls will pass them (`mask` may hold a
            `varlen.MaskMod`: its aux arrays are moved to where the plans live);
            ulysses_size: with `method="usp"`, as the calls pass it.
        score_mod, aux_grads, dropout_p: as the calls will pass them; they pick the backend
            (one that runs them) and are not part of the plans (nor are dropout's seed and
            offset: the keep bits are drawn in the kernels).
        on_device: build device plans (True) or host plans (False); default: where `part`'s
            metadata lives. Device plans are built without a host read.

    Returns a `StepPlans`.
    """
    pair = (part, part) if isinstance(part, Partition) else part
    pq, pk = check_context_parallel(pair, method, ulysses_size=ulysses_size)
    xp = _plan_module(pq, on_device)
    pq, pk = pq.on(xp), pk.on(xp)
    rank = pq._rank(rank)
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    if name not in FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
    head_dim = _int_arg("head_dim", head_dim, 1)
    head_dim_v = head_dim if head_dim_v is None else _int_arg("head_dim_v", head_dim_v, 1)
    base, mask_mod = split_mask(mask)
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a varlen.ScoreMod or None, got "
                        f"{type(score_mod).__name__}")
    mask_mod = None if mask_mod is None else mask_mod.with_aux(
        [_aux_in(a, f"mask_mod aux argument {i}", xp) for i, a in enumerate(mask_mod.aux)])
    mods = Mods(mask=mask_mod, score=score_mod,
                aux_grads=bool(aux_grads) and score_mod is not None and
                any(score_mod.float_aux()))
    p = check_dropout(dropout_p)[0]
    chosen = backends.select(backend, backends.Problem(
        name, head_dim, head_dim_v, xp is not np, mods,
        dropout=Dropout(p, 0, 0) if p > 0 else None))
    return step_plans(pq, pk, rank, method, chosen, chosen.default_blocks(name, head_dim),
                      working_mask(base, pq.batch, xp), mask_mod,
                      None if ulysses_size is None else int(ulysses_size))


def _aux_in(a, name, xp):
    """An aux array as a contiguous working array of `xp` (copied between host and device
    when it lives on the other side: plans are metadata)."""
    w = to_working(a, name)
    if array_module(w) is not xp:
        w = host_copy(w) if xp is np else xp.asarray(w)
    return xp.ascontiguousarray(w)


def _plan_module(p, on_device):
    if on_device is None:
        return p.xp
    if not isinstance(on_device, (bool, np.bool_)):
        raise TypeError(f"on_device must be True, False or None, got {on_device!r}")
    if not on_device:
        return np
    import cupy
    return cupy
