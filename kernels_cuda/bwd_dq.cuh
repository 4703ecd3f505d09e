// Deterministic dQ kernel (FlashAttention-2, Alg. 2, the loop over key tiles for one query
// tile, recomputed without atomics).
//
// Grid (num_q_tiles, Hq); block BM / 16 warps, warp w owns query rows 16w .. 16w + 15 (the
// rows of no query tile are written by varlen_bwd_preprocess). Like
// the forward pass it walks q_sched with K and V double-buffered, and per key chunk computes
//     S = Q K^T, P = exp2(S * LOG2E - lse2), dP = dO V^T,
//     dS = P * (dP - delta) * softmax_scale (times 1 - tanh^2 with a softcap), dQ += dS K,
// keeping dQ in registers and writing each row once: bitwise repeatable. A row with a pair it
// sees holding a NaN or inf operand writes NaN (softmax_backward, KvStages::zero_nonfinite).
// Shared memory: Q, dO [BM][D+8]; two stages of K, V [KN][D+8] (KN = dq_key_chunk: BN, BN / 2
// above D = 128, BN / 4 above D = 192).
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "pipeline.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

// Keys per chunk: a plan tile; half of one above D = 128, where the dQ accumulators take
// D / 2 registers per lane (96 at D = 192) and two stages of 64-key K and V tiles would not
// fit an A100 at D = 256 (202 752 B); a quarter of one above D = 192 (at D = 256 the 128
// accumulators beside S and dP of 32 keys spilled 32 bytes on sm_80).
template <int D, int BN>
__host__ __device__ constexpr int dq_key_chunk() {
    return D > 192 ? BN / 4 : D > 128 ? BN / 2 : BN;
}

template <int D, int BM, int BN>
using DqConfig = QueryTileConfig<D, BM, dq_key_chunk<D, BN>(), 2>;

// lse2 and delta of this lane's query rows g and g + 8, the same for every column.
struct RowStats {
    float row_lse2[2];
    float row_delta[2];

    __device__ __forceinline__ float lse2(int half, int) const { return row_lse2[half]; }
    __device__ __forceinline__ float delta(int half, int) const { return row_delta[half]; }
};

__device__ __forceinline__ RowStats load_warp_row_stats(const float* lse2, const float* delta,
                                                        int Tq, int head, const TileInfo& tile,
                                                        const WarpSlot& w) {
    RowStats stats;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = w.row0 + w.lane / 4 + 8 * half;
        load_row_stats(stats.row_lse2[half], stats.row_delta[half], lse2, delta, Tq, head,
                       tile.row + r, r < tile.rows);
    }
    return stats;
}

}  // namespace varlen

using namespace varlen;

template <typename T, int D, int BM, int BN, bool HAS_SOFTCAP>
__global__ void __launch_bounds__(DqConfig<D, BM, BN>::NUM_THREADS)
varlen_bwd_dq(const T* __restrict__ q,            // [Tq, Hq, D]
              const T* __restrict__ k,            // [Tk, Hk, D]
              const T* __restrict__ v,            // [Tk, Hk, D]
              const T* __restrict__ dout,         // [Tq, Hq, D]
              const float* __restrict__ lse2,     // [Hq, Tq] base-2 lse, +inf: no key
              const float* __restrict__ delta,    // [Hq, Tq]
              T* __restrict__ dq,                 // [Tq, Hq, D]
              const PlanView plan, const CallParams call) {
    using Cfg = DqConfig<D, BM, BN>;
    constexpr int KN = dq_key_chunk<D, BN>();
    const TileBlock<false> b(plan, call);
    if (b.tile.seq < 0) return;
    const WarpSlot& w = b.w;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* s_q = reinterpret_cast<T*>(smem_raw);      // [BM][STRIDE]
    T* s_do = s_q + BM * Cfg::STRIDE;             // [BM][STRIDE]
    const KvStages<T, D, KN, Cfg::NUM_THREADS> kv(s_do + BM * Cfg::STRIDE, k, v, call.Hk,
                                                  b.i_khead);
    b.load_rows<BM, D, Cfg::NUM_THREADS>(s_q, q, call.Hq);
    b.load_rows<BM, D, Cfg::NUM_THREADS>(s_do, dout, call.Hq);
    const SeqPolicy pol = SeqPolicy::load(plan, b.tile.seq);
    PartnerCursor<KN> keys = key_cursor<BN, KN>(plan, b.tile, b.i_tile);
    const RowStats stats = load_warp_row_stats(lse2, delta, plan.rows_q, b.i_head, b.tile, w);

    // [16, D] dQ accumulator of this warp
    float acc_dq[D / 8][4];
    zero_acc(acc_dq);
    for_each_chunk(keys, [&](const Chunk& c, int stage) { kv.load(c, stage); },
                   [&](const Chunk& c, int stage) {
        if (!c.full) kv.template zero_nonfinite<false>(c, stage);
    }, [&](const Chunk& c, int stage) {
        // [16, KN] S, then P, and dP, then dS, of this warp's rows
        float acc_s[KN / 8][4];
        float acc_dp[KN / 8][4];
        recompute_p_ds<HAS_SOFTCAP, T, D>(acc_s, acc_dp, s_q, s_do, kv.k_at(stage),
                                          kv.v_at(stage), query_rows_mask(pol, b.tile.pos, w, c),
                                          stats, call, w);
        gemm_pb<T, D / 8, KN / 8, Cfg::STRIDE>(acc_dq, acc_dp, kv.k_at(stage), w.lane);
    });
    const float one[2] = {1.f, 1.f};
    store_rows<T, D / 8, Cfg::STRIDE>(acc_dq, one, s_q, w.row0,
                                      head_rows<D>(dq, call.Hq, b.i_head), b.tile.row,
                                      b.tile.rows, w.lane);
}
