"""A traced graph as text and back, for boundaries that carry strings and arrays only.

A PyTorch custom op's schema takes no Python objects: `varlen.torch` passes a MaskMod or
ScoreMod to its op as `graph_text(mod.graph)` (the canonical text its digest hashes) beside the
aux tensors, and the op rebuilds the graph with `graph_from_text` (cached per text). The text is
self-contained: a compiled graph that holds it needs no registry of live Python objects, and two
functions that trace alike give the same text (so the same compiled graph serves both).

    role|leaf,leaf,...|((kind, ndim, dtype), ...)|root node's key

Node keys (`Node.key`): `op(arg,arg)`, leaves `q_idx()`, constants `const(float:0.5)`, aux reads
`load(1;b(),q_idx())`.
"""
from __future__ import annotations

import ast
from functools import lru_cache

from .graph import BINARY, LEAVES, UNARY, Graph, Node, Sym, binary, unary, where

__all__ = ["graph_text", "graph_from_text"]


def graph_text(graph: Graph) -> str:
    """The canonical text of `graph` (what `graph.digest` hashes)."""
    return f"{graph.role}|{','.join(graph.leaves)}|{graph.aux}|{graph.root.key()}"


@lru_cache(maxsize=512)
def graph_from_text(text: str) -> Graph:
    """The graph `graph_text` wrote (same digest); a ValueError for anything else."""
    try:
        role, leaves, aux, body = text.split("|", 3)
        aux = ast.literal_eval(aux)
        node, end = _parse(body, 0, tuple(kind for kind, _, _ in aux))
    except (ValueError, SyntaxError, IndexError, KeyError, TypeError) as e:
        raise ValueError(f"not the text of a mask_mod or score_mod graph: {text[:80]!r} "
                         f"({e})") from None
    graph = Graph(node, tuple(leaves.split(",")) if leaves else (), aux, role)
    if end != len(body) or graph_text(graph) != text:
        raise ValueError(f"not the text of a mask_mod or score_mod graph: {text[:80]!r}")
    return graph


def _parse(s: str, pos: int, aux_kinds: tuple) -> tuple[Node, int]:
    """The node whose key starts at `s[pos]`, and the position after it."""
    open_ = s.index("(", pos)
    op, pos = s[pos:open_], open_ + 1
    if op == "const":
        close = s.index(")", pos)
        kind, value = s[pos:close].split(":", 1)
        value = float(value) if kind == "float" else int(value)
        return Node("const", (), kind, bool(value) if kind == "bool" else value), close + 1
    index = None
    if op == "load":
        semi = s.index(";", pos)
        index, pos = int(s[pos:semi]), semi + 1
    args = []
    while s[pos] != ")":
        node, pos = _parse(s, pos, aux_kinds)
        args.append(node)
        if s[pos] == ",":
            pos += 1
    return _node(op, args, index, aux_kinds), pos + 1


def _node(op: str, args: list, index, aux_kinds: tuple) -> Node:
    """The node the tracer builds for `op` over `args` (its kind by the tracer's rules)."""
    if op in LEAVES and not args:
        return Node(op, (), LEAVES[op])
    if op == "load":
        return Node("load", args, aux_kinds[index], index)
    syms = [Sym(a) for a in args]
    if op == "where" and len(args) == 3:
        return where(*syms).node
    if op in BINARY and len(args) == 2:
        return binary(op, *syms).node
    if op in UNARY and len(args) == 1:
        return unary(op, *syms).node
    raise ValueError(f"unknown node {op}({len(args)} arguments)")
