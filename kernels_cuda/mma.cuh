// Tensor-core and async-copy helpers: mma.sync m16n8k16, ldmatrix, cp.async (sm_80+).
//
// Fragment layouts, from the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point
// type" and "Warp-level matrix load instruction: ldmatrix"). In a warp, lane l has
// g = l / 4 (groupID) and t = l % 4 (threadID_in_group).
//
//   A (16x16, row-major, 4 x .b32 = 8 halves a0..a7): register r holds two consecutive columns
//       reg0: (row g,     cols 2t, 2t+1)      reg1: (row g + 8, cols 2t, 2t+1)
//       reg2: (row g,     cols 2t+8, 2t+9)    reg3: (row g + 8, cols 2t+8, 2t+9)
//   B (16x8, K x N, ".col": 2 x .b32 = 4 halves b0..b3): register r holds two consecutive k
//       reg0: (k 2t, 2t+1;   col n = g)       reg1: (k 2t+8, 2t+9; col n = g)
//   C/D (16x8, fp32, 4 floats c0..c3):
//       c0, c1: (row g,     cols 2t, 2t+1)    c2, c3: (row g + 8, cols 2t, 2t+1)
//   In each .b32 register the element with the lower index sits in the lower 16 bits.
//
//   ldmatrix.m8n8.x4.b16: lanes 8i .. 8i+7 give the row addresses (16 contiguous bytes each)
//   of matrix i (i = 0..3); destination register i of lane l receives from matrix i
//       without .trans: M[l/4][2(l%4)], M[l/4][2(l%4)+1]       = (row g, cols 2t, 2t+1)
//       with    .trans: M[2(l%4)][l/4], M[2(l%4)+1][l/4]       = (rows 2t, 2t+1, col g)
//
// Consequences used by every kernel (docs/cupy_backend.md draws them):
//   * A tile stored row-major [rows][k] -> ldmatrix.x4 without .trans, matrix order
//     (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) gives
//     reg0..reg3 of A: lane l addresses row (l % 8) + 8 ((l / 8) % 2), column 8 (l / 16).
//   * B[k][n] = X[n][k] with X stored row-major [n][k] (K in Q K^T) -> ldmatrix without .trans:
//     matrix (n 0-7, k 0-7) is reg0, (n 0-7, k 8-15) reg1; x4 covers two n-blocks:
//     lane l addresses row n0 + 8 (l / 16) + (l % 8), column k0 + 8 ((l / 8) % 2).
//   * B[k][n] = X[k][n] with X stored row-major [k][n] (V in P V) -> ldmatrix .trans:
//     matrix (k 0-7, n 0-7) is reg0, (k 8-15, n 0-7) reg1; x4 covers two n-blocks:
//     lane l addresses row k0 + (l % 8) + 8 ((l / 8) % 2), column n0 + 8 (l / 16).
//   * A C fragment pair (n-blocks 2j, 2j+1 of a [16, N] fp32 tile) is the A fragment of
//     k-step j once packed: reg0 = C[2j](c0,c1), reg1 = C[2j](c2,c3), reg2 = C[2j+1](c0,c1),
//     reg3 = C[2j+1](c2,c3) (FlashAttention-2 keeps P in registers this way).
#pragma once

#include "common.cuh"

namespace varlen {

// The PTX primitives. A host emulation of the kernels (used to test their index arithmetic
// on a CPU) defines VARLEN_HOST_EMULATION and supplies its own versions of these six.
#ifndef VARLEN_HOST_EMULATION
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p_smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p_smem)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p_smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p_smem)));
}

// D = A B + D, fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
    if constexpr (ElemTraits<T>::IS_BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// 16-byte global -> shared copy; when `valid` is false nothing is read and the 16 bytes are
// zero-filled (src-size 0), so rows past a tile's end hold zeros, never garbage or NaN.
__device__ __forceinline__ void cp_async_16(void* p_smem, const void* p_global, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_u32(p_smem)), "l"(p_global), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

#endif  // VARLEN_HOST_EMULATION

// Row stride, in elements, of a padded shared-memory tile with D columns.
template <int D>
__host__ __device__ constexpr int smem_stride() { return D + SMEM_PAD; }

// Asynchronously copies rows [0, ROWS) x columns [0, D) of a strided global tile into a padded
// shared tile [ROWS][D + SMEM_PAD]; rows >= valid_rows are zero-filled. `p_src` points at row 0
// (which is always valid when valid_rows > 0, and is the only address used otherwise).
template <int ROWS, int D, int NUM_THREADS, typename T>
__device__ __forceinline__ void load_tile_async(T* s_dst, const T* p_src, int64_t row_stride,
                                                int valid_rows) {
    static_assert(D % CHUNK_ELEMS == 0, "rows are copied in 16-byte chunks");
    constexpr int CHUNKS_PER_ROW = D / CHUNK_ELEMS;
    constexpr int STRIDE = smem_stride<D>();
    constexpr int TOTAL = ROWS * CHUNKS_PER_ROW;
    #pragma unroll
    for (int i = 0; i < (TOTAL + NUM_THREADS - 1) / NUM_THREADS; ++i) {
        const int c = threadIdx.x + i * NUM_THREADS;
        if (TOTAL % NUM_THREADS != 0 && c >= TOTAL) break;
        const int r = c / CHUNKS_PER_ROW;
        const int col = (c % CHUNKS_PER_ROW) * CHUNK_ELEMS;
        const bool valid = r < valid_rows;
        const T* p = p_src + (valid ? static_cast<int64_t>(r) * row_stride + col : 0);
        cp_async_16(s_dst + r * STRIDE + col, p, valid);
    }
}

// A fragment (16 rows x 16 k) of a row-major shared tile: rows row0.., columns k0..
template <int STRIDE, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* s_tile, int row0, int k0,
                                       int lane) {
    const int r = row0 + (lane % 8) + 8 * ((lane / 8) % 2);
    const int c = k0 + 8 * (lane / 16);
    ldmatrix_x4(a, s_tile + r * STRIDE + c);
}

// A fragment of the transpose of a row-major shared tile X[k][m]: A[m][k] = X[k][m] for
// m in m0..m0+15, k in k0..k0+15. Matrix order: (m 0-7, k 0-7) is stored at rows k 0-7,
// columns m 0-7; (m 8-15, k 0-7) at rows k 0-7, columns m 8-15; (m 0-7, k 8-15) at rows
// k 8-15, columns m 0-7; (m 8-15, k 8-15) at rows k 8-15, columns m 8-15. With .trans lane l
// receives X[k0 + 2t, 2t+1][m0 + g] = A[g][2t, 2t+1] in register 0, as A's reg0 requires.
template <int STRIDE, typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* s_tile, int m0, int k0,
                                             int lane) {
    const int i = lane / 8;
    const int r = k0 + (lane % 8) + 8 * (i / 2);
    const int c = m0 + 8 * (i % 2);
    ldmatrix_x4_trans(a, s_tile + r * STRIDE + c);
}

// B fragments of two n-blocks (n0..n0+7 -> b[0], b[1]; n0+8..n0+15 -> b[2], b[3]) for
// B[k][n] = X[n][k], X row-major [n][k] in shared memory (K in Q K^T).
template <int STRIDE, typename T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* s_tile, int n0, int k0,
                                          int lane) {
    const int r = n0 + 8 * (lane / 16) + (lane % 8);
    const int c = k0 + 8 * ((lane / 8) % 2);
    ldmatrix_x4(b, s_tile + r * STRIDE + c);
}

// B fragments of two n-blocks for B[k][n] = X[k][n], X row-major [k][n] (V in P V).
template <int STRIDE, typename T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* s_tile, int k0, int n0,
                                          int lane) {
    const int r = k0 + (lane % 8) + 8 * ((lane / 8) % 2);
    const int c = n0 + 8 * (lane / 16);
    ldmatrix_x4_trans(b, s_tile + r * STRIDE + c);
}

// The A fragment of k-step j from a [16, N] fp32 C-fragment tile (register reuse, see top).
template <typename T, int NB>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[NB][4], int j) {
    a[0] = ElemTraits<T>::pack(c[2 * j][0], c[2 * j][1]);
    a[1] = ElemTraits<T>::pack(c[2 * j][2], c[2 * j][3]);
    a[2] = ElemTraits<T>::pack(c[2 * j + 1][0], c[2 * j + 1][1]);
    a[3] = ElemTraits<T>::pack(c[2 * j + 1][2], c[2 * j + 1][3]);
}

// acc[16, 8 NB] += A_tile[16, 16 KSTEPS] (rows row0.. of s_a) x X^T, X = s_b [8 NB][16 KSTEPS]
// row-major: the Q K^T product of a warp's 16 rows with a whole key tile.
template <typename T, int NB, int KSTEPS, int STRIDE_A, int STRIDE_B>
__device__ __forceinline__ void gemm_a_bt(float (&acc)[NB][4], const T* s_a, int row0,
                                          const T* s_b, int lane) {
    static_assert(NB % 2 == 0, "B fragments are loaded two n-blocks at a time");
    #pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[4];
        load_a<STRIDE_A>(a, s_a, row0, kk * 16, lane);
        #pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            uint32_t b[4];
            load_b_nk<STRIDE_B>(b, s_b, nb * 8, kk * 16, lane);
            mma_16816<T>(acc[nb], a, b[0], b[1]);
            mma_16816<T>(acc[nb + 1], a, b[2], b[3]);
        }
    }
}

// acc[16, 8 NB] += P[16, 16 KSTEPS] (C fragments in registers) x X, X = s_b [16 KSTEPS][8 NB]
// row-major: the P V product (and dS K, P^T dO, dS^T Q in the backward pass).
template <typename T, int NB, int KSTEPS, int NP, int STRIDE_B>
__device__ __forceinline__ void gemm_p_b(float (&acc)[NB][4], const float (&p)[NP][4],
                                         const T* s_b, int lane) {
    static_assert(NP == 2 * KSTEPS, "P holds two n-blocks of 8 per k-step of 16");
    static_assert(NB % 2 == 0, "B fragments are loaded two n-blocks at a time");
    #pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[4];
        c_to_a<T>(a, p, kk);
        #pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            uint32_t b[4];
            load_b_kn<STRIDE_B>(b, s_b, kk * 16, nb * 8, lane);
            mma_16816<T>(acc[nb], a, b[0], b[1]);
            mma_16816<T>(acc[nb + 1], a, b[2], b[3]);
        }
    }
}

template <int NB>
__device__ __forceinline__ void zero_acc(float (&acc)[NB][4]) {
    #pragma unroll
    for (int i = 0; i < NB; ++i) {
        acc[i][0] = 0.f; acc[i][1] = 0.f; acc[i][2] = 0.f; acc[i][3] = 0.f;
    }
}

// Writes a warp's [16, 8 NB] fp32 tile, scaled per row (row_scale[0] for row g, [1] for g + 8),
// into its rows of a padded shared tile as T, then copies rows < valid_rows to global memory
// in 16-byte stores. Only this warp touches these shared rows; the caller guarantees nobody
// else reads them any more.
template <typename T, int NB, int STRIDE>
__device__ __forceinline__ void store_rows(const float (&acc)[NB][4], const float (&row_scale)[2],
                                           T* s_stage, int row0, T* p_dst, int64_t row_stride,
                                           int valid_rows, int lane) {
    const int g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const int c = nb * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(s_stage + (row0 + g) * STRIDE + c) =
            ElemTraits<T>::pack(acc[nb][0] * row_scale[0], acc[nb][1] * row_scale[0]);
        *reinterpret_cast<uint32_t*>(s_stage + (row0 + g + 8) * STRIDE + c) =
            ElemTraits<T>::pack(acc[nb][2] * row_scale[1], acc[nb][3] * row_scale[1]);
    }
    __syncwarp();
    constexpr int D = NB * 8;
    constexpr int CHUNKS_PER_ROW = D / CHUNK_ELEMS;
    static_assert((WARP_ROWS * CHUNKS_PER_ROW) % WARP_SIZE == 0, "whole 16-byte chunks per lane");
    #pragma unroll
    for (int i = 0; i < WARP_ROWS * CHUNKS_PER_ROW / WARP_SIZE; ++i) {
        const int c = lane + i * WARP_SIZE;
        const int r = c / CHUNKS_PER_ROW;
        const int col = (c % CHUNKS_PER_ROW) * CHUNK_ELEMS;
        if (row0 + r < valid_rows) {
            *reinterpret_cast<uint4*>(p_dst + static_cast<int64_t>(row0 + r) * row_stride + col) =
                *reinterpret_cast<const uint4*>(s_stage + (row0 + r) * STRIDE + col);
        }
    }
}

}  // namespace varlen
