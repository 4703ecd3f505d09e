"""The package's import structure, as docs/architecture.md states it: no import cycle among the
modules of `varlen/` and `comm/` (imports inside functions included), every import goes to the
importer's own layer or one below it (the layers block of docs/architecture.md), the longest
chain of imports is the length the page gives, and no product module imports the test
machinery (`emulation/`, `tests/`), which the wheel does not ship."""
from __future__ import annotations

import ast
import configparser
import fnmatch
import os
import re
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"varlen": "varlen", "varlen.comm": "comm", "varlen.kernels_cuda": "kernels_cuda"}
TEST_MACHINERY = ("emulation", "tests", "helpers")


def _modules() -> dict:
    """{module name: path} of every product module."""
    mods = {}
    for pkg, folder in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if not f.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                if pkg == "varlen" and parts[:1] in (["comm"], ["kernels_cuda"]):
                    continue
                mods[".".join([pkg, *parts])] = os.path.join(dirpath, f)
    return mods


def _imports(name: str, path: str, mods: dict):
    """(product modules `name` imports, top-level names of everything it imports), every
    `import` statement counted, those inside functions too. `from . import x` is an import of
    submodule x when there is one, else of the package."""
    is_pkg = path.endswith("__init__.py")
    inside, tops = set(), set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            subs = [f"{module}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in mods]
            if len(targets) < len(subs):
                targets.append(module)
        else:
            continue
        for t in targets:
            tops.add(t.split(".")[0])
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                inside.add(t)
    return inside, tops


@lru_cache(maxsize=None)
def _graph():
    mods = _modules()
    graph, tops = {}, {}
    for name, path in mods.items():
        graph[name], tops[name] = _imports(name, path, mods)
    return graph, tops


def _doc() -> str:
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        return f.read()


def _layers() -> list:
    """The layers block of docs/architecture.md, top first: [(layer, [module patterns])]."""
    block = re.search(r"```layers\n(.*?)```", _doc(), re.S)[1]
    return [(line.split()[0], line.split()[1:]) for line in block.splitlines() if line.strip()]


def _layer_of(module: str, layers) -> int | None:
    for i, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    return None


def _cycle(graph) -> list | None:
    """A cycle of the graph as a list of modules, or None."""
    state = {}

    def visit(v, stack):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w, stack)
                if found:
                    return found
        stack.pop()
        state[v] = "done"
        return None
    for v in sorted(graph):
        if v not in state:
            found = visit(v, [])
            if found:
                return found
    return None


def _longest_chain(graph) -> list:
    @lru_cache(maxsize=None)
    def chain(v):
        return max(((v, *chain(w)) for w in graph[v]), key=len, default=(v,))
    return list(max((chain(v) for v in graph), key=len))


def test_no_import_cycle():
    graph, _ = _graph()
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_every_import_goes_down_the_documented_layers():
    graph, _ = _graph()
    layers = _layers()
    unplaced = sorted(m for m in graph if _layer_of(m, layers) is None)
    assert not unplaced, f"modules in no layer of docs/architecture.md: {unplaced}"
    upward = [f"{m} ({layers[_layer_of(m, layers)][0]}) -> {w} ({layers[_layer_of(w, layers)][0]})"
              for m in sorted(graph) for w in sorted(graph[m])
              if _layer_of(w, layers) < _layer_of(m, layers)]
    assert not upward, "imports up the layers of docs/architecture.md:\n" + "\n".join(upward)


def test_the_longest_chain_is_the_documented_one():
    graph, _ = _graph()
    chain = _longest_chain(graph)
    said = re.search(r"longest chain of imports is (\d+) modules", _doc())
    assert said, "docs/architecture.md gives no longest chain"
    assert int(said[1]) == len(chain), (
        f"docs/architecture.md says {said[1]}; the longest chain is {len(chain)}: "
        f"{' -> '.join(chain)}")


def test_the_product_never_imports_the_test_machinery():
    _, tops = _graph()
    bad = sorted(f"{m} imports {t}" for m, ts in tops.items() for t in ts
                 if t in TEST_MACHINERY)
    assert not bad, bad


def test_the_wheel_ships_no_test_machinery():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    packages = cfg["options"]["packages"].split()
    assert not [p for p in packages if p.split(".")[0] in TEST_MACHINERY or "emulation" in p]
    data = cfg["options.package_data"]
    assert all("emulation" not in v for v in data.values())
    kernels = os.listdir(os.path.join(ROOT, "kernels_cuda"))
    assert not [f for f in kernels if "emulation" in f], kernels
