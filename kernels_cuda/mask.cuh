// The per-sequence mask predicate, evaluated at global positions.
//
// With s = Lk - Lq when bottom_right else 0, query i sees key j iff
//     (left < 0 or j >= i + s - left) and (right < 0 or j <= i + s + right),
// i.e. j lies in the band [i + s - left, i + s + right] (an unbounded side drops out), and,
// transposed, i lies in [j - s - right, j - s + left]. Kernels evaluate it only on partially
// masked tiles; the band edges are computed once per row in 64-bit and clamped to int32, so
// the per-element test is two integer compares and cannot overflow.
#pragma once

#include "common.cuh"

namespace varlen {

struct SeqPolicy {
    int left;     // window_left, < 0 = unbounded
    int right;    // window_right, < 0 = unbounded
    int shift;    // s = Lk - Lq (bottom-right aligned) or 0

    __device__ __forceinline__ static SeqPolicy load(const int* p_left, const int* p_right,
                                                     const int* p_bottom_right,
                                                     const int* p_seqlen_q,
                                                     const int* p_seqlen_k, int b) {
        SeqPolicy pol;
        pol.left = p_left[b];
        pol.right = p_right[b];
        pol.shift = p_bottom_right[b] ? p_seqlen_k[b] - p_seqlen_q[b] : 0;
        return pol;
    }
};

// A closed interval [lo, hi] of visible positions; empty when lo > hi.
struct Band {
    int lo;
    int hi;
    __device__ __forceinline__ bool contains(int x) const { return x >= lo && x <= hi; }
};

__device__ __forceinline__ int clamp_to_int(int64_t x) {
    return static_cast<int>(x < INT_LOWEST ? INT_LOWEST : (x > INT_HIGHEST ? INT_HIGHEST : x));
}

// Keys visible to query position i, intersected with the key rows present [k_lo, k_hi].
__device__ __forceinline__ Band key_band(const SeqPolicy& pol, int i, int k_lo, int k_hi) {
    const int64_t center = static_cast<int64_t>(i) + pol.shift;
    const int lo = pol.left < 0 ? INT_LOWEST : clamp_to_int(center - pol.left);
    const int hi = pol.right < 0 ? INT_HIGHEST : clamp_to_int(center + pol.right);
    return Band{max(lo, k_lo), min(hi, k_hi)};
}

// Queries that see key position j, intersected with the query rows present [q_lo, q_hi].
__device__ __forceinline__ Band query_band(const SeqPolicy& pol, int j, int q_lo, int q_hi) {
    const int64_t center = static_cast<int64_t>(j) - pol.shift;
    const int lo = pol.right < 0 ? INT_LOWEST : clamp_to_int(center - pol.right);
    const int hi = pol.left < 0 ? INT_HIGHEST : clamp_to_int(center + pol.left);
    return Band{max(lo, q_lo), min(hi, q_hi)};
}

}  // namespace varlen
