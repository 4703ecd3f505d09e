// The call's mask_mod and score_mod (varlen.MaskMod, varlen.ScoreMod) in the kernels: hooks.
//
// The launcher (varlen/backends/cupy/mods.py) compiles a module of its own for each pair of
// functions: ahead of the kernels it puts the device functions varlen/mods/codegen.py
// generates from their graphs and names them by macro:
//     VARLEN_MASK_MOD        bool  f(b, q_idx, k_idx, const ModAux& aux)
//     VARLEN_SCORE_MOD       float f(score, b, h, q_idx, k_idx, const ModAux& aux)
//     VARLEN_SCORE_MOD_GRAD  float f(score, b, h, q_idx, k_idx, const ModAux& aux), d/d score
//     VARLEN_SCORE_MOD_AUX_GRAD  void f(ds, score, b, h, q_idx, k_idx, const ModAux& aux,
//                                       float* const* grad): with aux_grads, adds ds times
//                                the derivative of each float aux read at its index (atomics)
// (positions inside the sequence, `b` the sequence, `h` the query head, the score the scaled
// and soft-capped logit in natural-log units). Without them the hooks below are constants and
// every kernel compiles exactly as before. With either, every tile the plan keeps is treated
// as partially masked (TileMask::partial): each pair is tested, the built-in band AND the
// mask_mod, and the score_mod applied to the visible ones; pairs the band hides, and rows or
// columns past the tile, never reach the user's functions (so an aux index they would take out
// of range is not flagged). With a mask_mod the mma.sync forward skips a key chunk where none
// of the tile's pairs is visible (block_sees_any, mask.cuh).
#pragma once

#include "common.cuh"

namespace varlen {

#ifdef VARLEN_MASK_MOD
constexpr bool HAS_MASK_MOD = true;
#else
constexpr bool HAS_MASK_MOD = false;
#endif
#ifdef VARLEN_SCORE_MOD
constexpr bool HAS_SCORE_MOD = true;
#else
constexpr bool HAS_SCORE_MOD = false;
#endif
constexpr bool HAS_MODS = HAS_MASK_MOD || HAS_SCORE_MOD;
#ifdef VARLEN_SCORE_MOD_AUX_GRAD
constexpr bool HAS_AUX_GRADS = true;
#else
constexpr bool HAS_AUX_GRADS = false;
#endif

// Whether the mask_mod keeps the pair (query q, key k) of sequence b.
__device__ __forceinline__ bool user_mask(const ModParams& mods, int b, int q, int k) {
#ifdef VARLEN_MASK_MOD
    return VARLEN_MASK_MOD(b, q, k, mods.mask);
#else
    return true;
#endif
}

// The score_mod of score s (natural-log units) of query head h.
__device__ __forceinline__ float user_score(const ModParams& mods, float s, int b, int h, int q,
                                            int k) {
#ifdef VARLEN_SCORE_MOD
    return VARLEN_SCORE_MOD(s, b, h, q, k, mods.score);
#else
    return s;
#endif
}

// d score_mod / d score at s.
__device__ __forceinline__ float user_score_grad(const ModParams& mods, float s, int b, int h,
                                                 int q, int k) {
#ifdef VARLEN_SCORE_MOD_GRAD
    return VARLEN_SCORE_MOD_GRAD(s, b, h, q, k, mods.score);
#else
    return 1.f;
#endif
}

// Adds ds * d score_mod / d aux[index] of each float aux read at s into mods.grad (aux_grads).
__device__ __forceinline__ void user_aux_grad(const ModParams& mods, float ds, float s, int b,
                                              int h, int q, int k) {
#ifdef VARLEN_SCORE_MOD_AUX_GRAD
    VARLEN_SCORE_MOD_AUX_GRAD(ds, s, b, h, q, k, mods.score, mods.grad);
#endif
}

}  // namespace varlen
