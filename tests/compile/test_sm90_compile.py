"""The sm_90a kernels built by NVRTC for sm_90a: every variant within the budget of an SM (no
spills, registers x threads within the register file at entry, shared memory within the opt-in,
no ptxas warning such as setmaxnreg ignored), the variants generated from the implementation:
what it dispatches (`sm90.dispatched_specs()`: the backend's default tiles, packs 1 to 8, both
dQ modes) at the quick size, and at VARLEN_TEST_CASES=full every variant the specs' validation
accepts over the plan tiles the backend takes (each dtype, head dim, softcap, key chunk and
pack). One NVRTC build for the variants selected (`-k`, `-m smoke`: one). Also: the cubins kept
on disk between processes, and the primitive harness assembled for sm_90a."""
from __future__ import annotations

import itertools
import re

import pytest

from varlen.backends.cupy import sm90, traits
from varlen.backends.cupy.compile import parse_ptxas_log
from varlen.backends.cupy.sm90 import BwdSpec, FwdSpec

from helpers import cases

# the values of each field the validation is asked about
FWD_FIELDS = dict(dtype=tuple(traits.DTYPES), head_dim=FwdSpec.HEAD_DIMS, blocks=traits.BLOCKS,
                  softcap=(False, True), key_chunk=(None, 64, 128), pack=sm90.PACKS,
                  head_dim_v=(None, *{dv for _, dv in traits.SM90_FWD_HEAD_DIM_V_PAIRS}))
BWD_FIELDS = dict(dtype=tuple(traits.DTYPES), head_dim=traits.SM90_HEAD_DIMS, block_n=(64, 128),
                  softcap=(False, True), ordered_dq=(False, True))


def _accepted(make, fields):
    """The specs `make` builds from each combination of `fields` that the validation accepts,
    each once (in order)."""
    specs = {}
    for values in itertools.product(*fields.values()):
        try:
            spec = make(**dict(zip(fields, values)))
        except ValueError:
            continue
        specs.setdefault(spec.name, spec)
    return list(specs.values())


def variants():
    """The dispatched variants first, then the other ones the validation accepts."""
    accepted = (_accepted(lambda blocks, **kw: FwdSpec(block_m=blocks[0], block_n=blocks[1], **kw),
                          FWD_FIELDS) + _accepted(BwdSpec, BWD_FIELDS))
    dispatched = sm90.dispatched_specs()
    names = {s.name for s in accepted}
    assert all(s.name in names for s in dispatched), "a dispatched variant fails its validation"
    return dispatched + [s for s in accepted if s not in dispatched]


VARIANTS = variants()


@pytest.fixture(scope="module")
def report(request):
    """The NVRTC build report of the variants whose tests are selected, in batches."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
    params = [getattr(item, "callspec", None) for item in request.session.items
              if item.path == request.path]
    chosen = [p.params["spec"] for p in params if p is not None and "spec" in p.params]
    usage = {}
    for i in range(0, len(chosen), 32):
        usage.update(sm90.compile_report(chosen[i:i + 32]))
    return usage


@pytest.mark.parametrize("spec", [
    pytest.param(s, id=s.label, marks=pytest.mark.smoke if s is VARIANTS[0] else ())
    for s in cases(VARIANTS, VARIANTS[:len(sm90.dispatched_specs())])])
def test_compiles_for_sm90a_within_budget(report, spec):
    u = report[spec.name]
    print(f"{spec.name}: {u['registers']} registers at entry, {u['threads']} threads, "
          f"{u['smem']} B shared, spills {u['spill_stores']}/{u['spill_loads']}")
    assert u["spill_stores"] == 0 and u["spill_loads"] == 0, f"{spec.name} spills: {u}"
    assert u["registers"] * u["threads"] <= 65536, f"{spec.name}: registers exceed an SM: {u}"
    assert u["smem"] + u["static_smem"] <= sm90.OPTIN_SMEM, f"{spec.name}: shared memory {u}"
    assert not u["warnings"], f"{spec.name}: ptxas warnings (setmaxnreg ignored?) {u['warnings']}"


def test_sm90_cubins_are_kept_on_disk_between_processes(tmp_path, monkeypatch):
    """`cubin_path` builds a kernel's cubin once into the cache folder and serves it after that
    without NVRTC; other build options (a kernel source changed: they carry its hash) make
    another key. `warm` builds in worker processes; `dispatched_specs` lists every variant the
    implementation `cupy:sm90a` runs with its default tiles, packs included."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
    import varlen.backends.cupy.compile as _cupy_compile
    import varlen.backends.cupy.sm90 as _cupy_sm90
    from varlen.backends.cupy.compile import CACHE_ENV, cubin_path
    from varlen.backends.cupy.sm90 import FwdSpec as Sm90Spec, dispatched_specs
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    specs = dispatched_specs()
    names = [s.name for s in specs]
    # 72 at head_dim_v == head_dim, 16 forwards of (head_dim, head_dim_v) = (192, 128)
    assert len(names) == len(set(names)) == 88
    assert {s.pack for s in specs if isinstance(s, Sm90Spec)} == {1, 2, 4, 8}
    assert _cupy_sm90.warm(2, specs[:2]) == 2
    assert len(list(tmp_path.glob("*.cubin"))) == 2
    path, lowered = cubin_path(names[0])
    assert path.startswith(str(tmp_path)) and lowered.startswith("_Z15varlen_fwd_sm90")
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF"

    def no_build(*a, **k):
        raise AssertionError("built again")
    monkeypatch.setattr(_cupy_compile, "build_program", no_build)
    assert cubin_path(names[0]) == (path, lowered)
    options = _cupy_compile.program_options
    monkeypatch.setattr(_cupy_compile, "program_options", lambda arch: [*options(arch), "-DX"])
    with pytest.raises(AssertionError, match="built again"):
        cubin_path(names[0])


def test_harness_assembles_for_sm90a():
    """The primitives' harness (emulation/sm90_primitives.py) as the GPU runner builds it: every
    kernel of its table, NVRTC for sm_90a with the kernels' options, no spills, and the
    registers its setmaxnreg splits draw on."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
    from emulation.sm90_primitives import (KERNELS, PIPE_CONSUMER_REGS, PIPE_MAX_CONSUMERS,
                                           PIPE_PRODUCER_REGS, WG_REGS_INC, build_harness_cubin)
    cubin, lowered, log = build_harness_cubin()
    assert cubin[:4] == b"\x7fELF", "no cubin: ptxas did not run"
    usage = parse_ptxas_log(log)
    missing = [k for k in KERNELS if lowered[k] not in usage]
    assert not missing, f"not compiled for sm_90a: {missing}"
    spills = {k: usage[lowered[k]] for k in KERNELS
              if usage[lowered[k]]["spill_stores"] or usage[lowered[k]]["spill_loads"]}
    assert not spills, f"register spills: {spills}"
    assert not re.search(r"[1-9]\d* bytes spill", log), f"register spills:\n{log}"
    # setmaxnreg.inc takes only what a setmaxnreg.dec released: the registers at entry hold
    # the split (else a GPU waits forever at the .inc)
    for k in KERNELS:
        regs = usage[lowered[k]]["registers"]
        if k.startswith("sm90_wgmma"):
            assert regs >= WG_REGS_INC, f"{k}: {regs} registers at entry, .inc to {WG_REGS_INC}"
    regs = usage[lowered["sm90_pipeline"]]["registers"]
    need = PIPE_PRODUCER_REGS + PIPE_MAX_CONSUMERS * PIPE_CONSUMER_REGS
    assert need <= (1 + PIPE_MAX_CONSUMERS) * regs, f"sm90_pipeline: {regs} registers at entry"
