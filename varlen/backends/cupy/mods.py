"""The call's mask_mod and score_mod in the CuPy kernels (kernels_cuda/mods.cuh).

A module is compiled per pair of functions: `hooks_for(mods)` gives the `ModHooks` of a call,
the generated CUDA C (varlen/mods/codegen.py) that goes ahead of the kernel sources and the
macros that name it (with a mask_mod, also its class code, `varlen.mods.class_graph`: the class
of a box of positions, which the kernels compute per tile instead of reading a table); its
graph digests (which cover the aux arrays' dtypes) are part of every variant that carries it (`mma.KernelSpec.mods`, `sm90.FwdSpec.mods`), so the module cache and
the sm_90a cubin cache never give one function's kernels to another. The aux arrays reach the
kernels in the params struct (`ModParams`: one `ModAux` of pointers and shapes per function),
with a device flag the generated code sets on an out-of-range aux index; the launcher ors it
into `varlen.check_device_errors()`'s record (`MOD_INDEX_ERROR`) without a host read.

With `aux_grads` the module also carries `varlen_user_score_aux_grad`: for each read of a
float aux array by the score_mod (`ScoreMod.d_aux()`), dS * d(score_mod)/d(aux[index]) added
at the read's (clamped) index into that aux's gradient buffer, whose addresses
`ModParams::grad` carries (`aux_grad_buffers`, `aux_grads_result`): a float32 atomicAdd, or
with `deterministic=True` (`ModParams::grad_fixed`, a launch argument, not a variant) integer
atomics into fixed-point words (kernels_cuda/aux_fixed.cuh, `varlen.backends._aux_fixed`),
turned into float32 after the backward.

`refusal(mods, impl, backward)` says what the kernels do not run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...mods import class_graph
from ...mods.codegen import CUDA_PRELUDE, cuda_source
from .. import _aux_fixed
from .compile import ENTRY_FILE

MAX_AUX = 8                   # VARLEN_MAX_AUX
MAX_AUX_DIMS = 4              # ModAux::shape[i][4]
# The kernels' ModAux and ModParams (kernels_cuda/params.cuh) as aligned NumPy dtypes.
MOD_AUX_DTYPE = np.dtype([("ptr", np.uint64, (MAX_AUX,)),
                          ("shape", np.int64, (MAX_AUX, MAX_AUX_DIMS)),
                          ("err", np.uint64)], align=True)
MOD_PARAMS_DTYPE = np.dtype([("mask", MOD_AUX_DTYPE), ("score", MOD_AUX_DTYPE),
                             ("grad", np.uint64, (MAX_AUX,)), ("grad_fixed", np.int32)],
                            align=True)

# What varlen.check_device_errors() raises (as part of its message) once a kernel has flagged an
# out-of-range aux index: the IndexError the host backends raise at once.
MOD_INDEX_ERROR = ("a mask_mod or score_mod read one of its aux arrays at an index "
                   "outside it (the CUDA kernels clamped the index into the array); every index "
                   "must lie in [0, size) of its dimension")

# The generated functions' names in the module source (mods.cuh's hooks).
MASK_FN, SCORE_FN, SCORE_GRAD_FN = "varlen_user_mask", "varlen_user_score", "varlen_user_score_grad"
MASK_CLASS_FN = "varlen_user_mask_class"
AUX_GRAD_FN = "varlen_user_score_aux_grad"


@dataclass(frozen=True)
class ModHooks:
    """The user's functions one module is compiled with: the graph digests of the mask_mod and
    the score_mod ("" for none) and whether the backward adds the score_mod's aux gradients,
    which key the variant, and the source they generate (not compared: equal keys generate
    equal source)."""

    mask: str = ""
    score: str = ""
    aux_grads: bool = False
    source: str = field(default="", compare=False, repr=False)

    @property
    def label(self) -> str:
        return "-".join(x for x in (self.mask and f"mask{self.mask[:8]}",
                                    self.score and f"score{self.score[:8]}",
                                    self.aux_grads and "auxgrads") if x)


_hooks: dict = {}
_CONSTANTS = """#ifndef INFINITY
#define INFINITY (::varlen::pos_inf())
#endif
#ifndef NAN
#define NAN (::varlen::nan_f())
#endif"""


def hooks_for(mods, *, backward: bool = False) -> ModHooks | None:
    """The `ModHooks` of a call's `varlen.mods.Mods` (None without functions), built once per
    pair of graphs; with the aux gradients' code for the `backward` of a call that wants
    them."""
    if not mods:
        return None
    mask, score = mods.mask, mods.score
    key = (mask.digest if mask is not None else "", score.digest if score is not None else "",
           backward and bool(mods.aux_grads) and score is not None)
    hooks = _hooks.get(key)
    if hooks is None:
        # common.cuh first: the element types and, in the host emulation, __device__; NVRTC
        # has no INFINITY or NAN without the C library's math header
        parts = ['#include "common.cuh"', _CONSTANTS, CUDA_PRELUDE]
        if mask is not None:
            parts += [cuda_source(mask.graph, MASK_FN), f"#define VARLEN_MASK_MOD {MASK_FN}",
                      cuda_source(class_graph(mask.graph), MASK_CLASS_FN, float_t="double"),
                      f"#define VARLEN_MASK_MOD_CLASS {MASK_CLASS_FN}"]
        if score is not None:
            parts += [cuda_source(score.graph, SCORE_FN), f"#define VARLEN_SCORE_MOD {SCORE_FN}",
                      cuda_source(score.d_score(), SCORE_GRAD_FN),
                      f"#define VARLEN_SCORE_MOD_GRAD {SCORE_GRAD_FN}"]
        if key[2]:
            parts += ['#include "aux_fixed.cuh"', _aux_grad_source(score.graph, score.d_aux()),
                      f"#define VARLEN_SCORE_MOD_AUX_GRAD {AUX_GRAD_FN}"]
        hooks = _hooks[key] = ModHooks(*key, "\n".join(parts) + "\n")
    return hooks


def _aux_grad_source(graph, d_aux) -> str:
    """`AUX_GRAD_FN(ds, score, b, h, q_idx, k_idx, aux, grad, fixed)`: for each float aux read
    of the score graph, its derivative times `ds`, added (when nonzero) at the read's row-major
    index, each dimension's index clamped as the read clamps it (and flagged), into
    `grad[aux]`: a float32 atomicAdd, or with `fixed` into the entry's fixed-point words."""
    from ...mods.graph import Graph
    leaves = ", ".join(graph.leaves)
    parts, body = [], []
    for n, (load, d_graph) in enumerate(d_aux):
        parts.append(cuda_source(d_graph, f"{AUX_GRAD_FN}_d{n}"))
        flat = "0LL"
        for d, arg in enumerate(load.args):
            name = f"{AUX_GRAD_FN}_i{n}_{d}"
            parts.append(cuda_source(Graph(arg, graph.leaves, graph.aux, f"{graph.role}_index"),
                                     name))
            shape = f"aux.shape[{load.value}][{d}]"
            flat = f"({flat}) * {shape} + vl_clamp_index({name}({leaves}, aux), {shape}, aux.err)"
        words = f"reinterpret_cast<unsigned long long*>(grad[{load.value}])"
        body.append(f"    {{\n        const float g = ds * {AUX_GRAD_FN}_d{n}({leaves}, aux);\n"
                    f"        if (g != 0.f) {{\n"
                    f"            const long long e = {flat};\n"
                    f"            if (fixed) ::varlen::fixed_add({words} + "
                    f"::varlen::FIXED_WORDS * e, g);\n"
                    f"            else atomicAdd(grad[{load.value}] + e, g);\n        }}\n    }}")
    params = ", ".join(f"{'float' if x == 'score' else 'long long'} {x}" for x in graph.leaves)
    parts.append(f"__device__ __forceinline__ void {AUX_GRAD_FN}(float ds, {params}, "
                 f"const ModAux& aux, float* const* grad, bool fixed) {{\n" +
                 "\n".join(body) + "\n}")
    return "\n".join(parts) + "\n"


def module_source(hooks: ModHooks | None = None) -> str:
    """The source of a module: the entry file, after the user's functions if any."""
    return (hooks.source if hooks is not None else "") + f'#include "{ENTRY_FILE}"\n'


def refusal(mods, *, impl: str, backward: bool) -> str | None:
    """Why the kernels of `impl` ("mma" | "sm90a") cannot run a call's `mods` (None: they can);
    `backward`: the call wants gradients (aux gradients run with deterministic=True too)."""
    if not mods:
        return None
    if mods.aux_grads and impl == "sm90a" and backward:
        return ("its sm_90a backward does not compute gradients of a score_mod's aux arrays "
                "(aux_grads=True); backend='cupy' (cupy:mma's backward) does")
    if impl == "sm90a" and backward and mods.score is not None:
        return ("its sm_90a backward does not run a score_mod (a mask_mod it runs): the "
                "score_mod's per-pair arithmetic beside the dK, dV, S and dP registers of its "
                "consumer warpgroups spills; backend='cupy' (cupy:mma's backward) runs it")
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


def mod_params_arg(mods, err, address, grads=None) -> np.ndarray:
    """The kernels' `ModParams` of a call's `mods` (None: all zero): each function's aux arrays
    (contiguous working arrays) by device address (`address`) and shape, the address of the
    int32 error flag `err` (None: null, the generated code then flags nothing), and of the
    score_mod's aux gradient buffers `grads` (`aux_grad_buffers`; None: null), fixed-point
    words (`grad_fixed`) when they are uint64."""
    arg = np.zeros((), MOD_PARAMS_DTYPE)
    if mods:
        for name, mod in (("mask", mods.mask), ("score", mods.score)):
            if mod is not None:
                _aux_struct(arg[name], mod, address)
                arg[name]["err"] = address(err)
    for i, g in enumerate(grads or ()):
        if g is not None:
            arg["grad"][i] = address(g)
            arg["grad_fixed"] = g.dtype == np.uint64
    return arg


def aux_grad_buffers(mods, *, deterministic: bool = False):
    """Zeroed device buffers, one per float aux array of the score_mod (None for the others),
    when the call wants aux gradients (else None): flat float32, or with `deterministic` the
    uint64 fixed-point words (`_aux_fixed.buffer`)."""
    if not mods or not mods.aux_grads or mods.score is None:
        return None
    import cupy
    size = [int(a.size) if kind == "float" else None
            for (kind, _, _), a in zip(mods.score.graph.aux, mods.score.aux)]
    if deterministic:
        return tuple(None if n is None else _aux_fixed.buffer(cupy, n) for n in size)
    return tuple(None if n is None else cupy.zeros(n, np.float32) for n in size)


def aux_grads_result(mods, grads, *, deterministic: bool = False) -> tuple:
    """The backward's fourth result: per score_mod aux its gradient (float32, the aux's
    shape) or None; fixed-point words (`deterministic`) converted on the device first."""
    if deterministic:
        grads = tuple(None if g is None else _fixed_to_float32(g) for g in grads)
    return tuple(None if g is None else g.reshape(a.shape)
                 for g, a in zip(grads, mods.score.aux))


def _fixed_to_float32(words):
    """The float32 sums of fixed-point words (`_aux_fixed.to_float32`), an entry out of their
    range recorded for `varlen.check_device_errors()` (device array code, no host read)."""
    import cupy

    from ..._device_errors import record
    grad, out_of_range = _aux_fixed.to_float32(cupy, words)
    record(cupy, out_of_range, _aux_fixed.RANGE_ERROR, OverflowError)
    return grad


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
