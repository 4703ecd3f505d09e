"""JAX adapter: `varlen_attention` with a `jax.custom_vjp`, usable under `jax.jit` and `jax.grad`.

    import varlen.jax
    out = varlen.jax.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, mask="causal")

On concrete arrays (no tracer among them: an eager call, or the forward and backward of an
eager `jax.vjp`/`jax.grad`) the core API runs on the JAX arrays directly, and its errors reach
the caller as they are. Traced, forward and backward are each one opaque call chosen by
platform when the computation is lowered (`jax.lax.platform_dependent`):

* CPU (and any platform without CUDA): `jax.pure_callback` hands NumPy views of the operands to
  `varlen.attention_forward` / `varlen.attention_backward` (the `cpu` backend by default, or
  `numpy` for float64 and without the `[cpu]` extra).
* CUDA: `jax.experimental.buffer_callback` hands XLA's device buffers and stream to the callback;
  the operands become CuPy arrays through DLPack on that stream, the GPU backend runs on it, and
  the results are copied into XLA's output buffers on it. Nothing waits on the host but
  dropout's seed (its 8 bytes are read there).

The adapter holds no attention math and checks nothing itself: the setup step's data-free
checks run on the (possibly traced) arrays while tracing, its value checks inside the call.
Metadata (`cu_seqlens`, offsets, per-sequence mask arrays) travels as integer operands of the
custom VJP and gets `float0` (zero) cotangents, and so does dropout's seed (two uint32 words
drawn from `dropout_rng`, kept for the backward); the scalar settings, the plan and the text of a
MaskMod's or ScoreMod's graph are a hashable static argument, their aux arrays operands (a
ScoreMod's float ones differentiable). MaskMod and ScoreMod are pytrees. See
`docs/frameworks.md`.

`context_parallel_attention` runs inside `jax.shard_map`: varlen.comm's ring, all-gather and
Ulysses methods with `lax.ppermute`, `all_gather`, `psum_scatter` and `all_to_all`, each kernel
call a host callback that picks its rank's cached step plan (`docs/context_parallel.md`).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from ._api import attention_backward, attention_forward
from ._setup import check_ulysses_size, static_scalars
from ._sinks import add_sinks, sink_grads
from ._validate import (as_index_array, as_policy_array, check_qkv, check_specs,
                        check_together, scale_and_softcap)
from .dropout import Dropout, check_dropout, seed_of_words
from .masks import MASK_FIELDS, Mask, as_mask
from .mods import MaskMod, Mods, ScoreMod, split_mask
from .mods.graph import _dtype_name
from .mods.text import graph_from_text, graph_text
from .plan import Plan

__all__ = ["varlen_attention", "context_parallel_attention"]


@dataclass(frozen=True)
class _Static:
    """Everything of a call that is not an array: hashable, a static argument of the VJP."""

    mask_ints: tuple            # per mask field, the int where no array is given
    softmax_scale: float | None
    softcap: float
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    backend: str | None
    deterministic: bool
    plan: object                # a varlen.Plan (hashed by identity) or None
    # The user functions as the text of their graphs (`varlen.mods.text`; None: none), so
    # two calls with functions that trace alike share a trace.
    mask_mod: str | None = None
    score_mod: str | None = None
    # Dropout's probability and offset; its seed is an operand (`_dropout_words`).
    dropout_p: float = 0.0
    offset: int = 0

    def keywords(self, meta, mask_aux=(), score_aux=(), words=None):
        """The keyword arguments of the core API for metadata `meta`, the user functions'
        aux arrays and dropout's seed words (working arrays)."""
        cu_q, cu_k, off_q, off_k, *mask_arrays = meta
        mask = Mask.from_parts(mask_arrays, self.mask_ints)
        if self.mask_mod is not None:
            mask = MaskMod(None, *mask_aux, _graph=graph_from_text(self.mask_mod), base=mask)
        score_mod = None if self.score_mod is None else ScoreMod(
            None, *score_aux, _graph=graph_from_text(self.score_mod))
        return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_offsets_q=off_q,
                    seq_offsets_k=off_k, mask=mask, score_mod=score_mod,
                    softmax_scale=self.softmax_scale, softcap=self.softcap,
                    max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
                    backend=self.backend, plan=self.plan, dropout_p=self.dropout_p,
                    seed=_seed(words), offset=self.offset)


def _seed(words):
    """The core API's int seed of dropout's two words (None: none); a CuPy operand is read
    to the host (8 bytes)."""
    if words is None:
        return None
    get = getattr(words, "get", None)          # CuPy's device-to-host copy
    return seed_of_words(get() if callable(get) else words)


# --------------------------------------------------------------------------------------------
# Host and device calls of the core API
# --------------------------------------------------------------------------------------------

def _host_call(fn, result_shapes):
    """`fn(*numpy arrays) -> numpy arrays` as a JAX computation on the host."""
    def run(*args):
        def call(*arrays):
            # JAX hands the callback its own (immutable) arrays: the backends take NumPy ones
            return tuple(np.asarray(r) for r in fn(*jax.tree.map(np.asarray, arrays)))
        return jax.pure_callback(call, result_shapes, *args, vmap_method="sequential")
    return run


class _StreamRef:
    """A raw `cudaStream_t` handle behind the CUDA stream protocol (for CuPy)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


@contextlib.contextmanager
def _cupy_on(stream_ptr: int, device_id: int):
    """CuPy's current device and stream := XLA's, so DLPack exchanges and launches order on it."""
    import cupy
    with cupy.cuda.Device(device_id):
        if hasattr(cupy.cuda.Stream, "from_external"):
            stream = cupy.cuda.Stream.from_external(_StreamRef(stream_ptr))
        else:
            stream = cupy.cuda.ExternalStream(stream_ptr, device_id)
        with stream:
            yield cupy


def _buffer_call(fn, result_shapes, platform: str):
    """`fn(*working arrays) -> working arrays` on XLA's own buffers (no host round trip).

    On CUDA the operands are CuPy views of XLA's device buffers on XLA's stream and the results
    are copied into the output buffers on that stream. `platform="cpu"` runs the same plumbing
    with NumPy views (the tests use it to exercise this path on a CPU).
    """
    def callback(ctx, outs, *args):
        leaves = jax.tree.leaves(args)
        if platform == "cuda":
            device_id = leaves[0].__dlpack_device__()[1]
            scope = _cupy_on(ctx.stream, device_id)
        else:
            scope = contextlib.nullcontext(np)
        with scope as xp:
            # NumPy's DLPack cannot carry bfloat16; a CPU Buffer also exports `__array__`.
            view = xp.from_dlpack if xp is not np else np.asarray
            results = fn(*jax.tree.map(view, args))
            for buf, res in zip(outs, results):
                view(buf)[...] = res

    def run(*args):
        from jax.experimental.buffer_callback import buffer_callback
        return buffer_callback(callback, result_shapes, vmap_method="sequential")(*args)
    return run


# --------------------------------------------------------------------------------------------
# Argument errors found inside a callback
# --------------------------------------------------------------------------------------------

_CALLBACK_NOTE = ("found by varlen.jax.varlen_attention's callback, where traced metadata is "
                  "checked; outside jax.jit the same call raises this error directly, with its "
                  "traceback")


def _reported(fn):
    """`fn` whose argument errors reach the caller once and to the point.

    XLA formats an error raised in a callback into its runtime error, with the Python stack;
    the core API's message says all there is to say, so it is raised again from here, without
    the frames of the checks, and marked so that JAX does not log it a second time.
    """
    def run(*args):
        try:
            return fn(*args)
        except (ValueError, TypeError) as e:
            error = (TypeError if isinstance(e, TypeError) else ValueError)(
                f"{e} ({_CALLBACK_NOTE})")
        error.varlen_argument_error = True
        raise error
    return run


class _QuietArgumentErrors(logging.Filter):
    """JAX logs an exception raised in a callback, then raises it again; for an argument error
    of ours the log entry would only repeat what the caller gets."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not getattr(exc, "varlen_argument_error", False)


logging.getLogger("jax._src.callback").addFilter(_QuietArgumentErrors())

# Set by the tests to route CPU computations through `_buffer_call` as well.
_CPU_BUFFER_PATH = False


def _dispatch(fn, result_shapes, *args):
    """Run `fn` now on concrete arrays, else on the platform the computation is lowered for.

    Concrete (eager) arrays go to the core API as they are, so its errors reach the caller
    unchanged; traced ones through a callback, where the core API sees NumPy or CuPy arrays.
    """
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        return fn(*args)
    fn = _reported(fn)
    host = _buffer_call(fn, result_shapes, "cpu") if _CPU_BUFFER_PATH else _host_call(
        fn, result_shapes)
    # Every branch is traced; only the one for the lowering platform is compiled.
    return jax.lax.platform_dependent(*args, cpu=host,
                                      cuda=_buffer_call(fn, result_shapes, "cuda"),
                                      default=host)


def _forward(static: _Static, q, k, v, meta, mask_aux=(), score_aux=(), sinks=None,
             words=None):
    Tq, Hq, _ = q.shape
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    shapes = (jax.ShapeDtypeStruct((Tq, Hq, v.shape[2]), q.dtype),
              jax.ShapeDtypeStruct((Hq, Tq), lse_dtype))

    def fn(q, k, v, meta, mask_aux, score_aux, sinks, words):
        return attention_forward(q, k, v, **static.keywords(meta, mask_aux, score_aux, words),
                                 sinks=sinks)
    args = (q, k, v, meta, mask_aux, score_aux, sinks, words)
    axes = frozenset().union(*map(_varying_axes, jax.tree.leaves(args)))
    return tuple(_vary(r, axes) for r in _dispatch(fn, shapes, *args))


def _backward(static: _Static, dout, q, k, v, out, lse, meta, mask_aux=(), score_aux=(),
              aux_grads=False, sinks=None, words=None):
    """`(dq, dk, dv, dsinks)` (dsinks None without sinks), and with `aux_grads` a fifth
    result: float32 gradients of the float arrays among `score_aux`, in order. `words`: the
    forward's dropout seed (the same pairs are drawn again)."""
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    if sinks is not None:
        acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        shapes += (jax.ShapeDtypeStruct(sinks.shape, acc),)
    first_aux = len(shapes)
    floats = [i for i, a in enumerate(score_aux) if _floating(a)] if aux_grads else []
    shapes += tuple(jax.ShapeDtypeStruct(score_aux[i].shape, jnp.float32) for i in floats)

    def fn(dout, q, k, v, out, lse, meta, mask_aux, score_aux, sinks, words):
        grads = attention_backward(dout, q, k, v, out, lse,
                                   **static.keywords(meta, mask_aux, score_aux, words),
                                   deterministic=static.deterministic, aux_grads=bool(floats),
                                   sinks=sinks)
        daux = tuple(grads[-1][i] for i in floats) if floats else ()
        # A float aux the function never reads has a zero gradient.
        daux = tuple(np.zeros(s.shape, s.dtype) if g is None else g
                     for g, s in zip(daux, shapes[first_aux:]))
        return (*grads[:first_aux], *daux)
    res = _dispatch(fn, shapes, dout, q, k, v, out, lse, meta, mask_aux, score_aux, sinks,
                    words)
    dq, dk, dv = res[:3]
    dsinks = res[3] if sinks is not None else None
    daux = tuple(res[first_aux:])
    return (dq, dk, dv, dsinks, daux) if aux_grads else (dq, dk, dv, dsinks)


def _dropout_words(dropout_p: float, dropout_rng):
    """The seed of a call's dropout as a traced uint32[2] operand (`varlen.dropout.seed_of_words`
    turns it into the 64-bit seed inside the call), drawn from `dropout_rng` (a `jax.random`
    key, typed or raw); None without dropout."""
    if dropout_p == 0.0:
        return None
    if dropout_rng is None:
        raise ValueError(f"dropout_rng is required with dropout_p={dropout_p!r}: a jax.random "
                         f"key (e.g. jax.random.key(0)) that fixes which pairs are dropped")
    try:
        return jax.random.bits(dropout_rng, (2,), jnp.uint32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"dropout_rng must be a jax.random key (jax.random.key or "
                        f"jax.random.PRNGKey), got {type(dropout_rng).__name__}: {e}") from None


def _floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


# --------------------------------------------------------------------------------------------
# The custom VJP
# --------------------------------------------------------------------------------------------

# Symbolic zeros tell the forward rule whether the score_mod's aux arrays are differentiated:
# their gradients are computed only then.
@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, meta, mask_aux, score_aux, sinks, words):
    return _forward(static, q, k, v, meta, mask_aux, score_aux, sinks, words)


def _attention_fwd(static, *primals):
    # symbolic_zeros: every leaf comes as a CustomVJPPrimal (its value, whether it is perturbed)
    wanted = any(p.perturbed and _floating(p.value) for p in jax.tree.leaves(
        primals[5], is_leaf=lambda x: isinstance(x, CustomVJPPrimal)))     # score_aux
    q, k, v, meta, mask_aux, score_aux, sinks, words = jax.tree.map(
        lambda p: p.value, primals, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    out, lse = _forward(static, q, k, v, meta, mask_aux, score_aux, sinks, words)
    # dropout's words are kept, so the backward draws the forward's pairs
    return (out, lse), (q, k, v, out, lse, meta, mask_aux, score_aux, wanted, sinks, words)


def _float0_like(x):
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _zero_cotangent(x):
    """The cotangent of an input that gets no gradient: float0 for integers and bools, zeros
    for floats."""
    return jnp.zeros(x.shape, x.dtype) if _floating(x) else _float0_like(x)


def _vary(x, axes):
    """`x` typed as varying over the manual mesh axes `axes` (inside `jax.shard_map`, a
    callback's results vary over none, though each device computed its own: without this the
    output would pass for replicated, and the VJP's cotangents would not match their primals'
    type)."""
    missing = tuple(sorted(frozenset(axes) - _varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def _varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over (`aval.vma` in JAX < 0.10)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    if kind is not None:
        return frozenset(kind.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def _attention_bwd(static, residuals, cotangents):
    q, k, v, out, lse, meta, mask_aux, score_aux, wanted, sinks, words = residuals
    dout, _ = cotangents        # lse is behind a stop_gradient: its cotangent is zero
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    dq, dk, dv, dsinks, *daux = _backward(static, dout, q, k, v, out, lse, meta, mask_aux,
                                          score_aux, aux_grads=wanted, sinks=sinks,
                                          words=words)
    if sinks is not None:       # float32 (float64) accumulation, in the sinks' dtype
        dsinks = _vary(dsinks.astype(sinks.dtype), _varying_axes(sinks))
    dq, dk, dv = (_vary(g, _varying_axes(x)) for g, x in ((dq, q), (dk, k), (dv, v)))
    # Gradients of the float aux arrays (float32 accumulation, in their dtype); int and bool
    # aux arrays get float0 cotangents, as JAX wants for them.
    daux = iter(daux[0] if daux else ())
    score_cot = tuple(_vary(next(daux).astype(a.dtype), _varying_axes(a))
                      if wanted and _floating(a) else _zero_cotangent(a) for a in score_aux)
    return (dq, dk, dv, jax.tree.map(_float0_like, meta),
            tuple(map(_zero_cotangent, mask_aux)), score_cot, dsinks,
            None if words is None else _float0_like(words))


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------------------------
# MaskMod and ScoreMod as pytrees
# --------------------------------------------------------------------------------------------

class _ModDef:
    """A MaskMod / ScoreMod without its arrays (the pytree node's static part): equal, and
    hashed, by its class, the text of its graph and its base mask's ints, so a new object of
    the same function is the same tree structure."""

    def __init__(self, mod, base_ints):
        self.template = mod.with_aux(())
        if isinstance(mod, MaskMod):
            self.template.base = None
        self.key = (type(mod), graph_text(mod.graph), base_ints)

    def __eq__(self, other):
        return isinstance(other, _ModDef) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"{self.key[0].__name__}({self.template.graph.digest}, base={self.key[2]})"


def _flatten_mod(mod):
    base = getattr(mod, "base", None)
    arrays, ints = base.parts() if base is not None else ((), None)
    return (mod.aux, arrays), _ModDef(mod, ints)


def _unflatten_mod(definition: _ModDef, children):
    aux, arrays = children
    mod = definition.template.with_aux(aux)
    ints = definition.key[2]
    if ints is not None:
        mod.base = Mask.from_parts(arrays, ints)
    return mod


for _cls in (MaskMod, ScoreMod):
    jax.tree_util.register_pytree_node(_cls, _flatten_mod, _unflatten_mod)


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------

def _operand(x, convert):
    """Metadata as a JAX operand: JAX arrays (traced or not) as they are, anything else through
    the core's conversion first (on the host: values past int32 are refused or normalised
    there, never wrapped by JAX's 32-bit default)."""
    if x is None or isinstance(x, jax.Array):
        return x
    return jnp.asarray(convert(x))


def _operands(layout: dict, mask_arrays, batch: int) -> tuple:
    """The metadata operands of the VJP: the layout's arrays, then the mask's arrays."""
    return (*(_operand(x, partial(as_index_array, name=name, xp=np))
              for name, x in layout.items()),
            *(_operand(a, partial(as_policy_array, name=name, xp=np, batch=batch))
              for name, a in zip(MASK_FIELDS, mask_arrays)))


def _mod_operands(q, mod, cls, role: str) -> tuple:
    """`(graph text, aux arrays)` of a MaskMod / ScoreMod for the VJP (None, (): none); its
    aux JAX arrays (NumPy ones converted) of the dtypes and ranks it was traced with."""
    if mod is None:
        return None, ()
    if not isinstance(mod, cls):
        raise TypeError(f"{role} must be a varlen.{cls.__name__} or None, got "
                        f"{type(mod).__name__}")
    named = []
    for i, a in enumerate(mod.aux):
        name = f"{role} aux argument {i}"
        if isinstance(a, np.ndarray):
            a = jnp.asarray(a)
        elif not isinstance(a, jax.Array):
            raise TypeError(f"{name} is a {type(a).__module__}.{type(a).__name__}; "
                            f"varlen.jax takes aux arrays as JAX (or NumPy) arrays")
        named.append((name, a))
    check_together([("q", q), *named])
    aux = [a for _, a in named]
    for (name, a), (_, ndim, dtype) in zip(named, mod.graph.aux):
        if (a.ndim, _dtype_name(a)) == (ndim, dtype):
            continue
        if mod.fn is None:
            raise TypeError(f"{name} is a {a.ndim}-D {_dtype_name(a)} array but {role} was "
                            f"traced with a {ndim}-D {dtype} array; build it (or with_aux) "
                            f"with the arrays it runs on")
        # JAX's conversion changes 64-bit NumPy arrays without x64 (also on the way into
        # jax.jit): the function is traced again over the arrays it runs on.
        mod = cls(mod.fn, *aux)
        break
    return graph_text(mod.graph), tuple(aux)


def _sinks_operand(q, sinks):
    """`sinks` as a JAX array (NumPy converted) checked against q's shape without its values
    (None: none); the setup step checks the rest."""
    if sinks is None:
        return None
    if isinstance(sinks, np.ndarray):
        sinks = jnp.asarray(sinks)
    elif not isinstance(sinks, jax.Array):
        raise TypeError(f"sinks is a {type(sinks).__module__}.{type(sinks).__name__}; "
                        f"varlen.jax takes sinks as a float [Hq] JAX (or NumPy) array")
    if not _floating(sinks):
        raise TypeError(f"sinks must be a float array (one logit per query head), got "
                        f"{_dtype_name(sinks)}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape [Hq] = [{q.shape[1]}] (one logit per query "
                         f"head), got {list(sinks.shape)}")
    check_together([("q", q), ("sinks", sinks)])
    return sinks


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                     seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                     max_seqlen_q=None, max_seqlen_k=None, backend=None, deterministic=False,
                     plan=None, return_lse=False, score_mod=None, sinks=None, dropout_p=0.0,
                     dropout_rng=None, offset=0):
    """Attention over a packed variable-length batch, differentiable in q, k and v, in the
    float aux arrays of a `score_mod`, and in `sinks`.

    Works eagerly and under `jax.jit`, `jax.grad`, `jax.vjp` and `jax.vmap`; the metadata may be
    traced.

    Args:
        q: `[Tq, Hq, D]` JAX or NumPy array, float16, bfloat16, float32 (float64 on the CPU
            with x64 enabled).
        k: `[Tk, Hk, D]` array in q's dtype; `Hq % Hk == 0`, so that query head h reads key
            head `h // (Hq // Hk)` (GQA/MQA).
        v: `[Tk, Hk, Dv]` array in q's dtype.
        cu_seqlens_q, cu_seqlens_k: int32 `[B+1]` arrays, traced or not, beginning with 0 and
            non-decreasing: sequence b holds `Lq[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]`
            queries and `Lk[b]` keys, possibly none. Host arrays of wider integers must fit
            int32.
        seq_offsets_q, seq_offsets_k: optional int32 `[B+1]` arrays of first rows: sequence b
            covers rows `[off[b], off[b] + L[b])`; every other row is padding (output 0,
            gradient 0, never a key).
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask` with ints or
            int32/bool `[B]` arrays as fields (one policy per sequence; traced arrays are
            data). See `varlen.Mask` for what each query sees when Lq != Lk, drawn. Or a
            `varlen.MaskMod(fn, *aux)` (`Mask(...) & MaskMod(...)`): `fn(b, q_idx, k_idx,
            *aux)` says which pairs are visible, positions counted from each sequence's first
            row; aux are JAX (or NumPy) arrays, traced or not.
        softmax_scale: float multiplying `q @ k^T`; None means `1/sqrt(D)`.
        softcap: float; above 0 the scores become `softcap * tanh(scores / softcap)`.
        max_seqlen_q, max_seqlen_k: optional Python ints bounding the lengths.
        backend: `"numpy"`, `"cpu"`, `"numba"`, `"cupy"` or None (on the CPU `"cpu"` when its
            BLAS tile products are usable, else `"numpy"`, and `"numpy"` for float64; the
            fastest GPU backend on CUDA; docs/api.md).
        deterministic: bool, bitwise-repeatable backward.
        plan: optional `varlen.plan(...)` of this layout and mask, reused across calls and
            layers; a static argument (a new Plan object is a new trace under `jax.jit`).
        return_lse: return `(out, lse)` instead of `out`.
        score_mod: a `varlen.ScoreMod(fn, *aux)`: each visible pair's scaled (and softcapped)
            score becomes `fn(score, b, h, q_idx, k_idx, *aux)` before the softmax (-inf hides
            the pair). Its float aux arrays are differentiable (float32 accumulation, the
            gradient in the aux's dtype, computed only when differentiated); int and bool aux
            get float0 cotangents.
        sinks: optional float `[Hq]` JAX (or NumPy) array: attention sinks (gpt-oss), one
            logit per query head in every row's softmax with no value (not scaled, not
            soft-capped); differentiable (float32 accumulation, in its dtype).
        dropout_p: Python float in [0, 1) (static): attention dropout as in FlashAttention 2
            (each visible pair's probability dropped with probability `dropout_p`, the kept
            ones scaled by `1 / (1 - dropout_p)`; lse without dropout). 0.0 is exactly the
            path without dropout. Every backend runs it (on CUDA the device backends, which
            have not run on a GPU yet).
        dropout_rng: a `jax.random` key (`jax.random.key` or `jax.random.PRNGKey`, traced or
            not), required when `dropout_p > 0`: two uint32 words drawn from it inside the
            program are the 64-bit seed of `varlen.dropout` (`seed_of_words`), so the same key
            drops the same pairs on every backend that runs dropout, forward and backward
            (`varlen.reference.dropout_keep` with that seed gives them). Split it per step and
            per layer, as for any JAX randomness; under `jax.vmap` map the key too, or every
            element drops the same pairs.
        offset: Python int in [0, 2**32) (static), a stream index beside the seed.

    Returns:
        out: `[Tq, Hq, Dv]` in q's dtype.
        lse (with `return_lse=True`): `[Hq, Tq]` float32 (float64 for float64 inputs), the
            natural log of the sum of exp of each query's scores; `-inf` on padding rows and
            for queries that see no key (their output is 0, not NaN; with sinks their lse is
            `sinks[h]`). It has no gradient.

    MaskMod and ScoreMod are pytrees (their aux arrays the leaves, the traced function the
    structure, compared by the text of its graph), so they go into a jitted function as
    ordinary arguments: a new object of the same function each step, over new arrays of the
    same shapes and dtypes, reuses the trace. Built inside a jitted function from traced
    arrays they are traced with it. As `static_argnums` they hash by identity (each new
    object retraces, and its aux arrays become constants).

    Shape and dtype errors are raised while tracing. Value checks of the metadata (monotone
    `cu_seqlens`, offsets that fit) need the values: on concrete arrays the call raises the
    core API's error directly; under `jax.jit` the callback finds it and XLA raises it, once,
    inside its runtime error. On CUDA the value checks follow `varlen.set_validation` (off by
    default: no host synchronisation).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if isinstance(dropout_p, jax.core.Tracer) or isinstance(offset, jax.core.Tracer):
        raise TypeError("dropout_p and offset must be Python numbers (static arguments); got "
                        "a traced value: mark them static under jax.jit")
    dropout_p, _, offset = check_dropout(dropout_p, None, offset)
    words = _dropout_words(dropout_p, dropout_rng)
    mask, mask_mod = split_mask(mask)
    layout = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  seq_offsets_q=seq_offsets_q, seq_offsets_k=seq_offsets_k)
    batch = check_specs(q, k, v, *layout.values(), mask)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a varlen.Plan from varlen.plan(), got "
                        f"{type(plan).__name__}")
    mask_text, mask_aux = _mod_operands(q, mask_mod, MaskMod, "mask_mod")
    score_text, score_aux = _mod_operands(q, score_mod, ScoreMod, "score_mod")
    arrays, ints = mask.parts()
    static = _Static(ints, *static_scalars(softmax_scale, softcap, max_seqlen_q, max_seqlen_k,
                                           backend, deterministic), plan, mask_text,
                     score_text, dropout_p, offset)
    out, lse = _attention(static, q, k, v, _operands(layout, arrays, batch), mask_aux,
                          score_aux, _sinks_operand(q, sinks), words)
    lse = jax.lax.stop_gradient(lse)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# Context parallelism inside jax.shard_map: varlen.comm's methods with JAX collectives
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _CPStatic:
    """A context-parallel call's host metadata (hashed by identity): every rank's step plans,
    built once per partition and mask (the partition's cache), and the backend that runs them."""

    axis_name: object
    cp: int
    method: str
    steps: tuple                # steps[rank]: that rank's `varlen.comm.StepPlans`
    backend: object
    softmax_scale: float
    softcap: float
    deterministic: bool
    routes: tuple = ()          # ring over a document partition: a `_Route` per step
    score_mod: object = None    # a varlen.ScoreMod (its aux arrays travel as operands)
    has_mods: bool = False      # a mask_mod (in the step plans) or a score_mod
    valid: object = None        # with sinks: bool [cp, Tq_local], each rank's rows with a token
    # usp: (ring axis, Ulysses axis, u): the global rank is ring index * u + Ulysses index;
    # the node and ring parts are this static with `axis_name` and `cp` of their level
    levels: tuple | None = None
    traffic: list | None = None     # `stats=`: what the traces move, appended per call
    dropout: tuple | None = None    # dropout_p > 0: (p, offset); the seed is an operand

    @property
    def level(self) -> str:
        """The name `varlen.comm`'s counters give this static's axis."""
        if self.levels is None:
            return "flat"
        return "inter" if self.axis_name == self.levels[0] else "intra"

    @property
    def mesh_axes(self) -> frozenset:
        """Every mesh axis the call's shards vary over."""
        if self.levels is not None:
            return frozenset(self.levels[:2])
        return frozenset({self.axis_name})


class _Aux:
    """The score_mod's aux arrays in one forward or backward trace (operands of every kernel
    call), and in a backward the sum of the kernel calls' aux gradients on this rank
    (`want`: which aux arrays get one, the float ones); `seed`: the dropout seed's uint32[2]
    words (an operand of every kernel call too), None without dropout."""

    def __init__(self, values=(), want=None, seed=None):
        self.values = tuple(values)
        self.want = tuple(want) if want is not None else (False,) * len(self.values)
        self.grads = None
        self.seed = seed

    @property
    def operands(self) -> tuple:
        """What every kernel call takes besides its arrays: the aux values, the seed words."""
        return self.values + (() if self.seed is None else (self.seed,))

    def add(self, grads):
        self.grads = list(grads) if self.grads is None else [
            a + b for a, b in zip(self.grads, grads)]


def _acc(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _kernel(static: _CPStatic, ax: _Aux, index: int, backward: bool, *args):
    """Kernel call `index` of this rank's step plans (`args[-1]`: the rank, int32) on the host:
    forward `(out, lse)` of `(q, k, v)`, backward `(dq, dk, dv)` of `(dout, q, k, v, out,
    lse)`; the score_mod's aux arrays are further operands, and a backward adds their
    gradients into `ax`. The rank is traced, so the callback selects its plan; a step with
    nothing visible returns zeros (lse -inf) without a kernel call."""
    *args, rank = args
    grad_shapes = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32)
                        for a, w in zip(ax.values, ax.want) if w) if backward else ()
    if backward:
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args[1:4])
    else:
        q, _, v = args
        shapes = (jax.ShapeDtypeStruct(q.shape[:2] + v.shape[2:], q.dtype),
                  jax.ShapeDtypeStruct(q.shape[1::-1], _acc(q.dtype)))
    every = shapes + grad_shapes
    n = len(args)

    def fn(*arrays):
        arrays, aux, rank = list(arrays[:n]), arrays[n:-1], int(arrays[-1])
        if static.dropout is not None:
            aux, words = aux[:-1], aux[-1]
        steps = static.steps[rank]
        if not steps.busy[index]:
            return tuple(np.full(s.shape, -np.inf if i == 1 and not backward else 0, s.dtype)
                         for i, s in enumerate(every))
        plan = steps.plans[index]
        # A compact ring buffer has the step's largest size on every rank; this rank's plan
        # reads its first rows (a no-op for the other layouts).
        i_k = 2 if backward else 1
        arrays[i_k:i_k + 2] = (a[:plan.k.num_rows] for a in arrays[i_k:i_k + 2])
        kw = dict(softmax_scale=static.softmax_scale, softcap=static.softcap)
        if static.has_mods:
            kw["mods"] = _kernel_mods(static, steps, arrays[i_k - 1], aux, rank,
                                      bool(grad_shapes))
        if static.dropout is not None:
            kw["dropout"] = _kernel_dropout(static, words, arrays[i_k - 1], rank)
        if backward:
            results = static.backend.backward(plan, *arrays, **kw,
                                              deterministic=static.deterministic)
            if grad_shapes:
                results = results[:3] + tuple(g for g in results[3] if g is not None)
        else:
            results = static.backend.forward(plan, *arrays, **kw)
        return tuple(_rows_to(np.asarray(r, s.dtype), s) for r, s in zip(results, every))
    results = _host_call(fn, every)(*args, *ax.operands, rank)
    results = tuple(_vary(r, static.mesh_axes) for r in results)
    if grad_shapes:
        ax.add(results[3:])
    return results[:3] if backward else results


def _first_head(static, q, rank) -> int:
    """The global number of the kernel's first query head: under Ulysses a rank computes heads
    `[rank * h, (rank + 1) * h)` of q's `h` local ones (usp: its place in its node)."""
    if static.method == "ulysses":
        return rank * q.shape[1]
    return (rank % static.levels[2]) * q.shape[1] if static.method == "usp" else 0


def _kernel_mods(static, steps, q, aux, rank, aux_grads) -> Mods:
    """The kernel's `mods=`: the step plans' mask_mod, the score_mod over this call's aux
    values, its `h` global (`_first_head`)."""
    score = None if static.score_mod is None else static.score_mod.with_aux(
        [np.ascontiguousarray(a) for a in aux])
    return Mods(mask=steps.mask_mod, score=score,
                aux_grads=aux_grads).for_heads(_first_head(static, q, rank))


def _kernel_dropout(static, words, q, rank):
    """The kernel's `dropout=`: the call's p and offset, the seed of its traced words, the
    keep bits drawn at the global query head (`_first_head`)."""
    p, offset = static.dropout
    return Dropout(p, _seed(words), offset).for_heads(
        _first_head(static, q, rank))


def _rows_to(x, shape):
    """`x` with zero rows appended up to `shape` (gradients of a compact buffer's rows)."""
    if x.shape[0] == shape.shape[0]:
        return x
    full = np.zeros(shape.shape, shape.dtype)
    full[:x.shape[0]] = x
    return full


def _merge(out_a, lse_a, out_b, lse_b):
    """`varlen.comm.merge_partial` in JAX, in the accumulation dtype."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)        # [H, T], 0 for a -inf part
    total = wa + wb
    seen = total > 0
    safe = jnp.where(seen, total, 1)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    return out_a * (wa / safe).T[:, :, None] + out_b * (wb / safe).T[:, :, None], lse


def _rank(static):
    """This rank's number in the partition (under usp: ring index * u + Ulysses index)."""
    if static.levels is not None:
        ring, node, u = static.levels
        return (jax.lax.axis_index(ring) * u + jax.lax.axis_index(node)).astype(jnp.int32)
    return jax.lax.axis_index(static.axis_name).astype(jnp.int32)


def _nbytes(x) -> int:
    return int(math.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _count(static, sent, received=None) -> None:
    """Add to the current trace's record (`stats=`) what each rank sends and receives on
    `static`'s axis: ints (every rank alike) or per-rank lists of the cp of that axis, spread
    over the ranks of the whole partition (usp: each level's ranks)."""
    if static.traffic is None or not static.traffic:
        return
    record = static.traffic[-1]["ranks"]
    received = sent if received is None else received
    n = len(record)
    for r in range(n):
        i = r if static.levels is None else (r // static.levels[2] if static.level == "inter"
                                               else r % static.levels[2])
        s_ = sent[i] if isinstance(sent, list) else sent
        g_ = received[i] if isinstance(received, list) else received
        if s_ or g_:
            d = record[r].setdefault(static.level, {"sent": 0, "received": 0})
            d["sent"] += int(s_)
            d["received"] += int(g_)


def _hop(static, *xs):
    """Every array one hop along the ring: rank r sends to r+1, receives from r-1."""
    if static.cp > 1:
        _count(static, sum(_nbytes(x) for x in xs))
    perm = [(i, (i + 1) % static.cp) for i in range(static.cp)]
    return tuple(jax.lax.ppermute(x, static.axis_name, perm) for x in xs)


def _ring_forward(static, ax, q, k, v):
    out = lse = None
    for step in range(static.cp):             # K/V of rank (rank - step) % cp
        o, l = _kernel(static, ax, step, False, q, k, v, _rank(static))
        o = o.astype(_acc(q.dtype))
        out, lse = (o, l) if out is None else _merge(out, lse, o, l)
        if step + 1 < static.cp:
            k, v = _hop(static, k, v)
    return out.astype(q.dtype), lse


def _ring_backward(static, ax, dout, q, k, v, out, lse):
    # dQ accumulates here; the dK/dV accumulators travel one hop behind K/V and reach their
    # owners with the hop after the last step.
    acc = _acc(q.dtype)
    dq = jnp.zeros(q.shape, acc)
    dk = jnp.zeros(k.shape, acc)
    dv = jnp.zeros(v.shape, acc)
    for step in range(static.cp):
        dq_s, dk_s, dv_s = _kernel(static, ax, step, True, dout, q, k, v, out, lse,
                                   _rank(static))
        dq, dk, dv = dq + dq_s.astype(acc), dk + dk_s.astype(acc), dv + dv_s.astype(acc)
        if static.cp > 1:
            dk, dv = _hop(static, dk, dv)
            if step + 1 < static.cp:
                k, v = _hop(static, k, v)
    return dq, dk, dv


# Ring over a document partition: at step i rank r sends its rows of the documents it shares
# with rank (r + i) % cp (`DocumentPartition.ring_route`: one static [cp, n] table, this rank's
# row selected by `lax.axis_index`) and runs step i's plan on what it received from
# (r - i) % cp. Only sharing ranks exchange; a step where no rank shares is skipped. Backward
# sends each step's dK/dV of the received rows straight back, and the owner adds them in.

@dataclass(frozen=True, eq=False)
class _Route:
    """One step of the document ring: `rows[r]`, rank r's send rows (padded past its shard),
    and the `(sender, receiver)` pairs that exchange."""

    rows: np.ndarray
    pairs: tuple


def _routes(part) -> tuple:
    routes = []
    for step in range(part.cp_size):
        rows, counts = part.ring_route(step)
        pairs = tuple((r, (r + step) % part.cp_size) for r in range(part.cp_size) if counts[r])
        routes.append(_Route(rows, pairs))
    return tuple(routes)


def _my_rows(static, step):
    return jnp.asarray(static.routes[step].rows, jnp.int32)[_rank(static)]


def _doc_send(static, step, *xs):
    """Step `step`'s compact buffers: my shared rows gathered, sent to rank + step; returns
    what rank - step sent me (zeros where it sent nothing)."""
    rows, pairs = _my_rows(static, step), list(static.routes[step].pairs)
    _pair_count(static, pairs, sum(_nbytes(x) // x.shape[0] for x in xs) * rows.shape[0])
    return tuple(jax.lax.ppermute(jnp.take(x, rows, axis=0, mode="fill", fill_value=0),
                                  static.axis_name, pairs) for x in xs)


def _doc_ring_forward(static, ax, q, k, v):
    acc = _acc(q.dtype)
    out, lse = _kernel(static, ax, 0, False, q, k, v, _rank(static))
    out = out.astype(acc)
    for step in range(1, static.cp):
        if static.routes[step].pairs:
            o, l = _kernel(static, ax, step, False, q, *_doc_send(static, step, k, v),
                           _rank(static))
            out, lse = _merge(out, lse, o.astype(acc), l)
    return out, lse


def _doc_ring_backward(static, ax, dout, q, k, v, out, lse):
    acc = _acc(q.dtype)
    dq, dk, dv = (g.astype(acc) for g in _kernel(static, ax, 0, True, dout, q, k, v, out, lse,
                                                 _rank(static)))
    for step in range(1, static.cp):
        pairs = static.routes[step].pairs
        if not pairs:
            continue
        k_in, v_in = _doc_send(static, step, k, v)
        dq_s, dk_s, dv_s = _kernel(static, ax, step, True, dout, q, k_in, v_in, out, lse,
                                   _rank(static))
        dq = dq + dq_s.astype(acc)
        back = [(b, a) for a, b in pairs]            # the reverse route, to the rows' owner
        rows = _my_rows(static, step)
        _pair_count(static, back, _nbytes(dk_s.astype(acc)) + _nbytes(dv_s.astype(acc)))
        dk, dv = (d.at[rows].add(jax.lax.ppermute(g.astype(acc), static.axis_name, back),
                                 mode="drop") for d, g in ((dk, dk_s), (dv, dv_s)))
    return dq, dk, dv


def _pair_count(static, pairs, nbytes) -> None:
    """`_count` of a `ppermute` over `pairs` moving `nbytes` per sender."""
    sent = [0] * static.cp
    got = [0] * static.cp
    for a, b in pairs:
        sent[a] += nbytes
        got[b] += nbytes
    _count(static, sent, got)


def _a2a_count(static, x) -> None:
    """`_count` of an all-to-all (or reduce-scatter) of `x`: all but this rank's share."""
    _count(static, (static.cp - 1) * (_nbytes(x) // static.cp))


def _gather(static, x):
    """`[cp * T, ...]`: every rank's rows, rank-major (the gathered segments' layout)."""
    _count(static, (static.cp - 1) * _nbytes(x))
    return jax.lax.all_gather(x, static.axis_name, tiled=True)


def _allgather_forward(static, ax, q, k, v):
    return _kernel(static, ax, 0, False, q, _gather(static, k), _gather(static, v),
                   _rank(static))


def _allgather_backward(static, ax, dout, q, k, v, out, lse):
    dq, dk, dv = _kernel(static, ax, 0, True, dout, q, _gather(static, k), _gather(static, v),
                         out, lse, _rank(static))
    acc = _acc(q.dtype)
    for g in (dk, dv):
        _a2a_count(static, g.astype(acc))
    dk, dv = (jax.lax.psum_scatter(g.astype(acc), static.axis_name, tiled=True)
              for g in (dk, dv))
    return dq, dk, dv


def _to_heads(static, x, axis=1):
    """Sequence shard -> head shard: `[T, H, d]` -> `[cp * T, H / cp, d]` (`axis=1`), or lse
    `[H, T]` -> `[H / cp, cp * T]` (`axis=0`)."""
    _a2a_count(static, x)
    return jax.lax.all_to_all(x, static.axis_name, split_axis=axis, concat_axis=1 - axis,
                              tiled=True)


def _to_sequence(static, x, axis=1):
    """The inverse of `_to_heads`."""
    _a2a_count(static, x)
    return jax.lax.all_to_all(x, static.axis_name, split_axis=1 - axis, concat_axis=axis,
                              tiled=True)


def _kv_replicas(static, Hk):
    """Copies of each KV head that make the KV heads divisible by cp (GQA)."""
    return static.cp // math.gcd(Hk, static.cp)


def _ulysses_inputs(static, q, k, v):
    f = _kv_replicas(static, k.shape[1])
    # Copy j of head h becomes head h*f + j; query head h still reads a copy of h // G.
    k, v = jnp.repeat(k, f, axis=1), jnp.repeat(v, f, axis=1)
    return tuple(_to_heads(static, x) for x in (q, k, v)) + (f,)


def _ulysses_forward(static, ax, q, k, v):
    q, k, v, _ = _ulysses_inputs(static, q, k, v)
    out, lse = _kernel(static, ax, 0, False, q, k, v, _rank(static))
    return _to_sequence(static, out), _to_sequence(static, lse, axis=0)


def _ulysses_backward(static, ax, dout, q, k, v, out, lse):
    T, Hk = k.shape[:2]
    qh, kh, vh, f = _ulysses_inputs(static, q, k, v)
    grads = _kernel(static, ax, 0, True, _to_heads(static, dout), qh, kh, vh,
                    _to_heads(static, out), _to_heads(static, lse, axis=0), _rank(static))
    dq, dk, dv = (_to_sequence(static, g.astype(_acc(q.dtype))) for g in grads)
    return dq, dk.reshape(T, Hk, f, -1).sum(axis=2), dv.reshape(T, Hk, f, -1).sum(axis=2)


def _usp_levels(static):
    """`(node, ring)`: the static of the all-to-alls over the Ulysses axis (u ranks) and of the
    ring over the ring axis (cp / u groups)."""
    ring_axis, node_axis, u = static.levels
    return (replace(static, axis_name=node_axis, cp=u),
            replace(static, axis_name=ring_axis, cp=static.cp // u))


def _usp_forward(static, ax, q, k, v):
    node, ring = _usp_levels(static)
    qh, kh, vh, _ = _ulysses_inputs(node, q, k, v)
    out, lse = _ring_forward(ring, ax, qh, kh, vh)
    return _to_sequence(node, out), _to_sequence(node, lse, axis=0)


def _usp_backward(static, ax, dout, q, k, v, out, lse):
    T, Hk = k.shape[:2]
    node, ring = _usp_levels(static)
    qh, kh, vh, f = _ulysses_inputs(node, q, k, v)
    grads = _ring_backward(ring, ax, _to_heads(node, dout), qh, kh, vh, _to_heads(node, out),
                           _to_heads(node, lse, axis=0))
    dq, dk, dv = (_to_sequence(node, g.astype(_acc(q.dtype))) for g in grads)
    return dq, dk.reshape(T, Hk, f, -1).sum(axis=2), dv.reshape(T, Hk, f, -1).sum(axis=2)


_CP_FORWARD = {"ring": _ring_forward, "allgather": _allgather_forward,
               "ulysses": _ulysses_forward, "usp": _usp_forward}
_CP_BACKWARD = {"ring": _ring_backward, "allgather": _allgather_backward,
                "ulysses": _ulysses_backward, "usp": _usp_backward}


def _record(static, call: str) -> None:
    """Open the `stats=` record of one traced call (forward or backward)."""
    if static.traffic is not None:
        static.traffic.append({"call": call, "ranks": [{} for _ in range(static.cp)]})


def _cp_forward(static, q, k, v, aux, sinks, seed):
    _record(static, "forward")
    forward = _doc_ring_forward if static.routes else _CP_FORWARD[static.method]
    out, lse = forward(static, _Aux(aux, seed=seed), q, k, v)
    out = out.astype(q.dtype)
    if sinks is not None:       # once per row, after the last merge
        out, lse = add_sinks(out, lse, sinks.astype(_acc(q.dtype)), _valid_rows(static), jnp)
    return out, lse


def _valid_rows(static):
    return jnp.asarray(static.valid)[_rank(static)]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cp_attention(static, q, k, v, aux, sinks, seed):
    return _cp_forward(static, q, k, v, aux, sinks, seed)


def _cp_attention_fwd(static, q, k, v, aux, sinks, seed):
    out, lse = _cp_forward(static, q, k, v, aux, sinks, seed)
    return (out, lse), (q, k, v, out, lse, aux, sinks, seed)


def _is_float(x) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.floating))


def _aux_cotangents(static, aux, ax: _Aux) -> tuple:
    """Each aux array's cotangent: this rank's share of its gradient where the aux varies
    over the mesh axis, the shares summed over the axis (`psum`) where it is replicated (as
    JAX's transpose of a replicated value does); float0 zeros for int and bool aux."""
    grads = iter(ax.grads or ())
    out = []
    for a, want in zip(aux, ax.want):
        if not want:
            out.append(_float0_like(a))
            continue
        g = next(grads).astype(a.dtype)
        axes = _varying_axes(a)
        missing = tuple(sorted(static.mesh_axes - axes))
        if missing:
            g = jax.lax.psum(g, missing)
        out.append(_vary(g, axes))
    return tuple(out)


def _cp_attention_bwd(static, residuals, cotangents):
    _record(static, "backward")
    q, k, v, out, lse, aux, sinks, seed = residuals
    dout, _ = cotangents        # lse is behind a stop_gradient: its cotangent is zero
    backward = _doc_ring_backward if static.routes else _CP_BACKWARD[static.method]
    ax = _Aux(aux, want=tuple(_is_float(a) for a in aux), seed=seed)
    grads = backward(static, ax, dout, q, k, v, out, lse)
    grads = tuple(_vary(g.astype(x.dtype), _varying_axes(x)) for g, x in zip(grads, (q, k, v)))
    dsinks = None
    if sinks is not None:       # this rank's rows' share; summed where sinks is replicated
        dsinks = sink_grads(dout, out, lse, sinks.astype(_acc(q.dtype)), _valid_rows(static),
                            jnp).astype(sinks.dtype)
        axes = _varying_axes(sinks)
        missing = tuple(sorted(static.mesh_axes - axes))
        if missing:
            dsinks = jax.lax.psum(dsinks, missing)
        dsinks = _vary(dsinks, axes)
    return grads + (_aux_cotangents(static, aux, ax), dsinks,
                    None if seed is None else _float0_like(seed))


_cp_attention.defvjp(_cp_attention_fwd, _cp_attention_bwd)


def _mesh_levels(method, axis_name, ulysses_size):
    """usp's `(ring axis, Ulysses axis)` from `axis_name`, a pair of mesh axis names (None
    for the other methods, which take one)."""
    if method != "usp":
        if ulysses_size is not None:
            raise ValueError(f"ulysses_size={ulysses_size!r} is for method='usp'; method="
                             f"{method!r} takes none")
        return None
    if not (isinstance(axis_name, (tuple, list)) and len(axis_name) == 2):
        raise ValueError(f"method='usp' needs axis_name=(ring axis, Ulysses axis): two mesh "
                         f"axis names, the Ulysses one the ranks of a node; got {axis_name!r}")
    return tuple(axis_name)


def context_parallel_attention(q, k, v, part, *, axis_name, mask="full", softmax_scale=None,
                               softcap=0.0, method="ring", deterministic=False,
                               return_lse=False, score_mod=None, sinks=None,
                               ulysses_size=None, stats=None, dropout_p=0.0, dropout_rng=None,
                               offset=0):
    """Context-parallel attention inside `jax.shard_map`, differentiable in this device's shards
    (and in `sinks` and a score_mod's float aux arrays).

    Call it in a function mapped by `jax.shard_map` over mesh axis `axis_name` of size
    `part.cp_size`, with q, k, v split evenly along rows by `P(axis_name)`: the global arrays
    are the concatenation over ranks of `part.shard(x, r)`, and device r of the axis holds shard
    r. Works under `jax.jit` and `jax.grad` with shard_map's default checks.

        part = varlen.comm.partition(cu_seqlens, cp)                 # once per batch layout
        q_g = jnp.concatenate([part.shard(q, r) for r in range(cp)])  # likewise k, v
        f = jax.shard_map(lambda q, k, v: context_parallel_attention(q, k, v, part,
                          axis_name="cp", mask="causal"), mesh=mesh,
                          in_specs=(P("cp"),) * 3, out_specs=P("cp"))

    Args:
        q: `[Tq_local, Hq, D]`, this device's shard (inside shard_map), float16, bfloat16,
            float32 (float64 with x64 enabled).
        k, v: `[Tk_local, Hk, D]` and `[Tk_local, Hk, Dv]` shards in q's dtype; `Hq % Hk == 0`.
        part: a host `varlen.comm.partition(cu_seqlens, cp_size, scheme)`, any scheme
            (zigzag, contiguous or document), a static argument.
        axis_name: the shard_map mesh axis of size `part.cp_size`.
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask` whose
            per-sequence fields are ints or host `[B]` arrays (not traced), or a
            `varlen.MaskMod` (or `Mask & MaskMod`) whose aux arrays are host values (the plans
            classify their tiles on the host); positions are global.
        softmax_scale: default `1/sqrt(D)`. softcap: as in `varlen_attention`.
        score_mod: a `varlen.ScoreMod`; its aux arrays may be traced (they are operands of
            every kernel call) and its float ones are differentiable: a replicated aux (e.g.
            `P()` or closed over) gets the whole gradient (its shares `psum`med over
            `axis_name`), one that varies over the axis its rank's share. The functions see
            single-process coordinates: `b` the batch's sequence, `q_idx`/`k_idx` positions in
            the whole sequence, `h` the global query head (under Ulysses too).
        sinks: optional float `[Hq]` array, as in `varlen_attention` (the same on every rank:
            replicated, `P()` or closed over, it gets the whole gradient, `psum`med over
            `axis_name`); each row's sink enters once, after the last merge.
        dropout_p: float in [0, 1): attention dropout (FlashAttention 2's; the single-process
            keep rule, docs/semantics.md "Dropout"): every kernel call draws each pair's keep
            bit at its single-process coordinates, so the shards hold the single-process
            result for the same key. dropout_rng: a `jax.random` key, required with
            `dropout_p > 0`, the same on every device (replicated: `P()` or closed over; one
            that varies over the call's mesh axes is refused); the seed is two words drawn from
            it in the traced program, so every step of a jitted loop with a new key drops new
            pairs. offset: int in [0, 2**32), as in `varlen.attention_forward`.
        method: `"ring"` (K/V travel the ring with `lax.ppermute`, partial results merge
            through their LSE; dK/dV travel one hop behind and reach their owners last; on a
            document partition only the rows of split documents travel, between the ranks
            that share them, and their dK/dV go straight back),
            `"allgather"` (K/V `all_gather`ed once, dK/dV `psum_scatter`ed back) or
            `"ulysses"` (`all_to_all` from sequence to head shards and back; `Hq % cp_size
            == 0`, KV heads replicated when `Hk` does not divide by cp), or
            `"usp"` over a 2-D mesh, `axis_name=(ring_axis, ulysses_axis)`: `all_to_all` over
            heads along `ulysses_axis` (a node's devices), the ring along `ring_axis`; rank
            `g * u + i` of the partition is device `(g, i)`: shard q, k, v's rows with
            `P((ring_axis, ulysses_axis))`; `Hq` divides by the Ulysses axis' size u.
        deterministic: bitwise-repeatable backward.
        return_lse: return `(out, lse)` instead of `out`.
        ulysses_size: with `method="usp"`, optional: the size of the Ulysses axis (checked).
        stats: a list to which each trace of the call appends what it moves:
            `{"call": "forward" | "backward", "ranks": [per rank {level: {"sent": bytes,
            "received": bytes}}]}`, counted as `varlen.comm`'s groups count (levels `"flat"`,
            `"intra"`, `"inter"`); the shapes are static, so every run of a trace moves what
            its record says. The gradient `psum`s of replicated sinks or aux arrays are not
            counted. A document ring's buffers have the step's largest size on every rank.

    Returns:
        out: `[Tq_local, Hq, Dv]` in q's dtype, typed varying over `axis_name`; lse (with
        `return_lse=True`): `[Hq, Tq_local]` float32 (float64 for float64), no gradient. Pad
        rows get 0 and -inf.

    Every rank's step plans come from the partition's cache (built once per partition, mask
    and tile size, reused by every layer, forward and backward); the kernels run on the host
    through `jax.pure_callback` (one call per ring step, one for the other methods), each
    selecting its rank's plan by `lax.axis_index(axis_name)`. A document ring's buffers have
    one static shape per step on every rank (the step's largest send); a step where no two
    ranks share a document has no collective and no kernel call.
    """
    import varlen.comm as vc

    from . import backends

    if method not in vc.METHODS + vc.TWO_LEVEL_METHODS:
        raise ValueError(f"method must be one of {', '.join(vc.METHODS + vc.TWO_LEVEL_METHODS)}"
                         f", got {method!r}")
    levels = _mesh_levels(method, axis_name, ulysses_size)
    if not isinstance(part, vc.Partition):
        raise TypeError(f"part must be a varlen.comm.Partition, got {type(part).__name__}")
    if part.xp is not np:
        raise ValueError("part must be built from host cu_seqlens")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX array, got {type(x).__name__}")
    check_qkv(q, k, v)                  # ranks, heads, head dims, dtypes: data-free
    base, mask_mod = split_mask(mask)
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a varlen.ScoreMod or None, got "
                        f"{type(score_mod).__name__}")
    if any(isinstance(f, jax.core.Tracer) for f in base.fields()) or mask_mod is not None and \
            any(isinstance(a, jax.core.Tracer) for a in mask_mod.aux):
        raise TypeError("mask arrays (and a mask_mod's aux arrays) must be host values (the "
                        "step plans are built on the host), got a traced array")
    base = Mask(*(f if isinstance(f, (int, np.integer)) else np.asarray(f)
                  for f in base.fields()))
    if mask_mod is not None:
        mask_mod = mask_mod.with_aux([np.asarray(a) for a in mask_mod.aux])
        mask_mod.base = base
    mask = base if mask_mod is None else mask_mod
    # the mesh first: shards of a mesh of another size have other row counts
    size = math.prod(jax.lax.axis_size(a) for a in (levels[:2] if levels else (axis_name,)))
    if size != part.cp_size:
        raise ValueError(f"mesh axis {axis_name!r} has size {size} but "
                         f"part.cp_size={part.cp_size}; shard over a mesh axis of the "
                         f"partition's size")
    if levels is not None:
        u = jax.lax.axis_size(levels[1])
        if ulysses_size is not None and ulysses_size != u:
            raise ValueError(f"ulysses_size={ulysses_size} but the Ulysses axis "
                             f"{levels[1]!r} has size {u}")
        check_ulysses_size("usp", u, part.cp_size, int(q.shape[1]))
        levels = (levels[0], levels[1], u)
    rows = part.local_rows
    if q.shape[0] != rows or k.shape[0] != rows or v.shape[0] != rows:
        raise ValueError(f"{q.shape=}, {k.shape=} and {v.shape=}: shards must have "
                         f"part.local_rows={rows} rows (inside shard_map over {axis_name!r})")
    if method == "ulysses" and q.shape[1] % part.cp_size:
        raise ValueError(f"method='ulysses' needs Hq divisible by cp_size: {q.shape=}, "
                         f"cp_size={part.cp_size}")
    dtype = np.dtype(q.dtype).name
    D, Dv = int(q.shape[2]), int(v.shape[2])
    aux = () if score_mod is None else tuple(jnp.asarray(a) for a in score_mod.aux)
    p, _, offset = check_dropout(dropout_p, None, offset)
    seed = _dropout_words(p, dropout_rng)
    steps = tuple(vc.plan(part, r, dtype=dtype, head_dim=D, head_dim_v=Dv, mask=mask,
                          method=method, on_device=False, score_mod=score_mod,
                          aux_grads=any(map(_is_float, aux)),
                          ulysses_size=None if levels is None else levels[2], dropout_p=p)
                  for r in range(part.cp_size))
    scale, softcap = scale_and_softcap(softmax_scale, softcap, D)
    routes = _routes(part) if method == "ring" and part.scheme == "document" else ()
    static = _CPStatic(axis_name, part.cp_size, method, steps, backends.get(steps[0].backend),
                       scale, softcap, bool(deterministic), routes,
                       None if score_mod is None else score_mod.with_aux(()),
                       has_mods=mask_mod is not None or score_mod is not None,
                       valid=None if sinks is None else np.stack(
                           [np.asarray(part.valid(r)) for r in range(part.cp_size)]),
                       levels=levels, traffic=stats,
                       dropout=None if seed is None else (p, offset))
    if seed is not None:
        varying = sorted(map(str, _varying_axes(seed) & static.mesh_axes))
        if varying:
            raise ValueError(f"dropout_rng varies over the mesh axes {', '.join(varying)}: "
                             f"every rank must draw the same keep bits (the single-process "
                             f"ones); pass a key that is the same on every device (P() or "
                             f"closed over)")
    out, lse = _cp_attention(static, q, k, v, aux, _sinks_operand(q, sinks), seed)
    lse = jax.lax.stop_gradient(lse)
    return (out, lse) if return_lse else out
