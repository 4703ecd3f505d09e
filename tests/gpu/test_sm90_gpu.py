"""The cases of `emulation.sm90_cases` on a Hopper GPU, each on the pass of its kind: the NVRTC
cubins through CuPy, tensor maps from the driver, the backward's preprocessing and conversion
of the mma.sync module. float16 cases only (bfloat16 needs the 16-bit-pattern path of the CuPy
backend's adapters). Run by `scripts/gpu_check.sh --sm90a`."""
from __future__ import annotations

import pytest

from emulation.sm90_cases import CASES, run_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("label", [k for k, c in CASES.items() if c["dtype"] == "float16"])
def test_case_on_hopper(label):
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings (tensor maps)")
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    run_case(label, device=True)
