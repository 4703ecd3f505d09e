"""Source code generated from a graph: scalar Python (for Numba on the CPU and in CUDA) and CUDA C
(for the NVRTC-compiled kernels).

Both are straight-line code: one temporary per node in dependency order, every node evaluated
(no short-circuit), integer `//` and `%` floored with 0 for a zero divisor, and every aux index
clamped into its array with the out-of-range case flagged in `err[0]` (the host raises a named
`IndexError`, a device records it for `varlen.check_device_errors()`).
"""
from __future__ import annotations

from .evaluate import RANGE_CAP, RANGE_OPS, DtypeRanges
from .graph import Graph, Node

__all__ = ["python_source", "cuda_source", "numba_function", "CUDA_PRELUDE"]

_PY_BIN = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "lt": "<", "le": "<=",
           "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def _leaf_params(graph: Graph) -> list:
    return list(graph.leaves)


def python_source(graph: Graph, name: str, *, packed: bool = False,
                  float_type: str | None = None) -> str:
    """`def name(<leaves>, a0, a1, ..., err):` returning the function's value.

    Aux arrays are passed as arrays (any rank), `err` a 1-element int32 array. Compiles as is
    with `numba.njit` and `numba.cuda.jit(device=True)` (and runs as plain Python). With
    `packed`, `def name(<leaves>, args):` reads them from one tuple `args = (a0, ..., err)`: a
    CUDA kernel passes a user function's arrays as one tuple, whatever their number, and
    Numba does not inline a call with `*args`.

    Floats are Python `float` (float64) by default. `float_type="float32"` makes every float
    temporary float32: conversions `float32(x)`, literals `float32(1.5)`, and math functions,
    comparisons and selections on float32 operands only (Numba widens a float32 mixed with a
    float64 or an int64 to float64), so Numba types the whole function in float32; the
    source then needs the name `float32` (`numpy.float32` or `numba.float32`) beside `math`.
    Integers stay 64-bit either way.
    """
    if float_type not in (None, "float32"):
        raise ValueError(f"float_type must be None or 'float32', not {float_type!r}")
    fl = _Floats(float_type)
    aux = [f"a{i}" for i in range(len(graph.aux))] + ["err"]
    args = _leaf_params(graph) + (["args"] if packed else aux)
    lines = [f"def {name}({', '.join(args)}):"]
    if packed:
        lines += [f"    {a} = args[{i}]" for i, a in enumerate(aux)]
    names = {}
    for n in graph.nodes():
        t = f"t{len(names)}"
        names[n.key()] = t
        lines.extend("    " + s for s in _py_stmt(n, t, [names[a.key()] for a in n.args], fl,
                                                 graph))
    ret = names[graph.root.key()]
    kind = graph.kind
    cast = {"float": fl.conv, "int": "int", "bool": "bool"}[kind]
    lines.append(f"    return {cast}({ret})" if graph.root.op == "const" else f"    return {ret}")
    return "\n".join(lines) + "\n"


class _Floats:
    """How generated Python spells floats: Python `float` (float64), or float32 throughout."""

    def __init__(self, float_type: str | None):
        self.f32 = float_type == "float32"
        self.conv = "float32" if self.f32 else "float"

    def lit(self, v: float) -> str:
        """The literal `v` in the float type."""
        text = repr(v) if v == v and abs(v) != float("inf") else (
            "math.nan" if v != v else ("math.inf" if v > 0 else "-math.inf"))
        if not self.f32:
            return text
        return f"-float32(math.inf)" if text == "-math.inf" else f"float32({text})"

    def zero(self) -> str:
        """0 for a comparison with a float: an int in float64 (as before), float32(0.0)."""
        return "float32(0.0)" if self.f32 else "0"


def _py_num(n: Node, x: str, fl: _Floats) -> str:
    """`x` as n's kind (bool operands of arithmetic become ints, as in Python)."""
    return f"{fl.conv}({x})" if n.kind == "float" else f"int({x})" if n.kind == "int" else x


def _py_stmt(n: Node, t: str, a: list, fl: _Floats, graph: Graph) -> list:
    op, kind = n.op, n.kind
    if op == "const":
        if kind == "float":
            return [f"{t} = {fl.lit(n.value)}"]
        return [f"{t} = {n.value!r}"]
    if op == "dim":
        return [f"{t} = a{n.value[0]}.shape[{n.value[1]}]"]
    if op in RANGE_OPS:
        return _py_range(n, t, a, fl, graph)
    if not n.args:
        return [f"{t} = {op}"]
    if op == "load":
        stmts = []
        aux = f"a{n.value}"
        idx = []
        for d, i in enumerate(a):
            j = f"{t}_i{d}"
            stmts += [f"{j} = {i}",
                      f"if {j} < 0 or {j} >= {aux}.shape[{d}]:",
                      f"    err[0] = 1",
                      f"    {j} = 0 if {j} < 0 else {aux}.shape[{d}] - 1"]
            idx.append(j)
        conv = fl.conv if kind == "float" else "int" if kind == "int" else "bool"
        return stmts + [f"{t} = {conv}({aux}[{', '.join(idx)}])"]
    if op in _PY_BIN:
        x, y = a
        if op in ("add", "sub", "mul", "truediv"):
            return [f"{t} = {_py_num(n, x, fl)} {_PY_BIN[op]} {_py_num(n, y, fl)}"]
        if fl.f32 and _promote_kind([v.kind for v in n.args]) == "float":
            # an int or a float64 beside a float32 would widen the comparison to float64
            return [f"{t} = float32({x}) {_PY_BIN[op]} float32({y})"]
        return [f"{t} = {x} {_PY_BIN[op]} {y}"]
    if op in ("floordiv", "mod"):
        x, y = (_py_num(n, v, fl) for v in a)
        sym = "//" if op == "floordiv" else "%"
        if kind == "float" and fl.f32:
            z, inf, nan = fl.zero(), fl.lit(float("inf")), fl.lit(float("nan"))
            other = (f"(({inf} if {x} > {z} else -{inf}) if {x} != {z} else {nan})"
                     if op == "floordiv" else nan)
            return [f"{t} = {x} {sym} {y} if {y} != {z} else {other}"]
        if kind == "float":
            return [f"{t} = {x} {sym} {y} if {y} != 0.0 else "
                    f"({'math.inf * (1 if ' + x + ' > 0 else -1) if ' + x + ' != 0 else math.nan' if op == 'floordiv' else 'math.nan'})"]
        return [f"{t} = {x} {sym} {y} if {y} != 0 else 0"]
    if op in ("and", "or", "xor"):
        sym = {"and": "&", "or": "|", "xor": "^"}[op]
        x, y = a
        if kind == "bool":
            return [f"{t} = bool({x}) {sym} bool({y})"]
        return [f"{t} = int({x}) {sym} int({y})"]
    if op in ("minimum", "maximum"):
        x, y = (_py_num(n, v, fl) for v in a)
        cmp = "<=" if op == "minimum" else ">="
        return [f"{t} = {x} if {x} {cmp} {y} else {y}"]
    if op == "where":
        c, x, y = a
        return [f"{t} = {_py_num(n, x, fl)} if {c} else {_py_num(n, y, fl)}"]
    (x,) = a
    if op == "neg":
        return [f"{t} = -{_py_num(n, x, fl)}"]
    if op == "abs":
        return [f"{t} = abs({_py_num(n, x, fl)})"]
    if op == "invert":
        return [f"{t} = not {x}"] if kind == "bool" else [f"{t} = ~int({x})"]
    # float32: the operand converted first (an int compared with float32(0.0) would widen)
    x, arg = (f"float32({x})",) * 2 if fl.f32 else (x, f"float({x})")
    z, nan = fl.zero(), fl.lit(float("nan"))
    if op == "log":
        return [f"{t} = math.log({arg}) if {x} > {z} else "
                f"({fl.lit(-float('inf'))} if {x} == {z} else {nan})"]
    if op == "sqrt":
        return [f"{t} = math.sqrt({arg}) if {x} >= {z} else {nan}"]
    if op in ("exp", "tanh"):
        return [f"{t} = math.{op}({arg})"]
    raise AssertionError(op)


def _range_fallback(n: Node, graph: Graph):
    """The bound of a `range_lo` / `range_hi` node past its cap: the aux dtype's (`DtypeRanges`)."""
    lo, hi = DtypeRanges.of_dtype(graph.aux[n.value][2])
    v = lo if n.op == "range_lo" else hi
    return float(v) if n.kind == "float" else int(v)


def _py_range(n: Node, t: str, a: list, fl: _Floats, graph: Graph) -> list:
    """A run's min (`range_lo`) or max (`range_hi`): `a = (contiguous, leading indices...,
    first, last)` of aux `n.value`'s last dimension, read entry by entry (NaN propagates), or
    its dtype's bound past `RANGE_CAP` entries or off one run."""
    contiguous, lead, first, last = a[0], a[1:-2], a[-2], a[-1]
    aux = f"a{n.value}"
    conv = fl.conv if n.kind == "float" else "int"
    bound = _range_fallback(n, graph)
    cmp = "<" if n.op == "range_lo" else ">"
    at = ", ".join([*lead, "{}"])
    return [f"{t} = {fl.lit(bound) if n.kind == 'float' else repr(bound)}",
            f"if {contiguous} and {last} - {first} < {RANGE_CAP}:",
            f"    {t} = {conv}({aux}[{at.format(first)}])",
            f"    for {t}_j in range({first} + 1, {last} + 1):",
            f"        {t}_v = {conv}({aux}[{at.format(t + '_j')}])",
            f"        if {t}_v != {t}_v or ({t} == {t} and {t}_v {cmp} {t}):",
            f"            {t} = {t}_v"]


_NUMBA_CACHE: dict = {}


def numba_function(graph: Graph, *, cuda: bool = False, packed: bool = False,
                   float32: bool = False):
    """The graph compiled with Numba: an `njit` function, or a CUDA device function.

    Cached per graph digest, target, form and float type; the function takes
    `(<leaves>, a0, ..., err)`, or `(<leaves>, (a0, ..., err))` with `packed`, and computes its
    floats in float64, or in float32 with `float32` (`python_source`).
    """
    key = (graph.digest, cuda, packed, float32)
    fn = _NUMBA_CACHE.get(key)
    if fn is None:
        import math

        import numba
        name = f"{graph.role}_{graph.digest}" + ("_f32" if float32 else "")
        scope = {"math": math, "float32": numba.float32}
        src = python_source(graph, name, packed=packed,
                            float_type="float32" if float32 else None)
        exec(compile(src, f"<{name}>", "exec"), scope)
        py = scope[name]
        if cuda:
            from numba import cuda as nb_cuda
            fn = nb_cuda.jit(device=True, inline=True)(py)
        else:
            from numba import njit
            fn = njit(inline="always", error_model="numpy", cache=False)(py)
        _NUMBA_CACHE[key] = fn
    return fn


# --------------------------------------------------------------------------------------------
# CUDA C
# --------------------------------------------------------------------------------------------

CUDA_PRELUDE = r"""
#ifndef VARLEN_MODS_PRELUDE
#define VARLEN_MODS_PRELUDE
// What a generated mask_mod / score_mod reads of its aux arrays: base pointers and shapes
// (at most 4 dimensions each), row-major and contiguous. Guarded on its own: a kernel header
// may define the same struct first (the CuPy kernels' params.cuh).
#ifndef VARLEN_MOD_AUX
#define VARLEN_MOD_AUX
#define VARLEN_MAX_AUX 8
struct ModAux {
    const void* ptr[VARLEN_MAX_AUX];
    long long shape[VARLEN_MAX_AUX][4];
    int* err;                           // device flag: an aux index was out of range
};
#endif
__device__ __forceinline__ long long vl_floordiv(long long a, long long b) {
    if (b == 0) return 0;
    long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long vl_mod(long long a, long long b) {
    if (b == 0) return 0;
    long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
template <typename F> __device__ __forceinline__ F vl_fmod(F a, F b) {
    F r = fmod(a, b);
    return (r != F(0) && ((r < F(0)) != (b < F(0)))) ? r + b : r;
}
__device__ __forceinline__ int vl_floordiv(int a, int b) {
    if (b == 0) return 0;
    int q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int vl_mod(int a, int b) {
    if (b == 0) return 0;
    int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ long long vl_clamp_index(long long i, long long n, int* err) {
    if (i < 0 || i >= n) { if (err) *err = 1; return i < 0 ? 0 : n - 1; }
    return i;
}
#endif
"""

_C_TYPES = {"bool": "bool", "int": "long long"}
_AUX_C = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
          "float64": "double", "int8": "signed char", "int16": "short", "int32": "int",
          "int64": "long long", "uint8": "unsigned char", "uint16": "unsigned short",
          "uint32": "unsigned int", "uint64": "unsigned long long", "bool": "bool"}


def cuda_source(graph: Graph, name: str, float_t: str = "float") -> str:
    """`__device__ <T> name(<leaves>, const ModAux& aux)`: the graph in CUDA C.

    Floats compute in `float_t` (float in the kernels, double to check them); an integer node
    in 32 bits where its value and its integer operands' fit them for every input (positions,
    sequence and head numbers are int32, aux entries bounded by their dtypes: `int32_nodes`),
    else in 64. Needs `CUDA_PRELUDE` (and cuda_fp16/cuda_bf16 for half aux arrays) before it.
    """
    narrow = int32_nodes(graph)

    def ctype(n: Node) -> str:
        if n.kind == "int":
            return "int" if n.key() in narrow else "long long"
        return float_t if n.kind == "float" else "bool"
    params = []
    for leaf in graph.leaves:
        params.append(f"{float_t if leaf == 'score' else 'long long'} {leaf}")
    params.append("const ModAux& aux")
    lines = [f"__device__ __forceinline__ {ctype(graph.root)} {name}({', '.join(params)}) {{"]
    names = {}
    for n in graph.nodes():
        t = f"t{len(names)}"
        names[n.key()] = t
        expr = _c_expr(n, [names[a.key()] for a in n.args], ctype, graph)
        lines.append(f"    const {ctype(n)} {t} = {expr};")
    lines.append(f"    return {names[graph.root.key()]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


_INT32 = (-(1 << 31), (1 << 31) - 1)


def int32_nodes(graph: Graph) -> set:
    """Keys of the integer nodes generated code computes in 32 bits: those whose value fits
    int32 for any input and whose integer operands are such nodes too (so no operand is cut).
    Bounds by interval arithmetic with the leaves over int32 and aux entries by dtype."""
    import numpy as np
    from .evaluate import DtypeRanges, _intervals
    top = np.int64(_INT32[1])
    boxes = {leaf: (np.int64(0), top) for leaf in graph.leaves if leaf != "score"}
    boxes["score"] = (np.float64(-np.inf), np.float64(np.inf))
    bounds = _intervals(graph, boxes, DtypeRanges(graph))
    narrow = set()
    for n in graph.nodes():
        lo, hi = bounds[n.key()]
        fits = n.kind == "int" and _INT32[0] <= int(np.min(lo)) and int(np.max(hi)) <= _INT32[1]
        if fits and all(a.kind != "int" or a.key() in narrow for a in n.args
                        if n.op != "load"):
            narrow.add(n.key())
    return narrow


def _c_expr(n: Node, a: list, ctype, graph: Graph) -> str:
    op, kind = n.op, n.kind
    T = ctype(n)
    if op == "const":
        if kind == "float":
            v = n.value
            if v != v:
                return f"({T})NAN"
            if abs(v) == float("inf"):
                return f"({T})({'-' if v < 0 else ''}INFINITY)"
            return f"({T}){v!r}"
        if kind == "bool":
            return "true" if n.value else "false"
        return f"{n.value}" if T == "int" else f"{n.value}LL"
    if op == "dim":
        return f"({T})aux.shape[{n.value[0]}][{n.value[1]}]"
    if op in RANGE_OPS:
        return _c_range(n, a, T, graph)
    if not n.args:
        return f"({T}){op}"
    if op == "load":
        dt = graph.aux[n.value][2]
        shape = f"aux.shape[{n.value}]"
        flat = "0LL"
        for d, i in enumerate(a):
            flat = f"({flat}) * {shape}[{d}] + vl_clamp_index({i}, {shape}[{d}], aux.err)"
        read = f"((const {_AUX_C[dt]}*)aux.ptr[{n.value}])[{flat}]"
        if dt in ("float16", "bfloat16"):
            read = f"(float){read}"
        return f"({T})({read})"
    cast = [f"({T}){x}" for x in a]
    if op in _PY_BIN:
        if op in ("add", "sub", "mul", "truediv"):
            return f"{cast[0]} {_PY_BIN[op]} {cast[1]}"
        ct = _common_type([ctype(x) for x in n.args])
        return f"({ct}){a[0]} {_PY_BIN[op]} ({ct}){a[1]}"
    if op == "floordiv":
        return (f"vl_floordiv({cast[0]}, {cast[1]})" if kind == "int"
                else f"floor({cast[0]} / {cast[1]})")
    if op == "mod":
        return (f"vl_mod({cast[0]}, {cast[1]})" if kind == "int"
                else f"vl_fmod<{T}>({cast[0]}, {cast[1]})")
    if op in ("and", "or", "xor"):
        sym = {"and": "&", "or": "|", "xor": "^"}[op]
        if kind == "bool":
            return f"(bool)({a[0]}) {sym} (bool)({a[1]})"
        return f"{cast[0]} {sym} {cast[1]}"
    if op in ("minimum", "maximum"):
        cmp = "<=" if op == "minimum" else ">="
        return f"({cast[0]} {cmp} {cast[1]}) ? {cast[0]} : {cast[1]}"
    if op == "where":
        return f"{a[0]} ? ({T}){a[1]} : ({T}){a[2]}"
    (x,) = a
    if op == "neg":
        return f"-{cast[0]}"
    if op == "abs":
        return f"({cast[0]} < 0) ? -{cast[0]} : {cast[0]}"
    if op == "invert":
        return f"!{x}" if kind == "bool" else f"~{cast[0]}"
    if op in ("exp", "log", "tanh", "sqrt"):
        return f"{op}({cast[0]})"
    raise AssertionError(op)


def _c_literal(v, T: str) -> str:
    if isinstance(v, float):
        return f"({T})({'-' if v < 0 else ''}INFINITY)" if abs(v) == float("inf") else f"({T}){v!r}"
    return f"({T}){v}LL"


def _c_range(n: Node, a: list, T: str, graph: Graph) -> str:
    """`_py_range` in CUDA C: an immediately called lambda over the run's entries."""
    contiguous, lead, first, last = a[0], a[1:-2], a[-2], a[-1]
    i, dt = n.value, graph.aux[n.value][2]
    shape = f"aux.shape[{i}]"
    base = "0LL"
    for d, x in enumerate(lead):
        base = f"({base}) * {shape}[{d}] + {x}"
    base = f"({base}) * {shape}[{len(lead)}]"
    half = "(float)" if dt in ("float16", "bfloat16") else ""
    cmp = "<" if n.op == "range_lo" else ">"
    return (f"[&]() -> {T} {{\n"
            f"        if (!({contiguous}) || {last} - {first} >= {RANGE_CAP}) "
            f"return {_c_literal(_range_fallback(n, graph), T)};\n"
            f"        const {_AUX_C[dt]}* p = (const {_AUX_C[dt]}*)aux.ptr[{i}] + {base};\n"
            f"        {T} m = ({T})({half}p[{first}]);\n"
            f"        for (long long j = {first} + 1; j <= {last}; ++j) {{\n"
            f"            const {T} v = ({T})({half}p[j]);\n"
            f"            if (v != v || (m == m && v {cmp} m)) m = v;\n"
            f"        }}\n"
            f"        return m;\n"
            f"    }}()")


def _promote_kind(kinds) -> str:
    """Python's promotion of value kinds: bool < int < float."""
    order = ("bool", "int", "float")
    return max(kinds, key=order.index)


def _common_type(types) -> str:
    """The C type two operands of a comparison meet in (float over 64-bit over 32-bit ints)."""
    order = ("bool", "int", "long long", "float", "double")
    return max(types, key=order.index)
