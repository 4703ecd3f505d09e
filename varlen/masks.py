"""Mask policies, per sequence, and the sync-free mask builders.

Visibility (DESIGN.md, "Semantics"): with `s = Lk - Lq` if `bottom_right` else `0`, query at
global position `i` sees key at global position `j` iff

    (left < 0 or j >= i + s - left) and (right < 0 or j <= i + s + right)

Every field of a `Mask` is a scalar or a `[B]` array; negative windows mean unbounded.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validate import check_policy, is_policy_scalar, policy_value

__all__ = ["Mask", "as_mask", "visible", "key_band", "query_band", "padding_mask",
           "dense_mask", "MASK_NAMES", "MASK_FIELDS"]

MASK_NAMES = ("full", "causal", "causal_bottom_right")
# The fields of a mask policy, in the order of `Mask.fields()`, kernel arguments and op schemas.
MASK_FIELDS = ("window_left", "window_right", "bottom_right")


@dataclass(frozen=True, eq=False)
class Mask:
    """A per-sequence attention mask policy.

    Args:
        window_left: keys allowed to the left of the (aligned) diagonal; -1 = unbounded.
            int or int32 `[B]` array.
        window_right: keys allowed to the right of the diagonal; -1 = unbounded, 0 = causal.
            int or int32 `[B]` array.
        bottom_right: align the diagonal with the bottom-right corner (`s = Lk - Lq`) instead of
            the top-left (`s = 0`). bool or bool/int32 `[B]` array.

    Query i of a sequence sees its key j iff `(left < 0 or j >= i + s - left) and (right < 0 or
    j <= i + s + right)`, where `s = Lk - Lq` with bottom_right and 0 without (i, j count from
    the sequence's first row). Three masks of a sequence with Lq=3 and Lk=5::

        Mask(window_right=0)    Mask(-1, 0, True)    Mask(1, 0, True)
        x . . . .               x x x . .            . x x . .
        x x . . .               x x x x .            . . x x .
        x x x . .               x x x x x            . . . x x

    Examples: full `Mask()`, causal `Mask(window_right=0)`, sliding causal of width 128
    `Mask(window_left=128, window_right=0)`, per-sequence causal
    `Mask.causal_where(is_causal)`.

    Scalars are checked and normalised here: windows become ints, with every negative window
    and every window past int32 (`>= 2**31`, which no int32 position can reach) stored as -1
    (unbounded); `bottom_right` becomes a bool and must be True/False or 0/1. Floats (NaN
    included) are a TypeError, never truncated. Arrays must be int or bool, 0-d or `[B]`
    (checked without reading them, so device arrays and traced values work); their values are
    normalised the same way when a call uses them.
    """

    window_left: object = -1
    window_right: object = -1
    bottom_right: object = False

    def __post_init__(self):
        for name, f in self.items():
            if isinstance(f, np.ndarray) and f.ndim == 0:      # a host scalar in an array
                check_policy(f, name)
                f = f[()]
            if is_policy_scalar(f):
                v = policy_value(name, f)
                object.__setattr__(self, name, bool(v) if name == "bottom_right" else v)
            else:
                check_policy(f, name)

    @classmethod
    def named(cls, name: str) -> "Mask":
        if name == "full":
            return cls(-1, -1, False)
        if name == "causal":
            return cls(-1, 0, False)
        if name == "causal_bottom_right":
            return cls(-1, 0, True)
        raise ValueError(f"mask={name!r} is not a known mask name; expected one of "
                         f"{', '.join(map(repr, MASK_NAMES))} or a varlen.Mask")

    @classmethod
    def causal_where(cls, is_causal, *, window_left=-1, bottom_right=False) -> "Mask":
        """Causal where `is_causal[b]` is true, bidirectional elsewhere (seeds/003).

        Built with the array's own module, so a device array stays on the device.
        """
        xp = _namespace(is_causal)
        right = xp.where(is_causal, 0, -1)
        right = right.to(xp.int32) if _is_torch(right) else right.astype(np.int32)
        return cls(window_left, right, bottom_right)

    @classmethod
    def from_parts(cls, arrays, ints) -> "Mask":
        """The inverse of `parts`: per field, the array where one is given, else the int."""
        return cls(*(i if a is None else a for a, i in zip(arrays, ints)))

    def parts(self) -> tuple[tuple, tuple]:
        """The mask split for an op schema or a trace: per field, the array (None for a scalar)
        and the int (0 where the array is given). `from_parts` puts it back together."""
        arrays = tuple(None if is_policy_scalar(f) else f for f in self.fields())
        ints = tuple(0 if a is not None else int(f) for a, f in zip(arrays, self.fields()))
        return arrays, ints

    def fields(self):
        return self.window_left, self.window_right, self.bottom_right

    def items(self):
        """`(name, field)` pairs in the order of `MASK_FIELDS`."""
        return tuple(zip(MASK_FIELDS, self.fields()))

    def is_uniform(self) -> bool:
        """True when every field is a scalar (one policy for the whole batch)."""
        return all(_is_scalar(f) for f in self.fields())

    def __repr__(self):
        def show(f):
            return repr(f) if _is_scalar(f) else f"<{list(np.shape(f))} array>"
        return (f"Mask(window_left={show(self.window_left)}, window_right={show(self.window_right)}"
                f", bottom_right={show(self.bottom_right)})")


def _is_scalar(f) -> bool:
    return isinstance(f, (bool, int, np.integer, np.bool_)) or (
        isinstance(f, np.ndarray) and f.ndim == 0)


def as_mask(mask) -> Mask:
    """Normalise the `mask` argument of the public API into a `Mask`."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, str):
        return Mask.named(mask)
    if mask is None:
        return Mask()
    if type(mask).__name__ == "MaskMod":
        raise TypeError("mask is a varlen.MaskMod, which this entry point does not take; pass "
                        "a mask name or a varlen.Mask here")
    raise TypeError(f"mask must be a mask name ({', '.join(map(repr, MASK_NAMES))}) or a "
                    f"varlen.Mask, got {type(mask).__name__}")


def visible(i, j, lq, lk, left, right, bottom_right):
    """The visibility predicate, elementwise and broadcasting, in any array module.

    `i`, `j` are global query/key positions; `lq`, `lk` global lengths (only used when
    `bottom_right`); `left`, `right`, `bottom_right` the policy. Positions outside `[0, L)` are
    not excluded here; the callers bound them. The one Python statement of the predicate:
    `key_band` and `query_band` are its interval forms.
    """
    s = (lk - lq) * bottom_right
    ok_left = (left < 0) | (j >= i + s - left)
    ok_right = (right < 0) | (j <= i + s + right)
    return ok_left & ok_right


# Stands for an unbounded band edge in int64 position arithmetic (far beyond any int32 row).
UNBOUNDED = 1 << 40


def key_band(xp, i, shift, left, right):
    """`(lo, hi)`: query position `i` sees exactly the keys `lo <= j <= hi` (`visible` as an
    interval; `shift = (lk - lq) * bottom_right`; unbounded edges are +-UNBOUNDED)."""
    lo = xp.where(left < 0, -UNBOUNDED, i + shift - left)
    hi = xp.where(right < 0, UNBOUNDED, i + shift + right)
    return lo, hi


def query_band(xp, j, shift, left, right):
    """`(lo, hi)`: key position `j` is seen by exactly the queries `lo <= i <= hi`."""
    lo = xp.where(right < 0, -UNBOUNDED, j - shift - right)
    hi = xp.where(left < 0, UNBOUNDED, j - shift + left)
    return lo, hi


# --------------------------------------------------------------------------------------------
# Sync-free dense mask builders (seeds/004)
# --------------------------------------------------------------------------------------------

def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _namespace(x):
    """The array module of `x`: numpy, cupy, torch or jax.numpy (no import of the others)."""
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        import cupy
        return cupy
    if mod == "torch":
        import torch
        return torch
    if mod in ("jax", "jaxlib"):
        import jax.numpy as jnp
        return jnp
    return np


def _arange(xp, n, like):
    if xp is np:
        return np.arange(n)
    if _is_torch(like):
        return xp.arange(n, device=like.device)
    return xp.arange(n)


def _per_seq(xp, f, batch_size, like, name):
    """A policy field as a `[B, 1, 1]` array (or a scalar) in the namespace of `like`."""
    if _is_scalar(f):
        return int(f)
    if _namespace(f) is not xp:
        raise TypeError(f"mask.{name} is a {type(f).__module__} array but cu_seqlens is a "
                        f"{type(like).__module__} array; pass both from one framework")
    if f.shape[0] != batch_size:
        raise ValueError(f"mask.{name} has shape {tuple(f.shape)}; expected [{batch_size}] "
                         f"(one entry per sequence)")
    f = f[:batch_size]
    if _is_torch(f):
        f = f.to(xp.int64)
    else:
        f = f.astype(np.int64)
    return f[:, None, None]


def _lengths(cu_seqlens, batch_size, name):
    if cu_seqlens.ndim != 1:
        raise ValueError(f"{name} must be 1-D [B+1], got shape {tuple(cu_seqlens.shape)}")
    if batch_size is None:
        batch_size = cu_seqlens.shape[0] - 1
    if batch_size < 0 or cu_seqlens.shape[0] < batch_size + 1:
        raise ValueError(f"{name} has {cu_seqlens.shape[0]} entries; batch_size={batch_size} "
                         f"needs at least {batch_size + 1}")
    # Entries past batch_size + 1 are ignored: inference buffers are sized for the largest batch.
    return cu_seqlens[1:batch_size + 1] - cu_seqlens[:batch_size], batch_size


def padding_mask(cu_seqlens, max_seqlen: int, batch_size: int | None = None):
    """Boolean `[batch_size, max_seqlen]`, True at padding positions (`pos >= L[b]`).

    One vectorised expression in the array's own module (NumPy, CuPy, PyTorch or JAX), so a
    device `cu_seqlens` gives a device mask with no host synchronisation. `cu_seqlens` may hold
    more than `batch_size + 1` entries; the extra ones are ignored. A sequence longer than
    `max_seqlen` gives an all-False row.
    """
    xp = _namespace(cu_seqlens)
    lengths, batch_size = _lengths(cu_seqlens, batch_size, "cu_seqlens")
    pos = _arange(xp, int(max_seqlen), cu_seqlens)
    return pos[None, :] >= lengths[:, None]


def dense_mask(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, mask="full",
               batch_size: int | None = None):
    """Boolean `[B, max_seqlen_q, max_seqlen_k]`, True where attention is allowed.

    The convention of torch's `scaled_dot_product_attention` boolean `attn_mask`. Row `i` of
    sequence `b` is all False when `i >= Lq[b]` (padding) and column `j` when `j >= Lk[b]`.
    `mask` is a name or a `varlen.Mask` with scalars or `[B]` arrays in the same framework as
    `cu_seqlens_q`. Built on the arrays' device with no host synchronisation.
    """
    xp = _namespace(cu_seqlens_q)
    if _namespace(cu_seqlens_k) is not xp:
        raise TypeError("cu_seqlens_q and cu_seqlens_k must come from the same framework")
    lq, batch_size = _lengths(cu_seqlens_q, batch_size, "cu_seqlens_q")
    lk, _ = _lengths(cu_seqlens_k, batch_size, "cu_seqlens_k")
    m = as_mask(mask)
    left = _per_seq(xp, m.window_left, batch_size, cu_seqlens_q, "window_left")
    right = _per_seq(xp, m.window_right, batch_size, cu_seqlens_q, "window_right")
    br = _per_seq(xp, m.bottom_right, batch_size, cu_seqlens_q, "bottom_right")
    i = _arange(xp, int(max_seqlen_q), cu_seqlens_q)[None, :, None]
    j = _arange(xp, int(max_seqlen_k), cu_seqlens_q)[None, None, :]
    lq3, lk3 = lq[:, None, None], lk[:, None, None]
    inside = (i < lq3) & (j < lk3)
    return inside & visible(i, j, lq3, lk3, left, right, br)
