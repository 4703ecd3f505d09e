// Hopper (sm_90a) primitives: mbarrier, TMA bulk tensor loads, wgmma, setmaxnreg, stmatrix.
// Compiled with NVRTC for sm_90a they are inline PTX; compiled with -DVARLEN_HOST_EMULATION the
// host emulation supplies them (host_emulation_sm90.cuh), checked as docs/hopper.md describes.
//
// Layouts, from the PTX ISA ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//   * A warpgroup is 4 consecutive warps, the first of index divisible by 4: thread t of it
//     (t = threadIdx.x % 128) is lane l = t % 32 of warp w = t / 32; g = l / 4, q = l % 4.
//   * D of m64nNk16 (fp32, N / 2 registers d[i]): row 16 w + g + 8 ((i / 2) % 2),
//     column 8 (i / 4) + 2 q + i % 2.
//   * A of m64nNk16 from registers (16-bit types, 4 x .b32 = 8 halves a0..a7, the lower index
//     in the lower 16 bits): a0, a1 (row 16 w + g, k 2q, 2q+1), a2, a3 (row + 8, same k),
//     a4, a5 (row 16 w + g, k 2q+8, 2q+9), a6, a7 (row + 8, same k): mma.m16n8k16's A per warp.
//   * Shared-memory operands through a 64-bit matrix descriptor: bits 0-13 start address,
//     16-29 leading-dimension byte offset (LBO), 32-45 stride-dimension byte offset (SBO), each
//     (x & 0x3FFFF) >> 4; 49-51 base offset (0 here: tiles start on the swizzle pattern's
//     repeat); 62-63 swizzle (0 none, 1 128B, 2 64B, 3 32B). Element (mn, k) of a tile, S the
//     swizzle width in bytes, 16-bit elements:
//       K-major,  no swizzle: start + 16 (mn % 8) + SBO (mn / 8) + LBO (k / 8) + 2 (k % 8)
//       K-major,  swizzled:   start + S (mn % 8) + SBO (mn / 8) + 2 k
//       MN-major, no swizzle: start + 2 (mn % 8) + SBO (mn / 8) + 16 (k % 8) + LBO (k / 8)
//       MN-major, swizzled:   start + 2 (mn % (S/2)) + LBO (mn / (S/2)) + S (k % 8) + SBO (k / 8)
//     then swizzled: address bits [4, 4 + b) ^= bits [7, 7 + b), b = log2(S / 16). A is K-major
//     unless TRANS_A (M-major); B is K-major unless TRANS_B (N-major). For attention: K in
//     S = Q K^T is B K-major (K stored [keys][d]); V in O = P V is B N-major (V stored [keys][d]).
//   * TMA writes a box densely, innermost dimension first, into shared memory with the same
//     address swizzle; a swizzled box has rows of exactly S bytes. A [mn rows][S bytes] box is
//     the K-major swizzled operand (SBO = 8 S, k16 steps +32 bytes); a [k rows][S bytes] box
//     the MN-major one (SBO = 8 S, k16 steps +16 S bytes, the next S / 2 columns at LBO).
//   docs/hopper.md has the API, these layouts, and what the emulation models.
#pragma once

#include "common.cuh"

namespace varlen {
namespace sm90 {

using u64 = unsigned long long;

// Shared-memory swizzle of TMA boxes and wgmma operands; the values are CUtensorMapSwizzle's.
enum class Swizzle : uint32_t { NONE = 0, B32 = 1, B64 = 2, B128 = 3 };

__host__ __device__ constexpr uint32_t swizzle_bytes(Swizzle s) {
    return s == Swizzle::NONE ? 0u : 16u << static_cast<uint32_t>(s);
}

// The descriptor's 2-bit swizzle field: none 0, 128B 1, 64B 2, 32B 3.
__host__ __device__ constexpr uint32_t desc_swizzle_field(Swizzle s) {
    return (4u - static_cast<uint32_t>(s)) % 4u;
}

// wgmma shared-memory matrix descriptor for a tile at shared address `addr` (base offset 0).
__host__ __device__ constexpr u64 make_smem_desc(uint32_t addr, uint32_t lbo_bytes,
                                                 uint32_t sbo_bytes, Swizzle s) {
    return static_cast<u64>((addr & 0x3FFFFu) >> 4) |
           static_cast<u64>((lbo_bytes & 0x3FFFFu) >> 4) << 16 |
           static_cast<u64>((sbo_bytes & 0x3FFFFu) >> 4) << 32 |
           static_cast<u64>(desc_swizzle_field(s)) << 62;
}

// A descriptor moved by `bytes` (a multiple of 16) along its start address: the next k16 step
// of a K-major swizzled tile is +32 bytes, of an MN-major one +8 rows of S bytes (+ 16 S).
__host__ __device__ constexpr u64 desc_advance(u64 desc, uint32_t bytes) {
    return desc + (bytes >> 4);
}

}  // namespace sm90
}  // namespace varlen

#ifdef VARLEN_HOST_EMULATION
#include "host_emulation_sm90.cuh"
#else

namespace varlen {
namespace sm90 {

// CUtensorMap: 128 opaque bytes made by cuTensorMapEncodeTiled on the host, passed to the
// kernel by value as a `const __grid_constant__ TensorMap` parameter.
struct alignas(64) TensorMap { u64 opaque[16]; };

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u64* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count)
                 : "memory");
}

__device__ __forceinline__ void mbar_inval(u64* bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}

// Adds `bytes` to the phase's expected transaction count, then arrives.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Whether the phase of parity `parity` has completed (the hardware may suspend a while first).
__device__ __forceinline__ bool mbar_try_wait(u64* bar, uint32_t parity) {
    uint32_t done;
    asm volatile("{\n.reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}

// Makes the mbarrier.init of this thread visible to the other threads and to the async proxy
// (TMA); follow it with __syncthreads before anyone else uses the barrier.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads') of `threads` threads (a multiple of 32):
// bar.sync waits until all of them have arrived, bar.arrive counts this thread without waiting
// (one warpgroup signalling another, as in a ping-pong between consumer warpgroups).
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones
// (wgmma operand reads, TMA stores): each writer of an operand (st.shared, stmatrix), after its
// writes and before the barrier that hands them to the warpgroup issuing the wgmma.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- TMA -----------------------------------------------------------------------------
// Loads the box at coordinates (c0 innermost, c1) of `map` into shared memory at `dst`, then
// completes the box's bytes on `bar` (the caller arrive_expect_tx'd them).
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, u64* bar, int c0,
                                            int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4}], [%2];\n"
                 :: "r"(smem_addr(dst)), "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)),
                    "r"(c0), "r"(c1) : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, u64* bar, int c0,
                                            int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5}], [%2];\n"
                 :: "r"(smem_addr(dst)), "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)),
                    "r"(c0), "r"(c1), "r"(c2) : "memory");
}

// Plain bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// ---- wgmma ---------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N of this warpgroup's committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// Keeps the compiler from moving accesses of accumulator registers across an async wgmma.
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[R]) {
    #pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// The same for A fragments in registers (wgmma_rs reads them asynchronously too: they must
// not be overwritten before the wgmma_wait that retires the op).
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(uint32_t (&a)[R][4]) {
    #pragma unroll
    for (int i = 0; i < R; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j]) :: "memory");
    }
}

// Accumulator operand lists and their placeholders: N / 2 floats.
#define VARLEN_WG_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define VARLEN_WG_F16 VARLEN_WG_F8(0), VARLEN_WG_F8(8)
#define VARLEN_WG_F32(i) VARLEN_WG_F8(i), VARLEN_WG_F8(i + 8), VARLEN_WG_F8(i + 16), \
    VARLEN_WG_F8(i + 24)
#define VARLEN_WG_F64 VARLEN_WG_F32(0), VARLEN_WG_F32(32)
#define VARLEN_WG_F128 VARLEN_WG_F32(0), VARLEN_WG_F32(32), VARLEN_WG_F32(64), VARLEN_WG_F32(96)
#define VARLEN_WG_S10(t) "%" #t "0, %" #t "1, %" #t "2, %" #t "3, %" #t "4, %" #t "5, %" #t "6, %" \
    #t "7, %" #t "8, %" #t "9"
#define VARLEN_WG_S0_9 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9"
#define VARLEN_WG_D16 VARLEN_WG_S0_9 ", %10, %11, %12, %13, %14, %15"
#define VARLEN_WG_D32 VARLEN_WG_S0_9 ", " VARLEN_WG_S10(1) ", " VARLEN_WG_S10(2) ", %30, %31"
#define VARLEN_WG_D64 VARLEN_WG_S0_9 ", " VARLEN_WG_S10(1) ", " VARLEN_WG_S10(2) ", " \
    VARLEN_WG_S10(3) ", " VARLEN_WG_S10(4) ", " VARLEN_WG_S10(5) ", %60, %61, %62, %63"
#define VARLEN_WG_D128 VARLEN_WG_S0_9 ", " VARLEN_WG_S10(1) ", " VARLEN_WG_S10(2) ", " \
    VARLEN_WG_S10(3) ", " VARLEN_WG_S10(4) ", " VARLEN_WG_S10(5) ", " VARLEN_WG_S10(6) ", " \
    VARLEN_WG_S10(7) ", " VARLEN_WG_S10(8) ", " VARLEN_WG_S10(9) ", " VARLEN_WG_S10(10) ", " \
    VARLEN_WG_S10(11) ", %120, %121, %122, %123, %124, %125, %126, %127"

// A and B from shared memory: operands after the accumulators are desc_a, desc_b, scale_d,
// trans_a, trans_b (placeholders IA .. IA + 4).
#define VARLEN_WGMMA_SS(SHAPE, TY, DLIST, IA, IB, IS, ITA, ITB, ...)                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " {" DLIST "}, %" IA  \
                 ", %" IB ", p, 1, 1, %" ITA ", %" ITB ";\n}\n"                                \
                 : __VA_ARGS__                                                                 \
                 : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(scale_d)),                  \
                   "n"(TRANS_A ? 1 : 0), "n"(TRANS_B ? 1 : 0))

// A from registers: operands after the accumulators are a0..a3, desc_b, scale_d, trans_b.
#define VARLEN_WGMMA_RS(SHAPE, TY, DLIST, IA, IB, IS, ITB, ...)                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " {" DLIST "}, {%" IA \
                 "}, %" IB ", p, 1, 1, %" ITB ";\n}\n"                                         \
                 : __VA_ARGS__                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),                   \
                   "r"(static_cast<int>(scale_d)), "n"(TRANS_B ? 1 : 0))

// d[64, N] = A[64, 16] B[16, N] + (scale_d ? d : 0), fp32 accumulators, A and B in shared
// memory. Asynchronous: d must not be touched until a wgmma_wait retires its group.
template <typename T, int N, bool TRANS_A, bool TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b,
                                         bool scale_d) {
    static_assert(N == 32 || N == 64 || N == 128 || N == 256,
                  "wgmma m64nNk16: N of 32, 64, 128 or 256");
    constexpr bool BF16 = ElemTraits<T>::IS_BF16;
    if constexpr (N == 32 && BF16) {
        VARLEN_WGMMA_SS("m64n32k16", "bf16", VARLEN_WG_D16, "16", "17", "18", "19", "20",
                        VARLEN_WG_F16);
    } else if constexpr (N == 32) {
        VARLEN_WGMMA_SS("m64n32k16", "f16", VARLEN_WG_D16, "16", "17", "18", "19", "20",
                        VARLEN_WG_F16);
    } else if constexpr (N == 64 && BF16) {
        VARLEN_WGMMA_SS("m64n64k16", "bf16", VARLEN_WG_D32, "32", "33", "34", "35", "36",
                        VARLEN_WG_F32(0));
    } else if constexpr (N == 64) {
        VARLEN_WGMMA_SS("m64n64k16", "f16", VARLEN_WG_D32, "32", "33", "34", "35", "36",
                        VARLEN_WG_F32(0));
    } else if constexpr (N == 128 && BF16) {
        VARLEN_WGMMA_SS("m64n128k16", "bf16", VARLEN_WG_D64, "64", "65", "66", "67", "68",
                        VARLEN_WG_F64);
    } else if constexpr (N == 128) {
        VARLEN_WGMMA_SS("m64n128k16", "f16", VARLEN_WG_D64, "64", "65", "66", "67", "68",
                        VARLEN_WG_F64);
    } else if constexpr (BF16) {
        VARLEN_WGMMA_SS("m64n256k16", "bf16", VARLEN_WG_D128, "128", "129", "130", "131", "132",
                        VARLEN_WG_F128);
    } else {
        VARLEN_WGMMA_SS("m64n256k16", "f16", VARLEN_WG_D128, "128", "129", "130", "131", "132",
                        VARLEN_WG_F128);
    }
}

// As wgmma_ss with A from registers (this thread's fragment, layout at the top).
template <typename T, int N, bool TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], u64 desc_b,
                                         bool scale_d) {
    static_assert(N == 32 || N == 64 || N == 128 || N == 256,
                  "wgmma m64nNk16: N of 32, 64, 128 or 256");
    constexpr bool BF16 = ElemTraits<T>::IS_BF16;
    if constexpr (N == 32 && BF16) {
        VARLEN_WGMMA_RS("m64n32k16", "bf16", VARLEN_WG_D16, "16, %17, %18, %19", "20", "21", "22",
                        VARLEN_WG_F16);
    } else if constexpr (N == 32) {
        VARLEN_WGMMA_RS("m64n32k16", "f16", VARLEN_WG_D16, "16, %17, %18, %19", "20", "21", "22",
                        VARLEN_WG_F16);
    } else if constexpr (N == 64 && BF16) {
        VARLEN_WGMMA_RS("m64n64k16", "bf16", VARLEN_WG_D32, "32, %33, %34, %35", "36", "37", "38",
                        VARLEN_WG_F32(0));
    } else if constexpr (N == 64) {
        VARLEN_WGMMA_RS("m64n64k16", "f16", VARLEN_WG_D32, "32, %33, %34, %35", "36", "37", "38",
                        VARLEN_WG_F32(0));
    } else if constexpr (N == 128 && BF16) {
        VARLEN_WGMMA_RS("m64n128k16", "bf16", VARLEN_WG_D64, "64, %65, %66, %67", "68", "69",
                        "70", VARLEN_WG_F64);
    } else if constexpr (N == 128) {
        VARLEN_WGMMA_RS("m64n128k16", "f16", VARLEN_WG_D64, "64, %65, %66, %67", "68", "69",
                        "70", VARLEN_WG_F64);
    } else if constexpr (BF16) {
        VARLEN_WGMMA_RS("m64n256k16", "bf16", VARLEN_WG_D128, "128, %129, %130, %131", "132",
                        "133", "134", VARLEN_WG_F128);
    } else {
        VARLEN_WGMMA_RS("m64n256k16", "f16", VARLEN_WG_D128, "128, %129, %130, %131", "132",
                        "133", "134", VARLEN_WG_F128);
    }
}

#undef VARLEN_WGMMA_SS
#undef VARLEN_WGMMA_RS

// ---- register reallocation and stmatrix --------------------------------------------------
// Every thread of the warpgroup: raise (INC) or lower this warpgroup's registers per thread to
// REGS (24 .. 256, a multiple of 8).
template <int REGS, bool INC>
__device__ __forceinline__ void setmaxnreg() {
    static_assert(REGS >= 24 && REGS <= 256 && REGS % 8 == 0, "setmaxnreg: 24..256, step 8");
    if constexpr (INC) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS));
    } else {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS));
    }
}

// stmatrix.m8n8.x4(.trans).b16: lanes 8i .. 8i+7 give the row addresses of matrix i; register
// i of lane l holds M_i[l/4][2(l%4)], M_i[l/4][2(l%4)+1] (with .trans: M_i[2(l%4)][l/4],
// M_i[2(l%4)+1][l/4]): ldmatrix run backwards.
__device__ __forceinline__ void stmatrix_x4(void* p_smem, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(smem_addr(p_smem)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

__device__ __forceinline__ void stmatrix_x4_trans(void* p_smem, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(smem_addr(p_smem)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

}  // namespace sm90
}  // namespace varlen

#endif  // VARLEN_HOST_EMULATION

namespace varlen {
namespace sm90 {

// Spins until the phase of parity `parity` of `bar` has completed (phases alternate 0, 1, 0...;
// a consumer waits on parity 0 for the first fill of a stage, then 1, and so on). `name` and
// the call site (file, line, function) name the wait in the message of a build with
// VARLEN_POLL_LIMIT (common.cuh), which traps after that many polls.
__device__ __forceinline__ void mbar_wait(u64* bar, uint32_t parity, const char* name = "mbarrier",
                                          const char* file = __builtin_FILE(),
                                          int line = __builtin_LINE(),
                                          const char* function = __builtin_FUNCTION()) {
    if constexpr (VARLEN_POLL_LIMIT > 0) {
        for (int polls = 1; !mbar_try_wait(bar, parity); ++polls) {
            if (polls == VARLEN_POLL_LIMIT) {
                poll_limit_reached(file, line, function, "mbarrier", name, smem_addr(bar),
                                   parity, false, 0);
            }
        }
    } else {
        while (!mbar_try_wait(bar, parity)) {
        }
    }
}

// Descriptor of a shared-memory tile at p.
__device__ __forceinline__ u64 smem_desc(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                         Swizzle s) {
    return make_smem_desc(smem_addr(p), lbo_bytes, sbo_bytes, s);
}

}  // namespace sm90
}  // namespace varlen
