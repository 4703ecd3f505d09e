"""JAX adapter: `varlen_attention` with a `jax.custom_vjp`, usable under `jax.jit` and `jax.grad`.

    import varlen.jax
    out = varlen.jax.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, mask="causal")

Forward and backward are each one opaque call chosen by platform when the computation is
lowered (`jax.lax.platform_dependent`):

* CPU (and any platform without CUDA): `jax.pure_callback` hands NumPy views of the operands to
  `varlen.attention_forward` / `varlen.attention_backward` (NumPy backend by default).
* CUDA: `jax.experimental.buffer_callback` hands XLA's device buffers and stream to the callback;
  the operands become CuPy arrays through DLPack on that stream, the GPU backend runs on it, and
  the results are copied into XLA's output buffers on it. Nothing waits on the host.

The adapter holds no attention math. Metadata (`cu_seqlens`, offsets, per-sequence mask arrays)
travels as integer operands of the custom VJP and gets `float0` (zero) cotangents; the scalar
settings are a hashable static argument. See `docs/frameworks.md`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ._api import attention_backward, attention_forward
from ._setup import static_scalars
from ._validate import check_qkv
from .masks import Mask, as_mask

__all__ = ["varlen_attention"]

_MASK_FIELDS = ("window_left", "window_right", "bottom_right")


@dataclass(frozen=True)
class _Static:
    """Everything of a call that is not an array: hashable, a static argument of the VJP."""

    mask_ints: tuple            # (window_left, window_right, bottom_right) where no array is given
    softmax_scale: float | None
    softcap: float
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    backend: str | None
    deterministic: bool

    def keywords(self, meta):
        """The keyword arguments of the core API for metadata `meta` (working arrays)."""
        _, _, off_q, off_k, *mask_arrays = meta
        mask = Mask(*(s if a is None else a for a, s in zip(mask_arrays, self.mask_ints)))
        return dict(seq_offsets_q=off_q, seq_offsets_k=off_k, mask=mask,
                    softmax_scale=self.softmax_scale, softcap=self.softcap,
                    max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
                    backend=self.backend)


# --------------------------------------------------------------------------------------------
# Host and device calls of the core API
# --------------------------------------------------------------------------------------------

def _host_call(fn, result_shapes):
    """`fn(*numpy arrays) -> numpy arrays` as a JAX computation on the host."""
    def run(*args):
        def call(*arrays):
            return tuple(np.asarray(r) for r in fn(*arrays))
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


# Set by the tests to route CPU computations through `_buffer_call` as well.
_CPU_BUFFER_PATH = False


def _dispatch(fn, result_shapes, *args):
    """Run `fn` on the platform the computation is lowered for."""
    host = _buffer_call(fn, result_shapes, "cpu") if _CPU_BUFFER_PATH else _host_call(
        fn, result_shapes)
    # Every branch is traced; only the one for the lowering platform is compiled.
    return jax.lax.platform_dependent(*args, cpu=host,
                                      cuda=_buffer_call(fn, result_shapes, "cuda"),
                                      default=host)


def _forward(static: _Static, q, k, v, meta):
    Tq, Hq, _ = q.shape
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    shapes = (jax.ShapeDtypeStruct((Tq, Hq, v.shape[2]), q.dtype),
              jax.ShapeDtypeStruct((Hq, Tq), lse_dtype))

    def fn(q, k, v, meta):
        return attention_forward(q, k, v, meta[0], meta[1], **static.keywords(meta))
    return _dispatch(fn, shapes, q, k, v, meta)


def _backward(static: _Static, dout, q, k, v, out, lse, meta):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))

    def fn(dout, q, k, v, out, lse, meta):
        return attention_backward(dout, q, k, v, out, lse, meta[0], meta[1],
                                  **static.keywords(meta), deterministic=static.deterministic)
    return _dispatch(fn, shapes, dout, q, k, v, out, lse, meta)


# --------------------------------------------------------------------------------------------
# The custom VJP
# --------------------------------------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, meta):
    return _forward(static, q, k, v, meta)


def _attention_fwd(static, q, k, v, meta):
    out, lse = _forward(static, q, k, v, meta)
    return (out, lse), (q, k, v, out, lse, meta)


def _float0_like(x):
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _attention_bwd(static, residuals, cotangents):
    q, k, v, out, lse, meta = residuals
    dout, _ = cotangents        # lse is behind a stop_gradient: its cotangent is zero
    dq, dk, dv = _backward(static, dout, q, k, v, out, lse, meta)
    return dq, dk, dv, jax.tree.map(_float0_like, meta)


_attention.defvjp(_attention_fwd, _attention_bwd)


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------

def _index_array(x, name: str, length=None):
    """An int32 1-D metadata array (shape and dtype checks only: values may be traced)."""
    if x is None:
        return None
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    if np.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), got dtype {x.dtype}")
    if np.ndim(x) != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {tuple(np.shape(x))}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} has {x.shape[0]} entries; expected {length}")
    return jnp.asarray(x, dtype=jnp.int32)


def _mask_args(mask, batch: int):
    """`mask` as three optional int32 arrays and three static ints (an array overrides)."""
    m = as_mask(mask)
    arrays, scalars = [], []
    for name, f in zip(_MASK_FIELDS, m.fields()):
        if isinstance(f, (bool, int, np.integer, np.bool_)):
            arrays.append(None)
            scalars.append(int(f))
            continue
        if not hasattr(f, "dtype"):
            f = np.asarray(f)
        if np.ndim(f) == 0 and not isinstance(f, jax.core.Tracer):
            arrays.append(None)
            scalars.append(int(f))
            continue
        if np.ndim(f) > 1 or (np.ndim(f) == 1 and f.shape[0] != batch):
            raise ValueError(f"mask.{name} has shape {tuple(np.shape(f))}; expected a scalar "
                             f"or [{batch}] (one entry per sequence)")
        if np.dtype(f.dtype).kind not in "iub":
            raise TypeError(f"mask.{name} must be int32 or bool, got dtype {f.dtype}")
        arrays.append(jnp.asarray(f).astype(jnp.int32))
        scalars.append(0)
    return arrays, tuple(scalars)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                     seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                     max_seqlen_q=None, max_seqlen_k=None, backend=None, deterministic=False,
                     return_lse=False):
    """Attention over a packed variable-length batch, differentiable in q, k and v.

    Works eagerly and under `jax.jit`, `jax.grad` and `jax.vjp`; the metadata may be traced.

    Args:
        q: `[Tq, Hq, D]` float16, bfloat16, float32 (float64 on the CPU, with x64 enabled).
        k: `[Tk, Hk, D]`, q's dtype; `Hq % Hk == 0` (query head h reads key head
            `h // (Hq // Hk)`: GQA/MQA).
        v: `[Tk, Hk, Dv]`, q's dtype.
        cu_seqlens_q, cu_seqlens_k: int32 `[B+1]`, start at 0, non-decreasing; sequence b has
            `Lq[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]` queries (`Lk[b]` keys). Zero lengths
            are legal.
        seq_offsets_q, seq_offsets_k: optional int32 `[B+1]`; sequence b occupies rows
            `[off[b], off[b] + L[b])`. Rows outside every sequence are padding: output 0,
            gradient 0, never a key.
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask` whose fields are
            Python ints or int32/bool `[B]` arrays (one policy per sequence). Query i sees
            key j iff `(left < 0 or j >= i + s - left) and (right < 0 or j <= i + s + right)`
            with `s = Lk - Lq` when bottom_right else 0. For Lq=2, Lk=5, causal::

                top-left (s=0)     bottom-right (s=3)
                x . . . .          x x x x .
                x x . . .          x x x x x

        softmax_scale: float, scale of `q @ k^T`; default `1/sqrt(D)`.
        softcap: float; if > 0, scores become `softcap * tanh(scores / softcap)`.
        max_seqlen_q, max_seqlen_k: optional host ints bounding the lengths.
        backend: `"numpy"`, `"numba"`, `"cupy"` or None (NumPy on the CPU, the fastest GPU
            backend on CUDA).
        deterministic: bool, bitwise-repeatable backward.
        return_lse: also return the log-sum-exp.

    Returns:
        out: `[Tq, Hq, Dv]` in q's dtype.
        lse (with `return_lse=True`): `[Hq, Tq]` natural-log sum of exp of the scores, float32
            (float64 for float64 inputs); `-inf` for padding rows and for queries with no
            visible key (whose output is 0, never NaN). It carries no gradient.

    Value checks of the metadata (monotone `cu_seqlens`, offsets that fit) run inside the
    callback on the CPU and surface as a runtime error carrying the core API's message; on CUDA
    they follow `varlen.set_validation` (off by default: no host synchronisation).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v)
    cu_q = _index_array(cu_seqlens_q, "cu_seqlens_q")
    n = cu_q.shape[0]
    if n == 0:
        raise ValueError("cu_seqlens_q is empty; expected [B+1] entries starting at 0")
    cu_k = _index_array(cu_seqlens_k, "cu_seqlens_k")
    if cu_k.shape[0] != n:
        raise ValueError(f"cu_seqlens_q has {n} entries and cu_seqlens_k {cu_k.shape[0]}; "
                         f"both must be [B+1] for the same B")
    off_q = _index_array(seq_offsets_q, "seq_offsets_q", n)
    off_k = _index_array(seq_offsets_k, "seq_offsets_k", n)
    mask_arrays, mask_ints = _mask_args(mask, n - 1)
    softmax_scale, softcap, max_seqlen_q, max_seqlen_k, backend, deterministic = static_scalars(
        softmax_scale, softcap, max_seqlen_q, max_seqlen_k, backend, deterministic)
    static = _Static(mask_ints, softmax_scale, float(softcap), max_seqlen_q, max_seqlen_k,
                     backend, bool(deterministic))
    meta = (cu_q, cu_k, off_q, off_k, *mask_arrays)
    out, lse = _attention(static, q, k, v, meta)
    lse = jax.lax.stop_gradient(lse)
    return (out, lse) if return_lse else out
