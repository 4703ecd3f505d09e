// Backward preprocessing (FlashAttention-2, Alg. 2, line 4) and the dQ conversion.
//
// varlen_bwd_preprocess: per (row i, head h), delta[h, i] = sum_d dO[i, h, d] * O[i, h, d] in
// fp32, and lse2[h, i] = lse[h, i] * LOG2E, the row's log-sum-exp in the base-2 units of the
// score tiles. Where lse is not finite (-inf for a row without a visible key; NaN or +inf
// otherwise) lse2 is +inf, so that every probability exp2(x - lse2) of a hidden pair (x = -inf)
// is exactly 0, and delta is NaN, as it is where O or dO holds a NaN or inf: the one value the
// attention kernels check for the query side of a visible pair. One warp per (row, head) pair,
// striding over the grid.
//
// varlen_bwd_dq_convert: dq = dq_accum (fp32, atomically accumulated) in the input dtype.
#pragma once

#include "common.cuh"

namespace varlen {

constexpr int PREPROCESS_WARPS = 4;
constexpr int CONVERT_THREADS = 256;

}  // namespace varlen

using namespace varlen;

template <typename T, int D>
__global__ void __launch_bounds__(PREPROCESS_WARPS * WARP_SIZE)
varlen_bwd_preprocess(const T* __restrict__ out,     // [Tq, Hq, D]
                      const T* __restrict__ dout,    // [Tq, Hq, D]
                      const float* __restrict__ lse, // [Hq, Tq]
                      float* __restrict__ delta,     // [Hq, Tq]
                      float* __restrict__ lse2,      // [Hq, Tq]
                      int Tq, int Hq) {
    static_assert(D % WARP_SIZE == 0, "each lane reads D / 32 elements of a row");
    const int lane = threadIdx.x % WARP_SIZE;
    const int64_t pairs = static_cast<int64_t>(Tq) * Hq;
    const int64_t step = static_cast<int64_t>(gridDim.x) * PREPROCESS_WARPS;
    for (int64_t pair = static_cast<int64_t>(blockIdx.x) * PREPROCESS_WARPS +
                        threadIdx.x / WARP_SIZE;           // = row * Hq + head
         pair < pairs; pair += step) {
        const int64_t row = pair / Hq;
        const int head = static_cast<int>(pair % Hq);
        const T* p_o = out + pair * D;
        const T* p_do = dout + pair * D;
        float sum = 0.f;
        #pragma unroll
        for (int i = 0; i < D / WARP_SIZE; ++i) {
            const int d = lane + i * WARP_SIZE;
            sum += ElemTraits<T>::to_float(p_o[d]) * ElemTraits<T>::to_float(p_do[d]);
        }
        #pragma unroll
        for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        if (lane == 0) {
            const int64_t idx = static_cast<int64_t>(head) * Tq + row;
            const float l = lse[idx];
            delta[idx] = is_finite(l) ? sum : nan_f();
            lse2[idx] = is_finite(l) ? l * LOG2E : pos_inf();
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(CONVERT_THREADS)
varlen_bwd_dq_convert(const float* __restrict__ dq_accum, T* __restrict__ dq, int64_t n) {
    const int64_t step = static_cast<int64_t>(gridDim.x) * CONVERT_THREADS;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * CONVERT_THREADS + threadIdx.x; i < n;
         i += step) {
        dq[i] = ElemTraits<T>::from_float(dq_accum[i]);
    }
}
