"""The PyTorch custom ops behind `varlen.torch` (which re-exports `varlen_attention` and
`context_parallel_attention` with the drop-in names of `varlen.integrations`); see
`varlen.torch` for the contract."""
from __future__ import annotations

import contextlib
import weakref

import numpy as np
import torch

from ._api import attention_backward, attention_forward
from ._setup import static_scalars
from ._validate import check_metadata_devices, check_specs, set_validation, validation_mode
from .masks import MASK_FIELDS, Mask
from .mods import MaskMod, ScoreMod, split_mask
from .mods.text import graph_from_text, graph_text
from .plan import Plan

__all__ = ["varlen_attention", "context_parallel_attention"]

# The op arguments after the data arrays: metadata tensors, the mask as `Mask.parts` splits it
# (a tensor where given, else the int), the scalars of `_setup.static_scalars`, the key of the
# call's plan in `_PLANS` (0: none), then the user functions: each MaskMod / ScoreMod as the
# text of its graph (`varlen.mods.text`: self-contained, so a compiled graph holds no Python
# object) and its aux tensors (None: no such function); then the sinks (None: none); then
# dropout (`varlen.dropout`): p, the seed as a signed 64-bit int (`_seed_arg`), the offset.
_META = (("cu_seqlens_q", "Tensor"), ("cu_seqlens_k", "Tensor"),
         ("seq_offsets_q", "Tensor?"), ("seq_offsets_k", "Tensor?"),
         *((name, "Tensor?") for name in MASK_FIELDS),
         *((f"{name}_int", "int") for name in MASK_FIELDS),
         ("softmax_scale", "float?"), ("softcap", "float"), ("max_seqlen_q", "int?"),
         ("max_seqlen_k", "int?"), ("backend", "str?"), ("deterministic", "bool"),
         ("plan", "int"), ("mask_mod", "str?", "None"), ("mask_aux", "Tensor[]?", "None"),
         ("score_mod", "str?", "None"), ("score_aux", "Tensor[]?", "None"),
         ("sinks", "Tensor?", "None"),
         ("dropout_p", "float", "0.0"), ("seed", "int?", "None"), ("offset", "int", "0"))
_META_SCHEMA = ", ".join(f"{kind} {name}" + (f"={d[0]}" if d else "")
                         for name, kind, *d in _META)
_META_NAMES = tuple(name for name, *_ in _META)
# What PyTorch leaves out of trailing arguments that hold their default.
_META_DEFAULTS = tuple({"0.0": 0.0, "0": 0}.get(d[0]) if d else None for _, _, *d in _META)
_NUM_META = len(_META)
# Where the score_mod's aux tensors and the sinks sit among the op's inputs (after q, k, v).
_SCORE_AUX = 3 + _META_NAMES.index("score_aux")
_SINKS = 3 + _META_NAMES.index("sinks")

_NO_DOUBLE_BACKWARD = (
    "varlen.torch.varlen_attention has first-order gradients only (loss.backward(), "
    "torch.autograd.grad); differentiating its gradients again (double backward, "
    "create_graph=True followed by a second backward) is not implemented")
_NO_FUNC_TRANSFORMS = (
    "varlen.torch.varlen_attention does not support torch.func transforms that differentiate "
    "(torch.func.grad, vjp, jacrev, jvp, ...); use torch.autograd (loss.backward() or "
    "torch.autograd.grad), under torch.compile too")


# --------------------------------------------------------------------------------------------
# Plans: not tensors, so they stay out of the op schema
# --------------------------------------------------------------------------------------------

# id(plan) -> plan, for the op implementations. Weak: an entry lives as long as the caller or
# an autograd graph holds the plan.
_PLANS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# Plans traced into a torch.compile graph are constants of that graph: held for the process.
_COMPILED_PLANS: dict = {}


@torch.compiler.assume_constant_result
def _plan_key(plan) -> int:
    """The op argument that stands for `plan` (0: none). Under torch.compile this runs once, at
    trace time, and the key is a constant of the graph (guarded by the plan's identity)."""
    if plan is None:
        return 0
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a varlen.Plan from varlen.plan(), got "
                        f"{type(plan).__name__}")
    _PLANS[id(plan)] = plan
    if torch.compiler.is_compiling():
        _COMPILED_PLANS[id(plan)] = plan
    return id(plan)


def _plan_of(key: int):
    if key == 0:
        return None
    plan = _PLANS.get(key)
    if plan is None:
        raise RuntimeError("the plan passed to varlen.torch.varlen_attention is no longer alive")
    return plan


# --------------------------------------------------------------------------------------------
# The custom ops
# --------------------------------------------------------------------------------------------

def _padded(meta) -> list:
    """The metadata arguments with the trailing ones PyTorch leaves out when they hold their
    default put back."""
    return list(meta) + list(_META_DEFAULTS[len(meta):])


def _seed_arg(seed):
    """A seed in [0, 2**64) as the op's signed 64-bit `int?` (None stays None)."""
    return None if seed is None else (seed - (1 << 64) if seed >= 1 << 63 else seed)


def _seed_of(arg):
    """`_seed_arg`'s inverse."""
    return None if arg is None else arg % (1 << 64)


def _keywords(meta) -> dict:
    """The core API's keyword arguments from the op's metadata arguments."""
    kw = dict(zip(_META_NAMES, _padded(meta)))
    arrays = [kw.pop(name) for name in MASK_FIELDS]
    ints = [kw.pop(f"{name}_int") for name in MASK_FIELDS]
    base = Mask.from_parts(arrays, ints)
    mask_mod = _mod_of(MaskMod, kw.pop("mask_mod"), kw.pop("mask_aux"))
    if mask_mod is not None:
        mask_mod.base = base
    kw["mask"] = base if mask_mod is None else mask_mod
    kw["score_mod"] = _mod_of(ScoreMod, kw.pop("score_mod"), kw.pop("score_aux"))
    kw["plan"] = _plan_of(kw["plan"])
    kw["seed"] = _seed_of(kw["seed"])
    return kw


def _mod_of(cls, text, aux):
    """The MaskMod / ScoreMod an op argument pair stands for (None: none)."""
    if text is None:
        return None
    return cls(None, *(aux or ()), _graph=graph_from_text(text))


def _float_aux(text, aux) -> list:
    """The score_mod's float aux tensors: those the backward op returns gradients of."""
    if text is None:
        return []
    kinds = [kind for kind, _, _ in graph_from_text(text).aux]
    return [a for a, kind in zip(aux or (), kinds) if kind == "float"]


def _on_device_of(x: torch.Tensor):
    """CuPy's current device := `x`'s CUDA device (a no-op for CPU tensors).

    The core API makes PyTorch's current stream CuPy's current stream for torch inputs, so
    DLPack exchanges and launches are ordered on it without host synchronisation; CuPy launches
    on its current device, which must be the tensor's.
    """
    if x.device.type != "cuda":
        return contextlib.nullcontext()
    import cupy
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return cupy.cuda.Device(index)


@torch.library.custom_op("varlen::attention_forward", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, Tensor v, {_META_SCHEMA}) -> "
                                f"(Tensor, Tensor)")
def _forward_op(q, k, v, *meta):
    kw = _keywords(meta)
    # `deterministic` only matters to the backward; the autograd context reads it here.
    del kw["deterministic"]
    with _on_device_of(q):
        out, lse = attention_forward(q, k, v, **kw)
    # The fake implementation promises contiguous outputs; hold the real one to it.
    return out.contiguous(), lse.contiguous()


def _check_fake(q, k, v, meta):
    """The setup step's data-free checks, on fake or meta tensors while PyTorch traces."""
    kw = _keywords(meta)
    check_specs(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seq_offsets_q"],
                kw["seq_offsets_k"], split_mask(kw["mask"])[0])


@_forward_op.register_fake
def _forward_fake(q, k, v, *meta):
    _check_fake(q, k, v, meta)
    Tq, Hq, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((Tq, Hq, v.shape[2])), q.new_empty((Hq, Tq), dtype=lse_dtype)


@torch.library.custom_op("varlen::attention_backward", mutates_args=(),
                         schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                                f"Tensor lse, {_META_SCHEMA}, bool aux_grads=False) -> "
                                f"(Tensor, Tensor, Tensor, Tensor[], Tensor[])")
def _backward_op(dout, q, k, v, out, lse, *meta_and_flag):
    meta, aux_grads = _meta_and_flag(meta_and_flag)
    kw = _keywords(meta)
    with _on_device_of(q):
        dq, dk, dv, *rest = attention_backward(dout, q, k, v, out, lse, **kw,
                                               aux_grads=aux_grads)
    # with sinks: their gradient (float32; float64 for float64), a list of one
    dsinks = [] if kw["sinks"] is None else [rest.pop(0).contiguous()]
    # aux_grads: float32 gradients of the score_mod's float aux tensors, in order (a float aux
    # the function never reads has a zero gradient).
    daux = []
    if aux_grads:
        for a, g in zip(kw["score_mod"].aux, rest[0]):
            if a.is_floating_point():
                daux.append(torch.zeros(a.shape, dtype=torch.float32, device=a.device)
                            if g is None else g.contiguous())
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), daux, dsinks


def _meta_and_flag(args) -> tuple:
    """The backward op's metadata arguments and its `aux_grads` flag (False when left out)."""
    args = _padded(args[:_NUM_META]) + list(args[_NUM_META:])
    return args[:_NUM_META], bool(args[_NUM_META]) if len(args) > _NUM_META else False


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, *meta_and_flag):
    meta, aux_grads = _meta_and_flag(meta_and_flag)
    _check_fake(q, k, v, meta)
    kw = dict(zip(_META_NAMES, meta))
    daux = [a.new_empty(a.shape, dtype=torch.float32)
            for a in _float_aux(kw["score_mod"], kw["score_aux"])] if aux_grads else []
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dsinks = [] if kw.get("sinks") is None else [q.new_empty((q.shape[1],), dtype=acc)]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), daux, dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, *meta = inputs
    meta = _padded(meta)
    out, lse = output
    # Tensors (alone or in a list) are saved; the other arguments are kept as they are.
    tensors, ctx.meta = [], []
    for x in meta:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            ctx.meta.append(_Saved(1, False))
        elif isinstance(x, (list, tuple)):
            tensors.extend(x)
            ctx.meta.append(_Saved(len(x), True))
        else:
            ctx.meta.append(x)
    ctx.save_for_backward(q, k, v, out, lse, *tensors)
    # The backward may run on another thread (autograd's device threads): it keeps the
    # forward's validation mode, and the plan alive.
    ctx.validation = validation_mode()
    ctx.plan = _plan_of(meta[_META_NAMES.index("plan")])
    # lse is returned for inspection and LSE merging; it carries no gradient.
    ctx.mark_non_differentiable(lse)


class _Saved:
    """A place in `ctx.meta` whose tensors (`count`, a list if `is_list`) were saved."""

    def __init__(self, count: int, is_list: bool):
        self.count, self.is_list = count, is_list


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    meta = []
    for x in ctx.meta:
        if isinstance(x, _Saved):
            taken, saved = saved[:x.count], saved[x.count:]
            x = list(taken) if x.is_list else taken[0]
        meta.append(x)
    # Gradients of the score_mod's float aux tensors that require one (learnable biases).
    score_aux = meta[_META_NAMES.index("score_aux")] or []
    needs = ctx.needs_input_grad
    wants = (needs[_SCORE_AUX] if len(needs) > _SCORE_AUX else None) or [False] * len(score_aux)
    aux_grads = any(w and a.is_floating_point() for w, a in zip(wants, score_aux))
    # The incoming gradient may be an expanded (stride-0) view, e.g. from `out.sum()`.
    with set_validation(ctx.validation):
        dq, dk, dv, daux, dsinks = _backward_op(dout.contiguous(), q, k, v, out, lse, *meta,
                                                aux_grads)
    # One gradient per input, a list for a list of tensors (the structure of the inputs).
    grads = [[None] * x.count if isinstance(x, _Saved) and x.is_list else None
             for x in ctx.meta]
    if aux_grads:
        daux = iter(daux)           # one float32 gradient per float aux, in order
        aux_grad = grads[_SCORE_AUX - 3]
        for i, (a, wanted) in enumerate(zip(score_aux, wants)):
            if a.is_floating_point():
                g = next(daux)
                aux_grad[i] = g.to(a.dtype) if wanted else None
    if dsinks and len(needs) > _SINKS and needs[_SINKS]:
        grads[_SINKS - 3] = dsinks[0].to(meta[_SINKS - 3].dtype)
    # PyTorch leaves trailing arguments that hold their default out of the inputs.
    return (dq, dk, dv, *grads)[:len(needs)]


def _no_context(ctx, inputs, output):
    pass


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(_NO_DOUBLE_BACKWARD)


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_backward_op.register_autograd(_no_double_backward, setup_context=_no_context)


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------

def _as_tensor(x):
    """Metadata as a tensor (NumPy arrays, lists and DLPack producers are turned into one; the
    setup step checks what they hold)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        return torch.from_dlpack(x)
    return torch.as_tensor(np.asarray(x))


def _under_func_transform(*tensors) -> bool:
    """True inside torch.func.grad, vjp, jvp, jacrev, ... (their tensors track gradients)."""
    from torch._C._functorch import is_gradtrackingtensor
    return any(is_gradtrackingtensor(x) for x in tensors)


def _autocast(q, k, v):
    """Under `torch.autocast`, q, k and v in the autocast dtype, as for a matmul (float64
    stays: autocast leaves it alone)."""
    device = q.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if x.is_floating_point() and x.dtype != torch.float64 else x
                 for x in (q, k, v))


def _mod_operands(q, mod, cls, role: str) -> tuple:
    """`(graph text, aux tensors)` of a MaskMod / ScoreMod for the op (None, None: none), its
    aux checked to be tensors on q's device, of the dtypes and ranks the function was traced
    with (data-free, so it runs while torch.compile traces)."""
    if mod is None:
        return None, None
    if not isinstance(mod, cls):
        raise TypeError(f"{role} must be a varlen.{cls.__name__} or None, got "
                        f"{type(mod).__name__}")
    named = [(f"{role} aux argument {i}", a) for i, a in enumerate(mod.aux)]
    for name, a in named:
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{name} is a {type(a).__module__}.{type(a).__name__}; "
                            f"varlen.torch takes aux arrays as torch tensors on q's device "
                            f"({q.device})")
        # (compared here, not by check_together, which dynamo cannot trace for a Parameter)
        if a.device != q.device:
            raise ValueError(f"{name} is on {a.device} but q is on {q.device}; aux arrays "
                             f"must live on q's device")
    for (name, a), (kind, ndim, dtype) in zip(named, mod.graph.aux):
        got = str(a.dtype).removeprefix("torch.")
        if a.dim() != ndim or got != dtype:
            raise TypeError(f"{name} is a {a.dim()}-D {got} tensor but {role} was traced with "
                            f"a {ndim}-D {dtype} array; build it (or with_aux) with the "
                            f"tensors it runs on")
    return graph_text(mod.graph), list(mod.aux)


def _sinks_operand(q, sinks):
    """`sinks` for the op: None, or a floating tensor on q's device (checked without its data,
    so it runs while torch.compile traces; the setup step checks its shape)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks is a {type(sinks).__module__}.{type(sinks).__name__}; "
                        f"varlen.torch takes sinks as a float [Hq] tensor on q's device "
                        f"({q.device})")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}; sinks must live "
                         f"on q's device")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor (one logit per query head), got "
                        f"{sinks.dtype}")
    return sinks


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                     seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                     max_seqlen_q=None, max_seqlen_k=None, backend=None, deterministic=False,
                     plan=None, return_lse=False, score_mod=None, sinks=None, dropout_p=0.0,
                     seed=None, offset=0):
    """Attention over a packed variable-length batch, differentiable in q, k and v, in the
    float aux tensors of a `score_mod` that require grad, and in `sinks`.

    Args:
        q: `[Tq, Hq, D]` tensor, float16, bfloat16, float32 (float64 on the CPU).
        k: `[Tk, Hk, D]` tensor in q's dtype, on q's device; `Hq % Hk == 0` (query head h
            reads key head `h // (Hq // Hk)`: GQA/MQA).
        v: `[Tk, Hk, Dv]` tensor in q's dtype, on q's device.
        cu_seqlens_q, cu_seqlens_k: int32 `[B+1]` tensors, best on q's device: 0 first, then
            non-decreasing; sequence b has `Lq[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]` query
            rows and `Lk[b]` key rows; a length may be 0. Wider integers must fit int32.
        seq_offsets_q, seq_offsets_k: optional int32 `[B+1]` tensors: the first row of each
            sequence (`[off[b], off[b] + L[b])`); rows of no sequence are padding, with output
            0 and gradient 0, and never a key.
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask`, whose fields
            are ints or int32/bool `[B]` tensors (a policy per sequence); the `varlen.Mask`
            docstring draws what query i sees for Lq != Lk. Or a `varlen.MaskMod(fn, *aux)`
            (`Mask(...) & MaskMod(...)`): `fn(b, q_idx, k_idx, *aux)` says which pairs are
            visible, positions counted from each sequence's first row; aux are tensors on
            q's device.
        softmax_scale: float scaling `q @ k^T`, `1/sqrt(D)` when None.
        softcap: float; when > 0, scores go through `softcap * tanh(scores / softcap)`.
        max_seqlen_q, max_seqlen_k: optional ints bounding the lengths (smaller tile tables;
            checked when validation is on).
        backend: `"numpy"`, `"cpu"`, `"numba"`, `"cupy"` or None (for CPU tensors `"cpu"` when
            its BLAS tile products are usable, else `"numpy"`, and `"numpy"` for float64; the
            fastest GPU backend for CUDA tensors; docs/api.md).
        deterministic: bool, bitwise-repeatable backward (device backends accumulate dQ with
            atomics otherwise).
        plan: optional `varlen.plan(...)` of this layout and mask, reused across calls and
            layers. Under torch.compile a plan is a constant of the graph, guarded by identity:
            pass the same Plan object every step (each new one recompiles) or None.
        return_lse: return `(out, lse)` instead of `out`.
        score_mod: a `varlen.ScoreMod(fn, *aux)`: each visible pair's scaled (and softcapped)
            score becomes `fn(score, b, h, q_idx, k_idx, *aux)` before the softmax (-inf hides
            the pair). Aux are tensors on q's device; a float aux that requires grad (learnable
            ALiBi slopes, a relative bias table) gets its gradient, accumulated in float32
            and cast to its dtype; int and bool aux get none.
        sinks: optional float `[Hq]` tensor on q's device: attention sinks (gpt-oss), one
            logit per query head in every row's softmax with no value (not scaled, not
            soft-capped); its gradient is accumulated in float32 and cast to its dtype.
        dropout_p: float in [0, 1): attention dropout as in FlashAttention 2 (each visible
            pair's probability dropped with probability `dropout_p`, the kept ones scaled by
            `1 / (1 - dropout_p)`; lse without dropout). Runs on every backend (`cupy`
            through `cupy:mma`); the backward draws the same pairs again.
        seed: int in [0, 2**64) fixing the dropped pairs (with `offset`), the same on every
            backend. None: drawn from torch's default CPU generator (`torch.manual_seed` makes
            it repeatable); with `deterministic=True` a seed is required, and under
            torch.compile too (pass it as an argument of the compiled function).
        offset: int in [0, 2**32), a stream index beside the seed.

    Returns:
        out: `[Tq, Hq, Dv]` in q's dtype, on q's device.
        lse (with `return_lse=True`): `[Hq, Tq]` natural-log sum of exp of the scores, float32
            (float64 for float64 inputs); `-inf` for padding rows and for queries with no
            visible key (whose output is 0, never NaN; with sinks their lse is `sinks[h]`).
            It carries no gradient.

    Under `torch.autocast`, q, k and v are cast to the autocast dtype first (float64 stays),
    like the inputs of a matmul. Gradients are first order: double backward and `torch.func`
    transforms that differentiate raise NotImplementedError.

    Under `torch.compile(fullgraph=True)` a MaskMod or ScoreMod enters the graph as the text
    of its traced expression and its aux tensors as inputs: a new MaskMod / ScoreMod object of
    the same function each step (new aux values, same dtypes and ranks) reuses the compiled
    graph. Build it outside the compiled function (tracing a function inside it is not
    supported), or derive it inside with `mod.with_aux(new_tensors)`.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not torch.compiler.is_compiling() and _under_func_transform(q, k, v):
        raise NotImplementedError(_NO_FUNC_TRANSFORMS)
    q, k, v = _autocast(q, k, v)
    dropout = _dropout_args(dropout_p, seed, offset, deterministic)
    base, mask_mod = split_mask(mask)
    # The op dispatches on all its tensors: one on the meta device would run the fake
    # implementation on real data, so every metadata device is checked first.
    check_metadata_devices(q, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, base)
    mods = (*_mod_operands(q, mask_mod, MaskMod, "mask_mod"),
            *_mod_operands(q, score_mod, ScoreMod, "score_mod"), _sinks_operand(q, sinks))
    meta = [_as_tensor(x) for x in (cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k)]
    arrays, ints = base.parts()
    scalars = static_scalars(softmax_scale, softcap, max_seqlen_q, max_seqlen_k, backend,
                             deterministic)
    out, lse = _forward_op(q, k, v, *meta, *map(_as_tensor, arrays), *ints, *scalars,
                           _plan_key(plan), *mods, *dropout)
    return (out, lse) if return_lse else out


def draw_seed() -> int:
    """A dropout seed in [0, 2**63) from torch's default CPU generator (no device sync)."""
    return int(torch.empty((), dtype=torch.int64).random_())


def _dropout_args(dropout_p, seed, offset, deterministic) -> tuple:
    """`(dropout_p, seed, offset)` as the op takes them, checked (`varlen.dropout`); a seed
    drawn (`draw_seed`) when dropout is on and none is given."""
    from .dropout import check_dropout
    p, seed, offset = check_dropout(dropout_p, seed, offset)
    if p > 0 and seed is None:
        if deterministic:
            raise ValueError(f"seed is required with dropout_p={dropout_p!r} and "
                             f"deterministic=True: pass an int in [0, 2**64) (or "
                             f"varlen.torch.draw_seed()) so that the dropped pairs repeat")
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"dropout_p={dropout_p!r} under torch.compile needs seed=: an int argument of "
                f"the compiled function (drawing one would fix it in the graph)")
        seed = draw_seed()
    return p, _seed_arg(seed), offset


# --------------------------------------------------------------------------------------------
# Context parallelism: this rank's shard in, this rank's shard out, differentiable
# --------------------------------------------------------------------------------------------

def _cp_group(group):
    """A `varlen.comm.Group` for `group`: a Group as it is; a torch.distributed ProcessGroup,
    or None for the default one, through `varlen.comm.torch_group`."""
    import varlen.comm as vc
    if isinstance(group, vc.Group):
        return group
    if group is None or isinstance(group, torch.distributed.ProcessGroup):
        return vc.torch_group(group)
    raise TypeError(f"group must be a varlen.comm.Group, a torch.distributed.ProcessGroup or "
                    f"None (the default process group), got {type(group).__name__}")


# What a rank that drew its dropout seed sends (first, as what a peer that did not draw reads
# as the reason it stops: `varlen.comm`'s agreement takes a message there).
_DREW = "seed=None with dropout_p > 0 (a seed drawn on every rank, rank 0's taken)"


def _group_seed(group, drawn: int) -> int:
    """Rank 0's drawn seed on every rank (each rank drew one: its generator advances as in a
    single-process call); every rank must have drawn, else all raise."""
    got = group.allgather_object((_DREW, drawn))
    if any(not (isinstance(x, tuple) and len(x) == 2 and x[0] == _DREW) for x in got):
        raise ValueError("ranks disagree on seed: some passed seed=None with dropout_p > 0, "
                         "others a seed or no dropout; pass the same seed (or None) on every "
                         "rank")
    return got[0][1]


class _ContextParallelAttention(torch.autograd.Function):
    """Forward: `varlen.comm.attention_forward` on this rank; backward: the method's backward
    (for the ring, K/V and the dK/dV accumulators travel the ring again) with the same step
    plans, which the partition caches per rank, mask, method and tiles.

    `aux` are the score_mod's aux tensors, inputs of the function so that autograd hands
    their gradients to those that require them: this rank's share (`aux_grads="rank"`),
    which the training step sums over the group with the other parameter gradients."""

    @staticmethod
    def forward(ctx, q, k, v, part, group, kw, deterministic, sinks, *aux):
        import varlen.comm as vc
        out, lse = vc.attention_forward(q, k, v, part, group, sinks=sinks, **kw)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.part, ctx.group, ctx.kw = part, group, dict(kw, deterministic=deterministic)
        # Autograd may run the backward on another thread: it keeps the forward's mode.
        ctx.validation = validation_mode()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        import varlen.comm as vc
        q, k, v, out, lse, sinks = ctx.saved_tensors
        want = ctx.needs_input_grad[8:]
        kw = dict(ctx.kw, aux_grads="rank") if any(want) else ctx.kw
        with set_validation(ctx.validation):
            dq, dk, dv, *rest = vc.attention_backward(dout.contiguous(), q, k, v, out, lse,
                                                      ctx.part, ctx.group, sinks=sinks,
                                                      sinks_grad="rank", **kw)
        dsinks = None
        if sinks is not None:
            dsinks = rest.pop(0)
            dsinks = dsinks.to(sinks.dtype) if ctx.needs_input_grad[7] else None
        daux = rest[0] if rest else (None,) * len(want)
        aux = ctx.kw["score_mod"].aux if any(want) else ()
        daux = tuple(None if g is None or not w else g.to(a.dtype)
                     for g, w, a in zip(daux, want, aux or (None,) * len(want)))
        return (dq, dk, dv, None, None, None, None, dsinks) + daux


@torch.compiler.disable
def context_parallel_attention(q, k, v, part, group=None, *, mask="full", softmax_scale=None,
                               softcap=0.0, method="ring", deterministic=False,
                               return_lse=False, score_mod=None, sinks=None,
                               ulysses_size=None, dropout_p=0.0, seed=None, offset=0):
    """Context-parallel attention on this rank, differentiable in its q, k and v shards (and
    in `sinks` and a score_mod's float aux tensors).

    Call it on every rank of the group with the same partition, mask and method; each rank
    passes its shards and gets its shard of the output. `part.unshard([...])` of all ranks'
    outputs (and gradients) is what `varlen_attention` computes on the whole batch.

        part = varlen.comm.partition(cu_seqlens, cp_size)           # once per batch layout
        q_r, k_r, v_r = (part.shard(x, rank) for x in (q, k, v))
        out_r = varlen.torch.context_parallel_attention(q_r, k_r, v_r, part, mask="causal")

    Args:
        q: `[Tq_local, Hq, D]` tensor, this rank's shard `part.shard(q_global, rank)`.
        k, v: `[Tk_local, Hk, D]` and `[Tk_local, Hk, Dv]` shards in q's dtype and device;
            `Hq % Hk == 0` (GQA/MQA).
        part: `varlen.comm.partition(cu_seqlens, cp_size, ...)` (a pair `(part_q, part_k)` for
            cross attention).
        group: a `varlen.comm.Group` (MPI, NCCL, in-process), a
            `torch.distributed.ProcessGroup`, or None for torch.distributed's default group
            (gloo on CPUs, NCCL on GPUs); its size must be `part.cp_size`.
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask` (per-sequence
            fields as ints or `[B]` arrays), or a `varlen.MaskMod` (or `Mask & MaskMod`)
            whose aux tensors are on q's device; positions are global.
        softmax_scale: default `1/sqrt(D)`. softcap: as in `varlen_attention`.
        score_mod: a `varlen.ScoreMod`, its aux tensors on q's device. The functions see
            single-process coordinates: `b` the batch's sequence, `q_idx`/`k_idx` positions in
            the whole sequence, `h` the global query head (under Ulysses too). A float aux
            tensor that requires grad gets this rank's share of its gradient (the pairs its
            kernels computed), in its dtype: sum it over the group (`all_reduce`) with the
            other parameter gradients, as for any parameter every rank holds.
        sinks: optional float `[Hq]` tensor on q's device (every rank the same values), as in
            `varlen_attention`; it gets this rank's share of its gradient (its rows'): sum it
            over the group with the other parameter gradients.
        method: `"ring"`, `"allgather"`, `"ulysses"` (`Hq % cp_size == 0`) or `"usp"`
            (Ulysses inside groups of `ulysses_size` consecutive ranks, the ring across them;
            `Hq % ulysses_size == 0`).
        ulysses_size: with `method="usp"`, the ranks of one all-to-all group.
        dropout_p, seed, offset: attention dropout as in `varlen_attention`; the shards hold
            what `varlen_attention` gives the whole batch with the same seed (each pair's keep
            bit is drawn at its single-process coordinates). `seed=None` draws one from
            torch's default generator on every rank (each generator advances as in a
            single-process call) and every rank takes rank 0's draw (one small host exchange
            per forward call), so ranks seeded differently still drop the same pairs. A
            given seed must be the same on every rank (checked: the ranks raise the same
            ValueError otherwise). With `deterministic=True` the seed is required.
        deterministic: bitwise-repeatable backward.
        return_lse: return `(out, lse)` instead of `out`.

    Returns:
        out: `[Tq_local, Hq, Dv]` in q's dtype, on q's device; lse (with `return_lse=True`):
        `[Hq, Tq_local]` float32 (float64 for float64), no gradient. Pad rows get 0 and -inf.

    Step plans are built on the first call and cached by the partition (per rank, mask,
    method and tile size): build the partition once per batch and every layer, forward and
    backward, reuses them. Under torch.compile the call is a graph break (it communicates
    and runs host-side setup); the code around it compiles. Argument errors on any rank
    (a group of the wrong size, shards of the wrong length, ranks called differently) raise
    the same ValueError on every rank.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if _under_func_transform(q, k, v):
        raise NotImplementedError(_NO_FUNC_TRANSFORMS)
    q, k, v = _autocast(q, k, v)
    cp_group = _cp_group(group)
    p, drawn, offset = _dropout_args(dropout_p, seed, offset, deterministic)
    drawn = _seed_of(drawn)
    if p > 0 and seed is None:
        drawn = _group_seed(cp_group, drawn)
    kw = dict(mask=mask, softmax_scale=softmax_scale, softcap=softcap, method=method,
              score_mod=score_mod, ulysses_size=ulysses_size, dropout_p=p, seed=drawn,
              offset=offset)
    aux = () if score_mod is None else tuple(score_mod.aux)
    out, lse = _ContextParallelAttention.apply(q, k, v, part, cp_group, kw,
                                               bool(deterministic), _sinks_operand(q, sinks),
                                               *aux)
    return (out, lse) if return_lse else out
