// dK/dV kernel (FlashAttention-2, Alg. 2, the loop over query tiles for one key tile),
// optionally also accumulating dQ with fp32 atomics.
//
// Grid (num_k_tiles, Hk); block BN / 16 warps, warp w owns key rows 16w .. 16w + 15 of the
// tile. The block visits, for each of the G = Hq / Hk query heads of its key head, the query
// tiles the transposed schedule (k_sched) lists, in chunks of BQ rows, and keeps dK and dV of
// its keys in registers over all of them: each dK/dV row is written once, no atomics, so dK
// and dV are deterministic. Per chunk, in transposed form (rows = keys, columns = queries):
//     S^T  = K Q^T                     [BN, BQ]
//     P^T  = exp2(S^T * LOG2E - lse2)  (mask on partial tiles)
//     dP^T = V dO^T                    [BN, BQ]
//     dS^T = P^T * (dP^T - delta) * softmax_scale   (times 1 - tanh^2 with a softcap)
//     dV  += P^T dO,  dK += dS^T Q     [BN, D]
//     dQ  += dS K  (ATOMIC_DQ: dS^T goes through shared memory, then fp32 atomics)
// Shared memory: K, V [BN][D+8]; two stages of Q, dO [BQ][D+8] and lse2, delta [BQ];
// dS^T [BN][BQ+8] with ATOMIC_DQ.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

template <int D, int BN, int BQ, bool ATOMIC_DQ>
struct DkdvConfig {
    static constexpr int NUM_WARPS = BN / WARP_ROWS;
    static constexpr int NUM_THREADS = NUM_WARPS * WARP_SIZE;
    static constexpr int STRIDE = smem_stride<D>();
    static constexpr int DS_STRIDE = smem_stride<BQ>();
    static constexpr int STAGES = 2;
    // dQ is produced DQ_COLS columns at a time to bound the registers it needs.
    static constexpr int DQ_COLS = 32;
    static constexpr int T_ELEMS = 2 * BN * STRIDE + 2 * STAGES * BQ * STRIDE +
                                   (ATOMIC_DQ ? BN * DS_STRIDE : 0);
    static constexpr int F_ELEMS = 2 * STAGES * BQ;
    static_assert(BN % WARP_ROWS == 0, "each warp owns 16 key rows");
    static_assert(NUM_WARPS >= 1 && NUM_WARPS <= 8, "1 to 8 warps per block");
    static_assert(BQ % 16 == 0 && BQ <= NUM_THREADS, "query chunks of k-steps of 16; one "
                  "thread per chunk row loads lse2 and delta");
    static_assert(D % 16 == 0 && D % DQ_COLS == 0, "head dim in k-steps of 16 and dQ slices");
};

}  // namespace varlen

using namespace varlen;

template <typename T, int D, int BN, int BQ, bool HAS_SOFTCAP, bool ATOMIC_DQ>
__global__ void __launch_bounds__(DkdvConfig<D, BN, BQ, ATOMIC_DQ>::NUM_THREADS)
varlen_bwd_dkdv(const T* __restrict__ q,            // [Tq, Hq, D]
                const T* __restrict__ k,            // [Tk, Hk, D]
                const T* __restrict__ v,            // [Tk, Hk, D]
                const T* __restrict__ dout,         // [Tq, Hq, D]
                const float* __restrict__ lse2,     // [Hq, Tq] base-2 lse, +inf: no key
                const float* __restrict__ delta,    // [Hq, Tq]
                T* __restrict__ dk,                 // [Tk, Hk, D]
                T* __restrict__ dv,                 // [Tk, Hk, D]
                float* __restrict__ dq_accum,       // [Tq, Hq, D] (ATOMIC_DQ only)
                const int* __restrict__ k_tiles,    // [num_k_tiles, 5]
                const int* __restrict__ k_sched,    // [num_k_tiles, mq, 4]
                const int* __restrict__ q_row,      // [B, mq]
                const int* __restrict__ q_len,      // [B, mq]
                const int* __restrict__ q_pos,      // [B, mq]
                const int* __restrict__ seqlen_q,   // [B]
                const int* __restrict__ seqlen_k,   // [B]
                const int* __restrict__ window_left,
                const int* __restrict__ window_right,
                const int* __restrict__ bottom_right,
                int mq, int q_chunks_per_tile, int Tq, int Hq, int Hk, float softmax_scale,
                float softcap) {
    using Cfg = DkdvConfig<D, BN, BQ, ATOMIC_DQ>;
    constexpr int STRIDE = Cfg::STRIDE;
    constexpr int DS_STRIDE = Cfg::DS_STRIDE;
    constexpr int NB_Q = BQ / 8;     // n-blocks of the [16, BQ] S^T / dP^T tiles
    constexpr int NB_D = D / 8;      // n-blocks of the [16, D] dK / dV tiles

    const int i_tile = blockIdx.x;
    const int i_khead = blockIdx.y;
    const TileInfo tile = load_tile(k_tiles, i_tile);
    if (tile.seq < 0) return;
    const int group = Hq / Hk;
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int row0 = warp * WARP_ROWS;            // this warp's first key row in the tile
    const int g = lane / 4, t = lane % 4;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* s_k = reinterpret_cast<T*>(smem_raw);      // [BN][STRIDE]
    T* s_v = s_k + BN * STRIDE;                   // [BN][STRIDE]
    T* s_q = s_v + BN * STRIDE;                   // [2][BQ][STRIDE]
    T* s_do = s_q + Cfg::STAGES * BQ * STRIDE;    // [2][BQ][STRIDE]
    T* s_ds = s_do + Cfg::STAGES * BQ * STRIDE;   // [BN][DS_STRIDE]
    float* s_lse2 = reinterpret_cast<float*>(s_k + Cfg::T_ELEMS);   // [2][BQ]
    float* s_delta = s_lse2 + Cfg::STAGES * BQ;                      // [2][BQ]

    const int64_t q_stride = static_cast<int64_t>(Hq) * D;
    const int64_t k_stride = static_cast<int64_t>(Hk) * D;
    const int64_t k_offset = static_cast<int64_t>(tile.row) * k_stride +
                             static_cast<int64_t>(i_khead) * D;

    const SeqPolicy pol = SeqPolicy::load(window_left, window_right, bottom_right, seqlen_q,
                                          seqlen_k, tile.seq);
    PartnerCursor<BQ> cursor;
    const int64_t seg_base = static_cast<int64_t>(tile.seq) * mq;
    cursor.init(k_sched + static_cast<int64_t>(i_tile) * mq * SCHED_FIELDS, q_row + seg_base,
                q_len + seg_base, q_pos + seg_base, mq, group, q_chunks_per_tile);

    // Q, dO, lse2 and delta of one query chunk into a stage; rows past the chunk get zeros
    // and lse2 = +inf, so their probabilities are exactly 0.
    auto load_chunk = [&](const Chunk& c, int st) {
        const int head = i_khead * group + c.head;
        const int64_t offset = static_cast<int64_t>(c.row) * q_stride + static_cast<int64_t>(head) * D;
        load_tile_async<BQ, D, Cfg::NUM_THREADS>(s_q + st * BQ * STRIDE, q + offset, q_stride, c.rows);
        load_tile_async<BQ, D, Cfg::NUM_THREADS>(s_do + st * BQ * STRIDE, dout + offset, q_stride, c.rows);
        if (threadIdx.x < BQ) {
            const int r = threadIdx.x;
            const int64_t idx = static_cast<int64_t>(head) * Tq + c.row + r;
            s_lse2[st * BQ + r] = r < c.rows ? lse2[idx] : pos_inf();
            s_delta[st * BQ + r] = r < c.rows ? delta[idx] : 0.f;
        }
    };

    load_tile_async<BN, D, Cfg::NUM_THREADS>(s_k, k + k_offset, k_stride, tile.rows);
    load_tile_async<BN, D, Cfg::NUM_THREADS>(s_v, v + k_offset, k_stride, tile.rows);
    if (cursor.valid()) load_chunk(cursor.chunk(), 0);
    cp_async_commit();

    // [16, D] dK and dV accumulators of this warp's key rows
    float acc_dk[NB_D][4];
    float acc_dv[NB_D][4];
    zero_acc(acc_dk);
    zero_acc(acc_dv);
    const bool ragged_keys = tile.rows < BN;

    int stage = 0;
    while (cursor.valid()) {
        const Chunk cur = cursor.chunk();
        cursor.advance();
        if (cursor.valid()) load_chunk(cursor.chunk(), stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const T* s_qst = s_q + stage * BQ * STRIDE;
        const T* s_dost = s_do + stage * BQ * STRIDE;
        const float* s_lse2st = s_lse2 + stage * BQ;
        const float* s_deltast = s_delta + stage * BQ;

        // [16, BQ] S^T and dP^T of this warp's key rows
        float acc_s[NB_Q][4];
        float acc_dp[NB_Q][4];
        zero_acc(acc_s);
        zero_acc(acc_dp);
        gemm_a_bt<T, NB_Q, D / 16, STRIDE, STRIDE>(acc_s, s_k, row0, s_qst, lane);
        gemm_a_bt<T, NB_Q, D / 16, STRIDE, STRIDE>(acc_dp, s_v, row0, s_dost, lane);

        const bool m_partial = !cur.full || ragged_keys;     // mask arithmetic needed
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key_row = row0 + g + 8 * half;
            Band m_band{1, 0};                      // empty: a key row past the tile
            if (key_row < tile.rows) {
                m_band = query_band(pol, tile.pos + key_row, cur.pos, cur.pos + cur.rows - 1);
            }
            #pragma unroll
            for (int nb = 0; nb < NB_Q; ++nb) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = nb * 8 + 2 * t + e;
                    float th = 0.f;
                    float x = score_log2<HAS_SOFTCAP>(acc_s[nb][2 * half + e], softmax_scale,
                                                      softcap, &th);
                    if (m_partial && !m_band.contains(cur.pos + col)) x = neg_inf();
                    const float p = exp2f(x - s_lse2st[col]);
                    float ds = p * (acc_dp[nb][2 * half + e] - s_deltast[col]);
                    if (HAS_SOFTCAP) ds *= 1.f - th * th;
                    acc_s[nb][2 * half + e] = p;
                    acc_dp[nb][2 * half + e] = ds * softmax_scale;
                }
            }
        }
        gemm_p_b<T, NB_D, BQ / 16, NB_Q, STRIDE>(acc_dv, acc_s, s_dost, lane);
        gemm_p_b<T, NB_D, BQ / 16, NB_Q, STRIDE>(acc_dk, acc_dp, s_qst, lane);

        if constexpr (ATOMIC_DQ) {
            // dS^T [BN, BQ] to shared memory, then dQ [BQ, D] = dS K with 16 query rows per
            // warp, DQ_COLS columns at a time, added to dq_accum with fp32 atomics.
            #pragma unroll
            for (int nb = 0; nb < NB_Q; ++nb) {
                const int col = nb * 8 + 2 * t;
                *reinterpret_cast<uint32_t*>(s_ds + (row0 + g) * DS_STRIDE + col) =
                    ElemTraits<T>::pack(acc_dp[nb][0], acc_dp[nb][1]);
                *reinterpret_cast<uint32_t*>(s_ds + (row0 + g + 8) * DS_STRIDE + col) =
                    ElemTraits<T>::pack(acc_dp[nb][2], acc_dp[nb][3]);
            }
            __syncthreads();
            const int head = i_khead * group + cur.head;
            for (int qg = warp; qg < BQ / WARP_ROWS; qg += Cfg::NUM_WARPS) {
                #pragma unroll
                for (int dc = 0; dc < D / Cfg::DQ_COLS; ++dc) {
                    // [16, DQ_COLS] slice of dQ
                    float acc_q[Cfg::DQ_COLS / 8][4];
                    zero_acc(acc_q);
                    #pragma unroll
                    for (int kk = 0; kk < BN / 16; ++kk) {
                        uint32_t a[4];
                        load_a_trans<DS_STRIDE>(a, s_ds, qg * WARP_ROWS, kk * 16, lane);
                        #pragma unroll
                        for (int nb = 0; nb < Cfg::DQ_COLS / 8; nb += 2) {
                            uint32_t b[4];
                            load_b_kn<STRIDE>(b, s_k, kk * 16, dc * Cfg::DQ_COLS + nb * 8, lane);
                            mma_16816<T>(acc_q[nb], a, b[0], b[1]);
                            mma_16816<T>(acc_q[nb + 1], a, b[2], b[3]);
                        }
                    }
                    #pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int r = qg * WARP_ROWS + g + 8 * half;
                        if (r < cur.rows) {
                            float* p_dq = dq_accum + static_cast<int64_t>(cur.row + r) * q_stride +
                                          static_cast<int64_t>(head) * D + dc * Cfg::DQ_COLS + 2 * t;
                            #pragma unroll
                            for (int nb = 0; nb < Cfg::DQ_COLS / 8; ++nb) {
                                atomicAdd(p_dq + nb * 8, acc_q[nb][2 * half]);
                                atomicAdd(p_dq + nb * 8 + 1, acc_q[nb][2 * half + 1]);
                            }
                        }
                    }
                }
            }
        }

        __syncthreads();
        stage ^= 1;
    }
    cp_async_wait<0>();
    __syncthreads();

    const float one[2] = {1.f, 1.f};
    store_rows<T, NB_D, STRIDE>(acc_dk, one, s_k, row0, dk + k_offset, k_stride, tile.rows, lane);
    store_rows<T, NB_D, STRIDE>(acc_dv, one, s_v, row0, dv + k_offset, k_stride, tile.rows, lane);
}
