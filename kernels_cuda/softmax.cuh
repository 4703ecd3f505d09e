// Score transform (scale, softcap, mask) and the online softmax of FlashAttention-2 (Alg. 1,
// lines 9-10), on a warp's [16, 8 NB] fp32 score tile in C-fragment layout: lane (g, t) holds
// rows g and g + 8, columns nb * 8 + 2t + {0, 1}. Scores are kept in base-2 units
// x = s * LOG2E, so p = exp2(x - m) = exp(s - m / LOG2E).
#pragma once

#include "common.cuh"
#include "mask.cuh"

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

// Sets every element outside its row's key band to -inf. Row r of the tile is query position
// q_pos0 + row0 + r; column c is key position k_pos0 + c.
template <int NB>
__device__ __forceinline__ void mask_scores(float (&s)[NB][4], const SeqPolicy& pol, int q_pos,
                                            int k_pos0, int k_rows, int lane) {
    const int g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const Band m_band = key_band(pol, q_pos + g + 8 * half, k_pos0, k_pos0 + k_rows - 1);
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = k_pos0 + nb * 8 + 2 * t + e;
                if (!m_band.contains(j)) s[nb][2 * half + e] = neg_inf();
            }
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

}  // namespace varlen
