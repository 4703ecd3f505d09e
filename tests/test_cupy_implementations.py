"""The CuPy backend's implementations as first-class choices: `cupy:sm90a` and `cupy:mma` in the
registry and in `explain()`, each with its reason to refuse a call, `backend="cupy:sm90a"` naming
one, the family `backend="cupy"` choosing per pass, and `varlen.plan(..., backend=...)` asking
the named backend for its plan builder. Device questions are answered by stand-in devices (no
GPU here); the launches are stubbed to name themselves. Device support of `cupy:mma` on stand-in
device properties: compute capability sm_80 or newer, plan tiles whose kernels fit the GPU's
opt-in shared memory per block (a 99 KiB sm_86/sm_89 gets the same (128, 64) tiles as an A100,
and runs the deterministic backward wherever the atomic one runs: the same kernels), device
attributes read once per device, and the same NVRTC options (include directories) at run time
as in the compile-budget check."""
from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest

import varlen
import varlen.backends.cupy.launch as _cupy_launch
import varlen.backends.cupy.mma as _cupy_mma
import varlen.backends.cupy.traits as _cupy_traits
from varlen import backends
from varlen.backends import Problem
from varlen.backends.cupy import BACKEND, MmaImplementation, Sm90aImplementation
from varlen.backends.cupy.mma import KernelSpec
from varlen.backends.cupy.traits import DeviceInfo

KIB = 1024
H100 = DeviceInfo((9, 0), 227 * KIB, "NVIDIA H100")
A100 = DeviceInfo((8, 0), 163 * KIB, "NVIDIA A100")
A6000 = DeviceInfo((8, 6), 99 * KIB, "NVIDIA RTX A6000")
L40S = DeviceInfo((8, 9), 99 * KIB, "NVIDIA L40S")
T4 = DeviceInfo((7, 5), 64 * KIB, "Tesla T4")


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
        assert "(head_dim, head_dim_v)=(128, 64) is not compiled" in rows["cupy:sm90a"]
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


@pytest.mark.parametrize("D, Dv", _cupy_traits.HEAD_DIM_V_PAIRS,
                         ids=[f"D{d}-Dv{dv}" for d, dv in _cupy_traits.HEAD_DIM_V_PAIRS])
def test_mma_takes_the_head_dim_v_pairs(D, Dv):
    """head_dim_v < head_dim: cupy:mma runs the compiled pairs forward and backward (the
    refusal of every head_dim_v != head_dim is gone), on the tiles of head_dim; cupy:sm90a runs
    the forward of 192 / 128 and refuses its backward, and refuses the other pairs."""
    mma, sm90a = backends.get("cupy:mma"), backends.get("cupy:sm90a")
    with BACKEND.stand_in_device(H100):
        assert mma.supports(device_call(head_dim=D, head_dim_v=Dv)) is None
        assert mma.supports(_call("bfloat16", D, Dv=Dv, backward=True,
                                  deterministic=True)) is None
        assert backends.select("cupy:mma", device_call(head_dim=D, head_dim_v=Dv)) is mma
        rows = dict(backends.explain(device_call(head_dim=D, head_dim_v=Dv)))
        assert "backend='cupy:mma'" in rows["cupy:mma"]       # only not default-eligible
        backward = sm90a.supports(_call("float16", D, Dv=Dv, backward=True))
        if (D, Dv) in _cupy_traits.SM90_FWD_HEAD_DIM_V_PAIRS:
            assert backward == (
                f"head_dim_v={Dv} differs from head_dim={D}: the sm_90a backward takes "
                f"head_dim_v == head_dim (cupy:mma runs the backward of (head_dim, head_dim_v) "
                f"in {_cupy_traits.HEAD_DIM_V_PAIRS})")
            assert sm90a.supports(device_call(head_dim=D, head_dim_v=Dv)) is None
            assert "backend='cupy:sm90a'" in rows["cupy:sm90a"]
        else:
            assert rows["cupy:sm90a"].endswith(backward) and rows["cupy:sm90a"].endswith(
                f"(head_dim, head_dim_v)=({D}, {Dv}) is not compiled: the sm_90a forward takes "
                f"head_dim_v == head_dim or (head_dim, head_dim_v) in "
                f"{_cupy_traits.SM90_FWD_HEAD_DIM_V_PAIRS}, its backward head_dim_v == "
                f"head_dim (cupy:mma runs {_cupy_traits.HEAD_DIM_V_PAIRS})")


@pytest.mark.parametrize("D, Dv", [(192, 64), (64, 32), (128, 192), (256, 128), (96, 80)])
def test_explain_names_the_refused_head_dim_v(D, Dv):
    """Pairs the mma.sync kernels are not compiled for: a refusal naming both dims and the
    pairs they take, in supports, explain and a named selection."""
    why = (f"(head_dim, head_dim_v)=({D}, {Dv}) is not compiled: the mma.sync kernels take "
           f"head_dim_v == head_dim or (head_dim, head_dim_v) in "
           f"{_cupy_traits.HEAD_DIM_V_PAIRS}")
    with BACKEND.stand_in_device(H100):
        if D in _cupy_traits.HEAD_DIMS:
            assert backends.get("cupy:mma").supports(device_call(head_dim=D,
                                                                 head_dim_v=Dv)) == why
            assert dict(backends.explain(device_call(head_dim=D, head_dim_v=Dv)))[
                "cupy:mma"].endswith(why)
            with pytest.raises(ValueError, match=re.escape(why)):
                backends.select("cupy:mma", device_call(head_dim=D, head_dim_v=Dv))
        with pytest.raises(ValueError, match=r"KernelSpec: "):
            KernelSpec("fwd", "float16", D, 64, 64, False, None, Dv)


def test_head_dim_v_kernel_names():
    """head_dim_v == head_dim keeps the kernels' names (DV defaults to D); a pair appends DV."""
    same = KernelSpec("bwd", "float16", 192, 64, 64, False)
    assert same.head_dim_v == 192
    assert KernelSpec("bwd", "float16", 192, 64, 64, False, None, 192) == same
    assert same.name_expressions == (
        "varlen_bwd_preprocess<__half, 192>",
        "varlen_bwd_dkdv<__half, 192, 64, 32, false, true>",
        "varlen_bwd_dkdv<__half, 192, 64, 32, false, true, true>",
        "varlen_bwd_dq_convert<__half, 192>")
    mla = KernelSpec("bwd", "float16", 192, 64, 64, False, None, 128)
    assert mla.name_expressions == (
        "varlen_bwd_preprocess<__half, 192, 128>",
        "varlen_bwd_dkdv<__half, 192, 64, 32, false, true, false, 128>",
        "varlen_bwd_dkdv<__half, 192, 64, 32, false, true, true, 128>",
        "varlen_bwd_dq_convert<__half, 192>")
    assert mla.dkdv_smem() == same.dkdv_smem() and mla.label == "bwd-float16-D192-Dv128-BM64-BN64"
    fwd = KernelSpec("fwd", "bfloat16", 128, 128, 128, True, None, 64)
    assert fwd.compiled().head_dim_v == 64
    assert fwd.fwd_name() == "varlen_fwd<__nv_bfloat16, 128, 128, 64, true, 32, 2, 64>"
    assert {(s.head_dim, s.head_dim_v) for s in _cupy_mma.all_specs()} >= set(
        _cupy_traits.HEAD_DIM_V_PAIRS)


def test_family_runs_head_dim_v_per_pass(monkeypatch):
    """The family's choice per pass knows head_dim_v: sm_90a, default-eligible, runs the
    forward of 192 / 128 and is passed over for its backward and for the pairs it has no
    kernels for; named, its backward refuses them."""
    ran = _stub_launches(monkeypatch)
    monkeypatch.setattr(Sm90aImplementation, "default_eligible", True)
    lse = np.zeros((2, 4), np.float32)
    call = dict(softmax_scale=0.125, softcap=0.0)
    q128, v64 = np.zeros((4, 2, 128), np.float16), np.zeros((4, 2, 64), np.float16)
    q192 = np.zeros((4, 2, 192), np.float16)
    with BACKEND.stand_in_device(H100):
        assert BACKEND.forward(_Plan(), q128, q128, v64, **call) == "mma"
        assert BACKEND.backward(_Plan(), v64, q128, q128, v64, v64, lse, **call) == "mma"
        assert BACKEND.forward(_Plan(), q128, q128, q128, **call) == "sm90a"
        assert BACKEND.forward(_Plan(), q192, q192, q128, **call) == "sm90a"
        assert BACKEND.backward(_Plan(), q128, q192, q192, q128, q128, lse, **call) == "mma"
        with pytest.raises(ValueError, match=r"backend 'cupy:sm90a' cannot run this backward: "
                                             r"head_dim_v=128 differs from head_dim=192: the "
                                             r"sm_90a backward takes head_dim_v == head_dim"):
            backends.get("cupy:sm90a").backward(_Plan(), q128, q192, q192, q128, q128, lse,
                                                **call)
    assert ran == ["mma", ("mma", False), "sm90a", "sm90a", ("mma", False)]


def test_sm90a_forward_spec_of_head_dim_v():
    """The sm_90a forward's (192, 128) variant: V and the output stage of 128 columns in its
    shared memory, DV appended to its name; D = 192 only with 128, no backward spec."""
    from varlen.backends.cupy import sm90
    spec = sm90.FwdSpec("bfloat16", 192, 64, 64, False, head_dim_v=128)
    assert spec.key_chunk == 64 and spec.name == (
        "varlen_fwd_sm90<__nv_bfloat16, 192, 64, 64, false, 64, 1, 128>")
    # Q [64][192] + 2 x (K [64][192] + V [64][128]) + out [64][136], barriers, alignment
    assert spec.smem == (64 * 192 + 2 * 64 * (192 + 128) + 64 * 136) * 2 + 8 * 12 + 1024
    assert sm90.FwdSpec("float16", 128, 128, 128, False, head_dim_v=128).name == \
        sm90.FwdSpec("float16", 128, 128, 128, False).name
    for d, dv in ((192, 192), (128, 64), (256, 128), (192, 64)):
        with pytest.raises(ValueError, match="FwdSpec: "):
            sm90.FwdSpec("float16", d, 64, 64, False, head_dim_v=dv)
    with pytest.raises(ValueError, match="head_dim=192"):
        sm90.BwdSpec("float16", 192, 64, False)


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


def test_sm90a_backward_runs_a_mask_mod_and_refuses_a_score_mod(monkeypatch):
    """`explain()` no longer refuses a MaskMod (alone or ANDed with a Mask) in the sm_90a
    backward and says that it refuses a ScoreMod, and why; the family, with sm_90a
    default-eligible, runs the backward of a mask_mod there (the functions passed on) and of a
    score_mod on cupy:mma; named, its backward raises the reason."""
    from varlen.backends.cupy import sm90
    from varlen.mods import Mods
    ran = _stub_launches(monkeypatch)
    monkeypatch.setattr(sm90, "backward", lambda *a, deterministic, mods, **k:
                        ran.append(("sm90a", deterministic, mods)) or "sm90a")
    mask = varlen.MaskMod(lambda b, q, k, prefix: (k <= q) | (k < prefix[b]),
                          np.zeros(3, np.int32))
    score = varlen.ScoreMod(lambda s, b, h, q, k, t: s + t[h], np.zeros(2, np.float32))
    refused = ("its sm_90a backward does not run a score_mod (a mask_mod it runs): the "
               "score_mod's per-pair arithmetic beside the dK, dV, S and dP registers of its "
               "consumer warpgroups spills; backend='cupy' (cupy:mma's backward) runs it")

    class Backward(Problem):
        grads = ()
    with BACKEND.stand_in_device(H100):
        for mods in (Mods(mask=mask), Mods(mask=varlen.Mask(window_left=8) & mask)):
            rows = dict(backends.explain(Backward("float16", 64, 64, True, mods)))
            assert "not chosen by default yet" in rows["cupy:sm90a"], rows
        for mods in (Mods(score=score), Mods(mask=mask, score=score)):
            rows = dict(backends.explain(Backward("float16", 64, 64, True, mods)))
            assert rows["cupy:sm90a"] == refused, rows
            assert "not chosen by default yet" in rows["cupy:mma"], rows
        # the forward runs both; the backward a mask_mod at every head dim
        rows = dict(backends.explain(Problem("float16", 64, 64, True,
                                             Mods(mask=mask, score=score))))
        assert "not chosen by default yet" in rows["cupy:sm90a"], rows
        for head_dim in (64, 128, 256):
            rows = dict(backends.explain(Backward("float16", head_dim, head_dim, True,
                                                  Mods(mask=mask))))
            assert "not chosen by default yet" in rows["cupy:sm90a"], (head_dim, rows)

        monkeypatch.setattr(Sm90aImplementation, "default_eligible", True)
        q = np.zeros((4, 2, 64), np.float16)
        lse = np.zeros((2, 4), np.float32)
        call = dict(softmax_scale=0.125, softcap=0.0)
        for mods, deterministic, runs in ((Mods(mask=mask), True, "sm90a"),
                                          (Mods(mask=mask, score=score), False, "mma")):
            assert BACKEND.backward(_Plan(), q, q, q, q, q, lse, mods=mods,
                                    deterministic=deterministic, **call) == runs
        with pytest.raises(ValueError, match=re.escape(f"backend 'cupy:sm90a' cannot run this "
                                                       f"backward: {refused}")):
            backends.get("cupy:sm90a").backward(_Plan(), q, q, q, q, q, lse,
                                                mods=Mods(score=score), **call)
    assert ran == [("sm90a", True, Mods(mask=mask)), ("mma", False)]


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


# --------------------------------------------------------------------------------------------
# Device support of the mma.sync implementation: tiles that fit, old GPUs, device attributes,
# NVRTC options
# --------------------------------------------------------------------------------------------

# The tiles the backend's plans get, by head dim: (128, 64) up to D = 128, where the forward
# and the backward (both dQ modes run the same dK/dV kernel) take at most 69632 and 75264 B, so
# they fit 99 KiB too; (128, 128) at D = 96 and 128 where it fits (dK/dV: 125952 and 158720 B,
# not in 99 KiB, which falls back to (128, 64)). Above D = 128 only (64, 64) compiles, and its
# dK/dV kernel needs more than 99 KiB (108032 B at D = 192, 104704 B at D = 256): no tiles there
# (None).
BIG_TILES = {D: (128, 128) if D in (96, 128) else (128, 64) if D <= 128 else (64, 64)
             for D in _cupy_traits.HEAD_DIMS}
SMALL_SMEM_TILES = {D: (128, 64) if D <= 128 else None for D in _cupy_traits.HEAD_DIMS}
# A stand-in GPU with less shared memory per block than any shipped one: 64 KiB.
SMALL_SMEM = DeviceInfo((8, 9), 64 * KIB, "a GPU with 64 KiB per block")


def _call(dtype="bfloat16", D=128, *, backward=False, deterministic=False, Dv=None):
    """What `supports` reads of a call (the setup record's attributes)."""
    return types.SimpleNamespace(dtype=dtype, head_dim=D, head_dim_v=Dv or D, on_device=True,
                                 grads=() if backward else None, deterministic=deterministic)


@pytest.mark.parametrize("device, tiles", [(A100, BIG_TILES), (A6000, SMALL_SMEM_TILES),
                                           (L40S, SMALL_SMEM_TILES), (H100, BIG_TILES)],
                         ids=["sm_80-163KiB", "sm_86-99KiB", "sm_89-99KiB", "sm_90-227KiB"])
def test_tiles_fit_the_device(device, tiles):
    from varlen.backends.cupy import BACKEND
    with BACKEND.stand_in_device(device):
        for D in _cupy_traits.HEAD_DIMS:
            for dtype in _cupy_traits.DTYPES:
                blocks = BACKEND.default_blocks(dtype, D)
                if tiles[D] is None:
                    why = BACKEND.supports(_call(dtype, D))
                    dkdv = KernelSpec("bwd", dtype, D, 64, 64, False).kernels()["dkdv_atomic"]
                    assert why and "no tile size fits" in why and f"{dkdv.smem} B" in why, why
                    assert blocks == (64, 64), f"{device.arch} D={D}: tiles {blocks}"
                    continue
                assert blocks == tiles[D], f"{device.arch} D={D}: tiles {blocks}"
                assert BACKEND.supports(_call(dtype, D)) is None, f"{device.arch} D={D} forward"
                assert BACKEND.supports(_call(dtype, D, backward=True)) is None
                for kind, roles in (("fwd", "fwd"), ("bwd", "bwd")):
                    spec = KernelSpec(kind, dtype, D, *blocks, False)
                    for role in _cupy_mma.ROLES[roles]:
                        assert spec.kernels()[role].smem <= device.smem_optin, (
                            f"{device.arch}: {spec.kernels()[role].name} does not fit")
                why = BACKEND.supports(_call(dtype, D, backward=True, deterministic=True))
                assert why is None, f"{device.arch} D={D} deterministic: {why}"


def test_deterministic_backward_needs_what_the_atomic_one_needs():
    """Ordered dQ runs the atomic dK/dV kernel's layout: the same shared memory, so the
    deterministic backward fits wherever the atomic one does, and is refused, naming its
    kernel and both sizes, where it does not."""
    from varlen.backends.cupy import BACKEND
    for spec in _cupy_mma.all_specs():
        if spec.kind == "bwd":
            k = spec.kernels()
            assert k["dkdv_ordered"].smem == k["dkdv_atomic"].smem, spec.label
            assert k["dkdv_ordered"].threads == k["dkdv_atomic"].threads, spec.label
    with BACKEND.stand_in_device(SMALL_SMEM):
        # a plan built elsewhere with tiles the GPU cannot hold is refused before any launch
        plan = types.SimpleNamespace(block_m=64, block_n=64)
        q = np.zeros((1, 1, 128), np.float16)
        lse = np.zeros((1, 1), np.float32)
        with pytest.raises(ValueError, match=r"tiles \(64, 64\) .* varlen_bwd_dkdv<__half, 128, "
                                             r"64, 32, false, true, true> needs 75264 B .* "
                                             r"allows at most 65536 B"):
            BACKEND.backward(plan, q, q, q, q, q, lse, softmax_scale=1.0, softcap=0.0,
                             deterministic=True)


def test_old_gpus_are_refused():
    from varlen.backends.cupy import BACKEND
    with BACKEND.stand_in_device(T4):
        why = BACKEND.supports(_call())
    assert "sm_75" in why and "compute capability 7.5" in why and "sm_80" in why, why


def _stub_cupy(reads, options=None):
    """A `cupy` module with the few attributes the backend reads of a device and a RawModule
    that records its NVRTC options; `reads` counts the attribute reads per device."""
    class Device:
        def __init__(self, device=0):
            self.id = device

        @property
        def compute_capability(self):
            reads[self.id] = reads.get(self.id, 0) + 1
            return "86"

        @property
        def attributes(self):
            return {"MaxSharedMemoryPerBlockOptin": 99 * KIB}

    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=()):
            options_seen.extend(options)

    options_seen = options if options is not None else []
    runtime = types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"stub"})
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device, runtime=runtime),
                                 RawModule=RawModule)


def test_device_attributes_are_read_once_per_device(monkeypatch):
    import varlen.backends.cupy as cupy_backend
    reads = {}
    monkeypatch.setitem(sys.modules, "cupy", _stub_cupy(reads))
    cupy_backend.device_info.cache_clear()
    try:
        for _ in range(3):
            assert cupy_backend.device_info(0) == DeviceInfo((8, 6), 99 * KIB, "stub")
            cupy_backend.BACKEND.supports(_call())
            cupy_backend.BACKEND.default_blocks("bfloat16", 128)
        cupy_backend.device_info(1)
        assert reads == {0: 1, 1: 1}, f"device attributes read {reads} times"
    finally:
        cupy_backend.device_info.cache_clear()


def test_runtime_nvrtc_options_are_the_compile_checks(monkeypatch):
    """The options CuPy's RawModule gets are the compile check's, include directories too."""
    import varlen.backends.cupy.compile as _cupy_compile
    runtime = []
    monkeypatch.setitem(sys.modules, "cupy", _stub_cupy({}, runtime))
    _cupy_launch.Module(KernelSpec("fwd", "bfloat16", 128, 128, 64, False))
    check = _cupy_compile.program_options("sm_80")
    assert [o for o in check if o.startswith(("-I", "-D", "--use_fast_math"))] == runtime
    includes = [o[2:] for o in runtime if o.startswith("-I")]
    for d in _cupy_compile.cuda_include_dirs():
        assert d in includes, f"runtime NVRTC options miss the CUDA headers {d}: {runtime}"
