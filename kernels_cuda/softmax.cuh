// Score transform (scale, softcap, mask, non-finite values), the online softmax of
// FlashAttention-2 (Alg. 1, lines 9-10) and its backward (Alg. 2), on a warp's [16, 8 NB] fp32
// score tiles in C-fragment layout: lane (g, t) holds rows g and g + 8, columns
// nb * 8 + 2t + {0, 1}. Scores are kept in base-2 units x = s * LOG2E, so
// p = exp2(x - m) = exp(s - m / LOG2E).
#pragma once

#include "common.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "mma.cuh"

namespace varlen {

// tanh(y) = 1 - 2 / (2^(2 y LOG2E) + 1), from ex2.approx and one approximate division: about
// 2^-21 absolute error. tanhf under --use_fast_math is tanh.approx.f32, 2^-11 relative, which
// moves a soft-capped score by up to softcap * 2^-11 and the row's lse with it (1e-3 at a
// softcap of 5: past the lse tolerance). y = +inf gives 2 / inf = 0 and tanh 1, y = -inf gives
// exp2 = 0 and tanh -1; a NaN stays NaN.
__device__ __forceinline__ float tanh_accurate(float y) {
    return 1.f - __fdividef(2.f, exp2f(2.f * LOG2E * y) + 1.f);
}

// Scaled (and soft-capped) score in base-2 units; also the tanh for the softcap gradient.
template <bool HAS_SOFTCAP>
__device__ __forceinline__ float score_log2(float qk, float softmax_scale, float softcap,
                                            float* tanh_out = nullptr) {
    if constexpr (HAS_SOFTCAP) {
        const float th = tanh_accurate(__fdividef(qk * softmax_scale, softcap));
        if (tanh_out) *tanh_out = th;
        return softcap * th * LOG2E;
    } else {
        return qk * (softmax_scale * LOG2E);
    }
}

// Scaled (and soft-capped) score in natural-log units, what a score_mod takes; also the tanh
// for the softcap gradient.
template <bool HAS_SOFTCAP>
__device__ __forceinline__ float score_scaled(float qk, float softmax_scale, float softcap,
                                              float* tanh_out = nullptr) {
    if constexpr (HAS_SOFTCAP) {
        const float th = tanh_accurate(__fdividef(qk * softmax_scale, softcap));
        if (tanh_out) *tanh_out = th;
        return softcap * th;
    } else {
        return qk * softmax_scale;
    }
}

// mask_scores without user functions: scale, then the band on partial tiles only (below).
template <bool HAS_SOFTCAP, int NB>
__device__ __forceinline__ void mask_scores_builtin(float (&s)[NB][4], const TileMask<false>& mask,
                                                    const CallParams& call, int lane) {
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nb][e] = score_log2<HAS_SOFTCAP>(s[nb][e], call.softmax_scale, call.softcap) +
                       zero_or_nan(s[nb][e]);
        }
    }
    if (!mask.partial) return;
    for_each_element<NB>(mask, lane, [&](int nb, int i, int, bool visible) {
        if (!visible) s[nb][i] = neg_inf();
    });
}

// Every score of a warp's [16, 8 NB] tile in base-2 units (the forward pass), then -inf where
// the row does not see the key: a select, so whatever a hidden key holds stays out. A NaN or
// inf dot product (a NaN or inf in q or in that key's k) makes the score NaN, also under a
// softcap whose tanh would turn an infinite score into a finite one; a row that sees one has a
// NaN probability, and OnlineSoftmax carries it into the row's sum and output. Mask arithmetic
// on partial tiles only.
// With the user's functions (HAS_MODS) each pair is tested: the band (partial chunks), rows
// present, then the mask_mod (chunks its class leaves partial: TileMask::user_visible), and a
// visible pair's score goes through the score_mod before the base-2 scaling (-inf from it
// hides the pair).
template <bool HAS_SOFTCAP, int NB>
__device__ __forceinline__ void mask_scores(float (&s)[NB][4], const TileMask<false>& mask,
                                            const CallParams& call, int lane) {
    if constexpr (HAS_MODS) {
        for_each_element<NB>(mask, lane, [&](int nb, int i, int col, bool visible) {
            const float qk = s[nb][i];
            visible = mask.user_visible(visible, i / 2, col);
            float x = score_scaled<HAS_SOFTCAP>(qk, call.softmax_scale, call.softcap);
            if (visible) x = mask.user_score(x, i / 2, col);
            s[nb][i] = visible ? x * LOG2E + zero_or_nan(qk) : neg_inf();
        });
    } else {
        mask_scores_builtin<HAS_SOFTCAP>(s, mask, call, lane);
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
    // lse (-inf for such a row). Both are NaN for a row that saw a NaN or inf: a NaN score
    // (mask_scores) has made its sum NaN, a value row its output rows `acc` non-finite.
    template <int NO>
    __device__ __forceinline__ void finish(const float (&acc)[NO][4], float (&inv_l)[2],
                                           float (&lse)[2]) const {
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            bool bad = !is_finite(l[half]);
            #pragma unroll
            for (int no = 0; no < NO; ++no) {
                bad |= !is_finite(acc[no][2 * half]) || !is_finite(acc[no][2 * half + 1]);
            }
            bad = quad_max(bad ? 1.f : 0.f) > 0.f;       // any lane of the row's quad
            const float l_row = quad_sum(l[half]);
            const bool seen = l_row > 0.f;
            inv_l[half] = bad ? nan_f() : (seen ? __fdividef(1.f, l_row) : 0.f);
            lse[half] = bad ? nan_f() : (seen ? (m[half] + log2f(l_row)) * LN2 : neg_inf());
        }
    }
};

// lse2 and delta of query row `row` of head `head` ([Hq, Tq] arrays); a row past the tile gets
// lse2 = +inf and delta = 0 (its pairs are masked, or its results not written).
__device__ __forceinline__ void load_row_stats(float& row_lse2, float& row_delta,
                                               const float* lse2, const float* delta, int Tq,
                                               int head, int row, bool present) {
    const int64_t idx = static_cast<int64_t>(head) * Tq + row;
    row_lse2 = present ? lse2[idx] : pos_inf();
    row_delta = present ? delta[idx] : 0.f;
}

// The softmax backward of one [16, 8 NB] tile (FlashAttention-2, Alg. 2): with x the score in
// base-2 units, P = exp2(x - lse2) replaces the scores `s` (in: Q K^T) and
// dS = P (dP - delta) * softmax_scale (times 1 - tanh^2 with a softcap) replaces `dp` (in:
// dO V^T). `stats.lse2(half, col)` and `stats.delta(half, col)` give an element's row
// statistics: per column in the transposed dK/dV kernels (ColStats).
// Hidden pairs get P = dS = 0 exactly, whatever their operands hold: x = -inf against an lse2
// that is finite or +inf (the preprocessing), times a finite dP - delta. A pair the row sees
// with a NaN or inf operand gets P = dS = NaN, so the products that follow (dV += P^T dO,
// dK += dS^T Q and dQ += dS K in the dK/dV kernel) make both sides of the pair NaN in every
// column. The checks ride on values in registers, without a
// compare: see zero_or_nan and clamp_finite.
// With the user's functions (HAS_MODS) the pair is tested as mask_scores tests it, P comes from
// the score_mod of a visible pair's score, and dS is multiplied by its derivative (before the
// softcap's chain factor, which the product commutes with). A pair the score_mod sends to -inf
// is hidden here: P = dS = 0 whatever its operands hold (a row it leaves without a key has
// lse -inf, which the preprocessing turns into a NaN delta). With aux_grads (HAS_AUX_GRADS) a
// visible pair adds its dL/d score_mod = P (dP - delta) times each float aux read's derivative
// into the aux gradients (mask.user_aux_grad), where `mask.aux_grads` says so.
// With dropout (`drop`: TileDropout) a pair's dP and its P for dV are multiplied by its factor,
// 1 / (1 - p) kept and 0 dropped (docs/semantics.md, "Dropout"): dS = P (dP factor - delta).
// A mask type whose pairs' answers, the mask_mod's included, were computed ahead
// (UserBits<Mask>::ON: the sm_90a backward's KeyRowsUserBits, whose for_each_element gives
// them) in a kernel without a score_mod takes the walk without user functions.
template <typename Mask>
struct UserBits {
    static constexpr bool ON = false;
};

template <bool HAS_SOFTCAP, int NB, typename Mask, typename Stats, typename Drop = NoDropout>
__device__ __forceinline__ void softmax_backward(float (&s)[NB][4], float (&dp)[NB][4],
                                                 const Mask& mask, const Stats& stats,
                                                 const CallParams& call, int lane,
                                                 const Drop& drop = Drop{}) {
    if constexpr (HAS_SCORE_MOD || (HAS_MASK_MOD && !UserBits<Mask>::ON)) {
        for_each_element<NB>(mask, lane, [&](int nb, int i, int col, bool visible) {
            const float qk = s[nb][i];
            float th = 0.f;
            float x = score_scaled<HAS_SOFTCAP>(qk, call.softmax_scale, call.softcap, &th);
            if constexpr (Drop::ON) dp[nb][i] *= drop.factor(nb, i);
            float t = dp[nb][i] - stats.delta(i / 2, col);
            const float dp_delta = t;
            if (HAS_SOFTCAP) t *= 1.f - th * th;
            // NaN for a pair with a NaN or inf operand, as below (before the score_mod's factor)
            const float nan_check = zero_or_nan(qk + t);
            visible = mask.user_visible(visible, i / 2, col);
            const float x_in = x;
            if (visible) {
                t *= mask.user_score_grad(x, i / 2, col);
                x = mask.user_score(x, i / 2, col);
                visible = x != neg_inf();
            }
            x = visible ? x * LOG2E + nan_check : neg_inf();
            const float p = exp2f(x - stats.lse2(i / 2, col));
            if constexpr (HAS_AUX_GRADS) {
                if (visible && mask.aux_grads) mask.user_aux_grad(p * dp_delta, x_in, i / 2, col);
            }
            s[nb][i] = Drop::ON ? p * drop.factor(nb, i) : p;
            dp[nb][i] = p * clamp_finite(t) * call.softmax_scale;
        });
    } else {
        for_each_element<NB>(mask, lane, [&](int nb, int i, int col, bool visible) {
            float th = 0.f;
            float x = score_log2<HAS_SOFTCAP>(s[nb][i], call.softmax_scale, call.softcap, &th);
            if constexpr (Drop::ON) dp[nb][i] *= drop.factor(nb, i);
            float t = dp[nb][i] - stats.delta(i / 2, col);
            if (HAS_SOFTCAP) t *= 1.f - th * th;
            // NaN for a pair with a NaN or inf operand: q or k (the dot product, before the
            // softcap's tanh), dO or v (dP), O or lse (delta)
            x += zero_or_nan(s[nb][i] + t);
            if (!visible) x = neg_inf();
            const float p = exp2f(x - stats.lse2(i / 2, col));
            s[nb][i] = Drop::ON ? p * drop.factor(nb, i) : p;
            // a hidden pair's 0 * t stays 0 whatever its operands hold
            dp[nb][i] = p * clamp_finite(t) * call.softmax_scale;
        });
    }
}

// P and dS of this warp's rows of one tile pair in the backward pass: S = X Y^T and
// dP = dX dY^T (X, dX = K, V and Y, dY = Q, dO: transposed, in the dK/dV kernel; padded
// shared tiles of D columns, dX and dY holding DV of them), then softmax_backward.
template <bool HAS_SOFTCAP, typename T, int D, int DV, int NB, typename Mask, typename Stats,
          typename Drop = NoDropout>
__device__ __forceinline__ void recompute_p_ds(float (&p)[NB][4], float (&ds)[NB][4],
                                               const T* s_x, const T* s_dx, const T* s_y,
                                               const T* s_dy, const Mask& mask,
                                               const Stats& stats, const CallParams& call,
                                               const WarpSlot& w, const Drop& drop = Drop{}) {
    gemm_abt<T, D>(p, s_x, w.row0, s_y, w.lane);
    gemm_abt<T, D, DV>(ds, s_dx, w.row0, s_dy, w.lane);
    softmax_backward<HAS_SOFTCAP>(p, ds, mask, stats, call, w.lane, drop);
}

}  // namespace varlen
