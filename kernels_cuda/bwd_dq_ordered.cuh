// Deterministic dQ from the dK/dV kernel: the fp32 additions of every key tile to one query
// chunk's dQ happen in a fixed order, that of the key tiles' slots (FlashAttention-3's
// deterministic backward, with ranks taken from the plan's schedule; docs/cupy_backend.md,
// "Deterministic backward").
//
// dq_order, int32 [Hq + 1, Tq], written by varlen_bwd_preprocess:
//   * rows 0 .. Hq - 1: one counter per (query head, first row of a query chunk), zeroed; it
//     counts the key tiles that have added their part to that chunk of dQ;
//   * row Hq: the query tile slot of every row a query tile covers (the slot's q_sched row
//     lists the key tiles that meet it).
// The dK/dV block of key tile (b, key segment r, tile j) of slot s ranks, among the key tiles
// that meet query tile t, as
//     rank = sum over key segments r' < r of (end - begin) of q_sched[t][r'] + j - begin of r,
// the number of those key tiles in earlier slots: the plan numbers a sequence's key tiles in
// (segment, tile) order (docs/plan.md, "Tile tables"), and k_sched, which drives the block, is
// the exact transpose of q_sched. Before adding its part of chunk c of query head h, the block
// waits until counter (h, c) equals its rank, then adds (fp32 atomics, now in a fixed order),
// fences and adds 1 to the counter (rank + 1). All the tiles that meet a query tile share one grid
// row (their key head), so every wait is for blocks of a smaller linear index, which a GPU
// dispatches first: no wait can hang (the first block of a row never waits, and by induction
// each later one is only waiting on blocks that are running or done).
#pragma once

#include "common.cuh"
#include "tile_scheduler.cuh"

namespace varlen {

#ifndef VARLEN_HOST_EMULATION
// The host emulation has its own (host_emulation.cuh): there a wait must be satisfied at the
// first poll, since blocks run one after the other.
__device__ __forceinline__ int load_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Waits until *counter == value (acquire). `what` and `index` name the counter, the call site
// (file, line, function) the wait, in the messages of the emulation and of a build with
// VARLEN_POLL_LIMIT (common.cuh), which traps after that many polls.
__device__ __forceinline__ void spin_wait_equal(const int* counter, int value, const char* what,
                                                int64_t index, const char* file, int line,
                                                const char* function) {
    if constexpr (VARLEN_POLL_LIMIT > 0) {
        int seen;
        for (int polls = 1; (seen = load_acquire_gpu(counter)) != value; ++polls) {
            if (polls == VARLEN_POLL_LIMIT) {
                poll_limit_reached(file, line, function, "counter", what, index, value, true,
                                   seen);
            }
        }
    } else {
        while (load_acquire_gpu(counter) != value) {
        }
    }
}

// Adds 1 to a counter with release semantics (at the device's coherence point, so no stale
// cached copy of it is ever read). `fenced_by`: the threads whose fenced additions it
// publishes (the emulation checks that each has fenced).
__device__ __forceinline__ void release_increment_gpu(int* p, int /*fenced_by*/) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" :: "l"(p) : "memory");
}

__device__ __forceinline__ void store_release_gpu(int* p, int value, int /*fenced_by*/) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" :: "l"(p), "r"(value) : "memory");
}

// Adds 1 to a counter with release semantics for a block that added nothing there
// (OrderedDq::pass): no fence to check.
__device__ __forceinline__ void pass_increment_gpu(int* p) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" :: "l"(p) : "memory");
}
#endif

// dQ with unordered atomics: nothing to wait for.
struct UnorderedDq {
    __device__ __forceinline__ int acquire(const Chunk&) const { return 0; }
    template <bool CARRY_RANK>
    __device__ __forceinline__ void release(const Chunk&, int) const {}
};

// The turn of one dK/dV block (a key tile of one key head) at the dQ of each query chunk. It
// holds references only: the plan and the call are kernel parameters, the tile is the
// block's; ranks are computed by the leader (thread 0 of the block, or of the threads that
// add: the sm_90a kernel's consumer warpgroups) when it waits.
struct OrderedDq {
    int* dq_order;            // [Hq + 1, Tq]
    const PlanView& plan;
    const CallParams& call;
    const TileInfo& key_tile;
    int head0;                // the first query head of the block's key head

    __device__ __forceinline__ int64_t counter(const Chunk& c) const {
        return static_cast<int64_t>(head0 + c.head) * plan.rows_q + c.row;
    }

    // The block's rank among the key tiles that meet the query tile holding chunk c.
    __device__ __forceinline__ int rank(const Chunk& c) const {
        const int64_t slot = dq_order[static_cast<int64_t>(call.Hq) * plan.rows_q + c.row];
        const int* s = plan.q_sched + slot * plan.mk * SCHED_FIELDS;
        const int seg = key_tile.seg;
        const int tile = (key_tile.pos -
                          plan.k_pos[static_cast<int64_t>(key_tile.seq) * plan.mk + seg]) /
                         plan.block_n;
        int before = 0;
        #pragma unroll 1
        for (int r = 0; r < seg; ++r) before += s[r * SCHED_FIELDS + 3] - s[r * SCHED_FIELDS];
        return before + tile - s[seg * SCHED_FIELDS];
    }

    // The leader waits for the block's turn at chunk c and returns its rank; every thread
    // that adds must pass a barrier after it before adding (in the mma.sync kernel, the one
    // that publishes dS^T).
    // The call site names the wait in a message (spin_wait_equal).
    __device__ __forceinline__ int acquire(const Chunk& c, bool leader = threadIdx.x == 0,
                                           const char* file = __builtin_FILE(),
                                           int line = __builtin_LINE(),
                                           const char* function = __builtin_FUNCTION()) const {
        int turn = 0;
        if (leader) {
            turn = rank(c);
            spin_wait_equal(dq_order + counter(c), turn, "dq_order", counter(c), file, line,
                            function);
        }
        return turn;
    }

    // After the block's additions to chunk c by `adders` threads: each thread's are performed
    // (fence) before `barrier()`, which all of them pass, then the leader hands the turn on: it
    // stores rank + 1 (CARRY_RANK: `turn` kept in a register across the additions) or adds 1
    // to the counter, which holds the rank. The two differ only in ptxas' register allocation:
    // carrying the rank spills 12 B in the D = 256 softcap kernel on sm_90, the increment 8 B
    // in the D = 128 softcap kernel on sm_80.
    template <bool CARRY_RANK, typename Barrier>
    __device__ __forceinline__ void release(const Chunk& c, int turn, bool leader, int adders,
                                            Barrier&& barrier) const {
        __threadfence();
        barrier();
        if (leader) {
            if constexpr (CARRY_RANK) {
                store_release_gpu(dq_order + counter(c), turn + 1, adders);
            } else {
                release_increment_gpu(dq_order + counter(c), adders);
            }
        }
    }

    // The whole block adds; thread 0 leads.
    template <bool CARRY_RANK>
    __device__ __forceinline__ void release(const Chunk& c, int turn) const {
        release<CARRY_RANK>(c, turn, threadIdx.x == 0, static_cast<int>(blockDim.x), [] {
            __syncthreads();
        });
    }

    // The block's turn at chunk c, where it adds nothing (the mask_mod's class of the chunk is
    // empty: dK/dV skip it), taken and handed on by the leader alone: no fence, no barrier
    // (the additions its release orders are the earlier blocks', which its acquire saw). The
    // same chunks on every run, so the order of the additions does not change; the key tiles
    // ranked after it need not know.
    __device__ __forceinline__ void pass(const Chunk& c, bool leader = threadIdx.x == 0) const {
        if (leader) {
            acquire(c, true);
            pass_increment_gpu(dq_order + counter(c));
        }
    }
};

}  // namespace varlen
