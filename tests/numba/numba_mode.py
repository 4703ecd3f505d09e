"""Where the Numba kernels run in this test session (decided by the root conftest)."""
from numba import config as _numba_config

# True in the CUDA simulator: tiny shapes there (one OS thread per CUDA thread, about a
# millisecond per thread per launch); False on a GPU.
SIM = bool(getattr(_numba_config, "ENABLE_CUDASIM", 0))
