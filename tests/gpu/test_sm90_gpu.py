"""The cases of `emulation.sm90_cases` on a Hopper GPU, each on the pass of its kind: the NVRTC
cubins through CuPy, tensor maps from the driver, the backward's preprocessing and conversion
of the mma.sync module. float16 cases only (bfloat16 needs the 16-bit-pattern path of the CuPy
backend's adapters). Run by `scripts/gpu_check.sh --sm90a`."""
from __future__ import annotations

import pytest

from emulation.sm90_cases import CASES, RUNS, run_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("label, kind", [
    pytest.param(label, kind, id=f"{label}-{kind}") for label, kind in RUNS
    if CASES[label]["dtype"] == "float16"])
def test_case_on_hopper(label, kind):
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings (tensor maps)")
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    run_case(label, kind, device=True)
