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
// Consequences used by every kernel (docs/cupy_backend.md draws them). Every x4 load reads a
// 16 x 16 block in one of two matrix orders, rows first or columns first (ldmatrix_block):
//   * A tile stored row-major [rows][k] -> ldmatrix.x4 without .trans, rows first: matrices
//     (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) are
//     reg0..reg3 of A: lane l addresses row (l % 8) + 8 ((l / 8) % 2), column 8 (l / 16).
//   * B[k][n] = X[n][k] with X stored row-major [n][k] (K in Q K^T) -> ldmatrix without .trans,
//     columns first: matrix (n 0-7, k 0-7) is reg0, (n 0-7, k 8-15) reg1, and the next two the
//     next n-block: lane l addresses row n0 + 8 (l / 16) + (l % 8), column k0 + 8 ((l / 8) % 2).
//   * B[k][n] = X[k][n] with X stored row-major [k][n] (V in P V) -> ldmatrix .trans, rows
//     first: matrix (k 0-7, n 0-7) is reg0, (k 8-15, n 0-7) reg1, and the next two the next
//     n-block: lane l addresses row k0 + (l % 8) + 8 ((l / 8) % 2), column n0 + 8 (l / 16).
//   * A = X^T with X stored row-major [k][m] (dS from dS^T) -> ldmatrix .trans, columns first.
//   * A C fragment pair (n-blocks 2j, 2j+1 of a [16, N] fp32 tile) is the A fragment of
//     k-step j once packed: reg0 = C[2j](c0,c1), reg1 = C[2j](c2,c3), reg2 = C[2j+1](c0,c1),
//     reg3 = C[2j+1](c2,c3) (FlashAttention-2 keeps P in registers this way).
#pragma once

#include "common.cuh"

namespace varlen {

// The PTX primitives. A host emulation of the kernels (used to test their index arithmetic
// on a CPU) defines VARLEN_HOST_EMULATION and supplies its own versions of these seven.
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

// 4-byte global -> shared copy (cp.async.cg moves only 16; .ca any of 4, 8, 16); when `valid`
// is false nothing is read and the word is zero-filled.
__device__ __forceinline__ void cp_async_4(void* p_smem, const void* p_global, bool valid) {
    const int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
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

// Calls f(r, col) for this thread's 16-byte chunks (row r, columns col .. col + 7) of a
// [ROWS][D] tile, in increasing r: chunk c = threadIdx.x + i * NUM_THREADS of the tile's rows.
template <int ROWS, int D, int NUM_THREADS, typename F>
__device__ __forceinline__ void for_each_own_chunk(F&& f) {
    static_assert(D % CHUNK_ELEMS == 0, "rows are copied in 16-byte chunks");
    constexpr int CHUNKS_PER_ROW = D / CHUNK_ELEMS;
    constexpr int TOTAL = ROWS * CHUNKS_PER_ROW;
    #pragma unroll
    for (int i = 0; i < (TOTAL + NUM_THREADS - 1) / NUM_THREADS; ++i) {
        const int c = threadIdx.x + i * NUM_THREADS;
        if (TOTAL % NUM_THREADS != 0 && c >= TOTAL) break;
        f(c / CHUNKS_PER_ROW, (c % CHUNKS_PER_ROW) * CHUNK_ELEMS);
    }
}

// Asynchronously copies rows [row, row + ROWS) x columns [0, COLS) of one head of a packed
// array into a padded shared tile [ROWS][D + SMEM_PAD] (COLS < D: V and dO of head_dim_v
// columns in tiles of Q's and K's row width); rows >= valid_rows are zero-filled, so no
// value of a row outside the tile (another sequence, a padding gap) ever enters shared memory.
// Only row `row` is addressed for them (it is valid whenever valid_rows > 0). Each chunk's
// address is its row's, row + r (< 2^31 for a valid row), times the stride: no 64-bit row
// pointer is held across the chunks (held, it spilled in the forward at D = 192 once the
// strides came from the params).
template <int ROWS, int D, int NUM_THREADS, int COLS = D, typename T>
__device__ __forceinline__ void load_tile_async(T* s_dst, const HeadRows<const T>& src, int row,
                                                int valid_rows) {
    static_assert(COLS <= D, "a row of COLS columns in a tile of D");
    constexpr int STRIDE = smem_stride<D>();
    for_each_own_chunk<ROWS, COLS, NUM_THREADS>([&](int r, int col) {
        const bool valid = r < valid_rows;
        const T* p = src.row(valid ? row + r : row) + (valid ? col : 0);
        cp_async_16(s_dst + r * STRIDE + col, p, valid);
    });
}

// Zeroes this thread's chunks of a tile loaded by load_tile_async (with the same ROWS, D,
// NUM_THREADS, COLS) that hold a NaN or inf, and calls flag(r, col) for each. Call it after this
// thread's cp.async.wait for the tile: its own copies have landed for it, and no other thread
// touches them before the next barrier. It keeps a non-finite value of a row out of the
// products in which that row has a zero coefficient (the masked pairs of P V, dS K, P^T dO,
// dS^T Q, where 0 x NaN would be NaN); `flag` hands the value on to an operand that only meets
// the row's pairs one by one, where the mask selects.
template <int ROWS, int D, int NUM_THREADS, int COLS = D, typename T, typename Flag>
__device__ __forceinline__ void zero_nonfinite_chunks(T* s_tile, int valid_rows, Flag&& flag) {
    constexpr int STRIDE = smem_stride<D>();
    for_each_own_chunk<ROWS, COLS, NUM_THREADS>([&](int r, int col) {
        if (r >= valid_rows) return;                   // zero-filled
        uint4* p = reinterpret_cast<uint4*>(s_tile + r * STRIDE + col);
        if (any_nonfinite<T>(*p)) {
            *p = uint4{0u, 0u, 0u, 0u};
            flag(r, col);
        }
    });
}

// The two orders of the four 8 x 8 matrices of an x4 load of a 16 x 16 block (see top).
enum class X4 {
    ROWS_FIRST,    // (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), ...
    COLS_FIRST,    // (rows 0-7, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), ...
};

// ldmatrix.x4 (.trans with TRANS) of the 16 x 16 block at row r0, column c0 of a padded shared
// tile: lanes 8i .. 8i+7 address the rows of matrix i in ORDER. The uses, by operand:
//   A = X [16, 16k] stored [rows][k] (Q, dO, K, V):           ROWS_FIRST, no .trans, (row0, k0)
//   A = X^T, X stored [k][m] (dS from dS^T):                  COLS_FIRST, .trans, (k0, m0)
//   B = X^T, two n-blocks, X stored [n][k] (K in Q K^T):      COLS_FIRST, no .trans, (n0, k0)
//   B = X, two n-blocks, X stored [k][n] (V in P V):          ROWS_FIRST, .trans, (k0, n0)
template <int STRIDE, X4 ORDER, bool TRANS, typename T>
__device__ __forceinline__ void ldmatrix_block(uint32_t (&r)[4], const T* s_tile, int r0, int c0,
                                               int lane) {
    const int row_half = ORDER == X4::ROWS_FIRST ? (lane / 8) % 2 : lane / 16;
    const int col_half = ORDER == X4::ROWS_FIRST ? lane / 16 : (lane / 8) % 2;
    const T* p = s_tile + (r0 + lane % 8 + 8 * row_half) * STRIDE + c0 + 8 * col_half;
    if constexpr (TRANS) {
        ldmatrix_x4_trans(r, p);
    } else {
        ldmatrix_x4(r, p);
    }
}

// The A fragment of k-step j from a [16, N] fp32 C-fragment tile (register reuse, see top).
template <typename T, int NB>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[NB][4], int j) {
    a[0] = ElemTraits<T>::pack(c[2 * j][0], c[2 * j][1]);
    a[1] = ElemTraits<T>::pack(c[2 * j][2], c[2 * j][3]);
    a[2] = ElemTraits<T>::pack(c[2 * j + 1][0], c[2 * j + 1][1]);
    a[3] = ElemTraits<T>::pack(c[2 * j + 1][2], c[2 * j + 1][3]);
}

// acc[MT][16, 8 NB] += A_mt[16, 16 KSTEPS] B[16 KSTEPS, 8 NB] for MT m16 tiles sharing B,
// B = columns n0.. of X^T (B_IS_XT: X stored [n][k]) or of X (X stored [k][n]) in shared
// memory, two n-blocks per ldmatrix: each B fragment read from shared memory feeds MT tiles.
// `load_a_step(a, mt, kk)` fills the A fragment of tile mt, k-step kk.
template <typename T, int MT, int NB, int KSTEPS, int STRIDE_B, bool B_IS_XT, typename LoadA>
__device__ __forceinline__ void gemm_mt(float (&acc)[MT][NB][4], LoadA&& load_a_step,
                                        const T* s_b, int n0, int lane) {
    static_assert(NB % 2 == 0, "B fragments are loaded two n-blocks at a time");
    #pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[MT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a_step(a[mt], mt, kk);
        #pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            uint32_t b[4];
            if constexpr (B_IS_XT) {
                ldmatrix_block<STRIDE_B, X4::COLS_FIRST, false>(b, s_b, n0 + nb * 8, kk * 16, lane);
            } else {
                ldmatrix_block<STRIDE_B, X4::ROWS_FIRST, true>(b, s_b, kk * 16, n0 + nb * 8, lane);
            }
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<T>(acc[mt][nb], a[mt], b[0], b[1]);
                mma_16816<T>(acc[mt][nb + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// gemm_mt on one m16 tile: acc[16, 8 NB] += A B, `load_a_step(a, kk)` filling A.
template <typename T, int NB, int KSTEPS, int STRIDE_B, bool B_IS_XT, typename LoadA>
__device__ __forceinline__ void gemm_16(float (&acc)[NB][4], LoadA&& load_a_step, const T* s_b,
                                        int n0, int lane) {
    gemm_mt<T, 1, NB, KSTEPS, STRIDE_B, B_IS_XT>(
        reinterpret_cast<float (&)[1][NB][4]>(acc),
        [&](uint32_t (&a)[4], int, int kk) { load_a_step(a, kk); }, s_b, n0, lane);
}

template <int NB>
__device__ __forceinline__ void zero_acc(float (&acc)[NB][4]) {
    #pragma unroll
    for (int i = 0; i < NB; ++i) {
        acc[i][0] = 0.f; acc[i][1] = 0.f; acc[i][2] = 0.f; acc[i][3] = 0.f;
    }
}

// acc[16, 8 NB] = A X^T with A rows row0.. of s_a and X = s_b [8 NB] rows, both padded shared
// tiles of D columns, over their first K columns: the scores S = Q K^T of a warp's rows (and
// dO V^T, K Q^T, V dO^T; K = head_dim_v for the last).
template <typename T, int D, int K = D, int NB>
__device__ __forceinline__ void gemm_abt(float (&acc)[NB][4], const T* s_a, int row0,
                                         const T* s_b, int lane) {
    constexpr int STRIDE = smem_stride<D>();
    zero_acc(acc);
    gemm_16<T, NB, K / 16, STRIDE, true>(acc, [&](uint32_t (&a)[4], int kk) {
        ldmatrix_block<STRIDE, X4::ROWS_FIRST, false>(a, s_a, row0, kk * 16, lane);
    }, s_b, 0, lane);
}

// acc[16, 8 NB] += P[16, 8 NP] (C fragments in registers) X, X = s_b [8 NP][8 NB] row-major:
// the P V product (and dS K, P^T dO, dS^T Q in the backward pass).
template <typename T, int NB, int NP, int STRIDE_B>
__device__ __forceinline__ void gemm_pb(float (&acc)[NB][4], const float (&p)[NP][4],
                                        const T* s_b, int lane) {
    static_assert(NP % 2 == 0, "P holds two n-blocks of 8 per k-step of 16");
    gemm_16<T, NB, NP / 2, STRIDE_B, false>(acc, [&](uint32_t (&a)[4], int kk) {
        c_to_a<T>(a, p, kk);
    }, s_b, 0, lane);
}

// Packs a warp's [16, 8 NB] fp32 tile, scaled per row (row_scale[0] for row g, [1] for g + 8),
// as T into rows row0 .. row0 + 15 of a padded shared tile.
template <typename T, int NB, int STRIDE>
__device__ __forceinline__ void stage_rows(const float (&acc)[NB][4], const float (&row_scale)[2],
                                           T* s_stage, int row0, int lane) {
    const int g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const int c = nb * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(s_stage + (row0 + g) * STRIDE + c) =
            ElemTraits<T>::pack(acc[nb][0] * row_scale[0], acc[nb][1] * row_scale[0]);
        *reinterpret_cast<uint32_t*>(s_stage + (row0 + g + 8) * STRIDE + c) =
            ElemTraits<T>::pack(acc[nb][2] * row_scale[1], acc[nb][3] * row_scale[1]);
    }
}

// Writes a warp's [16, D = 8 NB] fp32 tile, scaled per row, to rows row .. row + 15 of a head
// (those < valid_rows) through the warp's rows row0.. of a padded shared tile, in 16-byte
// stores. Only this warp touches these shared rows; nobody else reads them any more. `Rows`
// gives the address of a row (`row(r)`): HeadRows, or a forward tile's TileOutput.
template <typename T, int NB, int STRIDE, typename Rows>
__device__ __forceinline__ void store_rows(const float (&acc)[NB][4], const float (&row_scale)[2],
                                           T* s_stage, int row0, const Rows& dst, int row,
                                           int valid_rows, int lane) {
    stage_rows<T, NB, STRIDE>(acc, row_scale, s_stage, row0, lane);
    __syncwarp();
    constexpr int D = NB * 8;
    constexpr int CHUNKS_PER_ROW = D / CHUNK_ELEMS;
    static_assert((WARP_ROWS * CHUNKS_PER_ROW) % WARP_SIZE == 0, "whole 16-byte chunks per lane");
    #pragma unroll
    for (int i = 0; i < WARP_ROWS * CHUNKS_PER_ROW / WARP_SIZE; ++i) {
        const int c = lane + i * WARP_SIZE;
        const int r = row0 + c / CHUNKS_PER_ROW;
        const int col = (c % CHUNKS_PER_ROW) * CHUNK_ELEMS;
        if (r < valid_rows) {
            *reinterpret_cast<uint4*>(dst.row(row + r) + col) =
                *reinterpret_cast<const uint4*>(s_stage + r * STRIDE + col);
        }
    }
}

// p[0] += a, p[1] += b (p 8-byte aligned), as fp32 reductions nobody waits for: one vector
// red.global.add.v2.f32 on sm_90 (PTX 8.1), two scalar ones before.
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// dst[row + r][col0 + c] += acc[r][c] with fp32 atomics, for the rows r < valid_rows of a
// warp's [16, 8 NB] tile.
template <int NB>
__device__ __forceinline__ void atomic_add_rows(const float (&acc)[NB][4],
                                                const HeadRows<float>& dst, int row,
                                                int valid_rows, int col0, int lane) {
    const int g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = g + 8 * half;
        if (r < valid_rows) {
            float* p = dst.row(row + r) + col0 + 2 * t;
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                red_add_f32x2(p + nb * 8, acc[nb][2 * half], acc[nb][2 * half + 1]);
            }
        }
    }
}

}  // namespace varlen
