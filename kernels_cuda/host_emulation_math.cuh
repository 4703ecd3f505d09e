// Host emulation, arithmetic: the element types and the arithmetic of the tensor-core and
// special-function instructions the kernels use (included by host_emulation.cuh).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

// ---- element types --------------------------------------------------------------------
struct __half { uint16_t bits; };
struct __nv_bfloat16 { uint16_t bits; };
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };

inline __half __float2half_rn(float f) { _Float16 h = (_Float16)f; __half r; std::memcpy(&r.bits, &h, 2); return r; }
inline float __half2float(__half h) { _Float16 v; std::memcpy(&v, &h.bits, 2); return (float)v; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.bits = 0x7fc0; return r; }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (uint16_t)(u >> 16);
    return r;
}
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }

namespace varlen {

// One element of mma.m16n8k16: c + sum_k a[k] * b[k] over the 16 products of a row of A and a
// column of B (each exact in float32: a product of two 16-bit floats).
inline float mma_dot16(float c, const float (&a)[16], const float (&b)[16]) {
    double acc = c;
    for (int k = 0; k < 16; ++k) acc += (double)a[k] * (double)b[k];
    return (float)acc;
}

}  // namespace varlen

