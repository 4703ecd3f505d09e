"""Launcher of the sm_90a backward kernel (`kernels_cuda/bwd_sm90.cuh`): wgmma, TMA, mbarriers.

`backward` runs what `_cupy_kernels.backward` runs: the preprocessing (delta, lse2, and with
`deterministic` the order of the dQ additions), then `varlen_bwd_dkdv_sm90` in place of the
mma.sync dK/dV kernel (dK, dV and dQ by fp32 reductions into the same `dq_accum`, in a fixed
order with `deterministic`), then the dQ conversion. The preprocessing
and the conversion are the mma.sync module's kernels, unchanged (`_cupy_kernels.backward` runs
all three, this kernel passed in as its `dkdv`). The CuPy backend runs it with
`VARLEN_CUPY_PATH=sm90a`, like the sm_90a forward (see docs/hopper.md, "The sm_90a backward,
stage 1").

The kernel reads the same `PlanView` and `CallParams` as the mma.sync kernels and four CUDA tensor
maps over the packed q, k, v and dout (3D: (D, H, T) innermost first, boxes of 64 head-dim
columns x 1 head x BQ = 64 rows for q and dout, BN rows for k and v, 128B swizzle, zero fill past
row T). It is compiled by NVRTC for `sm_90a` and loaded as a cubin by the forward's `Runtime`;
`EmulatedRuntime` runs it through the host emulation instead (tests/test_sm90_backward.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import _cupy_sm90, _cupy_spec
from ._cupy_sm90 import OPTIN_SMEM, SMEM_ALIGN, WG_THREADS

BQ = 64                        # query rows per chunk (BwdSm90Config::BQ): wgmma N of S^T, M of dQ
WG_ROWS = 64                   # key rows per consumer warpgroup (wgmma M)
SPLIT_HEAD_DIM = 256           # from this D two consumer warpgroups split the head dim's columns
STAGES = 2                     # Q/dO ring (BwdSm90Config::STAGES)
NUM_BARRIERS = 2 + 3 * STAGES
CHUNK_BYTES = 24               # StagedChunk: the query chunk a stage holds
KERNEL = "varlen_bwd_dkdv_sm90"


@dataclass(frozen=True)
class BwdSm90Spec:
    """One variant of `varlen_bwd_dkdv_sm90`: element type, head dim, key tile, softcap, and
    whether dQ is added in a fixed order (`deterministic=True`)."""

    dtype: str          # "float16" | "bfloat16"
    head_dim: int
    block_n: int
    softcap: bool
    ordered_dq: bool = False

    def __post_init__(self):
        if self.dtype not in _cupy_spec.DTYPES:
            raise ValueError(f"{self.dtype=}: the sm_90a backward takes float16 or bfloat16")
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"{self.head_dim=}: the sm_90a backward takes D = 64, 128 or 256")
        if self.block_n not in (64, 128):
            raise ValueError(f"{self.block_n=}: one or two consumer warpgroups of 64 key rows")
        if self.head_dim >= SPLIT_HEAD_DIM and self.block_n != WG_ROWS:
            raise ValueError(f"{self.block_n=} at D = {self.head_dim}: the sm_90a backward's two "
                             f"consumer warpgroups split the columns of a {WG_ROWS}-key tile")
        if self.smem > OPTIN_SMEM:
            raise ValueError(f"{self}: {self.smem} B of shared memory exceed {OPTIN_SMEM}")

    @property
    def ctype(self) -> str:
        return _cupy_spec.DTYPES[self.dtype]

    @property
    def consumers(self) -> int:
        """Consumer warpgroups: one per 64 key rows, two (one per half of the columns) at
        D = 256."""
        return self.block_n // WG_ROWS * (2 if self.head_dim >= SPLIT_HEAD_DIM else 1)

    @property
    def threads(self) -> int:
        """A producer warpgroup and the consumers."""
        return WG_THREADS * (1 + self.consumers)

    @property
    def smem(self) -> int:
        """K, V [BN][D], STAGES x (Q, dO) [BQ][D], dS [BQ][64] per consumer, STAGES x (lse2,
        delta) [BQ] and the stage's chunk, the mbarriers (BwdSm90Config's layout), and 1 KiB to
        align the window."""
        e = _cupy_spec.ELEM_BYTES
        data = (2 * self.block_n + 2 * STAGES * BQ) * self.head_dim * e
        data += self.consumers * BQ * WG_ROWS * e + STAGES * (2 * BQ * 4 + CHUNK_BYTES)
        return data + 8 * NUM_BARRIERS + SMEM_ALIGN

    @property
    def name(self) -> str:
        return (f"{KERNEL}<{self.ctype}, {self.head_dim}, {self.block_n}, {BQ}, "
                f"{_flag(self.softcap)}, {_flag(self.ordered_dq)}>")


def _flag(b: bool) -> str:
    return "true" if b else "false"


def spec_for(plan, q, softcap: float, deterministic: bool = False) -> BwdSm90Spec:
    if plan.block_m % BQ:
        raise ValueError(f"{plan.block_m=} does not split into query chunks of {BQ}")
    return BwdSm90Spec(str(q.dtype), int(q.shape[2]), int(plan.block_n), bool(softcap > 0),
                       bool(deterministic))


def compile_report(specs) -> dict:
    """NVRTC build of `specs` for sm_90a, as `_cupy_sm90.compile_report`."""
    return _cupy_sm90.compile_report(specs)


class EmulatedRuntime(_cupy_sm90.EmulatedRuntime):
    """The forward's emulated runtime, for this kernel's entry point and variant."""

    ENTRY = KERNEL.encode()

    def _build_args(self, spec: BwdSm90Spec) -> tuple:
        return (spec.ctype, spec.head_dim, 64, spec.block_n, BQ, _flag(spec.softcap))

    def entry(self, spec: BwdSm90Spec) -> bytes:
        return self.ENTRY + (b"_ordered" if spec.ordered_dq else b"")


_runtime = None


def runtime():
    """The runtime of the launches: the forward's (NVRTC cubin, driver tensor maps) unless
    `use_runtime` chose another."""
    return _runtime if _runtime is not None else _cupy_sm90.runtime()


def use_runtime(rt) -> None:
    """Route launches through `rt` (EmulatedRuntime in the tests)."""
    global _runtime
    _runtime = rt


def backward(plan, dout, q, k, v, out, lse, *, softmax_scale: float, softcap: float,
             deterministic: bool = False):
    """`(dq, dk, dv)` in the input dtype, as `_cupy_kernels.backward`: dq [Tq, Hq, D], dk and
    dv [Tk, Hk, D]; pad rows and rows without a visible pair 0; dQ's additions in a fixed order
    with `deterministic` (bitwise repeatable). The same three launches, `varlen_bwd_dkdv_sm90`
    in place of the mma.sync dK/dV kernel."""
    from . import _cupy_kernels
    spec = spec_for(plan, q, softcap, deterministic)
    # the preprocessing and the conversion depend on the element type and head dim only
    aux = _cupy_spec.KernelSpec("bwd", spec.dtype, spec.head_dim, 64, 64, False)

    def dkdv(q, k, v, dout, lse2, delta, dk, dv, dq_accum, dq_order, plan_struct, call):
        rt = runtime()
        if hasattr(rt, "prepare"):
            rt.prepare(spec)
        maps = (rt.tensor_map(q, BQ), rt.tensor_map(k, spec.block_n),
                rt.tensor_map(v, spec.block_n), rt.tensor_map(dout, BQ))
        rt.launch(spec, grid=(plan.num_k_tiles, k.shape[1]),
                  args=(*maps, lse2, delta, dk, dv, dq_accum, dq_order, plan_struct, call))

    return _cupy_kernels.backward(aux, plan, dout, q, k, v, out, lse,
                                  softmax_scale=softmax_scale, softcap=softcap,
                                  deterministic=bool(deterministic), dkdv=dkdv)
