// Host emulation of the CUDA features the varlen kernels use, so their index arithmetic,
// schedule walking, masking and softmax can be executed and tested on a CPU
// (varlen/backends/_cupy_emulation.py compiles them with g++ -DVARLEN_HOST_EMULATION).
//
// One OS thread per CUDA thread, blocks one after the other, __syncthreads as a barrier.
// Warp-collective PTX primitives (ldmatrix, mma.sync, shuffles) exchange operands through a
// per-warp slot array between two warp barriers, and follow the fragment ownership of the
// PTX ISA spelled out in mma.cuh: an independent statement of the same layouts, so an index
// error in a kernel shows up as a wrong result. cp.async copies are deferred: they land only
// when a cp.async.wait_group retires their committed group (the latest moment the PTX ISA
// allows), so reading a stage before waiting for it reads the NaN bytes shared memory starts
// with each block. Row addresses of ldmatrix and both addresses of cp.async are checked for
// 16-byte alignment (misaligned ones abort). Not a GPU: it checks logic, not timing, races
// between warps (a copy landing early into a buffer still being read) or register budgets.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <algorithm>
#include <thread>
#include <vector>
#include <functional>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

using std::min;
using std::max;

struct dim3e { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3e threadIdx, blockIdx;
inline dim3e gridDim;

struct alignas(16) uint4 { unsigned x, y, z, w; };

inline float __int_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }

#include "host_emulation_math.cuh"

// ---- block and warp synchronisation ---------------------------------------------------
struct WarpX {
    std::barrier<> bar{32};
    const void* ptr[32];
    uint32_t a[32][4];
    uint32_t b[32][2];
    float c[32][4];
    float f[32];
};
inline std::barrier<>* g_block_bar = nullptr;
inline WarpX* g_warps = nullptr;

inline WarpX& my_warp() { return g_warps[threadIdx.x / 32]; }
inline int my_lane() { return threadIdx.x % 32; }

inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __syncwarp() { my_warp().bar.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float x, int m) {
    WarpX& w = my_warp(); int l = my_lane();
    w.f[l] = x; w.bar.arrive_and_wait();
    float r = w.f[l ^ m]; w.bar.arrive_and_wait();
    return r;
}

inline float atomicAdd(float* p, float v) {
    std::atomic_ref<float> ref(*p);
    return ref.fetch_add(v);
}

// ---- PTX primitives, emulated from the PTX ISA description ---------------------------
namespace varlen {

inline uint16_t ld16(const void* p, int elem) { uint16_t v; std::memcpy(&v, (const char*)p + 2 * elem, 2); return v; }

// ldmatrix row addresses and cp.async 16-byte copies must be 16-byte aligned on the GPU.
inline void check_aligned16(const void* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
        std::fprintf(stderr, "host emulation: %s address %p is not 16-byte aligned\n", what, p);
        std::abort();
    }
}

// ldmatrix.m8n8.x4: lanes 8i..8i+7 address the rows of matrix i; lane l gets, in register
// i, M_i[l/4][2(l%4)] (low 16 bits) and M_i[l/4][2(l%4)+1] (high 16 bits).
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    WarpX& w = my_warp(); int l = my_lane();
    check_aligned16(p, "ldmatrix row");
    w.ptr[l] = p; w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        const void* row = w.ptr[8 * i + l / 4];
        r[i] = ld16(row, 2 * (l % 4)) | ((uint32_t)ld16(row, 2 * (l % 4) + 1) << 16);
    }
    w.bar.arrive_and_wait();
}

// .trans: lane l gets M_i[2(l%4)][l/4] (low) and M_i[2(l%4)+1][l/4] (high).
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    WarpX& w = my_warp(); int l = my_lane();
    check_aligned16(p, "ldmatrix.trans row");
    w.ptr[l] = p; w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        const void* r0 = w.ptr[8 * i + 2 * (l % 4)];
        const void* r1 = w.ptr[8 * i + 2 * (l % 4) + 1];
        r[i] = ld16(r0, l / 4) | ((uint32_t)ld16(r1, l / 4) << 16);
    }
    w.bar.arrive_and_wait();
}

template <typename T> float to_f(uint16_t bits);
template <> inline float to_f<__half>(uint16_t bits) { return __half2float(__half{bits}); }
template <> inline float to_f<__nv_bfloat16>(uint16_t bits) { return __bfloat162float(__nv_bfloat16{bits}); }

// mma.m16n8k16, fragment ownership from the PTX ISA:
//   A[r][k]: lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2
//   B[k][n]: lane 4 n + (k % 8) / 2, register (k >= 8), half k % 2
//   C[r][n]: lane 4 (r % 8) + (n % 8) / 2, element 2 (r >= 8) + n % 2
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    WarpX& w = my_warp(); int l = my_lane();
    for (int i = 0; i < 4; ++i) { w.a[l][i] = a[i]; w.c[l][i] = d[i]; }
    w.b[l][0] = b0; w.b[l][1] = b1;
    w.bar.arrive_and_wait();
    auto A = [&](int r, int k) {
        uint32_t reg = w.a[4 * (r % 8) + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)];
        return to_f<T>((uint16_t)(k % 2 ? reg >> 16 : reg & 0xffff));
    };
    auto B = [&](int k, int n) {
        uint32_t reg = w.b[4 * n + (k % 8) / 2][k >= 8];
        return to_f<T>((uint16_t)(k % 2 ? reg >> 16 : reg & 0xffff));
    };
    const int g = l / 4, t = l % 4;
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int r = g + 8 * (e >= 2), n = 2 * t + (e % 2);
        float a_row[16], b_col[16];
        for (int k = 0; k < 16; ++k) { a_row[k] = A(r, k); b_col[k] = B(k, n); }
        out[e] = mma_dot16(w.c[l][e], a_row, b_col);
    }
    w.bar.arrive_and_wait();
    for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// cp.async: this thread's copies since its last commit, and its committed groups, oldest
// first. A copy lands (global read, shared write) when wait_group retires its group.
struct AsyncCopy { void* dst; const void* src; bool valid; };
inline thread_local std::vector<AsyncCopy> t_open_group;
inline thread_local std::deque<std::vector<AsyncCopy>> t_committed;

inline void cp_async_16(void* dst, const void* src, bool valid) {
    check_aligned16(dst, "cp.async shared");
    check_aligned16(src, "cp.async global");
    t_open_group.push_back(AsyncCopy{dst, src, valid});
}
inline void cp_async_commit() {
    t_committed.push_back(std::move(t_open_group));
    t_open_group.clear();
}
template <int N> inline void cp_async_wait() {
    while (t_committed.size() > static_cast<size_t>(N)) {
        for (const AsyncCopy& c : t_committed.front()) {
            if (c.valid) std::memcpy(c.dst, c.src, 16); else std::memset(c.dst, 0, 16);
        }
        t_committed.pop_front();
    }
}

}  // namespace varlen

// ---- launching -----------------------------------------------------------------------
alignas(16) inline unsigned char smem_raw[256 * 1024];

template <typename F>
void launch(unsigned gx, unsigned gy, unsigned threads, F&& body) {
    gridDim = dim3e{gx, gy, 1};
    for (unsigned by = 0; by < gy; ++by) {
        for (unsigned bx = 0; bx < gx; ++bx) {
            std::memset(smem_raw, 0xff, sizeof(smem_raw));    // garbage (NaN) shared memory
            std::barrier<> bar((std::ptrdiff_t)threads);
            std::vector<WarpX> warps(threads / 32);
            g_block_bar = &bar;
            g_warps = warps.data();
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < threads; ++t) {
                ts.emplace_back([&, t, bx, by] {
                    threadIdx = dim3e{t, 0, 0};
                    blockIdx = dim3e{bx, by, 0};
                    body();
                });
            }
            for (auto& th : ts) th.join();
        }
    }
}
