"""Compile every Numba kernel to PTX for sm_80 and sm_90 with the real CUDA target (no GPU).

The simulator runs kernels as Python, so it never types them; NVVM does. Run in a process of
its own with NUMBA_ENABLE_CUDASIM=0 (the simulator replaces `numba.cuda` process-wide):

    NUMBA_ENABLE_CUDASIM=0 python tests/numba/compile_check.py [--quick]

Prints one JSON line: {"ok": [...], "failed": {name: error}, "narrow": {name: [place, ...]},
"audited": n, "f64": {name: [instruction, ...]}, "functions": n, "philox": [...],
"seconds": ...}; exit status 1 when anything failed, is narrow or computes in f64.

`philox` names the kernels (at sm_90) whose PTX holds a Philox multiplier: the dropout variants
must, the kernels without dropout must not (their Philox draws are compiled out).

`narrow` is the 64-bit audit: every kernel is typed once more and its typed IR, and that of
every device function it calls, is searched for signed integer arithmetic or `range()`
counters narrower than 64 bits. Numba indexes arrays in int64, so with none of those, no
element offset (row x heads x dim past 2**31 on real batches) is computed in 32 bits.

`f64` is the float32 audit: the device functions of the gallery's user functions
(tests/mods_cases.py) and of their derivatives, generated as the kernels compile them
(`numba_function(..., float32=True)`), are compiled to PTX alone and searched for f64
instructions (1/64 of the float32 rate on many GPUs). Their aux arrays are float32 or
integers: a float64 aux array is read (and converted once) in f64, as it is stored.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
import types as pytypes

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

import numpy as np  # noqa: E402
from numba import cuda, typeof  # noqa: E402
from numba import types as nt  # noqa: E402
from numba.cuda.compiler import compile_cuda  # noqa: E402

import numba.cuda.dispatcher as _dispatcher  # noqa: E402

import varlen  # noqa: E402
from varlen.backends import _numba_kernels as K  # noqa: E402
from varlen.mods import Mods  # noqa: E402
from varlen.plan import KernelView  # noqa: E402

CCS = ((8, 0), (9, 0))
_CC = [CCS[-1]]
# Device functions are compiled for "the current device"; without a GPU, say which one.
_dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=_CC[0])

i32, i64, f32 = nt.int32, nt.int64, nt.float32
ELEM = {"float16": nt.float16, "bfloat16": nt.uint16, "float32": nt.float32}


def a1(t):
    return t[::1]


def a2(t):
    return t[:, ::1]


def a3(t):
    return t[:, :, ::1]


# The plan record as the kernels receive it: the arrays of `KernelView`, then its sizes.
VIEW = nt.NamedTuple([a2(i32), a3(i32), a2(i32), a3(i32)] + [a2(i32)] * 6 + [a1(i32)] * 5 +
                     [a3(i32)] * 2 + [i64] * 9, KernelView)
SEQ_MASK = nt.NamedUniTuple(a1(i32), len(K.SeqMask._fields), K.SeqMask)
# A user function's `(aux arrays..., err)`: the error flag alone for a function a variant lacks.
NO_FN = nt.Tuple((a1(i32),))
# The dropout record (`_numba_launch.dropout_args`): threshold, seed lo, seed hi, offset, scale,
# head offset.
DROP = nt.Tuple((nt.uint32,) * 4 + (f32, nt.uint32))
# Philox 4x32's first multiplier as PTX writes an immediate (unsigned or signed 32-bit, or
# zero-extended to 64 bits).
PHILOX_IMMEDIATES = re.compile(r"(?<![\w.])(3528531795|-766435501|0xD2511F53)(?!\w)", re.I)


def _fn_args(mod):
    return nt.Tuple(tuple(typeof(np.ascontiguousarray(a)) for a in mod.aux) + (a1(i32),))


def _user_functions():
    """A MaskMod reading 1-D int arrays at a sequence-dependent index and a ScoreMod with an
    int table and a 2-D float table (aux gradients on): `(fns, mask args, score args, aux
    gradient args: float32 atomics, fixed-point words)`."""
    doc, start = np.zeros(64, np.int32), np.zeros(4, np.int32)
    mask = varlen.MaskMod(lambda b, q, k, doc, start: (doc[start[b] + q] == doc[start[b] + k]) &
                          (k <= q), doc, start)
    buckets, bias = np.arange(9, dtype=np.int32), np.zeros((4, 16), np.float32)
    score = varlen.ScoreMod(lambda s, b, h, q, k, bucket, bias: s + bias[
        h, bucket[varlen.minimum(abs(q - k), 8)] + varlen.where(k > q, 8, 0)], buckets, bias)
    fns = K.UserFns.of(Mods(mask=mask, score=score, aux_grads=True))
    return (fns, _fn_args(mask), _fn_args(score),
            (nt.Tuple((a1(f32), a1(f32))), nt.Tuple((a2(nt.uint64), a2(nt.uint64)))))


def kernels(quick: bool):
    """(name, python function, signature) of every kernel and variant worth typing."""
    out = [
        ("segments_from_cu", K.segments_from_cu,
         (a1(i32), a1(i32), i64, a2(i32), a2(i32), a2(i32), a1(i32), a1(i32))),
        ("to_int32[int32]", K.to_int32, (a1(i32), a1(i32))),
        ("to_int32[bool]", K.to_int32, (a1(nt.boolean), a1(i32))),
        ("or_flag", K.or_flag, (a1(i32), a1(i32))),
        ("tile_scan", K.tile_scan, (a2(i32), i64, i64, a1(i64), a1(i32))),
        ("tiles_and_schedule", K.tiles_and_schedule,
         (a1(i64), a2(i32), a2(i32), a2(i32), a2(i32), a2(i32), a2(i32), SEQ_MASK, i64, i64,
          i64, a2(i32), a3(i32), a3(i32))),
    ]
    for dt, el in ELEM.items():
        out.append((f"fill[{dt}]", K.fill, (a1(el), el)))
        out.append((f"convert[{dt}]", K.convert_kernel(dt), (a1(f32), a1(el))))
        out.append((f"delta[{dt}]", K.delta_kernel(dt), (a3(el), a3(el), a2(f32))))
    out.append(("fill[int32]", K.fill, (a1(i32), i32)))
    out.append(("aux_fixed", K.aux_fixed_kernel, (a2(nt.uint64), a1(f32), a1(i32))))
    # Every dtype, both sides of the softcap branch, and dropout (float32: the variant that
    # also types that dtype's loads and stores, so dropout costs no extra compile).
    variants = [("float16", True, False), ("bfloat16", True, False), ("float32", False, True)]
    if quick:
        variants = variants[:1]
    fns, mask_args, score_args, grads = _user_functions()
    variants = [(dt, softcap, K.UserFns(), NO_FN, NO_FN, (NO_FN, NO_FN), dropout)
                for dt, softcap, dropout in variants]
    # The user functions once (their code does not depend on the dtype of q, k, v).
    variants.append(("float16", True, fns, mask_args, score_args, grads, False))
    for dt, softcap, var_fns, margs, sargs, gargs, dropout in variants:
        el = ELEM[dt]
        var = K.Variant(dt, 64, 64, 32, 32, softcap, var_fns, dropout)
        tag = (f"{dt},softcap={softcap}" + (",mods" if var_fns.mask else "") +
               (",dropout" if dropout else ""))
        out.append((f"forward[{tag}]", K.forward_kernel(var),
                    (a3(el), a3(el), a3(el), a3(el), a2(f32), VIEW, f32, f32, margs, sargs,
                     DROP)))
        # deterministic (atomic_dq=False): the aux gradients in fixed-point words
        for atomic, g in ((True, gargs[0]), (False, gargs[1])):
            out.append((f"dkdv[{tag},atomic_dq={atomic}]", K.dkdv_kernel(var, atomic),
                        (a3(el), a3(el), a3(el), a3(el), a2(f32), a2(f32), a3(f32), a3(el),
                         a3(el), VIEW, f32, f32, margs, sargs, g, DROP)))
        out.append((f"dq[{tag}]", K.dq_kernel(var),
                    (a3(el), a3(el), a3(el), a3(el), a2(f32), a2(f32), a3(el), VIEW, f32,
                     f32, margs, sargs, DROP)))
    return out


def _narrow(ty) -> bool:
    """A signed integer type under 64 bits (indices, counts and positions are signed; the
    bf16 conversion's unsigned bit operations are no addresses)."""
    return isinstance(ty, nt.Integer) and ty.signed and ty.bitwidth < 64


def narrow_integers(cres, where: str, seen=None) -> list[str]:
    """`file:line` places in a typed function, and the device functions it calls, where a
    signed integer result of arithmetic or a `range()` counter is narrower than 64 bits."""
    seen = set() if seen is None else seen
    ann = cres.type_annotation
    found = []
    for block in ann.blocks.values():
        for stmt in block.body:
            expr = getattr(stmt, "value", None)
            if type(stmt).__name__ != "Assign" or type(expr).__name__ != "Expr":
                continue
            ty = ann.typemap.get(stmt.target.name)
            place = f"{where} line {stmt.loc.line}"
            if expr.op in ("binop", "inplace_binop", "unary") and _narrow(ty):
                found.append(f"{place}: {expr.fn} gives {ty}")
            if expr.op != "call":
                continue
            if isinstance(ty, nt.RangeType) and _narrow(ty.dtype):
                found.append(f"{place}: range() counts in {ty.dtype}")
            callee = getattr(ann.typemap.get(expr.func.name), "dispatcher", None)
            args = ann.calltypes[expr].args
            if callee is not None and (id(callee), args) not in seen:
                seen.add((id(callee), args))
                found += narrow_integers(callee.overloads[args], callee.py_func.__qualname__,
                                         seen)
    return found


def user_functions_f64():
    """`({name: [f64 instruction, ...]}, functions compiled)` over the gallery's user functions
    and their derivatives in the kernels' float32 form, as device functions (sm_90)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mods_cases import mask_cases, score_cases
    from varlen.mods import ScoreMod, split_mask
    from varlen.mods.codegen import numba_function
    from varlen.mods.derive import aux_derivatives, derivative

    mods = ([(f"mask[{i}]", split_mask(m)[1]) for i, m in mask_cases([5, 0, 17])] +
            [(f"score[{i}]", m) for i, m in score_cases(2)])
    found, n = {}, 0
    _CC[0] = CCS[-1]
    for name, mod in mods:
        graphs = [(name, mod.graph)]
        if isinstance(mod, ScoreMod):
            graphs.append((f"{name}.d_score", derivative(mod.graph, "score")))
            graphs += [(f"{name}.d_aux{j}", g) for j, (_, g) in
                       enumerate(aux_derivatives(mod.graph))]
        for label, g in graphs:
            fn = numba_function(g, cuda=True, packed=True, float32=True).py_func
            sig = tuple(f32 if leaf == "score" else i64 for leaf in g.leaves) + (_fn_args(mod),)
            try:
                ptx, _ = cuda.compile_ptx(fn, sig, device=True, cc=CCS[-1])
            except Exception as e:  # noqa: BLE001
                found[label] = [f"could not compile: {type(e).__name__}: {e}"[:2000]]
                continue
            n += 1
            ops = sorted(set(re.findall(r"^\s*([a-z][\w.]*\.f64)\b", ptx, re.M)))
            if ops:
                found[label] = ops
    return found, n


def main(argv):
    quick = "--quick" in argv
    t0 = time.time()
    ok, failed, narrow, audited, philox = [], {}, {}, 0, []
    for name, kern, sig in kernels(quick):
        fn = getattr(kern, "py_func", kern)
        for cc in CCS:
            _CC[0] = cc
            label = f"{name}@sm_{cc[0]}{cc[1]}"
            try:
                ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
                assert f".target sm_{cc[0]}{cc[1]}" in ptx, "unexpected PTX target"
                ok.append(label)
                if cc == CCS[-1] and PHILOX_IMMEDIATES.search(ptx):
                    philox.append(name)
            except Exception as e:  # noqa: BLE001
                failed[label] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc(file=sys.stderr)
        try:
            found = narrow_integers(compile_cuda(fn, None, sig, cc=CCS[-1]), name)
            audited += 1
        except Exception as e:  # noqa: BLE001
            found = [f"could not audit: {type(e).__name__}: {e}"[:2000]]
        if found:
            narrow[name] = found
    f64, functions = user_functions_f64()
    print(json.dumps({"ok": ok, "failed": failed, "narrow": narrow, "audited": audited,
                      "f64": f64, "functions": functions, "philox": philox,
                      "seconds": round(time.time() - t0, 1)}))
    return 1 if failed or narrow or f64 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
