"""Masks and scores as user functions: `MaskMod` and `ScoreMod`.

    prefix = np.array([3, 0, 5], np.int32)             # per sequence
    prefix_lm = varlen.MaskMod(lambda b, q, k, p: (k <= q) | (k < p[b]), prefix)
    alibi = varlen.ScoreMod(lambda s, b, h, q, k, m: s - m[h] * abs(q - k), slopes)
    out, lse = varlen.attention_forward(q, k, v, cu, cu, mask=prefix_lm, score_mod=alibi)

A function is traced once into an expression graph (`graph.py`); every backend runs code
generated from that graph (`evaluate.py` for array code, `codegen.py` for Numba and CUDA C), plans
classify tiles by interval arithmetic over it, and the backward differentiates it (`derive.py`).
Positions `q_idx`/`k_idx` count from the sequence's first row (under context parallelism, of the
whole document). docs/mods.md has the rules and a gallery.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .derive import aux_derivatives, derivative
from .evaluate import EMPTY, FULL, PARTIAL, RANGE_CAP, AuxRanges, box_class, class_graph, \
    evaluate, interval, may_read_outside
from .graph import Graph, Node, const, exp, log, maximum, minimum, sqrt, substitute, tanh, \
    trace, where

__all__ = ["MaskMod", "ScoreMod", "Mods", "split_mask", "classify", "class_graph", "where",
           "exp", "log", "tanh", "sqrt", "minimum", "maximum", "EMPTY", "PARTIAL", "FULL",
           "RANGE_CAP", "alibi"]

MASK_LEAVES = ("b", "q_idx", "k_idx")
SCORE_LEAVES = ("score", "b", "h", "q_idx", "k_idx")


class _Mod:
    role = ""
    leaves: tuple = ()

    def __init__(self, fn, *aux, _graph=None):
        self.fn = fn
        self.aux = tuple(aux)
        self.graph = _graph if _graph is not None else trace(fn, self.leaves, self.aux,
                                                             self.role)
        self._check()

    def _check(self):
        pass

    @property
    def digest(self) -> str:
        return self.graph.digest

    def with_aux(self, aux) -> "_Mod":
        """The same function over other arrays (the working copies setup makes)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.aux = tuple(aux)
        return new

    def __repr__(self):
        name = getattr(self.fn, "__name__", "fn")
        return f"{type(self).__name__}({name}, {len(self.aux)} aux; {self.graph.digest})"


class MaskMod(_Mod):
    """A mask as a function: `fn(b, q_idx, k_idx, *aux) -> bool`, True where query `q_idx` of
    sequence `b` sees key `k_idx` (positions counted from the sequence's first row).

    `aux` are integer, bool or float arrays (the caller's framework and device), indexed inside
    `fn` by integer expressions. `mask=MaskMod(...)` goes wherever `mask=` goes; `Mask & MaskMod`
    and `MaskMod & MaskMod` combine (a pair is visible where both say so); the built-in `Mask`
    part keeps its fast tile schedule. Python control flow on traced values is a TypeError naming
    the line: use `varlen.where`, `&`, `|`, `~`.
    """

    role = "mask_mod"
    leaves = MASK_LEAVES

    def __init__(self, fn, *aux, _graph=None, base=None):
        super().__init__(fn, *aux, _graph=_graph)
        self.base = base            # a varlen.Mask ANDed in, or None

    def _check(self):
        if self.graph.kind != "bool":
            raise TypeError(f"mask_mod must return a bool expression (comparisons combined "
                            f"with & | ~), got a {self.graph.kind}")

    def __and__(self, other):
        from ..masks import Mask, as_mask
        if isinstance(other, (Mask, str)):
            other = as_mask(other)
            base = other if self.base is None else _and_masks(self.base, other)
            new = self.with_aux(self.aux)
            new.base = base
            return new
        if isinstance(other, MaskMod):
            n = len(self.aux)
            f, g = self.fn, other.fn

            def both(b, q, k, *aux):
                return f(b, q, k, *aux[:n]) & g(b, q, k, *aux[n:])
            both.__name__ = f"{getattr(f, '__name__', 'f')}_and_{getattr(g, '__name__', 'g')}"
            base = self.base if other.base is None else (
                other.base if self.base is None else _and_masks(self.base, other.base))
            return MaskMod(both, *self.aux, *other.aux, base=base)
        return NotImplemented

    __rand__ = __and__


def _and_masks(a, b):
    raise TypeError(f"{a!r} & {b!r}: two built-in masks cannot be combined; write one of them "
                    f"as a MaskMod")


class ScoreMod(_Mod):
    """A score modifier: `fn(score, b, h, q_idx, k_idx, *aux) -> score`, applied to the scaled
    logit of query `q_idx` and key `k_idx` of sequence `b` at query head `h` (after softcap if
    both are given), before the softmax. A result of -inf hides the pair as a mask does.

    Gradients flow through `score`, and (torch and JAX adapters) into float `aux` arrays.
    """

    role = "score_mod"
    leaves = SCORE_LEAVES

    def _check(self):
        if self.graph.kind != "float":
            raise TypeError(f"score_mod must return a float expression (the modified score), "
                            f"got a{'n' if self.graph.kind == 'int' else ''} {self.graph.kind}")
        root = self.graph.root
        if root.op == "const" and not np.isfinite(root.value):
            raise ValueError(f"score_mod returns the constant {root.value}; every score would "
                             f"be {root.value} (use a MaskMod to hide pairs)")
        self._d_score = None
        self._d_aux = None

    def d_score(self) -> Graph:
        """d(score_mod)/d(score) as a graph (symbolic)."""
        if self._d_score is None:
            self._d_score = derivative(self.graph, "score")
        return self._d_score

    def d_aux(self) -> list:
        """`[(load node, derivative graph)]` for each read of a float aux array."""
        if self._d_aux is None:
            self._d_aux = aux_derivatives(self.graph)
        return self._d_aux

    def with_head_offset(self, offset: int) -> "ScoreMod":
        """The same function seeing query head `offset + j` where a call computes its local
        head `j` (context parallelism's Ulysses hands each rank a slice of the heads): a
        rewrite of the graph, so every backend runs it unchanged."""
        offset = int(offset)
        if offset == 0 or not self.graph.uses("h"):
            return self
        h = Node("h", (), "int")
        g = self.graph
        root = substitute(g.root, "h", Node("add", (h, const(offset)), "int"))
        new = object.__new__(ScoreMod)
        new.__dict__.update(self.__dict__)
        new.graph = Graph(root, g.leaves, g.aux, g.role)
        new._d_score = new._d_aux = None
        return new

    def float_aux(self) -> tuple:
        """Which aux arrays are float (those that can have a gradient)."""
        return tuple(kind == "float" for kind, _, _ in self.graph.aux)


@dataclass(frozen=True)
class Mods:
    """What a backend is given of a call's user functions (aux arrays as working arrays).

    mask: a MaskMod or None (its `base` already folded into the plan's mask policy);
    score: a ScoreMod or None; aux_grads: whether the backward returns gradients of the score
    function's float aux arrays (a fourth result, one float32 array or None per aux).
    """

    mask: MaskMod | None = None
    score: ScoreMod | None = None
    aux_grads: bool = False

    def for_heads(self, first: int) -> "Mods":
        """These functions for a call whose local query head `j` is global head `first + j`
        (`ScoreMod.with_head_offset`)."""
        if self.score is None or not first:
            return self
        return Mods(self.mask, self.score.with_head_offset(first), self.aux_grads)

    def __bool__(self):
        return self.mask is not None or self.score is not None

    def describe(self) -> str:
        parts = []
        if self.mask is not None:
            parts.append("mask_mod")
        if self.score is not None:
            parts.append("score_mod")
        return " and ".join(parts)


NO_MODS = Mods()


def split_mask(mask):
    """`(built-in mask, MaskMod or None)` of a `mask=` argument (a name, a Mask, a MaskMod)."""
    from ..masks import as_mask
    if isinstance(mask, MaskMod):
        return (mask.base if mask.base is not None else as_mask("full")), mask
    return as_mask(mask), None


def classify(mask_mod: MaskMod, b, q0, q1, k0, k1, ranges: AuxRanges | None = None):
    """Tile classes (EMPTY, PARTIAL, FULL, int8) of the boxes `q_idx in [q0, q1]`,
    `k_idx in [k0, k1]` of sequences `b` (broadcast int arrays), by interval arithmetic over
    the mask graph: O(1) per box whatever its size (aux entries by range queries). A box where
    an aux index may leave its array is PARTIAL, so its pairs are evaluated (and the index
    checked) rather than classified by clamped entries."""
    if ranges is None:
        ranges = AuxRanges(mask_mod.aux)
    b = np.asarray(b, np.int64)
    boxes = {"b": (b, b), "q_idx": (np.asarray(q0, np.int64), np.asarray(q1, np.int64)),
             "k_idx": (np.asarray(k0, np.int64), np.asarray(k1, np.int64))}
    shape = np.broadcast(*(x for v in boxes.values() for x in v)).shape
    return np.broadcast_to(box_class(mask_mod.graph, boxes, ranges), shape).astype(np.int8)


def _alibi(score, b, h, q_idx, k_idx, slopes, shift):
    # FlashAttention 2: bias -slope * |q + (Lk - Lq) - k| (bottom-right aligned)
    return score - slopes[h] * abs(q_idx + shift[b] - k_idx)


def _alibi_per_sequence(score, b, h, q_idx, k_idx, slopes, shift):
    return score - slopes[b, h] * abs(q_idx + shift[b] - k_idx)


def alibi(slopes, shift) -> ScoreMod:
    """FlashAttention 2's ALiBi as a ScoreMod: `score - slopes[h] * |q_idx + shift[b] - k_idx|`
    with `shift[b] = Lk[b] - Lq[b]` (bottom-right alignment; zeros for top-left). `slopes` is
    `[Hq]`, or `[B, Hq]` for slopes per sequence (`slopes[b, h]`)."""
    per_sequence = getattr(slopes, "ndim", 1) == 2
    return ScoreMod(_alibi_per_sequence if per_sequence else _alibi, slopes, shift)
