"""A graph evaluated with array code (NumPy or CuPy): the reference and the host backends.

`evaluate` computes the function elementwise over broadcast leaf arrays; `interval` computes,
for boxes of leaf values, bounds that hold for every point of the box (interval arithmetic),
which is how a plan classifies a tile without visiting its pairs. The same rules run over
traced values build `class_graph`, the class code the kernels generate and run per tile.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph, Node, Sym, _as_node, where

__all__ = ["evaluate", "evaluate_node", "scatter_aux_grads", "interval", "may_read_outside",
           "AuxRanges", "index_error", "box_class", "class_graph", "EMPTY", "PARTIAL", "FULL",
           "CLASS_LEAVES", "RANGE_OPS", "RANGE_CAP"]

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
        self.ops = _ArrayOps
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

    def load(self, n: Node, idx):
        return _load_interval(n, idx, self)

    @staticmethod
    def generated(n: Node):
        raise ValueError(f"{n.op} appears only in generated class code")


def _host(a):
    if isinstance(a, np.ndarray):
        return a
    return a.get() if hasattr(a, "get") else np.asarray(a)


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
    out = _outside(graph, _intervals(graph, boxes, ranges), ranges)
    return np.broadcast_to(out, np.broadcast(*(x for v in boxes.values() for x in v)).shape)


def _outside(graph: Graph, vals: dict, ranges):
    out = np.asarray(False)
    for n in graph.loads():
        for a, s in zip(n.args, ranges.shape(n.value)):
            lo, hi = vals[a.key()]
            out = out | (lo < 0) | (hi > s - 1)
    return out


# Tile classes (`classify`, `Plan.tile_classes`, the kernels' class code).
EMPTY, PARTIAL, FULL = 0, 1, 2


def box_class(graph: Graph, boxes: dict, ranges):
    """The class of each box of a bool graph: FULL where it is true on the whole box, EMPTY
    where false on it, PARTIAL otherwise or where an aux index may leave its array (so the
    pairs are evaluated and the index checked or flagged). NumPy arrays, or with
    `TracedRanges` a traced value: the class code the kernels run (`class_graph`)."""
    vals = _intervals(graph, boxes, ranges)
    lo, hi = vals[graph.root.key()]
    return np.where(_outside(graph, vals, ranges), PARTIAL,
                    np.where(lo == 1, FULL, np.where(hi == 0, EMPTY, PARTIAL)))


def class_graph(graph: Graph) -> Graph:
    """`box_class` of a mask graph as a graph of its own, leaves `(b, q0, q1, k0, k1)`: what
    generated code (`codegen.py`) evaluates per tile on the device, with no table built and
    nothing read back. Its aux reads are runs of at most `RANGE_CAP` entries; a longer or
    non-contiguous run is bounded by its dtype, so it may say PARTIAL where a host plan
    (`AuxRanges`, exact) says FULL or EMPTY, never the reverse."""
    leaf = {name: Sym(Node(name, (), "int")) for name in CLASS_LEAVES}
    boxes = {"b": (leaf["b"], leaf["b"]), "q_idx": (leaf["q0"], leaf["q1"]),
             "k_idx": (leaf["k0"], leaf["k1"])}
    root = _as_node(box_class(graph, boxes, TracedRanges(graph)))
    return Graph(root, CLASS_LEAVES, graph.aux, graph.role)


CLASS_LEAVES = ("b", "q0", "q1", "k0", "k1")


class DtypeRanges:
    """Aux entries bounded by their dtypes alone: what generated code may assume of any call."""

    def __init__(self, graph: Graph):
        self.ops = _ArrayOps
        self.dtypes = [dt for _, _, dt in graph.aux]

    def load(self, n: Node, idx):
        return self.bounds(n.value)

    def generated(self, n: Node):
        if n.op == "dim":
            return np.int64(1), np.int64(_POS)
        return self.bounds(n.value)

    def bounds(self, i: int):
        return self.of_dtype(self.dtypes[i])

    @staticmethod
    def of_dtype(dt: str):
        """`(lo, hi)` of any entry of an aux array of NumPy dtype name `dt`."""
        if dt == "bool":
            return np.int64(0), np.int64(1)
        if dt.startswith(("int", "uint")):
            info = np.iinfo(np.dtype(dt))
            return np.int64(max(int(info.min), _NEG)), np.int64(min(int(info.max), _POS))
        return np.float64(-np.inf), np.float64(np.inf)


def _intervals(graph: Graph, boxes: dict, ranges) -> dict:
    """`(lo, hi)` of every node of `graph` over the boxes, by node key (`ranges`: an
    `AuxRanges` of a call's arrays, `DtypeRanges`, or `TracedRanges`, which builds the bounds
    as graph nodes: the rules below are written once, over NumPy arrays and traced values)."""
    vals = {}
    ops = ranges.ops
    with np.errstate(all="ignore"):
        for n in graph.nodes():
            if n.op == "const":
                v = (np.asarray(n.value), np.asarray(n.value))
            elif n.op in boxes:
                v = tuple(ops.value(x) for x in boxes[n.op])
            elif n.op == "load":
                v = ranges.load(n, [vals[a.key()] for a in n.args])
            elif n.op in ("dim",) + RANGE_OPS:
                v = ranges.generated(n)
            elif not n.args:
                raise ValueError(f"{graph.role} uses {n.op}, which the plan does not provide")
            else:
                v = _interval_op(n, [vals[a.key()] for a in n.args], ops)
            if n.kind == "bool":
                v = tuple(ops.to_int(x) for x in v)
            vals[n.key()] = v
    return vals


_NEG, _POS = np.iinfo(_INT).min // 4, np.iinfo(_INT).max // 4
# The ops of generated class code (`class_graph`): an aux array's dimension, and the min / max
# of a contiguous run of its entries (`RANGE_CAP` entries at most; past that, or where the
# run is not contiguous, the bounds of its dtype).
RANGE_OPS = ("range_lo", "range_hi")
RANGE_CAP = 256


class _ArrayOps:
    """The interval rules' primitives on NumPy arrays."""

    value = staticmethod(np.asarray)

    @staticmethod
    def to_int(x):
        return np.asarray(x).astype(_INT)

    @staticmethod
    def to_float(x):
        return np.asarray(x, np.float64)

    @staticmethod
    def or_bound(a1, b1):
        """An upper bound of `a | b` and `a ^ b` for `0 <= a <= a1`, `0 <= b <= b1`: the
        smallest `2**k - 1` at or above both."""
        top = np.maximum(a1, b1)
        bits = np.where(top > 0, np.floor(np.log2(np.maximum(top, 1))).astype(_INT) + 1, 0)
        return (np.int64(1) << bits) - 1


class _TracedOps:
    """The same primitives on traced values (`graph.Sym`; constants stay NumPy scalars)."""

    @staticmethod
    def value(x):
        return x if isinstance(x, Sym) else np.asarray(x)

    @staticmethod
    def to_int(x):
        return where(x, 1, 0) if isinstance(x, Sym) else np.asarray(x).astype(_INT)

    @staticmethod
    def to_float(x):
        return x if isinstance(x, Sym) else np.asarray(x, np.float64)

    @staticmethod
    def or_bound(a1, b1):
        """`a | b <= a + b` for non-negative `a`, `b` (no logarithm in generated code)."""
        return a1 + b1


def _unbounded(kind, shape):
    if kind == "float":
        return np.full(shape, -np.inf), np.full(shape, np.inf)
    if kind == "bool":
        return np.zeros(shape, _INT), np.ones(shape, _INT)
    return np.full(shape, _NEG, _INT), np.full(shape, _POS, _INT)


def _shape(*xs):
    """The broadcast shape of NumPy operands (traced ones count as scalars)."""
    return np.broadcast(*(x for x in xs if not isinstance(x, Sym))).shape


def _corners(f, a, b):
    vals = [f(x, y) for x in a for y in b]
    lo = hi = vals[0]
    for v in vals[1:]:
        lo, hi = np.minimum(lo, v), np.maximum(hi, v)
    return lo, hi


def _interval_op(n: Node, args, ops):
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
        spans_zero = (b0 <= 0) & (b1 >= 0)
        safe_b0 = np.where(spans_zero, 1, b0)
        safe_b1 = np.where(spans_zero, 1, b1)
        lo, hi = _corners(f, (a0, a1), (safe_b0, safe_b1))
        ulo, uhi = _unbounded(kind, _shape(lo))
        if kind == "int":                  # |a // b| <= |a| for |b| >= 1, and x // 0 == 0
            m = np.maximum(np.abs(a0), np.abs(a1))
            ulo, uhi = -m, m
        return np.where(spans_zero, ulo, lo), np.where(spans_zero, uhi, hi)
    if op == "mod":
        (a0, a1), (b0, b1) = args
        ulo, uhi = _unbounded(kind, _shape(a0, b0))
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
        ulo, uhi = _unbounded("int", _shape(a0, b0))
        if op == "and":
            return np.where(nonneg, 0, ulo), np.where(nonneg, np.minimum(a1, b1), uhi)
        return np.where(nonneg, 0, ulo), np.where(nonneg, ops.or_bound(a1, b1), uhi)
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
        return f(ops.to_float(a0)), f(ops.to_float(a1))
    if op in ("log", "sqrt"):                      # increasing on their domain; NaN below it
        f = getattr(np, op)
        a0f, a1f = ops.to_float(a0), ops.to_float(a1)
        below = a0f < 0
        return np.where(below, -np.inf, f(np.maximum(a0f, 0))), np.where(
            a1f < 0, -np.inf, np.where(below, np.inf, f(a1f)) if op == "log" else f(
                np.maximum(a1f, 0)))
    raise AssertionError(op)


def _clamped_index_box(idx, shape):
    """Index boxes clamped into an array of `shape` (as the kernels clamp), and whether they
    are one contiguous run of its flattened entries (every dimension but the last a single
    index)."""
    lo = [np.minimum(np.maximum(i0, 0), s - 1) for (i0, _), s in zip(idx, shape)]
    hi = [np.minimum(np.maximum(i1, 0), s - 1) for (_, i1), s in zip(idx, shape)]
    contiguous = np.asarray(True)
    for d in range(len(shape) - 1):
        contiguous = contiguous & (lo[d] == hi[d])
    return lo, hi, contiguous


def _load_interval(n: Node, idx, ranges: AuxRanges):
    """Bounds of `aux[idx]` over index boxes: the entries themselves when the box is one
    contiguous run of the flattened array, else the whole array's range."""
    shape = ranges.shape(n.value)
    lo, hi, contiguous = _clamped_index_box(idx, shape)
    lo = np.broadcast_arrays(*lo, *hi, contiguous)
    lo, hi, contiguous = lo[:len(shape)], lo[len(shape):-1], lo[-1]
    flat_lo = np.zeros(lo[0].shape, _INT)
    flat_hi = np.zeros(lo[0].shape, _INT)
    for d, s in enumerate(shape):
        flat_lo = flat_lo * s + lo[d]
        flat_hi = flat_hi * s + hi[d]
    size = int(np.prod(shape))
    first = np.where(contiguous, flat_lo, 0)
    last = np.where(contiguous, flat_hi, size - 1)
    vlo, vhi = ranges.query(n.value, first.reshape(-1), last.reshape(-1))
    return vlo.reshape(first.shape), vhi.reshape(first.shape)


class TracedRanges:
    """Aux bounds as graph nodes, for the class code generated from a mask graph
    (`class_graph`): shapes are `dim` nodes, and the entries of a box are a `range_lo` /
    `range_hi` node over `(contiguous, leading indices..., first, last)` of the last dimension,
    which generated code reads entry by entry (up to `RANGE_CAP` of them) or bounds by the
    dtype."""

    ops = _TracedOps

    def __init__(self, graph: Graph):
        self.graph = graph

    def shape(self, i: int) -> list:
        return [Sym(Node("dim", (), "int", (i, d))) for d in range(self.graph.aux[i][1])]

    def load(self, n: Node, idx):
        lo, hi, contiguous = _clamped_index_box(idx, self.shape(n.value))
        kind = "float" if n.kind == "float" else "int"
        args = [_as_node(contiguous)] + [_as_node(x) for x in lo[:-1]] + [
            _as_node(lo[-1]), _as_node(hi[-1])]
        return tuple(Sym(Node(op, args, kind, n.value)) for op in RANGE_OPS)

    @staticmethod
    def generated(n: Node):
        raise ValueError(f"{n.op} appears only in generated class code")


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
