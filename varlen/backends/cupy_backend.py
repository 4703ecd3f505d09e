"""The CuPy backend: tensor-core (mma.sync) forward and backward kernels for float16/bfloat16.

Kernels live in `kernels_cuda/` (see docs/cupy_backend.md); this module checks what they can
run (dtype, head dim, and the GPU: compute capability, opt-in shared memory per block) and
hands the plan and the working CuPy arrays to the launchers in `_cupy_kernels.py`. Nothing
here reads device memory on the host.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

from .._validate import dtype_name
from ..plan import Plan, plan_from_cu_seqlens
from .base import Backend
from ._cupy_spec import (BLOCKS, DTYPES, HEAD_DIMS, ROLES, DeviceInfo, KernelSpec, blocks_for,
                         choose_blocks, smem_refusal, unsupported_device)

# Tile sizes of plans this backend builds by default: 32 query rows per warp in the forward;
# (64, 64) above D = 128 (_cupy_spec.blocks_for). Head dims where scripts/perf_model.py
# predicts the dK/dV kernel faster with 128-key tiles (by more than its margin, on H100 and
# A100) take (128, 128) (docs/cupy_backend.md, "Performance model"); the forward runs both in
# the same key chunks. (128, 128) stays selectable at every head dim up to 128.
DEFAULT_BLOCKS = (128, 64)
DEFAULT_BLOCKS_BY_HEAD_DIM = {96: (128, 128), 128: (128, 128)}


def _default_blocks_for(head_dim: int) -> tuple:
    allowed = blocks_for(head_dim)
    preferred = DEFAULT_BLOCKS_BY_HEAD_DIM.get(head_dim, DEFAULT_BLOCKS)
    return preferred if preferred in allowed else allowed[0]


def _cupy_missing():
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return f"CuPy is not importable ({e})"
    return None


@functools.lru_cache(maxsize=None)
def device_info(device_id: int) -> DeviceInfo:
    """The compute capability and opt-in shared memory per block of CUDA device `device_id`,
    read once per device."""
    import cupy
    dev = cupy.cuda.Device(device_id)
    cc = str(dev.compute_capability)                        # "86"
    name = cupy.cuda.runtime.getDeviceProperties(device_id).get("name", b"")
    return DeviceInfo(compute_capability=(int(cc[:-1]), int(cc[-1])),
                      smem_optin=int(dev.attributes["MaxSharedMemoryPerBlockOptin"]),
                      name=name.decode() if isinstance(name, bytes) else str(name))


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

    def __init__(self):
        self._stand_in = None

    @contextlib.contextmanager
    def stand_in_device(self, device: DeviceInfo):
        """Answer every device question as if the current GPU were `device` (tests on a CPU)."""
        self._stand_in, before = device, self._stand_in
        try:
            yield device
        finally:
            self._stand_in = before

    def device(self) -> tuple:
        """`(DeviceInfo of the current GPU, None)`, or `(None, why there is none)`."""
        if self._stand_in is not None:
            return self._stand_in, None
        why = _cupy_missing()
        if why:
            return None, why
        import cupy
        try:
            return device_info(cupy.cuda.Device().id), None
        except Exception as e:          # no driver, no device: CuPy's own error types vary
            return None, f"no CUDA device is usable ({type(e).__name__}: {e})"

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
        device, why = self.device()
        return why or unsupported_device(device) or self._fits(device, call)

    def _fits(self, device, call):
        """Why the kernels of `call` do not fit the shared memory of `device` (None: they do)."""
        blocks = choose_blocks(device, call.dtype, call.head_dim,
                               _default_blocks_for(call.head_dim))
        if blocks is None:
            # the forward or the atomic-dQ backward of the smallest tiles does not fit
            smallest = blocks_for(call.head_dim)[0]
            whys = [smem_refusal(KernelSpec(kind, call.dtype, call.head_dim, *smallest, False),
                                 device, ROLES[kind]) for kind in ("fwd", "bwd")]
            why = next(w for w in whys if w)
            return f"no tile size fits this GPU at head_dim={call.head_dim}: {why}"
        if getattr(call, "grads", None) is not None and getattr(call, "deterministic", False):
            why = smem_refusal(KernelSpec("bwd", call.dtype, call.head_dim, *blocks, False),
                               device, ROLES["bwd-deterministic"])
            if why:
                return f"deterministic=True runs a kernel that does not fit: {why}"
        return None

    def default_blocks(self, dtype, head_dim):
        """(128, 64), or (128, 128) at the head dims of DEFAULT_BLOCKS_BY_HEAD_DIM ((64, 64)
        above D = 128, the only tiles there), or else the largest tiles whose kernels fit the
        current GPU's shared memory (`_cupy_spec.choose_blocks`: (128, 64) for (128, 128) at
        D = 96 and 128 on a 99 KiB sm_86/sm_89)."""
        device, _ = self.device()
        if dtype not in DTYPES or head_dim not in HEAD_DIMS:
            return DEFAULT_BLOCKS
        fallback = _default_blocks_for(head_dim)
        if device is None:
            return fallback
        return choose_blocks(device, dtype, head_dim, fallback) or fallback

    def plan_from_cu_seqlens(self, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                             num_rows_q, num_rows_k, mask, **tiles) -> Plan:
        """Segments, mask policy, tile tables and schedules of device arrays in two fused
        kernels (`_cupy_plan.py`; `varlen.plan.plan_from_cu_seqlens`)."""
        return plan_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                                    num_rows_q, num_rows_k, mask, **tiles)

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

    def _require_fit(self, spec, roles):
        """A plan given with the call has its own tiles: refuse those the GPU cannot hold."""
        device, _ = self.device()
        why = None if device is None else smem_refusal(spec, device, ROLES[roles])
        if why:
            raise ValueError(f"the cupy backend cannot run a plan with tiles ({spec.block_m}, "
                             f"{spec.block_n}) on this GPU: {why}; build the plan with the "
                             f"tiles of CupyBackend.default_blocks or use another backend")

    def _require_sm90(self):
        """Raise unless the device runs the sm_90a kernels (compute capability 9.0)."""
        from . import _cupy_sm90
        device, why = self.device()
        if device is None or tuple(device.compute_capability) != (9, 0):
            raise RuntimeError(
                f"{_cupy_sm90.ENV_PATH}=sm90a runs wgmma/TMA kernels built for sm_90a "
                f"(H100/H200); this GPU is {why or device.describe()}: unset it")

    def _compute_capability(self):
        device, _ = self.device()
        return None if device is None else device.compute_capability

    def _sm90_variant(self, module, what, plan, q, softcap) -> bool:
        """Whether the sm_90a `module` (forward or backward) runs this call. Under
        `VARLEN_CUPY_PATH=sm90a`: when it has a variant for it, after checking the GPU
        (`_require_sm90`); else the mma.sync kernels run the call, as on every other GPU, with a
        RuntimeWarning that names what the sm_90a kernels do not take (Python's default filter
        shows each once). Unset, on an sm_90 GPU once the sm_90a kernels are the default there
        (`_cupy_sm90.by_default`): when it has a variant, silently otherwise. `mma`: never."""
        from . import _cupy_sm90
        named = _cupy_sm90.selected()
        if not (named or _cupy_sm90.by_default(self._compute_capability)):
            return False
        if named:
            self._require_sm90()
        try:
            module.spec_for(plan, q, softcap)
        except ValueError as e:
            if named:
                warnings.warn(f"{_cupy_sm90.ENV_PATH}=sm90a: the sm_90a {what} has no variant "
                              f"for this call ({e}); the mma.sync kernels run it",
                              RuntimeWarning, stacklevel=3)
            return False
        return True

    def forward(self, plan, q, k, v, *, softmax_scale, softcap):
        """`out [Tq, Hq, D]` in q's dtype and `lse [Hq, Tq]` float32; pad rows 0 and -inf.
        With `VARLEN_CUPY_PATH=sm90a` the sm_90a kernel runs it (`_cupy_sm90`, opt-in until
        a GPU has passed scripts/gpu_check.sh); it refuses any GPU but compute capability 9.0."""
        from . import _cupy_kernels, _cupy_sm90
        if self._sm90_variant(_cupy_sm90, "forward", plan, q, softcap):
            return _cupy_sm90.forward(plan, q, k, v, softmax_scale=softmax_scale,
                                      softcap=softcap)
        spec = spec_for(plan, q, kind="fwd", softcap=softcap)
        self._require_fit(spec, "fwd")
        return _cupy_kernels.forward(spec, plan, q, k, v, softmax_scale=softmax_scale,
                                     softcap=softcap)

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
                 deterministic=False):
        """`(dq, dk, dv)` in the input dtype. dK/dV are always deterministic (one writer per
        row); dQ uses fp32 atomics, added in a fixed order when `deterministic` (bitwise
        repeatable).
        With `VARLEN_CUPY_PATH=sm90a` both modes run the sm_90a dK/dV kernel
        (`_cupy_sm90_bwd`)."""
        from . import _cupy_kernels, _cupy_sm90_bwd
        if self._sm90_variant(_cupy_sm90_bwd, "backward", plan, q, softcap):
            return _cupy_sm90_bwd.backward(plan, dout, q, k, v, out, lse,
                                           softmax_scale=softmax_scale, softcap=softcap,
                                           deterministic=bool(deterministic))
        spec = spec_for(plan, q, kind="bwd", softcap=softcap)
        self._require_fit(spec, "bwd-deterministic" if deterministic else "bwd")
        return _cupy_kernels.backward(spec, plan, dout, q, k, v, out, lse,
                                      softmax_scale=softmax_scale, softcap=softcap,
                                      deterministic=bool(deterministic))


BACKEND = CupyBackend()
