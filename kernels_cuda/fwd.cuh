// Forward kernel: FlashAttention-2 (Alg. 1) over the plan's query tiles.
//
// Grid (num_q_tiles, Hq); block BM / 16 warps, warp w owns query rows 16w .. 16w + 15 of the
// tile. Shared memory: Q [BM][D+8], then two stages of K [BN][D+8] and V [BN][D+8]: the key
// tile after the current one is fetched with cp.async while the current one is computed.
// Only the key tiles the schedule lists are loaded; mask arithmetic runs only on partial
// tiles (and on a ragged last tile, for its missing rows).
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

template <int D, int BM, int BN>
struct FwdConfig {
    static constexpr int NUM_WARPS = BM / WARP_ROWS;
    static constexpr int NUM_THREADS = NUM_WARPS * WARP_SIZE;
    static constexpr int STRIDE = smem_stride<D>();
    static constexpr int STAGES = 2;
    static constexpr int SMEM_ELEMS = BM * STRIDE + 2 * STAGES * BN * STRIDE;
    static_assert(BM % WARP_ROWS == 0, "each warp owns 16 query rows");
    static_assert(NUM_WARPS >= 1 && NUM_WARPS <= 8, "1 to 8 warps per block");
    static_assert(BN % 16 == 0, "P V consumes key tiles in k-steps of 16");
    static_assert(D % 16 == 0, "Q K^T consumes the head dim in k-steps of 16");
};

}  // namespace varlen

// Kernels live at global scope so that their name expressions are short.
using namespace varlen;

template <typename T, int D, int BM, int BN, bool HAS_SOFTCAP>
__global__ void __launch_bounds__(FwdConfig<D, BM, BN>::NUM_THREADS)
varlen_fwd(const T* __restrict__ q,           // [Tq, Hq, D]
           const T* __restrict__ k,           // [Tk, Hk, D]
           const T* __restrict__ v,           // [Tk, Hk, D]
           T* __restrict__ out,               // [Tq, Hq, D]
           float* __restrict__ lse,           // [Hq, Tq]
           const int* __restrict__ q_tiles,   // [num_q_tiles, 5]
           const int* __restrict__ q_sched,   // [num_q_tiles, mk, 4]
           const int* __restrict__ k_row,     // [B, mk]
           const int* __restrict__ k_len,     // [B, mk]
           const int* __restrict__ k_pos,     // [B, mk]
           const int* __restrict__ seqlen_q,  // [B]
           const int* __restrict__ seqlen_k,  // [B]
           const int* __restrict__ window_left,
           const int* __restrict__ window_right,
           const int* __restrict__ bottom_right,
           int mk, int Tq, int Hq, int Hk, float softmax_scale, float softcap) {
    using Cfg = FwdConfig<D, BM, BN>;
    constexpr int STRIDE = Cfg::STRIDE;
    constexpr int NB_S = BN / 8;     // n-blocks of the [16, BN] score tile
    constexpr int NB_O = D / 8;      // n-blocks of the [16, D] output tile

    const int i_tile = blockIdx.x;
    const int i_head = blockIdx.y;
    const TileInfo tile = load_tile(q_tiles, i_tile);
    if (tile.seq < 0) return;
    const int i_khead = i_head / (Hq / Hk);
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int row0 = warp * WARP_ROWS;           // this warp's first row inside the tile

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* s_q = reinterpret_cast<T*>(smem_raw);     // [BM][STRIDE]
    T* s_k = s_q + BM * STRIDE;                  // [2][BN][STRIDE]
    T* s_v = s_k + Cfg::STAGES * BN * STRIDE;    // [2][BN][STRIDE]

    const int64_t q_stride = static_cast<int64_t>(Hq) * D;
    const int64_t k_stride = static_cast<int64_t>(Hk) * D;
    const T* p_q = q + static_cast<int64_t>(tile.row) * q_stride + static_cast<int64_t>(i_head) * D;
    const T* p_k = k + static_cast<int64_t>(i_khead) * D;
    const T* p_v = v + static_cast<int64_t>(i_khead) * D;

    const SeqPolicy pol = SeqPolicy::load(window_left, window_right, bottom_right, seqlen_q,
                                          seqlen_k, tile.seq);
    PartnerCursor<BN> cursor;
    const int64_t seg_base = static_cast<int64_t>(tile.seq) * mk;
    cursor.init(q_sched + static_cast<int64_t>(i_tile) * mk * SCHED_FIELDS, k_row + seg_base,
                k_len + seg_base, k_pos + seg_base, mk, 1, 1);

    load_tile_async<BM, D, Cfg::NUM_THREADS>(s_q, p_q, q_stride, tile.rows);
    if (cursor.valid()) {
        const Chunk c = cursor.chunk();
        load_tile_async<BN, D, Cfg::NUM_THREADS>(s_k, p_k + c.row * k_stride, k_stride, c.rows);
        load_tile_async<BN, D, Cfg::NUM_THREADS>(s_v, p_v + c.row * k_stride, k_stride, c.rows);
    }
    cp_async_commit();

    // [16, D] output accumulator of this warp
    float acc_o[NB_O][4];
    zero_acc(acc_o);
    OnlineSoftmax softmax;
    softmax.init();

    int stage = 0;
    while (cursor.valid()) {
        const Chunk cur = cursor.chunk();
        cursor.advance();
        if (cursor.valid()) {
            // Prefetch the next key tile into the other stage (last read one iteration ago,
            // released by the barrier at the end of that iteration).
            const Chunk nxt = cursor.chunk();
            const int other = (stage ^ 1) * BN * STRIDE;
            load_tile_async<BN, D, Cfg::NUM_THREADS>(s_k + other, p_k + nxt.row * k_stride,
                                                     k_stride, nxt.rows);
            load_tile_async<BN, D, Cfg::NUM_THREADS>(s_v + other, p_v + nxt.row * k_stride,
                                                     k_stride, nxt.rows);
        }
        cp_async_commit();
        cp_async_wait<1>();      // all groups but the prefetch: Q and the current tile
        __syncthreads();

        const T* s_kst = s_k + stage * BN * STRIDE;
        const T* s_vst = s_v + stage * BN * STRIDE;
        // [16, BN] scores of this warp's rows
        float acc_s[NB_S][4];
        zero_acc(acc_s);
        gemm_a_bt<T, NB_S, D / 16, STRIDE, STRIDE>(acc_s, s_q, row0, s_kst, lane);
        #pragma unroll
        for (int nb = 0; nb < NB_S; ++nb) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc_s[nb][e] = score_log2<HAS_SOFTCAP>(acc_s[nb][e], softmax_scale, softcap);
            }
        }
        if (!cur.full) mask_scores(acc_s, pol, tile.pos + row0, cur.pos, cur.rows, lane);
        softmax.update(acc_s, acc_o);
        gemm_p_b<T, NB_O, BN / 16, NB_S, STRIDE>(acc_o, acc_s, s_vst, lane);

        __syncthreads();         // everyone is done with this stage before it is refilled
        stage ^= 1;
    }
    // With no key tile at all the Q copies may still be in flight: drain before reusing s_q.
    cp_async_wait<0>();
    __syncthreads();

    float inv_l[2], row_lse[2];
    softmax.finish(inv_l, row_lse);
    T* p_out = out + static_cast<int64_t>(tile.row) * q_stride + static_cast<int64_t>(i_head) * D;
    store_rows<T, NB_O, STRIDE>(acc_o, inv_l, s_q, row0, p_out, q_stride, tile.rows, lane);
    const int g = lane / 4;
    if (lane % 4 == 0) {
        float* p_lse = lse + static_cast<int64_t>(i_head) * Tq + tile.row;
        if (row0 + g < tile.rows) p_lse[row0 + g] = row_lse[0];
        if (row0 + g + 8 < tile.rows) p_lse[row0 + g + 8] = row_lse[1];
    }
}
