// Walking the plan's tile schedule (varlen/plan.py, docs/plan.md).
//
// q_tiles / k_tiles: int32 [num_tiles, 5] = (seq, seg, row, rows, pos); seq = -1 marks an
// unused slot. q_sched / k_sched: int32 [num_tiles, m, 4] = (begin, full_begin, full_end, end)
// partner-tile indices per partner segment: [begin, end) holds a visible pair, [full_begin,
// full_end) only visible pairs, the rest of [begin, end) is partially masked and everything
// outside is skipped (never loaded).
#pragma once

#include "common.cuh"

namespace varlen {

constexpr int TILE_FIELDS = 5;
constexpr int SCHED_FIELDS = 4;

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
// row present, so no mask arithmetic is needed.
struct Chunk {
    int row;
    int rows;
    int pos;
    int head;
    bool full;
};

// Iterates over the partner chunks of one tile: for each of NUM_HEADS head offsets (the
// query heads sharing a key head in dK/dV; 1 elsewhere), each partner segment and each chunk
// of CHUNK rows inside the scheduled range. A plan tile of partner rows splits into `ratio`
// chunks (plan tile = ratio * CHUNK rows, checked on the host), each inheriting its tile's
// full/partial flag. Every thread of a block holds the same cursor state (uniform control
// flow).
template <int CHUNK>
struct PartnerCursor {

    const int* p_sched;    // [num_segments, 4] schedule row of this tile
    const int* p_row;      // [num_segments] partner segments of this sequence
    const int* p_len;
    const int* p_pos;
    int num_segments;
    int num_heads;
    int ratio;

    int head, seg, c, c_end, f_begin, f_end;
    int row, pos, left;    // chunk c's first packed row and position, rows of the segment from it

    // The schedule row `sched` of a tile of sequence b against the partner segments
    // [b * segments, (b + 1) * segments) of `row`, `len` and `pos`.
    __device__ __forceinline__ PartnerCursor(const int* sched, const int* row0, const int* len,
                                             const int* pos0, int b, int segments, int heads,
                                             int chunks_per_tile) {
        const int64_t first = static_cast<int64_t>(b) * segments;
        p_sched = sched; p_row = row0 + first; p_len = len + first; p_pos = pos0 + first;
        num_segments = segments; num_heads = heads; ratio = chunks_per_tile;
        head = 0; seg = 0;
        enter();
    }

    // Moves to the first non-empty chunk range at or after (head, seg) and reads that segment's
    // first row and position once: moving inside a segment is then a compare and an add.
    __device__ __forceinline__ void enter() {
        while (head < num_heads) {
            while (seg < num_segments) {
                const int* s = p_sched + seg * SCHED_FIELDS;
                const int len = p_len[seg];
                // not (len + CHUNK - 1) / CHUNK, which overflows for len > 2^31 - CHUNK
                const int num_chunks = len / CHUNK + (len % CHUNK != 0);
                c = s[0] * ratio;
                c_end = min(s[3] * ratio, num_chunks);
                f_begin = s[1] * ratio;
                f_end = s[2] * ratio;
                if (c < c_end) {
                    const int offset = c * CHUNK;      // < len: no overflow
                    row = p_row[seg] + offset;
                    pos = p_pos[seg] + offset;
                    left = len - offset;
                    return;
                }
                ++seg;
            }
            ++head;
            seg = 0;
        }
    }

    __device__ __forceinline__ bool valid() const { return head < num_heads; }

    __device__ __forceinline__ void advance() {
        if (++c >= c_end) {
            ++seg;
            enter();
        } else {
            row += CHUNK;
            pos += CHUNK;
            left -= CHUNK;
        }
    }

    __device__ __forceinline__ Chunk chunk() const {
        const int rows = min(CHUNK, left);
        return Chunk{row, rows, pos, head, c >= f_begin && c < f_end && rows == CHUNK};
    }
};

// The key chunks of KN rows of query tile i_tile (forward, dQ): the host compiles BN =
// plan.block_n (KernelSpec), and a plan tile is BN / KN chunks.
template <int BN, int KN = BN>
__device__ __forceinline__ PartnerCursor<KN> key_cursor(const PlanView& plan, const TileInfo& tile,
                                                        int i_tile) {
    static_assert(BN % KN == 0, "a plan tile of keys is a whole number of chunks");
    return PartnerCursor<KN>(plan.q_sched + static_cast<int64_t>(i_tile) * plan.mk * SCHED_FIELDS,
                             plan.k_row, plan.k_len, plan.k_pos, tile.seq, plan.mk, 1, BN / KN);
}

// The query chunks of key tile i_tile (dK/dV) for each of `heads` query heads; a plan tile of
// block_m query rows is block_m / BQ chunks (a whole number, checked by KernelSpec).
template <int BQ>
__device__ __forceinline__ PartnerCursor<BQ> query_cursor(const PlanView& plan,
                                                          const TileInfo& tile, int i_tile,
                                                          int heads) {
    return PartnerCursor<BQ>(plan.k_sched + static_cast<int64_t>(i_tile) * plan.mq * SCHED_FIELDS,
                             plan.q_row, plan.q_len, plan.q_pos, tile.seq, plan.mq, heads,
                             plan.block_m / BQ);
}

}  // namespace varlen
