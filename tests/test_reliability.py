"""Regression tests of the second reliability pass: each test names the defect it guards
against and fails without its fix."""
from __future__ import annotations

import numpy as np
import pytest

import varlen


def _batch(T=5, H=2, D=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((T, H, D)).astype(dtype) for _ in range(3))


# ---- silent wrong answers --------------------------------------------------------------------

@pytest.mark.parametrize("where", ["cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q",
                                   "mask.window_left"])
def test_torch_metadata_on_the_meta_device_is_refused(where):
    """Metadata on the meta device with CPU data made the custom op dispatch to its fake
    implementation: uninitialised memory came back with no error."""
    torch = pytest.importorskip("torch")
    import varlen.torch as vt
    q, k, v = (torch.from_numpy(x) for x in _batch())
    cu = torch.tensor([0, 5], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    if where.startswith("mask."):
        kw["mask"] = varlen.Mask(window_left=torch.tensor([2], dtype=torch.int32,
                                                          device="meta"))
    else:
        kw[where] = cu.to("meta")
    with pytest.raises(TypeError, match=rf"{where} is on device meta but q is on cpu"):
        vt.varlen_attention(q, k, v, **kw)
    if where.startswith("cu_seqlens"):
        with pytest.raises(TypeError, match=rf"{where} is on device meta"):
            vt.flash_attn_varlen_func(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], 5, 5)


def test_backward_refuses_dout_of_another_framework():
    """The forward refused torch k with NumPy q; the backward took a torch dout silently."""
    torch = pytest.importorskip("torch")
    q, k, v = _batch()
    cu = np.array([0, 5], np.int32)
    out, lse = varlen.attention_forward(q, k, v, cu, cu)
    with pytest.raises(TypeError, match=r"k is a torch array but q is a numpy array"):
        varlen.attention_forward(q, torch.from_numpy(k), v, cu, cu)
    for name, args in (("dout", (torch.from_numpy(np.ones_like(out)), q, k, v, out, lse)),
                       ("out", (np.ones_like(out), q, k, v, torch.from_numpy(out), lse)),
                       ("lse", (np.ones_like(out), q, k, v, out, torch.from_numpy(lse)))):
        with pytest.raises(TypeError, match=rf"{name} is a torch array but q is a numpy "
                                            r"array; pass the data arrays from one framework"):
            varlen.attention_backward(*args, cu, cu)


# ---- crashes that become named errors --------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_no_query_heads_is_a_named_error(backend):
    """Hq = 0 with Hk = 1 passed the GQA check (0 % 1 == 0) and divided by zero in the cpu
    backend."""
    q = np.zeros((5, 0, 8), np.float32)
    k = np.zeros((5, 1, 8), np.float32)
    cu = np.array([0, 5], np.int32)
    with pytest.raises(ValueError, match=r"q.shape=\(5, 0, 8\) has no heads; expected Hq >= 1"):
        varlen.attention_forward(q, k, k, cu, cu, backend=backend)


def test_position_ids_of_no_tokens():
    torch = pytest.importorskip("torch")
    from varlen.torch import cu_seqlens_from_position_ids
    for shape in ((1, 0), (0,), (0, 5)):
        cu = cu_seqlens_from_position_ids(torch.zeros(shape, dtype=torch.int64))
        assert cu.tolist() == [0] * (int(np.prod(shape)) + 1) and cu.dtype == torch.int32


def test_pad_input_names_bad_indices():
    torch = pytest.importorskip("torch")
    from varlen.torch import pad_input
    x = torch.randn(3, 2, 4)
    cases = [(torch.tensor([0, 1, 9]), ValueError, r"indices span \[0, 9\] but batch=2 x "
                                                   r"seqlen=3 holds positions \[0, 5\]"),
             (torch.tensor([-1, 1, 2]), ValueError, r"indices span \[-1, 2\]"),
             (torch.tensor([0, 1]), ValueError, r"2 indices for 3 rows of hidden_states"),
             (torch.tensor([0.0, 1, 2]), TypeError, r"indices must be a 1-D integer tensor"),
             (torch.tensor([[0, 1, 2]]), TypeError, r"indices must be a 1-D integer tensor")]
    for indices, error, match in cases:
        with pytest.raises(error, match=match):
            pad_input(x, indices, 2, 3)
    with pytest.raises(ValueError, match=r"seqlen must be a non-negative int, got -3"):
        pad_input(x, torch.tensor([0, 1, 2]), 2, -3)
    assert pad_input(x, torch.tensor([0, 4, 5]), 2, 3)[1, 1:].equal(x[1:])


def test_the_mma_cache_warmer_says_cupy_is_missing():
    import subprocess
    import sys
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    run = subprocess.run([sys.executable, "-m", "varlen.backends.cupy.mma"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "CuPy is not importable" in run.stderr and "Traceback" not in run.stderr


# ---- unclear messages ------------------------------------------------------------------------

def test_flash_attn_func_says_it_takes_torch_tensors():
    pytest.importorskip("torch")
    from varlen.torch import flash_attn_func
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor \(FlashAttention's contract\)"
                                        r", got ndarray"):
        flash_attn_func(q, q, q)


def test_flash_attn_takes_numpy_bools_for_causal():
    torch = pytest.importorskip("torch")
    from varlen.torch import flash_attn_func, flash_attn_varlen_func
    q = torch.randn(1, 4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for causal in (np.True_, np.False_):
        want = flash_attn_func(q, q, q, causal=bool(causal))
        assert torch.equal(flash_attn_func(q, q, q, causal=causal), want)
        assert torch.equal(flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, causal=causal),
                           want[0])


def test_comm_call_without_a_partition_names_part():
    import varlen.comm as vc
    q, k, v = _batch()
    group = vc.local_group(1)[0]
    with pytest.raises(TypeError, match=r"part is required: a varlen.comm.partition"):
        vc.attention_forward(q, k, v, None, group)


def test_comm_call_on_tensors_that_require_grad_warns():
    """varlen.comm's functions return results outside autograd: with tensors that require
    grad they said nothing, and training silently got no gradient."""
    torch = pytest.importorskip("torch")
    import varlen.comm as vc
    import varlen.torch as vt
    part = vc.partition(np.array([0, 4], np.int32), 1)
    group = vc.local_group(1)[0]
    x = torch.randn(part.local_rows, 2, 8, requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"returns results outside autograd.*"
                                            r"varlen.torch.context_parallel_attention"):
        vc.attention_forward(x, x, x, part, group)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.no_grad():
            vc.attention_forward(x, x, x, part, group)
        vt.context_parallel_attention(x, x, x, part, group).sum().backward()
    assert x.grad is not None


def test_the_readme_lists_every_extra():
    """The extras table lacked `[cpu]`."""
    import configparser
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(root, "setup.cfg"))
    extras = set(cfg["options.extras_require"])
    with open(os.path.join(root, "README.md")) as f:
        listed = set(re.findall(r"`\[(\w+)\]`", "".join(line for line in f
                                                      if line.startswith("| `["))))
    assert extras <= listed, f"README's extras table lacks {sorted(extras - listed)}"


# ---- the suite itself -----------------------------------------------------------------------

BLOCK_FRAMEWORKS = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "jax", "jaxlib", "cupy", "transformers"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "", "-p", "no:cacheprovider", "tests"]))
"""


def test_every_test_file_collects_without_torch_jax_or_cupy():
    """A machine without the optional frameworks collects the whole suite: the tests that need
    one skip (importorskip) instead of failing collection."""
    import subprocess
    import sys
    from helpers import ROOT
    run = subprocess.run([sys.executable, "-c", BLOCK_FRAMEWORKS], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_the_readme_tier_table_is_the_suite_s(pytestconfig):
    """README's tier table names every tier of tests/conftest.py, each with its folder, and its
    full command is the one `.ci/run` runs; the default command's tiers are setup.cfg's."""
    import configparser
    import os
    import re
    from helpers import ROOT
    # tests/conftest.py as pytest loaded it (tests/numba/conftest.py may hold the name conftest)
    path = os.path.realpath(os.path.join(ROOT, "tests", "conftest.py"))
    root_conftest = next(m for m in pytestconfig.pluginmanager.get_plugins()
                         if os.path.realpath(getattr(m, "__file__", None) or "") == path)
    FOLDER_TIERS, TIERS = root_conftest.FOLDER_TIERS, root_conftest.TIERS
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = readme.split("### Test tiers", 1)[1].split("\n\n")[2]
    rows = {r.split("|")[1].strip().split(" ")[0]: r for r in table.splitlines()[2:]}
    missing = set(TIERS) - {"slow"} - set(rows)
    assert not missing, f"README's tier table lacks {missing}"
    for folder, tier in FOLDER_TIERS.items():
        assert f"`tests/{folder}/`" in rows[tier], (tier, rows[tier])
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    full = re.search(r"`(VARLEN_TEST_CASES=full python -m pytest [^`]*)`", table)[1]
    assert full in ci, f".ci/run does not run README's full command {full}"
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert '-m "quick or smoke or gpu"' in cfg["tool:pytest"]["addopts"]
    assert "@@" not in readme, "a figure of the README's tier table is not filled in"
