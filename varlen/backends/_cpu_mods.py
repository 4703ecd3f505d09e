"""User functions (mask_mod, score_mod) on the `cpu` backend: the per-function tile kernels.

The generic kernels (`_cpu_kernels.forward`, `backward`, given the functions) are compiled once
per working dtype and cached on disk like the others; they take the user's functions as Numba
first-class functions of fixed signatures, one indirect call per tile, never per pair. What
differs per function is a small tile kernel generated here around the scalar code of
`varlen.mods.codegen.python_source` (inlined into its loops):

* `mask_tile` (a mask graph): fills the visibility of one (query tile, key tile) block that the
  plan classifies PARTIAL;
* `score_tile` (a score graph, per working dtype): the forward's scores of one product, the
  score_mod applied to the scaled (softcapped) logit, in the log2 domain with the tile max;
* `grad_tile` (a score graph, per working dtype): the backward's P and dS of one product, dS
  times d(score_mod)/d(score), and with `want_aux` the gradients of the float aux arrays
  (dS times d(score_mod)/d(aux[index]) added at the read's index into the item's float64 row).

Aux arrays reach a tile kernel as three arrays of fixed types (`AuxPack`): every int and bool
aux as int64 and every float aux as float64, each flattened into one array, and a table of
offsets and shapes; the generated code views them back with their ranks.

The generated source is written to a file beside Numba's cache of the kernels (named by the
graph's digest) and compiled with `cache=True`, so a later process loads it; without that
cache, in memory only. Compiled tile kernels are kept per (role, digest, working dtype).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading

import numpy as np

from ..mods import codegen
from ..mods.evaluate import evaluate
from ..mods.graph import Graph

__all__ = ["AuxPack", "pack_aux", "mask_tile", "score_tile", "grad_tile", "float_offsets",
           "find_index_error"]

LOG2E = 1.4426950408889634          # 1/ln(2)
# Bumped when the templates below change: it names the generated files.
TEMPLATE_VERSION = 1


class AuxPack:
    """A function's aux arrays as the tile kernels read them: `ints` (int64, every int and bool
    aux flattened in order), `floats` (float64, every float aux), `table` int64 `[n, 5]`
    (offset into its flat array, then up to four dimensions)."""

    def __init__(self, graph: Graph, aux):
        ints, floats, table = [], [], np.zeros((max(len(aux), 1), 5), np.int64)
        n_int = n_float = 0
        for i, ((kind, ndim, _), a) in enumerate(zip(graph.aux, aux)):
            a = np.asarray(a)
            flat = a.reshape(-1)
            if kind == "float":
                table[i, 0] = n_float
                floats.append(flat.astype(np.float64))
                n_float += flat.size
            else:
                table[i, 0] = n_int
                ints.append(flat.astype(np.int64))
                n_int += flat.size
            table[i, 1:1 + ndim] = a.shape
        self.ints = np.ascontiguousarray(np.concatenate(ints) if ints else np.zeros(1, np.int64))
        self.floats = np.ascontiguousarray(np.concatenate(floats) if floats else
                                           np.zeros(1, np.float64))
        self.table = table
        self.num_floats = n_float

    def args(self):
        return self.ints, self.floats, self.table


def pack_aux(mod) -> AuxPack:
    return AuxPack(mod.graph, mod.aux)


def float_offsets(graph: Graph, aux) -> list:
    """`[(aux number, offset in the flat float array)]` of the float aux arrays."""
    out, n = [], 0
    for i, ((kind, _, _), a) in enumerate(zip(graph.aux, aux)):
        if kind == "float":
            out.append((i, n))
            n += int(np.prod(np.shape(a)))
    return out


# --------------------------------------------------------------------------------------------
# Generated source
# --------------------------------------------------------------------------------------------

def _unpack_lines(graph: Graph, table: str = "table") -> list:
    """`aK = <flat array>[offset:offset + size].reshape(shape)` for every aux of `graph`."""
    lines = []
    for i, (kind, ndim, _) in enumerate(graph.aux):
        flat = "floats" if kind == "float" else "ints"
        dims = [f"{table}[{i}, {d + 1}]" for d in range(ndim)]
        size = " * ".join(dims)
        shape = "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"
        lines.append(f"    a{i} = {flat}[{table}[{i}, 0]:{table}[{i}, 0] + {size}]"
                     f".reshape({shape})")
    return lines


def _aux_args(graph: Graph) -> str:
    return "".join(f"a{i}, " for i in range(len(graph.aux)))


_HEADER = """\
import math
import numpy as np
from numba import njit

_inline = njit(inline="always", error_model="numpy")
"""


def _scalar(graph: Graph, name: str) -> str:
    return "@_inline\n" + codegen.python_source(graph, name)


def _mask_source(graph: Graph) -> str:
    fn = f"mask_{graph.digest}"
    body = [
        "def mask_tile(M, n, lo, hi, r_lo, r_hi, G, b, qpos0, kpos0, ints, floats, table, err):",
        "    # M [n, rows]: visibility of stacked rows [r_lo, r_hi) inside each key's band",
        *_unpack_lines(graph),
        "    for j in range(n):",
        "        k = kpos0 + j",
        "        row = M[j]",
        "        for t in range(max(lo[j], r_lo) // G, min(hi[j], r_hi) // G):",
        f"            v = {fn}(b, qpos0 + t, k, {_aux_args(graph)}err)",
        "            for i in range(t * G, t * G + G):",
        "                row[i] = v",
    ]
    return "\n".join([_HEADER, _scalar(graph, fn), *body]) + "\n"


def _pair_walk(rows: str, row: str, hide: list) -> list:
    """The loops of a score tile kernel over the pairs of its product, down to the body of one
    pair (`i` its stacked row, `k`, `q`, `h` its positions and head, at 16 spaces): `rows`
    names key `j`'s rows of the outputs (`row` one of them, for its length), `hide` writes a
    pair outside the band or hidden by `M`."""
    def at(depth):
        return [" " * depth + line for line in hide]
    return ["    for j in range(n):", f"        {rows}", "        a, z = lo[j], hi[j]",
            "        for i in range(0, a):", *at(12),
            f"        for i in range(z, {row}.size):", *at(12),
            "        k = kpos0 + j",
            "        for t in range(a // G, z // G):",
            "            q = qpos0 + t",
            "            for g in range(G):",
            "                i = t * G + g",
            "                if use_m and M[j, i] == 0:", *at(20),
            "                    continue"]


def _score_source(graph: Graph, d_score: Graph, d_aux: list) -> str:
    fn, dfn = f"score_{graph.digest}", f"dscore_{graph.digest}"
    parts = [_HEADER, _scalar(graph, fn), _scalar(d_score, dfn)]
    aux = _aux_args(graph)
    leaf_args = f"x, b, h, q, k, {aux}err"
    # per read of a float aux: its derivative and its index expressions
    scatter = []
    for n_load, (load, dgraph) in enumerate(d_aux):
        dname = f"daux{n_load}_{graph.digest}"
        parts.append(_scalar(dgraph, dname))
        i = load.value
        flat = "0"
        for d, node in enumerate(load.args):
            iname = f"idx{n_load}_{d}_{graph.digest}"
            parts.append(_scalar(Graph(node, graph.leaves, graph.aux, graph.role), iname))
            scatter += [f"                    j{d} = {iname}({leaf_args})",
                        f"                    j{d} = min(max(j{d}, 0), table[{i}, {d + 1}] - 1)"]
            flat = f"({flat}) * table[{i}, {d + 1}] + j{d}"
        scatter.append(f"                    gaux[table[{i}, 0] + {flat}] += "
                       f"dsn * {dname}({leaf_args})")
    if not scatter:
        scatter = ["                    pass"]
    forward = [
        "def score_tile(S, n, lo, hi, M, use_m, G, kh, b, qpos0, kpos0, scale, softcap, tmax,",
        "               row_flag, ints, floats, table, err):",
        "    # S [n, R] key-major: products q . k in, log2-domain modified scores out",
        *_unpack_lines(graph),
        "    ninf = -math.inf",
        *_pair_walk("row = S[j]", "row", ["row[i] = ninf"]),
        "                x = float(row[i]) * scale",
        "                if softcap > 0.0:",
        "                    x = softcap * math.tanh(x / softcap)",
        "                h = kh * G + g",
        f"                y = {fn}({leaf_args})",
        "                if y != y or y == math.inf:",
        "                    row_flag[i] = True",
        "                    y = ninf",
        f"                row[i] = y * {LOG2E!r}",
        "                if row[i] > tmax[i]:",
        "                    tmax[i] = row[i]",
    ]
    backward = [
        "def grad_tile(S, dP, n, lo, hi, M, use_m, G, kh, b, qpos0, kpos0, lse2, lse2_lo, delta,",
        "              one_cum, scale, softcap, gaux, want_aux, ints, floats, table, err):",
        "    # S: products q . k in, P out; dP: dO . v in, dS (of the raw product) out",
        *_unpack_lines(graph),
        *_pair_walk("s_row, d_row = S[j], dP[j]", "s_row", ["s_row[i] = 0", "d_row[i] = 0"]),
        "                x = float(s_row[i]) * scale",
        "                sech2 = 1.0",
        "                if softcap > 0.0:",
        "                    th = math.tanh(x / softcap)",
        "                    x = softcap * th",
        "                    sech2 = (1.0 - th) * (1.0 + th)",
        "                h = kh * G + g",
        f"                y = {fn}({leaf_args})",
        "                p = 0.0",
        "                if y > -math.inf:",
        f"                    p = np.exp2((y * {LOG2E!r} - float(lse2[i])) - float(lse2_lo[i]))",
        "                dsn = p * (float(d_row[i]) - float(delta[i]))",
        "                if p == 0.0 or one_cum[i + 1] != one_cum[i]:",
        "                    dsn = 0.0            # hidden, or the softmax of one score",
        "                    if p != 0.0:",
        "                        p = 1.0",
        "                ds = 0.0",
        "                if dsn != 0.0:",
        f"                    ds = dsn * {dfn}({leaf_args}) * sech2 * scale",
        "                if want_aux and dsn != 0.0:",
        *scatter,
        "                s_row[i] = p",
        "                d_row[i] = ds",
    ]
    return "\n".join(parts + forward + [""] + backward) + "\n"


# --------------------------------------------------------------------------------------------
# Compilation and the caches
# --------------------------------------------------------------------------------------------

_lock = threading.RLock()
_modules: dict = {}
_compiled: dict = {}


def _source_dir() -> str | None:
    """Where generated sources are written: beside Numba's cache of the kernels."""
    from . import _cpu_kernels as K
    path = K.forward.stats.cache_path
    if not path:
        return None
    path = os.path.join(path, "varlen_mods")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path


def _load(name: str, source: str):
    """The module of `source` (from a file named after its text when one can be written,
    so that Numba caches what it compiles; else executed in memory)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod = _modules.get(key)
    if mod is not None:
        return mod
    directory = _source_dir()
    if directory is not None:
        path = os.path.join(directory, f"{name}_v{TEMPLATE_VERSION}_{key}.py")
        try:
            if not os.path.exists(path):
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(source)
                os.replace(tmp, path)
            spec = importlib.util.spec_from_file_location(f"varlen_mods_{name}_{key}", path)
            mod = importlib.util.module_from_spec(spec)
            # importable by name: Numba's cache finds a compiled function's globals there
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        except OSError:
            mod = None
    if mod is None:
        import types
        mod = types.ModuleType(f"varlen_mods_{name}_{key}")
        sys.modules[mod.__name__] = mod
        exec(compile(source, f"<varlen mods {name}>", "exec"), mod.__dict__)
    _modules[key] = mod
    return mod


def _signatures(wdt):
    from numba import types as T
    W = T.float32 if np.dtype(wdt) == np.float32 else T.float64
    C2, C1 = (lambda t: T.Array(t, 2, "C")), (lambda t: T.Array(t, 1, "C"))
    A1 = lambda t: T.Array(t, 1, "A")          # noqa: E731
    i64, f64, u8 = T.int64, T.float64, T.uint8
    aux = (C1(i64), C1(f64), C2(i64), C1(T.int32))
    mask = T.void(C2(u8), i64, C1(i64), C1(i64), i64, i64, i64, i64, i64, i64, *aux)
    score = T.void(C2(W), i64, C1(i64), C1(i64), C2(u8), T.boolean, i64, i64, i64, i64, i64,
                   f64, f64, A1(W), A1(T.boolean), *aux)
    grad = T.void(C2(W), C2(W), i64, C1(i64), C1(i64), C2(u8), T.boolean, i64, i64, i64, i64,
                  i64, A1(W), A1(W), A1(W), A1(i64), f64, f64, C1(f64), T.boolean, *aux)
    return {"mask": mask, "score": score, "grad": grad}


def _compile(kind: str, graph_key: str, source_fn, wdt):
    """The first-class function (a `WrapperAddressProtocol` object) of tile kernel `kind`."""
    key = (kind, graph_key, np.dtype(wdt).name)
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _compiled.get(key)
        if fn is None:
            from numba import njit
            from numba.core.types.function_type import CompileResultWAP
            mod = source_fn()
            sig = _signatures(wdt)[kind]
            disp = njit(sig, error_model="numpy", cache=hasattr(mod, "__file__"))(
                getattr(mod, f"{kind}_tile"))
            fn = _compiled[key] = CompileResultWAP(disp.overloads[sig.args])
    return fn


def mask_tile(mask_mod, wdt):
    g = mask_mod.graph
    return _compile("mask", g.digest, lambda: _load(f"mask_{g.digest}", _mask_source(g)), wdt)


def _score_module(score_mod):
    g = score_mod.graph
    return _load(f"score_{g.digest}",
                 _score_source(g, score_mod.d_score(), score_mod.d_aux()))


def score_tile(score_mod, wdt):
    return _compile("score", score_mod.digest, lambda: _score_module(score_mod), wdt)


def grad_tile(score_mod, wdt):
    return _compile("grad", score_mod.digest, lambda: _score_module(score_mod), wdt)


# --------------------------------------------------------------------------------------------
# An aux index out of range: which function, which aux, which index
# --------------------------------------------------------------------------------------------

def find_index_error(mod, plan, heads: int = 1) -> IndexError:
    """The `IndexError` the kernels flagged (`err`): the function is evaluated with checks on
    the host over each sequence's pairs until a read outside an aux array is found."""
    role = mod.graph.role
    view = plan.view()
    lq = np.asarray(view.seqlen_q, np.int64)
    lk = np.asarray(view.seqlen_k, np.int64)
    for b in range(lq.size):
        leaves = {"b": np.int64(b), "q_idx": np.arange(lq[b])[:, None],
                  "k_idx": np.arange(lk[b])[None, :]}
        if role == "score_mod":
            leaves = {"score": np.zeros((1, 1, 1)), "b": np.int64(b),
                      "h": np.arange(heads)[:, None, None],
                      "q_idx": np.arange(lq[b])[None, :, None],
                      "k_idx": np.arange(lk[b])[None, None, :]}
        try:
            evaluate(mod.graph, leaves, mod.aux, check=True)
        except IndexError as e:
            return e
    return IndexError(f"{role} read an aux array outside its shape (an index was clamped); "
                      f"every index must lie in [0, size) of its dimension")

