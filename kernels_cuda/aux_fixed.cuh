// Deterministic aux gradients: one float32 contribution added to an aux entry's fixed-point
// words with 64-bit integer atomics, which associate, so the sum is the same in any order.
// The encoding, its range and resolution, and the conversion to float32 that follows the
// backward: varlen/backends/_aux_fixed.py (docs/mods.md, "Gradients").
#pragma once

#include "common.cuh"

namespace varlen {

// The words of an entry: [POS_HI, POS_LO, NEG_HI, NEG_LO, FLAGS] (_aux_fixed.WORDS).
constexpr int FIXED_WORDS = 5;
constexpr unsigned long long FIXED_NAN = 1ULL, FIXED_POS_INF = 2ULL, FIXED_NEG_INF = 4ULL,
                             FIXED_RANGE = 8ULL;
constexpr double FIXED_SCALE = 16777216.0;                  // 2^24: HI units, and LO per HI unit
constexpr double FIXED_LIMIT = 9223372036854775808.0;       // 2^63: no word reaches it

// w += x; the addition that takes the word to 2^63 or past flags RANGE (each word only grows,
// so whichever addition crosses it does, in any order).
__device__ __forceinline__ void fixed_word_add(unsigned long long* w, unsigned long long x,
                                               unsigned long long* flags) {
    if (x == 0ULL) return;
    const unsigned long long old = atomicAdd(w, x);
    if (old + x >= (1ULL << 63)) atomicOr(flags, FIXED_RANGE);
}

// Adds g to the entry whose words start at w (the caller skips g == 0).
__device__ __forceinline__ void fixed_add(unsigned long long* w, float g) {
    unsigned long long* const flags = w + 4;
    if (g != g) {
        atomicOr(flags, FIXED_NAN);
        return;
    }
    const double a = fabs(static_cast<double>(g)) * FIXED_SCALE;     // exact
    if (a >= FIXED_LIMIT) {     // an infinity, or one contribution past the range
        atomicOr(flags, a == static_cast<double>(pos_inf()) ?
                            (g > 0.f ? FIXED_POS_INF : FIXED_NEG_INF) : FIXED_RANGE);
        return;
    }
    const double hi = floor(a);
    const int side = g < 0.f ? 2 : 0;
    fixed_word_add(w + side, static_cast<unsigned long long>(hi), flags);
    fixed_word_add(w + side + 1, static_cast<unsigned long long>(rint((a - hi) * FIXED_SCALE)),
                   flags);
}

}  // namespace varlen
