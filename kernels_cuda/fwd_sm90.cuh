// Forward kernel for sm_90a: FlashAttention-2's online softmax (Alg. 1) over the plan's query
// tiles, with the operands moved by TMA and multiplied by wgmma, warp-specialised as in
// FlashAttention-3, with its two overlaps: the two consumer warpgroups of BM = 128 take turns at
// the tensor cores (ping-pong, section 3.1), and inside a warpgroup S of the next key chunk is
// issued with P V of this one, its softmax running while P V is in flight (Alg. 2, section 3.2).
// docs/hopper.md, "The sm_90a forward", has the design and the schedule.
//
// Persistent: a 1D grid of at most (SMs x CTAs per SM) blocks, each looping over the work items
// (query tile slot, head; or head group under GQA packing: PACK heads of one key head as the
// rows of a tile, FwdSm90Config::PACK) in varlen_fwd's order (reverse slot order: heaviest
// tiles of a sequence first; WorkItem), block b taking items b, b + gridDim.x, ... (a
// static stride: no counter to zero, no extra launch). Unused slots (seq -1) are skipped by
// every warpgroup alike. Before its items each block writes the rows of no query tile (out 0,
// lse -inf) of the pad windows it owns, the last blocks first (they get the lighter items of
// each round). Block: warpgroup 0 is the producer, warpgroups 1 .. NC the consumers, each
// owning 64 query rows of a tile (BM = 64 NC).
// Key chunks of KN rows (the wgmma N of S): KN = 128 at D <= 128, two of the plan's 64-row key
// tiles when it has those; KN = 64 at D = 256. Shared memory, 1024-byte aligned, every tile in
// boxes of 64 columns (128 bytes, 128B swizzle) written by TMA:
//   Q [D / 64][BM][64], K [STAGES][D / 64][KN][64], V [STAGES][DV / 64][KN][64], the output
//   stage [BM][DV + 8], then the mbarriers (DV: head_dim_v, the columns of V and out; DV < D
//   for multi-head latent attention's D = 192, DV = 128).
// The producer's thread 0 loads each item's Q once the consumers have released the last one
// (q_empty: every consumer thread arrives once the item's last S has retired, before its last
// P V and the epilogue, which thus overlap the next item's Q and first K loads), then K of chunk
// i ahead of V of chunk i - 1, into a ring of STAGES stages (full barriers: k_full, v_full with
// transaction bytes; empty barriers apart for K and V: every consumer thread arrives on k_empty
// once its S has retired, on v_empty once its P V has, so K is refilled a P V earlier). The ring
// and the phases run on across items (Sm90Ring): chunk c of the block, whatever its item, uses
// stage c % STAGES in round c / STAGES. TMA reads whole boxes of the packed arrays, so
// the rows of a chunk past its sequence's last key are another sequence's rows or padding: the
// scores of those keys are masked by the selects of mask_scores (the chunk is partial), and
// their V rows, which meet P = 0 in P V, are zeroed by the producer warpgroup before the chunk
// is handed on (`ready`), with a NaN or inf in a present V row zeroed and handed to its K row,
// as KvStages::zero_nonfinite does for the mma.sync kernel.
//
// The wgmma D fragment of a warp (rows 16 w + g, + 8; columns 8 j + 2 q + {0, 1}) is the
// mma.m16n8 C fragment repeated along N, so the consumer keeps its tiles as float [N / 8][4]
// and reuses mask_scores, OnlineSoftmax and store_output unchanged; P goes from those registers
// into wgmma's A operand by c_to_a (docs/hopper.md, "Layouts").
#pragma once

#include "common.cuh"
#include "fwd.cuh"
#include "mask.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

template <int D_, int BM_, int BN_, int KN_, int PACK_ = 1, int DV_ = D_>
struct FwdSm90Config {
    static constexpr int D = D_;
    static constexpr int DV = DV_;                       // head_dim_v: V's and out's columns
    static constexpr int BM = BM_;                       // rows of a tile (wgmma M per consumer)
    static constexpr int BN = BN_;                       // the plan's key tiles
    // rows of a key chunk, a K or V stage: the launcher's tile_size, 128 where two stages of K
    // and V fit next to Q and the output stage (D <= 128), 64 at D = 256 (SMEM_BYTES below)
    static constexpr int KN = KN_;
    // Query heads per position in a tile: 1, or PACK heads of one key head packed into the M
    // of a tile of BM / PACK positions (the plan's query tiles), its row r position r / PACK of
    // head r % PACK ("GQA packing" in docs/hopper.md)
    static constexpr int PACK = PACK_;
    static constexpr int WG_THREADS = 128;               // a warpgroup: 4 warps
    static constexpr int WG_ROWS = 64;                   // the M of wgmma
    static constexpr int NUM_CONSUMERS = BM / WG_ROWS;
    static constexpr int NUM_THREADS = WG_THREADS * (1 + NUM_CONSUMERS);
    static constexpr int STAGES = 2;
    static constexpr int BOX_COLS = 64;                  // 128 bytes of 16-bit elements
    static constexpr int BOX_ROW_BYTES = 128;            // = the swizzle width
    static constexpr int D_BOXES = D / BOX_COLS;
    static constexpr int DV_BOXES = DV / BOX_COLS;
    static constexpr int ATOM_BYTES = 8 * BOX_ROW_BYTES; // 8 rows: the 128B swizzle's repeat
    static constexpr int Q_BYTES = BM * D * 2;
    static constexpr int KV_BYTES = KN * D * 2;          // one K stage
    static constexpr int V_BYTES = KN * DV * 2;          // one V stage (KV_BYTES when DV = D)
    static constexpr int OUT_STRIDE = smem_stride<DV>();
    static constexpr int OUT_BYTES = BM * OUT_STRIDE * 2;
    static constexpr int OFF_K = Q_BYTES;
    static constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;
    static constexpr int OFF_OUT = OFF_V + STAGES * V_BYTES;
    static constexpr int OFF_BARS = (OFF_OUT + OUT_BYTES + 7) / 8 * 8;
    // q_full, q_empty, then k_full, v_full, ready, k_empty, v_empty per stage; with a mask_mod
    // cls_full and cls_empty per class table
    static constexpr int NUM_BARS = 2 + 5 * STAGES + (HAS_MASK_MOD ? 4 : 0);
    // With a mask_mod two tables of the key chunks' classes (ClassTable, mask.cuh), one per
    // work item by its parity, after the barriers
    static constexpr int OFF_CLS = OFF_BARS + 8 * NUM_BARS;
    static constexpr int CLS_BYTES = HAS_MASK_MOD ? 2 * ClassTable::CAP : 0;
    // + ALIGN: the block rounds its base up to the swizzle's repeat (tiles start on it, the
    // descriptors' base offset is 0), whatever alignment the dynamic window has
    static constexpr int ALIGN = 1024;
    static constexpr int SMEM_BYTES = OFF_CLS + CLS_BYTES + ALIGN;
    // Registers per thread after setmaxnreg: the producer gives its share to the consumers
    // (FlashAttention-3's split). setmaxnreg.inc draws on what the block's setmaxnreg.dec
    // released, so the split adds up to what the block is launched with: ENTRY_REGS per
    // thread, the cap of __launch_bounds__(NUM_THREADS, 1): 40 + 2 x 232 = 504 = 3 x 168 with
    // two consumers (CUTLASS's split). The persistent producer (the item loop's state beside the
    // chunk cursor, the partial chunk's sanitising) spills at 24 and 32 registers, not at 40;
    // the consumers (O, S and P at once: 160 registers at D = KN = 128) fit 232 without a spill
    // (NVRTC, every variant; docs/hopper.md, "What is proven"). With a mask_mod the producer
    // walks the class table too (at 40 registers that spilled 12 B): 56 + 2 x 224.
    static constexpr int ENTRY_REGS = 65536 / NUM_THREADS / 8 * 8 < 256
                                          ? 65536 / NUM_THREADS / 8 * 8 : 256;
    static constexpr int PRODUCER_REGS = HAS_MASK_MOD ? 56 : 40;
    static constexpr int CONSUMER_REGS = NUM_CONSUMERS == 1 ? 256 : (HAS_MASK_MOD ? 224 : 232);
    // The ping-pong of two consumer warpgroups: named barrier TURN_BAR + c is consumer c's turn
    // at the tensor cores, counted over both consumer warpgroups (c waits, the other arrives).
    // Id 0 is __syncthreads'.
    static constexpr bool PINGPONG = NUM_CONSUMERS == 2;
    static constexpr uint32_t TURN_BAR = 1;
    static constexpr uint32_t TURN_THREADS = 2 * WG_THREADS;

    static_assert(BM == 64 || BM == 128, "one or two consumer warpgroups of 64 query rows");
    static_assert(BN == 64 || BN == 128, "plan key tiles of 64 or 128 rows");
    static_assert(KN == 64 || KN == 128, "wgmma N of Q K^T: key chunks of 64 or 128 rows");
    static_assert(BN % KN == 0 || KN == 2 * BN,
                  "a key chunk is a part of a plan tile or two of them");
    static_assert(D == 64 || D == 128 || D == 192 || D == 256, "head dim in boxes of 64");
    static_assert(DV == 64 || DV == 128 || DV == 256, "DV in boxes of 64, wgmma N of P V");
    static_assert(DV <= D && (D != 192 || DV == 128),
                  "DV <= D; D = 192 only with DV = 128 (multi-head latent attention)");
    static_assert(PACK == 1 || PACK == 2 || PACK == 4 || PACK == 8,
                  "packed heads: a power of two up to 8 (the Q box's heads, row g + 8 a whole "
                  "step on)");
    static_assert(PRODUCER_REGS + NUM_CONSUMERS * CONSUMER_REGS <=
                      (1 + NUM_CONSUMERS) * ENTRY_REGS,
                  "the register split must fit the registers the block is launched with");
    static_assert(TURN_BAR + NUM_CONSUMERS - 1 <= 15, "named barrier ids are 1..15");
    static_assert(SMEM_BYTES <= 227 * 1024, "shared memory past sm_90's 227 KiB per block");
};

// The operands of one block in shared memory and its barriers.
template <typename T, typename Cfg>
struct Sm90Smem {
    unsigned char* base;

    __device__ __forceinline__ T* q() const { return reinterpret_cast<T*>(base); }
    __device__ __forceinline__ T* k(int s) const {
        return reinterpret_cast<T*>(base + Cfg::OFF_K + s * Cfg::KV_BYTES);
    }
    __device__ __forceinline__ T* v(int s) const {
        return reinterpret_cast<T*>(base + Cfg::OFF_V + s * Cfg::V_BYTES);
    }
    __device__ __forceinline__ T* out() const { return reinterpret_cast<T*>(base + Cfg::OFF_OUT); }
    __device__ __forceinline__ sm90::u64* bar(int i) const {
        return reinterpret_cast<sm90::u64*>(base + Cfg::OFF_BARS) + i;
    }
    __device__ __forceinline__ sm90::u64* q_full() const { return bar(0); }
    __device__ __forceinline__ sm90::u64* q_empty() const { return bar(1); }
    __device__ __forceinline__ sm90::u64* k_full(int s) const { return bar(2 + s); }
    __device__ __forceinline__ sm90::u64* v_full(int s) const { return bar(2 + Cfg::STAGES + s); }
    __device__ __forceinline__ sm90::u64* ready(int s) const {
        return bar(2 + 2 * Cfg::STAGES + s);
    }
    __device__ __forceinline__ sm90::u64* k_empty(int s) const {
        return bar(2 + 3 * Cfg::STAGES + s);
    }
    __device__ __forceinline__ sm90::u64* v_empty(int s) const {
        return bar(2 + 4 * Cfg::STAGES + s);
    }
    // with a mask_mod: class table p (of the items of parity p), filled by the consumers
    // (cls_full: every consumer thread arrives), read by every thread of the block (cls_empty:
    // every thread arrives once its walk of the item is over)
    __device__ __forceinline__ sm90::u64* cls_full(int p) const {
        return bar(2 + 5 * Cfg::STAGES + p);
    }
    __device__ __forceinline__ sm90::u64* cls_empty(int p) const {
        return bar(4 + 5 * Cfg::STAGES + p);
    }
    __device__ __forceinline__ unsigned char* cls(int p) const {
        return base + Cfg::OFF_CLS + p * ClassTable::CAP;
    }
};

// Where a warpgroup stands in the block's barrier phases, carried from one work item to the
// next: the key chunks the block has passed through the K/V ring (its chunk c, of whichever
// item, uses stage c % STAGES in round c / STAGES: round_parity) and the Q tiles it has loaded
// (the q_full and q_empty phases). Producer and consumers count the same items and chunks.
struct Sm90Ring {
    int chunk = 0;      // the block's next key chunk
    int item = 0;       // the block's next Q tile

    __device__ __forceinline__ uint32_t q_parity() const {
        return static_cast<uint32_t>(item) & 1u;
    }
    // the item's class table, and the parity of that table's phases at this item's use of it
    __device__ __forceinline__ int table() const { return item & 1; }
    __device__ __forceinline__ uint32_t table_parity() const {
        return static_cast<uint32_t>(item >> 1) & 1u;
    }
    __device__ __forceinline__ void next_item() { ++item; }
};

// The work items of this block. Pair p = i_tile * G + i_group of the num_q_tiles x G (tile
// slot, head group) pairs is item num - 1 - p: slots in reverse order, as varlen_fwd takes
// them (a sequence's later query tiles see more keys under a causal mask, so its heaviest
// tiles start first; the unused slots, at the end of the table, are skipped first), the heads
// of a slot together. A group is PACK consecutive query heads (G = Hq / PACK), all of one key
// head. Block b takes items b, b + gridDim.x, b + 2 gridDim.x, ... (num is recomputed from the
// kernel's parameters at each use, not held in a register)
template <int PACK>
struct WorkItem {
    int index = static_cast<int>(blockIdx.x);

    __device__ __forceinline__ static int groups(const CallParams& call) { return call.Hq / PACK; }
    __device__ __forceinline__ static int num(const PlanView& plan, const CallParams& call) {
        return plan.num_q_tiles * groups(call);
    }
    __device__ __forceinline__ bool valid(const PlanView& plan, const CallParams& call) const {
        return index < num(plan, call);
    }
    __device__ __forceinline__ void advance() { index += static_cast<int>(gridDim.x); }
    __device__ __forceinline__ int tile(const PlanView& plan, const CallParams& call) const {
        return (num(plan, call) - 1 - index) / groups(call);
    }
    // the group's first query head
    __device__ __forceinline__ int head(const PlanView& plan, const CallParams& call) const {
        return (num(plan, call) - 1 - index) % groups(call) * PACK;
    }
};

// Which pass over a stage a chunk is: chunk i uses stage i % STAGES in its (i / STAGES)-th
// round, whose phases have parity (i / STAGES) & 1.
template <int STAGES>
__device__ __forceinline__ uint32_t round_parity(int i) {
    return static_cast<uint32_t>(i / STAGES) & 1u;
}

// The key chunks of KN rows of query tile i_tile walk the plan's row schedule (key_cursor),
// which does not depend on the chunk: when KN divides the plan's key tiles each tile is KN-row
// chunks; when KN is two tiles, a chunk is two consecutive tiles of one partner segment (full
// when both are), and the last tile of a segment's range, alone, makes a partial chunk: its
// rows past the tile are masked and their V rows zeroed like those past a sequence's end.
// With a mask_mod both sides walk the chunks through the item's class table (ClassTable,
// mask.cuh), which the consumers fill at the item's start (classify_chunks): an empty chunk is
// neither loaded nor computed, a full one keeps the schedule's flags (no mask_mod evaluated), a
// partial one is sanitised and its pairs tested.

// FlashAttention-3's ping-pong (section 3.1) of the two consumer warpgroups of BM = 128: each
// issues a block of GEMMs only on its turn and then hands the turn over, so that one's softmax
// runs while the other's GEMMs keep the tensor cores busy. Both walk the same chunks, so they
// issue the same number of blocks; the second lets the first go first and does not hand over
// after its last block (every phase of both barriers then completes). No-op with one consumer.
template <typename Cfg>
struct PingPong {
    int c_wg;

    __device__ __forceinline__ void start() const {
        if constexpr (Cfg::PINGPONG) {
            if (c_wg == 1) sm90::named_bar_arrive(Cfg::TURN_BAR, Cfg::TURN_THREADS);
        }
    }
    __device__ __forceinline__ void wait() const {
        if constexpr (Cfg::PINGPONG) sm90::named_bar_sync(Cfg::TURN_BAR + c_wg, Cfg::TURN_THREADS);
    }
    __device__ __forceinline__ void pass(bool last) const {
        if constexpr (Cfg::PINGPONG) {
            if (!(last && c_wg == 1)) {
                sm90::named_bar_arrive(Cfg::TURN_BAR + 1 - c_wg, Cfg::TURN_THREADS);
            }
        }
    }
};

// Rows r >= rows of a V stage zeroed (another sequence's rows or padding, which P V meets with
// P = 0), and a present V row with a NaN or inf zeroed and its K row made NaN, so that exactly
// the queries that see the key get a NaN score. One thread per row; a swizzled box keeps each
// 128-byte row in place (only its 16-byte chunks move), so whole rows are addressed as they
// are in a dense tile.
template <typename T, typename Cfg>
__device__ __forceinline__ void sanitize_partial_chunk(T* s_k, T* s_v, int rows, int t) {
    constexpr int VECS = Cfg::BOX_ROW_BYTES / 16;
    for (int r = t; r < Cfg::KN; r += Cfg::WG_THREADS) {
        bool bad = false;
        if (r < rows) {
            #pragma unroll
            for (int b = 0; b < Cfg::DV_BOXES; ++b) {
                const uint4* p = reinterpret_cast<const uint4*>(
                    reinterpret_cast<const unsigned char*>(s_v) + b * Cfg::KN * Cfg::BOX_ROW_BYTES +
                    r * Cfg::BOX_ROW_BYTES);
                #pragma unroll 1
                for (int i = 0; i < VECS; ++i) bad |= any_nonfinite<T>(p[i]);
            }
        }
        if (r < rows && !bad) continue;
        #pragma unroll
        for (int b = 0; b < Cfg::DV_BOXES; ++b) {
            uint4* p = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(s_v) +
                                                b * Cfg::KN * Cfg::BOX_ROW_BYTES +
                                                r * Cfg::BOX_ROW_BYTES);
            #pragma unroll
            for (int i = 0; i < VECS; ++i) p[i] = uint4{0u, 0u, 0u, 0u};
        }
        if (bad) {
            T* p = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(s_k) +
                                        r * Cfg::BOX_ROW_BYTES);
            #pragma unroll
            for (int i = 0; i < Cfg::BOX_COLS; ++i) p[i] = ElemTraits<T>::from_float(nan_f());
        }
    }
}

// `ROWS` rows of one head from packed row `row` into `dst`: one TMA box per 64 head-dim columns
// (the 128B swizzle's width; BOXES of them: D / 64, or DV / 64 for V), completing on `bar`.
template <typename Cfg, int ROWS, int BOXES = Cfg::D_BOXES>
__device__ __forceinline__ void load_rows(void* dst, const sm90::TensorMap* map, sm90::u64* bar,
                                          int head, int row) {
    #pragma unroll
    for (int b = 0; b < BOXES; ++b) {
        sm90::tma_load_3d(static_cast<unsigned char*>(dst) + b * ROWS * Cfg::BOX_ROW_BYTES, map,
                          bar, b * Cfg::BOX_COLS, head, row);
    }
}

// Loads V of chunk `c` (the i-th) once the consumers have released its stage's previous round;
// on a partial chunk all 128 producer threads then sanitise the landed K and V rows and hand
// the chunk on (`ready`; a full chunk was handed on with its K).
template <typename T, typename Cfg>
__device__ __forceinline__ void produce_v(const sm90::TensorMap* map_v, const Sm90Smem<T, Cfg>& sm,
                                          const Chunk& c, int i, int i_khead, int t) {
    const int s = i % Cfg::STAGES;
    const uint32_t parity = round_parity<Cfg::STAGES>(i);
    // every producer thread waits, so that none arrives on `ready` a round early
    sm90::mbar_wait(sm.v_empty(s), parity ^ 1u, "v_empty");
    if (t == 0) {
        sm90::mbar_arrive_expect_tx(sm.v_full(s), Cfg::V_BYTES);
        load_rows<Cfg, Cfg::KN, Cfg::DV_BOXES>(sm.v(s), map_v, sm.v_full(s), i_khead + c.head,
                                               c.row);
    }
    if (!c.full) {
        sm90::mbar_wait(sm.k_full(s), parity, "k_full");
        sm90::mbar_wait(sm.v_full(s), parity, "v_full");
        sanitize_partial_chunk<T, Cfg>(sm.k(s), sm.v(s), c.rows, t);
        // generic-proxy stores that the consumers' wgmma (async proxy) reads next
        sm90::fence_proxy_async();
        sm90::mbar_arrive(sm.ready(s));
    }
}

// The producer warpgroup over the block's work items: thread 0 issues the TMA loads of each
// item's Q (once the consumers have released the last one: q_empty) and of every key chunk of
// the tile's schedule, K of chunk i before V of chunk i - 1 (K is released a P V earlier than
// V); a full chunk is handed on (`ready`) with its K, a partial one once sanitised (produce_v).
// The last V of an item is issued before the next item's Q, so the consumers never wait on it
// behind a Q load.
template <typename T, typename Cfg>
__device__ __forceinline__ void fwd_sm90_producer(const sm90::TensorMap* map_q,
                                                  const sm90::TensorMap* map_k,
                                                  const sm90::TensorMap* map_v,
                                                  const Sm90Smem<T, Cfg>& sm, const PlanView& plan,
                                                  const CallParams& call) {
    constexpr int STAGES = Cfg::STAGES;
    const int t = threadIdx.x;
    Sm90Ring ring;
    for (WorkItem<Cfg::PACK> work; work.valid(plan, call); work.advance()) {
        const int i_tile = work.tile(plan, call);
        const TileInfo tile = load_tile(plan.q_tiles, i_tile);
        if (tile.seq < 0) continue;
        const int i_head = work.head(plan, call), i_khead = i_head / (call.Hq / call.Hk);
        if (t == 0) {
            // every consumer's last S of the previous item has retired (the first item passes)
            sm90::mbar_wait(sm.q_empty(), ring.q_parity() ^ 1u, "q_empty");
            sm90::mbar_arrive_expect_tx(sm.q_full(), Cfg::Q_BYTES);
            load_rows<Cfg, Cfg::BM>(sm.q(), map_q, sm.q_full(), i_head, tile.row);
        }
        const int table = ring.table();       // with a mask_mod: the item's class table
        if constexpr (HAS_MASK_MOD) {
            sm90::mbar_wait(sm.cls_full(table), ring.table_parity(), "cls_full");
        }
        auto keys = key_cursor_partials_first<Cfg::KN>(plan, i_tile, ClassTable{sm.cls(table)});
        Chunk prev{};       // rows 0: none yet (a chunk has rows)
        for (; keys.valid(); keys.advance(), ++ring.chunk) {
            const Chunk c = keys.chunk();
            const int i = ring.chunk;
            const int s = i % STAGES;
            // the consumers' S of this stage's previous round has retired (the first round passes)
            sm90::mbar_wait(sm.k_empty(s), round_parity<STAGES>(i) ^ 1u, "k_empty");
            if (t == 0) {
                sm90::mbar_arrive_expect_tx(sm.k_full(s), Cfg::KV_BYTES);
                load_rows<Cfg, Cfg::KN>(sm.k(s), map_k, sm.k_full(s), i_khead + c.head, c.row);
            }
            if (c.full) sm90::mbar_arrive(sm.ready(s));
            if (prev.rows > 0) produce_v<T, Cfg>(map_v, sm, prev, i - 1, i_khead, t);
            prev = c;
        }
        if (prev.rows > 0) produce_v<T, Cfg>(map_v, sm, prev, ring.chunk - 1, i_khead, t);
        if constexpr (HAS_MASK_MOD) sm90::mbar_arrive(sm.cls_empty(table));
        ring.next_item();
    }
}

// The mask_mod's class of each key chunk of a work item (query tile i_tile, `tile`) against
// its queries, chunk n of the item's key walk (key_cursor) into table[n] for the first
// ClassTable::CAP: consumer thread t (of NUM_CONSUMERS x 128) takes chunks t, t + 128
// NUM_CONSUMERS, ... At an item's start no accumulator is live, so the class code, inlined, has
// the consumers' registers.
template <typename Cfg>
__device__ __forceinline__ void classify_chunks(unsigned char* table, const PlanView& plan,
                                                int i_tile, const TileInfo& tile,
                                                const ModParams& mods, int t) {
    constexpr int THREADS = Cfg::NUM_CONSUMERS * Cfg::WG_THREADS;
    int n = 0;
    #pragma unroll 1
    for (auto keys = key_cursor<Cfg::KN>(plan, i_tile); keys.valid() && n < ClassTable::CAP;
         keys.advance(), ++n) {
        if (n % THREADS == t) {
            table[n] = static_cast<unsigned char>(chunk_class<false, false>(mods, tile,
                                                                            keys.chunk()));
        }
    }
}

// S = Q K^T of chunk i (this warpgroup's 64 rows; both K-major: k16 steps of 32 bytes inside a
// box, the next 64 columns one box further), issued and committed.
template <typename T, typename Cfg>
__device__ __forceinline__ void issue_s(float (&s_frag)[Cfg::KN / 2], const Sm90Smem<T, Cfg>& sm,
                                       sm90::u64 desc_q, int i) {
    constexpr uint32_t BOX_Q = Cfg::BM * Cfg::BOX_ROW_BYTES;   // bytes per box of 64 columns
    constexpr uint32_t BOX_KV = Cfg::KN * Cfg::BOX_ROW_BYTES;
    const sm90::u64 desc_k = sm90::smem_desc(sm.k(i % Cfg::STAGES), 0, Cfg::ATOM_BYTES,
                                             sm90::Swizzle::B128);
    #pragma unroll
    for (int kk = 0; kk < Cfg::D / 16; ++kk) {
        const uint32_t step = (kk % 4) * 32;      // k16 steps inside a box of 64 columns
        const sm90::u64 a = sm90::desc_advance(desc_q, (kk / 4) * BOX_Q + step);
        const sm90::u64 b = sm90::desc_advance(desc_k, (kk / 4) * BOX_KV + step);
        sm90::wgmma_ss<T, Cfg::KN, false, false>(s_frag, a, b, kk > 0);
    }
    sm90::wgmma_commit();
}

// O += P V of chunk i, issued and committed: P (registers) as A, V N-major as B: 8-key atoms
// SBO apart, k16 steps of 16 rows, the next 64 columns of the head dim one box (LBO) further.
template <typename T, typename Cfg>
__device__ __forceinline__ void issue_pv(float (&o_frag)[Cfg::DV / 2],
                                        const uint32_t (&p_frag)[Cfg::KN / 16][4],
                                        const Sm90Smem<T, Cfg>& sm, int i) {
    const sm90::u64 desc_v = sm90::smem_desc(sm.v(i % Cfg::STAGES),
                                             Cfg::KN * Cfg::BOX_ROW_BYTES, Cfg::ATOM_BYTES,
                                             sm90::Swizzle::B128);
    #pragma unroll
    for (int j = 0; j < Cfg::KN / 16; ++j) {
        sm90::wgmma_rs<T, Cfg::DV, true>(o_frag, p_frag[j],
                                        sm90::desc_advance(desc_v, j * 16 * Cfg::BOX_ROW_BYTES),
                                        true);
    }
    sm90::wgmma_commit();
}

// Mask and online softmax of a retired S (chunk c) into probabilities, returning in `corr` the
// factor exp2(m_old - m_new) by which O must be rescaled: the rescaling of
// OnlineSoftmax::update, deferred while O is in flight under the next P V.
template <bool HAS_SOFTCAP, int NB>
__device__ __forceinline__ void softmax_deferred(float (&acc_s)[NB][4], OnlineSoftmax& softmax,
                                                 float (&corr)[2], const TileMask<false>& mask,
                                                 const CallParams& call, int lane) {
    mask_scores<HAS_SOFTCAP>(acc_s, mask, call, lane);
    const float m_old[2] = {softmax.m[0], softmax.m[1]};
    float none[1][4] = {};
    softmax.update(acc_s, none);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float m = softmax.m[half];
        corr[half] = exp2f(m_old[half] - (m == neg_inf() ? 0.f : m));
    }
}

template <int NO>
__device__ __forceinline__ void rescale(float (&acc_o)[NO][4], const float (&corr)[2]) {
    #pragma unroll
    for (int no = 0; no < NO; ++no) {
        acc_o[no][0] *= corr[0];
        acc_o[no][1] *= corr[0];
        acc_o[no][2] *= corr[1];
        acc_o[no][3] *= corr[1];
    }
}

// One consumer warpgroup (rows 64 c .. 64 c + 63 of the tile) on one work item,
// FlashAttention-3's Alg. 2 over its key chunks 0 .. n - 1 (the block's chunks ring.chunk
// on) with two S tiles, the fp32 accumulator of the next chunk's S and this chunk's P packed
// to 16 bits:
//   S_0 = Q K_0^T; wait; softmax -> P_0 (the factor corr_0 of its O rescaling kept)
//   for j = 0 .. n - 2: issue S_{j+1} = Q K_{j+1}^T; O *= corr_j; issue O += P_j V_j;
//     wait<1> (S_{j+1} retired, P_j V_j in flight); release K_{j+1} (and Q after the
//     item's last S); softmax of S_{j+1} -> corr_{j+1}; wait<0>; release V_j; P_{j+1}
//   O *= corr_{n-1}; O += P_{n-1} V_{n-1}; wait; release V_{n-1}
// then O / l and lse through store_output. With two consumers each block of issues runs on the
// warpgroup's turn (PingPong). `w` is the warp's slot among the consumer warps, `i_head` the
// item's first query head (of PACK). Moves `ring` past the item.
template <typename T, typename Cfg, bool HAS_SOFTCAP>
__device__ __forceinline__ void fwd_sm90_consume_item(const Sm90Smem<T, Cfg>& sm,
                                                     const FwdParams& params, const TileInfo& tile,
                                                     int i_tile, int i_head, int c_wg,
                                                     const WarpSlot& w, sm90::u64 desc_q,
                                                     Sm90Ring& ring) {
    constexpr int STAGES = Cfg::STAGES, KN = Cfg::KN, DV = Cfg::DV;
    const PlanView& plan = params.plan;
    const CallParams& call = params.call;
    const SeqPolicy pol = SeqPolicy::load(plan, tile.seq);

    // [16, DV] output rows and [16, KN] scores of this warp, as the warpgroup's wgmma D
    // fragments, and [16, KN] probabilities of the chunk before as wgmma A fragments
    float acc_o[DV / 8][4];
    float acc_s[KN / 8][4];
    uint32_t p_frag[KN / 16][4];
    OnlineSoftmax softmax[1];
    zero_acc(acc_o);
    softmax[0].init();
    auto& o_frag = reinterpret_cast<float (&)[DV / 2]>(acc_o);
    auto& s_frag = reinterpret_cast<float (&)[KN / 2]>(acc_s);
    const PingPong<Cfg> turn{c_wg};
    // the mask of this warp's rows against a key chunk
    const auto rows_mask = [&](const Chunk& c) {
        return query_rows_mask<Cfg::PACK>(pol, tile, w, c, 0, params.mods, i_head);
    };

    const int table = ring.table();           // with a mask_mod: the item's class table
    if constexpr (HAS_MASK_MOD) {
        // the table's item before (two items back) is over in every thread (the first two
        // uses pass); this item's classes, then everybody's
        sm90::mbar_wait(sm.cls_empty(table), ring.table_parity() ^ 1u, "cls_empty");
        classify_chunks<Cfg>(sm.cls(table), plan, i_tile, tile, params.mods,
                             static_cast<int>(threadIdx.x) - Cfg::WG_THREADS);
        sm90::mbar_arrive(sm.cls_full(table));
        sm90::mbar_wait(sm.cls_full(table), ring.table_parity(), "cls_full");
    }
    sm90::mbar_wait(sm.q_full(), ring.q_parity(), "q_full");
    auto keys = key_cursor_partials_first<Cfg::KN>(plan, i_tile, ClassTable{sm.cls(table)});
    // Mask and softmax of the retired S of the cursor's chunk, its O rescaling deferred to
    // `corr`; moves the cursor on. After the item's last S it releases Q: the producer loads
    // the next item's under this softmax, the last P V and the epilogue.
    float corr[2];
    const auto softmax_chunk = [&]() {
        const TileMask<false> mask = rows_mask(keys.chunk());
        keys.advance();
        if (!keys.valid()) sm90::mbar_arrive(sm.q_empty());
        softmax_deferred<HAS_SOFTCAP>(acc_s, softmax[0], corr, mask, call, w.lane);
    };
    int i = ring.chunk;     // the block's chunk of P
    if (keys.valid()) {
        turn.start();
        // prologue: S_0
        sm90::mbar_wait(sm.ready(i % STAGES), round_parity<STAGES>(i), "ready");
        sm90::mbar_wait(sm.k_full(i % STAGES), round_parity<STAGES>(i), "k_full");
        turn.wait();
        sm90::wgmma_fence_operand(s_frag);
        sm90::wgmma_fence();
        issue_s<T, Cfg>(s_frag, sm, desc_q, i);
        turn.pass(false);
        sm90::wgmma_wait<0>();
        sm90::wgmma_fence_operand(s_frag);
        sm90::mbar_arrive(sm.k_empty(i % STAGES));
        softmax_chunk();
        #pragma unroll
        for (int j = 0; j < KN / 16; ++j) c_to_a<T>(p_frag[j], acc_s, j);
        for (; keys.valid(); ++i) {
            const int n = i + 1;
            const uint32_t parity_n = round_parity<STAGES>(n);
            sm90::mbar_wait(sm.ready(n % STAGES), parity_n, "ready");
            sm90::mbar_wait(sm.k_full(n % STAGES), parity_n, "k_full");
            turn.wait();
            // P was packed after the last wait: read by the wgmmas below (the ISA orders
            // register writes before an async read only through the wgmma.fence)
            sm90::wgmma_fence_operand(s_frag);
            sm90::wgmma_fence();
            issue_s<T, Cfg>(s_frag, sm, desc_q, n);
            // O rescaled to P_i's maximum while S_{i+1} is on the tensor cores
            // (FlashAttention-3's place for it), then fenced for P_i V_i
            sm90::wgmma_fence_operand(o_frag);
            rescale(acc_o, corr);
            sm90::mbar_wait(sm.v_full(i % STAGES), round_parity<STAGES>(i), "v_full");
            sm90::wgmma_fence_operand(o_frag);
            sm90::wgmma_fence();
            issue_pv<T, Cfg>(o_frag, p_frag, sm, i);
            turn.pass(false);
            sm90::wgmma_wait<1>();
            sm90::wgmma_fence_operand(s_frag);
            sm90::mbar_arrive(sm.k_empty(n % STAGES));
            softmax_chunk();
            sm90::wgmma_wait<0>();
            sm90::wgmma_fence_operand(o_frag);
            sm90::wgmma_fence_operand(p_frag);
            sm90::mbar_arrive(sm.v_empty(i % STAGES));
            #pragma unroll
            for (int j = 0; j < KN / 16; ++j) c_to_a<T>(p_frag[j], acc_s, j);
        }
        // epilogue: P V of the last chunk (Q was released after its S)
        sm90::wgmma_fence_operand(o_frag);
        rescale(acc_o, corr);
        sm90::mbar_wait(sm.v_full(i % STAGES), round_parity<STAGES>(i), "v_full");
        turn.wait();
        sm90::wgmma_fence_operand(o_frag);
        sm90::wgmma_fence();
        issue_pv<T, Cfg>(o_frag, p_frag, sm, i);
        turn.pass(true);
        sm90::wgmma_wait<0>();
        sm90::wgmma_fence_operand(o_frag);
        sm90::mbar_arrive(sm.v_empty(i % STAGES));
        ++i;
    } else {
        sm90::mbar_arrive(sm.q_empty());
    }
    store_output<T, DV, Cfg::OUT_STRIDE>(reinterpret_cast<const float (&)[1][DV / 8][4]>(acc_o),
                                         softmax, sm.out(),
                                         tile_output<T, DV, Cfg::PACK>(params, tile, i_head),
                                         w);
    // the warp's rows of the output stage were read back by other lanes: the next item's
    // staging must follow those reads
    __syncwarp();
    if constexpr (HAS_MASK_MOD) sm90::mbar_arrive(sm.cls_empty(table));
    ring.chunk = i;
    ring.next_item();
}

// One consumer warpgroup over the block's work items (the producer's, in the same order).
template <typename T, typename Cfg, bool HAS_SOFTCAP>
__device__ __forceinline__ void fwd_sm90_consumer(const Sm90Smem<T, Cfg>& sm,
                                                  const FwdParams& params, int c_wg,
                                                  const WarpSlot& w) {
    const PlanView& plan = params.plan;
    const CallParams& call = params.call;
    // K-major A: this warpgroup's 64 rows of Q, 8-row atoms SBO apart
    const sm90::u64 desc_q = sm90::smem_desc(reinterpret_cast<unsigned char*>(sm.q()) +
                                                 c_wg * Cfg::WG_ROWS * Cfg::BOX_ROW_BYTES,
                                             0, Cfg::ATOM_BYTES, sm90::Swizzle::B128);
    Sm90Ring ring;
    for (WorkItem<Cfg::PACK> work; work.valid(plan, call); work.advance()) {
        const int i_tile = work.tile(plan, call);
        const TileInfo tile = load_tile(plan.q_tiles, i_tile);
        if (tile.seq < 0) continue;
        fwd_sm90_consume_item<T, Cfg, HAS_SOFTCAP>(sm, params, tile, i_tile,
                                                   work.head(plan, call), c_wg, w, desc_q, ring);
    }
}

}  // namespace varlen

using namespace varlen;

// Tensor maps (made by the launcher, varlen/backends/cupy/sm90.py, from the pointers and strides
// of params): 3D over the arrays, dims (D, H, T) innermost first, strides those of the heads and
// rows, box (64, PACK, BM / PACK) for Q (PACK heads of BM / PACK positions: row r of the box
// is position r / PACK of head r % PACK, the plan's query tiles being BM / PACK rows) and
// (64, 1, KN) for K and V, 128B swizzle, zero fill past row T. BN is the plan's key tile, KN
// the key chunk. PACK divides Hq / Hk. Grid (G, 1) with G <= num_q_tiles x Hq / PACK work
// items (at most the SMs x CTAs per SM, at least 1). out and lse through params. DV:
// head_dim_v, the columns of v and out (DV < D: multi-head latent attention).
template <typename T, int D, int BM, int BN, bool HAS_SOFTCAP, int KN, int PACK, int DV = D>
__global__ void __launch_bounds__(FwdSm90Config<D, BM, BN, KN, PACK, DV>::NUM_THREADS, 1)
varlen_fwd_sm90(const __grid_constant__ sm90::TensorMap map_q,   // q [Tq, Hq, D]
                const __grid_constant__ sm90::TensorMap map_k,   // k [Tk, Hk, D]
                const __grid_constant__ sm90::TensorMap map_v,   // v [Tk, Hk, DV]
                const FwdParams params) {
    using Cfg = FwdSm90Config<D, BM, BN, KN, PACK, DV>;
    const PlanView& plan = params.plan;
    // The rows of no tile (as varlen_fwd's pad blocks, whose windows the block takes in turn:
    // pad block i_pad of a grid of one row of blocks), by the whole block before its items.
    // Block G - 1 - b takes the windows b, b + G, ...: the last blocks, whose items are the
    // shortest of each round, go first.
    #pragma unroll 1
    for (int i_pad = static_cast<int>(gridDim.x - 1 - blockIdx.x);
         static_cast<int64_t>(i_pad) * Cfg::NUM_THREADS * PAD_ROWS_PER_THREAD < plan.rows_q;
         i_pad += static_cast<int>(gridDim.x)) {
        write_forward_pad_rows<T, DV, Cfg::NUM_THREADS>(params, i_pad);
    }

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t misalign = sm90::smem_addr(smem_raw) % Cfg::ALIGN;
    const Sm90Smem<T, Cfg> sm{smem_raw + (misalign ? Cfg::ALIGN - misalign : 0)};
    if (threadIdx.x == 0) {
        sm90::mbar_init(sm.q_full(), 1);
        sm90::mbar_init(sm.q_empty(), Cfg::NUM_CONSUMERS * Cfg::WG_THREADS);
        if constexpr (HAS_MASK_MOD) {
            #pragma unroll
            for (int p = 0; p < 2; ++p) {
                sm90::mbar_init(sm.cls_full(p), Cfg::NUM_CONSUMERS * Cfg::WG_THREADS);
                sm90::mbar_init(sm.cls_empty(p), Cfg::NUM_THREADS);
            }
        }
        #pragma unroll
        for (int s = 0; s < Cfg::STAGES; ++s) {
            sm90::mbar_init(sm.k_full(s), 1);
            sm90::mbar_init(sm.v_full(s), 1);
            sm90::mbar_init(sm.ready(s), Cfg::WG_THREADS);
            sm90::mbar_init(sm.k_empty(s), Cfg::NUM_CONSUMERS * Cfg::WG_THREADS);
            sm90::mbar_init(sm.v_empty(s), Cfg::NUM_CONSUMERS * Cfg::WG_THREADS);
        }
        sm90::fence_barrier_init();
    }
    __syncthreads();

    if (threadIdx.x < Cfg::WG_THREADS) {
        sm90::setmaxnreg<Cfg::PRODUCER_REGS, false>();
        fwd_sm90_producer<T, Cfg>(&map_q, &map_k, &map_v, sm, plan, params.call);
    } else {
        sm90::setmaxnreg<Cfg::CONSUMER_REGS, true>();
        const int t = threadIdx.x - Cfg::WG_THREADS;
        const WarpSlot w{t % WARP_SIZE, t / WARP_SIZE, (t / WARP_SIZE) * WARP_ROWS};
        fwd_sm90_consumer<T, Cfg, HAS_SOFTCAP>(sm, params, t / Cfg::WG_THREADS, w);
    }
}
