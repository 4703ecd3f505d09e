"""Every Numba kernel compiles to PTX for sm_80 and sm_90 (typing errors the simulator misses).

The compile runs in its own process (`compile_check.py`, started by this directory's conftest
when the suite is collected, so it overlaps the simulated tests).
"""
import json

import pytest

TIMEOUT_S = 600


def test_every_kernel_compiles_for_sm80_and_sm90(compile_check):
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
    result = json.loads(text[-1])
    assert not result["failed"], "kernels that failed to compile:\n" + "\n".join(
        f"{k}: {v}" for k, v in result["failed"].items())
    assert rc == 0, f"compile check exited with {rc}"
    names = {label.split("@")[0] for label in result["ok"]}
    for kernel in ("segments_from_cu", "to_int32[bool]", "tile_scan",
                   "tiles_and_schedule", "fill[bfloat16]", "convert[float16]", "delta[bfloat16]",
                   "forward[bfloat16,softcap=True]", "forward[float32,softcap=False]",
                   "dkdv[float16,softcap=True,atomic_dq=True]",
                   "dkdv[float32,softcap=False,atomic_dq=False]",
                   "dq[bfloat16,softcap=True]"):
        assert kernel in names, f"{kernel} was not compiled"
    for cc in ("sm_80", "sm_90"):
        assert sum(label.endswith(cc) for label in result["ok"]) == len(names), cc
