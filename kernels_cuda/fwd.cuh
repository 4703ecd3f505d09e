// Forward kernel: FlashAttention-2 (Alg. 1) over the plan's query tiles.
//
// Grid (num_q_tiles, Hq); block BM / 16 warps, warp w owns query rows 16w .. 16w + 15 of the
// tile. Shared memory: Q [BM][D+8], then two stages of K [BN][D+8] and V [BN][D+8] (pipeline.cuh).
// Mask arithmetic runs only on partial key chunks (and on a ragged last chunk, for its missing
// rows). A row that sees a NaN or inf (in q, or in k or v of a key it sees) writes NaN to out
// and lse; hidden keys never reach it (mask_scores, KvStages::zero_nonfinite).
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "pipeline.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

template <int D, int BM, int BN>
using FwdConfig = QueryTileConfig<D, BM, BN, 1>;

// O / l of this warp's rows, through its rows of the Q buffer, and their natural-log lse (one
// lane per quad writes it), both NaN for a row that saw a NaN or inf; rows past the tile are
// not written.
template <typename T, int D, int STRIDE>
__device__ __forceinline__ void store_output(const float (&acc_o)[D / 8][4],
                                             const OnlineSoftmax& softmax, T* s_stage,
                                             const HeadRows<T>& out, float* p_lse,
                                             const TileInfo& tile, const WarpSlot& w) {
    float inv_l[2], row_lse[2];
    softmax.finish(acc_o, inv_l, row_lse);
    store_rows<T, D / 8, STRIDE>(acc_o, inv_l, s_stage, w.row0, out, tile.row, tile.rows, w.lane);
    const int r = w.row0 + w.lane / 4;
    if (w.lane % 4 == 0) {
        if (r < tile.rows) p_lse[tile.row + r] = row_lse[0];
        if (r + 8 < tile.rows) p_lse[tile.row + r + 8] = row_lse[1];
    }
}

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
           const PlanView plan, const CallParams call) {
    using Cfg = FwdConfig<D, BM, BN>;
    const TileBlock<false> b(plan, call);
    if (b.tile.seq < 0) return;
    const WarpSlot& w = b.w;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* s_q = reinterpret_cast<T*>(smem_raw);                          // [BM][STRIDE]
    const KvStages<T, D, BN, Cfg::NUM_THREADS> kv(s_q + BM * Cfg::STRIDE, k, v, call.Hk,
                                                  b.i_khead);
    b.load_rows<BM, D, Cfg::NUM_THREADS>(s_q, q, call.Hq);
    const SeqPolicy pol = SeqPolicy::load(plan, b.tile.seq);
    PartnerCursor<BN> keys = key_cursor<BN>(plan, b.tile, b.i_tile);

    // [16, D] output accumulator of this warp
    float acc_o[D / 8][4];
    zero_acc(acc_o);
    OnlineSoftmax softmax;
    softmax.init();
    for_each_chunk(keys, [&](const Chunk& c, int stage) { kv.load(c, stage); },
                   [&](const Chunk& c, int stage) {
        if (!c.full) kv.template zero_nonfinite<true>(c, stage);
    }, [&](const Chunk& c, int stage) {
        // [16, BN] scores of this warp's rows
        float acc_s[BN / 8][4];
        gemm_abt<T, D>(acc_s, s_q, w.row0, kv.k_at(stage), w.lane);
        mask_scores<HAS_SOFTCAP>(acc_s, query_rows_mask(pol, b.tile.pos, w, c), call, w.lane);
        softmax.update(acc_s, acc_o);
        gemm_pb<T, D / 8, BN / 8, Cfg::STRIDE>(acc_o, acc_s, kv.v_at(stage), w.lane);
    });
    store_output<T, D, Cfg::STRIDE>(acc_o, softmax, s_q, head_rows<D>(out, call.Hq, b.i_head),
                                    lse + static_cast<int64_t>(b.i_head) * plan.rows_q, b.tile, w);
}
