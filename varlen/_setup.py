"""The setup step: a call's arguments in, one immutable record of the call out.

Every entry point goes through `setup` (the core API, `varlen.comm`, and through them the
PyTorch and JAX adapters): it turns the inputs into working arrays (NumPy on the host, CuPy on a
device), checks shapes, dtypes and devices, normalises the mask and the scalars, picks the
backend and builds (or checks) the plan. What it returns, a `Call`, is all a backend or the
context-parallel layer reads; nothing after this step checks an argument again.

Value checks that read `cu_seqlens` and friends run when validation is on (`_validate.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import backends
from ._array import Origin, array_module, common_origin, digest, host_copy, to_working
from ._validate import (as_index_array, as_policy_array, check_backward_inputs, check_bound,
                        check_layout_specs, check_layout_values, check_qkv, check_together,
                        dtype_name, scale_and_softcap, validation_enabled)
from .dropout import Dropout, make_dropout
from .masks import MASK_FIELDS, Mask, as_mask
from .mods import NO_MODS, Mods, split_mask
from ._sinks import add_sinks, sink_grads, working_sinks
from .plan import Plan

__all__ = ["Call", "Layout", "setup", "make_plan", "working_mask", "working_mods",
           "static_scalars"]


@dataclass(frozen=True)
class Layout:
    """The validated packed layout of a single-process call (int32 arrays in the data's module)."""

    batch: int
    cu_q: object
    cu_k: object
    off_q: object             # None: the cu_seqlens themselves
    off_k: object
    max_seqlen_q: int | None
    max_seqlen_k: int | None


@dataclass(frozen=True, eq=False)
class Call:
    """One checked call: what a backend and the context-parallel layer read, and nothing else.

    `plan` is the call's plan (single process), or for context parallelism the plan the caller
    passed (None: the partition's cached step plans). `grads` holds `(dout, out, lse)` as
    working arrays for a backward call, else None.
    """

    origin: Origin            # where results go back (framework, device)
    xp: object                # numpy or cupy: the module of the working arrays
    q: object
    k: object
    v: object
    dtype: str                # float16 | bfloat16 | float32 | float64
    head_dim: int             # D
    head_dim_v: int           # Dv
    heads_q: int              # Hq
    heads_k: int              # Hk
    on_device: bool
    validate: bool            # value checks (host reads) ran for this call
    mask: Mask                # fields: scalars or int32 [B] arrays in xp
    softmax_scale: float
    softcap: float
    deterministic: bool
    backend: backends.Backend
    plan: object
    grads: tuple | None = None
    layout: Layout | None = None
    part: tuple | None = None  # context parallelism: (query partition, key partition)
    method: str | None = None
    mods: Mods = NO_MODS       # mask_mod / score_mod, their aux arrays as working arrays
    sinks: object = None       # float [Hq] working array (`sinks=`), float32 or float64
    ulysses_size: int | None = None   # method "usp": ranks per all-to-all group (u of u x r)
    dropout: Dropout | None = None  # dropout_p > 0: its p, seed and offset (varlen.dropout)

    @property
    def rows_q(self) -> int:
        return int(self.q.shape[0])

    @property
    def rows_k(self) -> int:
        return int(self.k.shape[0])

    def blocks(self) -> tuple[int, int]:
        """The backend's tile sizes for this call's dtype and head dim."""
        return self.backend.default_blocks(self.dtype, self.head_dim)

    def make_plan(self, lay: Layout) -> Plan:
        """A plan of this layout with this call's mask, built by its backend."""
        bm, bn = self.blocks()
        plan = self.backend.plan_from_cu_seqlens(
            lay.cu_q, lay.cu_k, lay.off_q, lay.off_k, self.rows_q, self.rows_k, self.mask,
            block_m=bm, block_n=bn, max_seqlen_q=lay.max_seqlen_q, max_seqlen_k=lay.max_seqlen_k)
        return replace(plan, mask_mod=self.mods.mask)

    def with_sinks(self, out, lse, valid):
        """A finished forward's `(out, lse)` with the call's sinks joined (`_sinks.add_sinks`;
        `valid`: bool `[Tq]`, the rows that hold a token); as they are without sinks."""
        if self.sinks is None:
            return out, lse
        return add_sinks(out, lse, self.sinks, valid)

    def sink_grads(self, valid):
        """`dsinks` of a backward call (`_sinks.sink_grads`), or None without sinks."""
        if self.sinks is None:
            return None
        dout, out, lse = self.grads
        return sink_grads(dout, out, lse, self.sinks, valid)

    def backward_results(self, grads, aux_grads, dsinks=None) -> tuple:
        """A backward's results for the caller: `(dq, dk, dv)` in its framework, then with
        sinks `dsinks`, then when it asked for `aux_grads` per score_mod aux its gradient or
        None (a tuple)."""
        res = tuple(self.origin.wrap(g) for g in grads[:3])
        if self.sinks is not None:
            res += (self.origin.wrap(dsinks),)
        if not aux_grads:
            return res
        score = self.mods.score
        daux = grads[3] if self.mods.aux_grads else (None,) * (
            0 if score is None else len(score.aux))
        return res + (tuple(None if g is None else self.origin.wrap(g) for g in daux),)

    @property
    def backend_mods(self) -> dict:
        """The keyword a backend's forward/backward gets for the call's user functions: none
        when the call has none, so backends that run none never see it."""
        return {"mods": self.mods} if self.mods else {}

    def sinks_flag(self, backend) -> dict:
        """The keyword a backend's backward gets when the call's lse holds its sinks: only for
        backends that would otherwise take a one-key row's P as 1 (`one_key_shortcut`)."""
        return {"lse_has_sinks": True} if (self.sinks is not None
                                           and backend.one_key_shortcut) else {}
    @property
    def backend_dropout(self) -> dict:
        """The keyword a backend's forward/backward gets for the call's dropout: none without
        dropout, so backends that run none never see it."""
        return {} if self.dropout is None else {"dropout": self.dropout}


# --------------------------------------------------------------------------------------------
# Pieces shared with the adapters
# --------------------------------------------------------------------------------------------

def working_mask(mask, batch: int, xp) -> Mask:
    """The mask with every per-sequence field as a scalar or an int32 `[B]` array in `xp`."""
    m = as_mask(mask)
    return Mask(*(as_policy_array(f, n, xp, batch) for n, f in zip(MASK_FIELDS, m.fields())))


def _working_mod(mod, role: str, like, like_name: str, xp):
    """`mod` over working copies of its aux arrays (contiguous, in `xp`), each checked to come
    from the framework and device of `like` (the call's q, or cu_seqlens_q for a plan)."""
    if mod is None:
        return None
    named = [(f"{role} aux argument {i}", a) for i, a in enumerate(mod.aux)]
    check_together([(like_name, like), *named])
    aux = []
    for name, a in named:
        w = to_working(a, name)
        if array_module(w) is not xp:
            raise TypeError(f"{name} lives on the {'device' if xp is np else 'host'} but the "
                            f"data on the {'host' if xp is np else 'device'}")
        aux.append(xp.ascontiguousarray(w))
    return mod.with_aux(aux)


def working_mods(mask, score_mod, xp, like, like_name: str = "q", *,
                 aux_grads=False) -> tuple:
    """`(built-in mask, Mods)` of a call's `mask=` and `score_mod=` arguments: the MaskMod part
    of `mask` split off, every aux array a working array of `xp` from `like`'s framework."""
    from .mods import ScoreMod
    base, mask_mod = split_mask(mask)
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a varlen.ScoreMod or None, got "
                        f"{type(score_mod).__name__}")
    if not isinstance(aux_grads, (bool, np.bool_)):
        raise TypeError(f"aux_grads must be True or False, got {aux_grads!r}")
    mods = Mods(mask=_working_mod(mask_mod, "mask_mod", like, like_name, xp),
                score=_working_mod(score_mod, "score_mod", like, like_name, xp),
                aux_grads=bool(aux_grads) and score_mod is not None and
                any(score_mod.float_aux()))
    return base, mods


def static_scalars(softmax_scale, softcap, max_seqlen_q, max_seqlen_k, backend,
                   deterministic=False):
    """The scalar arguments as plain Python values, for adapters that make them static (part of
    an op's schema or of a trace), with the core API's messages for the wrong kind of value."""
    softmax_scale, softcap = scale_and_softcap(softmax_scale, softcap)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be one of {', '.join(map(repr, backends.names()))} or "
                        f"None, got {backend!r}")
    return (softmax_scale, softcap, check_bound("max_seqlen_q", max_seqlen_q),
            check_bound("max_seqlen_k", max_seqlen_k), backend, _flag(deterministic))


def _flag(deterministic) -> bool:
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    return bool(deterministic)


# --------------------------------------------------------------------------------------------
# Layout and plan
# --------------------------------------------------------------------------------------------

def _layout(xp, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q,
            max_seqlen_k) -> Layout:
    B = check_layout_specs(cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k)
    cu_q = as_index_array(cu_seqlens_q, "cu_seqlens_q", xp)
    cu_k = as_index_array(cu_seqlens_k, "cu_seqlens_k", xp)
    off_q = None if seq_offsets_q is None else as_index_array(
        seq_offsets_q, "seq_offsets_q", xp, length=B + 1)
    off_k = None if seq_offsets_k is None else as_index_array(
        seq_offsets_k, "seq_offsets_k", xp, length=B + 1)
    return Layout(B, cu_q, cu_k, off_q, off_k, check_bound("max_seqlen_q", max_seqlen_q),
                  check_bound("max_seqlen_k", max_seqlen_k))


def _check_layout(lay: Layout, rows_q: int, rows_k: int, *, rows_names=(None, None)):
    check_layout_values(lay.cu_q, lay.off_q, rows_q, lay.max_seqlen_q, "q",
                        rows_name=rows_names[0])
    check_layout_values(lay.cu_k, lay.off_k, rows_k, lay.max_seqlen_k, "k",
                        rows_name=rows_names[1])


def _fingerprint(lay: Layout, rows_q: int, rows_k: int, mask: Mask, mask_mod=None) -> tuple:
    """What a plan describes, cheap to compare: sizes, and a digest of every host array among
    the layout and the mask (a device array contributes its shape only: no host read); a
    mask_mod by its graph and its aux arrays."""
    off_q = lay.cu_q if lay.off_q is None else lay.off_q      # the default offsets
    off_k = lay.cu_k if lay.off_k is None else lay.off_k
    mod = None if mask_mod is None else (mask_mod.digest, *(
        digest(a.reshape(-1), int(a.size)) for a in mask_mod.aux))
    return (lay.batch, rows_q, rows_k,
            *(digest(a, lay.batch) for a in (lay.cu_q, lay.cu_k, off_q, off_k)),
            *(digest(f, lay.batch) for f in mask.fields()), mod)


_FINGERPRINT_NAMES = ("B", "rows of q", "rows of k", "cu_seqlens_q", "cu_seqlens_k",
                      "seq_offsets_q", "seq_offsets_k", *(f"mask.{n}" for n in MASK_FIELDS), "mask_mod")


def _fingerprint_differs(have: tuple, want: tuple) -> str | None:
    """The first thing the plan was built for otherwise than this call (device digests match
    anything of the same shape)."""
    for name, a, b in zip(_FINGERPRINT_NAMES, have, want):
        device = (isinstance(a, tuple) or isinstance(b, tuple)) and name != "mask_mod"
        if a != b and not (device and (a is None) == (b is None)):
            return name
    return None


def make_plan(cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None, seq_offsets_k=None,
              mask="full", num_rows_q=None, num_rows_k=None, max_seqlen_q=None,
              max_seqlen_k=None, block_m=64, block_n=64, backend=None) -> Plan:
    """`varlen.plan`: see its docstring."""
    probe = to_working(cu_seqlens_q, "cu_seqlens_q")
    xp = array_module(probe) if np.ndim(probe) else np
    on_device = xp is not np
    lay = _layout(xp, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q,
                  max_seqlen_k)
    rows = []
    for side, n, cu, off in (("q", num_rows_q, lay.cu_q, lay.off_q),
                             ("k", num_rows_k, lay.cu_k, lay.off_k)):
        if n is None:
            if on_device:
                raise ValueError(f"num_rows_{side} is required for device cu_seqlens: it sizes "
                                 f"the plan without reading device memory")
            n = int(host_copy(off if off is not None else cu)[-1])
        rows.append(check_bound(f"num_rows_{side}", n))
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(blk, (int, np.integer)) or isinstance(blk, bool) or blk <= 0:
            raise ValueError(f"{name} must be a positive int, got {blk!r}")
    if validation_enabled(on_device):
        _check_layout(lay, *rows)
    base, mods = working_mods(mask, None, xp, cu_seqlens_q, "cu_seqlens_q")
    wmask = working_mask(base, lay.batch, xp)
    planner = backends.select_planner(backend, on_device)
    plan = planner.plan_from_cu_seqlens(lay.cu_q, lay.cu_k, lay.off_q, lay.off_k, *rows, wmask,
                                        block_m=int(block_m), block_n=int(block_n),
                                        max_seqlen_q=lay.max_seqlen_q,
                                        max_seqlen_k=lay.max_seqlen_k)
    return replace(plan, mask_mod=mods.mask,
                   fingerprint=_fingerprint(lay, *rows, wmask, mods.mask))


def _check_plan(plan, call: Call, lay: Layout):
    """A plan given with the call must fit it: always checked, validation on or off (the
    fingerprint comparison reads no device memory)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a varlen.Plan from varlen.plan(), got "
                        f"{type(plan).__name__}")
    if plan.batch != lay.batch:
        raise ValueError(f"plan covers {plan.batch} sequences but cu_seqlens has {lay.batch}")
    if (plan.mask_mod is None) != (call.mods.mask is None) or (
            plan.mask_mod is not None and plan.mask_mod.digest != call.mods.mask.digest):
        raise ValueError("plan was built for another mask_mod than this call's; build a plan "
                         "with this call's mask (varlen.plan(..., mask=...))")
    if plan.q.num_rows != call.rows_q or plan.k.num_rows != call.rows_k:
        raise ValueError(f"plan was built for {plan.q.num_rows} query and {plan.k.num_rows} key "
                         f"rows but q has {call.rows_q} and k has {call.rows_k}")
    if plan.fingerprint is not None:
        what = _fingerprint_differs(plan.fingerprint, _fingerprint(
            lay, call.rows_q, call.rows_k, call.mask, call.mods.mask))
        if what:
            raise ValueError(f"plan was built for another {what} than this call's; build a "
                             f"plan for this layout and mask with varlen.plan(...)")
    why = call.backend.check_plan(plan)
    if why:
        raise ValueError(f"plan cannot be used by backend {call.backend.name!r}: {why}")


# --------------------------------------------------------------------------------------------
# The setup step
# --------------------------------------------------------------------------------------------

def _tensors(q, k, v, grads):
    named = [("q", q), ("k", k), ("v", v)]
    if grads is not None:
        named += list(zip(("dout", "out", "lse"), grads))
    origin = common_origin(named)
    check_qkv(q, k, v)             # on the caller's arrays: frameworks are compared too
    check_together(named)          # the backward's dout, out and lse too
    qw, kw, vw = to_working(q, "q"), to_working(k, "k"), to_working(v, "v")
    gw = None if grads is None else tuple(to_working(x, n) for n, x in named[3:])
    return origin, qw, kw, vw, gw


def setup(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, *, seq_offsets_q=None,
          seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0, max_seqlen_q=None,
          max_seqlen_k=None, backend=None, plan=None, deterministic=False, grads=None,
          part=None, method=None, grads_rows="Tq", group_size=None, score_mod=None,
          aux_grads=False, sinks=None, ulysses_size=None, dropout_p=0.0, seed=None,
          offset=0) -> Call:
    """Check and normalise one call's arguments; returns its `Call` record.

    Single process: `cu_seqlens_*` (and optional offsets, bounds, `plan`). Context
    parallelism: `part`, a pair `(query partition, key partition)`, `method` and `group_size`,
    checked here (`check_context_parallel`). `grads = (dout, out, lse)` for a backward call.
    A `MaskMod` in `mask` and a `score_mod` become `Call.mods` (`working_mods`); `sinks`
    `Call.sinks` (`_sinks.working_sinks`); `dropout_p`, `seed` and `offset` `Call.dropout`
    (`varlen.dropout.make_dropout`).
    """
    dropout = make_dropout(dropout_p, seed, offset)
    origin, qw, kw, vw, gw = _tensors(q, k, v, grads)
    xp = array_module(qw)
    on_device = xp is not np
    if gw is not None:
        check_backward_inputs(qw, vw, *gw, rows=grads_rows)
    softmax_scale, softcap = scale_and_softcap(softmax_scale, softcap, qw.shape[2])
    call = Call(origin=origin, xp=xp, q=qw, k=kw, v=vw, dtype=dtype_name(qw.dtype),
                head_dim=int(qw.shape[2]), head_dim_v=int(vw.shape[2]),
                heads_q=int(qw.shape[1]), heads_k=int(kw.shape[1]), on_device=on_device,
                validate=validation_enabled(on_device), mask=Mask(),
                softmax_scale=softmax_scale, softcap=softcap, deterministic=_flag(deterministic),
                backend=None, plan=None, grads=gw, part=part, method=method)
    base, mods = working_mods(mask, score_mod, xp, q, aux_grads=aux_grads and gw is not None)
    call = replace(call, mods=mods, sinks=working_sinks(sinks, q, call.heads_q, xp),
                   dropout=dropout)
    call = replace(call, backend=backends.select(backend, call))
    if part is not None:
        call = replace(call, part=check_context_parallel(part, method, xp, group_size=group_size,
                                                         rows=(call.rows_q, call.rows_k),
                                                         heads_q=call.heads_q,
                                                         ulysses_size=ulysses_size),
                       ulysses_size=None if ulysses_size is None else int(ulysses_size))
        return replace(call, mask=working_mask(base, part[0].batch, xp), plan=plan)
    lay = _layout(xp, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q,
                  max_seqlen_k)
    call = replace(call, mask=working_mask(base, lay.batch, xp), layout=lay)
    if call.validate:
        _check_layout(lay, call.rows_q, call.rows_k)
    if plan is None:
        plan = call.make_plan(lay)
    else:
        _check_plan(plan, call, lay)
    return replace(call, plan=plan)


# --------------------------------------------------------------------------------------------
# Context parallelism
# --------------------------------------------------------------------------------------------

CP_METHODS = ("ring", "allgather", "ulysses", "usp")


def check_ulysses_size(method, ulysses_size, cp_size, heads_q=None) -> None:
    """Method `"usp"` takes `ulysses_size=u`: an int that divides `cp_size` and `heads_q`;
    the other methods take none."""
    if method != "usp":
        if ulysses_size is not None:
            raise ValueError(f"ulysses_size={ulysses_size!r} is for method='usp' (Ulysses inside "
                             f"groups of ulysses_size ranks, the ring across them); method="
                             f"{method!r} takes none")
        return
    u = ulysses_size
    if isinstance(u, (bool, np.bool_)) or not isinstance(u, (int, np.integer)) or u < 1:
        raise ValueError(f"method='usp' needs ulysses_size, an int >= 1 that divides cp_size="
                         f"{cp_size} (the ranks of one all-to-all group), got {u!r}")
    if cp_size % u:
        raise ValueError(f"ulysses_size={u} does not divide cp_size={cp_size}: cp = "
                         f"ulysses_size x ring size")
    if heads_q is not None and heads_q % u:
        raise ValueError(f"method='usp' splits heads over ulysses_size={u} ranks: q has "
                         f"{heads_q} heads, not divisible by it")


def check_context_parallel(part, method, xp=None, *, group_size=None, rows=None,
                           heads_q=None, ulysses_size=None) -> tuple:
    """The context-parallel arguments of a call (`varlen.comm`); each check runs when its
    value is given. Returns `part` with its metadata in array module `xp` (None: where it is).

    part: `(query partition, key partition)`, built for the same cp size, scheme and batch;
    method: one of `CP_METHODS`; group_size: the group's ranks, the partition's cp size;
    rows: `(Tq_local, Tk_local)` of the shards, each partition's `local_rows`; heads_q: `Hq`,
    which Ulysses splits over the ranks; ulysses_size: `u` of method `"usp"` (required there,
    refused elsewhere): a divisor of cp_size (and of `Hq`).
    """
    # Partitions are known by what they offer: varlen.comm sits above this step.
    def is_partition(p):
        return all(hasattr(p, a) for a in ("cp_size", "scheme", "batch", "local_rows", "on"))
    if not (isinstance(part, (tuple, list)) and len(part) == 2 and
            all(is_partition(p) for p in part)):
        raise TypeError(f"part must be a varlen.comm.partition(...) or a (queries, keys) pair of "
                        f"them, got {type(part).__name__}")
    pq, pk = part
    if (pq.cp_size, pq.scheme, pq.batch) != (pk.cp_size, pk.scheme, pk.batch):
        raise ValueError(f"the query partition {pq} and key partition {pk} disagree on "
                         f"cp_size, scheme or batch")
    if method not in CP_METHODS:
        raise ValueError(f"method={method!r} is not a known method; expected one of "
                         f"{', '.join(map(repr, CP_METHODS))}")
    if group_size is not None and group_size != pq.cp_size:
        raise ValueError(f"group has {group_size} ranks but part was built for "
                         f"cp_size={pq.cp_size}")
    for name, T, p in zip(("q", "k"), rows or (), (pq, pk)):
        if T != p.local_rows:
            raise ValueError(f"{name} has {T} rows but the partition gives every rank "
                             f"{p.local_rows}; pass this rank's shard, part.shard({name}, rank)")
    if heads_q is not None and method == "ulysses" and heads_q % pq.cp_size:
        raise ValueError(f"method='ulysses' splits heads over ranks: q has {heads_q} heads, not "
                         f"divisible by cp_size={pq.cp_size}; use 'ring' or 'allgather'")
    check_ulysses_size(method, ulysses_size, pq.cp_size, heads_q)
    return (pq, pk) if xp is None else (pq.on(xp), pk.on(xp))
