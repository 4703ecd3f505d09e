// Entry point of the CuPy module: every kernel template of the backend. The host side
// (varlen/backends/cupy/mma.py) names instantiations through name expressions.
#include "fwd.cuh"
#include "bwd_preprocess.cuh"
#include "bwd_dkdv.cuh"
#include "plan_build.cuh"

// The sm_90a forward (wgmma, TMA, setmaxnreg): only where those instructions exist, so that
// the sm_80 and sm_90 builds of the kernels above are unchanged.
#if defined(VARLEN_HOST_EMULATION) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "fwd_sm90.cuh"
#include "bwd_sm90.cuh"
#endif
