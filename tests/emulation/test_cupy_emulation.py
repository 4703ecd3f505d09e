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
    FwdParams dtype missing a field is refused before the kernel runs."""
    import numpy as np
    from emulation.cupy import _Kernel
    kernel = _Kernel("varlen_fwd<__half, 64, 64, 64, false, 64, 3>", block_m=64)
    full = _cupy_launch.FWD_PARAMS_DTYPE
    short = np.dtype([(n, full.fields[n][0]) for n in full.names[:-1]], align=True)
    with pytest.raises(TypeError, match=f"argument 0 .*{short.itemsize} B.* has "
                                        f"{full.itemsize} B"):
        kernel((1, 1), (128,), (np.zeros((), short),))
    with pytest.raises(TypeError, match="2 arguments for 1 parameters"):
        kernel((1, 1), (128,), (np.zeros((), full), np.zeros((), full)))


@pytest.mark.smoke
@needs_cxx
def test_kernels_match_reference_on_host_emulation():
    """The kernels themselves, compiled for the CPU with emulated PTX primitives and driven by
    the real launchers, agree with the float64 reference (forward and both backward modes)."""
    emulate(["-m", "emulation", "--quick"], timeout=600)
