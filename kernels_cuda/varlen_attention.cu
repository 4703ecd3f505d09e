// Entry point of the CuPy module: every kernel template of the backend. The host side
// (varlen/backends/_cupy_kernels.py) names instantiations through name expressions.
#include "fwd.cuh"
#include "bwd_preprocess.cuh"
#include "bwd_dkdv.cuh"
#include "bwd_dq.cuh"
#include "plan_build.cuh"


