// Host emulation, arithmetic: the element types and the arithmetic of the tensor-core and
// special-function instructions the kernels use (included by host_emulation.cuh), modelled on
// what the GPU does under NVRTC's --use_fast_math, so that the emulation's tolerance verdict
// predicts the GPU's.
//
// What NVRTC 13 emits for sm_80 and sm_90 under --use_fast_math, and how it is modelled here
// (bounds from the PTX ISA, "Floating Point Instructions"):
//   exp2f(x)  ex2.approx.ftz.f32   2 ulp from the correctly rounded result
//   log2f(x)  lg2.approx.ftz.f32   2^-22 absolute for x in (0.5, 2), else 2^-22 relative
//   tanhf(x)  tanh.approx.f32      2^-11 relative; subnormal inputs pass through
//   a / b     div.approx.ftz.f32   2 ulp for |b| in [2^-126, 2^126]; 0 (NaN for infinite a) above
//   1.f / b   rcp.approx.ftz.f32   1 ulp
//   + - *     .ftz                 subnormal inputs and results are zero
// Each approximate result is the correctly rounded one moved by the full documented bound, up or
// down as a hash of the argument's bits decides: errors as large as the ISA allows, uncorrelated
// between elements as a table-and-polynomial unit's are. Arguments whose result is exact in the
// ISA's corner-case tables or a power of two (ex2 of an integer, lg2 of a power of two, tanh of
// 0) stay exact. VARLEN_EMU_APPROX=0 selects correctly rounded results instead (for comparison).
// exp2f, log2f and tanhf resolve to the models through the macros below; the two divisions
// cannot be reached from here (float `/` has no overload): `__fdividef` is provided for them.
//
// Flush to zero of every float operation: each emulated thread sets the x86 MXCSR FTZ and DAZ
// bits before its first element conversion, mma or special function (`ftz_thread`).
//
// mma.m16n8k16 with float32 accumulation (`mma_dot16`): products of two 16-bit floats are exact;
// a block of VARLEN_EMU_MMA_BLOCK products and the accumulator are aligned to the largest
// exponent among them, each truncated to 24 + VARLEN_EMU_MMA_EXTRA_BITS significant bits below
// that exponent, summed exactly, and the sum truncated (round toward zero) to float32. Blocks of
// 16 (Hopper, the emulated sm_90: one block per instruction) or 8 (Ampere: two chained blocks);
// 3 extra bits. This is the behaviour published from test vectors on V100/A100/H100 (Fasi,
// Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021;
// Khattak, Mikaitis, "Accurate models of NVIDIA tensor cores", arXiv:2512.07004), not an NVIDIA
// specification.
//
// -ftrivial-auto-var-init=pattern: uninitialised automatic variables of every function defined
// after this header (the kernels) hold the 0xFE byte pattern instead of whatever the stack held
// (GCC; clang needs the flag on the command line).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("-ftrivial-auto-var-init=pattern")
#endif

#ifndef VARLEN_EMU_APPROX
#define VARLEN_EMU_APPROX 1
#endif
#ifndef VARLEN_EMU_MMA_BLOCK
#define VARLEN_EMU_MMA_BLOCK 16
#endif
#ifndef VARLEN_EMU_MMA_EXTRA_BITS
#define VARLEN_EMU_MMA_EXTRA_BITS 3
#endif
static_assert(16 % VARLEN_EMU_MMA_BLOCK == 0, "mma blocks split the 16 products of k16");

namespace varlen {
namespace gpu_math {

// ---- flush to zero ----------------------------------------------------------------------
struct FtzThread {
    FtzThread() {
#if defined(__x86_64__) || defined(__i386__)
        _mm_setcsr(_mm_getcsr() | 0x8040u);     // FTZ (bit 15) | DAZ (bit 6)
#endif
    }
};
inline thread_local FtzThread t_ftz;
// Called by every entry point below: the first call in a thread sets its flush-to-zero mode.
inline void ftz_thread() { (void)&t_ftz; }

inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline bool is_subnormal(float x) { return (bits_of(x) & 0x7f800000u) == 0 && (bits_of(x) << 1); }
inline float flush(float x) { return is_subnormal(x) ? float_of(bits_of(x) & 0x80000000u) : x; }

// x as a double, exact for subnormal x too (bit arithmetic: DAZ would zero a converted one).
inline double exact_double(float x) {
    const uint32_t u = bits_of(x);
    if ((u & 0x7f800000u) != 0) return static_cast<double>(x);
    const double mag = static_cast<double>(u & 0x7fffffu) * 0x1p-149;
    return (u >> 31) ? -mag : mag;
}

// x rounded toward zero to float (bit arithmetic: exact for subnormal results, whatever MXCSR
// holds). Overflow gives +-inf, as the tensor cores' float32 output does.
inline float to_float_rz(double x) {
    uint64_t u; std::memcpy(&u, &x, 8);
    const uint32_t sign = static_cast<uint32_t>(u >> 63) << 31;
    const int e = static_cast<int>((u >> 52) & 0x7ff) - 1023;
    if (e == 1024) return float_of(sign | 0x7f800000u | (((u << 12) != 0) ? 0x400000u : 0u));
    if (e > 127) return float_of(sign | 0x7f800000u);
    if (e < -150) return float_of(sign);
    const uint64_t sig = (u & 0xfffffffffffffull) | (1ull << 52);       // 53 bits, x = sig 2^(e-52)
    if (e >= -126) {
        const uint32_t mant = static_cast<uint32_t>((sig >> 29) & 0x7fffffu);
        return float_of(sign | (static_cast<uint32_t>(e + 127) << 23) | mant);
    }
    return float_of(sign | static_cast<uint32_t>(sig >> (29 + (-126 - e))));  // subnormal
}

// A well-mixed hash of an argument's bits: its lowest bit picks the direction of the error.
inline uint32_t mix(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}
inline bool goes_up(uint32_t key) { return mix(key) & 1u; }

// r moved by n float steps, away from zero or toward it (a finite nonzero r; never across 0).
inline float step_ulps(float r, int n, bool up) {
    if (r == 0.f || !std::isfinite(r)) return r;
    const bool away = up == (r > 0.f);
    uint32_t u = bits_of(r);
    for (int i = 0; i < n; ++i) {
        if (away && (u & 0x7fffffffu) < 0x7f7fffffu) ++u;
        else if (!away && (u & 0x7fffffffu) > 1u) --u;
    }
    return float_of(u);
}

// The float farthest from `exact` in the direction `up` that is within `bound` of it.
inline float at_bound(double exact, double bound, bool up) {
    float f = static_cast<float>(exact + (up ? bound : -bound));
    while (std::fabs(static_cast<double>(f) - exact) > bound) {
        f = std::nextafter(f, static_cast<float>(exact));
    }
    return f;
}

// ---- special-function units --------------------------------------------------------------

// ex2.approx.ftz.f32
inline float ex2_approx_ftz(float x) {
    ftz_thread();
    x = flush(x);
    if (std::isnan(x)) return x;
    if (x == 0.f) return 1.f;
    const float r = flush(static_cast<float>(std::exp2(static_cast<double>(x))));
    if (!VARLEN_EMU_APPROX || x == std::trunc(x)) return r;    // powers of two are exact
    return flush(step_ulps(r, 2, goes_up(bits_of(x))));
}

// lg2.approx.ftz.f32
inline float lg2_approx_ftz(float x) {
    ftz_thread();
    x = flush(x);
    if (std::isnan(x) || x < 0.f) return std::nanf("");
    if (x == 0.f) return -INFINITY;
    if (std::isinf(x)) return x;
    const double exact = std::log2(static_cast<double>(x));
    if (!VARLEN_EMU_APPROX || exact == std::trunc(exact)) return static_cast<float>(exact);
    const double bound = (x > 0.5f && x < 2.f) ? 0x1p-22 : 0x1p-22 * std::fabs(exact);
    return at_bound(exact, bound, goes_up(bits_of(x)));
}

// tanh.approx.f32 (no .ftz: subnormal inputs pass through)
inline float tanh_approx(float x) {
    ftz_thread();
    if (std::isnan(x) || x == 0.f || is_subnormal(x)) return x;
    if (std::isinf(x)) return x > 0.f ? 1.f : -1.f;
    const double exact = std::tanh(exact_double(x));
    if (!VARLEN_EMU_APPROX) return static_cast<float>(exact);
    const float r = at_bound(exact, 0x1p-11 * std::fabs(exact), goes_up(bits_of(x)));
    return std::fmin(std::fmax(r, -1.f), 1.f);
}

// rcp.approx.ftz.f32
inline float rcp_approx_ftz(float b) {
    ftz_thread();
    b = flush(b);
    if (std::isnan(b)) return b;
    if (b == 0.f) return std::copysign(INFINITY, b);
    const float r = flush(static_cast<float>(1.0 / static_cast<double>(b)));
    const bool exact = (bits_of(b) & 0x7fffffu) == 0;                // 1 / 2^k
    if (!VARLEN_EMU_APPROX || exact) return r;
    return flush(step_ulps(r, 1, goes_up(bits_of(b))));
}

// div.approx.ftz.f32 (computed by the GPU as a * (1 / b))
inline float div_approx_ftz(float a, float b) {
    ftz_thread();
    a = flush(a);
    b = flush(b);
    if (std::isnan(a) || std::isnan(b)) return std::nanf("");
    if (std::fabs(b) > 0x1p126f && std::isfinite(b)) {
        return std::isinf(a) ? std::nanf("") : std::copysign(0.f, a) * std::copysign(1.f, b);
    }
    const float r = flush(static_cast<float>(static_cast<double>(a) / static_cast<double>(b)));
    if (!VARLEN_EMU_APPROX) return r;
    return flush(step_ulps(r, 2, goes_up(bits_of(a) * 0x9e3779b9u ^ bits_of(b))));
}

// ---- tensor cores ------------------------------------------------------------------------

// One fused block of the tensor core: c + sum of the n exact products p[0..n), aligned to the
// largest exponent, truncated to 24 + EXTRA bits below it, summed exactly, truncated to float.
inline float mma_block(float c, const double* p, int n) {
    double naive = exact_double(c);
    double big = std::fabs(naive);
    for (int k = 0; k < n; ++k) { naive += p[k]; big = std::fmax(big, std::fabs(p[k])); }
    if (!std::isfinite(naive) || big == 0.0) return to_float_rz(naive);   // NaN, inf, zeros
    if (std::isinf(big)) return to_float_rz(naive);
    // ulp of the aligned sum: 2^(e_max - 23 - EXTRA), e_max the exponent of the largest term.
    const double ulp = std::ldexp(1.0, std::ilogb(big) - 23 - VARLEN_EMU_MMA_EXTRA_BITS);
    double sum = std::trunc(exact_double(c) / ulp) * ulp;
    for (int k = 0; k < n; ++k) sum += std::trunc(p[k] / ulp) * ulp;   // exact: < 2^33 ulps
    return to_float_rz(sum);
}

}  // namespace gpu_math

// One element of mma.m16n8k16 with float32 accumulation: c + sum_k a[k] * b[k] over the 16
// products of a row of A and a column of B (each exact: a product of two 16-bit floats), by the
// tensor-core model above.
inline float mma_dot16(float c, const float (&a)[16], const float (&b)[16]) {
    gpu_math::ftz_thread();
    double p[16];
    for (int k = 0; k < 16; ++k) p[k] = gpu_math::exact_double(a[k]) * gpu_math::exact_double(b[k]);
    for (int k0 = 0; k0 < 16; k0 += VARLEN_EMU_MMA_BLOCK) {
        c = gpu_math::mma_block(c, p + k0, VARLEN_EMU_MMA_BLOCK);
    }
    return c;
}

}  // namespace varlen

// The special functions as the kernels name them (fast-math PTX, see above). Macros, so that a
// call anywhere after this header, in any namespace, reaches the model.
#define exp2f(x) ::varlen::gpu_math::ex2_approx_ftz(x)
#define log2f(x) ::varlen::gpu_math::lg2_approx_ftz(x)
#define tanhf(x) ::varlen::gpu_math::tanh_approx(x)
inline float __fdividef(float a, float b) { return ::varlen::gpu_math::div_approx_ftz(a, b); }

// ---- element types --------------------------------------------------------------------
struct __half { uint16_t bits; };
struct __nv_bfloat16 { uint16_t bits; };
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };

inline __half __float2half_rn(float f) {
    ::varlen::gpu_math::ftz_thread();
    _Float16 h = (_Float16)f; __half r; std::memcpy(&r.bits, &h, 2); return r;
}
inline float __half2float(__half h) {
    ::varlen::gpu_math::ftz_thread();
    _Float16 v; std::memcpy(&v, &h.bits, 2); return (float)v;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    ::varlen::gpu_math::ftz_thread();
    uint32_t u; std::memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.bits = 0x7fc0; return r; }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (uint16_t)(u >> 16);
    return r;
}
inline float __bfloat162float(__nv_bfloat16 b) {
    ::varlen::gpu_math::ftz_thread();
    uint32_t u = (uint32_t)b.bits << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
