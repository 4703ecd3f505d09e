"""Every Numba kernel compiles to PTX for sm_80 and sm_90 (typing errors the simulator misses),
and computes its integers in 64 bits.

The compile runs in its own process (`compile_check.py`, started by this directory's conftest
when the suite is collected, so it overlaps the simulated tests). Tier `compile` (NVVM), kept
beside the Numba suite it checks.
"""
import json

import pytest

pytestmark = pytest.mark.compile

TIMEOUT_S = 600


def _result(compile_check):
    """The compile pass's JSON line (waits for it once)."""
    if "result" in compile_check:
        return compile_check["result"], compile_check["rc"]
    proc = compile_check["proc"]
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    except Exception:  # noqa: BLE001
        proc.kill()
        raise
    out, err = compile_check["out"], compile_check["err"]
    out.seek(0)
    err.seek(0)
    text = out.read().strip().splitlines()
    if not text:
        pytest.fail(f"compile check printed nothing (rc {rc}); stderr:\n{err.read()[-4000:]}")
    compile_check["result"], compile_check["rc"] = json.loads(text[-1]), rc
    return compile_check["result"], rc


def test_every_kernel_compiles_for_sm80_and_sm90(compile_check):
    result, rc = _result(compile_check)
    assert not result["failed"], "kernels that failed to compile:\n" + "\n".join(
        f"{k}: {v}" for k, v in result["failed"].items())
    assert rc == 0 or result["narrow"] or result["f64"], f"compile check exited with {rc}"
    names = {label.split("@")[0] for label in result["ok"]}
    for kernel in ("segments_from_cu", "to_int32[bool]", "or_flag", "tile_scan",
                   "tiles_and_schedule", "fill[bfloat16]", "convert[float16]", "delta[bfloat16]",
                   "forward[bfloat16,softcap=True]", "forward[float32,softcap=False,dropout]",
                   "dkdv[float16,softcap=True,atomic_dq=True]",
                   "dkdv[float32,softcap=False,dropout,atomic_dq=False]",
                   "dkdv[float32,softcap=False,dropout,atomic_dq=True]",
                   "dq[float32,softcap=False,dropout]",
                   "dq[bfloat16,softcap=True]", "forward[float16,softcap=True,mods]",
                   "dkdv[float16,softcap=True,mods,atomic_dq=True]",
                   "dq[float16,softcap=True,mods]"):
        assert kernel in names, f"{kernel} was not compiled"
    for cc in ("sm_80", "sm_90"):
        assert sum(label.endswith(cc) for label in result["ok"]) == len(names), cc


def test_only_dropout_kernels_draw_philox(compile_check):
    """The dropout variants hold Philox's multiplier in their PTX; the kernels without dropout
    do not: their draws are compiled out (HAS_DROPOUT), not skipped at run time."""
    result, _ = _result(compile_check)
    names = {label.split("@")[0] for label in result["ok"]}
    dropout = {n for n in names if ",dropout" in n}
    assert dropout, "no dropout kernel was compiled"
    assert set(result["philox"]) == dropout, (
        f"Philox in {sorted(set(result['philox']) - dropout)} (no dropout there), missing in "
        f"{sorted(dropout - set(result['philox']))}")


def test_address_arithmetic_is_64_bit(compile_check):
    """Element offsets pass 2**31 on real batches (1M tokens x 32 heads x 128). Numba indexes
    arrays in int64; the typed kernels and their device functions do no signed integer
    arithmetic and count no `range()` in fewer bits (values read from the int32 plan arrays
    are widened first), so no offset or row count is ever formed in 32 bits."""
    result, _ = _result(compile_check)
    assert result["audited"] == len({label.split("@")[0] for label in result["ok"]}), \
        "not every compiled kernel was audited"
    assert not result["narrow"], "integer arithmetic narrower than 64 bits:\n" + "\n".join(
        f"{k}: {p}" for k, places in result["narrow"].items() for p in places)


def test_user_functions_compute_in_float32(compile_check):
    """The kernels' user functions (the gallery's, and their derivatives) have no f64
    instruction in their PTX: the generated code computes in float32 (Numba widens a float32
    mixed with a Python float or an int64 to float64, which runs at 1/64 rate on many GPUs)."""
    result, _ = _result(compile_check)
    assert result["functions"] >= 20, f"only {result['functions']} user functions compiled"
    assert not result["f64"], "f64 instructions in user functions:\n" + "\n".join(
        f"{k}: {v}" for k, v in result["f64"].items())
