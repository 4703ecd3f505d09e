// Walking the plan's tile schedule (varlen/plan.py, docs/plan.md).
//
// q_tiles / k_tiles: int32 [num_tiles, 5] = (seq, seg, row, rows, pos); seq = -1 marks an
// unused slot. q_sched / k_sched: int32 [num_tiles, m, 4] = (begin, full_begin, full_end, end)
// partner-tile indices per partner segment: [begin, end) holds a visible pair, [full_begin,
// full_end) only visible pairs, the rest of [begin, end) is partially masked and everything
// outside is skipped (never loaded). q_row_sched / k_row_sched: int32 [num_tiles, m, 5] = the
// same ranges as packed partner rows clipped to each segment, and pos - row of the segment
// (what PartnerCursor walks).
#pragma once

#include "common.cuh"

namespace varlen {

constexpr int TILE_FIELDS = 5;
constexpr int SCHED_FIELDS = 4;
constexpr int ROW_SCHED_FIELDS = 5;      // plan.ROW_SCHED_FIELDS: q_row_sched / k_row_sched

struct TileInfo {
    int seq;    // sequence b, -1 for an unused slot
    int seg;    // segment inside the sequence
    int row;    // first packed row
    int rows;   // valid rows (<= the tile size)
    int pos;    // global position of the first row inside the sequence
};

__device__ __forceinline__ TileInfo load_tile(const int* p_tiles, int i_tile) {
    const int* p = p_tiles + static_cast<int64_t>(i_tile) * TILE_FIELDS;
    return TileInfo{p[0], p[1], p[2], p[3], p[4]};
}

// One chunk of partner rows to visit: `rows` rows starting at packed row `row` and global
// position `pos`, belonging to head offset `head`; `full` = every pair is visible and every
// row present, so no mask arithmetic is needed. Kernels with a mask_mod mark a chunk by its
// class (UserMaskChunks, mask.cuh): `mod_partial`, the mask_mod is evaluated pair by pair
// (`full` is then false too); `mod_empty`, no pair is visible and the chunk is neither loaded
// nor computed, only walked (the ordered dQ's turn at it; other walks drop such a chunk).
struct Chunk {
    int row;
    int rows;
    int pos;
    int head;
    bool full;
    bool mod_partial = false;
    bool mod_empty = false;

    // Its rows from `col` on as a chunk of their own (a subtile of a chunk's query columns in
    // dK/dV; none left when col >= rows: every pair masked)
    __device__ __forceinline__ Chunk from(int col) const {
        return Chunk{row + col, rows - col, pos + col, head, full, mod_partial, mod_empty};
    }
};

// Iterates over the partner chunks of one tile: for each of NUM_HEADS head offsets (the
// query heads sharing a key head in dK/dV; 1 elsewhere), each partner segment and each chunk
// of CHUNK rows inside the scheduled range. It walks the plan's row schedule (q_row_sched /
// k_row_sched: [num_segments, 5] = (row_begin, row_full_begin, row_full_end, row_end,
// pos_delta) per partner segment, the tile ranges of the schedule as packed rows clipped to
// the segment): chunks start at row_begin and every CHUNK rows after it, the last one cut at
// row_end. A chunk is full when its CHUNK rows all lie in [row_full_begin, row_full_end), so a
// chunk that crosses a bound, or the short last chunk of a segment, takes the mask
// arithmetic; with CHUNK dividing the plan's partner tile, the chunks of a tile inherit its
// full/partial flag. The bounds do not depend on CHUNK: one plan serves every chunk size.
// Every thread of a block holds the same cursor state (uniform control flow).
template <int CHUNK>
struct PartnerCursor {

    const int* p_rows;     // [num_segments, ROW_SCHED_FIELDS] row schedule of this tile
    int num_segments;
    int num_heads;

    int head, seg;
    int row;               // the current chunk's first packed row
    int row_end;           // of the current segment

    // Row schedule `row_sched` ([segments, 5]) of one tile, walked `heads` times.
    __device__ __forceinline__ PartnerCursor(const int* row_sched, int segments, int heads) {
        p_rows = row_sched;
        num_segments = segments; num_heads = heads;
        head = 0; seg = 0;
        enter();
    }

    // Moves to the first non-empty range at or after (head, seg) and reads its bounds once:
    // moving inside a segment is then a compare and an add.
    __device__ __forceinline__ void enter() {
        while (head < num_heads) {
            while (seg < num_segments) {
                const int* r = p_rows + seg * ROW_SCHED_FIELDS;
                row = r[0];
                row_end = r[3];
                if (row < row_end) return;
                ++seg;
            }
            ++head;
            seg = 0;
        }
    }

    __device__ __forceinline__ bool valid() const { return head < num_heads; }

    // Compares before it adds, and against row_end - CHUNK (>= -CHUNK): row + CHUNK overflows
    // int32 past the last chunk of a buffer of nearly 2^31 rows.
    __device__ __forceinline__ void advance() {
        if (row >= row_end - CHUNK) {
            ++seg;
            enter();
        } else {
            row += CHUNK;
        }
    }

    // The segment's other fields are read again (L1) rather than held in registers across
    // the chunk's work.
    __device__ __forceinline__ Chunk chunk() const {
        const int* r = p_rows + seg * ROW_SCHED_FIELDS;
        return Chunk{row, min(CHUNK, row_end - row), row + r[4], head,
                     row >= r[1] && row <= r[2] - CHUNK};
    }
};

// The chunks a block computes: every one the schedule lists. A `keep(chunk)` (UserMaskChunks,
// mask.cuh) may drop some and mark the others; ALL: it takes every chunk unchanged.
struct KeepAll {
    static constexpr bool ALL = true;
    __device__ __forceinline__ bool operator()(Chunk&) const { return true; }
};

// Keep::ALL of a `keep` passed by reference.
template <typename Keep> struct KeepsAll { static constexpr bool value = Keep::ALL; };
template <typename Keep> struct KeepsAll<Keep&> : KeepsAll<Keep> {};
template <typename Keep> struct KeepsAll<const Keep> : KeepsAll<Keep> {};

// The chunks of a PartnerCursor in two passes: the partial ones (a causal diagonal's, a ragged
// end's, a window's edge: the mask arithmetic) first, then the full ones, each pass in the
// cursor's order. The sm_90a forward walks its key chunks so (FlashAttention-3 walks them from
// the diagonal down): the partial chunks, whose V landing and sanitising the consumers wait
// for, come while the previous item drains, not at the item's end (docs/hopper.md, "The
// persistent loop"). The second pass restarts the walk; a chunk of the other pass costs a
// compare and an add to step over. With a `keep` (ClassTable: ALL false) the chunks it drops
// are in neither pass, its marks decide the pass, and the current chunk is held as marked
// (`cur`; the keep is asked in both passes, once per chunk in walk order, and told to
// `restart` where the second pass does).
template <int CHUNK, typename Keep = KeepAll>
struct PartialsFirstCursor {
    PartnerCursor<CHUNK> walk;
    bool full_pass;
    Keep keep;
    Chunk cur;          // !Keep::ALL: the current chunk, marked

    __device__ __forceinline__ PartialsFirstCursor(const int* row_sched, int segments, int heads,
                                                   const Keep& keep_ = Keep{})
        : walk(row_sched, segments, heads), full_pass(false), keep(keep_) {
        settle();
    }

    // On the next chunk of this pass at or after the walk's, or past the last of both.
    __device__ __forceinline__ void settle() {
        for (;;) {
            if (!walk.valid()) {
                if (full_pass) return;
                full_pass = true;
                walk.head = 0;
                walk.seg = 0;
                walk.enter();
                if constexpr (!Keep::ALL) keep.restart();
                continue;
            }
            if constexpr (Keep::ALL) {
                if (walk.chunk().full == full_pass) return;
            } else {
                cur = walk.chunk();
                if (keep(cur) && cur.full == full_pass) return;
            }
            walk.advance();
        }
    }

    __device__ __forceinline__ bool valid() const { return walk.valid(); }
    __device__ __forceinline__ void advance() {
        walk.advance();
        settle();
    }
    __device__ __forceinline__ Chunk chunk() const {
        if constexpr (Keep::ALL) {
            return walk.chunk();
        } else {
            return cur;
        }
    }
};

// ---- Pad rows: the rows of a packed array that no tile covers -------------------------------
//
// Gaps between segments, rows past the last one, positions past a sequence's global length: the
// kernels write these rows of their outputs too (out 0 and lse -inf, gradients 0), so that no
// output needs a fill before it. They are taken in windows of PAD_ROWS_PER_THREAD consecutive
// rows, one per thread: the forward's pad blocks, past its query tile slots, own window i_pad *
// gridDim.y + blockIdx.y of NUM_THREADS windows each (pad_window); the backward preprocessing
// strides over the windows of dQ, dK and dV. A thread walks the whole tile table (the threads
// of a warp read the same entry: one broadcast load) and marks the rows of its window that some
// tile covers; what is left is exactly the complement of the rows the tile blocks write,
// whatever the order of the segments (all-gathered context-parallel segments are not in row
// order): no row is written twice or by two threads, none is left out. The launchers
// (varlen/backends/cupy/mma.py) size the grids with the same constant.
constexpr int PAD_ROWS_PER_THREAD = 32;

// The index of slot i_slot among the pad blocks of a grid over num_slots tile slots, or -1 for
// a tile slot.
__device__ __forceinline__ int pad_block_index(int i_slot, int num_slots) {
    return i_slot >= num_slots ? i_slot - num_slots : -1;
}

// This thread's window in pad block i_pad of a grid of NUM_THREADS-thread blocks.
template <int NUM_THREADS>
__device__ __forceinline__ int64_t pad_window(int i_pad) {
    return (static_cast<int64_t>(i_pad) * gridDim.y + blockIdx.y) * NUM_THREADS + threadIdx.x;
}

// Calls clear(begin, end) (int64 rows) for each maximal run of rows of window `window` (rows
// window * PAD_ROWS_PER_THREAD on, those below num_rows) that no tile of p_tiles [num_tiles, 5]
// covers.
template <typename Clear>
__device__ __forceinline__ void for_each_pad_run(const int* p_tiles, int num_tiles, int num_rows,
                                                 int64_t window, Clear&& clear) {
    static_assert(PAD_ROWS_PER_THREAD == 32, "one bit per row in a 32-bit mask");
    const int64_t first = window * PAD_ROWS_PER_THREAD;
    if (first >= num_rows) return;
    const int n = static_cast<int>(min(static_cast<int64_t>(PAD_ROWS_PER_THREAD),
                                       num_rows - first));
    uint32_t covered = 0;        // bit i: row first + i lies in a tile
    // Not unrolled, here and below: this code stays small beside the tile blocks'.
    #pragma unroll 1
    for (int t = 0; t < num_tiles; ++t) {
        const TileInfo tile = load_tile(p_tiles, t);       // unused slots have no rows
        const int64_t lo = max(static_cast<int64_t>(tile.row), first);
        const int64_t hi = min(static_cast<int64_t>(tile.row) + tile.rows, first + n);
        if (lo < hi) {
            const int width = static_cast<int>(hi - lo);
            const uint32_t bits = width == 32 ? ~0u : (1u << width) - 1u;
            covered |= bits << static_cast<int>(lo - first);
        }
    }
    #pragma unroll 1
    for (int i = 0; i < n;) {
        if ((covered >> i) & 1u) {
            ++i;
            continue;
        }
        int end = i + 1;
        #pragma unroll 1
        while (end < n && !((covered >> end) & 1u)) ++end;
        clear(first + i, first + end);
        i = end;
    }
}

// Zeros rows [begin, end) of heads 0 .. heads - 1 of a [T, H, D] array whose rows and heads
// lie `s` apart (each head's row of D elements 16-byte aligned: the launchers' outputs), in
// 16-byte stores.
template <int D, typename T>
__device__ __forceinline__ void zero_head_rows(T* base, const Strides& s, int heads,
                                               int64_t begin, int64_t end) {
    constexpr int VECS = D * static_cast<int>(sizeof(T)) / 16;
    static_assert(D * sizeof(T) % 16 == 0, "a head's row is whole 16-byte chunks");
    #pragma unroll 1
    for (int64_t r = begin; r < end; ++r) {
        #pragma unroll 1
        for (int h = 0; h < heads; ++h) {
            T* row = base + r * s.row + static_cast<int64_t>(h) * s.head;
            uint4* p = reinterpret_cast<uint4*>(row);
            #pragma unroll
            for (int i = 0; i < VECS; ++i) p[i] = uint4{0u, 0u, 0u, 0u};
        }
    }
}

// The key chunks of KN rows of query tile i_tile (forward, dQ).
template <int KN>
__device__ __forceinline__ PartnerCursor<KN> key_cursor(const PlanView& plan, int i_tile) {
    return PartnerCursor<KN>(
        plan.q_row_sched + static_cast<int64_t>(i_tile) * plan.mk * ROW_SCHED_FIELDS, plan.mk, 1);
}

// The same chunks, the partial ones first (PartialsFirstCursor), those `keep` takes.
template <int KN, typename Keep = KeepAll>
__device__ __forceinline__ PartialsFirstCursor<KN, Keep> key_cursor_partials_first(
    const PlanView& plan, int i_tile, const Keep& keep = Keep{}) {
    return PartialsFirstCursor<KN, Keep>(
        plan.q_row_sched + static_cast<int64_t>(i_tile) * plan.mk * ROW_SCHED_FIELDS, plan.mk, 1,
        keep);
}

// The query chunks of BQ rows of key tile i_tile (dK/dV) for each of `heads` query heads.
template <int BQ>
__device__ __forceinline__ PartnerCursor<BQ> query_cursor(const PlanView& plan, int i_tile,
                                                          int heads) {
    return PartnerCursor<BQ>(
        plan.k_row_sched + static_cast<int64_t>(i_tile) * plan.mq * ROW_SCHED_FIELDS, plan.mq,
        heads);
}

}  // namespace varlen
