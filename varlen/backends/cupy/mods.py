"""The call's mask_mod and score_mod in the CuPy kernels (kernels_cuda/mods.cuh).

A module is compiled per pair of functions: `hooks_for(mods)` gives the `ModHooks` of a call,
the generated CUDA C (varlen/mods/codegen.py) that goes ahead of the kernel sources and the
macros that name it; its graph digests (which cover the aux arrays' dtypes) are part of every
variant that carries it (`mma.KernelSpec.mods`, `sm90.FwdSpec.mods`), so the module cache and
the sm_90a cubin cache never give one function's kernels to another. The aux arrays reach the
kernels in the params struct (`ModParams`: one `ModAux` of pointers and shapes per function),
with a device flag the generated code sets on an out-of-range aux index; the launcher ors it
into `varlen.check_device_errors()`'s record (`MOD_INDEX_ERROR`) without a host read.

`refusal(mods, impl, backward)` says what the kernels do not run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...mods.codegen import CUDA_PRELUDE, cuda_source
from .compile import ENTRY_FILE

MAX_AUX = 8                   # VARLEN_MAX_AUX
MAX_AUX_DIMS = 4              # ModAux::shape[i][4]
# The kernels' ModAux and ModParams (kernels_cuda/params.cuh) as aligned NumPy dtypes.
MOD_AUX_DTYPE = np.dtype([("ptr", np.uint64, (MAX_AUX,)),
                          ("shape", np.int64, (MAX_AUX, MAX_AUX_DIMS)),
                          ("err", np.uint64)], align=True)
MOD_PARAMS_DTYPE = np.dtype([("mask", MOD_AUX_DTYPE), ("score", MOD_AUX_DTYPE)], align=True)

# What varlen.check_device_errors() raises (as part of its message) once a kernel has flagged an
# out-of-range aux index: the IndexError the host backends raise at once.
MOD_INDEX_ERROR = ("a mask_mod or score_mod read one of its aux arrays at an index "
                   "outside it (the CUDA kernels clamped the index into the array); every index "
                   "must lie in [0, size) of its dimension")

# The generated functions' names in the module source (mods.cuh's hooks).
MASK_FN, SCORE_FN, SCORE_GRAD_FN = "varlen_user_mask", "varlen_user_score", "varlen_user_score_grad"


@dataclass(frozen=True)
class ModHooks:
    """The user's functions one module is compiled with: the graph digests of the mask_mod and
    the score_mod ("" for none), which key the variant, and the source they generate (not
    compared: equal digests generate equal source)."""

    mask: str = ""
    score: str = ""
    source: str = field(default="", compare=False, repr=False)

    @property
    def label(self) -> str:
        return "-".join(x for x in (self.mask and f"mask{self.mask[:8]}",
                                    self.score and f"score{self.score[:8]}") if x)


_hooks: dict = {}
_CONSTANTS = """#ifndef INFINITY
#define INFINITY (::varlen::pos_inf())
#endif
#ifndef NAN
#define NAN (::varlen::nan_f())
#endif"""


def hooks_for(mods) -> ModHooks | None:
    """The `ModHooks` of a call's `varlen.mods.Mods` (None without functions), built once per
    pair of graphs."""
    if not mods:
        return None
    mask, score = mods.mask, mods.score
    key = (mask.digest if mask is not None else "", score.digest if score is not None else "")
    hooks = _hooks.get(key)
    if hooks is None:
        # common.cuh first: the element types and, in the host emulation, __device__; NVRTC
        # has no INFINITY or NAN without the C library's math header
        parts = ['#include "common.cuh"', _CONSTANTS, CUDA_PRELUDE]
        if mask is not None:
            parts += [cuda_source(mask.graph, MASK_FN), f"#define VARLEN_MASK_MOD {MASK_FN}"]
        if score is not None:
            parts += [cuda_source(score.graph, SCORE_FN), f"#define VARLEN_SCORE_MOD {SCORE_FN}",
                      cuda_source(score.d_score(), SCORE_GRAD_FN),
                      f"#define VARLEN_SCORE_MOD_GRAD {SCORE_GRAD_FN}"]
        hooks = _hooks[key] = ModHooks(*key, "\n".join(parts) + "\n")
    return hooks


def module_source(hooks: ModHooks | None = None) -> str:
    """The source of a module: the entry file, after the user's functions if any."""
    return (hooks.source if hooks is not None else "") + f'#include "{ENTRY_FILE}"\n'


def refusal(mods, *, impl: str, backward: bool) -> str | None:
    """Why the kernels of `impl` ("mma" | "sm90a") cannot run a call's `mods` (None: they can);
    `backward`: the call wants gradients."""
    if not mods:
        return None
    if mods.aux_grads:
        return ("it does not compute gradients of a score_mod's aux arrays (aux_grads=True): "
                "the CUDA kernels run mask_mod and score_mod, forward and backward, but not "
                "their aux gradients; use backend='cpu' or 'numpy' for those")
    if impl == "sm90a" and backward:
        return ("its sm_90a backward does not run a mask_mod or score_mod; backend='cupy' "
                "(cupy:mma's backward) runs them")
    for role, mod in (("mask_mod", mods.mask), ("score_mod", mods.score)):
        if mod is None:
            continue
        if len(mod.aux) > MAX_AUX:
            return f"its kernels take at most {MAX_AUX} aux arrays per function; the {role} " \
                   f"has {len(mod.aux)}"
        deep = [i for i, (_, ndim, _) in enumerate(mod.graph.aux) if ndim > MAX_AUX_DIMS]
        if deep:
            return (f"its kernels index aux arrays of at most {MAX_AUX_DIMS} dimensions; "
                    f"{role} aux argument {deep[0]} has {mod.graph.aux[deep[0]][1]}")
    return None


def _aux_struct(arg, mod, address) -> None:
    for i, a in enumerate(mod.aux):
        arg["ptr"][i] = address(a)
        shape = tuple(int(n) for n in a.shape)
        arg["shape"][i] = shape + (1,) * (MAX_AUX_DIMS - len(shape))


def needs_flag(mods) -> bool:
    """Whether the functions read an aux array (and so may flag an index)."""
    return any(mod is not None and mod.aux for mod in (mods.mask, mods.score))


def mod_params_arg(mods, err, address) -> np.ndarray:
    """The kernels' `ModParams` of a call's `mods` (None: all zero): each function's aux arrays
    (contiguous working arrays) by device address (`address`) and shape, and the address of the
    int32 error flag `err` (None: null, the generated code then flags nothing)."""
    arg = np.zeros((), MOD_PARAMS_DTYPE)
    if mods:
        for name, mod in (("mask", mods.mask), ("score", mods.score)):
            if mod is not None:
                _aux_struct(arg[name], mod, address)
                arg[name]["err"] = address(err)
    return arg


def error_flag(mods):
    """A zeroed int32 device flag for the call's kernels to set, or None when its functions
    read no aux array."""
    if not mods or not needs_flag(mods):
        return None
    import cupy
    return cupy.zeros((), np.int32)


def record_errors(err) -> None:
    """Or the kernels' flag into `varlen.check_device_errors()`'s record (a device operation,
    no host read)."""
    if err is None:
        return
    import cupy

    from ..._device_errors import record
    record(cupy, err, MOD_INDEX_ERROR, IndexError)
