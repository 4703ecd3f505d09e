// Forward kernel for sm_90a: FlashAttention-2's online softmax (Alg. 1) over the plan's query
// tiles, with the operands moved by TMA and multiplied by wgmma, warp-specialised as in
// FlashAttention-3 (stage 1: no ping-pong between consumer warpgroups, no overlap of softmax and
// the next Q K^T inside a warpgroup). docs/hopper.md, "The sm_90a forward", has the design.
//
// Grid (num_q_tiles, Hq), as varlen_fwd. Block: warpgroup 0 is the producer, warpgroups 1 .. NC
// the consumers, each owning 64 query rows of the tile (BM = 64 NC). Shared memory, 1024-byte
// aligned, every tile in boxes of 64 columns (128 bytes, 128B swizzle) written by TMA:
//   Q [D / 64][BM][64], K and V [STAGES][D / 64][BN][64] each, the output stage [BM][D + 8],
//   then the mbarriers.
// The producer's thread 0 loads Q once and K, V of each key chunk into a ring of STAGES stages
// (full barriers: k_full, v_full with transaction bytes; empty: every consumer thread arrives
// once its P V has retired). TMA reads whole boxes of the packed arrays, so the rows of a chunk
// past its sequence's last key are another sequence's rows or padding: the scores of those keys
// are masked by the selects of mask_scores (the chunk is partial), and their V rows, which meet
// P = 0 in P V, are zeroed by the producer warpgroup before the chunk is handed on (`ready`),
// with a NaN or inf in a present V row zeroed and handed to its K row, as KvStages::
// zero_nonfinite does for the mma.sync kernel.
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

template <int D_, int BM_, int BN_>
struct FwdSm90Config {
    static constexpr int D = D_;
    static constexpr int BM = BM_;
    static constexpr int BN = BN_;
    static constexpr int WG_THREADS = 128;               // a warpgroup: 4 warps
    static constexpr int WG_ROWS = 64;                   // the M of wgmma
    static constexpr int NUM_CONSUMERS = BM / WG_ROWS;
    static constexpr int NUM_THREADS = WG_THREADS * (1 + NUM_CONSUMERS);
    static constexpr int STAGES = 2;
    static constexpr int BOX_COLS = 64;                  // 128 bytes of 16-bit elements
    static constexpr int BOX_ROW_BYTES = 128;            // = the swizzle width
    static constexpr int D_BOXES = D / BOX_COLS;
    static constexpr int ATOM_BYTES = 8 * BOX_ROW_BYTES; // 8 rows: the 128B swizzle's repeat
    static constexpr int Q_BYTES = BM * D * 2;
    static constexpr int KV_BYTES = BN * D * 2;          // one K (or V) stage
    static constexpr int OUT_STRIDE = smem_stride<D>();
    static constexpr int OUT_BYTES = BM * OUT_STRIDE * 2;
    static constexpr int OFF_K = Q_BYTES;
    static constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;
    static constexpr int OFF_OUT = OFF_V + STAGES * KV_BYTES;
    static constexpr int OFF_BARS = (OFF_OUT + OUT_BYTES + 7) / 8 * 8;
    // q_full, then k_full, v_full, ready, empty per stage
    static constexpr int NUM_BARS = 1 + 4 * STAGES;
    // + ALIGN: the block rounds its base up to the swizzle's repeat (tiles start on it, the
    // descriptors' base offset is 0), whatever alignment the dynamic window has
    static constexpr int ALIGN = 1024;
    static constexpr int SMEM_BYTES = OFF_BARS + 8 * NUM_BARS + ALIGN;
    // Registers per thread after setmaxnreg: the producer gives its share to the consumers
    // (FlashAttention-3's split); 128 (PRODUCER + NC CONSUMER) must fit the SM's 64 K.
    static constexpr int PRODUCER_REGS = 40;
    static constexpr int CONSUMER_REGS = NUM_CONSUMERS == 1 ? 240 : 232;

    static_assert(BM == 64 || BM == 128, "one or two consumer warpgroups of 64 query rows");
    static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma N of Q K^T: 64, 128 or 256 keys");
    static_assert(D == 64 || D == 128 || D == 256, "head dim in boxes of 64, wgmma N of P V");
    static_assert(WG_THREADS * (PRODUCER_REGS + NUM_CONSUMERS * CONSUMER_REGS) <= 65536,
                  "the register split must fit an SM");
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
        return reinterpret_cast<T*>(base + Cfg::OFF_V + s * Cfg::KV_BYTES);
    }
    __device__ __forceinline__ T* out() const { return reinterpret_cast<T*>(base + Cfg::OFF_OUT); }
    __device__ __forceinline__ sm90::u64* bar(int i) const {
        return reinterpret_cast<sm90::u64*>(base + Cfg::OFF_BARS) + i;
    }
    __device__ __forceinline__ sm90::u64* q_full() const { return bar(0); }
    __device__ __forceinline__ sm90::u64* k_full(int s) const { return bar(1 + s); }
    __device__ __forceinline__ sm90::u64* v_full(int s) const { return bar(1 + Cfg::STAGES + s); }
    __device__ __forceinline__ sm90::u64* ready(int s) const {
        return bar(1 + 2 * Cfg::STAGES + s);
    }
    __device__ __forceinline__ sm90::u64* empty(int s) const {
        return bar(1 + 3 * Cfg::STAGES + s);
    }
};

// Which pass over a stage a chunk is: chunk i uses stage i % STAGES in its (i / STAGES)-th
// round, whose phases have parity (i / STAGES) & 1.
template <int STAGES>
__device__ __forceinline__ uint32_t round_parity(int i) {
    return static_cast<uint32_t>(i / STAGES) & 1u;
}

// Rows r >= rows of a V stage zeroed (another sequence's rows or padding, which P V meets with
// P = 0), and a present V row with a NaN or inf zeroed and its K row made NaN, so that exactly
// the queries that see the key get a NaN score. One thread per row; a swizzled box keeps each
// 128-byte row in place (only its 16-byte chunks move), so whole rows are addressed as they
// are in a dense tile.
template <typename T, typename Cfg>
__device__ __forceinline__ void sanitize_partial_chunk(T* s_k, T* s_v, int rows, int t) {
    constexpr int VECS = Cfg::BOX_ROW_BYTES / 16;
    for (int r = t; r < Cfg::BN; r += Cfg::WG_THREADS) {
        bool bad = false;
        if (r < rows) {
            #pragma unroll
            for (int b = 0; b < Cfg::D_BOXES; ++b) {
                const uint4* p = reinterpret_cast<const uint4*>(
                    reinterpret_cast<const unsigned char*>(s_v) + b * Cfg::BN * Cfg::BOX_ROW_BYTES +
                    r * Cfg::BOX_ROW_BYTES);
                #pragma unroll
                for (int i = 0; i < VECS; ++i) bad |= any_nonfinite<T>(p[i]);
            }
        }
        if (r < rows && !bad) continue;
        #pragma unroll
        for (int b = 0; b < Cfg::D_BOXES; ++b) {
            uint4* p = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(s_v) +
                                                b * Cfg::BN * Cfg::BOX_ROW_BYTES +
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
// (the 128B swizzle's width), completing on `bar`.
template <typename Cfg, int ROWS>
__device__ __forceinline__ void load_rows(void* dst, const sm90::TensorMap* map, sm90::u64* bar,
                                          int head, int row) {
    #pragma unroll
    for (int b = 0; b < Cfg::D_BOXES; ++b) {
        sm90::tma_load_3d(static_cast<unsigned char*>(dst) + b * ROWS * Cfg::BOX_ROW_BYTES, map,
                          bar, b * Cfg::BOX_COLS, head, row);
    }
}

// The producer warpgroup: thread 0 issues the TMA loads of Q and of every key chunk of the
// tile's schedule; on a partial chunk all 128 threads sanitise the landed stage before it is
// released to the consumers, on a full one they release it at once.
template <typename T, typename Cfg>
__device__ __forceinline__ void fwd_sm90_producer(const sm90::TensorMap* map_q,
                                                  const sm90::TensorMap* map_k,
                                                  const sm90::TensorMap* map_v,
                                                  const Sm90Smem<T, Cfg>& sm, const PlanView& plan,
                                                  const TileInfo& tile, int i_tile, int i_head,
                                                  int i_khead) {
    constexpr int STAGES = Cfg::STAGES;
    const int t = threadIdx.x;
    if (t == 0) {
        sm90::mbar_arrive_expect_tx(sm.q_full(), Cfg::Q_BYTES);
        load_rows<Cfg, Cfg::BM>(sm.q(), map_q, sm.q_full(), i_head, tile.row);
    }
    PartnerCursor<Cfg::BN> keys = key_cursor<Cfg::BN>(plan, tile, i_tile);
    for (int i = 0; keys.valid(); ++i, keys.advance()) {
        const Chunk c = keys.chunk();
        const int s = i % STAGES;
        const uint32_t parity = round_parity<STAGES>(i);
        // The consumers released this stage's previous round (the first round passes at once);
        // every producer thread waits, so that none arrives on `ready` a round early.
        sm90::mbar_wait(sm.empty(s), parity ^ 1u);
        if (t == 0) {
            sm90::mbar_arrive_expect_tx(sm.k_full(s), Cfg::KV_BYTES);
            load_rows<Cfg, Cfg::BN>(sm.k(s), map_k, sm.k_full(s), i_khead + c.head, c.row);
            sm90::mbar_arrive_expect_tx(sm.v_full(s), Cfg::KV_BYTES);
            load_rows<Cfg, Cfg::BN>(sm.v(s), map_v, sm.v_full(s), i_khead + c.head, c.row);
        }
        if (!c.full) {
            sm90::mbar_wait(sm.k_full(s), parity);
            sm90::mbar_wait(sm.v_full(s), parity);
            sanitize_partial_chunk<T, Cfg>(sm.k(s), sm.v(s), c.rows, t);
            // generic-proxy stores that the consumers' wgmma (async proxy) reads next
            sm90::fence_proxy_async();
        }
        sm90::mbar_arrive(sm.ready(s));
    }
}

// One consumer warpgroup (rows 64 c .. 64 c + 63 of the tile): per key chunk S = Q K^T by
// wgmma_ss, mask and online softmax on the fragments, O += P V by wgmma_rs; then O / l and lse
// through store_output. `w` is the warp's slot among the consumer warps (row0 = 16 warp).
template <typename T, typename Cfg, bool HAS_SOFTCAP>
__device__ __forceinline__ void fwd_sm90_consumer(const Sm90Smem<T, Cfg>& sm, T* out, float* lse,
                                                  const PlanView& plan, const CallParams& call,
                                                  const TileInfo& tile, int i_tile, int i_head,
                                                  int c_wg, const WarpSlot& w) {
    constexpr int STAGES = Cfg::STAGES, BN = Cfg::BN, D = Cfg::D;
    constexpr uint32_t BOX_Q = Cfg::BM * Cfg::BOX_ROW_BYTES;   // bytes per box of 64 columns
    constexpr uint32_t BOX_KV = BN * Cfg::BOX_ROW_BYTES;
    const SeqPolicy pol = SeqPolicy::load(plan, tile.seq);
    // K-major A (Q, this warpgroup's 64 rows) and B (K): 8-row atoms SBO apart, k16 steps of 32
    // bytes inside a box, the next 64 columns one box further.
    const sm90::u64 desc_q = sm90::smem_desc(reinterpret_cast<unsigned char*>(sm.q()) +
                                                 c_wg * Cfg::WG_ROWS * Cfg::BOX_ROW_BYTES,
                                             0, Cfg::ATOM_BYTES, sm90::Swizzle::B128);

    // [16, D] output rows and [16, BN] scores, then probabilities, of this warp, as the
    // warpgroup's wgmma D fragments
    float acc_o[D / 8][4];
    float acc_s[BN / 8][4];
    OnlineSoftmax softmax[1];
    zero_acc(acc_o);
    softmax[0].init();
    auto& o_frag = reinterpret_cast<float (&)[D / 2]>(acc_o);
    auto& s_frag = reinterpret_cast<float (&)[BN / 2]>(acc_s);

    sm90::mbar_wait(sm.q_full(), 0);
    PartnerCursor<BN> keys = key_cursor<BN>(plan, tile, i_tile);
    for (int i = 0; keys.valid(); ++i, keys.advance()) {
        const Chunk c = keys.chunk();
        const int s = i % STAGES;
        const uint32_t parity = round_parity<STAGES>(i);
        sm90::mbar_wait(sm.ready(s), parity);
        sm90::mbar_wait(sm.k_full(s), parity);
        const sm90::u64 desc_k = sm90::smem_desc(sm.k(s), 0, Cfg::ATOM_BYTES, sm90::Swizzle::B128);
        sm90::wgmma_fence_operand(s_frag);
        sm90::wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint32_t step = (kk % 4) * 32;      // k16 steps inside a box of 64 columns
            const sm90::u64 a = sm90::desc_advance(desc_q, (kk / 4) * BOX_Q + step);
            const sm90::u64 b = sm90::desc_advance(desc_k, (kk / 4) * BOX_KV + step);
            sm90::wgmma_ss<T, BN, false, false>(s_frag, a, b, kk > 0);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::wgmma_fence_operand(s_frag);

        mask_scores<HAS_SOFTCAP>(acc_s, query_rows_mask(pol, tile.pos, w, c), call, w.lane);
        softmax[0].update(acc_s, acc_o);

        // O += P V: P (registers) as A, V N-major as B: 8-key atoms SBO apart, k16 steps of 16
        // rows, the next 64 columns of the head dim one box (LBO) further.
        sm90::mbar_wait(sm.v_full(s), parity);
        const sm90::u64 desc_v = sm90::smem_desc(sm.v(s), BOX_KV, Cfg::ATOM_BYTES,
                                                 sm90::Swizzle::B128);
        // [16, BN] P of this warp as BN / 16 A fragments, all written before the wgmma.fence
        // (the ISA orders register writes before an async read of them only through it)
        uint32_t p_frag[BN / 16][4];
        #pragma unroll
        for (int j = 0; j < BN / 16; ++j) c_to_a<T>(p_frag[j], acc_s, j);
        sm90::wgmma_fence_operand(o_frag);
        sm90::wgmma_fence();
        #pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
            sm90::wgmma_rs<T, D, true>(o_frag, p_frag[j],
                                       sm90::desc_advance(desc_v, j * 16 * Cfg::BOX_ROW_BYTES),
                                       true);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::wgmma_fence_operand(o_frag);
        sm90::mbar_arrive(sm.empty(s));
    }
    store_output<T, D, Cfg::OUT_STRIDE>(reinterpret_cast<const float (&)[1][D / 8][4]>(acc_o),
                                        softmax, sm.out(), head_rows<D>(out, call.Hq, i_head),
                                        lse + static_cast<int64_t>(i_head) * plan.rows_q, tile, w);
}

}  // namespace varlen

using namespace varlen;

// Tensor maps (made by the launcher, varlen/backends/_cupy_sm90.py): 3D over the packed arrays,
// dims (D, H, T) innermost first, box (64, 1, BM) for Q and (64, 1, BN) for K and V, 128B
// swizzle, zero fill past row T.
template <typename T, int D, int BM, int BN, bool HAS_SOFTCAP>
__global__ void __launch_bounds__(FwdSm90Config<D, BM, BN>::NUM_THREADS, 1)
varlen_fwd_sm90(const __grid_constant__ sm90::TensorMap map_q,   // q [Tq, Hq, D]
                const __grid_constant__ sm90::TensorMap map_k,   // k [Tk, Hk, D]
                const __grid_constant__ sm90::TensorMap map_v,   // v [Tk, Hk, D]
                T* __restrict__ out,                             // [Tq, Hq, D]
                float* __restrict__ lse,                         // [Hq, Tq]
                const PlanView plan, const CallParams call) {
    using Cfg = FwdSm90Config<D, BM, BN>;
    const int i_tile = blockIdx.x, i_head = blockIdx.y;
    const TileInfo tile = load_tile(plan.q_tiles, i_tile);
    if (tile.seq < 0) return;
    const int i_khead = i_head / (call.Hq / call.Hk);

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t misalign = sm90::smem_addr(smem_raw) % Cfg::ALIGN;
    const Sm90Smem<T, Cfg> sm{smem_raw + (misalign ? Cfg::ALIGN - misalign : 0)};
    if (threadIdx.x == 0) {
        sm90::mbar_init(sm.q_full(), 1);
        #pragma unroll
        for (int s = 0; s < Cfg::STAGES; ++s) {
            sm90::mbar_init(sm.k_full(s), 1);
            sm90::mbar_init(sm.v_full(s), 1);
            sm90::mbar_init(sm.ready(s), Cfg::WG_THREADS);
            sm90::mbar_init(sm.empty(s), Cfg::NUM_CONSUMERS * Cfg::WG_THREADS);
        }
        sm90::fence_barrier_init();
    }
    __syncthreads();

    if (threadIdx.x < Cfg::WG_THREADS) {
        sm90::setmaxnreg<Cfg::PRODUCER_REGS, false>();
        fwd_sm90_producer<T, Cfg>(&map_q, &map_k, &map_v, sm, plan, tile, i_tile, i_head,
                                  i_khead);
    } else {
        sm90::setmaxnreg<Cfg::CONSUMER_REGS, true>();
        const int t = threadIdx.x - Cfg::WG_THREADS;
        const WarpSlot w{t % WARP_SIZE, t / WARP_SIZE, (t / WARP_SIZE) * WARP_ROWS};
        fwd_sm90_consumer<T, Cfg, HAS_SOFTCAP>(sm, out, lse, plan, call, tile, i_tile, i_head,
                                               t / Cfg::WG_THREADS, w);
    }
}
