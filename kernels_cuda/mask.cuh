// The per-sequence mask predicate, evaluated at global positions: its one home in the kernels.
//
// With s = Lk - Lq when bottom_right else 0, query i sees key j iff
//     (left < 0 or j >= i + s - left) and (right < 0 or j <= i + s + right),
// i.e. j lies in the band [i + s - left, i + s + right] (an unbounded side drops out), and,
// transposed, i lies in [j - s - right, j - s + left]. Kernels evaluate it only on partially
// masked tiles; the band edges are computed once per row in 64-bit and clamped to int32, so
// the per-element test is two integer compares and cannot overflow.
#pragma once

#include "common.cuh"
#include "mods.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

struct SeqPolicy {
    int left;     // window_left, < 0 = unbounded
    int right;    // window_right, < 0 = unbounded
    int shift;    // s = Lk - Lq (bottom-right aligned) or 0

    __device__ __forceinline__ static SeqPolicy load(const PlanView& plan, int b) {
        SeqPolicy pol;
        pol.left = plan.window_left[b];
        pol.right = plan.window_right[b];
        pol.shift = plan.bottom_right[b] ? plan.seqlen_k[b] - plan.seqlen_q[b] : 0;
        return pol;
    }
};

// A closed interval [lo, hi] of visible positions; empty when lo > hi.
struct Band {
    int lo;
    int hi;
    __device__ __forceinline__ bool contains(int x) const { return x >= lo && x <= hi; }
};

__device__ __forceinline__ int clamp_to_int(int64_t x) {
    return static_cast<int>(x < INT_LOWEST ? INT_LOWEST : (x > INT_HIGHEST ? INT_HIGHEST : x));
}

// Keys visible to query position i, intersected with the key rows present [k_lo, k_hi].
__device__ __forceinline__ Band key_band(const SeqPolicy& pol, int i, int k_lo, int k_hi) {
    const int64_t center = static_cast<int64_t>(i) + pol.shift;
    const int lo = pol.left < 0 ? INT_LOWEST : clamp_to_int(center - pol.left);
    const int hi = pol.right < 0 ? INT_HIGHEST : clamp_to_int(center + pol.right);
    return Band{max(lo, k_lo), min(hi, k_hi)};
}

// Queries that see key position j, intersected with the query rows present [q_lo, q_hi].
__device__ __forceinline__ Band query_band(const SeqPolicy& pol, int j, int q_lo, int q_hi) {
    const int64_t center = static_cast<int64_t>(j) - pol.shift;
    const int lo = pol.right < 0 ? INT_LOWEST : clamp_to_int(center - pol.right);
    const int hi = pol.left < 0 ? INT_HIGHEST : clamp_to_int(center + pol.left);
    return Band{max(lo, q_lo), min(hi, q_hi)};
}

// The mask_mod's class (user_mask_class, mods.cuh) of the pairs of the block's tile and a
// partner chunk c: the box of the tile's present rows by the chunk's, in positions inside the
// sequence (under context parallelism, the document's: TileInfo::pos, Chunk::pos), whatever the
// built-in band shows of it. KEY_TILE: the tile's rows are keys (dK/dV), else queries. O(1) per
// chunk, no table, no barrier: every thread computes it from the same values, so the block
// agrees on it. TILE_FULL without a mask_mod. CALLED: user_mask_class's.
template <bool KEY_TILE, bool CALLED = true>
__device__ __forceinline__ int chunk_class(const ModParams& mods, const TileInfo& tile,
                                           const Chunk& c) {
    if constexpr (!HAS_MASK_MOD) {
        return TILE_FULL;
    } else {
        const int t1 = tile.pos + tile.rows - 1, c1 = c.pos + c.rows - 1;
        return KEY_TILE ? user_mask_class<CALLED>(mods, tile.seq, c.pos, c1, tile.pos, t1)
                        : user_mask_class<CALLED>(mods, tile.seq, tile.pos, t1, c.pos, c1);
    }
}

// The `keep` of the chunk walks (pipeline.cuh) in kernels with a mask_mod: a chunk the
// mask_mod's class shows no pair of is dropped (never loaded or computed; with `keep_empty`
// kept, marked `mod_empty`, for a walk that must still pass it), one it shows every pair of
// keeps the built-in schedule's flags (no mask_mod evaluated), a partial one is marked
// `mod_partial` and not `full` (each pair tested; its operands sanitised as on any partial
// chunk). Without a mask_mod every chunk is kept unchanged (ALL). HOLD_NEXT: how
// for_each_chunk keeps the next chunk (pipeline.cuh), fitted to ptxas: the ordered dK/dV
// kernel with dropout reads it again (holding it spilled 12 B at D = 128 on sm_80), the others
// hold it (reading it again spilled 4-16 B at D = 64 with prefix-LM and a soft clip).
template <bool KEY_TILE, bool HOLD_NEXT_ = true>
struct UserMaskChunks {
    static constexpr bool ALL = !HAS_MASK_MOD;
    static constexpr bool HOLD_NEXT = HOLD_NEXT_;
    const ModParams& mods;
    const TileInfo& tile;
    bool keep_empty = false;

    __device__ __forceinline__ bool operator()(Chunk& c) const {
        const int cls = chunk_class<KEY_TILE>(mods, tile, c);
        c.mod_partial = cls == TILE_PARTIAL;
        c.mod_empty = keep_empty && cls == TILE_EMPTY;
        c.full = c.full && cls == TILE_FULL;
        return cls != TILE_EMPTY || keep_empty;
    }
};

// The sm_90a forward's `keep` with a mask_mod: each chunk's class read from the work item's
// table in shared memory, one byte per chunk in the order of the item's key walk (key_cursor),
// which its consumer warpgroups fill when the item starts (fwd_sm90.cuh, classify_chunks): the
// class code does not fit the producer (inlined into its 40 registers it spilled 348 B; called,
// it left setmaxnreg's register split unallocatable). Marks and drops as UserMaskChunks does.
// The walk calls it once per chunk and pass in walk order, and `restart` at the second pass;
// chunks past the table's CAP are taken as partial (coarser, never wrong). Without a mask_mod
// every chunk is kept unchanged (ALL; an empty type, so that such kernels are as they were).
constexpr int CLASS_TABLE_CAP = 2048;        // chunks of an item with a class (128 Ki keys of 64)

template <bool ON>
struct ClassTableOf {
    static constexpr bool ALL = false;
    static constexpr int CAP = CLASS_TABLE_CAP;
    const unsigned char* table;
    int n = 0;                               // the walk's next chunk

    __device__ __forceinline__ void restart() { n = 0; }
    __device__ __forceinline__ bool operator()(Chunk& c) {
        const int cls = n < CAP ? static_cast<int>(table[n]) : TILE_PARTIAL;
        ++n;
        c.mod_partial = cls == TILE_PARTIAL;
        c.full = c.full && cls == TILE_FULL;
        return cls != TILE_EMPTY;
    }
};

template <>
struct ClassTableOf<false> : KeepAll {
    static constexpr int CAP = CLASS_TABLE_CAP;
    __device__ __forceinline__ explicit ClassTableOf(const unsigned char*) {}
};

using ClassTable = ClassTableOf<HAS_MASK_MOD>;

// The mask of a warp's [16, N] tile in C-fragment layout, whose columns are one partner chunk:
// rows are queries and columns keys (forward, dQ), or, transposed, rows are keys and columns
// queries (dK/dV). A lane holds rows g and g + 8 (`half` 0 and 1); `band(half)` gives the
// column positions its row sees, computed once per row, and `visible` tests one column. In a
// tile of packed query heads (fwd_sm90's PACK heads per position) row g + 8 is 8 / PACK
// positions further (none at PACK = 16).
// In kernels compiled with the call's mask_mod or score_mod (mods.cuh, HAS_MODS) rows past the
// tile see nothing (never reach the user's functions, even in a full chunk), the mask_mod is
// evaluated on the chunks its class leaves partial (`mod_partial`, UserMaskChunks), the
// score_mod on every visible pair, and the mask carries what the user's functions take besides
// the positions: the sequence, the query head, the aux arrays.
template <bool ROWS_ARE_KEYS>
struct TileMask {
    SeqPolicy pol;
    int row_pos;      // global position of this lane's row g
    int rows_left;    // rows of the tile present from row g on (key rows past them see nothing)
    int col_pos0;     // global position of column 0
    int cols;         // columns present
    bool partial;     // false: every pair of the tile is visible and nothing is tested
    int half_step = 8;  // positions from row g to row g + 8
    // HAS_MODS only
    const ModParams* mods = nullptr;
    int seq = 0;        // the sequence b
    int head = 0;       // query head: of the chunk (ROWS_ARE_KEYS), else of the tile's row 0
    int head_row = 0;   // tile row of row g: with packed heads row r is head + (r & head_mask)
    int head_mask = 0;  // PACK - 1
    bool aux_grads = true;  // HAS_AUX_GRADS: the backward adds the aux gradients of this tile
    bool mod_partial = true;  // HAS_MASK_MOD: the mask_mod is evaluated (the chunk's mod_partial)

    __device__ __forceinline__ Band band(int half) const {
        const int pos = row_pos + half_step * half;
        const int col_last = col_pos0 + cols - 1;
        if constexpr (ROWS_ARE_KEYS || HAS_MODS) {
            if (8 * half >= rows_left) return Band{1, 0};
        }
        if constexpr (ROWS_ARE_KEYS) {
            return query_band(pol, pos, col_pos0, col_last);
        } else {
            return key_band(pol, pos, col_pos0, col_last);
        }
    }

    __device__ __forceinline__ bool visible(const Band& m_band, int col) const {
        return !partial || m_band.contains(col_pos0 + col);
    }

    // The pair of row g + 8 half and column col: its query and key positions, its query head.
    __device__ __forceinline__ int q_idx(int half, int col) const {
        return ROWS_ARE_KEYS ? col_pos0 + col : row_pos + half_step * half;
    }
    __device__ __forceinline__ int k_idx(int half, int col) const {
        return ROWS_ARE_KEYS ? row_pos + half_step * half : col_pos0 + col;
    }
    __device__ __forceinline__ int query_head(int half) const {
        return ROWS_ARE_KEYS ? head : head + ((head_row + 8 * half) & head_mask);
    }
    // Whether the pair the built-in mask shows (`visible`) is shown by the mask_mod too (where
    // its class of the chunk is partial); a row past the tile is not (on a full chunk `visible`
    // does not test rows).
    __device__ __forceinline__ bool user_visible(bool visible, int half, int col) const {
        visible = visible && 8 * half < rows_left;
        return visible && (!mod_partial || user_mask(*mods, seq, q_idx(half, col),
                                                     k_idx(half, col)));
    }
    // The score_mod of a visible pair's score s (natural-log units), and its derivative.
    __device__ __forceinline__ float user_score(float s, int half, int col) const {
        return ::varlen::user_score(*mods, s, seq, query_head(half), q_idx(half, col),
                                    k_idx(half, col));
    }
    __device__ __forceinline__ float user_score_grad(float s, int half, int col) const {
        return ::varlen::user_score_grad(*mods, s, seq, query_head(half), q_idx(half, col),
                                         k_idx(half, col));
    }
    // A visible pair's share of the aux gradients: ds = dL/d score_mod(s).
    __device__ __forceinline__ void user_aux_grad(float ds, float s, int half, int col) const {
        ::varlen::user_aux_grad(*mods, ds, s, seq, query_head(half), q_idx(half, col),
                                k_idx(half, col));
    }
};

// Rows are the queries of query tile `tile` (forward, dQ), in m16 tile `m_tile` of the warp's
// rows; `keys` the chunk. With PACK > 1 (a power of two) the tile holds PACK query heads per
// position: its row r is position tile.pos + r / PACK, of query head `head` + r % PACK. Query
// rows past the tile need no mask (nothing of them is written) except under the user's
// functions, which see no such row.
template <int PACK = 1>
__device__ __forceinline__ TileMask<false> query_rows_mask(const SeqPolicy& pol,
                                                           const TileInfo& tile,
                                                           const WarpSlot& w, const Chunk& keys,
                                                           int m_tile, const ModParams& mods,
                                                           int head) {
    static_assert(PACK >= 1 && PACK <= 16 && (PACK & (PACK - 1)) == 0,
                  "packed rows: a power of two of heads per position, row g + 8 a whole step on");
    const int row = w.row0 + WARP_ROWS * m_tile + w.lane / 4;
    TileMask<false> mask{pol, tile.pos + row / PACK, tile.rows * PACK - row, keys.pos, keys.rows,
                         !keys.full, 8 / PACK, &mods, tile.seq, head, row, PACK - 1};
    mask.mod_partial = keys.mod_partial;
    return mask;
}

// Rows are the keys of a tile of BN rows (dK/dV); `queries` the chunk, of query head `head`. A
// ragged key tile is masked even against a fully visible chunk, so that its missing rows
// contribute nothing.
template <int BN>
__device__ __forceinline__ TileMask<true> key_rows_mask(const SeqPolicy& pol, const TileInfo& tile,
                                                        const WarpSlot& w, const Chunk& queries,
                                                        const ModParams* mods = nullptr,
                                                        int head = 0) {
    const int row = w.row0 + w.lane / 4;
    TileMask<true> mask{pol, tile.pos + row, tile.rows - row, queries.pos, queries.rows,
                        !queries.full || tile.rows < BN, 8, mods, tile.seq, head};
    mask.mod_partial = queries.mod_partial;
    return mask;
}

// Calls f(nb, i, col, visible) for every element this lane holds of a [16, 8 NB] tile under
// `mask`: element s[nb][i] is in row g + 8 (i / 2), column col = nb * 8 + 2t + i % 2.
template <int NB, bool ROWS_ARE_KEYS, typename F>
__device__ __forceinline__ void for_each_element(const TileMask<ROWS_ARE_KEYS>& mask, int lane,
                                                 F&& f) {
    const int t = lane % 4;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const Band m_band = mask.band(half);
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = nb * 8 + 2 * t + e;
                f(nb, 2 * half + e, col, mask.visible(m_band, col));
            }
        }
    }
}

}  // namespace varlen
