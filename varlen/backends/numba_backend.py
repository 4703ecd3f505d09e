"""The Numba CUDA backend: device plans and portable SIMT attention kernels.

`NumbaBackend` answers the `Backend` questions and hands each call to the launchers in
`_numba_launch.py`, which run the kernels of `_numba_kernels.py` (see docs/numba_backend.md).
Arrays may be CuPy or Numba device arrays, or NumPy arrays that run in the device (or in the
Numba CUDA simulator, which is how CI executes the kernels); results come back as the same kind.
Numba is imported on first use, so this module loads without it.
"""
from __future__ import annotations

from .._validate import dtype_name
from ..plan import Plan, Segments
from .base import Backend

MAX_HEAD_DIM = 256
# Tile sizes tried in order by `default_blocks` on a GPU: the first whose shared memory fits.
_GPU_BLOCKS = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8))
# Tiles in the simulator, which runs one OS thread per CUDA thread.
_SIM_BLOCKS = (16, 16)

__all__ = ["NumbaBackend", "BACKEND", "plan_from_cu_seqlens", "simulated"]


def _launch():
    from . import _numba_launch
    return _numba_launch


def _kernels():
    from . import _numba_kernels
    return _numba_kernels


def _numba_missing() -> str | None:
    try:
        from numba import cuda  # noqa: F401
    except ImportError:
        return "numba-cuda is not installed (pip install 'numba-cuda[cu13]')"
    return None


def simulated() -> bool:
    """True when Numba runs CUDA kernels in its CPU simulator (`NUMBA_ENABLE_CUDASIM=1`)."""
    return _launch().simulated()


def variant(plan: Plan, q, v, softcap: float, mods=None, dropout=None):
    """The compiled kernel variant that runs this plan on these inputs (and the call's
    mask_mod / score_mod, by graph digest; with dropout, the variant that draws it)."""
    K = _kernels()
    try:
        return K.Variant(dtype_name(q.dtype), int(q.shape[2]), int(v.shape[2]), plan.block_m,
                         plan.block_n, softcap > 0, K.UserFns.of(mods), dropout is not None)
    except ValueError as e:
        raise ValueError(f"plan tiles do not fit the numba kernels: {e}") from None


class NumbaBackend(Backend):
    """FlashAttention-2 as Numba CUDA kernels, plans built on the device."""

    name = "numba"
    runs_mods = frozenset({"mask_mod", "score_mod", "aux_grads"})
    runs_dropout = True

    def supports(self, call):
        missing = _numba_missing()
        if missing:
            return missing
        dtypes = _kernels().DTYPES
        if call.dtype not in dtypes:
            return f"dtype {call.dtype} is not supported (expected one of {', '.join(dtypes)})"
        if max(call.head_dim, call.head_dim_v) > MAX_HEAD_DIM:
            return f"head dims {call.head_dim}/{call.head_dim_v} exceed {MAX_HEAD_DIM}"
        if simulated():
            if call.on_device:
                return "the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1); it runs host arrays only"
            return None
        from numba import cuda
        if not cuda.is_available():
            return "no CUDA device is available to Numba"
        return None

    def default_blocks(self, dtype, head_dim):
        """The largest tiles (of a fixed ladder) whose shared memory fits, assuming Dv = D."""
        ladder = _GPU_BLOCKS
        if simulated():
            ladder = _GPU_BLOCKS[_GPU_BLOCKS.index(_SIM_BLOCKS):]
        for bm, bn in ladder:
            if _kernels().fits(dtype, head_dim, head_dim, bm, bn) is None:
                return bm, bn
        return ladder[-1]

    def can_plan(self, on_device: bool) -> str | None:
        """Device arrays on a GPU, host arrays in the simulator (or copied to the GPU and back)."""
        return _numba_missing()

    def make_plan(self, q: Segments, k: Segments, mask, *, block_m: int, block_n: int,
                  max_seqlen_q=None, max_seqlen_k=None) -> Plan:
        """`varlen.plan.build_plan` on the device: the same arrays, built by Numba kernels.

        Segment and mask arrays may be CuPy or Numba device arrays (the plan stays there, no
        host synchronisation) or NumPy (built in the device or simulator, returned as NumPy).
        More tiles than `max_seqlen_*` allows is a device error (`check_device_errors()`), raised
        at once for NumPy arrays.
        """
        L = _launch()
        L.check_blocks(block_m, block_n)
        if q.batch != k.batch:
            raise ValueError(f"query segments cover {q.batch} sequences but key segments "
                             f"{k.batch}; expected the same batch")
        ctx = L.Context(q.row)
        plan = L.device_plan(ctx, L.segments_on_device(ctx, q), L.segments_on_device(ctx, k),
                             mask, block_m=int(block_m), block_n=int(block_n),
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        return plan.to_host() if ctx.kind == "host" else plan

    def plan_from_cu_seqlens(self, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                             num_rows_q: int, num_rows_k: int, mask, *, block_m: int,
                             block_n: int, max_seqlen_q=None, max_seqlen_k=None) -> Plan:
        """A plan straight from `cu_seqlens` in kernels (segments, mask policy, tile tables,
        schedules; the module's `plan_from_cu_seqlens`)."""
        L = _launch()
        L.check_blocks(block_m, block_n)
        if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
            raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries and "
                             f"cu_seqlens_k {cu_seqlens_k.shape[0]}; both must be [B+1] for the "
                             f"same B")
        ctx = L.Context(cu_seqlens_q)
        q = L.segments(ctx, cu_seqlens_q, seq_offsets_q, num_rows_q, "q")
        k = L.segments(ctx, cu_seqlens_k, seq_offsets_k, num_rows_k, "k")
        plan = L.device_plan(ctx, q, k, mask, block_m=int(block_m), block_n=int(block_n),
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        return plan.to_host() if ctx.kind == "host" else plan

    def check_plan(self, plan: Plan):
        if plan.block_m > 1024 or plan.block_n > 1024:
            return (f"block_m={plan.block_m} and block_n={plan.block_n} must be <= 1024 (a "
                    f"thread per row)")
        if _launch().kind_of(plan.q_tiles) is None:
            return f"its arrays are {type(plan.q_tiles).__name__}; expected NumPy, CuPy or Numba"
        return None

    def forward(self, plan, q, k, v, *, softmax_scale, softcap, mods=None, dropout=None):
        """`out [Tq, Hq, Dv]` in q's dtype and float32 `lse [Hq, Tq]`, beside the inputs; pad
        rows and rows that see no key 0 and -inf, rows a NaN or inf reaches NaN
        (docs/semantics.md, "Non-finite values"). `mods`: the call's mask_mod and score_mod,
        run in the kernels (docs/numba_backend.md, "User functions"). `dropout`: the call's
        `varlen.dropout.Dropout`, its keep bits drawn in the kernels ("Dropout" there)."""
        return _launch().forward(variant(plan, q, v, softcap, mods, dropout), plan, q, k, v,
                                 softmax_scale=softmax_scale, softcap=softcap, mods=mods,
                                 dropout=dropout)

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
                 deterministic=False, mods=None, dropout=None):
        """`(dq, dk, dv)` beside the inputs (FlashAttention-2, Alg. 2); with `mods.aux_grads`
        a fourth result, the score_mod's aux gradients (one float32 array or None per aux).

        dK/dV: one pass over key tiles (`k_sched`), GQA groups reduced in registers. dQ: float32
        atomics from that same pass, or with `deterministic=True` a separate pass over query
        tiles (`q_sched`) whose per-row accumulation order is fixed: bitwise repeatable. Aux
        gradients: from the dK/dV pass, float32 atomics, or with `deterministic=True` integer
        atomics in fixed point (`_aux_fixed`), bitwise repeatable. With `dropout`, every pass
        draws the forward's keep bits again.
        """
        return _launch().backward(variant(plan, q, v, softcap, mods, dropout), plan, dout, q, k,
                                  v, out, lse, softmax_scale=softmax_scale, softcap=softcap,
                                  deterministic=bool(deterministic), mods=mods,
                                  dropout=dropout)


BACKEND = NumbaBackend()


def plan_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, *, num_rows_q: int, num_rows_k: int,
                         seq_offsets_q=None, seq_offsets_k=None, mask="full",
                         max_seqlen_q=None, max_seqlen_k=None, block_m=None,
                         block_n=None, dtype="float16", head_dim=64) -> Plan:
    """A plan straight from device `cu_seqlens` (CuPy or Numba arrays; NumPy for the simulator).

    Everything runs in kernels: segments, mask policy, tile tables, schedules. `num_rows_*`
    (the packed arrays' row counts) size it; values are never read on the host. Block sizes
    default to `BACKEND.default_blocks(dtype, head_dim)`. int32 `cu_seqlens` and offsets.
    What the sizes would drop (a sequence past its buffer, more tiles than `max_seqlen_*`
    allows) is a device error (`varlen.check_device_errors()`), raised at once for NumPy.
    """
    bm, bn = BACKEND.default_blocks(dtype, head_dim)
    return BACKEND.plan_from_cu_seqlens(
        cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, num_rows_q, num_rows_k, mask,
        block_m=bm if block_m is None else block_m, block_n=bn if block_n is None else block_n,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
