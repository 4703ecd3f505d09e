"""Symbolic derivatives of a score graph: d(score_mod)/d(score) and d/d(each float aux entry).

The backward multiplies dS (the gradient of the modified score) by the first to reach the raw
score, and scatters it times the second into the aux array's gradient at the load's index.
Integer and bool nodes have no derivative (they are piecewise constant).
"""
from __future__ import annotations

from .graph import Graph, Node, const

__all__ = ["derivative", "aux_derivatives"]

_ZERO = const(0.0)
_ONE = const(1.0)


def _is(n: Node, v) -> bool:
    return n.op == "const" and n.value == v


def _add(a, b):
    if _is(a, 0):
        return b
    if _is(b, 0):
        return a
    return Node("add", (a, b), "float")


def _mul(a, b):
    if _is(a, 0) or _is(b, 0):
        return _ZERO
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    return Node("mul", (a, b), "float")


def _sub(a, b):
    if _is(b, 0):
        return a
    return Node("sub", (a, b), "float")


def _div(a, b):
    if _is(a, 0):
        return _ZERO
    return Node("truediv", (a, b), "float")


def _d(n: Node, wrt: str, memo: dict) -> Node:
    """d n / d (the node whose key is `wrt`)."""
    k = n.key()
    if k in memo:
        return memo[k]
    if k == wrt:
        r = _ONE
    elif n.kind != "float" or n.op in ("const", "load") or not n.args:
        r = _ZERO
    else:
        r = _rule(n, [(a, _d(a, wrt, memo)) for a in n.args])
    memo[k] = r
    return r


def _rule(n: Node, args) -> Node:
    op = n.op
    if op == "add":
        return _add(args[0][1], args[1][1])
    if op == "sub":
        return _sub(args[0][1], args[1][1])
    if op == "mul":
        (a, da), (b, db) = args
        return _add(_mul(da, b), _mul(a, db))
    if op == "truediv":
        (a, da), (b, db) = args
        return _div(_sub(_mul(da, b), _mul(a, db)), _mul(b, b))
    if op in ("floordiv", "mod"):
        if op == "mod":                     # a - b*floor(a/b): da - floor(a/b) * db
            (a, da), (b, db) = args
            return _sub(da, _mul(Node("floordiv", (a, b), "float"), db))
        return _ZERO
    if op in ("minimum", "maximum"):
        (a, da), (b, db) = args
        pick_a = Node("le" if op == "minimum" else "ge", (a, b), "bool")
        return _where(pick_a, da, db)
    if op == "where":
        (c, _), (a, da), (b, db) = args
        return _where(c, da, db)
    (a, da), = args
    if _is(da, 0):
        return _ZERO
    if op == "neg":
        return Node("neg", (da,), "float")
    if op == "abs":
        sign = _where(Node("lt", (a, const(0)), "bool"), const(-1.0), _ONE)
        return _mul(sign, da)
    if op == "exp":
        return _mul(n, da)
    if op == "log":
        return _div(da, a)
    if op == "tanh":
        return _mul(_sub(_ONE, _mul(n, n)), da)
    if op == "sqrt":
        return _div(da, _mul(const(2.0), n))
    raise AssertionError(op)


def _where(c, a, b):
    if a.key() == b.key():
        return a
    return Node("where", (c, a, b), "float")


def derivative(graph: Graph, wrt: Node | str = "score") -> Graph:
    """The graph of d(graph)/d(wrt): `wrt` a leaf name or a node of the graph (a load)."""
    key = Node(wrt, (), "float").key() if isinstance(wrt, str) else wrt.key()
    root = graph.root
    if root.kind != "float":
        root = Node("add", (root, _ZERO), "float")
    d = _d(root, key, {})
    return Graph(d, graph.leaves, graph.aux, f"d_{graph.role}")


def aux_derivatives(graph: Graph) -> list:
    """`[(load node, its derivative graph)]` for every load of a float aux array: the aux's
    gradient gets `dS * derivative` scattered at the load's index, summed over loads."""
    return [(n, derivative(graph, n)) for n in graph.loads("float")]
