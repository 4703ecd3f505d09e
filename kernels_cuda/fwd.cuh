// Forward kernel: FlashAttention-2 (Alg. 1) over the plan's query tiles.
//
// Grid (num_q_tiles + pad blocks, Hq); block of 4 warps, warp w owns query rows WARP_M w ..
// WARP_M w + WARP_M - 1 of the tile, MT = WARP_M / 16 m16 tiles (2 for BM = 128: every K or V
// fragment read from shared memory feeds two mma tiles, FlashAttention-2's 1/32 byte per FLOP).
// Q's fragments stay in registers where the budget allows (FwdConfig::q_in_regs), else they are
// read from the Q tile per k-step. Shared memory: Q [BM][D+8], then STAGES stages of K
// [KN][D+8] and V [KN][D+8] (V in its first DV columns: head_dim_v <= D, out [Tq, Hq, DV])
// (KN and STAGES from the launcher's tile_size: KN = 64, or 32 at D >= 96, BM = 128 and at
// D > 128, where BM = 64 only; the chunks walk the plan's row schedule, which does not depend
// on its key tile: a tile of BN = 128 keys is 2 or 4 chunks); K and V wait separately
// (KvPipeline), so Q K^T starts while V is in flight.
// Mask arithmetic runs only on partial key chunks (and on a ragged last chunk, for its missing
// rows). With a mask_mod its class of each chunk against the tile (UserMaskChunks, mask.cuh:
// generated interval arithmetic, O(1) per chunk, the same on every thread) decides before the
// chunk is loaded: empty, skipped (not loaded, no MMA); full, computed as the built-in
// schedule says; partial, the mask_mod tested pair by pair. A score_mod is applied to every
// visible pair, of full chunks too. A row that sees a NaN or
// inf (in q, or in k or v of a key it sees) writes NaN to out and lse; hidden keys never reach
// it (mask_scores, KvStages::zero_nonfinite).
// Every row of out and lse is written: a query tile's rows by its block (0 and -inf for a row
// without a visible key), the rows of no tile by the pad blocks (for_each_pad_run).
#pragma once

#include "common.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "pipeline.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

// The tiles come from the launcher (varlen/backends/cupy/traits.py, tile_size): KN keys per
// chunk and STAGES K/V stages; the static_asserts below state the constraints its choice meets.
template <int D_, int BM, int BN, int KN_, int STAGES_, int DV_ = D_>
struct FwdConfig {
    static constexpr int D = D_;
    static constexpr int DV = DV_;                       // head_dim_v: columns of V and O
    static constexpr int KN = KN_;                       // keys per chunk (a K or V stage)
    static constexpr int STAGES = STAGES_;               // K/V stages in flight
    static constexpr int NUM_WARPS = 4;
    static constexpr int NUM_THREADS = NUM_WARPS * WARP_SIZE;
    static constexpr int WARP_M = BM / NUM_WARPS;      // query rows per warp
    static constexpr int MT = WARP_M / WARP_ROWS;       // m16 tiles per warp
    static constexpr int STRIDE = smem_stride<D>();
    // Registers per lane of Q's fragments and of the accumulators. Q stays in registers when
    // both leave ~48 for addresses, softmax state and the cursor; the softcap's tanh keeps a
    // second fp32 value per score live (MT * KN / 2 more), which moves Q to shared memory at
    // D = 64, BM = 128 (48 bytes of spill on sm_90 otherwise). At D = 256 (64 + 144 = 208)
    // Q in registers spills too (224 bytes on sm_80, 364 on sm_90): it is read from shared
    // memory above D = 192. On sm_80 the budget is one register less: D = 96, BM = 128 with a
    // softcap (48 + 128 + 32 = 208) spilled 8 bytes there with Q in registers. Fitted to
    // ptxas: every other variant keeps its placement.
    static constexpr int Q_REGS = MT * D / 4;
    static constexpr int ACC_REGS = MT * (DV + KN) / 2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static constexpr int Q_BUDGET = 208;
#else
    static constexpr int Q_BUDGET = 207;
#endif
    __host__ __device__ static constexpr bool q_in_regs(bool has_softcap) {
        return D <= 192 && Q_REGS + ACC_REGS + (has_softcap ? MT * KN / 2 : 0) <= Q_BUDGET;
    }
    __host__ __device__ static constexpr int smem_elems(int stages) {
        return (BM + 2 * stages * KN) * STRIDE;
    }
    static constexpr int SMEM_ELEMS = smem_elems(STAGES);
    // Blocks per SM the registers must allow: two (128 threads x 2 leave ptxas every register
    // up to 255) with two m16 tiles per warp; three (168 registers) with one, up to D = 96.
    // (D = 32 with two tiles under 168 registers spills on sm_80 with a softcap.)
    static constexpr int MIN_BLOCKS = MT == 1 && D <= 96 ? 3 : 2;
    static_assert(BM % (NUM_WARPS * WARP_ROWS) == 0, "each warp owns whole m16 tiles");
    static_assert(KN % 16 == 0, "P V consumes key chunks in k-steps of 16");
    static_assert(D % 16 == 0, "Q K^T consumes the head dim in k-steps of 16");
    static_assert(DV <= D && DV % 16 == 0, "V and O of DV <= D columns (in K's stages and Q's "
                  "staging rows), whole 16-byte chunks per lane when stored");
    static_assert(D <= 128 || MT == 1, "above D = 128 a warp's O accumulators of 16 rows take "
                  "D / 2 registers: one m16 tile per warp (BM = 64)");
    static_assert(KN <= BN && BN % KN == 0, "a key chunk is a part of the plan's key tile, so "
                  "that the chunks of a tile inherit its full/partial flag");
    static_assert(KN == 32 || KN == 64, "key chunks of 32 or 64: the [16, KN] fp32 scores of "
                  "each m16 tile live in registers beside O");
    static_assert(KN == 32 || MT * (D + 64) / 2 < 160, "chunks of 64 keys only where O and S "
                  "of 64 keys take fewer than 160 registers per lane (at D = 96 and 128 with "
                  "BM = 128 they leave too few for the rest)");
    static_assert(D <= 128 || KN == 32, "above D = 128 chunks of 32 keys: half-tile stages keep "
                  "two blocks per SM at D = 192 (76 800 B, not 128 000 B)");
    static_assert(STAGES == 2 || STAGES == 3, "two or three K/V stages");
    // Shared memory per SM of an A100 (164 KiB) and what the driver reserves per block (1 KiB).
    static_assert(STAGES == 2 || 2 * (2 * smem_elems(3) + 1024) <= 164 * 1024,
                  "a third K/V stage only where two blocks of it still fit an A100 SM: a third "
                  "stage must never cost a block per SM");
};

// The A operand of S = Q K^T for a warp's MT m16 tiles: fragments held in registers
// (IN_REGS, loaded once per block) or read from the Q tile per k-step.
template <typename T, int D, int MT, bool IN_REGS>
struct QOperand {
    static constexpr int STRIDE = smem_stride<D>();
    const T* s_q;
    int row0;
    uint32_t frag[IN_REGS ? MT : 1][IN_REGS ? D / 16 : 1][4];

    // Call once the Q tile is in shared memory and published.
    __device__ __forceinline__ void load(int lane) {
        if constexpr (IN_REGS) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                #pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    ldmatrix_block<STRIDE, X4::ROWS_FIRST, false>(frag[mt][kk], s_q,
                                                                  row0 + WARP_ROWS * mt, kk * 16,
                                                                  lane);
                }
            }
        }
    }

    __device__ __forceinline__ void step(uint32_t (&a)[4], int mt, int kk, int lane) const {
        if constexpr (IN_REGS) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = frag[mt][kk][i];
        } else {
            ldmatrix_block<STRIDE, X4::ROWS_FIRST, false>(a, s_q, row0 + WARP_ROWS * mt, kk * 16,
                                                          lane);
        }
    }
};

// Where a query tile's output goes: row r of the tile is position first + r / PACK of query
// head head0 + r % PACK (PACK > 1: the packed heads of fwd_sm90), `rows` of them present.
// 64-bit offsets (T * H * D may exceed 2^31). The tile's first row is addressed once and its
// rows from there (with the first row's offset added per row, the sm_90a forward spilled 24 B
// at D = 128, BM = 64 with a softcap once the strides came from the params).
template <typename T, int D, int PACK = 1>
struct TileOutput {
    T* out;               // out [first][head0]: the tile's first row
    float* lse;           // lse [head0][first]
    int out_stride;       // one position further (Strides::row of out)
    int head_stride;      // one head further (Strides::head of out; PACK > 1)
    int64_t lse_stride;   // one head further in lse (PACK > 1)
    int rows;

    __device__ __forceinline__ T* row(int r) const {
        return out + static_cast<int64_t>(r / PACK) * out_stride +
               static_cast<int64_t>(r % PACK) * head_stride;
    }
    __device__ __forceinline__ float* lse_at(int r) const {
        return lse + static_cast<int64_t>(r % PACK) * lse_stride + r / PACK;
    }
};

template <typename T, int D, int PACK = 1>
__device__ __forceinline__ TileOutput<T, D, PACK> tile_output(const FwdParams& params,
                                                              const TileInfo& tile, int head0) {
    const Strides& s = params.out_strides;
    T* out = static_cast<T*>(params.out) + static_cast<int64_t>(tile.row) * s.row +
             static_cast<int64_t>(head0) * s.head;
    float* lse = params.lse + static_cast<int64_t>(head0) * params.lse_stride + tile.row;
    return TileOutput<T, D, PACK>{out, lse, s.row, s.head, params.lse_stride, tile.rows * PACK};
}

// O / l of this warp's rows, through its rows of the Q buffer, and their natural-log lse (one
// lane per quad writes it), both NaN for a row that saw a NaN or inf; rows past the tile are
// not written. `scale` multiplies O / l (dropout's 1 / (1 - p)), not the lse.
template <typename T, int D, int STRIDE, int MT, int PACK>
__device__ __forceinline__ void store_output(const float (&acc_o)[MT][D / 8][4],
                                             const OnlineSoftmax (&softmax)[MT], T* s_stage,
                                             const TileOutput<T, D, PACK>& dst,
                                             const WarpSlot& w, float scale = 1.f) {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv_l[2], row_lse[2];
        softmax[mt].finish(acc_o[mt], inv_l, row_lse);
        inv_l[0] *= scale;
        inv_l[1] *= scale;
        const int row0 = w.row0 + WARP_ROWS * mt;
        store_rows<T, D / 8, STRIDE>(acc_o[mt], inv_l, s_stage, row0, dst, 0, dst.rows, w.lane);
        const int r = row0 + w.lane / 4;
        if (w.lane % 4 == 0) {
            if (r < dst.rows) *dst.lse_at(r) = row_lse[0];
            if (r + 8 < dst.rows) *dst.lse_at(r + 8) = row_lse[1];
        }
    }
}

}  // namespace varlen

// Kernels live at global scope so that their name expressions are short.
using namespace varlen;

// Pad block i_pad of a forward grid of NUM_THREADS-thread blocks: out 0 and lse -inf on the
// rows of its windows that no query tile covers (for_each_pad_run).
template <typename T, int D, int NUM_THREADS>
__device__ __forceinline__ void write_forward_pad_rows(const FwdParams& params, int i_pad) {
    const PlanView& plan = params.plan;
    const int Hq = params.call.Hq;
    for_each_pad_run(plan.q_tiles, plan.num_q_tiles, plan.rows_q, pad_window<NUM_THREADS>(i_pad),
                     [&](int64_t begin, int64_t end) {
        zero_head_rows<D>(static_cast<T*>(params.out), params.out_strides, Hq, begin, end);
        #pragma unroll 1
        for (int h = 0; h < Hq; ++h) {
            float* p_lse = params.lse + static_cast<int64_t>(h) * params.lse_stride;
            #pragma unroll 1
            for (int64_t r = begin; r < end; ++r) p_lse[r] = neg_inf();
        }
    });
}

// DV: head_dim_v, the columns of V and out (DV < D: multi-head latent attention's 192 / 128).
// DROPOUT: attention dropout (dropout.cuh; params.dropout): each chunk's probabilities, once
// their row sums have them, lose the dropped pairs before P V; O / l is scaled by 1 / (1 - p).
template <typename T, int D, int BM, int BN, bool HAS_SOFTCAP, int KN, int STAGES, int DV = D,
          bool DROPOUT = false>
__global__ void __launch_bounds__(FwdConfig<D, BM, BN, KN, STAGES, DV>::NUM_THREADS,
                                  FwdConfig<D, BM, BN, KN, STAGES, DV>::MIN_BLOCKS)
varlen_fwd(const __grid_constant__ FwdParams params) {
    using Cfg = FwdConfig<D, BM, BN, KN, STAGES, DV>;
    constexpr int MT = Cfg::MT;
    const PlanView& plan = params.plan;
    const CallParams& call = params.call;
    // The pad blocks come first in the grid: query tiles run in reverse slot order (TileBlock).
    const int i_pad = pad_block_index(static_cast<int>(gridDim.x - 1 - blockIdx.x),
                                      plan.num_q_tiles);
    if (i_pad >= 0) {
        write_forward_pad_rows<T, DV, Cfg::NUM_THREADS>(params, i_pad);
        return;
    }
    const TileBlock<false, Cfg::WARP_M> b(plan, call);
    if (b.tile.seq < 0) return;
    const WarpSlot& w = b.w;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* s_q = reinterpret_cast<T*>(smem_raw);                          // [BM][STRIDE]
    const KvStages<T, D, KN, Cfg::NUM_THREADS, STAGES, DV> kv(
        s_q + BM * Cfg::STRIDE, static_cast<const T*>(params.k), params.k_strides,
        static_cast<const T*>(params.v), params.v_strides, b.i_khead);
    b.template load_rows<BM, D, Cfg::NUM_THREADS>(s_q, static_cast<const T*>(params.q),
                                                  params.q_strides);
    cp_async_commit();
    PartnerCursor<KN> keys = key_cursor<KN>(plan, b.i_tile);
    const SeqPolicy pol = SeqPolicy::load(plan, b.tile.seq);
    // With a mask_mod, a key chunk its class empties is not loaded, and only the chunks it
    // leaves partial evaluate it
    const UserMaskChunks<false> keep{params.mods, b.tile};
    using Pipeline = KvPipeline<STAGES, KN>;
    Pipeline pipe;
    pipe.start(keys, kv, keep);
    constexpr bool Q_IN_REGS = Cfg::q_in_regs(HAS_SOFTCAP);
    QOperand<T, D, MT, Q_IN_REGS> q_op{s_q, w.row0};
    if constexpr (Q_IN_REGS) {
        cp_async_wait<Pipeline::PROLOGUE_GROUPS>();   // Q, older than every K/V group
        __syncthreads();
        q_op.load(w.lane);
    }

    // [MT][16, DV] output accumulators and [MT][16, KN] scores, then probabilities, of this
    // warp's rows
    float acc_o[MT][DV / 8][4];
    float acc_s[MT][KN / 8][4];
    OnlineSoftmax softmax[MT];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        zero_acc(acc_o[mt]);
        softmax[mt].init();
    }
    pipe.run(keys, kv, [&](const Chunk& c, int stage) {
        kv.zero_nonfinite(c, stage);
    }, [&](const Chunk& c, int stage) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero_acc(acc_s[mt]);
        gemm_mt<T, MT, KN / 8, D / 16, Cfg::STRIDE, true>(acc_s, [&](uint32_t (&a)[4], int mt,
                                                                     int kk) {
            q_op.step(a, mt, kk, w.lane);
        }, kv.k_at(stage), 0, w.lane);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mask_scores<HAS_SOFTCAP>(acc_s[mt], query_rows_mask(pol, b.tile, w, c, mt,
                                                                params.mods, b.i_head),
                                     call, w.lane);
            softmax[mt].update(acc_s[mt], acc_o[mt]);
            if constexpr (DROPOUT) {
                const TileMask<false> m = query_rows_mask(pol, b.tile, w, c, mt, params.mods,
                                                          b.i_head);
                drop_probs(acc_s[mt], keep_query_rows<KN / 8>(
                    dropout_draw(params.dropout, b.tile.seq, b.i_head), m.row_pos, m.col_pos0,
                    w.lane));
            }
        }
    }, [&](const Chunk&, int stage) {
        gemm_mt<T, MT, DV / 8, KN / 16, Cfg::STRIDE, false>(acc_o, [&](uint32_t (&a)[4], int mt,
                                                                      int kk) {
            c_to_a<T>(a, acc_s[mt], kk);
        }, kv.v_at(stage), 0, w.lane);
    }, keep);
    store_output<T, DV, Cfg::STRIDE>(acc_o, softmax, s_q,
                                     tile_output<T, DV>(params, b.tile, b.i_head), w,
                                     DROPOUT ? params.dropout.scale : 1.f);
}
