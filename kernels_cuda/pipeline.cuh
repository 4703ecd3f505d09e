// The main loop every attention kernel shares: a block keeps its own tile in shared memory and
// streams the partner chunks its schedule lists through two shared-memory stages, fetching the
// chunk after the current one with cp.async while the current one is computed. Only scheduled
// chunks are loaded.
#pragma once

#include "common.cuh"
#include "mma.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

constexpr int STAGES = 2;

// The next chunk of `cursor` that `keep` takes (marked by it), the cursor moved past it; rows
// 0 past the last. `keep` gives every thread the same answer, so every thread walks alike.
template <int CHUNK, typename Keep>
__device__ __forceinline__ Chunk next_kept(PartnerCursor<CHUNK>& cursor, Keep&& keep) {
    while (cursor.valid()) {
        Chunk c = cursor.chunk();
        cursor.advance();
        if (keep(c)) return c;
    }
    return Chunk{0, 0, 0, 0, false};
}

// Moves `cursor` to the next chunk `keep` takes, at or after its own, and returns it as `keep`
// marked it (nothing past the last).
template <int CHUNK, typename Keep>
__device__ __forceinline__ Chunk settle_kept(PartnerCursor<CHUNK>& cursor, Keep&& keep) {
    Chunk c{0, 0, 0, 0, false};
    while (cursor.valid()) {
        c = cursor.chunk();
        if (keep(c)) break;
        cursor.advance();
    }
    return c;
}

// Chunk c with the marks `keep` gave `marked` (the same chunk).
__device__ __forceinline__ Chunk with_marks(Chunk c, const Chunk& marked) {
    c.full = marked.full;
    c.mod_partial = marked.mod_partial;
    c.mod_empty = marked.mod_empty;
    return c;
}

// Runs `compute(chunk, stage)` on every chunk of `cursor` (that `keep` takes) once
// `load(chunk, stage)` has filled that stage. Before, `own(chunk, stage)` runs between this
// thread's wait for its copies and the barrier that publishes everyone's: a thread may rewrite
// its own copies there (zero_nonfinite_chunks). The copies of the block's own tile, issued by
// the caller before, join the first chunk's group. On return every copy has landed and every
// thread is past its last compute, so the shared tiles may be reused. With KeepAll the loop
// holds no chunk ahead (the cursor is its state), as it did before `keep`; with another `keep`
// it holds the next chunk (Keep::HOLD_NEXT) or its marks only, the cursor waiting on it: the
// choice ptxas allocates without a spill (UserMaskChunks).
template <int CHUNK, typename Load, typename Own, typename Compute, typename Keep = KeepAll>
__device__ __forceinline__ void for_each_chunk(PartnerCursor<CHUNK>& cursor, Load&& load,
                                               Own&& own, Compute&& compute,
                                               Keep keep = Keep{}) {
    const auto step = [&](const Chunk& cur, int stage) {
        cp_async_commit();
        cp_async_wait<1>();      // every group but the prefetch: the own tile and `cur`
        own(cur, stage);
        __syncthreads();
        compute(cur, stage);
        __syncthreads();         // everyone is done with this stage before it is refilled
    };
    int stage = 0;
    if constexpr (Keep::ALL) {
        if (cursor.valid()) load(cursor.chunk(), 0);
        cp_async_commit();
        while (cursor.valid()) {
            const Chunk cur = cursor.chunk();
            cursor.advance();
            // The other stage was last read one iteration ago and released by the barrier
            // ending it.
            if (cursor.valid()) load(cursor.chunk(), stage ^ 1);
            step(cur, stage);
            stage ^= 1;
        }
    } else if constexpr (Keep::HOLD_NEXT) {
        Chunk next = next_kept(cursor, keep);
        if (next.rows > 0) load(next, 0);
        cp_async_commit();
        while (next.rows > 0) {
            const Chunk cur = next;
            next = next_kept(cursor, keep);
            if (next.rows > 0) load(next, stage ^ 1);
            step(cur, stage);
            stage ^= 1;
        }
    } else {
        // The cursor waits on the next chunk `keep` takes, its marks beside it: the chunk is
        // read again from the cursor rather than held across `compute`.
        Chunk marks = settle_kept(cursor, keep);
        if (cursor.valid()) load(marks, 0);
        cp_async_commit();
        while (cursor.valid()) {
            const Chunk cur = with_marks(cursor.chunk(), marks);
            cursor.advance();
            marks = settle_kept(cursor, keep);
            if (cursor.valid()) load(with_marks(cursor.chunk(), marks), stage ^ 1);
            step(cur, stage);
            stage ^= 1;
        }
    }
    // Without any chunk the own tile's copies may still be in flight: drain them.
    cp_async_wait<0>();
    __syncthreads();
}

// The forward's main loop: like for_each_chunk, but K and V of a chunk travel in separate
// cp.async groups, STAGES - 1 chunks ahead, and the scores (Q K^T, softmax) start once K has
// landed while V is still in flight. Per chunk:
//     wait K (and V on a partial chunk), barrier, prefetch into the stage freed one chunk ago,
//     scores(chunk, stage), wait V, barrier (skipped on a partial chunk), values(chunk, stage).
// The first barrier both publishes K and releases the stage read one iteration ago: every warp
// has finished that chunk's values before it arrives. `own` runs on partial chunks only, once
// this thread's K and V copies of the chunk have landed (zero_nonfinite).
template <int STAGES, int CHUNK>
struct KvPipeline {
    static_assert(STAGES >= 2, "at least one chunk in flight while one is computed");
    // Groups committed by start(): a K and a V group per prefetched chunk.
    static constexpr int PROLOGUE_GROUPS = 2 * (STAGES - 1);

    Chunk ahead[STAGES - 1];    // issued, not yet computed; rows == 0: none
    int stage;                  // the stage of ahead[0]

    // Issues the first STAGES - 1 chunks of `cursor`. Copies issued before (the block's own
    // tile) must be committed in a group of their own. Chunks `keep` rejects are skipped
    // (next_kept), here and in run(), which must get the same `keep`.
    template <typename Kv, typename Keep = KeepAll>
    __device__ __forceinline__ void start(PartnerCursor<CHUNK>& cursor, const Kv& kv,
                                          Keep&& keep = Keep{}) {
        #pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) ahead[s] = fetch(cursor, kv, s, keep);
        stage = 0;
    }

    // Runs scores(chunk, stage) then values(chunk, stage) on every chunk; on return every copy
    // has landed and every thread is past its last read of the stages.
    template <typename Kv, typename Own, typename Scores, typename Values,
              typename Keep = KeepAll>
    __device__ __forceinline__ void run(PartnerCursor<CHUNK>& cursor, const Kv& kv, Own&& own,
                                        Scores&& scores, Values&& values, Keep&& keep = Keep{}) {
        while (ahead[0].rows > 0) {
            const Chunk cur = ahead[0];
            #pragma unroll
            for (int s = 0; s + 1 < STAGES - 1; ++s) ahead[s] = ahead[s + 1];
            if (cur.full) {
                cp_async_wait<2 * STAGES - 3>();     // all but V and the chunks ahead: K
            } else {
                cp_async_wait<2 * STAGES - 4>();     // K and V
                own(cur, stage);
            }
            __syncthreads();
            ahead[STAGES - 2] = fetch(cursor, kv, stage == 0 ? STAGES - 1 : stage - 1, keep);
            scores(cur, stage);
            if (cur.full) {
                cp_async_wait<2 * STAGES - 2>();     // all but the chunks ahead: V
                __syncthreads();
            }
            values(cur, stage);
            stage = stage + 1 == STAGES ? 0 : stage + 1;
        }
        // Without any chunk the block's own copies may still be in flight: drain them.
        cp_async_wait<0>();
        __syncthreads();
    }

  private:
    // The next chunk of `cursor` that `keep` takes (next_kept) into `into`: a K group and a V
    // group, both committed (empty past the last chunk, so that every thread counts groups
    // alike).
    template <typename Kv, typename Keep>
    __device__ __forceinline__ static Chunk fetch(PartnerCursor<CHUNK>& cursor, const Kv& kv,
                                                  int into, Keep&& keep) {
        Chunk c{0, 0, 0, 0, false};
        if constexpr (KeepsAll<Keep>::value) {
            // the code before `keep`, for the same allocation (next_kept spilled 4 B at D = 128
            // with a softcap and dropout on sm_90)
            if (cursor.valid()) {
                c = cursor.chunk();
                cursor.advance();
                kv.load_k(c, into);
            }
        } else {
            c = next_kept(cursor, keep);
            if (c.rows > 0) kv.load_k(c, into);
        }
        cp_async_commit();
        if (c.rows > 0) kv.load_v(c, into);
        cp_async_commit();
        return c;
    }
};

// A block over one tile of the plan and one head: grid (num_q_tiles, Hq) over query tiles
// (forward), or (num_k_tiles, Hk) over key tiles (dK/dV), which visit the G = Hq / Hk query
// heads of their key head. Each warp owns WARP_M rows of the tile. Query tiles run in reverse
// slot order: a sequence's later query tiles see more keys under a causal mask, so its heaviest
// tiles start first (and the unused slots, at the end of the table, exit first); key tiles
// keep slot order, where under a causal mask the first ones see the most queries.
template <bool KEY_TILES, int WARP_M = WARP_ROWS>
struct TileBlock {
    int i_tile;
    int i_head;        // a query head over query tiles, a key head over key tiles
    int group;         // G = Hq / Hk
    int i_khead;       // the key head: the one query head i_head reads, or i_head itself
    TileInfo tile;     // seq < 0: an unused slot, nothing to do
    WarpSlot w;

    __device__ __forceinline__ TileBlock(const PlanView& plan, const CallParams& call)
        : i_tile(KEY_TILES ? blockIdx.x : gridDim.x - 1 - blockIdx.x), i_head(blockIdx.y),
          group(call.Hq / call.Hk),
          i_khead(KEY_TILES ? i_head : i_head / group),
          tile(load_tile(KEY_TILES ? plan.k_tiles : plan.q_tiles, i_tile)), w(warp_slot<WARP_M>()) {}

    // Issues the copies of head i_head's rows of the tile, from a [T, H, COLS] array whose rows
    // and heads lie `strides` apart, into s_dst [ROWS][D + 8] (COLS <= D).
    template <int ROWS, int D, int NUM_THREADS, int COLS = D, typename T>
    __device__ __forceinline__ void load_rows(T* s_dst, const T* base,
                                              const Strides& strides) const {
        load_tile_async<ROWS, D, NUM_THREADS, COLS>(s_dst, head_rows(base, strides, i_head),
                                                    tile.row, tile.rows);
    }
};

// The K and V chunks of one key head, through shared stages [NUM_STAGES][BN][D + 8] each; V
// rows hold DV <= D columns (head_dim_v), in stages of K's row width.
template <typename T, int D, int BN, int NUM_THREADS, int NUM_STAGES = STAGES, int DV = D>
struct KvStages {
    static constexpr int STAGE_ELEMS = BN * smem_stride<D>();
    T* s_k;
    T* s_v;
    HeadRows<const T> k;
    HeadRows<const T> v;

    // Stages from s_base on; k and v are [Tk, Hk, D] arrays, their rows and heads `k_strides`
    // and `v_strides` apart.
    __device__ __forceinline__ KvStages(T* s_base, const T* k_base, const Strides& k_strides,
                                        const T* v_base, const Strides& v_strides, int i_khead)
        : s_k(s_base), s_v(s_base + NUM_STAGES * STAGE_ELEMS),
          k(head_rows(k_base, k_strides, i_khead)), v(head_rows(v_base, v_strides, i_khead)) {}

    __device__ __forceinline__ void load_k(const Chunk& c, int stage) const {
        load_tile_async<BN, D, NUM_THREADS>(s_k + stage * STAGE_ELEMS, k, c.row, c.rows);
    }

    __device__ __forceinline__ void load_v(const Chunk& c, int stage) const {
        load_tile_async<BN, D, NUM_THREADS, DV>(s_v + stage * STAGE_ELEMS, v, c.row, c.rows);
    }

    __device__ __forceinline__ void load(const Chunk& c, int stage) const {
        load_k(c, stage);
        load_v(c, stage);
    }

    // On a partially masked chunk, where hidden pairs have P = 0: a NaN or inf in this thread's
    // chunks of V (the right-hand factor of P V) is zeroed and handed on as a NaN in K, which
    // meets the key row only in Q K^T, one pair at a time: exactly the rows that see the key are
    // flagged, the others select it away. Call it in for_each_chunk's `own` step, every thread
    // alike. With DV < D a thread's V chunks are not its K chunks: a barrier first, so that
    // every K copy of the chunk has landed before a NaN is written into it.
    __device__ __forceinline__ void zero_nonfinite(const Chunk& c, int stage) const {
        if constexpr (DV != D) __syncthreads();
        T* s_to = s_k + stage * STAGE_ELEMS;
        zero_nonfinite_chunks<BN, D, NUM_THREADS, DV>(s_v + stage * STAGE_ELEMS, c.rows,
                                                  [&](int r, int col) {
            s_to[r * smem_stride<D>() + col] = ElemTraits<T>::from_float(nan_f());
        });
    }

    __device__ __forceinline__ const T* k_at(int stage) const { return s_k + stage * STAGE_ELEMS; }
    __device__ __forceinline__ const T* v_at(int stage) const { return s_v + stage * STAGE_ELEMS; }
};

}  // namespace varlen
