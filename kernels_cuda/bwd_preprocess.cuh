// Backward preprocessing (FlashAttention-2, Alg. 2, line 4) and the dQ conversion.
//
// varlen_bwd_preprocess: per (row i, head h), delta[h, i] = sum_d dO[i, h, d] * O[i, h, d] in
// fp32, and lse2[h, i] = lse[h, i] * LOG2E, the row's log-sum-exp in the base-2 units of the
// score tiles. Where lse is not finite (-inf for a row without a visible key; NaN or +inf
// otherwise) lse2 is +inf, so that every probability exp2(x - lse2) of a hidden pair (x = -inf)
// is exactly 0, and delta is NaN, as it is where O or dO holds a NaN or inf: the one value the
// attention kernels check for the query side of a visible pair. One warp per (row, head) pair,
// striding over the grid. It also writes what no later kernel of the backward writes, so that
// none of its outputs needs a fill: the zeros of the fp32 accumulator dq_accum (every row: the
// dK/dV kernel adds into it, dq_convert then writes every row of dq); the pad rows of dk and dv
// (rows of no key tile), striding over their windows of PAD_ROWS_PER_THREAD rows
// (for_each_pad_run); with ordered dQ
// (bwd_dq_ordered.cuh, the deterministic backward) the zeroed counters of dq_order and its map
// from rows to query tile slots.
// The kernels after it on the stream write only their tiles' rows: no row has two writers.
//
// varlen_bwd_dq_convert: dq = dq_accum (fp32, atomically accumulated) in the input dtype.
//
// Both take the backward's BwdParams (params.cuh), as the dK/dV kernels do.
#pragma once

#include "common.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

constexpr int PREPROCESS_WARPS = 4;
constexpr int CONVERT_THREADS = 256;

}  // namespace varlen

using namespace varlen;

// D: the head dim of q, k, dq_accum; DV: that of v, out and dout (head_dim_v <= D).
template <typename T, int D, int DV = D>
__global__ void __launch_bounds__(PREPROCESS_WARPS * WARP_SIZE)
varlen_bwd_preprocess(const BwdParams params) {
    static_assert(D % WARP_SIZE == 0 && DV % WARP_SIZE == 0,
                  "each lane reads DV / 32 elements of a row and zeroes D / 32");
    const PlanView& plan = params.plan;
    const int Tq = plan.rows_q;
    const int Hq = params.call.Hq;
    const T* out = static_cast<const T*>(params.out);
    const T* dout = static_cast<const T*>(params.dout);
    int* dq_order = params.dq_order;
    const int lane = threadIdx.x % WARP_SIZE;
    const int64_t pairs = static_cast<int64_t>(Tq) * Hq;
    const int64_t step = static_cast<int64_t>(gridDim.x) * PREPROCESS_WARPS;
    for (int64_t pair = static_cast<int64_t>(blockIdx.x) * PREPROCESS_WARPS +
                        threadIdx.x / WARP_SIZE;           // = row * Hq + head
         pair < pairs; pair += step) {
        const int64_t row = pair / Hq;
        const int head = static_cast<int>(pair % Hq);
        const T* p_o = out + row * params.out_strides.row +
                       static_cast<int64_t>(head) * params.out_strides.head;
        const T* p_do = dout + row * params.dout_strides.row +
                        static_cast<int64_t>(head) * params.dout_strides.head;
        float sum = 0.f;
        #pragma unroll
        for (int i = 0; i < DV / WARP_SIZE; ++i) {
            const int d = lane + i * WARP_SIZE;
            sum += ElemTraits<T>::to_float(p_o[d]) * ElemTraits<T>::to_float(p_do[d]);
        }
        #pragma unroll
        for (int i = 0; i < D / WARP_SIZE; ++i) {
            params.dq_accum[pair * D + lane + i * WARP_SIZE] = 0.f;
        }
        #pragma unroll
        for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        if (lane == 0) {
            const int64_t idx = static_cast<int64_t>(head) * Tq + row;
            const float l = params.lse[static_cast<int64_t>(head) * params.lse_stride + row];
            params.delta[idx] = is_finite(l) ? sum : nan_f();
            params.lse2[idx] = is_finite(l) ? l * LOG2E : pos_inf();
            if (dq_order != nullptr) dq_order[idx] = 0;
        }
    }

    // Ordered dQ: row Hq of dq_order holds the query tile slot of each row a tile covers.
    if (dq_order != nullptr) {
        constexpr int NUM_THREADS = PREPROCESS_WARPS * WARP_SIZE;
        int* p_slot = dq_order + static_cast<int64_t>(Hq) * Tq;
        const int64_t items = static_cast<int64_t>(plan.num_q_tiles) * plan.block_m;
        #pragma unroll 1
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * NUM_THREADS + threadIdx.x; i < items;
             i += static_cast<int64_t>(gridDim.x) * NUM_THREADS) {
            const int slot = static_cast<int>(i / plan.block_m);
            const int r = static_cast<int>(i % plan.block_m);
            const TileInfo tile = load_tile(plan.q_tiles, slot);     // unused slots: no rows
            if (r < tile.rows) p_slot[tile.row + r] = slot;
        }
    }

    // Pad rows of dk and dv.
    const int64_t windows =
        (static_cast<int64_t>(plan.rows_k) + PAD_ROWS_PER_THREAD - 1) / PAD_ROWS_PER_THREAD;
    constexpr int NUM_THREADS = PREPROCESS_WARPS * WARP_SIZE;
    #pragma unroll 1
    for (int64_t w = static_cast<int64_t>(blockIdx.x) * NUM_THREADS + threadIdx.x; w < windows;
         w += static_cast<int64_t>(gridDim.x) * NUM_THREADS) {
        for_each_pad_run(plan.k_tiles, plan.num_k_tiles, plan.rows_k, w,
                         [&](int64_t begin, int64_t end) {
            zero_head_rows<D>(static_cast<T*>(params.dk), params.dk_strides, params.call.Hk,
                              begin, end);
            zero_head_rows<DV>(static_cast<T*>(params.dv), params.dv_strides, params.call.Hk,
                              begin, end);
        });
    }
}

// dq [Tq, Hq, D] (its rows and heads dq_strides apart) = dq_accum (packed fp32), in the input
// dtype: a grid-stride loop over the rows, a block's threads over a row's Hq * D elements.
template <typename T, int D>
__global__ void __launch_bounds__(CONVERT_THREADS)
varlen_bwd_dq_convert(const BwdParams params) {
    const int64_t rows = params.plan.rows_q;
    const int row_elems = params.call.Hq * D;       // < 2^24: Hq <= 65535, D <= 256
    T* dq = static_cast<T*>(params.dq);
    #pragma unroll 1
    for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
        const float* src = params.dq_accum + t * row_elems;
        T* dst = dq + t * params.dq_strides.row;
        #pragma unroll 1
        for (int j = threadIdx.x; j < row_elems; j += CONVERT_THREADS) {
            const int h = j / D;
            dst[static_cast<int64_t>(h) * params.dq_strides.head + (j - h * D)] =
                ElemTraits<T>::from_float(src[j]);
        }
    }
}
