"""Expression graphs of mask and score functions, and the tracer that builds them.

A user function is called once with symbolic arguments (`Sym`); every operator on them records a
`Node`. The graph is the one description every backend is generated from (`codegen.py`), the
plan classifies tiles with (`evaluate.py`'s interval rules) and the backward differentiates (`derive.py`).

Values have one of three kinds: `bool`, `int` (64-bit) and `float`. Python's rules promote
(`bool < int < float`), `/` is true division, `//` and `%` floor (Python's signs) and give 0 for
an integer division by zero. Every node is evaluated, in every language: nothing short-circuits,
so an aux index out of range is found whichever branch of a `where` uses it.
"""
from __future__ import annotations

import hashlib
import sys

import numpy as np

__all__ = ["Node", "Sym", "AuxSym", "Graph", "trace", "where", "exp", "log", "tanh", "sqrt",
           "minimum", "maximum", "KINDS", "LEAVES"]

KINDS = ("bool", "int", "float")
# Leaves: the score (float) and the int indices a function receives.
LEAVES = {"score": "float", "b": "int", "h": "int", "q_idx": "int", "k_idx": "int"}

BINARY = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
          "and": "&", "or": "|", "xor": "^", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "minimum": "minimum", "maximum": "maximum"}
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
UNARY_FLOAT = ("exp", "log", "tanh", "sqrt")
UNARY = ("neg", "invert", "abs") + UNARY_FLOAT


class Node:
    """One operation: `op`, its argument nodes, its kind; `value` for a constant, the aux
    number for a load. Nodes are immutable and shared (a DAG)."""

    __slots__ = ("op", "args", "kind", "value", "_key")

    def __init__(self, op: str, args=(), kind: str = "int", value=None):
        self.op, self.args, self.kind, self.value = op, tuple(args), kind, value
        self._key = None

    def key(self) -> str:
        """A canonical text of the subgraph (for digests and common subexpressions)."""
        if self._key is None:
            if self.op == "const":
                v = repr(float(self.value)) if self.kind == "float" else repr(int(self.value))
                inner = f"{self.kind}:{v}"
            else:
                inner = ",".join(a.key() for a in self.args)
                if self.value is not None:      # a load's aux, a generated op's operand
                    inner = f"{self.value};{inner}"
            self._key = f"{self.op}({inner})"
        return self._key

    def __repr__(self):
        return f"Node<{self.kind}>{self.key()}"


def const(value) -> Node:
    if isinstance(value, (bool, np.bool_)):
        return Node("const", (), "bool", bool(value))
    if isinstance(value, (int, np.integer)):
        return Node("const", (), "int", int(value))
    if isinstance(value, (float, np.floating)):
        return Node("const", (), "float", float(value))
    raise TypeError(f"a constant of type {type(value).__name__} cannot enter a mask_mod or "
                    f"score_mod; use bool, int or float")


def _promote(*kinds) -> str:
    return max(kinds, key=KINDS.index)


def _user_line() -> str:
    """`file:line: source` of the innermost frame outside this package (the user's line)."""
    here = __name__.rsplit(".", 1)[0].replace(".", "/")
    f = sys._getframe(1)
    while f is not None and (here in f.f_code.co_filename.replace("\\", "/") or
                             f.f_code.co_filename.startswith("<__array_function__")):
        f = f.f_back
    if f is None:
        return "<unknown>"
    import linecache
    src = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    return f"{f.f_code.co_filename}:{f.f_lineno}: {src}" if src else \
        f"{f.f_code.co_filename}:{f.f_lineno}"


def _as_node(x) -> Node:
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, AuxSym):
        raise TypeError(f"aux argument {x.index} is used whole; index it "
                        f"(aux[i] for a 1-D array, aux[i, j] for 2-D) at {_user_line()}")
    if isinstance(x, np.ndarray) and x.ndim == 0:
        return const(x[()])
    return const(x)


def binary(op: str, a, b) -> "Sym":
    na, nb = _as_node(a), _as_node(b)
    if op in COMPARE:
        kind = "bool"
    elif op == "truediv":
        kind = "float"
    elif op in ("and", "or", "xor"):
        kind = "bool" if na.kind == nb.kind == "bool" else _promote(na.kind, nb.kind, "int")
        if kind == "float":
            raise TypeError(f"operator {BINARY[op]} needs bool or int operands, got a float at "
                            f"{_user_line()}")
    else:
        kind = _promote(na.kind, nb.kind, "int")
    return Sym(Node(op, (na, nb), kind))


def unary(op: str, a) -> "Sym":
    n = _as_node(a)
    if op in UNARY_FLOAT:
        kind = "float"
    elif op == "invert":
        if n.kind == "float":
            raise TypeError(f"operator ~ needs a bool or int operand, got a float at "
                            f"{_user_line()}")
        kind = n.kind
    else:
        kind = _promote(n.kind, "int")
    return Sym(Node(op, (n,), kind))


def where(cond, a, b):
    """`a` where `cond` else `b`, elementwise: the traced form of a conditional (both sides are
    evaluated). On plain values it is `numpy.where`."""
    if not any(isinstance(x, Sym) for x in (cond, a, b)):
        return np.where(cond, a, b)
    c = _as_node(cond)
    if c.kind != "bool":
        c = Node("ne", (c, const(0)), "bool")
    na, nb = _as_node(a), _as_node(b)
    return Sym(Node("where", (c, na, nb), _promote(na.kind, nb.kind)))


def _lift(name, np_fn, binary_op=False):
    def fn(*xs):
        if not any(isinstance(x, Sym) for x in xs):
            return np_fn(*xs)
        return binary(name, *xs) if binary_op else unary(name, *xs)
    fn.__name__ = name
    fn.__doc__ = (f"`numpy.{np_fn.__name__}` that also takes traced values (inside a mask_mod "
                  f"or score_mod).")
    return fn


exp = _lift("exp", np.exp)
log = _lift("log", np.log)
tanh = _lift("tanh", np.tanh)
sqrt = _lift("sqrt", np.sqrt)
minimum = _lift("minimum", np.minimum, True)
maximum = _lift("maximum", np.maximum, True)

# NumPy functions that a traced value answers (through __array_ufunc__ / __array_function__).
_UFUNCS = {np.add: "add", np.subtract: "sub", np.multiply: "mul", np.true_divide: "truediv",
           np.floor_divide: "floordiv", np.remainder: "mod", np.bitwise_and: "and",
           np.bitwise_or: "or", np.bitwise_xor: "xor", np.logical_and: "and",
           np.logical_or: "or", np.logical_xor: "xor", np.less: "lt", np.less_equal: "le",
           np.greater: "gt", np.greater_equal: "ge", np.equal: "eq", np.not_equal: "ne",
           np.minimum: "minimum", np.maximum: "maximum", np.fmin: "minimum",
           np.fmax: "maximum"}
_UNARY_UFUNCS = {np.negative: "neg", np.invert: "invert", np.logical_not: "invert",
                 np.absolute: "abs", np.exp: "exp", np.log: "log", np.tanh: "tanh",
                 np.sqrt: "sqrt"}


class Sym:
    """A traced value: what a mask or score function computes on, instead of a number."""

    __slots__ = ("node",)
    __array_priority__ = 1000
    __hash__ = None

    def __init__(self, node: Node):
        self.node = node

    @property
    def kind(self) -> str:
        return self.node.kind

    # arithmetic
    def __add__(self, o): return binary("add", self, o)
    def __radd__(self, o): return binary("add", o, self)
    def __sub__(self, o): return binary("sub", self, o)
    def __rsub__(self, o): return binary("sub", o, self)
    def __mul__(self, o): return binary("mul", self, o)
    def __rmul__(self, o): return binary("mul", o, self)
    def __truediv__(self, o): return binary("truediv", self, o)
    def __rtruediv__(self, o): return binary("truediv", o, self)
    def __floordiv__(self, o): return binary("floordiv", self, o)
    def __rfloordiv__(self, o): return binary("floordiv", o, self)
    def __mod__(self, o): return binary("mod", self, o)
    def __rmod__(self, o): return binary("mod", o, self)
    def __and__(self, o): return binary("and", self, o)
    def __rand__(self, o): return binary("and", o, self)
    def __or__(self, o): return binary("or", self, o)
    def __ror__(self, o): return binary("or", o, self)
    def __xor__(self, o): return binary("xor", self, o)
    def __rxor__(self, o): return binary("xor", o, self)
    def __lt__(self, o): return binary("lt", self, o)
    def __le__(self, o): return binary("le", self, o)
    def __gt__(self, o): return binary("gt", self, o)
    def __ge__(self, o): return binary("ge", self, o)
    def __eq__(self, o): return binary("eq", self, o)       # noqa: E704
    def __ne__(self, o): return binary("ne", self, o)
    def __neg__(self): return unary("neg", self)
    def __pos__(self): return self
    def __invert__(self): return unary("invert", self)
    def __abs__(self): return unary("abs", self)

    def _unsupported(name):
        def fn(self, *a):
            raise TypeError(f"operation {name} is not supported on a traced value (mask_mod/"
                            f"score_mod support + - * / // % & | ^ ~, comparisons, abs and "
                            f"varlen.where/exp/log/tanh/sqrt/minimum/maximum) at {_user_line()}")
        return fn

    __pow__ = __rpow__ = _unsupported("**")
    __matmul__ = __rmatmul__ = _unsupported("@")
    __lshift__ = __rlshift__ = _unsupported("<<")
    __rshift__ = __rrshift__ = _unsupported(">>")
    __round__ = _unsupported("round()")
    __getitem__ = _unsupported("indexing a traced value")
    __iter__ = _unsupported("iteration")
    __len__ = _unsupported("len()")
    del _unsupported

    def __bool__(self):
        raise TypeError(
            f"a traced value was used as a Python bool (if, while, and, or, not, bool(), "
            f"Python's min/max) at {_user_line()}; a mask_mod or score_mod is traced once, so "
            f"write varlen.where(cond, a, b), & | ~ for logic, varlen.minimum/maximum")

    def _number(name):
        def fn(self):
            raise TypeError(f"a traced value was converted with {name} at {_user_line()}; "
                            f"keep it symbolic (varlen.exp/log/tanh/sqrt, not math.*)")
        return fn

    __int__ = _number("int()")
    __float__ = _number("float()")
    __index__ = _number("an index conversion")
    __complex__ = _number("complex()")
    del _number

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method == "__call__" and not kwargs:
            if ufunc in _UFUNCS and len(inputs) == 2:
                return binary(_UFUNCS[ufunc], *inputs)
            if ufunc in _UNARY_UFUNCS and len(inputs) == 1:
                op = _UNARY_UFUNCS[ufunc]
                if ufunc is np.logical_not:
                    return unary("invert", where(inputs[0], True, False))
                return unary(op, inputs[0])
        raise TypeError(f"numpy.{ufunc.__name__} is not supported on a traced value at "
                        f"{_user_line()}")

    def __array_function__(self, func, types, args, kwargs):
        if func is np.where and not kwargs and len(args) == 3:
            return where(*args)
        raise TypeError(f"numpy.{func.__name__} is not supported on a traced value at "
                        f"{_user_line()}")

    def __repr__(self):
        return f"<traced {self.kind}: {self.node.key()}>"


class AuxSym:
    """A traced aux array: indexing it (one integer expression per dimension) reads an entry."""

    __slots__ = ("index", "ndim", "kind", "shape")

    def __init__(self, index: int, ndim: int, kind: str, shape=None):
        self.index, self.ndim, self.kind, self.shape = index, ndim, kind, shape

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != self.ndim:
            raise TypeError(f"aux argument {self.index} has {self.ndim} dimension(s) but is "
                            f"indexed with {len(idx)} at {_user_line()}")
        nodes = []
        for i in idx:
            if isinstance(i, (slice, type(Ellipsis))) or i is None:
                raise TypeError(f"aux argument {self.index} must be indexed by integer "
                                f"expressions, got {i!r} at {_user_line()}")
            n = _as_node(i)
            if n.kind == "float":
                raise TypeError(f"aux argument {self.index} is indexed by a float expression at "
                                f"{_user_line()}; use // for integer division")
            nodes.append(n)
        return Sym(Node("load", nodes, self.kind, self.index))

    def __bool__(self):
        raise TypeError(f"aux argument {self.index} was used as a Python bool at {_user_line()}")

    def __repr__(self):
        return f"<traced aux {self.index}: {self.ndim}-D {self.kind}>"


class Graph:
    """A traced function: its root node, the leaves it takes, its aux arrays' kinds and ranks.

    `aux` holds, per aux argument, `(kind, ndim, dtype name)`. `digest` names the graph in
    caches (its text, the aux dtypes): equal functions give equal digests.
    """

    def __init__(self, root: Node, leaves: tuple, aux: tuple, role: str):
        self.root, self.leaves, self.aux, self.role = root, tuple(leaves), tuple(aux), role
        text = f"{role}|{','.join(leaves)}|{aux}|{root.key()}"
        self.digest = hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def kind(self) -> str:
        return self.root.kind

    def nodes(self) -> list:
        """Every distinct node, arguments before their users (common subexpressions once)."""
        order, seen = [], {}

        def visit(n):
            stack = [(n, False)]
            while stack:
                node, done = stack.pop()
                k = node.key()
                if k in seen:
                    continue
                if done:
                    seen[k] = node
                    order.append(node)
                    continue
                stack.append((node, True))
                for a in reversed(node.args):
                    if a.key() not in seen:
                        stack.append((a, False))
        visit(self.root)
        return order

    def uses(self, leaf: str) -> bool:
        return any(n.op == leaf for n in self.nodes())

    def loads(self, kind=None) -> list:
        """The load nodes (of aux arrays of `kind`, when given)."""
        return [n for n in self.nodes() if n.op == "load" and (kind is None or n.kind == kind)]

    def __repr__(self):
        return f"<{self.role} graph {self.digest}: {self.root.key()}>"


def _dtype_name(a) -> str:
    """NumPy's name of an array's dtype, read without touching its data (torch by name)."""
    dt = a.dtype
    if type(dt).__module__ == "torch":
        return str(dt).removeprefix("torch.")
    name = getattr(dt, "name", None) or str(dt)
    return "bfloat16" if name == "bfloat16" else np.dtype(dt).name


def _aux_kind(a, where: str) -> tuple:
    if not (hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim")):
        raise TypeError(f"{where} must be an array (NumPy, PyTorch, JAX or CuPy), got "
                        f"{type(a).__name__}")
    name = _dtype_name(a)
    kind = ("bool" if name == "bool" else "int" if name.startswith(("int", "uint")) else
            "float" if name.startswith(("float", "bfloat")) else None)
    if kind is None:
        raise TypeError(f"{where} has dtype {name}; expected an integer, bool or float array")
    shape = tuple(int(n) for n in a.shape)
    if not 1 <= len(shape) <= 4:
        raise ValueError(f"{where} has {len(shape)} dimensions; expected 1 to 4 (a Python number "
                         f"is a constant: write it in the function)")
    if 0 in shape:
        raise ValueError(f"{where} has shape {shape}; an empty aux array has no entry to read")
    return kind, len(shape), name


def trace(fn, leaves: tuple, aux: tuple, role: str, aux_names=None) -> Graph:
    """Call `fn(*leaves, *aux)` with traced values; returns its `Graph`.

    `role` is "mask_mod" or "score_mod" (it names the function in errors). The arity is checked
    against `len(leaves) + len(aux)` before the call.
    """
    specs = tuple(_aux_kind(a, f"{role} aux argument {i}") for i, a in enumerate(aux))
    _check_arity(fn, len(leaves), len(aux), role)
    syms = [Sym(Node(name, (), LEAVES[name])) for name in leaves]
    auxs = [AuxSym(i, nd, kind, tuple(int(s) for s in a.shape))
            for i, ((kind, nd, _), a) in enumerate(zip(specs, aux))]
    out = fn(*syms, *auxs)
    if isinstance(out, AuxSym):
        _as_node(out)
    root = _as_node(out) if not isinstance(out, Sym) else out.node
    return Graph(root, leaves, specs, role)


def _check_arity(fn, n_leaves: int, n_aux: int, role: str):
    import inspect
    if not callable(fn):
        raise TypeError(f"{role} must be a callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    required = [p for p in pos if p.default is p.empty]
    want = n_leaves + n_aux
    if len(required) > want or (len(pos) < want and not varargs):
        names = {"mask_mod": "(b, q_idx, k_idx, *aux)",
                 "score_mod": "(score, b, h, q_idx, k_idx, *aux)"}[role]
        raise TypeError(f"{role} is called as {role}{names} with {n_aux} aux array(s), so it "
                        f"must take {want} positional arguments; "
                        f"{getattr(fn, '__name__', 'the function')} takes {len(pos)}"
                        f"{' or more' if varargs else ''}")


def substitute(root: Node, leaf: str, by: Node) -> Node:
    """`root` with every use of the leaf named `leaf` replaced by the node `by`."""
    memo = {}

    def rebuild(n: Node) -> Node:
        k = n.key()
        if k not in memo:
            if n.op == leaf and not n.args:
                memo[k] = by
            elif not n.args:
                memo[k] = n
            else:
                memo[k] = Node(n.op, [rebuild(a) for a in n.args], n.kind, n.value)
        return memo[k]
    return rebuild(root)

