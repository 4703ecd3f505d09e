"""docs/mods.md stays true: every code block runs, every picture is what `describe()` draws,
every gallery example matches the float64 reference, every public name it shows exists.

The page's conventions (keep them when editing it):
* a ```python block runs as is, in a fresh namespace holding `np` and `varlen`;
* a ```text block right after a ```python block (blank lines between at most) is its result:
  `plan: ...` is the picture `varlen.plan(cu, cu, mask=mask, block_m=64, block_n=64)
  .describe()` of the block's `lengths`, `mask` (default "full") and `score_mod`; `XError: ...`
  is the exception the block raises, its message exact (the block runs as file `model.py`).
"""
import ast
import builtins
import dataclasses
import inspect
import linecache
import re
from pathlib import Path

import numpy as np
import pytest

import varlen
import varlen.mods
import varlen.reference
from varlen import MaskMod
from varlen.reference import attention_dense

import mods_cases
from helpers import check_numpy_backend, nan_padded_batch

PAGE = Path(__file__).resolve().parent.parent / "docs" / "mods.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def _blocks():
    """`[(heading, python source, result text or None)]` of the page, in order."""
    text = PAGE.read_text()
    found, heading, pos = [], "intro", 0
    matches = list(BLOCK.finditer(text))
    for n, m in enumerate(matches):
        for h in re.findall(r"^#+ (.+)$", text[pos:m.start()], re.M):
            heading = h
        pos = m.end()
        if m.group(1) != "python":
            continue
        result = None
        nxt = matches[n + 1] if n + 1 < len(matches) else None
        if nxt is not None and nxt.group(1) == "text" and not text[m.end():nxt.start()].strip():
            result = nxt.group(2)
        found.append((heading, m.group(2), result))
    return found


BLOCKS = _blocks()
GALLERY = [(h, src, res) for h, src, res in BLOCKS if res is not None and res.startswith("plan:")]


def _run(src: str) -> dict:
    ns = {"np": np, "varlen": varlen}
    linecache.cache["model.py"] = (len(src), None, src.splitlines(True), "model.py")
    exec(compile(src, "model.py", "exec"), ns)
    return ns


def _cu(lengths, gap=0):
    lengths = np.asarray(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    off = np.concatenate([[0], np.cumsum(lengths + gap)]).astype(np.int32)
    return cu, off


def test_the_page_has_its_gallery():
    assert [h for h, _, _ in GALLERY] == [
        "Prefix-LM", "Chunked causal (Llama 4)", "Sliding window and global tokens",
        "Segments inside a document", "Tree mask (speculative decoding)", "ALiBi",
        "Learnable relative-position bias", "T5 relative buckets"]


@pytest.mark.parametrize("heading,src,result", BLOCKS,
                         ids=[f"{h}-{i}" for i, (h, _, _) in enumerate(BLOCKS)])
def test_every_block_runs_and_shows_its_result(heading, src, result):
    error = re.match(r"(\w+Error): (.*)\n$", result or "", re.S)
    if error:
        with pytest.raises(getattr(builtins, error[1], Exception)) as info:
            _run(src)
        assert type(info.value).__name__ == error[1]
        assert str(info.value) == error[2], f"the page shows another message; today's:\n" \
                                            f"{error[1]}: {info.value}"
        return
    ns = _run(src)
    if result is not None and result.startswith("plan:"):
        cu, _ = _cu(ns["lengths"])
        drawn = varlen.plan(cu, cu, mask=ns.get("mask", "full"), block_m=64,
                            block_n=64).describe() + "\n"
        assert drawn == result, f"docs/mods.md, {heading}: the picture is now\n{drawn}"


def test_the_gallery_shows_the_functions_of_mods_cases():
    """A function of the page named as one of tests/mods_cases.py is that one, letter for
    letter (the backends' tests run mods_cases)."""
    shown = {}
    for _, src, _ in GALLERY:
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and hasattr(mods_cases, node.name):
                shown[node.name] = ast.dump(node)
    assert set(shown) == {"prefix_lm", "chunked_causal", "sliding_global", "document_segments",
                          "tree", "alibi", "relative_bias", "t5_buckets", "t5_bucket_table"}
    for name, dump in shown.items():
        want = ast.dump(ast.parse(inspect.getsource(getattr(mods_cases, name))).body[0])
        assert dump == want, f"docs/mods.md's {name} differs from tests/mods_cases.py's"


@pytest.mark.parametrize("heading,src,result", GALLERY, ids=[h for h, _, _ in GALLERY])
def test_each_example_matches_the_reference(heading, src, result):
    """Forward, backward and aux gradients of the numpy backend against the float64 reference,
    GQA, padding gaps of NaN between the sequences, NaN-filled fresh buffers."""
    ns = _run(src)
    lengths = ns["lengths"]
    Hq = ns.get("heads", 2)
    Hk = Hq // 2 if Hq % 2 == 0 else Hq
    cu, off, q, k, v, do, rows = nan_padded_batch(np.random.default_rng(len(heading)), lengths,
                                                  Hq, Hk, gap=3, D=16, Dv=16)
    check_numpy_backend(q, k, v, do, cu, rows, seq_offsets=off, mask=ns.get("mask", "full"),
                        score_mod=ns.get("score_mod"))


def test_every_name_the_page_shows_exists():
    text = PAGE.read_text()
    names = set(re.findall(r"\bvarlen(?:\.[A-Za-z_]\w*)+", text))
    optional = ("varlen.torch", "varlen.jax", "varlen.comm")     # need their frameworks
    missing = []
    for name in sorted(names):
        if name.startswith(optional):
            continue
        obj = varlen
        for part in name.split(".")[1:]:
            if not hasattr(obj, part):
                missing.append(name)
                break
            obj = getattr(obj, part)
    assert not missing, f"docs/mods.md names what does not exist: {missing}"
    for attr in set(re.findall(r"\bplan\.([a-z_]\w*)", text)) - {"md"}:
        fields = {f.name for f in dataclasses.fields(varlen.Plan)}
        assert hasattr(varlen.Plan, attr) or attr in fields, f"docs/mods.md names plan.{attr}"
    for attr in set(re.findall(r"\bScoreMod\.([a-z_]\w*)", text)):
        assert hasattr(varlen.ScoreMod, attr), f"ScoreMod.{attr}"


def test_an_aux_index_outside_its_array_is_an_index_error_on_the_host():
    """The page's index rule: a tile where an index may leave its array is computed, never
    classified full or empty by the clamped entries (which skipped the error)."""
    cu = np.array([0, 200], np.int32)
    q = np.random.default_rng(0).standard_normal((200, 1, 8))
    everywhere = MaskMod(lambda b, i, j, t: t[i - j], np.ones(200, bool))  # j > i: t[-1]...
    above = MaskMod(lambda b, i, j, t: t[i - j + 63] & (j <= i), np.ones(263, bool))
    for mask in (everywhere, above):
        with pytest.raises(IndexError, match=r"mask_mod reads aux argument 0 .* at index \(-"):
            attention_dense(q, q, q, cu, cu, mask=mask)
        with pytest.raises(IndexError, match=r"mask_mod reads aux argument 0 .* at index \(-"):
            varlen.attention_forward(q, q, q, cu, cu, mask=mask, backend="numpy")
    in_range = MaskMod(lambda b, i, j, t: t[varlen.maximum(i - j, 0)] & (j <= i),
                       np.ones(200, bool))
    start, classes = varlen.plan(cu, cu, mask=in_range).tile_classes("q")
    assert (classes == varlen.mods.FULL).sum() == 6, "provably in range: classified as usual"


@pytest.mark.parametrize("value", [-np.inf, np.nan, np.inf], ids=["-inf", "nan", "+inf"])
def test_a_score_mod_s_non_finite_result(value):
    """-inf hides the pair (the row left with none: out 0, lse -inf); NaN and +inf: a NaN row.
    Only the row that has the pair changes, in the numpy backend as in the reference."""
    cu = np.array([0, 4, 10], np.int32)
    q = np.random.default_rng(1).standard_normal((10, 2, 8))
    row6 = varlen.ScoreMod(lambda s, b, h, i, j: varlen.where((b == 1) & (i == 2), value, s))
    for out, lse in (attention_dense(q, q, q, cu, cu, score_mod=row6),
                     varlen.attention_forward(q, q, q, cu, cu, score_mod=row6, backend="numpy")):
        if value == -np.inf:
            assert np.all(out[6] == 0) and np.all(lse[:, 6] == -np.inf)
        else:
            assert np.isnan(out[6]).all() and np.isnan(lse[:, 6]).all()
        others = np.delete(np.arange(10), 6)
        assert np.isfinite(out[others]).all() and np.isfinite(lse[:, others]).all()
