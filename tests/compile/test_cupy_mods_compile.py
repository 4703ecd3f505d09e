"""The CuPy kernels compiled with a call's mask_mod and score_mod (varlen/backends/cupy/mods.py,
kernels_cuda/mods.cuh): gallery functions (tests/mods_cases.py) generated into the module
source, built by NVRTC for sm_80 and sm_90 (mma.sync forward and dK/dV kernels) and sm_90a
(the forward; the dK/dV kernel with a mask_mod) within the budgets of the kernels without
them: no spills, registers within the register file, shared memory within each
architecture's opt-in (unchanged: the functions add registers, not shared memory); the dK/dV
kernel with aux gradients too. Also: variants of
other functions never share a module or a cubin, and the params structs carry the aux
arrays."""
from __future__ import annotations

import numpy as np
import pytest

from varlen.backends.cupy import compile as _compile
from varlen.backends.cupy import mods as _mods
from varlen.backends.cupy import sm90, traits
from varlen.backends.cupy.mma import KernelSpec
from varlen.mods import Mods

from mods_cases import mask_cases, score_cases

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")


def _hooks(mask_id, score_id):
    masks, scores = dict(mask_cases([0, 5, 70])), dict(score_cases(4))
    return _mods.hooks_for(Mods(mask=masks.get(mask_id), score=scores.get(score_id)))


# (mask, score): a per-token aux array (two loads per pair) with a [Hq, 13] table, a
# per-sequence aux array with a transcendental score (tanh, log), and integer divisions per pair
# with a where of -inf (32-bit: generated integers narrow to 32 bits where they fit)
GALLERY = {"segments+relative-bias": ("segments", "relative-bias"),
           "prefix-lm+soft-clip": ("prefix-lm", "soft-clip"),
           "chunked+hide-first": ("chunked", "hide-first")}
# the heaviest register tiles at D = 64 and D = 128 (the backend's default tiles there); at
# D = 128 the per-token and table functions only
MMA = [("fwd", 64, 128, 64), ("bwd", 64, 128, 64), ("fwd", 128, 128, 128),
       ("bwd", 128, 128, 128)]


def _mma_params():
    for gid in GALLERY:
        for kind, d, bm, bn in MMA:
            # at D = 128 the kernels hold 246-255 registers without user functions: a score_mod
            # with tanh and log spills 24 B in the ordered dK/dV kernel (docs/cupy_backend.md)
            if gid == "prefix-lm+soft-clip" and d != 64:
                continue
            for arch in traits.ARCHS:
                smoke = gid == "segments+relative-bias" and (kind, d, arch) == ("fwd", 64, "sm_80")
                yield pytest.param(gid, kind, d, bm, bn, arch,
                                   id=f"{gid}-{kind}-D{d}-BM{bm}-BN{bn}-{arch}",
                                   marks=pytest.mark.smoke if smoke else ())


@pytest.mark.parametrize("gid, kind, head_dim, block_m, block_n, arch", list(_mma_params()))
def test_mma_kernels_with_user_functions_within_budget(gid, kind, head_dim, block_m, block_n,
                                                       arch):
    hooks = _hooks(*GALLERY[gid])
    spec = KernelSpec(kind, "bfloat16", head_dim, block_m, block_n, False, hooks).compiled()
    roles = ("fwd",) if kind == "fwd" else ("dkdv_atomic", "dkdv_ordered")
    launches = [spec.kernels()[r] for r in roles]
    _, usage = _compile.compile_names([k.name for k in launches], arch,
                                      _mods.module_source(hooks))
    for k in launches:
        u = usage[k.name]
        _within_budget(f"{arch} {k.name} [{gid}]", u,
                       f", {k.smem + u['static_smem']} B shared")
        assert k.smem + u["static_smem"] <= traits.SMEM_BUDGET[arch], (k.name, u)


def _within_budget(label: str, u: dict, more: str = "") -> None:
    """Prints a kernel's registers and spills (`usage` of `compile_names`); asserts no spill
    and a register count the register file allows."""
    print(f"{label}: {u['registers']} registers, spills {u['spill_stores']}/"
          f"{u['spill_loads']}{more}")
    assert u["spill_stores"] == 0 and u["spill_loads"] == 0, f"{label} spills: {u}"
    assert 0 < u["registers"] <= 255, u


@pytest.mark.parametrize("arch", traits.ARCHS)
def test_mma_kernels_with_user_functions_and_dropout_within_budget(arch):
    """The dropout variants (`KernelSpec.dropout`) with the per-token mask_mod and the table
    score_mod at D = 128, tiles (128, 128): forward and both dK/dV kernels without a spill
    (250-255 registers when measured; 247-254 at D = 64)."""
    hooks = _hooks(*GALLERY["segments+relative-bias"])
    names = [KernelSpec(kind, "bfloat16", 128, 128, 128, False, hooks, None, True).compiled()
             .kernels()[role].name
             for kind, role in (("fwd", "fwd"), ("bwd", "dkdv_atomic"), ("bwd", "dkdv_ordered"))]
    assert all(n.endswith(", 128, true>") for n in names), names
    _, usage = _compile.compile_names(names, arch, _mods.module_source(hooks))
    for name in names:
        _within_budget(f"{arch} {name} [dropout, segments+relative-bias]", usage[name])


@pytest.mark.parametrize("arch", traits.ARCHS)
def test_mma_backward_with_aux_grads_within_budget(arch):
    """The dK/dV kernels, atomic dQ and ordered dQ (deterministic=True: the aux gradients in
    fixed point, `ModParams::grad_fixed`), adding the aux gradients of a [Hq, 13]
    relative-bias table under a segments mask_mod, at D = 64: no spills (docs/cupy_backend.md
    has the registers measured)."""
    masks, scores = dict(mask_cases([0, 5, 70])), dict(score_cases(4))
    hooks = _mods.hooks_for(Mods(mask=masks["segments"], score=scores["relative-bias"],
                                 aux_grads=True), backward=True)
    assert hooks.aux_grads and _mods.AUX_GRAD_FN in hooks.source
    spec = KernelSpec("bwd", "bfloat16", 64, 128, 64, False, hooks).compiled()
    names = [spec.kernels()[role].name for role in ("dkdv_atomic", "dkdv_ordered")]
    _, usage = _compile.compile_names(names, arch, _mods.module_source(hooks))
    for name in names:
        _within_budget(f"{arch} {name} [aux grads]", usage[name])


def _sm90_within_budget(spec) -> None:
    """An sm_90a variant compiled: registers at entry and spills printed; no spill, its threads'
    registers within the register file, its shared memory within the opt-in, no warning."""
    u = sm90.compile_report([spec])[spec.name]
    print(f"sm_90a {spec.label}: {u['registers']} registers at entry, spills "
          f"{u['spill_stores']}/{u['spill_loads']}, {u['smem']} B shared")
    assert u["spill_stores"] == 0 and u["spill_loads"] == 0, f"{spec.label} spills: {u}"
    assert u["registers"] * u["threads"] <= 65536, u
    assert u["smem"] + u["static_smem"] <= sm90.OPTIN_SMEM, u
    assert not u["warnings"], u["warnings"]


# The sm_90a forward with user functions: its consumers classify each work item's key chunks
# into a table in shared memory (56 + 2 x 224 registers with a mask_mod), the producer walks
# the table; D = 64 packed by 2, D = 128, D = 256 and D = 192 / 128 packed by 2 (a tree mask's
# 2-D table).
@pytest.mark.parametrize("gid, head_dim, block_m, block_n, pack, head_dim_v", [
    pytest.param("segments+relative-bias", 64, 128, 64, 2, None,
                 id="segments+relative-bias-D64-P2"),
    pytest.param("prefix-lm+soft-clip", 128, 128, 128, 1, None, id="prefix-lm+soft-clip-D128-P1"),
    pytest.param("prefix-lm", 256, 64, 64, 1, None, id="prefix-lm-D256-P1"),
    pytest.param("tree", 192, 128, 64, 2, 128, id="tree-D192-Dv128-P2")])
def test_sm90a_forward_with_user_functions_within_budget(gid, head_dim, block_m, block_n, pack,
                                                        head_dim_v):
    mods = _hooks(*GALLERY[gid]) if gid in GALLERY else _hooks(gid, None)
    spec = sm90.FwdSpec("bfloat16", head_dim, block_m, block_n, False, pack=pack,
                        key_chunk=sm90.MODS_KEY_CHUNK, mods=mods, head_dim_v=head_dim_v)
    _sm90_within_budget(spec)


# The sm_90a dK/dV kernel with a mask_mod (its answers taken before S^T and dP^T, in query
# subtiles of 32: kernels_cuda/bwd_sm90.cuh, user_bits; each chunk's class computed by the
# producer): the heaviest consumers (two of 232 registers at D = 128, BN = 128) with the
# gallery's per-token (segments), 2D table (tree) and per-sequence (prefix-LM) aux reads, both
# dQ modes, with and without a softcap; one consumer of 240 at D = 64 and 128; two consumers
# splitting the columns at D = 256 (80-100 B of spills while the tile's mask stayed live across
# S^T and dP^T beside the per-pair answers).
SM90_BWD = [("segments", 128, 128, True, True), ("tree", 128, 128, False, False),
            ("prefix-lm", 64, 64, True, True), ("sliding-global", 64, 128, True, False),
            ("chunked", 64, 128, True, False), ("segments", 128, 64, True, True),
            ("tree", 128, 64, False, True), ("sliding-global", 128, 128, False, False),
            ("segments", 256, 64, True, True), ("tree", 256, 64, False, False),
            ("sliding-global", 256, 64, True, False)]


@pytest.mark.parametrize("mask_id, head_dim, block_n, softcap, ordered", [
    pytest.param(*p, id=f"{p[0]}-D{p[1]}-BN{p[2]}{'-softcap' if p[3] else ''}"
                 f"{'-ordered' if p[4] else ''}") for p in SM90_BWD])
def test_sm90a_backward_with_mask_mod_within_budget(mask_id, head_dim, block_n, softcap,
                                                    ordered):
    spec = sm90.BwdSpec("bfloat16", head_dim, block_n, softcap, ordered,
                        mods=_hooks(mask_id, None))
    _sm90_within_budget(spec)


def test_sm90a_backward_spec_carries_the_mask_mod():
    """The dK/dV variant of a call with a mask_mod: its hooks key it and its cubin (the same
    kernel name, another module source); a score_mod (with or without aux gradients) is
    refused before (`mods.refusal`), by the spec and by the kernel's static_assert."""
    hooks = _hooks("prefix-lm", None)
    plain = sm90.BwdSpec("float16", 64, 64, False)
    spec = sm90.BwdSpec("float16", 64, 64, False, mods=hooks)
    assert spec != plain and spec.name == plain.name and plain.source is None
    assert spec.source == _mods.module_source(hooks) and hooks.label in spec.label
    alibi = dict(score_cases(4))["alibi"]
    for mods in (Mods(score=alibi), Mods(score=alibi, aux_grads=True)):
        with pytest.raises(ValueError, match="runs a mask_mod, no score_mod"):
            sm90.BwdSpec("float16", 64, 64, False, mods=_mods.hooks_for(mods, backward=True))


def test_other_functions_never_share_a_module_or_cubin(tmp_path, monkeypatch):
    """The variant carries the graph digests (which cover the aux dtypes): specs of other
    functions differ, and so do their module sources and sm_90a cubin keys; specs of equal
    functions are equal (one module)."""
    a, b = _hooks("segments", "alibi"), _hooks("segments", "relative-bias")
    i32 = dict(mask_cases([0, 5, 70]))["prefix-lm"]
    i64 = type(i32)(i32.fn, i32.aux[0].astype(np.int64))
    assert _mods.hooks_for(Mods(mask=i32)) != _mods.hooks_for(Mods(mask=i64))
    assert _hooks("segments", "alibi") == a
    # the forward of a call with aux gradients is the forward without them
    score = dict(score_cases(4))["alibi"]
    assert _mods.hooks_for(Mods(score=score, aux_grads=True)) == _mods.hooks_for(Mods(score=score))
    assert _mods.hooks_for(Mods(score=score, aux_grads=True), backward=True) != \
        _mods.hooks_for(Mods(score=score), backward=True)
    assert KernelSpec("fwd", "float16", 64, 128, 64, False, a) != \
        KernelSpec("fwd", "float16", 64, 128, 64, False, b)
    assert KernelSpec("fwd", "float16", 64, 128, 128, False, a).compiled().mods == a
    assert _mods.module_source(a) != _mods.module_source(b)
    monkeypatch.setenv(_compile.CACHE_ENV, str(tmp_path))
    built = []
    monkeypatch.setattr(_compile, "build_program",
                        lambda names, arch, source=None: (built.append(source) or b"x",
                                                          {names[0]: "k"}, ""))
    spec_a = sm90.FwdSpec("float16", 64, 64, 64, False, mods=a)
    spec_b = sm90.FwdSpec("float16", 64, 64, 64, False, mods=b)
    paths = {_compile.cubin_path(s.name, "sm_90a", s.source)[0] for s in (spec_a, spec_b)}
    assert len(paths) == 2 and built == [spec_a.source, spec_b.source]


def test_params_carry_the_aux_arrays():
    """Each function's aux arrays by address and shape (padded with 1), the flag's address."""
    masks, scores = dict(mask_cases([0, 5, 70])), dict(score_cases(4))
    mods = Mods(mask=masks["segments"], score=scores["relative-bias"])
    arg = _mods.mod_params_arg(mods, np.zeros((), np.int32), lambda a: a.ctypes.data)
    doc, start = mods.mask.aux
    assert arg["mask"]["ptr"][:2].tolist() == [doc.ctypes.data, start.ctypes.data]
    assert arg["mask"]["shape"][0].tolist() == [75, 1, 1, 1]
    assert arg["score"]["shape"][0].tolist() == [4, 13, 1, 1]
    assert arg["mask"]["err"] == arg["score"]["err"] != 0
    assert not arg["mask"]["ptr"][2:].any()
    assert not any(_mods.mod_params_arg(None, None, id).tobytes())
    grads = (np.zeros(52, np.float32),)           # the table's gradient buffer (aux_grads)
    arg = _mods.mod_params_arg(mods, np.zeros((), np.int32), lambda a: a.ctypes.data, grads)
    assert arg["grad"][0] == grads[0].ctypes.data and not arg["grad"][1:].any()
