"""The mma.sync kernels (`cupy:mma`) through the host emulation, driven by the real launchers:
one batch's forward and both backward modes against the float64 reference (`python -m
emulation --quick`), and the emulated launch's check of each argument's size."""
from __future__ import annotations

import pytest

import varlen.backends.cupy.launch as _cupy_launch

from helpers import emulate, needs_cxx


@needs_cxx
def test_emulation_refuses_a_struct_of_the_wrong_size():
    """The emulated launch checks every argument's size against its kernel parameter: a
    PlanView dtype missing a field is refused before the kernel runs."""
    import numpy as np
    from emulation.cupy import _Kernel
    kernel = _Kernel("varlen_fwd<__half, 64, 64, 64, false>", block_m=64)
    short = np.dtype([(n, _cupy_launch.PLAN_VIEW_DTYPE.fields[n][0])
                      for n in _cupy_launch.PLAN_VIEW_DTYPE.names[:-1]], align=True)
    data = [np.zeros((1, 1, 64), np.float16) for _ in range(4)] + [np.zeros((1, 1), np.float32)]
    call = np.zeros((), _cupy_launch.CALL_PARAMS_DTYPE)
    full = _cupy_launch.PLAN_VIEW_DTYPE.itemsize
    with pytest.raises(TypeError, match=f"argument 5 .*{short.itemsize} B.* has {full} B"):
        kernel((1, 1), (128,), (*data, np.zeros((), short), call))
    with pytest.raises(TypeError, match="6 arguments for 7 parameters"):
        kernel((1, 1), (128,), (*data[:4], np.zeros((), _cupy_launch.PLAN_VIEW_DTYPE), call))


@pytest.mark.smoke
@needs_cxx
def test_kernels_match_reference_on_host_emulation():
    """The kernels themselves, compiled for the CPU with emulated PTX primitives and driven by
    the real launchers, agree with the float64 reference (forward and both backward modes)."""
    emulate(["-m", "emulation", "--quick"], timeout=600)
