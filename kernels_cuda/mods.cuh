// The call's mask_mod and score_mod (varlen.MaskMod, varlen.ScoreMod) in the kernels: hooks.
//
// The launcher (varlen/backends/cupy/mods.py) compiles a module of its own for each pair of
// functions: ahead of the kernels it puts the device functions varlen/mods/codegen.py
// generates from their graphs and names them by macro:
//     VARLEN_MASK_MOD        bool  f(b, q_idx, k_idx, const ModAux& aux)
//     VARLEN_MASK_MOD_CLASS  int   f(b, q0, q1, k0, k1, const ModAux& aux): a box's class
//     VARLEN_SCORE_MOD       float f(score, b, h, q_idx, k_idx, const ModAux& aux)
//     VARLEN_SCORE_MOD_GRAD  float f(score, b, h, q_idx, k_idx, const ModAux& aux), d/d score
//     VARLEN_SCORE_MOD_AUX_GRAD  void f(ds, score, b, h, q_idx, k_idx, const ModAux& aux,
//                                       float* const* grad, bool fixed): with aux_grads, adds
//                                ds times the derivative of each float aux read at its index
//                                (float32 atomics, or with `fixed` the deterministic
//                                fixed-point words of aux_fixed.cuh)
// (positions inside the sequence, `b` the sequence, `h` the query head, the score the scaled
// and soft-capped logit in natural-log units). Without them the hooks below are constants and
// every kernel compiles as before. With a mask_mod the mma.sync kernels classify each chunk
// they walk against their tile (user_mask_class below; UserMaskChunks, mask.cuh): empty chunks
// are skipped, full ones run without evaluating it, partial ones test each pair, the built-in
// band AND the mask_mod (the sm_90a forward treats every chunk as partial). The score_mod is
// applied to every visible pair; pairs the band hides, and rows or columns past the tile,
// never reach the user's functions (so an aux index they would take out of range is not
// flagged).
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

// The mask_mod's class of the box of queries [q0, q1] and keys [k0, k1] of sequence b:
// TILE_EMPTY (no pair visible), TILE_FULL (every pair), TILE_PARTIAL (evaluate each pair; also
// where an aux index may leave its array). Interval arithmetic over the mask graph, generated
// (varlen.mods.class_graph): O(1) per box, aux runs of up to RANGE_CAP entries read; uniform
// across the threads that call it with the same box. Without a mask_mod: TILE_FULL.
constexpr int TILE_EMPTY = 0, TILE_PARTIAL = 1, TILE_FULL = 2;
// Called, not inlined: inlined at the chunk walks of the mma.sync kernels (beside O's or dK's
// and dV's accumulators) it spilled 4 B in the forward at D = 128 (sm_80) and in the ordered
// dK/dV kernel at D = 64 (sm_90); called (the kernels take their params __grid_constant__, so
// `aux` is read in place) neither spills. Not for the sm_90a forward, whose setmaxnreg split
// a call leaves unallocatable, nor for the sm_90a backward's producer, which computes it
// inline (CALLED false: a call there spilled 114 B at D = 64, BN = 128).
#ifdef VARLEN_MASK_MOD_CLASS
__device__ __noinline__ int user_mask_class_call(const ModAux& aux, int b, int q0, int q1, int k0,
                                                 int k1) {
    return static_cast<int>(VARLEN_MASK_MOD_CLASS(b, q0, q1, k0, k1, aux));
}
#endif
template <bool CALLED = true>
__device__ __forceinline__ int user_mask_class(const ModParams& mods, int b, int q0, int q1,
                                               int k0, int k1) {
#ifdef VARLEN_MASK_MOD_CLASS
    if constexpr (CALLED) {
        return user_mask_class_call(mods.mask, b, q0, q1, k0, k1);
    } else {
        return static_cast<int>(VARLEN_MASK_MOD_CLASS(b, q0, q1, k0, k1, mods.mask));
    }
#else
    return TILE_FULL;
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

// Adds ds * d score_mod / d aux[index] of each float aux read at s into mods.grad (aux_grads;
// in fixed point with mods.grad_fixed).
__device__ __forceinline__ void user_aux_grad(const ModParams& mods, float ds, float s, int b,
                                              int h, int q, int k) {
#ifdef VARLEN_SCORE_MOD_AUX_GRAD
    VARLEN_SCORE_MOD_AUX_GRAD(ds, s, b, h, q, k, mods.score, mods.grad, mods.grad_fixed != 0);
#endif
}

}  // namespace varlen
