"""The CuPy backend's implementations as first-class choices: `cupy:sm90a` and `cupy:mma` in the
registry and in `explain()`, each with its reason to refuse a call, `backend="cupy:sm90a"` naming
one, the family `backend="cupy"` choosing per pass, and `varlen.plan(..., backend=...)` asking
the named backend for its plan builder. Device questions are answered by stand-in devices (no
GPU here); the launches are stubbed to name themselves."""
from __future__ import annotations

import numpy as np
import pytest

import varlen
from varlen import backends
from varlen.backends import Problem
from varlen.backends.cupy import BACKEND, MmaImplementation, Sm90aImplementation
from varlen.backends.cupy.traits import DeviceInfo

H100 = DeviceInfo((9, 0), 227 * 1024, "NVIDIA H100")
A100 = DeviceInfo((8, 0), 163 * 1024, "NVIDIA A100")
L40S = DeviceInfo((8, 9), 99 * 1024, "NVIDIA L40S")
T4 = DeviceInfo((7, 5), 64 * 1024, "Tesla T4")


def device_call(dtype="float16", head_dim=64, head_dim_v=None):
    return Problem(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v or head_dim,
                   on_device=True)


def test_registry_names_every_implementation():
    assert backends.names() == ("numpy", "cpu", "numba", "cupy", "cupy:sm90a", "cupy:mma")
    assert isinstance(backends.get("cupy:sm90a"), Sm90aImplementation)
    assert isinstance(backends.get("cupy:mma"), MmaImplementation)
    assert backends.get("cupy") is BACKEND
    assert [i.name for i in BACKEND.implementations] == ["cupy:sm90a", "cupy:mma"]
    with pytest.raises(ValueError, match=r"backend='cupy:wgmma' is not a known backend; "
                                         r"expected one of .*'cupy:sm90a', 'cupy:mma'"):
        backends.get("cupy:wgmma")


def test_explain_gives_each_implementation_its_reason():
    with BACKEND.stand_in_device(A100):
        rows = dict(backends.explain(device_call()))
        # the family is not chosen by default before its GPU check: neither is its member
        assert "not chosen by default yet" in rows["cupy"]
        assert "backend='cupy:mma'" in rows["cupy:mma"]
        assert "compute capability 9.0 only" in rows["cupy:sm90a"]
        assert "sm_80" in rows["cupy:sm90a"]
        # D = 96: mma.sync only; float32: neither
        rows = dict(backends.explain(device_call(head_dim=96)))
        assert "head_dim=96 is not compiled" in rows["cupy:sm90a"]
        rows = dict(backends.explain(device_call(dtype="float32")))
        assert "dtype float32" in rows["cupy:mma"] and "dtype float32" in rows["cupy:sm90a"]
    with BACKEND.stand_in_device(H100):
        rows = dict(backends.explain(device_call()))
        # supported, but not chosen by default until the GPU check has passed on one
        assert "not chosen by default yet" in rows["cupy:sm90a"]
        assert "backend='cupy:sm90a'" in rows["cupy:sm90a"]
        rows = dict(backends.explain(device_call(head_dim=128, head_dim_v=64)))
        assert "head_dim_v=64 differs" in rows["cupy:sm90a"]
    with BACKEND.stand_in_device(T4):
        rows = dict(backends.explain(device_call()))
        assert "sm_80 or newer" in rows["cupy:mma"]
    rows = dict(backends.explain(dtype="float16", head_dim=64))
    assert "arrays live on the host" in rows["cupy:mma"]


def test_explain_once_the_family_is_default_eligible(monkeypatch):
    from varlen.backends.cupy import CupyBackend
    monkeypatch.setattr(CupyBackend, "default_eligible", True)
    with BACKEND.stand_in_device(A100):
        rows = dict(backends.explain(device_call()))
        assert rows["cupy"] is None and rows["cupy:mma"] is None
    with BACKEND.stand_in_device(H100):
        rows = dict(backends.explain(device_call()))
        assert rows["cupy:mma"] is None and "not chosen by default" in rows["cupy:sm90a"]
        monkeypatch.setattr(Sm90aImplementation, "default_eligible", True)
        rows = dict(backends.explain(device_call()))
        assert rows["cupy:sm90a"] is None


def test_named_implementation_is_selected_or_refused_with_its_reason():
    with BACKEND.stand_in_device(H100):
        assert backends.select("cupy:sm90a", device_call()).name == "cupy:sm90a"
        assert backends.select("cupy:mma", device_call()).name == "cupy:mma"
    with BACKEND.stand_in_device(A100), pytest.raises(
            ValueError, match=r"backend='cupy:sm90a' cannot run this call: the GPU is NVIDIA "
                              r"A100 \(sm_80\); the sm_90a kernels .* 9.0 only"):
        backends.select("cupy:sm90a", device_call())


def _stub_launches(monkeypatch):
    from varlen.backends.cupy import mma, sm90
    ran = []
    monkeypatch.setattr(sm90, "forward", lambda *a, **k: ran.append("sm90a") or "sm90a")
    monkeypatch.setattr(mma, "forward", lambda *a, **k: ran.append("mma") or "mma")
    monkeypatch.setattr(sm90, "backward",
                        lambda *a, deterministic, **k: ran.append(("sm90a", deterministic))
                        or "sm90a")
    monkeypatch.setattr(mma, "backward",
                        lambda *a, deterministic, **k: ran.append(("mma", deterministic))
                        or "mma")
    monkeypatch.setattr(MmaImplementation, "_require_fit", lambda *a: None)
    return ran


class _Plan:
    block_m, block_n = 64, 64


def test_family_runs_sm90a_only_once_it_is_default_eligible(monkeypatch):
    """The family takes, per pass, the first default-eligible implementation with a variant
    for it: mma.sync until the sm_90a kernels are default-eligible (after the GPU check), then
    sm_90a on compute capability 9.0 only, mma.sync for what it has no variant for (D = 96)
    and on every other GPU, silently."""
    import warnings
    ran = _stub_launches(monkeypatch)
    q = np.zeros((4, 2, 64), np.float16)
    q96 = np.zeros((4, 2, 96), np.float16)
    lse = np.zeros((2, 4), np.float32)
    call = dict(softmax_scale=0.125, softcap=0.0)

    def both(device, x=q):
        with BACKEND.stand_in_device(device):
            return (BACKEND.forward(_Plan(), x, x, x, **call),
                    BACKEND.backward(_Plan(), x, x, x, x, x, lse, **call))
    assert Sm90aImplementation.default_eligible is False     # no GPU has passed the check
    assert both(H100) == ("mma", "mma")
    monkeypatch.setattr(Sm90aImplementation, "default_eligible", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert both(H100) == ("sm90a", "sm90a")
        assert both(L40S) == ("mma", "mma")
        assert both(H100, q96) == ("mma", "mma")
    assert ran[:2] == ["mma", ("mma", False)]


def test_named_sm90a_runs_both_passes_and_both_dq_modes(monkeypatch):
    ran = _stub_launches(monkeypatch)
    sm90a = backends.get("cupy:sm90a")
    q = np.zeros((4, 2, 256), np.float16)
    lse = np.zeros((2, 4), np.float32)
    call = dict(softmax_scale=0.125, softcap=0.0)
    with BACKEND.stand_in_device(H100):
        assert sm90a.forward(_Plan(), q, q, q, **call) == "sm90a"
        assert sm90a.backward(_Plan(), q, q, q, q, q, lse, deterministic=True, **call) == "sm90a"
    assert ran == ["sm90a", ("sm90a", True)]


def test_sm90a_says_which_plans_it_has_no_variant_for():
    sm90a = backends.get("cupy:sm90a")
    q = np.zeros((4, 2, 256), np.float16)

    class Wide:
        block_m, block_n = 128, 128
    assert sm90a.runs("fwd", _Plan(), q, 0.0) is None
    assert "consumer warpgroups split the columns" in sm90a.runs("bwd", Wide(), q, 0.0)


def test_plan_asks_the_named_backend_for_its_builder(monkeypatch):
    """`varlen.plan(backend=None)` builds host plans by array code; `backend=` names the
    builder (a device-only builder refuses host cu_seqlens with its reason), and every builder
    writes the same plan."""
    cu = np.array([0, 3, 3, 70], np.int32)
    host = varlen.plan(cu, cu, mask="causal")
    called = []
    numba = backends.get("numba")
    if numba is not None and numba.can_plan(False) is None:
        original = type(numba).plan_from_cu_seqlens

        def spy(self, *a, **k):
            called.append("numba")
            return original(self, *a, **k)
        monkeypatch.setattr(type(numba), "plan_from_cu_seqlens", spy)
        built = varlen.plan(cu, cu, mask="causal", block_m=16, block_n=16, backend="numba")
        ref = varlen.plan(cu, cu, mask="causal", block_m=16, block_n=16)
        assert called == ["numba"]
        for a, b in zip(built.view(), ref.view()):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"backend='cupy:mma' cannot build this plan: it builds "
                                         r"plans of CUDA device arrays"):
        varlen.plan(cu, cu, backend="cupy:mma")
    with pytest.raises(ValueError, match=r"backend='tpu' is not a known backend"):
        varlen.plan(cu, cu, backend="tpu")
    assert host.block_m == 64
