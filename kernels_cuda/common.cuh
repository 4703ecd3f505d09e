// Shared definitions of the varlen attention kernels: element types, constants, smem layout,
// tests for non-finite values, the rows of one head of a packed array, a thread's warp and lane.
#pragma once

#include "params.cuh"

// Every wait on another thread (an mbarrier phase, the ordered-dQ counter) gives up after
// VARLEN_POLL_LIMIT polls when it is nonzero: the thread prints where it waited and traps, so a
// deadlock ends the launch with a diagnosis instead of a hang (docs/hopper.md, "Hangs"). 0, the
// default: the waits poll without a count (the shipped SASS). A build option
// (`compile.compile_options`), so the two kinds of module never share a cache entry.
#ifndef VARLEN_POLL_LIMIT
#define VARLEN_POLL_LIMIT 0
#endif
static_assert(VARLEN_POLL_LIMIT >= 0 && VARLEN_POLL_LIMIT < 2147483647,
              "VARLEN_POLL_LIMIT: 0 (off) or a poll count below 2^31");

#ifdef VARLEN_HOST_EMULATION
#include "host_emulation.cuh"
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

static_assert(sizeof(int64_t) == 8 && sizeof(uint32_t) == 4, "fixed-width integer types");

namespace varlen {

// A wait that reached VARLEN_POLL_LIMIT polls: prints the kernel's source file and line, the
// function that waited, the block and thread, what it waited on (`kind` `name` at `where`: an
// mbarrier's shared address, a counter's index) and for what (`expected`: an mbarrier's phase
// parity, a counter's value; `seen`: what the counter held, when `has_seen`), then traps: the
// launch ends with an error. Not inlined, and declared not to return, so that the wait loops
// keep no register live across it (no spills around the call).
[[noreturn]] __device__ __noinline__ void poll_limit_reached(const char* file, int line, const char* function,
                                                const char* kind, const char* name,
                                                long long where, long long expected,
                                                bool has_seen, long long seen) {
    const char* base = file;
    for (const char* c = file; *c; ++c) {
        if (*c == '/') base = c + 1;
    }
    if (has_seen) {
        printf("varlen: poll limit: %s:%d (%s), block (%u, %u), thread %u: %s %s %lld still "
               "holds %lld, waiting for %lld, after %d polls; trap\n", base, line, function,
               blockIdx.x, blockIdx.y, threadIdx.x, kind, name, where, seen, expected,
               VARLEN_POLL_LIMIT);
    } else {
        printf("varlen: poll limit: %s:%d (%s), block (%u, %u), thread %u: %s %s at shared "
               "0x%llx: phase of parity %lld not completed after %d polls; trap\n", base, line,
               function, blockIdx.x, blockIdx.y, threadIdx.x, kind, name, where, expected,
               VARLEN_POLL_LIMIT);
    }
    __trap();
    __builtin_unreachable();
}

// exp(x) = exp2(x * LOG2E): the softmax runs in base 2 (one ex2.approx per element).
constexpr float LOG2E = 1.4426950408889634f;   // 1/ln(2)
constexpr float LN2 = 0.6931471805599453f;     // ln(2), back to natural-log lse

// -inf marks a masked score and the lse of a row without a visible key (no <math.h> here).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000u); }
// NaN marks a row that sees a non-finite value (docs/semantics.md, "Non-finite values").
__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000u); }
// false for NaN and +-inf. A comparison, not x - x == 0, which a fast-math compiler may fold.
__device__ __forceinline__ bool is_finite(float x) { return fabsf(x) < pos_inf(); }

// 0 for a finite x, NaN for NaN and +-inf: added to a value, it makes that value NaN exactly when
// x is not finite, with no compare or select (IEEE: inf * 0 is NaN). --use_fast_math (ftz,
// approximate division and square root) does not assume finite values: the SASS keeps the
// multiply by zero (FMUL or FFMA with RZ).
__device__ __forceinline__ float zero_or_nan(float x) { return x * 0.f; }

// x clamped to the finite range, NaN to -FLT_MAX (min/max return the number when one operand is
// NaN): 0 * clamp_finite(x) is 0 whatever x holds.
__device__ __forceinline__ float clamp_finite(float x) {
    const float big = __int_as_float(0x7f7fffffu);   // FLT_MAX
    return fminf(fmaxf(x, -big), big);
}
constexpr int INT_LOWEST = -2147483647 - 1;
constexpr int INT_HIGHEST = 2147483647;

constexpr int WARP_SIZE = 32;
// One warp owns 16 rows of every register tile: the M of mma.m16n8k16.
constexpr int WARP_ROWS = 16;
// Shared-memory rows are padded by 8 elements (16 bytes), which keeps every row start 16-byte
// aligned (ldmatrix and cp.async need that). A row of D + 8 half-words is an odd multiple of
// 16 bytes modulo 128 for D in {32, 64, 96, 128, 256} (2*(D+8) mod 128 is 80, 16, 80, 16, 16),
// so the 8 row addresses of one ldmatrix 8x8 matrix fall in 8 distinct 16-byte bank groups:
// conflict-free without a swizzle.
constexpr int SMEM_PAD = 8;
// cp.async and ldmatrix move 16-byte chunks: 8 half-words.
constexpr int CHUNK_ELEMS = 8;

// Element-type traits: packing two fp32 values into one 32-bit register of the mma operand
// (the lower column index goes to the lower 16 bits, as the PTX fragment layouts require).
template <typename T> struct ElemTraits;

// EXP_BITS: the exponent fields of two packed elements; an element is NaN or inf when its field
// is all ones (see any_nonfinite).
template <> struct ElemTraits<__half> {
    static constexpr bool IS_BF16 = false;
    static constexpr uint32_t EXP_BITS = 0x7c007c00u;
    __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);     // .x = lo (low 16 bits), .y = hi
        return *reinterpret_cast<uint32_t*>(&h);
    }
    __device__ static __forceinline__ float to_float(__half x) { return __half2float(x); }
    __device__ static __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <> struct ElemTraits<__nv_bfloat16> {
    static constexpr bool IS_BF16 = true;
    static constexpr uint32_t EXP_BITS = 0x7f807f80u;
    __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    __device__ static __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// Whether any of the 8 elements of a 16-byte chunk is NaN or inf. Per pair of packed elements,
// adding the lowest exponent bit to an all-ones exponent field carries into that element's sign
// bit, and a smaller field never carries at all (so nothing crosses into the other element).
template <typename T>
__device__ __forceinline__ bool any_nonfinite(const uint4& v) {
    constexpr uint32_t E = ElemTraits<T>::EXP_BITS;
    constexpr uint32_t LSB = E & ~(E << 1);          // lowest bit of each exponent field
    constexpr uint32_t SIGNS = 0x80008000u;
    const uint32_t x = ((v.x & E) + LSB) | ((v.y & E) + LSB) | ((v.z & E) + LSB) |
                       ((v.w & E) + LSB);
    return (x & SIGNS) != 0;
}

// The rows of one head of a [T, H, D] array: row r starts at p + r * stride, in 64-bit
// arithmetic (T * H * D may exceed 2^31).
template <typename T>
struct HeadRows {
    T* p;               // row 0 of the head
    int64_t stride;     // elements from one row to the next (Strides::row)

    __device__ __forceinline__ T* row(int r) const { return p + static_cast<int64_t>(r) * stride; }
};

// Head `head`'s rows of an array whose rows and heads lie `s` apart.
template <typename T>
__device__ __forceinline__ HeadRows<T> head_rows(T* base, const Strides& s, int head) {
    return HeadRows<T>{base + static_cast<int64_t>(head) * s.head, s.row};
}

// The strides of a packed [T, num_heads, D] array (the backward's fp32 dQ accumulator).
template <int D>
__device__ __forceinline__ Strides packed_strides(int num_heads) {
    return Strides{num_heads * D, D};
}

// This thread's lane and warp in a block whose warps own WARP_M rows of the tile each.
struct WarpSlot {
    int lane;
    int warp;
    int row0;           // the warp's first row of the tile
};

// Divided as unsigned (threadIdx.x is): the compiler then knows lane and warp are small and
// non-negative, which keeps the fragment address arithmetic short.
template <int WARP_M = WARP_ROWS>
__device__ __forceinline__ WarpSlot warp_slot() {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    return WarpSlot{lane, warp, warp * WARP_M};
}

// Reductions over the 4 lanes of a quad (lanes 4g .. 4g+3 hold one row of a C fragment).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return x;
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

}  // namespace varlen
