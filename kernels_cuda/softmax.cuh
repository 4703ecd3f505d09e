// Score transform (scale, softcap), the online softmax of FlashAttention-2 (Alg. 1, lines 9-10)
// and its backward (Alg. 2), on a warp's [16, 8 NB] fp32 score tiles in C-fragment layout:
// lane (g, t) holds rows g and g + 8, columns nb * 8 + 2t + {0, 1}. Scores are kept in base-2
// units x = s * LOG2E, so p = exp2(x - m) = exp(s - m / LOG2E).
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"

namespace varlen {

// Scaled (and soft-capped) score in base-2 units; also the tanh for the softcap gradient.
template <bool HAS_SOFTCAP>
__device__ __forceinline__ float score_log2(float qk, float softmax_scale, float softcap,
                                            float* tanh_out = nullptr) {
    if constexpr (HAS_SOFTCAP) {
        const float th = tanhf(qk * softmax_scale / softcap);
        if (tanh_out) *tanh_out = th;
        return softcap * th * LOG2E;
    } else {
        return qk * (softmax_scale * LOG2E);
    }
}

// Every score of a [16, 8 NB] tile in base-2 units (the forward pass; the backward pass also
// needs each tanh, so it transforms element by element in softmax_backward).
template <bool HAS_SOFTCAP, int NB>
__device__ __forceinline__ void scale_scores(float (&s)[NB][4], const CallParams& call) {
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nb][e] = score_log2<HAS_SOFTCAP>(s[nb][e], call.softmax_scale, call.softcap);
        }
    }
}

// Running row statistics of one lane's two rows (g and g + 8): max m in base-2 units and the
// lane's partial row sum l (summed over the quad only at the end: every lane of a quad
// applies the same rescaling, so the partial sums stay consistent).
struct OnlineSoftmax {
    float m[2];
    float l[2];

    __device__ __forceinline__ void init() {
        m[0] = m[1] = neg_inf();
        l[0] = l[1] = 0.f;
    }

    // s: scores in base-2 units -> probabilities exp2(s - m_new); acc (the output rows) is
    // rescaled by exp2(m_old - m_new). A row that has seen no visible key yet keeps m = -inf
    // and uses 0 as its reference, so no inf - inf appears.
    template <int NB, int NO>
    __device__ __forceinline__ void update(float (&s)[NB][4], float (&acc)[NO][4]) {
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            float mx = m[half];
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                mx = fmaxf(mx, fmaxf(s[nb][2 * half], s[nb][2 * half + 1]));
            }
            mx = quad_max(mx);
            const float ref = mx == neg_inf() ? 0.f : mx;
            const float corr = exp2f(m[half] - ref);
            m[half] = mx;
            float sum = 0.f;
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                s[nb][2 * half] = exp2f(s[nb][2 * half] - ref);
                s[nb][2 * half + 1] = exp2f(s[nb][2 * half + 1] - ref);
                sum += s[nb][2 * half] + s[nb][2 * half + 1];
            }
            l[half] = l[half] * corr + sum;
            #pragma unroll
            for (int no = 0; no < NO; ++no) {
                acc[no][2 * half] *= corr;
                acc[no][2 * half + 1] *= corr;
            }
        }
    }

    // Final 1/l per row (0 for a row without a visible key: output 0) and the natural-log
    // lse (-inf for such a row).
    __device__ __forceinline__ void finish(float (&inv_l)[2], float (&lse)[2]) const {
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float l_row = quad_sum(l[half]);
            const bool seen = l_row > 0.f;
            inv_l[half] = seen ? 1.f / l_row : 0.f;
            lse[half] = seen ? (m[half] + log2f(l_row)) * LN2 : neg_inf();
        }
    }
};

// lse2 and delta of query row `row` of head `head` ([Hq, Tq] arrays); a row past the tile gets
// lse2 = +inf and delta = 0, so its recomputed probabilities are exactly 0.
__device__ __forceinline__ void load_row_stats(float& row_lse2, float& row_delta,
                                               const float* lse2, const float* delta, int Tq,
                                               int head, int row, bool present) {
    const int64_t idx = static_cast<int64_t>(head) * Tq + row;
    row_lse2 = present ? lse2[idx] : pos_inf();
    row_delta = present ? delta[idx] : 0.f;
}

// The softmax backward of one [16, 8 NB] tile (FlashAttention-2, Alg. 2): with x the masked
// score in base-2 units, P = exp2(x - lse2) replaces the scores `s` (in: Q K^T) and
// dS = P (dP - delta) * softmax_scale (times 1 - tanh^2 with a softcap) replaces `dp` (in:
// dO V^T). `stats.lse2(half, col)` and `stats.delta(half, col)` give an element's row
// statistics: per row in the dQ kernel, per column in the transposed dK/dV kernel.
template <bool HAS_SOFTCAP, int NB, typename Mask, typename Stats>
__device__ __forceinline__ void softmax_backward(float (&s)[NB][4], float (&dp)[NB][4],
                                                 const Mask& mask, const Stats& stats,
                                                 const CallParams& call, int lane) {
    for_each_element<NB>(mask, lane, [&](int nb, int i, int col, bool visible) {
        float th = 0.f;
        float x = score_log2<HAS_SOFTCAP>(s[nb][i], call.softmax_scale, call.softcap, &th);
        if (!visible) x = neg_inf();
        const float p = exp2f(x - stats.lse2(i / 2, col));
        float ds = p * (dp[nb][i] - stats.delta(i / 2, col));
        if (HAS_SOFTCAP) ds *= 1.f - th * th;
        s[nb][i] = p;
        dp[nb][i] = ds * call.softmax_scale;
    });
}

// P and dS of this warp's rows of one tile pair in the backward pass: S = X Y^T and
// dP = dX dY^T (X, dX = Q, dO and Y, dY = K, V in the dQ kernel; K, V and Q, dO, transposed,
// in the dK/dV kernel; all padded shared tiles of D columns), then softmax_backward.
template <bool HAS_SOFTCAP, typename T, int D, int NB, typename Mask, typename Stats>
__device__ __forceinline__ void recompute_p_ds(float (&p)[NB][4], float (&ds)[NB][4],
                                               const T* s_x, const T* s_dx, const T* s_y,
                                               const T* s_dy, const Mask& mask,
                                               const Stats& stats, const CallParams& call,
                                               const WarpSlot& w) {
    gemm_abt<T, D>(p, s_x, w.row0, s_y, w.lane);
    gemm_abt<T, D>(ds, s_dx, w.row0, s_dy, w.lane);
    softmax_backward<HAS_SOFTCAP>(p, ds, mask, stats, call, w.lane);
}

}  // namespace varlen
