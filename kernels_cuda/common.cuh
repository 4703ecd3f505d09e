// Shared definitions of the varlen attention kernels: element types, constants, smem layout,
// the rows of one head of a packed array, a thread's warp and lane.
#pragma once

#include "plan_view.cuh"

#ifdef VARLEN_HOST_EMULATION
#include "host_emulation.cuh"
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

// NVRTC compiles without the C library headers: the fixed-width types come from here (the
// host emulation of the kernels takes them from <cstdint>).
#ifndef VARLEN_HOST_EMULATION
using int64_t = long long;
using uint32_t = unsigned int;
#endif
static_assert(sizeof(int64_t) == 8 && sizeof(uint32_t) == 4, "fixed-width integer types");

namespace varlen {

// exp(x) = exp2(x * LOG2E): the softmax runs in base 2 (one ex2.approx per element).
constexpr float LOG2E = 1.4426950408889634f;   // 1/ln(2)
constexpr float LN2 = 0.6931471805599453f;     // ln(2), back to natural-log lse

// -inf marks a masked score and the lse of a row without a visible key (no <math.h> here).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000u); }
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

template <> struct ElemTraits<__half> {
    static constexpr bool IS_BF16 = false;
    __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);     // .x = lo (low 16 bits), .y = hi
        return *reinterpret_cast<uint32_t*>(&h);
    }
    __device__ static __forceinline__ float to_float(__half x) { return __half2float(x); }
    __device__ static __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <> struct ElemTraits<__nv_bfloat16> {
    static constexpr bool IS_BF16 = true;
    __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    __device__ static __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// The rows of one head of a packed [T, H, D] array: row r starts at p + r * stride, in 64-bit
// arithmetic (T * H * D may exceed 2^31).
template <typename T>
struct HeadRows {
    T* p;               // row 0 of the head
    int64_t stride;     // H * D elements

    __device__ __forceinline__ T* row(int r) const { return p + static_cast<int64_t>(r) * stride; }
};

template <int D, typename T>
__device__ __forceinline__ HeadRows<T> head_rows(T* base, int num_heads, int head) {
    return HeadRows<T>{base + static_cast<int64_t>(head) * D, static_cast<int64_t>(num_heads) * D};
}

// This thread's lane and warp in a block whose warps own WARP_ROWS rows of the tile each.
struct WarpSlot {
    int lane;
    int warp;
    int row0;           // the warp's first row of the tile
};

// Divided as unsigned (threadIdx.x is): the compiler then knows lane and warp are small and
// non-negative, which keeps the fragment address arithmetic short.
__device__ __forceinline__ WarpSlot warp_slot() {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    return WarpSlot{lane, warp, warp * WARP_ROWS};
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
