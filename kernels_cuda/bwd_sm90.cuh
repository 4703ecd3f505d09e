// dK/dV kernel for sm_90a with atomic dQ: what varlen_bwd_dkdv<..., ATOMIC_DQ = true> computes
// (FlashAttention-2, Alg. 2, the loop over query chunks for one key tile), with the operands moved
// by TMA and multiplied by wgmma, warp-specialised as in FlashAttention-3 (stage 1: no overlap of
// one chunk's products with the next chunk's). docs/hopper.md, "The sm_90a backward, stage 1",
// has the design.
//
// Grid (num_k_tiles, Hk), as varlen_bwd_dkdv. Block: warpgroup 0 is the producer, warpgroups
// 1 .. NC the consumers, each owning 64 key rows of the tile (BN = 64 NC) and, at D = 256, half
// of the head dim: two consumers share the 64 keys of a tile (BN = 64), each with dK, dV and dQ
// of 128 columns (dK and dV of all 256 would take 256 accumulator registers per thread), both
// computing the tile's S^T and dP^T over all 256, in query subtiles of 32. Shared memory,
// 1024-byte aligned, every tile in boxes of 64 columns (128 bytes, 128B swizzle):
//   K, V [D / 64][BN][64] (TMA, once); Q, dO [STAGES][D / 64][BQ][64] (TMA, per query chunk);
//   dS [NC][BQ][64] (per consumer: its keys' dS, written by stmatrix.trans); lse2, delta
//   [STAGES][BQ] (plain loads by the producer); the chunk of each stage; the mbarriers.
// Per query chunk, consumer warpgroup c (keys 64 c .. 64 c + 63 of the tile, rows = keys; at
// D = 256 keys 0 .. 63 and columns DC c .. DC c + DC - 1, DC = D / 2, elsewhere DC = D):
//     S^T  = K Q^T, dP^T = V dO^T                      wgmma SS, both K-major   [64, BQ]
//     P^T, dS^T = softmax_backward (mask.cuh, softmax.cuh unchanged)
//     dV  += P^T dO, dK += dS^T Q                      wgmma RS, B MN-major     [64, DC]
//     dQ  += dS K  (this warpgroup's 64 keys, or the   wgmma SS, A = dS K-major from shared
//           tile's with DQ_BY_COLUMNS)              memory, B = K MN-major   [BQ, 64] slices
//                                                      of its DQ_WIDTH columns
// and dQ goes to dq_accum by fp32 reductions, as in the mma.sync kernel (the preprocessing and
// varlen_bwd_dq_convert serve both unchanged). With two consumer warpgroups at D = 128 each
// multiplies the whole tile's dS (both warpgroups' buffers) into its half of dQ's columns: one
// reduction per dQ element and chunk (DQ_BY_COLUMNS); at D = 64 each adds its own keys' part
// over all columns (two reductions per element); at D = 256 each adds its own columns.
//
// ORDERED_DQ (deterministic=True): the additions to one query chunk's dQ happen in a fixed
// order, as in the mma.sync kernel (bwd_dq_ordered.cuh): the key tiles in slot order, and
// inside a tile the first consumer warpgroup's part of each column slice before the second's
// (at D = 128 and 256 the two add disjoint columns: no order between them).
// The first thread of the last consumer warpgroup waits for the tile's turn, the consumer
// warpgroups pass a barrier of their own (the producer goes on loading), and after the last
// slice every consumer thread fences, passes it again, and the same thread hands the turn on.
//
// Non-finite values follow the mma.sync kernel (docs/semantics.md): the producer zeroes the K
// rows past the tile (another sequence's rows or padding, which dQ += dS K meets with dS = 0) and
// moves a NaN or inf of a present K row into its V row, which meets queries only pair by pair in
// dP^T; on a partial query chunk it zeroes the Q and dO rows past the chunk and any present row
// holding a NaN or inf, whose delta becomes NaN (QueryStages::zero_nonfinite).
#pragma once

#include "bwd_dkdv.cuh"
#include "bwd_dq_ordered.cuh"
#include "common.cuh"
#include "fwd_sm90.cuh"
#include "mask.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

// The query chunk a stage holds, as the producer's cursor gave it (the consumers walk no cursor
// of their own: its state would take registers from the accumulators); `valid` 0 ends the walk,
// else it is 1 + the mask_mod's class of the chunk against the key tile (`chunk_class`).
struct StagedChunk {
    Chunk chunk;
    int valid;

    // Read where it is used (volatile: the compiler keeps no copy in registers across the
    // chunk's products, where the accumulators need them all).
    __device__ __forceinline__ Chunk load() const {
        const volatile Chunk& c = chunk;
        return Chunk{c.row, c.rows, c.pos, c.head, c.full};
    }
};

template <int D_, int BN_, int BQ_>
struct BwdSm90Config {
    static constexpr int D = D_;
    static constexpr int BN = BN_;
    static constexpr int BQ = BQ_;
    static constexpr int WG_THREADS = 128;               // a warpgroup: 4 warps
    static constexpr int WG_ROWS = 64;                   // the M of wgmma: key rows per consumer
    static constexpr int KEY_GROUPS = BN / WG_ROWS;      // consumers' groups of 64 key rows
    static constexpr int COL_PARTS = D == 256 ? 2 : 1;   // consumers per group, by column
    static constexpr int DC = D / COL_PARTS;             // dK, dV, dQ columns per consumer
    static constexpr int NUM_CONSUMERS = KEY_GROUPS * COL_PARTS;
    // Query subtiles per chunk: at D = 256 two of 32 queries, so that S^T and dP^T take 32
    // registers each beside dK and dV's 128 (wgmma N = 32); the same with a mask_mod
    // (mods.cuh), whose answers for 64 queries (user_bits) and their arithmetic spilled
    // (8-28 B at D = 128, BN = 128)
    static constexpr int SUBTILES = COL_PARTS == 2 || HAS_MASK_MOD ? 2 : 1;
    static constexpr int BQS = BQ / SUBTILES;
    static constexpr int NUM_THREADS = WG_THREADS * (1 + NUM_CONSUMERS);
    static constexpr int STAGES = 2;
    static constexpr int BOX_COLS = 64;                  // 128 bytes of 16-bit elements
    static constexpr int BOX_ROW_BYTES = 128;            // = the swizzle width
    static constexpr int D_BOXES = D / BOX_COLS;
    static constexpr int ATOM_BYTES = 8 * BOX_ROW_BYTES; // 8 rows: the 128B swizzle's repeat
    static constexpr int DQ_COLS = 64;                   // dQ columns per wgmma (N)
    // dQ = dS K per chunk. With two key groups at D >= 128 the consumers split dQ's columns
    // instead of its keys: each multiplies the dS of the whole tile (both groups' buffers) into
    // its D / 2 columns, so every dQ element gets one reduction per chunk, not one per key
    // group (the same wgmma count: 8 of m64n64k16 per consumer at D = 128). At D = 64 a half
    // would be 32 columns (N = 32, twice the shared-memory reads per FLOP): each group adds
    // its own keys' part there. At D = 256 each consumer has its own columns already.
    static constexpr bool DQ_BY_COLUMNS = KEY_GROUPS > 1 && D >= 128;
    static constexpr int DQ_KEYS = DQ_BY_COLUMNS ? BN : WG_ROWS;  // keys of a consumer's dQ
    static constexpr int DQ_WIDTH = DQ_BY_COLUMNS ? D / KEY_GROUPS : DC;   // and its columns
    static constexpr int KV_BYTES = BN * D * 2;          // K (or V)
    static constexpr int QD_BYTES = BQ * D * 2;          // one stage of Q (or dO)
    static constexpr int DS_BYTES = BQ * WG_ROWS * 2;    // one consumer's dS [BQ][64]
    static constexpr int OFF_V = KV_BYTES;
    static constexpr int OFF_Q = 2 * KV_BYTES;
    static constexpr int OFF_DO = OFF_Q + STAGES * QD_BYTES;
    static constexpr int OFF_DS = OFF_DO + STAGES * QD_BYTES;
    static constexpr int OFF_LSE2 = OFF_DS + NUM_CONSUMERS * DS_BYTES;
    static constexpr int OFF_DELTA = OFF_LSE2 + STAGES * BQ * 4;
    static constexpr int OFF_CHUNKS = OFF_DELTA + STAGES * BQ * 4;
    static constexpr int OFF_BARS = OFF_CHUNKS + STAGES * sizeof(StagedChunk);
    // kv_full, kv_ready, then q_full, ready, empty per stage
    static constexpr int NUM_BARS = 2 + 3 * STAGES;
    // Named barriers: 0 is __syncthreads, 1 .. NUM_CONSUMERS one per consumer warpgroup, then
    // one over every consumer thread (ordered dQ), then the producer warpgroup's (its threads
    // read the class thread 0 staged)
    static constexpr uint32_t CONSUMERS_BAR = 1 + NUM_CONSUMERS;
    static constexpr uint32_t PRODUCER_BAR = 2 + NUM_CONSUMERS;
    // The threads that add to dQ (ordered dQ: every consumer thread), and the threads of the
    // barrier around the dS stores: a warpgroup's, or with DQ_BY_COLUMNS every consumer's
    static constexpr int ADDERS = NUM_CONSUMERS * WG_THREADS;
    static constexpr uint32_t DS_BAR_THREADS = DQ_BY_COLUMNS ? ADDERS : WG_THREADS;
    // + ALIGN: the block rounds its base up to the swizzle's repeat (see FwdSm90Config)
    static constexpr int ALIGN = 1024;
    static constexpr int SMEM_BYTES = OFF_BARS + 8 * NUM_BARS + ALIGN;
    // Registers per thread after setmaxnreg (FlashAttention-3's split). setmaxnreg moves
    // registers between the warpgroups of the block, within what the launch allocated: at most
    // ENTRY_REGS per thread (64 K over the block's threads, in units of 8, at most 255).
    static constexpr int ENTRY_REGS = (65536 / NUM_THREADS > 255 ? 255 : 65536 / NUM_THREADS)
                                      / 8 * 8;
    // The producer's thread 0 classifies each query chunk by the mask_mod (chunk_class) before
    // its loads, with one consumer in 56 registers (40 spilled 32 B for a tree mask_mod's
    // class), with two in 40
    static constexpr bool CLASSIFIES = HAS_MASK_MOD;
    static constexpr int PRODUCER_REGS = CLASSIFIES && NUM_CONSUMERS == 1 ? 56 : 40;
    static constexpr int CONSUMER_REGS = NUM_CONSUMERS == 1 ? 240 : 232;

    static_assert(BN == 64 || BN == 128, "one or two consumer warpgroups of 64 key rows");
    static_assert(BQ == 64, "query chunks of 64 rows: the N of S^T and the M of dQ");
    static_assert(D == 64 || D == 128 || D == 256, "head dim in boxes of 64");
    static_assert(NUM_CONSUMERS <= 2, "at D = 256 two consumers split the 64 keys' columns: "
                  "a key tile of 64 rows");
    static_assert(BQ <= WG_THREADS && BN <= WG_THREADS, "one producer thread per row");
    static_assert(PRODUCER_REGS + NUM_CONSUMERS * CONSUMER_REGS <=
                  (1 + NUM_CONSUMERS) * ENTRY_REGS,
                  "the register split must fit what the launch allocates to the block");
    static_assert(sizeof(StagedChunk) == 24, "the launcher counts 24 bytes per stage");
    static_assert(DQ_WIDTH % DQ_COLS == 0, "dQ in slices of 64 columns");
    static_assert(SMEM_BYTES <= 227 * 1024, "shared memory past sm_90's 227 KiB per block");
};

// The block's shared memory and barriers.
template <typename T, typename Cfg>
struct BwdSm90Smem {
    unsigned char* base;

    __device__ __forceinline__ T* k() const { return reinterpret_cast<T*>(base); }
    __device__ __forceinline__ T* v() const { return reinterpret_cast<T*>(base + Cfg::OFF_V); }
    __device__ __forceinline__ T* q(int s) const {
        return reinterpret_cast<T*>(base + Cfg::OFF_Q + s * Cfg::QD_BYTES);
    }
    __device__ __forceinline__ T* dout(int s) const {
        return reinterpret_cast<T*>(base + Cfg::OFF_DO + s * Cfg::QD_BYTES);
    }
    __device__ __forceinline__ unsigned char* ds(int c) const {
        return base + Cfg::OFF_DS + c * Cfg::DS_BYTES;
    }
    __device__ __forceinline__ float* lse2(int s) const {
        return reinterpret_cast<float*>(base + Cfg::OFF_LSE2) + s * Cfg::BQ;
    }
    __device__ __forceinline__ float* delta(int s) const {
        return reinterpret_cast<float*>(base + Cfg::OFF_DELTA) + s * Cfg::BQ;
    }
    __device__ __forceinline__ StagedChunk* chunk(int s) const {
        return reinterpret_cast<StagedChunk*>(base + Cfg::OFF_CHUNKS) + s;
    }
    __device__ __forceinline__ sm90::u64* bar(int i) const {
        return reinterpret_cast<sm90::u64*>(base + Cfg::OFF_BARS) + i;
    }
    __device__ __forceinline__ sm90::u64* kv_full() const { return bar(0); }
    __device__ __forceinline__ sm90::u64* kv_ready() const { return bar(1); }
    __device__ __forceinline__ sm90::u64* q_full(int s) const { return bar(2 + s); }
    __device__ __forceinline__ sm90::u64* ready(int s) const { return bar(2 + Cfg::STAGES + s); }
    __device__ __forceinline__ sm90::u64* empty(int s) const {
        return bar(2 + 2 * Cfg::STAGES + s);
    }
};

// Row r of a tile of ROWS rows in boxes of 64 columns: each 128-byte row stays in place under the
// swizzle (only its 16-byte chunks move), so whole rows are addressed as in a dense tile.
template <typename Cfg, int ROWS>
__device__ __forceinline__ uint4* box_row(void* tile, int box, int r) {
    return reinterpret_cast<uint4*>(static_cast<unsigned char*>(tile) +
                                    (box * ROWS + r) * Cfg::BOX_ROW_BYTES);
}

template <typename T, typename Cfg, int ROWS>
__device__ __forceinline__ bool row_nonfinite(void* tile, int r) {
    bool bad = false;
    #pragma unroll
    for (int b = 0; b < Cfg::D_BOXES; ++b) {
        const uint4* p = box_row<Cfg, ROWS>(tile, b, r);
        #pragma unroll
        for (int i = 0; i < Cfg::BOX_ROW_BYTES / 16; ++i) bad |= any_nonfinite<T>(p[i]);
    }
    return bad;
}

template <typename Cfg, int ROWS>
__device__ __forceinline__ void fill_row(void* tile, int r, uint32_t word) {
    #pragma unroll
    for (int b = 0; b < Cfg::D_BOXES; ++b) {
        uint4* p = box_row<Cfg, ROWS>(tile, b, r);
        #pragma unroll
        for (int i = 0; i < Cfg::BOX_ROW_BYTES / 16; ++i) p[i] = uint4{word, word, word, word};
    }
}

// The key tile after its TMA load (thread t of the producer warpgroup, key row t): K rows past
// the tile zeroed; a present K row holding a NaN or inf zeroed and its V row made NaN.
template <typename T, typename Cfg>
__device__ __forceinline__ void sanitize_key_tile(T* s_k, T* s_v, int rows, int t) {
    if (t >= Cfg::BN) return;
    const bool bad = t < rows && row_nonfinite<T, Cfg, Cfg::BN>(s_k, t);
    if (t >= rows || bad) fill_row<Cfg, Cfg::BN>(s_k, t, 0u);
    if (bad) fill_row<Cfg, Cfg::BN>(s_v, t, 0xffffffffu);     // NaN in both halves
}

// A partial query chunk after its TMA load (thread t, query row t): Q and dO rows past the chunk
// zeroed (dK += dS^T Q and dV += P^T dO meet them with zero coefficients); a present row of Q or
// dO holding a NaN or inf zeroed and the row's delta made NaN, which reaches exactly the pairs
// that see the row (softmax_backward).
template <typename T, typename Cfg>
__device__ __forceinline__ void sanitize_query_chunk(T* s_q, T* s_do, float* s_delta, int rows,
                                                     int t) {
    if (t >= Cfg::BQ) return;
    const bool bad_q = t < rows && row_nonfinite<T, Cfg, Cfg::BQ>(s_q, t);
    const bool bad_do = t < rows && row_nonfinite<T, Cfg, Cfg::BQ>(s_do, t);
    if (t >= rows || bad_q) fill_row<Cfg, Cfg::BQ>(s_q, t, 0u);
    if (t >= rows || bad_do) fill_row<Cfg, Cfg::BQ>(s_do, t, 0u);
    if (bad_q || bad_do) s_delta[t] = nan_f();
}

// The mask_mod's class (mods.cuh: user_mask_class) of the queries of chunk c against the keys
// of the tile where the configuration classifies (BwdSm90Config::CLASSIFIES); TILE_FULL
// without a mask_mod, TILE_PARTIAL with one where it does not classify.
template <typename Cfg>
__device__ __forceinline__ int chunk_class(const ModParams& mods, const Chunk& c,
                                           const TileInfo& tile) {
    if constexpr (Cfg::CLASSIFIES) {
        return user_mask_class<false>(mods, tile.seq, c.pos, c.pos + c.rows - 1, tile.pos,
                               tile.pos + tile.rows - 1);
    } else {
        return HAS_MASK_MOD ? TILE_PARTIAL : TILE_FULL;
    }
}

// The producer warpgroup: thread 0 loads K and V once and Q and dO of every query chunk of the
// tile's schedule (all G query heads of the key head) into the stage ring, and stages the chunk
// with the mask_mod's class (`chunk_class`: within the producer's registers, where the
// consumers' dK and dV leave no room for its interval arithmetic); thread t < BQ loads
// lse2 and delta of the chunk's row t (lse2 = +inf, delta = 0 past the chunk); on the key tile
// and on a partial chunk the warpgroup sanitises the landed rows before handing them on. A
// chunk the mask_mod hides whole (TILE_EMPTY) still takes its stage, so that the consumers pass
// it in order (the ordered dQ's turn), but nothing of it is loaded or sanitised: thread 0
// completes q_full's phase with a plain arrive, and the other threads learn the class from the
// staged chunk after the warpgroup's barrier.
template <typename T, typename Cfg>
__device__ __forceinline__ void bwd_sm90_producer(
    const sm90::TensorMap* map_q, const sm90::TensorMap* map_k, const sm90::TensorMap* map_v,
    const sm90::TensorMap* map_do, const float* lse2, const float* delta,
    const BwdSm90Smem<T, Cfg>& sm, const PlanView& plan, const ModParams& mods,
    const TileInfo& tile, int i_tile, int i_khead, int group) {
    constexpr int STAGES = Cfg::STAGES, BQ = Cfg::BQ;
    const int t = threadIdx.x;
    if (t == 0) {
        sm90::mbar_arrive_expect_tx(sm.kv_full(), 2 * Cfg::KV_BYTES);
        load_rows<Cfg, Cfg::BN>(sm.k(), map_k, sm.kv_full(), i_khead, tile.row);
        load_rows<Cfg, Cfg::BN>(sm.v(), map_v, sm.kv_full(), i_khead, tile.row);
    }
    sm90::mbar_wait(sm.kv_full(), 0, "kv_full");
    sanitize_key_tile<T, Cfg>(sm.k(), sm.v(), tile.rows, t);
    sm90::fence_proxy_async();
    sm90::mbar_arrive(sm.kv_ready());

    PartnerCursor<BQ> queries = query_cursor<BQ>(plan, i_tile, group);
    for (int i = 0;; ++i, queries.advance()) {
        const int s = i % STAGES;
        const uint32_t parity = round_parity<STAGES>(i);
        // every producer thread waits, so that none writes the stage or arrives a round early
        sm90::mbar_wait(sm.empty(s), parity ^ 1u, "empty");
        if (!queries.valid()) {
            // the end of the walk, through the stage the consumers look at next
            if (t == 0) sm.chunk(s)->valid = 0;
            sm90::mbar_arrive(sm.ready(s));
            break;
        }
        const Chunk c = queries.chunk();
        const int head = i_khead * group + c.head;
        if (t == 0) {
            const int cls = chunk_class<Cfg>(mods, c, tile);
            *sm.chunk(s) = StagedChunk{c, 1 + cls};
            if (cls == TILE_EMPTY) {
                sm90::mbar_arrive(sm.q_full(s));           // the phase, with no bytes
            } else {
                sm90::mbar_arrive_expect_tx(sm.q_full(s), 2 * Cfg::QD_BYTES);
                load_rows<Cfg, BQ>(sm.q(s), map_q, sm.q_full(s), head, c.row);
                load_rows<Cfg, BQ>(sm.dout(s), map_do, sm.q_full(s), head, c.row);
            }
        }
        if constexpr (Cfg::CLASSIFIES) {
            sm90::named_bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);
            if (sm.chunk(s)->valid == 1 + TILE_EMPTY) {
                sm90::mbar_arrive(sm.ready(s));
                continue;
            }
        }
        if (t < BQ) {
            load_row_stats(sm.lse2(s)[t], sm.delta(s)[t], lse2, delta, plan.rows_q, head,
                           c.row + t, t < c.rows);
        }
        if (!c.full) {
            sm90::mbar_wait(sm.q_full(s), parity, "q_full");
            sanitize_query_chunk<T, Cfg>(sm.q(s), sm.dout(s), sm.delta(s), c.rows, t);
            // generic-proxy stores that the consumers' wgmma (async proxy) reads next
            sm90::fence_proxy_async();
        }
        sm90::mbar_arrive(sm.ready(s));
    }
}

// This thread's part of a warpgroup's [64, N] fp32 D fragment (rows 16 w + g, + 8) written as T
// to rows row .. of a head, those < valid_rows: 4-byte stores straight from the registers.
template <typename T, int NB>
__device__ __forceinline__ void store_fragment_rows(const float (&acc)[NB][4],
                                                    const HeadRows<T>& dst, int row,
                                                    int valid_rows, int lane) {
    const int g = lane / 4, q = lane % 4;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = g + 8 * half;
        if (r >= valid_rows) continue;
        T* p = dst.row(row + r) + 2 * q;
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            *reinterpret_cast<uint32_t*>(p + nb * 8) =
                ElemTraits<T>::pack(acc[nb][2 * half], acc[nb][2 * half + 1]);
        }
    }
}

// Whether each pair this lane holds of a [16, 8 NB] key-rows tile is visible, the band's answer
// and the mask_mod's together, computed before S^T and dP^T hold registers (`user_bits`): the
// mask_mod's per-pair arithmetic and aux loads then run beside dK and dV only, and no field of
// the tile's mask stays live across the products (at D = 256 those spilled 80-100 B). Bit
// 2 NB half + 2 nb + e holds the pair of row g + 8 half and column nb 8 + 2 (lane % 4) + e.
template <int NB>
struct KeyRowsUserBits {
    uint32_t bits = 0;
};

template <int NB>
struct UserBits<KeyRowsUserBits<NB>> {
    static constexpr bool ON = true;
};

// for_each_element's walk over the pairs of `m`, each pair's visibility its bit.
template <int NB, int NBITS, typename F>
__device__ __forceinline__ void for_each_element(const KeyRowsUserBits<NBITS>& m, int lane,
                                                 F&& f) {
    static_assert(NB == NBITS, "the bits of the tile being walked");
    const int t = lane % 4;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                f(nb, 2 * half + e, nb * 8 + 2 * t + e,
                  ((m.bits >> (2 * NB * half + 2 * nb + e)) & 1u) != 0);
            }
        }
    }
}

// `mask` with the mask_mod's answer for each pair this lane holds of a [16, 8 NB] tile, each
// tested as a partial chunk's TileMask::user_visible tests it (the band first: pairs it hides,
// rows and columns past the tile never reach the mask_mod); in a tile the mask_mod shows whole
// (`full`: its class TILE_FULL) the band's answer alone.
template <int NB>
__device__ __forceinline__ KeyRowsUserBits<NB> user_bits(const TileMask<true>& mask, int lane,
                                                         bool full) {
    static_assert(4 * NB <= 32, "one bit per element of the lane's fragment");
    KeyRowsUserBits<NB> m;
    if constexpr (HAS_MASK_MOD) {
        // for_each_element's walk, four pairs at a time: unrolled, the compiler hoists every
        // pair's aux loads together beside dK and dV, and one at a time spilled at D = 256
        #pragma unroll 4
        for (int n = 0; n < 4 * NB; ++n) {
            const int half = n / (2 * NB), col = n % (2 * NB) / 2 * 8 + 2 * (lane % 4) + n % 2;
            const bool visible = mask.visible(mask.band(half), col);
            // the class is `full`'s (the producer stages no chunk marks); band(half) already
            // hides rows past the key tile
            if (visible && (full || user_mask(*mask.mods, mask.seq, mask.q_idx(half, col),
                                              mask.k_idx(half, col)))) {
                m.bits |= 1u << n;
            }
        }
    }
    return m;
}

// The dS/dP step of one subtile of BQS queries of the chunk in stage s (FlashAttention-2,
// Alg. 2, lines 11-16, transposed), for one consumer warpgroup: S^T = K Q^T and dP^T = V dO^T,
// P^T and dS^T (softmax_backward), dS^T into the warpgroup's dS buffer for the dQ step (the
// barrier `ds_bar` before the first subtile's stores and after the last's), dV += P^T dO and
// dK += dS^T Q. A function of its own so that the consumer's chunk loop reads as its protocol:
// wait for the stage, the subtiles, release the stage, the dQ step.
template <typename T, typename Cfg, bool HAS_SOFTCAP>
__device__ __forceinline__ void bwd_sm90_dsdp_subtile(
    float (&dk_frag)[Cfg::DC / 2], float (&dv_frag)[Cfg::DC / 2], const BwdSm90Smem<T, Cfg>& sm,
    int s, int sub, sm90::u64 desc_k, sm90::u64 desc_v, sm90::u64 desc_q, sm90::u64 desc_do,
    sm90::u64 desc_q_mn, sm90::u64 desc_do_mn, unsigned char* p_ds_row, uint32_t ds_bar,
    const SeqPolicy& pol, const TileInfo& tile, const CallParams& call, const ModParams& mods,
    int head0, int cls, const WarpSlot& w) {
    constexpr int BQS = Cfg::BQS, D = Cfg::D, DC = Cfg::DC;
    constexpr uint32_t ROW = Cfg::BOX_ROW_BYTES;
    constexpr uint32_t BOX_KV = Cfg::BN * ROW;  // bytes per box of 64 columns
    constexpr uint32_t BOX_Q = Cfg::BQ * ROW;
    const int col = sub * BQS;               // the subtile's first query of the chunk
    // the subtile's queries as a chunk of their own (none left: all masked, P^T =
    // dS^T = 0), as in the mma.sync kernel
    const auto rows_mask = [&] {
        const Chunk cols = sm.chunk(s)->load().from(col);
        return key_rows_mask<Cfg::BN>(pol, tile, w, cols, &mods, head0 + cols.head);
    };
    // With a mask_mod every pair is tested, the band AND the mask_mod (in a chunk of class
    // `cls` TILE_FULL the band alone), the answers taken here, before S^T and dP^T hold
    // registers.
    KeyRowsUserBits<BQS / 8> bits{};
    if constexpr (HAS_MASK_MOD) bits = user_bits<BQS / 8>(rows_mask(), w.lane, cls == TILE_FULL);
    // [64, BQS] S^T = K Q^T, then P^T, and dP^T = V dO^T, then dS^T
    float acc_s[BQS / 8][4];
    float acc_dp[BQS / 8][4];
    auto& s_frag = reinterpret_cast<float (&)[BQS / 2]>(acc_s);
    auto& dp_frag = reinterpret_cast<float (&)[BQS / 2]>(acc_dp);
    sm90::wgmma_fence_operand(s_frag);
    sm90::wgmma_fence_operand(dp_frag);
    // frag = X Y^T over the head dim: X = K or V (this warpgroup's keys), Y = the
    // subtile's rows of Q or dO, in k16 steps inside boxes of 64 columns
    const auto product_t = [&](float (&frag)[BQS / 2], sm90::u64 desc_x, sm90::u64 desc_y) {
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint32_t step = (kk % 4) * 32;
            sm90::wgmma_ss<T, BQS, false, false>(
                frag, sm90::desc_advance(desc_x, (kk / 4) * BOX_KV + step),
                sm90::desc_advance(desc_y, (kk / 4) * BOX_Q + col * ROW + step), kk > 0);
        }
    };
    sm90::wgmma_fence();
    product_t(s_frag, desc_k, desc_q);
    product_t(dp_frag, desc_v, desc_do);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::wgmma_fence_operand(s_frag);
    sm90::wgmma_fence_operand(dp_frag);

    const ColStats stats = ColStats{sm.lse2(s) + col, sm.delta(s) + col};
    if constexpr (HAS_MASK_MOD) {
        softmax_backward<HAS_SOFTCAP>(acc_s, acc_dp, bits, stats, call, w.lane);
    } else {
        softmax_backward<HAS_SOFTCAP>(acc_s, acc_dp, rows_mask(), stats, call, w.lane);
    }
    // P^T and dS^T as BQS / 16 A fragments (k = queries), all written before the
    // wgmma.fence
    uint32_t p_frag[BQS / 16][4];
    uint32_t ds_frag[BQS / 16][4];
    #pragma unroll
    for (int j = 0; j < BQS / 16; ++j) {
        c_to_a<T>(p_frag[j], acc_s, j);
        c_to_a<T>(ds_frag[j], acc_dp, j);
    }

    // dS^T -> dS [BQ][64 keys] by stmatrix.trans: the A fragment of k-step j is the x4
    // set of matrices (queries col + 16 j + 8 (i / 2) .., keys 16 warp + 8 (i % 2) ..),
    // i = 0..3, each transposed into 8 query rows of 8 keys (16 bytes, their
    // 128B-swizzled chunk). The warpgroup's last dQ product has retired in every warp
    // before the buffer is rewritten (the barrier before the first subtile's stores);
    // the barrier after the last one publishes them.
    if (sub == 0) sm90::named_bar_sync(ds_bar, Cfg::DS_BAR_THREADS);
    #pragma unroll
    for (int j = 0; j < BQS / 16; ++j) {
        sm90::stmatrix_x4_trans(p_ds_row + (col + j * 16) * ROW, ds_frag[j]);
    }
    if (sub == Cfg::SUBTILES - 1) {
        sm90::fence_proxy_async();
        sm90::named_bar_sync(ds_bar, Cfg::DS_BAR_THREADS);
    }

    // dV += P^T dO, dK += dS^T Q: A from registers, dO and Q MN-major (k16 steps of 16
    // rows, the next 64 columns of the head dim one box further)
    sm90::wgmma_fence_operand(dv_frag);
    sm90::wgmma_fence_operand(dk_frag);
    sm90::wgmma_fence();
    #pragma unroll
    for (int j = 0; j < BQS / 16; ++j) {
        sm90::wgmma_rs<T, DC, true>(dv_frag, p_frag[j],
                                    sm90::desc_advance(desc_do_mn, (col + 16 * j) * ROW), true);
    }
    #pragma unroll
    for (int j = 0; j < BQS / 16; ++j) {
        sm90::wgmma_rs<T, DC, true>(dk_frag, ds_frag[j],
                                    sm90::desc_advance(desc_q_mn, (col + 16 * j) * ROW), true);
    }
    sm90::wgmma_commit();
    // retired before the next subtile and dQ: the P^T and dS^T fragments they read free
    // their registers
    sm90::wgmma_wait<0>();
    sm90::wgmma_fence_operand(dv_frag);
    sm90::wgmma_fence_operand(dk_frag);
}

// The dQ step of query chunk c, once its dS is in the consumers' dS buffers: dQ [BQ, DQ_WIDTH]
// += dS K over this warpgroup's DQ_KEYS keys and columns, DQ_COLS at a time, by fp32
// reductions into dq_accum. With ORDERED_DQ the hand-off: the leader waits for the tile's turn
// at the chunk and every adder passes the consumers' barrier after it, the second warpgroup
// adds each slice after the first where both add to the same columns, and after the last
// slice the turn is handed on (bwd_dq_ordered.cuh). A function of its own: the ordering
// protocol in one place, apart from the products that make dS.
// `adds` false (a chunk the mask_mod hides whole): no product and no addition, the ordered
// turn taken and handed on all the same.
template <typename T, typename Cfg, bool ORDERED_DQ>
__device__ __forceinline__ void bwd_sm90_add_dq(const Chunk& c, const BwdParams& params,
                                                const TileInfo& tile, int head0,
                                                sm90::u64 desc_dq_a, sm90::u64 desc_dq_b,
                                                int col_box0, int c_wg, const WarpSlot& w,
                                                bool adds) {
    constexpr uint32_t BOX_KV = Cfg::BN * Cfg::BOX_ROW_BYTES;
    constexpr uint32_t KSTEP_MN = 16 * Cfg::BOX_ROW_BYTES;  // a k16 step of an MN-major B
    constexpr int ADDERS = Cfg::ADDERS;
    const int wg_warp = w.warp % 4;             // the warp's slot in its warpgroup
    // The first column box of this warpgroup's dQ columns, read from threadIdx where used:
    // held in a register through the chunk, or folded into a pointer or descriptor held
    // there, it cost 8-12 bytes of spills at D = 128 under a softcap.
    const auto dq_box0 = [col_box0] {
        const int c = static_cast<int>(threadIdx.x / Cfg::WG_THREADS) - 1;   // c_wg
        return Cfg::DQ_BY_COLUMNS ? c / Cfg::COL_PARTS * (Cfg::DQ_WIDTH / Cfg::BOX_COLS)
                                  : col_box0;
    };
    // The first thread of the last consumer warpgroup leads (read where used: no register held
    // across the chunk). With two consumers the first warpgroup, which adds first, learns of
    // the turn only through the barrier after the wait (in the emulation a wgmma synchronises
    // its own warpgroup, which would hide a missing barrier from a leader among the adders).
    const auto leader = [] {
        return threadIdx.x == Cfg::NUM_CONSUMERS * Cfg::WG_THREADS;
    };
    HeadRows<float> dq_rows = head_rows(params.dq_accum, packed_strides<Cfg::D>(params.call.Hq),
                                        head0 + c.head);
    dq_rows.p += dq_box0() * Cfg::DQ_COLS;
    const OrderedDq order{params.dq_order, params.plan, params.call, tile, head0};
    if constexpr (ORDERED_DQ) {
        order.acquire(c, leader());
        sm90::named_bar_sync(Cfg::CONSUMERS_BAR, ADDERS);   // every adder after the wait
    }
    #pragma unroll
    for (int n = 0; n < Cfg::DQ_WIDTH / Cfg::DQ_COLS && adds; ++n) {
        float acc_dq[Cfg::DQ_COLS / 8][4];
        auto& dq_frag = reinterpret_cast<float (&)[Cfg::DQ_COLS / 2]>(acc_dq);
        sm90::wgmma_fence();
        #pragma unroll
        for (int j = 0; j < Cfg::DQ_KEYS / 16; ++j) {
            sm90::wgmma_ss<T, Cfg::DQ_COLS, false, true>(
                dq_frag, sm90::desc_advance(desc_dq_a, j / 4 * Cfg::DS_BYTES + j % 4 * 32),
                sm90::desc_advance(desc_dq_b, (dq_box0() + n) * BOX_KV + j * KSTEP_MN), j > 0);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::wgmma_fence_operand(dq_frag);
        // ordered: the second warpgroup adds this slice once the first has added it (where
        // both add to the same columns)
        constexpr bool HAND_OVER = ORDERED_DQ && Cfg::KEY_GROUPS > 1 && !Cfg::DQ_BY_COLUMNS;
        if (HAND_OVER && c_wg == 1) sm90::named_bar_sync(Cfg::CONSUMERS_BAR, ADDERS);
        atomic_add_rows(acc_dq, dq_rows, c.row + 16 * wg_warp, c.rows - 16 * wg_warp,
                        n * Cfg::DQ_COLS, w.lane);
        if (HAND_OVER && c_wg == 0) sm90::named_bar_sync(Cfg::CONSUMERS_BAR, ADDERS);
    }
    if constexpr (ORDERED_DQ) {
        order.release<false>(c, 0, leader(), ADDERS, [] {
            sm90::named_bar_sync(Cfg::CONSUMERS_BAR, ADDERS);
        });
    }
}

// One consumer warpgroup c: key rows 64 g .. 64 g + 63 of the tile and head-dim columns
// DC p .. DC p + DC - 1 (g = c / COL_PARTS, p = c % COL_PARTS). `w` is the warp's slot among
// the consumer warps (row0: the key row of its fragment's row 0 in the tile). Per query chunk:
// wait for its stage, the dS/dP step of each subtile (bwd_sm90_dsdp_subtile), release the
// stage, the dQ step (bwd_sm90_add_dq); then dK and dV of its keys and columns.
template <typename T, typename Cfg, bool HAS_SOFTCAP, bool ORDERED_DQ>
__device__ __forceinline__ void bwd_sm90_consumer(const BwdSm90Smem<T, Cfg>& sm,
                                                  const BwdParams& params, const TileInfo& tile,
                                                  int i_khead, int group, int c_wg,
                                                  const WarpSlot& w) {
    constexpr int STAGES = Cfg::STAGES, BQ = Cfg::BQ, DC = Cfg::DC;
    constexpr uint32_t ROW = Cfg::BOX_ROW_BYTES;
    constexpr uint32_t BOX_KV = Cfg::BN * ROW;  // bytes per box of 64 columns
    constexpr uint32_t BOX_Q = BQ * ROW;
    const SeqPolicy pol = SeqPolicy::load(params.plan, tile.seq);
    const int wg_warp = w.warp % 4;             // the warp's slot in its warpgroup
    const int key_group = c_wg / Cfg::COL_PARTS;
    const int col_box0 = c_wg % Cfg::COL_PARTS * (DC / Cfg::BOX_COLS);   // its first column box
    const uint32_t own_rows = key_group * Cfg::WG_ROWS * ROW;
    // K and V as K-major A of S^T and dP^T (this warpgroup's 64 rows); K as the MN-major B of dQ
    // (N = head dim: the next 64 columns one box further, k16 steps of 16 key rows).
    const sm90::u64 desc_k = sm90::smem_desc(reinterpret_cast<unsigned char*>(sm.k()) + own_rows,
                                             0, Cfg::ATOM_BYTES, sm90::Swizzle::B128);
    const sm90::u64 desc_v = sm90::desc_advance(desc_k, Cfg::OFF_V);
    const sm90::u64 desc_k_mn = desc_k | sm90::make_smem_desc(0, BOX_KV, 0, sm90::Swizzle::NONE);
    // dS [BQ][64 keys] of this warpgroup as the K-major A of dQ (k16 steps of 32 bytes)
    // This lane's row address of each stmatrix.trans below: lanes 8 i .. 8 i + 7 give the rows
    // of matrix i, the queries 16 j + 8 (i / 2) + lane % 8 of k-step j, at their keys' 16-byte
    // chunk 2 warp + i % 2 (8 keys), XOR the row % 8 (the 128B swizzle; the row's position in
    // its 8-row atom, lane % 8 for every j).
    const int ds_row = 8 * (w.lane / 16) + w.lane % 8;
    unsigned char* p_ds_row = sm.ds(c_wg) + ds_row * ROW +
                              (((2 * wg_warp + (w.lane / 8) % 2) ^ (ds_row % 8)) << 4);
    static_assert(Cfg::DS_BYTES == Cfg::WG_ROWS * ROW, "dS and K move alike per warpgroup");
    // dQ's A and B: this warpgroup's dS (sm.ds(c_wg)) and K rows, or with DQ_BY_COLUMNS every
    // group's dS (ds(0), ds(1): the next 64 keys one buffer further) and all BN rows of K, from
    // the first column box of its dQ columns (bwd_sm90_add_dq).
    const sm90::u64 desc_dq_a = Cfg::DQ_BY_COLUMNS
        ? sm90::smem_desc(sm.ds(0), 0, Cfg::ATOM_BYTES, sm90::Swizzle::B128)
        : sm90::desc_advance(desc_k, Cfg::OFF_DS + (c_wg - key_group) * Cfg::DS_BYTES);
    const sm90::u64 desc_dq_b = Cfg::DQ_BY_COLUMNS
        ? sm90::smem_desc(sm.k(), BOX_KV, Cfg::ATOM_BYTES, sm90::Swizzle::B128)
        : desc_k_mn;
    // The barrier around the dS stores: this warpgroup's, or with DQ_BY_COLUMNS every
    // consumer's (each reads the others' dS)
    const uint32_t ds_bar = Cfg::DQ_BY_COLUMNS ? Cfg::CONSUMERS_BAR : 1 + c_wg;

    // [64, DC] dK and dV of this warpgroup's keys and columns (this warp: 16 rows), as wgmma D
    // fragments
    float acc_dk[DC / 8][4];
    float acc_dv[DC / 8][4];
    zero_acc(acc_dk);
    zero_acc(acc_dv);
    auto& dk_frag = reinterpret_cast<float (&)[DC / 2]>(acc_dk);
    auto& dv_frag = reinterpret_cast<float (&)[DC / 2]>(acc_dv);

    sm90::mbar_wait(sm.kv_full(), 0, "kv_full");
    sm90::mbar_wait(sm.kv_ready(), 0, "kv_ready");
    for (int i = 0;; ++i) {
        const int s = i % STAGES;
        const uint32_t parity = round_parity<STAGES>(i);
        sm90::mbar_wait(sm.ready(s), parity, "ready");
        // The mask_mod's class of the chunk's queries against the tile's keys, which the
        // producer staged with it: TILE_EMPTY skips the chunk's products and dQ additions (its
        // P^T = dS^T = 0; nothing of it was loaded; the stage is released and the ordered turn
        // passed as for any other), TILE_FULL the mask_mod's evaluation.
        const int staged = sm.chunk(s)->valid;
        if (!staged) break;
        const int cls = staged - 1;
        sm90::mbar_wait(sm.q_full(s), parity, "q_full");
        // Q and dO as K-major B (N = the chunk's queries) and as MN-major B (N = this
        // warpgroup's columns of the head dim)
        const sm90::u64 desc_q = sm90::smem_desc(sm.q(s), 0, Cfg::ATOM_BYTES, sm90::Swizzle::B128);
        const sm90::u64 desc_do = sm90::smem_desc(sm.dout(s), 0, Cfg::ATOM_BYTES,
                                                  sm90::Swizzle::B128);
        const sm90::u64 desc_q_mn = sm90::smem_desc(sm.q(s) + col_box0 * BQ * Cfg::BOX_COLS,
                                                    BOX_Q, Cfg::ATOM_BYTES, sm90::Swizzle::B128);
        const sm90::u64 desc_do_mn = sm90::smem_desc(sm.dout(s) + col_box0 * BQ * Cfg::BOX_COLS,
                                                     BOX_Q, Cfg::ATOM_BYTES,
                                                     sm90::Swizzle::B128);
        // Per subtile of BQS queries (the whole chunk but at D = 256, where two halves keep S^T
        // and dP^T to 32 registers each beside dK and dV):
        #pragma unroll
        for (int sub = 0; sub < Cfg::SUBTILES && cls != TILE_EMPTY; ++sub) {
            bwd_sm90_dsdp_subtile<T, Cfg, HAS_SOFTCAP>(dk_frag, dv_frag, sm, s, sub, desc_k,
                                                       desc_v, desc_q, desc_do, desc_q_mn,
                                                       desc_do_mn, p_ds_row, ds_bar, pol, tile,
                                                       params.call, params.mods,
                                                       i_khead * group, cls, w);
        }
        // the stage's Q, dO, lse2, delta and chunk are no longer read
        const Chunk c = sm.chunk(s)->load();
        sm90::mbar_arrive(sm.empty(s));
        bwd_sm90_add_dq<T, Cfg, ORDERED_DQ>(c, params, tile, i_khead * group, desc_dq_a,
                                            desc_dq_b, col_box0, c_wg, w, cls != TILE_EMPTY);
    }
    HeadRows<T> dk_rows = head_rows(static_cast<T*>(params.dk), params.dk_strides, i_khead);
    HeadRows<T> dv_rows = head_rows(static_cast<T*>(params.dv), params.dv_strides, i_khead);
    dk_rows.p += col_box0 * Cfg::BOX_COLS;
    dv_rows.p += col_box0 * Cfg::BOX_COLS;
    store_fragment_rows<T>(acc_dk, dk_rows, tile.row + w.row0, tile.rows - w.row0, w.lane);
    store_fragment_rows<T>(acc_dv, dv_rows, tile.row + w.row0, tile.rows - w.row0, w.lane);
}

}  // namespace varlen

using namespace varlen;

// Tensor maps (made by the launcher, varlen/backends/cupy/sm90.py, from the pointers and strides
// of params): 3D over the arrays, dims (D, H, T) innermost first, strides those of the heads and
// rows, box (64, 1, BQ) for Q and dO and (64, 1, BN) for K and V, 128B swizzle, zero fill past
// row T. The other arrays (lse2, delta, dk, dv, dq_accum, dq_order) through params.
template <typename T, int D, int BN, int BQ, bool HAS_SOFTCAP, bool ORDERED_DQ>
__global__ void __launch_bounds__(BwdSm90Config<D, BN, BQ>::NUM_THREADS, 1)
varlen_bwd_dkdv_sm90(const __grid_constant__ sm90::TensorMap map_q,    // q [Tq, Hq, D]
                     const __grid_constant__ sm90::TensorMap map_k,    // k [Tk, Hk, D]
                     const __grid_constant__ sm90::TensorMap map_v,    // v [Tk, Hk, D]
                     const __grid_constant__ sm90::TensorMap map_do,   // dout [Tq, Hq, D]
                     const BwdParams params) {
    using Cfg = BwdSm90Config<D, BN, BQ>;
    // (dependent on T, so that only an instantiation fails: a module with a score_mod still
    // compiles its other kernels)
    static_assert(sizeof(T) > 0 && !HAS_SCORE_MOD, "the sm_90a backward runs no score_mod (the "
                  "backend refuses it: varlen/backends/cupy/mods.py, refusal): its per-pair "
                  "arithmetic beside S^T, dP^T, dK and dV spills");
    const PlanView& plan = params.plan;
    const int i_tile = blockIdx.x, i_khead = blockIdx.y;
    const TileInfo tile = load_tile(plan.k_tiles, i_tile);
    if (tile.seq < 0) return;
    const int group = params.call.Hq / params.call.Hk;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t misalign = sm90::smem_addr(smem_raw) % Cfg::ALIGN;
    const BwdSm90Smem<T, Cfg> sm{smem_raw + (misalign ? Cfg::ALIGN - misalign : 0)};
    if (threadIdx.x == 0) {
        sm90::mbar_init(sm.kv_full(), 1);
        sm90::mbar_init(sm.kv_ready(), Cfg::WG_THREADS);
        #pragma unroll
        for (int s = 0; s < Cfg::STAGES; ++s) {
            sm90::mbar_init(sm.q_full(s), 1);
            sm90::mbar_init(sm.ready(s), Cfg::WG_THREADS);
            sm90::mbar_init(sm.empty(s), Cfg::NUM_CONSUMERS * Cfg::WG_THREADS);
        }
        sm90::fence_barrier_init();
    }
    __syncthreads();

    if (threadIdx.x < Cfg::WG_THREADS) {
        sm90::setmaxnreg<Cfg::PRODUCER_REGS, false>();
        bwd_sm90_producer<T, Cfg>(&map_q, &map_k, &map_v, &map_do, params.lse2, params.delta,
                                  sm, plan, params.mods, tile, i_tile, i_khead, group);
    } else {
        sm90::setmaxnreg<Cfg::CONSUMER_REGS, true>();
        const int t = threadIdx.x - Cfg::WG_THREADS;
        // the key rows of warp t / 32: its group's 64, 16 per warp of the warpgroup (written
        // apart for one consumer per group: the general form cost 4 B of spills at D = 128,
        // BN = 128 with a softcap, ordered)
        const int c_wg = t / Cfg::WG_THREADS;
        const int key_warp = Cfg::COL_PARTS == 1 ? t / WARP_SIZE
                                                 : c_wg / Cfg::COL_PARTS * 4 + t / WARP_SIZE % 4;
        const WarpSlot w{t % WARP_SIZE, t / WARP_SIZE, key_warp * WARP_ROWS};
        bwd_sm90_consumer<T, Cfg, HAS_SOFTCAP, ORDERED_DQ>(sm, params, tile, i_khead, group,
                                                           c_wg, w);
    }
}
