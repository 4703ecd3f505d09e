"""The CuPy backend: tensor-core forward and backward kernels for float16/bfloat16 through CuPy
RawModules (kernels_cuda/; docs/cupy_backend.md, docs/hopper.md).

Two implementations, each a `Backend` of its own that `backend=` can name:

| name         | GPUs            | kernels                                             |
| ------------ | --------------- | --------------------------------------------------- |
| `cupy:sm90a` | H100/H200 (9.0) | wgmma, TMA, mbarriers, warp specialisation (`sm90`) |
| `cupy:mma`   | sm_80 and newer | mma.sync, cp.async (`mma`)                          |

`backend="cupy"` is the family: for each pass (forward, backward) it runs the first
implementation, in that order, that may be chosen by default (`default_eligible`) and can run
it. The sm_90a kernels are not chosen by default until `scripts/gpu_check.sh --sm90a` has passed
on a GPU; until then `backend="cupy:sm90a"` asks for them. All three share the device
questions, the plan builder (two fused device kernels, `plan`) and the plan checks.

Modules: `traits` (dtypes, head dims, the GPU, `tile_size`: the one home of tile sizes),
`compile` (NVRTC, build options, the sm_90a cubin cache, the compile check), `launch` (the
structs and data arguments every launch shares, the module cache), `plan`, `mma`, `sm90`,
`mods` (a call's mask_mod and score_mod as generated code compiled into the kernels). Nothing
here imports CuPy before a call needs it, and nothing reads device memory on the host.

User functions (`runs_mods`): both implementations run a mask_mod and a score_mod in the
forward and a mask_mod in the backward; `cupy:mma`'s backward runs a score_mod too, with the
gradients of its aux arrays (float32 atomics; with deterministic=True integer atomics in fixed
point, bitwise repeatable: `varlen.backends._aux_fixed`).

Attention dropout (`runs_dropout`): `cupy:mma` runs it, forward and backward (kernels_cuda/
dropout.cuh, a DROPOUT variant of its forward and dK/dV kernels); the sm_90a kernels do not
(`SM90_DROPOUT_REFUSAL`), so `backend="cupy"` runs a call with dropout on `cupy:mma`.
"""
from __future__ import annotations

import contextlib
import functools

from ...plan import Plan
from ..base import Backend
from .traits import (BLOCKS, DTYPES, HEAD_DIMS, SM90_COMPUTE_CAPABILITY,
                     SM90_FWD_HEAD_DIM_V_PAIRS, SM90_HEAD_DIMS, DeviceInfo, default_blocks,
                     head_dim_v_refusal, sm90_backward_refusal, smem_refusal,
                     unsupported_device)

__all__ = ["BACKEND", "CupyBackend", "MmaImplementation", "Sm90aImplementation", "DeviceInfo",
           "device_info"]

_stand_in: list = []        # the device every implementation answers for (tests on a CPU)

SM90_DROPOUT_REFUSAL = ("its sm_90a kernels do not run attention dropout (dropout_p > 0); "
                        "backend='cupy' runs it on cupy:mma's kernels")


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


class _CupyBase(Backend):
    """What the implementations and the family share: the GPU, the plans and their tiles."""

    IMPL = "mma"            # whose kernels' limits on user functions apply (`mods.refusal`)
    runs_mods = frozenset({"mask_mod", "score_mod", "aux_grads"})

    def supports_mods(self, call):
        """None when the kernels run the call's mask_mod / score_mod (`mods.refusal`: the
        sm_90a backward runs a mask_mod, no score_mod)."""
        from .mods import refusal
        return refusal(getattr(call, "mods", None), impl=self.IMPL,
                       backward=getattr(call, "grads", None) is not None)

    @contextlib.contextmanager
    def stand_in_device(self, device: DeviceInfo):
        """Answer every device question of every implementation as if the current GPU were
        `device` (tests on a CPU)."""
        _stand_in.append(device)
        try:
            yield device
        finally:
            _stand_in.pop()

    def device(self) -> tuple:
        """`(DeviceInfo of the current GPU, None)`, or `(None, why there is none)`."""
        if _stand_in:
            return _stand_in[-1], None
        why = _cupy_missing()
        if why:
            return None, why
        import cupy
        try:
            return device_info(cupy.cuda.Device().id), None
        except Exception as e:          # no driver, no device: CuPy's own error types vary
            return None, f"no CUDA device is usable ({type(e).__name__}: {e})"

    def _common_refusal(self, call, head_dims) -> str | None:
        if not call.on_device:
            return f"the {self.name} backend runs on a CUDA device; the arrays live on the host"
        if call.dtype not in DTYPES:
            return (f"dtype {call.dtype} is not supported (tensor-core kernels take "
                    f"{', '.join(DTYPES)})")
        if call.head_dim not in head_dims:
            return f"head_dim={call.head_dim} is not compiled (available: {head_dims})"
        return head_dim_v_refusal(call.head_dim, call.head_dim_v, self.IMPL)

    def can_plan(self, on_device: bool) -> str | None:
        if not on_device:
            return "it builds plans of CUDA device arrays; cu_seqlens live on the host"
        return _cupy_missing()

    def default_blocks(self, dtype, head_dim):
        """`traits.default_blocks`, or else the largest tiles whose kernels fit the current
        GPU's shared memory (`mma.choose_blocks`: (128, 64) for (128, 128) at D = 96 and 128 on
        a 99 KiB sm_86/sm_89)."""
        if dtype not in DTYPES or head_dim not in HEAD_DIMS:
            return default_blocks(64)
        fallback = default_blocks(head_dim)
        device, _ = self.device()
        if device is None:
            return fallback
        from .mma import choose_blocks
        return choose_blocks(device, dtype, head_dim, fallback) or fallback

    def make_plan(self, q, k, mask, *, block_m, block_n, max_seqlen_q=None,
                  max_seqlen_k=None) -> Plan:
        """The plan of these segments in two fused device kernels (`plan.build_plan`)."""
        from .plan import build_plan
        return build_plan(q, k, mask, block_m=int(block_m), block_n=int(block_n),
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)

    def plan_from_cu_seqlens(self, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                             num_rows_q, num_rows_k, mask, *, block_m, block_n,
                             max_seqlen_q=None, max_seqlen_k=None) -> Plan:
        """Segments, mask policy, tile tables and schedules of device arrays in two fused
        kernels (`plan.plan_from_cu_seqlens`)."""
        from ...masks import as_mask
        from .plan import plan_from_cu_seqlens
        return plan_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                                    num_rows_q, num_rows_k, as_mask(mask), block_m=int(block_m),
                                    block_n=int(block_n), max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k)

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


class MmaImplementation(_CupyBase):
    """mma.sync and cp.async kernels (sm_80 and newer; `mma`)."""

    name = "cupy:mma"
    runs_dropout = True

    def supports(self, call):
        why = self._common_refusal(call, HEAD_DIMS)
        if why:
            return why
        device, why = self.device()
        return why or unsupported_device(device) or self._fits(device, call)

    def _fits(self, device, call):
        """Why the kernels of `call` do not fit the shared memory of `device` (None: they do)."""
        from .mma import ROLES, KernelSpec, choose_blocks
        from .traits import blocks_for
        blocks = choose_blocks(device, call.dtype, call.head_dim, default_blocks(call.head_dim))
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

    def runs(self, kind: str, plan, q, softcap: float, v=None) -> str | None:
        """None when this implementation runs pass `kind` of a call with `plan`."""
        return None

    def _require_fit(self, spec, roles):
        """A plan given with the call has its own tiles: refuse those the GPU cannot hold."""
        from .mma import ROLES
        device, _ = self.device()
        why = None if device is None else smem_refusal(spec, device, ROLES[roles])
        if why:
            raise ValueError(f"the cupy backend cannot run a plan with tiles ({spec.block_m}, "
                             f"{spec.block_n}) on this GPU: {why}; build the plan with the "
                             f"tiles of the backend's default_blocks or use another backend")

    def forward(self, plan, q, k, v, *, softmax_scale, softcap, mods=None, dropout=None):
        """`out [Tq, Hq, Dv]` in q's dtype and `lse [Hq, Tq]` float32; pad rows 0 and -inf.
        `mods`: the call's mask_mod and score_mod, compiled into the kernel; `dropout`: the
        call's `varlen.dropout.Dropout` (the kernel's DROPOUT variant)."""
        from . import mma
        spec = mma.spec_for(plan, q, kind="fwd", softcap=softcap, mods=mods, v=v,
                            dropout=dropout)
        self._require_fit(spec, "fwd")
        return mma.forward(spec, plan, q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                           mods=mods, dropout=dropout)

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
                 deterministic=False, mods=None, dropout=None):
        """`(dq, dk, dv)` in the input dtype. dK/dV are always deterministic (one writer per
        row); dQ uses fp32 atomics, added in a fixed order when `deterministic` (bitwise
        repeatable). `mods`: as `forward`'s; with `mods.aux_grads` a fourth result, the
        score_mod's aux gradients (float32 atomics; fixed point with `deterministic`).
        `dropout`: the forward's, whose keep bits the dK/dV kernel draws again."""
        from . import mma
        spec = mma.spec_for(plan, q, kind="bwd", softcap=softcap, mods=mods, v=v,
                            dropout=dropout)
        self._require_fit(spec, "bwd-deterministic" if deterministic else "bwd")
        return mma.backward(spec, plan, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                            softcap=softcap, deterministic=bool(deterministic), mods=mods,
                            dropout=dropout)


class Sm90aImplementation(_CupyBase):
    """wgmma, TMA and mbarrier kernels for compute capability 9.0 (`sm90`)."""

    name = "cupy:sm90a"
    IMPL = "sm90a"
    # a score_mod in its forward only (`mods.refusal`)
    runs_mods = frozenset({"mask_mod", "score_mod"})
    # Chosen by backend="cupy" on an H100/H200 once scripts/gpu_check.sh --sm90a has passed on
    # one (docs/hopper.md, "The GPU side"); until then only when named.
    default_eligible = False

    def supports_dropout(self, call):
        """Dropout is refused (`SM90_DROPOUT_REFUSAL`): `backend="cupy"` falls back on
        `cupy:mma`, `backend="cupy:sm90a"` raises."""
        return None if getattr(call, "dropout", None) is None else SM90_DROPOUT_REFUSAL

    def supports(self, call):
        """Its forward also takes the pairs of `traits.SM90_FWD_HEAD_DIM_V_PAIRS` (D = 192 with
        head_dim_v = 128), its backward head_dim_v == head_dim only."""
        pair = (call.head_dim, call.head_dim_v)
        why = self._common_refusal(call, SM90_HEAD_DIMS if pair not in
                                   SM90_FWD_HEAD_DIM_V_PAIRS else (call.head_dim,))
        if why is None and getattr(call, "grads", None) is not None:
            why = sm90_backward_refusal(*pair)
        if why:
            return why
        device, why = self.device()
        if why:
            return why
        if tuple(device.compute_capability) != SM90_COMPUTE_CAPABILITY:
            return (f"the GPU is {device.describe()}; the sm_90a kernels (wgmma, TMA) run on "
                    f"compute capability 9.0 only (H100/H200)")
        return None

    def runs(self, kind: str, plan, q, softcap: float, v=None) -> str | None:
        """None when this implementation has a variant for pass `kind` of a call with `plan`
        (and values `v`: head_dim_v; None: q's head dim), else why not."""
        from . import sm90
        try:
            if kind == "fwd":
                sm90.fwd_spec_for(plan, q, softcap, v=v)
            else:
                sm90.bwd_spec_for(plan, q, softcap, v=v)
        except ValueError as e:
            return str(e)
        return None

    def forward(self, plan, q, k, v, *, softmax_scale, softcap, mods=None, dropout=None):
        """As `MmaImplementation.forward`, by the sm_90a kernel (`sm90.forward`); no dropout."""
        if dropout is not None:
            raise ValueError(f"backend {self.name!r} cannot run this forward: "
                             f"dropout_p={dropout.p!r}: {SM90_DROPOUT_REFUSAL}")
        from . import sm90
        return sm90.forward(plan, q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                            mods=mods)

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
                 deterministic=False, mods=None, dropout=None):
        """As `MmaImplementation.backward`, the sm_90a dK/dV kernel in place of the mma.sync one
        (`sm90.backward`), with the call's mask_mod; no score_mod (`supports_mods` refuses it)
        and no dropout."""
        if dropout is not None:
            raise ValueError(f"backend {self.name!r} cannot run this backward: "
                             f"dropout_p={dropout.p!r}: {SM90_DROPOUT_REFUSAL}")
        from . import sm90
        from .mods import refusal
        why = refusal(mods, impl=self.IMPL, backward=True) or sm90_backward_refusal(
            int(q.shape[2]), int(v.shape[2]))
        if why:
            raise ValueError(f"backend {self.name!r} cannot run this backward: {why}")
        return sm90.backward(plan, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                             softcap=softcap, deterministic=bool(deterministic), mods=mods)


class CupyBackend(_CupyBase):
    """The family: each pass by the first implementation that may be chosen by default and runs
    it (`implementations`, in order of preference)."""

    name = "cupy"
    # backend=None may pick it only once the GPU parity suite (tests/gpu/test_cupy_gpu.py, run
    # by scripts/gpu_check.sh) has passed on a GPU: the kernels compile cleanly for
    # sm_80/sm_90 but their numerics are unverified until then. backend="cupy" always works.
    default_eligible = False

    def __init__(self, implementations):
        self.implementations = tuple(implementations)

    def implementation(self, short: str) -> Backend | None:
        """The implementation called `cupy:{short}` (None if there is none)."""
        return next((i for i in self.implementations if i.name == f"{self.name}:{short}"), None)

    def supports(self, call):
        whys = []
        for impl in self.implementations:
            why = impl.supports(call)
            if why is None and impl.default_eligible:
                return None
            whys.append(why)
        return whys[-1] or "no implementation is chosen by default for this call"

    def supports_mods(self, call):
        """The user functions of the implementation every pass can fall back on (`cupy:mma`)."""
        return self.implementations[-1].supports_mods(call)

    def supports_dropout(self, call):
        """The dropout of the implementation every pass can fall back on (`cupy:mma`)."""
        return self.implementations[-1].supports_dropout(call)

    def choose(self, kind: str, plan, q, softcap: float, mods=None, v=None,
               dropout=None) -> Backend:
        """The implementation that runs pass `kind` ("fwd" | "bwd") of a call with `plan`, user
        functions `mods`, values `v` (its head dim is head_dim_v; None: q's) and `dropout`: the
        first default-eligible one that has a variant for it (the last one otherwise)."""
        probe = _Probe(q, on_device=True, mods=mods, backward=kind == "bwd", v=v,
                       dropout=dropout)
        for impl in self.implementations[:-1]:
            if impl.default_eligible and impl.runs(kind, plan, q, softcap, v) is None and \
                    impl.supports(probe) is None and impl.supports_mods(probe) is None and \
                    impl.supports_dropout(probe) is None:
                return impl
        return self.implementations[-1]

    def forward(self, plan, q, k, v, *, softmax_scale, softcap, mods=None, dropout=None):
        return self.choose("fwd", plan, q, softcap, mods, v, dropout).forward(
            plan, q, k, v, softmax_scale=softmax_scale, softcap=softcap,
            **({"mods": mods} if mods else {}),
            **({"dropout": dropout} if dropout is not None else {}))

    def backward(self, plan, dout, q, k, v, out, lse, *, softmax_scale, softcap,
                 deterministic=False, mods=None, dropout=None):
        return self.choose("bwd", plan, q, softcap, mods, v, dropout).backward(
            plan, dout, q, k, v, out, lse, softmax_scale=softmax_scale, softcap=softcap,
            deterministic=deterministic, **({"mods": mods} if mods else {}),
            **({"dropout": dropout} if dropout is not None else {}))


class _Probe:
    """What `supports`, `supports_mods` and `supports_dropout` read, from a working array and
    the call's user functions and dropout (the family's choice inside a pass)."""

    def __init__(self, q, *, on_device, mods=None, backward=False, v=None, dropout=None):
        from ..._validate import dtype_name
        self.dtype = dtype_name(q.dtype)
        self.head_dim = int(q.shape[2])
        self.head_dim_v = self.head_dim if v is None else int(v.shape[2])
        self.on_device = on_device
        self.mods = mods
        self.dropout = dropout
        self.grads = () if backward else None


BACKEND = CupyBackend([Sm90aImplementation(), MmaImplementation()])
