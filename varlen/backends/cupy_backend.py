"""The CuPy backend: tensor-core (mma.sync) forward and backward kernels for float16/bfloat16.

Kernels live in `kernels_cuda/` (see docs/cupy_backend.md); this module checks what they can
run and hands the plan and the working CuPy arrays to the launchers in `_cupy_kernels.py`.
Nothing here reads device memory on the host.
"""
from __future__ import annotations

from .._validate import dtype_name
from ..plan import Plan
from .base import Backend
from ._cupy_spec import BLOCKS, DTYPES, HEAD_DIMS, KernelSpec

# Tile sizes of plans this backend builds by default: 8 warps of 16 query rows per block.
DEFAULT_BLOCKS = (128, 64)


def _cupy_missing():
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return f"CuPy is not importable ({e})"
    return None


def spec_for(plan: Plan, q, *, kind: str, softcap: float) -> KernelSpec:
    """The compiled variant that runs `kind` ("fwd"/"bwd") for this plan and input."""
    return KernelSpec(kind=kind, dtype=dtype_name(q.dtype), head_dim=int(q.shape[2]),
                      block_m=plan.block_m, block_n=plan.block_n, has_softcap=softcap > 0)


class CupyBackend(Backend):
    """Tensor-core kernels of `kernels_cuda/` through CuPy RawModules."""

    name = "cupy"
    # backend=None may pick it only once the GPU parity suite (tests/test_cupy_gpu.py, run by
    # scripts/gpu_check_cupy.sh) has passed on a GPU: the kernels compile cleanly for
    # sm_80/sm_90 but their numerics are unverified until then. backend="cupy" always works.
    default_eligible = False

    def supports(self, call):
        if not call.on_device:
            return "the cupy backend runs on a CUDA device; the arrays live on the host"
        if call.dtype not in DTYPES:
            return (f"dtype {call.dtype} is not supported (tensor-core kernels take "
                    f"{', '.join(DTYPES)})")
        if call.head_dim not in HEAD_DIMS:
            return f"head_dim={call.head_dim} is not compiled (available: {HEAD_DIMS})"
        if call.head_dim_v != call.head_dim:
            return f"head_dim_v={call.head_dim_v} differs from head_dim={call.head_dim}"
        return _cupy_missing()

    def default_blocks(self, dtype, head_dim):
        return DEFAULT_BLOCKS

    def check_plan(self, plan: Plan):
        if (plan.block_m, plan.block_n) not in BLOCKS:
            return (f"its tiles are ({plan.block_m}, {plan.block_n}); the cupy kernels take "
                    f"(block_m, block_n) in {BLOCKS}")
        try:
            import cupy
        except ImportError:
            return "CuPy is not importable"
        view = plan.view()
        if not all(isinstance(a, cupy.ndarray) for a in view[:view.NUM_ARRAYS]):
            return "its arrays are not CuPy device arrays; build it from device cu_seqlens"
        return None

    def forward(self, plan, q, k, v, *, softmax_scale, softcap):
        """`out [Tq, Hq, D]` in q's dtype and `lse [Hq, Tq]` float32; pad rows 0 and -inf."""
        from . import _cupy_kernels
        spec = spec_for(plan, q, kind="fwd", softcap=softcap)
        return _cupy_kernels.forward(spec, plan, q, k, v, softmax_scale=softmax_scale,
                                     softcap=softcap)

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
                 deterministic=False):
        """`(dq, dk, dv)` in the input dtype. dK/dV are always deterministic (one writer per
        row); dQ uses fp32 atomics unless `deterministic`, which runs a separate dQ kernel."""
        from . import _cupy_kernels
        spec = spec_for(plan, q, kind="bwd", softcap=softcap)
        return _cupy_kernels.backward(spec, plan, dout, q, k, v, out, lse,
                                      softmax_scale=softmax_scale, softcap=softcap,
                                      deterministic=bool(deterministic))


BACKEND = CupyBackend()
