// dK/dV kernel (FlashAttention-2, Alg. 2, the loop over query tiles for one key tile),
// optionally also accumulating dQ with fp32 atomics.
//
// Grid (num_k_tiles, Hk); block BN / 16 warps, warp w owns key rows 16w .. 16w + 15 of the
// tile. The block visits, for each of the G = Hq / Hk query heads of its key head, the query
// tiles the transposed schedule (k_sched) lists, in chunks of BQ rows, and keeps dK and dV of
// its keys in registers over all of them: each dK/dV row is written once, no atomics, so dK
// and dV are deterministic (0 for a key no query sees; varlen_bwd_preprocess writes the rows
// of no key tile). Per chunk, in transposed form (rows = keys, columns = queries):
//     S^T  = K Q^T                     [BN, BQ]
//     P^T  = exp2(S^T * LOG2E - lse2)  (mask on partial tiles)
//     dP^T = V dO^T                    [BN, BQ]
//     dS^T = P^T * (dP^T - delta) * softmax_scale   (times 1 - tanh^2 with a softcap)
//     dV  += P^T dO,  dK += dS^T Q     [BN, D]
//     dQ  += dS K  (ATOMIC_DQ: dS^T goes through shared memory, then fp32 atomics; with
//                  ORDERED_DQ each query chunk's additions come in key-slot order,
//                  bwd_dq_ordered.cuh: bitwise repeatable)
// With DROPOUT, P^T in dV and dP^T are first multiplied by the pair's keep factor, 1 / (1 - p)
// or 0 (dropout.cuh, drawn again per subtile).
// With a mask_mod its class of each query chunk against the key tile (UserMaskChunks, mask.cuh)
// decides before the chunk is loaded: empty, skipped (nothing loaded, computed or added; with
// ordered dQ the first pass still walks it, to take the block's turn at the chunk's dQ counter:
// OrderedDq::pass, the same chunks on every run); full,
// computed as the built-in schedule says; partial, the mask_mod tested pair by pair. A
// score_mod is applied to every visible pair.
// Above D = 128 the dK, dV accumulators of a warp (D registers per lane) do not fit: the block
// walks its query chunks D_PARTS = 2 times, each pass accumulating half of dK's and dV's columns
// from the full S^T and dP^T (recomputed per pass, about 1.4 times the work at D = 256); dQ
// (atomic or ordered) is added in the first pass only, and each pass writes its columns from
// registers.
// With head_dim_v DV < D (multi-head latent attention), V, dO and dV have DV columns: dP^T
// contracts over DV, dV's accumulators take DV / D_PARTS columns; V and dO lie in the rows of
// K and Q (D + 8), their first DV columns.
// Shared memory: K, V [BN][D+8]; two stages of Q, dO [BQ][D+8] and lse2, delta [BQ] (all by
// cp.async, one group per chunk); dS^T [BN][BQ+8] with ATOMIC_DQ.
// A key row with a pair it sees holding a NaN or inf operand writes NaN to dK and dV, and that
// pair's dS makes the query's dQ NaN; hidden pairs never reach either (softmax_backward,
// QueryStages::zero_nonfinite, and the key tile's own check with ATOMIC_DQ).
#pragma once

#include "bwd_dq_ordered.cuh"
#include "common.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "pipeline.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

template <int D_, int BN_, int BQ_, bool ATOMIC_DQ, int DV_ = D_>
struct DkdvConfig {
    static constexpr int D = D_;
    static constexpr int DV = DV_;       // head_dim_v: columns of V, dO and dV (in tiles of D)
    static constexpr int BN = BN_;
    static constexpr int BQ = BQ_;
    static constexpr int NUM_WARPS = BN / WARP_ROWS;
    static constexpr int NUM_THREADS = NUM_WARPS * WARP_SIZE;
    static constexpr int STRIDE = smem_stride<D>();
    static constexpr int DS_STRIDE = smem_stride<BQ>();
    // dQ [BQ, D] of a chunk: DQ_GROUPS groups of 16 query rows, each split over DQ_SPLIT warps
    // by columns (every warp busy), produced DQ_COLS columns at a time to bound the registers.
    static constexpr int DQ_GROUPS = BQ / WARP_ROWS;
    static constexpr int DQ_SPLIT = NUM_WARPS / DQ_GROUPS;
    static constexpr int DQ_COLS = 16;
    // Query columns of a warp's register tiles S^T, dP^T [16, BQ_REG]: the chunk, or at D > 64
    // 32 of its columns at a time (SUBTILES per chunk), so that they and dK, dV (D registers
    // per lane) fit beside each other: a chunk of 64 at once spilled 8-176 B at D = 96 and 128
    // (BN = 128). The chunk's loads, barriers and dQ phase stay those of BQ rows.
    static constexpr int BQ_REG = D > 64 && BQ > 32 ? 32 : BQ;
    static constexpr int SUBTILES = BQ / BQ_REG;
    // Passes over the query chunks, each accumulating DC = D / D_PARTS columns of dK and dV:
    // a warp's dK and dV of 16 rows take D registers per lane, 256 at D = 256. Each pass
    // recomputes S^T and dP^T in full (the D-wide products); dQ (ATOMIC_DQ) is added once, in
    // the first pass. Each pass writes its columns straight from the fragments (store_fragments:
    // K and V, the staging rows of a single pass, are still read by the next pass; staging
    // through shared memory in the last pass only spilled 8 bytes on sm_80 at D = 256).
    static constexpr int D_PARTS = D > 128 ? 2 : 1;
    static constexpr int DC = D / D_PARTS;
    static constexpr int DVC = DV / D_PARTS;     // dV's columns per pass
    // Ordered dQ hands its turn on by storing rank + 1, the rank kept in a register (4 warps up
    // to D = 128), or by a release increment (bwd_dq_ordered.cuh): whichever ptxas allocates
    // without a spill.
    static constexpr bool CARRY_RANK = D_PARTS == 1 && NUM_WARPS <= 4;
    // Blocks per SM the register budget must allow. Two (of 128 threads) leave ptxas all 255
    // registers; stated, it keeps ptxas from squeezing D = 32 under 168 registers for a third
    // block with a spill on sm_80. On sm_90 D = 32 fits three blocks without one. With 8 warps
    // (BN = 128) one block: 256 threads of up to 255 registers fill the register file.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static constexpr int MIN_BLOCKS = NUM_WARPS > 4 ? 1 : D <= 32 ? 3 : 2;
#else
    static constexpr int MIN_BLOCKS = NUM_WARPS > 4 ? 1 : 2;
#endif
    static constexpr int T_ELEMS = 2 * BN * STRIDE + 2 * STAGES * BQ * STRIDE +
                                   (ATOMIC_DQ ? BN * DS_STRIDE : 0);
    static constexpr int F_ELEMS = 2 * STAGES * BQ;
    static_assert(BN % WARP_ROWS == 0, "each warp owns 16 key rows");
    static_assert(NUM_WARPS >= 1 && NUM_WARPS <= 8, "1 to 8 warps per block");
    static_assert(BQ % 16 == 0 && BQ <= NUM_THREADS, "query chunks of k-steps of 16; one "
                  "thread per chunk row loads lse2 and delta");
    static_assert(D % 16 == 0, "head dim in k-steps of 16");
    static_assert(NUM_WARPS % DQ_GROUPS == 0 && D % (DQ_COLS * DQ_SPLIT) == 0,
                  "every warp takes an equal part of dQ: whole row groups, whole column slices");
    static_assert(DC % 16 == 0 && DVC % 16 == 0, "whole pairs of n-blocks per part");
    static_assert(DV <= D && (DV == D || D < 8 * DV), "V and dO of DV <= D columns, in the "
                  "stages of K and Q; a K chunk's NaN marks a V column of its own (D / DV < 8)");
    static_assert(BQ % BQ_REG == 0 && BQ_REG % 16 == 0, "whole register tiles of k-steps");
};

// lse2 and delta of the chunk's query rows, one per column of the transposed tiles.
struct ColStats {
    const float* s_lse2;     // [BQ] in shared memory
    const float* s_delta;    // [BQ]

    __device__ __forceinline__ float lse2(int, int col) const { return s_lse2[col]; }
    __device__ __forceinline__ float delta(int, int col) const { return s_delta[col]; }
};

// The kernel's shared memory: Cfg::T_ELEMS elements of T, then Cfg::F_ELEMS floats.
template <typename T, typename Cfg>
struct DkdvSmem {
    T* k;            // [BN][STRIDE]
    T* v;            // [BN][STRIDE]
    T* q;            // [STAGES][BQ][STRIDE]
    T* dout;         // [STAGES][BQ][STRIDE]
    T* ds;           // [BN][DS_STRIDE], dS^T (ATOMIC_DQ only)
    float* lse2;     // [STAGES][BQ]
    float* delta;    // [STAGES][BQ]

    __device__ __forceinline__ explicit DkdvSmem(unsigned char* raw)
        : k(reinterpret_cast<T*>(raw)), v(k + Cfg::BN * Cfg::STRIDE), q(v + Cfg::BN * Cfg::STRIDE),
          dout(q + STAGES * Cfg::BQ * Cfg::STRIDE), ds(dout + STAGES * Cfg::BQ * Cfg::STRIDE),
          lse2(reinterpret_cast<float*>(k + Cfg::T_ELEMS)), delta(lse2 + STAGES * Cfg::BQ) {}
};

// A query chunk of one query head, through the shared stages: Q, dO, lse2 and delta. Rows past
// the chunk get zeros and lse2 = +inf, so their probabilities are exactly 0.
template <typename T, typename Cfg>
struct QueryStages {
    static constexpr int STAGE_ELEMS = Cfg::BQ * Cfg::STRIDE;
    DkdvSmem<T, Cfg> s;
    const BwdParams& params; // q, dout [Tq, Hq, D]; lse2, delta [Hq, Tq]
    int head0;               // the first query head of the block's key head

    __device__ __forceinline__ void load(const Chunk& c, int stage) const {
        const int head = head0 + c.head;
        load_tile_async<Cfg::BQ, Cfg::D, Cfg::NUM_THREADS>(
            s.q + stage * STAGE_ELEMS,
            head_rows(static_cast<const T*>(params.q), params.q_strides, head), c.row, c.rows);
        load_tile_async<Cfg::BQ, Cfg::D, Cfg::NUM_THREADS, Cfg::DV>(
            s.dout + stage * STAGE_ELEMS,
            head_rows(static_cast<const T*>(params.dout), params.dout_strides, head), c.row,
            c.rows);
        // lse2 and delta travel in the same group as Q and dO (no exposed global load before
        // the barrier). A row past the chunk is stored directly: lse2 = +inf, delta = 0. The
        // stage was released by the barrier that ended its last use.
        const int r = threadIdx.x;
        if (r < Cfg::BQ) {
            float* p_lse2 = s.lse2 + stage * Cfg::BQ + r;
            float* p_delta = s.delta + stage * Cfg::BQ + r;
            if (r < c.rows) {
                const int64_t idx = static_cast<int64_t>(head) * params.plan.rows_q + c.row + r;
                cp_async_4(p_lse2, params.lse2 + idx, true);
                cp_async_4(p_delta, params.delta + idx, true);
            } else {
                *p_lse2 = pos_inf();
                *p_delta = 0.f;
            }
        }
    }

    // On a partially masked chunk, where hidden pairs have P^T = dS^T = 0: a NaN or inf in this
    // thread's chunks of Q or dO (the right-hand factors of dK += dS^T Q and dV += P^T dO) is
    // zeroed, and the query row's delta becomes NaN, which reaches exactly the pairs that see
    // the row (softmax_backward). Several threads may flag one row: atomically. Call it in
    // for_each_chunk's `own` step after a barrier: the delta copies, issued by other threads,
    // must have landed before a flag is added.
    __device__ __forceinline__ void zero_nonfinite(const Chunk& c, int stage) const {
        float* p_delta = s.delta + stage * Cfg::BQ;
        const auto flag = [&](int r, int) { atomicAdd(p_delta + r, nan_f()); };
        zero_nonfinite_chunks<Cfg::BQ, Cfg::D, Cfg::NUM_THREADS>(s.q + stage * STAGE_ELEMS, c.rows,
                                                                 flag);
        zero_nonfinite_chunks<Cfg::BQ, Cfg::D, Cfg::NUM_THREADS, Cfg::DV>(
            s.dout + stage * STAGE_ELEMS, c.rows, flag);
    }

    __device__ __forceinline__ const T* q_at(int stage) const { return s.q + stage * STAGE_ELEMS; }
    __device__ __forceinline__ const T* do_at(int stage) const {
        return s.dout + stage * STAGE_ELEMS;
    }
    __device__ __forceinline__ ColStats stats_at(int stage) const {
        return ColStats{s.lse2 + stage * Cfg::BQ, s.delta + stage * Cfg::BQ};
    }
};

// Writes a warp's [16, 8 NB] fp32 tile as T to rows row .. row + 15 of `dst` (those <
// valid_rows) straight from its C fragments: each lane's two adjacent columns of rows g and
// g + 8 as one 4-byte store, no shared memory and no barrier (the dK, dV columns of each pass
// when D_PARTS > 1, once per pass).
template <typename T, int NB>
__device__ __forceinline__ void store_fragments(const float (&acc)[NB][4], const HeadRows<T>& dst,
                                                int row, int valid_rows, int lane) {
    const int g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        if (g + 8 * half < valid_rows) {
            T* p = dst.row(row + g + 8 * half) + 2 * t;
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                *reinterpret_cast<uint32_t*>(p + nb * 8) =
                    ElemTraits<T>::pack(acc[nb][2 * half], acc[nb][2 * half + 1]);
            }
        }
    }
}

// dQ += dS K for one query chunk with fp32 atomics: dS^T [BN, BQ] goes through shared memory,
// then every warp takes a [16, D / DQ_SPLIT] part of dQ [BQ, D]: the 16 query rows qg = warp %
// DQ_GROUPS, columns split DQ_SPLIT ways, DQ_COLS at a time. The warp's dS fragments (A operand,
// BN / 16 k-steps) are read once and kept for all its column slices (DS_HELD) or read per
// slice. `order` (UnorderedDq or
// OrderedDq) makes the block wait for its turn at the chunk before the first addition and hand
// it on after the last.
// With SUBTILES > 1 the caller has staged dS^T already and ds_t is not read.
template <typename T, typename Cfg, bool DS_HELD, typename Order>
__device__ __forceinline__ void add_dq_atomic(const float (&ds_t)[Cfg::BQ_REG / 8][4], T* s_ds,
                                              const T* s_k, const HeadRows<float>& dq_accum,
                                              const Chunk& c, const WarpSlot& w,
                                              const Order& order) {
    constexpr int NB = Cfg::DQ_COLS / 8;
    constexpr int KSTEPS = Cfg::BN / 16;
    constexpr int SLICES = Cfg::D / Cfg::DQ_COLS / Cfg::DQ_SPLIT;    // per warp
    const float one[2] = {1.f, 1.f};
    const int turn = order.acquire(c);
    if constexpr (Cfg::SUBTILES == 1)
        stage_rows<T, Cfg::BQ / 8, Cfg::DS_STRIDE>(ds_t, one, s_ds, w.row0, w.lane);
    __syncthreads();
    const int qg = w.warp % Cfg::DQ_GROUPS;
    const int part = w.warp / Cfg::DQ_GROUPS;
    // [16, BN] dS of rows qg, as KSTEPS A fragments held for every slice (DS_HELD), or read
    // again per slice
    uint32_t a_ds[DS_HELD ? KSTEPS : 1][4];
    if constexpr (DS_HELD) {
        #pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            ldmatrix_block<Cfg::DS_STRIDE, X4::COLS_FIRST, true>(a_ds[kk], s_ds, kk * 16,
                                                                 qg * WARP_ROWS, w.lane);
        }
    }
    #pragma unroll
    for (int i = 0; i < SLICES; ++i) {
        const int col0 = (part * SLICES + i) * Cfg::DQ_COLS;
        // [16, DQ_COLS] slice of dQ
        float acc_q[NB][4];
        zero_acc(acc_q);
        gemm_16<T, NB, KSTEPS, Cfg::STRIDE, false>(acc_q, [&](uint32_t (&a)[4], int kk) {
            if constexpr (DS_HELD) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) a[j] = a_ds[kk][j];
            } else {
                ldmatrix_block<Cfg::DS_STRIDE, X4::COLS_FIRST, true>(a, s_ds, kk * 16,
                                                                     qg * WARP_ROWS, w.lane);
            }
        }, s_k, col0, w.lane);
        atomic_add_rows(acc_q, dq_accum, c.row + qg * WARP_ROWS, c.rows - qg * WARP_ROWS, col0,
                        w.lane);
    }
    // the rank in a register or the counter's increment (CARRY_RANK, bwd_dq_ordered.cuh)
    order.template release<Cfg::CARRY_RANK>(c, turn);
}

}  // namespace varlen

using namespace varlen;

// DV: head_dim_v, the columns of V, dO and dV (DV < D: multi-head latent attention).
// DROPOUT: attention dropout (dropout.cuh; params.dropout): each subtile draws its keep bits
// again, and P (for dV) and dP take 1 / (1 - p) or 0 (softmax_backward).
template <typename T, int D, int BN, int BQ, bool HAS_SOFTCAP, bool ATOMIC_DQ,
          bool ORDERED_DQ = false, int DV = D, bool DROPOUT = false>
__global__ void __launch_bounds__(DkdvConfig<D, BN, BQ, ATOMIC_DQ, DV>::NUM_THREADS,
                                  DkdvConfig<D, BN, BQ, ATOMIC_DQ, DV>::MIN_BLOCKS)
varlen_bwd_dkdv(const __grid_constant__ BwdParams params) {
    using Cfg = DkdvConfig<D, BN, BQ, ATOMIC_DQ, DV>;
    static_assert(ATOMIC_DQ || !ORDERED_DQ, "ordered dQ is atomic dQ in a fixed order");
    const PlanView& plan = params.plan;
    const CallParams& call = params.call;
    // How the register tiles of a chunk are walked and whether the dQ phase keeps its dS
    // fragments: the choice ptxas allocates without a spill, on sm_80 and sm_90 alike (so the
    // host emulation runs the GPUs' choice). One register tile at a time; at D = 128 with 8
    // warps (BN = 128) the unordered kernel without a softcap reads dS per slice (holding it
    // spilled 108 B on sm_90; reading it per slice at D = 64, 32 B), every other kernel holds
    // it. (Unrolling the tiles with dS per slice was the sm_80 ordered kernel's choice while
    // the cursor walked the tile schedule.) With dropout above D = 128 (two passes) dS is read
    // per slice too: holding it spilled 16 B on sm_90 at D = 192, Dv = 128 with a softcap.
    constexpr bool DS_HELD = !(Cfg::NUM_WARPS > 4 && D > 96 && !ORDERED_DQ && !HAS_SOFTCAP) &&
                             !(DROPOUT && Cfg::D_PARTS > 1);
    const TileBlock<true> b(plan, call);
    if (b.tile.seq < 0) return;
    const WarpSlot& w = b.w;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const DkdvSmem<T, Cfg> smem(smem_raw);
    const QueryStages<T, Cfg> qs{smem, params, b.i_khead * b.group};
    b.load_rows<BN, D, Cfg::NUM_THREADS>(smem.k, static_cast<const T*>(params.k), params.k_strides);
    b.load_rows<BN, D, Cfg::NUM_THREADS, DV>(smem.v, static_cast<const T*>(params.v),
                                             params.v_strides);
    const SeqPolicy pol = SeqPolicy::load(plan, b.tile.seq);
    constexpr int DC = Cfg::DC;
    constexpr int DVC = Cfg::DVC;
    bool first = true;
    #pragma unroll 1
    for (int part = 0; part < Cfg::D_PARTS; ++part) {
        const int col0 = part * DC;
        PartnerCursor<BQ> queries = query_cursor<BQ>(plan, b.i_tile, b.group);
        // [16, DC] dK and [16, DVC] dV accumulators of this warp's key rows, columns col0 ..
        // and vcol0 ..
        const int vcol0 = part * DVC;
        float acc_dk[DC / 8][4];
        float acc_dv[DVC / 8][4];
        zero_acc(acc_dk);
        zero_acc(acc_dv);
        for_each_chunk(queries, [&](const Chunk& c, int stage) {
            if (!c.mod_empty) qs.load(c, stage);
        }, [&](const Chunk& c, int stage) {
            if constexpr (ATOMIC_DQ) {
                if (first) {
                    first = false;
                    // K is the right-hand factor of dQ += dS K: a NaN or inf in a key row moves
                    // to its V row, which meets queries only in dP^T = V dO^T, pair by pair.
                    // This thread's own K and V copies (the first group): no barrier needed.
                    // With DV < D a thread's K chunks are not its V chunks: a barrier first (every
                    // V copy landed), and K's chunk col marks V column col % DV + col / DV
                    // (col a multiple of 8, D / DV < 8: one writer per element).
                    if constexpr (DV != D) __syncthreads();
                    zero_nonfinite_chunks<BN, D, Cfg::NUM_THREADS>(smem.k, b.tile.rows,
                                                                   [&](int r, int col) {
                        smem.v[r * Cfg::STRIDE + (DV == D ? col : col % DV + col / DV)] =
                            ElemTraits<T>::from_float(nan_f());
                    });
                }
            }
            if (c.mod_empty) {
                // a chunk the mask_mod's class empties, kept by the ordered dQ's first pass
                // only: nothing loaded, computed or added; the block's turn at its dQ taken
                // and handed on by the leader (OrderedDq::pass)
                if constexpr (ORDERED_DQ) {
                    OrderedDq{params.dq_order, plan, call, b.tile, qs.head0}.pass(c);
                }
            } else if (!c.full) {
                // Every thread's lse2/delta copies of the chunk have landed before any flag.
                __syncthreads();
                qs.zero_nonfinite(c, stage);
            }
        }, [&](const Chunk& c, int stage) {
            if (c.mod_empty) return;     // its dQ turn was taken in `own`
            // [16, BQ_REG] S^T, then P^T, and dP^T, then dS^T, of this warp's key rows, for
            // query columns col .. col + BQ_REG - 1 of the chunk
            constexpr int BQ_REG = Cfg::BQ_REG;
            float acc_s[BQ_REG / 8][4];
            float acc_dp[BQ_REG / 8][4];
            #pragma unroll 1
            for (int sub = 0; sub < Cfg::SUBTILES; ++sub) {
                const int col = sub * BQ_REG;
                // the columns as a chunk of their own (no rows: all masked, P^T = dS^T = 0)
                const Chunk cols = c.from(col);
                ColStats stats = qs.stats_at(stage);
                stats.s_lse2 += col;
                stats.s_delta += col;
                const T* s_q = qs.q_at(stage) + col * Cfg::STRIDE;
                const T* s_do = qs.do_at(stage) + col * Cfg::STRIDE;
                TileMask<true> mask = key_rows_mask<BN>(pol, b.tile, w, cols, &params.mods,
                                                        qs.head0 + c.head);
                mask.aux_grads = part == 0;     // once per pair, whatever D_PARTS
                if constexpr (DROPOUT) {
                    const DropoutDraw d = dropout_draw(params.dropout, b.tile.seq,
                                                       qs.head0 + c.head);
                    const TileDropout<BQ_REG / 8> drop{
                        keep_key_rows<BQ_REG / 8>(d, mask.row_pos, mask.col_pos0, w.lane),
                        params.dropout.scale};
                    recompute_p_ds<HAS_SOFTCAP, T, D, DV>(acc_s, acc_dp, smem.k, smem.v, s_q,
                                                          s_do, mask, stats, call, w, drop);
                } else {
                    recompute_p_ds<HAS_SOFTCAP, T, D, DV>(acc_s, acc_dp, smem.k, smem.v, s_q,
                                                          s_do, mask, stats, call, w);
                }
                gemm_pb<T, DVC / 8, BQ_REG / 8, Cfg::STRIDE>(acc_dv, acc_s, s_do + vcol0, w.lane);
                gemm_pb<T, DC / 8, BQ_REG / 8, Cfg::STRIDE>(acc_dk, acc_dp, s_q + col0, w.lane);
                if constexpr (ATOMIC_DQ && Cfg::SUBTILES > 1) {
                    // these columns of dS^T to shared memory for the dQ phase: s_ds was
                    // released by the barrier that ended the last step
                    if (part == 0) {
                        const float one[2] = {1.f, 1.f};
                        stage_rows<T, BQ_REG / 8, Cfg::DS_STRIDE>(acc_dp, one, smem.ds + col,
                                                                   w.row0, w.lane);
                    }
                }
            }
            if constexpr (ATOMIC_DQ) {
                if (part == 0) {
                    const auto dq_rows = head_rows(params.dq_accum, packed_strides<D>(call.Hq),
                                                   qs.head0 + c.head);
                    if constexpr (ORDERED_DQ) {
                        add_dq_atomic<T, Cfg, DS_HELD>(acc_dp, smem.ds, smem.k, dq_rows, c, w,
                                              OrderedDq{params.dq_order, plan, call, b.tile,
                                                        qs.head0});
                    } else {
                        add_dq_atomic<T, Cfg, DS_HELD>(acc_dp, smem.ds, smem.k, dq_rows, c, w,
                                              UnorderedDq{});
                    }
                }
            }
        }, UserMaskChunks<true, !(ORDERED_DQ && DROPOUT)>{params.mods, b.tile,
                                                          ORDERED_DQ && part == 0});
        HeadRows<T> dk_rows = head_rows(static_cast<T*>(params.dk), params.dk_strides, b.i_head);
        HeadRows<T> dv_rows = head_rows(static_cast<T*>(params.dv), params.dv_strides, b.i_head);
        dk_rows.p += col0;
        dv_rows.p += vcol0;
        if constexpr (Cfg::D_PARTS > 1) {
            store_fragments(acc_dk, dk_rows, b.tile.row + w.row0, b.tile.rows - w.row0, w.lane);
            store_fragments(acc_dv, dv_rows, b.tile.row + w.row0, b.tile.rows - w.row0, w.lane);
        } else {
            // Through this warp's rows of K and V, which nobody reads any more.
            const float one[2] = {1.f, 1.f};
            store_rows<T, DC / 8, Cfg::STRIDE>(acc_dk, one, smem.k, w.row0, dk_rows, b.tile.row,
                                               b.tile.rows, w.lane);
            store_rows<T, DVC / 8, Cfg::STRIDE>(acc_dv, one, smem.v, w.row0, dv_rows, b.tile.row,
                                               b.tile.rows, w.lane);
        }
    }
}
