"""A graph evaluated with array code (NumPy or CuPy): the reference and the host backends.

`evaluate` computes the function elementwise over broadcast leaf arrays; `interval` computes,
for boxes of leaf values, bounds that hold for every point of the box (interval arithmetic),
which is how a plan classifies a tile without visiting its pairs.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph, Node

__all__ = ["evaluate", "evaluate_node", "scatter_aux_grads", "interval", "may_read_outside",
           "AuxRanges", "index_error"]

_INT = np.int64


def _xp(*arrays):
    for a in arrays:
        if type(a).__module__.split(".")[0] == "cupy":
            import cupy
            return cupy
    return np


def index_error(role: str, i: int, shape, bad) -> IndexError:
    return IndexError(f"{role} reads aux argument {i} (shape {tuple(shape)}) at index "
                      f"{tuple(int(x) for x in bad)}, outside it; every index must lie in "
                      f"[0, size) of its dimension")


def _floordiv(xp, a, b, kind):
    if kind == "float":
        return xp.floor_divide(a, b)
    zero = b == 0
    return xp.where(zero, 0, xp.floor_divide(a, xp.where(zero, 1, b)))


def _mod(xp, a, b, kind):
    if kind == "float":
        return xp.remainder(a, b)
    zero = b == 0
    return xp.where(zero, 0, xp.remainder(a, xp.where(zero, 1, b)))


def _cast(xp, x, kind, float_dtype):
    if kind == "float":
        return xp.asarray(x, dtype=float_dtype)
    if kind == "int":
        return xp.asarray(x, dtype=_INT)
    return xp.asarray(x, dtype=bool)


def _apply(xp, node: Node, args, float_dtype):
    op, kind = node.op, node.kind
    if op in ("and", "or", "xor"):
        f = {"and": xp.bitwise_and, "or": xp.bitwise_or, "xor": xp.bitwise_xor}[op]
        return f(*(_cast(xp, a, kind, float_dtype) for a in args))
    if op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "minimum", "maximum"):
        a, b = (_cast(xp, a, kind, float_dtype) for a in args)
        if op == "floordiv":
            return _floordiv(xp, a, b, kind)
        if op == "mod":
            return _mod(xp, a, b, kind)
        return {"add": xp.add, "sub": xp.subtract, "mul": xp.multiply, "truediv": xp.true_divide,
                "minimum": xp.minimum, "maximum": xp.maximum}[op](a, b)
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        return {"lt": xp.less, "le": xp.less_equal, "gt": xp.greater, "ge": xp.greater_equal,
                "eq": xp.equal, "ne": xp.not_equal}[op](*args)
    (a,) = args[:1]
    if op == "where":
        c, a, b = args
        return xp.where(c, _cast(xp, a, kind, float_dtype), _cast(xp, b, kind, float_dtype))
    if op == "neg":
        return xp.negative(_cast(xp, a, kind, float_dtype))
    if op == "abs":
        return xp.abs(_cast(xp, a, kind, float_dtype))
    if op == "invert":
        return xp.logical_not(a) if kind == "bool" else xp.invert(_cast(xp, a, "int", None))
    if op in ("exp", "log", "tanh", "sqrt"):
        return getattr(xp, op)(_cast(xp, a, "float", float_dtype))
    raise AssertionError(op)


def evaluate(graph: Graph, leaves: dict, aux, *, float_dtype=np.float64, check: bool = True):
    """The function's value at every (broadcast) point of `leaves` (name -> array).

    `aux` are the aux arrays (NumPy or CuPy). An index outside an aux array is an `IndexError`
    naming it when `check`; otherwise it is clamped into the array, as the kernels do.
    """
    xp = _xp(*leaves.values(), *aux)
    vals = {}
    with np.errstate(all="ignore"):
        for n in graph.nodes():
            if n.op == "const":
                v = n.value
            elif n.op in leaves:
                v = leaves[n.op]
            elif n.op == "load":
                v = _load(xp, graph.role, n, aux, [vals[a.key()] for a in n.args], check)
            elif not n.args:
                raise ValueError(f"{graph.role} uses {n.op}, which this call does not provide")
            else:
                v = _apply(xp, n, [vals[a.key()] for a in n.args], float_dtype)
            vals[n.key()] = v
    return _cast(xp, vals[graph.root.key()], graph.kind, float_dtype)


def _load(xp, role, node: Node, aux, idx, check: bool):
    a = aux[node.value]
    idx = [xp.asarray(i, dtype=_INT) for i in idx]
    if check:
        for d, i in enumerate(idx):
            bad = (i < 0) | (i >= a.shape[d])
            if bool(bad.any()):
                full = xp.broadcast_arrays(*idx)
                first = tuple(int(x) for x in xp.argwhere(xp.broadcast_to(bad, full[0].shape))[0])
                raise index_error(role, node.value, a.shape, [j[first] for j in full])
    idx = [xp.clip(i, 0, a.shape[d] - 1) for d, i in enumerate(idx)]
    v = a[tuple(idx)]
    if node.kind == "float":
        return v.astype(np.float64)
    return v.astype(bool) if node.kind == "bool" else v.astype(_INT)


# --------------------------------------------------------------------------------------------
# Interval arithmetic
# --------------------------------------------------------------------------------------------

class AuxRanges:
    """Range queries over the aux arrays (flattened): min and max of any contiguous run of
    entries in O(1) from a sparse table (O(n log n) to build, once per call)."""

    def __init__(self, aux):
        self.tables = []
        for a in aux:
            flat = np.asarray(_host(a)).reshape(-1)
            flat = flat.astype(np.float64 if flat.dtype.kind == "f" else _INT)
            lo, hi = [flat], [flat]
            span = 1
            while 2 * span <= flat.size:
                lo.append(np.minimum(lo[-1][:-span], lo[-1][span:]))
                hi.append(np.maximum(hi[-1][:-span], hi[-1][span:]))
                span *= 2
            self.tables.append((lo, hi, tuple(int(s) for s in a.shape)))

    def query(self, i: int, first, last):
        """`(min, max)` of flat entries `[first, last]` of aux `i` (int64 arrays, first <= last)."""
        lo, hi, _ = self.tables[i]
        n = last - first + 1
        level = np.floor(np.log2(np.maximum(n, 1))).astype(_INT)
        level = np.minimum(level, len(lo) - 1)
        out_lo = np.empty(np.shape(first), dtype=lo[0].dtype)
        out_hi = np.empty(np.shape(first), dtype=hi[0].dtype)
        for lv in np.unique(level):
            sel = level == lv
            a, b = first[sel], last[sel] - (1 << int(lv)) + 1
            out_lo[sel] = np.minimum(lo[lv][a], lo[lv][b])
            out_hi[sel] = np.maximum(hi[lv][a], hi[lv][b])
        return out_lo, out_hi

    def shape(self, i: int) -> tuple:
        return self.tables[i][2]


def _host(a):
    if isinstance(a, np.ndarray):
        return a
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _corners(f, a, b):
    vals = [f(x, y) for x in a for y in b]
    return np.minimum.reduce(vals), np.maximum.reduce(vals)


def interval(graph: Graph, boxes: dict, ranges: AuxRanges):
    """`(lo, hi)` bounds of the function over boxes of leaf values.

    `boxes` maps each leaf the graph uses to `(lo, hi)` int64 arrays (broadcast together). For a
    bool function, `lo == hi == 1` means true on the whole box, `lo == hi == 0` false on it.
    The bounds are conservative: every point's value lies inside them.
    """
    return _intervals(graph, boxes, ranges)[graph.root.key()]


def may_read_outside(graph: Graph, boxes: dict, ranges: AuxRanges):
    """Bool per box: some aux index of the function may leave its array somewhere on the box
    (conservative: False only where every index provably lies inside). A plan evaluates such
    a box pair by pair, so the index is checked (host) or flagged (device), never assumed."""
    vals = _intervals(graph, boxes, ranges)
    out = np.zeros(np.broadcast(*(x for v in boxes.values() for x in v)).shape, bool)
    for n in graph.loads():
        for a, s in zip(n.args, ranges.shape(n.value)):
            lo, hi = vals[a.key()]
            out = out | (np.asarray(lo) < 0) | (np.asarray(hi) > s - 1)
    return out


class DtypeRanges:
    """Aux entries bounded by their dtypes alone: what generated code may assume of any call."""

    def __init__(self, graph: Graph):
        self.dtypes = [dt for _, _, dt in graph.aux]

    def bounds(self, i: int):
        dt = self.dtypes[i]
        if dt == "bool":
            return np.int64(0), np.int64(1)
        if dt.startswith(("int", "uint")):
            info = np.iinfo(np.dtype(dt))
            return np.int64(max(int(info.min), _NEG)), np.int64(min(int(info.max), _POS))
        return np.float64(-np.inf), np.float64(np.inf)


def _intervals(graph: Graph, boxes: dict, ranges) -> dict:
    """`(lo, hi)` of every node of `graph` over the boxes, by node key (`ranges`: an
    `AuxRanges` of a call's arrays, or `DtypeRanges`)."""
    vals = {}
    with np.errstate(all="ignore"):
        for n in graph.nodes():
            if n.op == "const":
                v = (np.asarray(n.value), np.asarray(n.value))
            elif n.op in boxes:
                v = tuple(np.asarray(x) for x in boxes[n.op])
            elif n.op == "load" and isinstance(ranges, DtypeRanges):
                v = ranges.bounds(n.value)
            elif n.op == "load":
                v = _load_interval(n, [vals[a.key()] for a in n.args], ranges)
            elif not n.args:
                raise ValueError(f"{graph.role} uses {n.op}, which the plan does not provide")
            else:
                v = _interval_op(n, [vals[a.key()] for a in n.args])
            if n.kind == "bool":
                v = tuple(np.asarray(x).astype(_INT) for x in v)
            vals[n.key()] = v
    return vals


_NEG, _POS = np.iinfo(_INT).min // 4, np.iinfo(_INT).max // 4


def _unbounded(kind, shape):
    if kind == "float":
        return np.full(shape, -np.inf), np.full(shape, np.inf)
    if kind == "bool":
        return np.zeros(shape, _INT), np.ones(shape, _INT)
    return np.full(shape, _NEG, _INT), np.full(shape, _POS, _INT)


def _interval_op(n: Node, args):
    op, kind = n.op, n.kind
    if op == "add":
        (a0, a1), (b0, b1) = args
        return a0 + b0, a1 + b1
    if op == "sub":
        (a0, a1), (b0, b1) = args
        return a0 - b1, a1 - b0
    if op == "mul":
        (a0, a1), (b0, b1) = args
        return _corners(np.multiply, (a0, a1), (b0, b1))
    if op in ("truediv", "floordiv"):
        (a0, a1), (b0, b1) = args
        f = np.true_divide if op == "truediv" else np.floor_divide
        safe_b0 = np.where((b0 <= 0) & (b1 >= 0), 1, b0)
        safe_b1 = np.where((b0 <= 0) & (b1 >= 0), 1, b1)
        lo, hi = _corners(f, (a0, a1), (safe_b0, safe_b1))
        spans_zero = (b0 <= 0) & (b1 >= 0)
        ulo, uhi = _unbounded(kind, np.shape(lo))
        if kind == "int":                  # |a // b| <= |a| for |b| >= 1, and x // 0 == 0
            m = np.maximum(np.abs(a0), np.abs(a1))
            ulo, uhi = -m, m
        return np.where(spans_zero, ulo, lo), np.where(spans_zero, uhi, hi)
    if op == "mod":
        (a0, a1), (b0, b1) = args
        ulo, uhi = _unbounded(kind, np.broadcast(a0, b0).shape)
        if kind == "int":                  # |a % b| < |b|, and x % 0 == 0
            m = np.maximum(np.maximum(np.abs(b0), np.abs(b1)) - 1, 0)
            ulo, uhi = -m + 0 * ulo, m + 0 * uhi
        const_pos = (b0 == b1) & (b0 > 0)
        bb = np.where(const_pos, b0, 1)
        one_period = const_pos & (np.floor_divide(a0, bb) == np.floor_divide(a1, bb))
        lo = np.where(one_period, np.remainder(a0, bb), 0)
        hi = np.where(one_period, np.remainder(a1, bb), bb - 1)
        pos = b0 > 0                       # any positive divisor: [0, b1)
        plo = np.where(const_pos, lo, 0)
        phi = np.where(const_pos, hi, b1 - (1 if kind == "int" else 0))
        return np.where(pos, plo, ulo), np.where(pos, phi, uhi)
    if op in ("minimum", "maximum"):
        (a0, a1), (b0, b1) = args
        f = np.minimum if op == "minimum" else np.maximum
        return f(a0, b0), f(a1, b1)
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        (a0, a1), (b0, b1) = args
        if op in ("gt", "ge"):                       # a > b  is  b < a
            (a0, a1), (b0, b1) = (b0, b1), (a0, a1)
            op = "lt" if op == "gt" else "le"
        if op == "lt":
            return (a1 < b0), (a0 < b1)
        if op == "le":
            return (a1 <= b0), (a0 <= b1)
        single = (a0 == a1) & (b0 == b1) & (a0 == b0)
        disjoint = (a1 < b0) | (b1 < a0)
        if op == "eq":
            return single, ~disjoint
        return disjoint, ~single
    if op in ("and", "or", "xor"):
        (a0, a1), (b0, b1) = args
        if kind == "bool":
            if op == "and":
                return a0 & b0, a1 & b1
            if op == "or":
                return a0 | b0, a1 | b1
            known = (a0 == a1) & (b0 == b1)
            return np.where(known, a0 ^ b0, 0), np.where(known, a0 ^ b0, 1)
        nonneg = (a0 >= 0) & (b0 >= 0)
        ulo, uhi = _unbounded("int", np.broadcast(a0, b0).shape)
        if op == "and":
            return np.where(nonneg, 0, ulo), np.where(nonneg, np.minimum(a1, b1), uhi)
        top = np.maximum(a1, b1)
        bits = np.where(top > 0, np.floor(np.log2(np.maximum(top, 1))).astype(_INT) + 1, 0)
        return np.where(nonneg, 0, ulo), np.where(nonneg, (np.int64(1) << bits) - 1, uhi)
    if op == "where":
        (c0, c1), (a0, a1), (b0, b1) = args
        lo = np.where(c0 == 1, a0, np.where(c1 == 0, b0, np.minimum(a0, b0)))
        hi = np.where(c0 == 1, a1, np.where(c1 == 0, b1, np.maximum(a1, b1)))
        return lo, hi
    (a0, a1), = args
    if op == "neg":
        return -a1, -a0
    if op == "invert":
        return (1 - a1, 1 - a0) if kind == "bool" else (-a1 - 1, -a0 - 1)
    if op == "abs":
        spans = (a0 <= 0) & (a1 >= 0)
        lo = np.where(spans, 0, np.minimum(np.abs(a0), np.abs(a1)))
        return lo, np.maximum(np.abs(a0), np.abs(a1))
    if op in ("exp", "tanh"):                      # increasing
        f = getattr(np, op)
        return f(np.asarray(a0, np.float64)), f(np.asarray(a1, np.float64))
    if op in ("log", "sqrt"):                      # increasing on their domain; NaN below it
        f = getattr(np, op)
        a0f, a1f = np.asarray(a0, np.float64), np.asarray(a1, np.float64)
        below = a0f < 0
        return np.where(below, -np.inf, f(np.maximum(a0f, 0))), np.where(
            a1f < 0, -np.inf, np.where(below, np.inf, f(a1f)) if op == "log" else f(
                np.maximum(a1f, 0)))
    raise AssertionError(op)


def _load_interval(n: Node, idx, ranges: AuxRanges):
    """Bounds of `aux[idx]` over index boxes: the entries themselves when the box is one
    contiguous run of the flattened array (every dimension but the last a single index), else
    the whole array's range. Indices are clamped into the array, as the kernels clamp them."""
    shape = ranges.shape(n.value)
    lo = [np.clip(i0, 0, s - 1) for (i0, _), s in zip(idx, shape)]
    hi = [np.clip(i1, 0, s - 1) for (_, i1), s in zip(idx, shape)]
    lo = np.broadcast_arrays(*lo, *hi)
    lo, hi = lo[:len(shape)], lo[len(shape):]
    flat_lo = np.zeros(lo[0].shape, _INT)
    flat_hi = np.zeros(lo[0].shape, _INT)
    contiguous = np.ones(lo[0].shape, bool)
    for d, s in enumerate(shape):
        flat_lo = flat_lo * s + lo[d]
        flat_hi = flat_hi * s + hi[d]
        if d < len(shape) - 1:
            contiguous &= lo[d] == hi[d]
    size = int(np.prod(shape))
    first = np.where(contiguous, flat_lo, 0)
    last = np.where(contiguous, flat_hi, size - 1)
    vlo, vhi = ranges.query(n.value, first.reshape(-1), last.reshape(-1))
    return vlo.reshape(first.shape), vhi.reshape(first.shape)


def evaluate_node(graph: Graph, node: Node, leaves: dict, aux, *, float_dtype=np.float64):
    """The value of one node of `graph` (a load's index, say) at every point of `leaves`."""
    return evaluate(Graph(node, graph.leaves, graph.aux, graph.role), leaves, aux,
                    float_dtype=float_dtype)


def scatter_aux_grads(score_mod, leaves: dict, ds, where, grads: list):
    """Add the gradients of `score_mod`'s float aux arrays at the points of `leaves`:
    `grads[i] += sum over points of ds * d(score_mod)/d(aux_i[index])` at each read's index,
    over the points where `where` holds (float64 host arrays in `grads`)."""
    for load, dgraph in score_mod.d_aux():
        a = score_mod.aux[load.value]
        shape = np.broadcast(ds, *leaves.values()).shape
        w = np.broadcast_to(where, shape)
        with np.errstate(all="ignore"):
            g = np.broadcast_to(ds * evaluate(dgraph, leaves, score_mod.aux), shape)[w]
        idx = tuple(np.clip(np.broadcast_to(evaluate_node(score_mod.graph, i, leaves,
                                                          score_mod.aux), shape)[w], 0, n - 1)
                    for i, n in zip(load.args, a.shape))
        np.add.at(grads[load.value], idx, g)
