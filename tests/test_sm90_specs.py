"""The sm_90a implementation (`cupy:sm90a`) without a GPU: what its spec classes accept and
refuse, the launcher's choices (GQA packing, the persistent grid, key chunks, the driver's tensor
map arguments, the device's SM count read once), and that the emulated cases of
`emulation.sm90_cases` cover every value of every field of the variants the implementation
dispatches (`sm90.dispatched_specs()`), each case a pass the implementation has a variant for,
and the quick run's cases are adversarial. The runs: tests/emulation/test_sm90_kernels.py; the
NVRTC builds: tests/compile/test_sm90_compile.py; on a Hopper GPU: tests/gpu/test_sm90_gpu.py."""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

import varlen
from emulation import sm90_cases
from varlen.backends.cupy import sm90
from varlen.backends.cupy.sm90 import BwdSpec, FwdSpec


@pytest.mark.parametrize("cls, bad", [
    (FwdSpec, dict(dtype="float32")), (FwdSpec, dict(head_dim=96)), (FwdSpec, dict(block_m=32)),
    (FwdSpec, dict(block_n=32)),
    (FwdSpec, dict(head_dim=256, block_m=128)),         # 259 KiB of shared memory
    (FwdSpec, dict(head_dim=256, key_chunk=128)),       # 322 KiB
    (FwdSpec, dict(block_n=128, key_chunk=256)), (FwdSpec, dict(key_chunk=32)),
    (FwdSpec, dict(pack=3)), (FwdSpec, dict(pack=16)),
    (FwdSpec, dict(head_dim=192)), (FwdSpec, dict(head_dim=128, head_dim_v=64)),
    (FwdSpec, dict(head_dim=64, head_dim_v=128)),
    (BwdSpec, dict(dtype="float32")), (BwdSpec, dict(head_dim=96)), (BwdSpec, dict(head_dim=512)),
    (BwdSpec, dict(head_dim=256, block_n=128)), (BwdSpec, dict(block_n=32)),
    (BwdSpec, dict(block_n=256)),
], ids=lambda x: x.__name__ if isinstance(x, type) else "-".join(f"{k}{v}" for k, v in x.items()))
def test_spec_rejects_what_the_kernel_does_not_take(cls, bad):
    base = dict(dtype="bfloat16", head_dim=64, block_n=64, softcap=False)
    if cls is FwdSpec:
        base["block_m"] = 64
    with pytest.raises(ValueError):
        cls(**{**base, **bad})


def _spec_of(label, kind):
    """The variant run (label, kind) runs: the implementation must have one for it."""
    c = sm90_cases.CASES[label]
    b = sm90_cases.batch(c)
    plan = sm90_cases.plan_of(c, b)
    why = varlen.backends.get("cupy:sm90a").runs(kind, plan, b.q, c["softcap"], b.v)
    assert why is None, f"{label}: cupy:sm90a has no {kind} variant for it: {why}"
    if kind == "bwd":
        return sm90.bwd_spec_for(plan, b.q, c["softcap"], c.get("deterministic", False), b.v)
    pack = c.get("pack", 1)
    if pack == "auto":
        pack = sm90.pack_for(plan, b.q.shape[0], c["Hq"], c["Hk"], c["block_m"])
    return dataclasses.replace(sm90.fwd_spec_for(plan, b.q, c["softcap"], v=b.v), pack=pack)


# what a field of each kind's variants is
FIELDS = {FwdSpec: ("dtype", "head_dim", "block_m", "block_n", "softcap", "key_chunk", "pack",
                    "head_dim_v"),
          BwdSpec: ("dtype", "head_dim", "block_n", "softcap", "ordered_dq")}


def test_emulated_cases_cover_the_dispatched_variants():
    """Every value of every field of the dispatched variants (dtype, head dim, tiles, softcap,
    key chunk, pack, dQ mode) is run by some emulated case of its kind (VARLEN_TEST_CASES=full:
    tests/emulation/test_sm90_kernels.py)."""
    specs = [_spec_of(label, kind) for label, kind in sm90_cases.RUNS]
    for cls, fields in FIELDS.items():
        for field in fields:
            want = {getattr(s, field) for s in sm90.dispatched_specs() if isinstance(s, cls)}
            have = {getattr(s, field) for s in specs if isinstance(s, cls)}
            assert want <= have, f"{cls.__name__}.{field}: {sorted(want - have)} not emulated"


def test_quick_cases_are_adversarial():
    """The quick run's emulated cases hold zero-length and length-1 sequences, lengths off the
    tile, pad gaps holding NaN, GQA, per-sequence masks and a NaN that must stay in its
    sequence, in both kinds together."""
    quick = [sm90_cases.CASES[label] for label, _ in sm90_cases.QUICK]
    lengths = [n for c in quick for n in (*c["lengths_q"], *c["lengths_k"])]
    assert 0 in lengths and 1 in lengths and any(n % 64 for n in lengths)
    assert any(c["gaps"] and c["nan_in_pad"] for c in quick)
    assert any(c["Hq"] > c["Hk"] for c in quick)
    assert any(c["mask"] == ("mixed",) for c in quick)
    assert any(c.get("nan") for c in quick)
    assert {kind for _, kind in sm90_cases.QUICK} == {"fwd", "bwd"}


def test_sm90_gqa_packing_is_chosen_where_it_fills_the_tiles():
    """`choose_pack` doubles the heads packed per position while the estimated fill of the
    tiles' rows grows by PACK_GAIN: decoding (one query per sequence) packs as far as the group
    and MAX_PACK allow, long sequences not at all, lengths in between part way; `pack_for`
    refuses a pack that does not divide the group or the tile."""
    import types
    from varlen.backends.cupy.sm90 import MAX_PACK, choose_pack, pack_for, row_fill
    assert MAX_PACK == 8
    assert row_fill(64, 64, 128) == 1 / 128 and row_fill(0, 3, 128) == 1.0
    # 64 sequences of 128 rows: 64 + 64 x 127 / 256 = 95.75 tiles expected (lengths unknown)
    assert row_fill(64 * 128, 64, 128) == 64 * 128 / (95.75 * 128)
    assert row_fill(64 * 128, 64, 128) < row_fill(64 * 128, 64, 64) < 1
    for group, want in ((1, 1), (2, 2), (3, 1), (4, 4), (6, 2), (8, 8), (16, 8)):
        assert choose_pack(64, 64, group, 128) == want, (group, want)   # 64 one-row sequences
    assert choose_pack(64, 64, 8, 64) == 8
    # 8 sequences of mean length L, GQA 8:1, 128-row tiles: estimated fill by pack 1, 2, 4, 8
    assert choose_pack(8 * 8192, 8, 8, 128) == 1          # 0.99 -> 1.00
    assert choose_pack(8 * 1000, 8, 8, 128) == 1          # 0.94 -> 0.97: < 10 %
    assert choose_pack(8 * 300, 8, 8, 128) == 1           # 0.83 -> 0.91: 9.7 %
    assert choose_pack(8 * 200, 8, 8, 128) == 2           # 0.76 -> 0.86 -> 0.93: 7 %
    assert choose_pack(8 * 100, 8, 8, 128) == 4           # 0.61 -> 0.76 -> 0.87 -> 0.93: 7 %
    plan = types.SimpleNamespace(batch=64, q=types.SimpleNamespace(per_seq=1))
    assert pack_for(plan, 64, 8, 2, 128) == 4
    assert pack_for(plan, 64, 8, 2, 128, pack=2) == 2
    for bad in (3, 8, 16, 0):
        with pytest.raises(ValueError, match="packed per position"):
            pack_for(plan, 64, 8, 2, 128, pack=bad)


def test_sm90_tensor_map_arguments_are_what_the_driver_bindings_take():
    """The launcher's arguments of cuTensorMapEncodeTiled go through cuda-bindings' conversion
    (plain ints in its lists are a TypeError there); on this machine the call then stops only
    for want of a driver, on a GPU it returns a map."""
    cu = pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings")
    import types
    from varlen.backends.cupy.sm90 import encode_args
    for dtype, heads, box_heads in (("float16", 8, 4), ("bfloat16", 2, 1)):
        a = types.SimpleNamespace(shape=(1000, heads, 128), dtype=types.SimpleNamespace(
            name=dtype, itemsize=2), data=types.SimpleNamespace(ptr=1 << 20),
            strides=(heads * 256, 256, 2))
        args = encode_args(a, 128 // box_heads, box_heads)
        assert [int(x) for x in args[3]] == [128, heads, 1000]
        assert [int(x) for x in args[4]] == [256, heads * 256]
        assert [int(x) for x in args[5]] == [64, box_heads, 128 // box_heads]
        try:
            err, _ = cu.cuTensorMapEncodeTiled(*args)
        except TypeError:
            raise
        except Exception as e:          # no driver library here
            assert "cuda" in str(e).lower(), e
        else:
            assert isinstance(err, cu.CUresult)


@pytest.mark.parametrize("shape, dtype, view, box, swizzle, nan_fill", [
    ((40, 88), "uint16", None, (64, 16), 3, False),
    ((3, 5, 24), "float32", None, (8, 4, 2), 0, True),
    ((37, 8, 64), "float16", (slice(None), slice(1, 7)), (64, 2, 32), 3, False),
    ((128, 320), "uint16", None, (64, 128), 3, False),
], ids=["2d-128B", "3d-nan-fill", "3d-packed-heads-view", "pipeline-a"])
def test_sm90_primitive_maps_on_a_gpu_are_the_emulations(shape, dtype, view, box, swizzle,
                                                          nan_fill):
    """The primitives' GPU runner asks the driver for the maps the emulation's runner makes
    (emulation/sm90_primitives.py, the maps of its tests): address, rank, dims, byte strides,
    box, element size, swizzle and fill, through the launcher's `tiled_args`."""
    cu = pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings")
    import types
    from emulation.cupy import tensor_map
    from emulation.sm90_primitives import map_args
    a = np.zeros(shape, dtype)
    a = a if view is None else a[view]
    m = tensor_map(a, box, swizzle, nan_fill)[0]
    device = types.SimpleNamespace(data=types.SimpleNamespace(ptr=a.ctypes.data), shape=a.shape,
                                   strides=a.strides, dtype=a.dtype)
    args = map_args(device, box, swizzle, nan_fill)
    rank = a.ndim
    assert (args[1], args[2]) == (m["rank"], m["global_address"])
    assert [int(x) for x in args[3]] == m["dims"][:rank].tolist()
    assert [int(x) for x in args[4]] == m["strides"][:rank - 1].tolist()
    assert [int(x) for x in args[5]] == m["box"][:rank].tolist()
    assert int(args[8]) == m["swizzle"] and a.itemsize == m["elem_bytes"]
    assert (args[10] == cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
            ) == bool(m["nan_fill"])


def test_sm90_persistent_grid_is_one_block_per_sm_at_most():
    """The persistent forward's grid: one block per work item up to one per SM, at least one
    (the blocks also write the pad rows); the emulation's stand-in device has few SMs, so that
    its blocks loop."""
    from emulation.sm90 import EMULATED_SM_COUNT, EmulatedRuntime
    from varlen.backends.cupy.sm90 import CTAS_PER_SM, persistent_grid
    assert CTAS_PER_SM == 1
    assert persistent_grid(0, 132) == 1
    assert persistent_grid(7, 132) == 7
    assert persistent_grid(5000, 132) == 132
    assert persistent_grid(5000, 132) * CTAS_PER_SM <= 132
    assert EmulatedRuntime().sm_count() == EMULATED_SM_COUNT <= 4
    assert EmulatedRuntime(sm_count=2).sm_count() == 2


def test_sm90_runtime_reads_the_sm_count_of_the_device_once(monkeypatch):
    """The GPU runtime sizes the persistent grid from the device's MultiProcessorCount, read
    once per device (CuPy's `Device.attributes` queries every attribute)."""
    import types
    from varlen.backends.cupy.sm90 import Runtime
    reads = []

    class Device:
        def __init__(self):
            self.id = 0

        @property
        def attributes(self):
            reads.append(self.id)
            return {"MultiProcessorCount": 132}

    monkeypatch.setitem(sys.modules, "cupy",
                        types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device)))
    rt = Runtime()
    assert rt.sm_count() == 132 and rt.sm_count() == 132
    assert reads == [0]


def test_sm90_key_chunk_is_128_where_it_fits():
    """Chunks of 128 keys by default at D 64 and 128 (pairs of the CuPy backend's 64-row key
    tiles), 64 at D 256, whose 128-key stages would not fit."""
    from varlen.backends.cupy.sm90 import OPTIN_SMEM, FwdSpec as Sm90Spec
    for d, bm in ((64, 64), (64, 128), (128, 64), (128, 128)):
        spec = Sm90Spec("bfloat16", d, bm, 64, False)
        assert spec.key_chunk == 128 and spec.smem <= OPTIN_SMEM, f"D{d} BM{bm}: {spec}"
    assert Sm90Spec("bfloat16", 256, 64, 64, False).key_chunk == 64
    with pytest.raises(ValueError, match="shared memory"):
        Sm90Spec("bfloat16", 256, 64, 64, False, key_chunk=128)


def test_work_ordered_plan_runs_the_heaviest_items_first():
    """The sm_90a forward's plan (`work_ordered_plan`): query tile slots in ascending order of
    visible key tiles, so that its work items, taken from the last slot on, run heaviest
    first; every slot's tile, schedule and row schedule stay together, unused slots come
    first, ties keep slot order, and the plan is built once per plan object."""
    import numpy as np
    import varlen
    from varlen.backends.cupy import sm90
    cu = np.array([0, 300, 301, 301, 420], np.int32)
    plan = varlen.plan(cu, cu, mask="causal", block_m=64, block_n=64)
    ordered = sm90.work_ordered_plan(plan)
    assert sm90.work_ordered_plan(plan) is ordered
    sched = np.asarray(plan.q_sched)
    work = (sched[:, :, 3] - sched[:, :, 0]).sum(axis=1)
    got = np.asarray(ordered.q_sched)
    got_work = (got[:, :, 3] - got[:, :, 0]).sum(axis=1)
    assert list(got_work) == sorted(work), (list(got_work), list(work))
    assert len(set(work.tolist())) > 2 and list(work) != sorted(work), "a plan worth ordering"
    tiles, got_tiles = np.asarray(plan.q_tiles), np.asarray(ordered.q_tiles)
    unused = int((tiles[:, 0] < 0).sum())
    assert unused > 0 and (got_tiles[:unused, 0] < 0).all(), "unused slots first"
    # each used slot once, its tile, schedule and row schedule together
    order = [int(np.flatnonzero((tiles[:, 2] == t[2]) & (tiles[:, 0] >= 0))[0])
             for t in got_tiles[unused:]]
    assert sorted(order) == sorted(np.flatnonzero(tiles[:, 0] >= 0).tolist()), order
    for name in ("q_tiles", "q_sched", "q_row_sched"):
        assert (np.asarray(getattr(ordered, name))[unused:]
                == np.asarray(getattr(plan, name))[order]).all(), name
    ties = [[o for o, w in zip(order, got_work[unused:]) if w == v]
            for v in set(got_work.tolist())]
    assert all(t == sorted(t) for t in ties), ties
    assert ordered.k_tiles is plan.k_tiles and ordered.k_sched is plan.k_sched
