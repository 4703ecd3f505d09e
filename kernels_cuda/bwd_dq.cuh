// Deterministic dQ kernel (FlashAttention-2, Alg. 2, the loop over key tiles for one query
// tile, recomputed without atomics).
//
// Grid (num_q_tiles, Hq); block BM / 16 warps, warp w owns query rows 16w .. 16w + 15. Like
// the forward pass it walks q_sched with K and V double-buffered, and per key tile computes
//     S = Q K^T, P = exp2(S * LOG2E - lse2), dP = dO V^T,
//     dS = P * (dP - delta) * softmax_scale (times 1 - tanh^2 with a softcap), dQ += dS K,
// keeping dQ in registers and writing each row once: bitwise repeatable.
// Shared memory: Q, dO [BM][D+8]; two stages of K, V [BN][D+8].
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

template <int D, int BM, int BN>
struct DqConfig {
    static constexpr int NUM_WARPS = BM / WARP_ROWS;
    static constexpr int NUM_THREADS = NUM_WARPS * WARP_SIZE;
    static constexpr int STRIDE = smem_stride<D>();
    static constexpr int STAGES = 2;
    static constexpr int SMEM_ELEMS = 2 * BM * STRIDE + 2 * STAGES * BN * STRIDE;
    static_assert(BM % WARP_ROWS == 0, "each warp owns 16 query rows");
    static_assert(NUM_WARPS >= 1 && NUM_WARPS <= 8, "1 to 8 warps per block");
    static_assert(BN % 16 == 0 && D % 16 == 0, "k-steps of 16");
};

}  // namespace varlen

using namespace varlen;

template <typename T, int D, int BM, int BN, bool HAS_SOFTCAP>
__global__ void __launch_bounds__(DqConfig<D, BM, BN>::NUM_THREADS)
varlen_bwd_dq(const T* __restrict__ q,            // [Tq, Hq, D]
              const T* __restrict__ k,            // [Tk, Hk, D]
              const T* __restrict__ v,            // [Tk, Hk, D]
              const T* __restrict__ dout,         // [Tq, Hq, D]
              const float* __restrict__ lse2,     // [Hq, Tq]
              const float* __restrict__ delta,    // [Hq, Tq]
              T* __restrict__ dq,                 // [Tq, Hq, D]
              const int* __restrict__ q_tiles,    // [num_q_tiles, 5]
              const int* __restrict__ q_sched,    // [num_q_tiles, mk, 4]
              const int* __restrict__ k_row,      // [B, mk]
              const int* __restrict__ k_len,      // [B, mk]
              const int* __restrict__ k_pos,      // [B, mk]
              const int* __restrict__ seqlen_q,   // [B]
              const int* __restrict__ seqlen_k,   // [B]
              const int* __restrict__ window_left,
              const int* __restrict__ window_right,
              const int* __restrict__ bottom_right,
              int mk, int Tq, int Hq, int Hk, float softmax_scale, float softcap) {
    using Cfg = DqConfig<D, BM, BN>;
    constexpr int STRIDE = Cfg::STRIDE;
    constexpr int NB_S = BN / 8;     // n-blocks of the [16, BN] S / dP tiles
    constexpr int NB_D = D / 8;      // n-blocks of the [16, D] dQ tile

    const int i_tile = blockIdx.x;
    const int i_head = blockIdx.y;
    const TileInfo tile = load_tile(q_tiles, i_tile);
    if (tile.seq < 0) return;
    const int i_khead = i_head / (Hq / Hk);
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int row0 = warp * WARP_ROWS;
    const int g = lane / 4, t = lane % 4;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* s_q = reinterpret_cast<T*>(smem_raw);      // [BM][STRIDE]
    T* s_do = s_q + BM * STRIDE;                  // [BM][STRIDE]
    T* s_k = s_do + BM * STRIDE;                  // [2][BN][STRIDE]
    T* s_v = s_k + Cfg::STAGES * BN * STRIDE;     // [2][BN][STRIDE]

    const int64_t q_stride = static_cast<int64_t>(Hq) * D;
    const int64_t k_stride = static_cast<int64_t>(Hk) * D;
    const int64_t q_offset = static_cast<int64_t>(tile.row) * q_stride +
                             static_cast<int64_t>(i_head) * D;
    const T* p_k = k + static_cast<int64_t>(i_khead) * D;
    const T* p_v = v + static_cast<int64_t>(i_khead) * D;

    const SeqPolicy pol = SeqPolicy::load(window_left, window_right, bottom_right, seqlen_q,
                                          seqlen_k, tile.seq);
    PartnerCursor<BN> cursor;
    const int64_t seg_base = static_cast<int64_t>(tile.seq) * mk;
    cursor.init(q_sched + static_cast<int64_t>(i_tile) * mk * SCHED_FIELDS, k_row + seg_base,
                k_len + seg_base, k_pos + seg_base, mk, 1, 1);

    load_tile_async<BM, D, Cfg::NUM_THREADS>(s_q, q + q_offset, q_stride, tile.rows);
    load_tile_async<BM, D, Cfg::NUM_THREADS>(s_do, dout + q_offset, q_stride, tile.rows);
    if (cursor.valid()) {
        const Chunk c = cursor.chunk();
        load_tile_async<BN, D, Cfg::NUM_THREADS>(s_k, p_k + c.row * k_stride, k_stride, c.rows);
        load_tile_async<BN, D, Cfg::NUM_THREADS>(s_v, p_v + c.row * k_stride, k_stride, c.rows);
    }
    cp_async_commit();

    // Row statistics of this lane's rows g and g + 8 (past the tile: P = 0).
    float row_lse2[2], row_delta[2];
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = row0 + g + 8 * half;
        const int64_t idx = static_cast<int64_t>(i_head) * Tq + tile.row + r;
        row_lse2[half] = r < tile.rows ? lse2[idx] : pos_inf();
        row_delta[half] = r < tile.rows ? delta[idx] : 0.f;
    }

    // [16, D] dQ accumulator of this warp
    float acc_dq[NB_D][4];
    zero_acc(acc_dq);

    int stage = 0;
    while (cursor.valid()) {
        const Chunk cur = cursor.chunk();
        cursor.advance();
        if (cursor.valid()) {
            const Chunk nxt = cursor.chunk();
            const int other = (stage ^ 1) * BN * STRIDE;
            load_tile_async<BN, D, Cfg::NUM_THREADS>(s_k + other, p_k + nxt.row * k_stride,
                                                     k_stride, nxt.rows);
            load_tile_async<BN, D, Cfg::NUM_THREADS>(s_v + other, p_v + nxt.row * k_stride,
                                                     k_stride, nxt.rows);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const T* s_kst = s_k + stage * BN * STRIDE;
        const T* s_vst = s_v + stage * BN * STRIDE;
        // [16, BN] S and dP of this warp's rows
        float acc_s[NB_S][4];
        float acc_dp[NB_S][4];
        zero_acc(acc_s);
        zero_acc(acc_dp);
        gemm_a_bt<T, NB_S, D / 16, STRIDE, STRIDE>(acc_s, s_q, row0, s_kst, lane);
        gemm_a_bt<T, NB_S, D / 16, STRIDE, STRIDE>(acc_dp, s_do, row0, s_vst, lane);

        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            const Band m_band = key_band(pol, tile.pos + row0 + g + 8 * half, cur.pos,
                                       cur.pos + cur.rows - 1);
            #pragma unroll
            for (int nb = 0; nb < NB_S; ++nb) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = nb * 8 + 2 * t + e;
                    float th = 0.f;
                    float x = score_log2<HAS_SOFTCAP>(acc_s[nb][2 * half + e], softmax_scale,
                                                      softcap, &th);
                    if (!cur.full && !m_band.contains(cur.pos + col)) x = neg_inf();
                    const float p = exp2f(x - row_lse2[half]);
                    float ds = p * (acc_dp[nb][2 * half + e] - row_delta[half]);
                    if (HAS_SOFTCAP) ds *= 1.f - th * th;
                    acc_s[nb][2 * half + e] = ds * softmax_scale;
                }
            }
        }
        gemm_p_b<T, NB_D, BN / 16, NB_S, STRIDE>(acc_dq, acc_s, s_kst, lane);

        __syncthreads();
        stage ^= 1;
    }
    cp_async_wait<0>();
    __syncthreads();

    const float one[2] = {1.f, 1.f};
    store_rows<T, NB_D, STRIDE>(acc_dq, one, s_q, row0, dq + q_offset, q_stride, tile.rows, lane);
}
