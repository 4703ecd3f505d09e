// Kernels that exercise the primitives of kernels_cuda/sm90.cuh one at a time. One source for
// two builds: NVRTC for sm_90a (run on a Hopper GPU through CuPy) and g++ through the host
// emulation (the table at the end launches them by name). emulation/sm90_primitives.py
// launches them the same way on both (its runners) and holds the expectations, written from
// the PTX ISA; here only data moves. Every kernel takes the block's shared memory from its
// 1024-byte aligned base (`aligned_smem`: launches add SMEM_ALIGN bytes of slack), and the
// wgmma descriptors are made on the device from that base's shared address.
#include "sm90.cuh"

using varlen::sm90::u64;
namespace sm90 = varlen::sm90;

constexpr int WG_THREADS = 128;
// The 128B swizzle's repeat: the pattern is a function of the shared address, so tiles start
// on it (on a GPU the dynamic shared window need not)
constexpr unsigned SMEM_ALIGN = 1024;

__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
    const uint32_t misalign = sm90::smem_addr(raw) % SMEM_ALIGN;
    return raw + (misalign ? SMEM_ALIGN - misalign : 0);
}

// Box of `map` at (c0, c1, c2) into shared memory at the base (barrier at bar_off), out = its
// bytes.
extern "C" __global__ void sm90_tma_box(const __grid_constant__ sm90::TensorMap map, int rank,
                                        int c0, int c1, int c2, unsigned box_bytes,
                                        unsigned bar_off, unsigned char* out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    u64* bar = reinterpret_cast<u64*>(smem + bar_off);
    if (threadIdx.x == 0) {
        sm90::mbar_init(bar, 1);
        sm90::fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        sm90::mbar_arrive_expect_tx(bar, box_bytes);
        if (rank == 2) sm90::tma_load_2d(smem, &map, bar, c0, c1);
        else sm90::tma_load_3d(smem, &map, bar, c0, c1, c2);
    }
    sm90::mbar_wait(bar, 0);
    for (unsigned i = threadIdx.x; i < box_bytes; i += WG_THREADS) out[i] = smem[i];
}

// Phases and transaction counts of one barrier of count 32 (warp 1 arrives), observed by
// thread 0 between block barriers: out[0..5] = try_wait results, out[6] = the waits passed;
// then out_bytes = the 64 bytes bulk-copied from src. 64 threads.
extern "C" __global__ void sm90_mbar_phases(const unsigned char* src, int* out,
                                            unsigned char* out_bytes) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    u64* bar = reinterpret_cast<u64*>(smem + 128);
    const int tid = threadIdx.x;
    if (tid == 0) {
        sm90::mbar_init(bar, 32);
        sm90::fence_barrier_init();
    }
    __syncthreads();
    if (tid == 0) out[0] = sm90::mbar_try_wait(bar, 0);          // no arrival yet
    __syncthreads();
    if (tid >= 32) sm90::mbar_arrive(bar);                        // phase 0 completes
    __syncthreads();
    if (tid == 0) {
        out[1] = sm90::mbar_try_wait(bar, 0);                     // phase 0 done
        out[2] = sm90::mbar_try_wait(bar, 1);                     // phase 1 not yet
    }
    __syncthreads();
    if (tid == 32) sm90::mbar_arrive_expect_tx(bar, 64);
    else if (tid > 32) sm90::mbar_arrive(bar);                    // all arrived, 64 bytes due
    __syncthreads();
    if (tid == 0) out[3] = sm90::mbar_try_wait(bar, 1);          // still waiting for bytes
    __syncthreads();
    if (tid == 32) sm90::bulk_load(smem, src, 64, bar);
    sm90::mbar_wait(bar, 1);
    if (tid == 0) {
        out[4] = sm90::mbar_try_wait(bar, 1);
        out[5] = sm90::mbar_try_wait(bar, 0);                     // phase 2 (parity 0) open
        out[6] = 1;
    }
    if (tid < 64) out_bytes[tid] = smem[tid];
}

// Misuses of an mbarrier, each of which the emulation must report (never hang):
// 1: expect 128 bytes that no copy brings, then wait; 2: store over the barrier, then arrive;
// 3: a bulk copy completing on a barrier whose init was not fenced; 4: thread 1 arrives after
// seeing a plain flag thread 0 set after the init, with no barrier between.
extern "C" __global__ void sm90_mbar_misuse(int what, const unsigned char* src) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    u64* bar = reinterpret_cast<u64*>(smem);
    if (threadIdx.x == 0) {
        sm90::mbar_init(bar, 1);
        if (what != 3) sm90::fence_barrier_init();
    }
    if (what == 4) {
        volatile int* inited = reinterpret_cast<volatile int*>(smem + 32);
        if (threadIdx.x == 0) *inited = 1;
        while (*inited != 1) {
#ifdef VARLEN_HOST_EMULATION
            std::this_thread::yield();    // spinning OS threads would starve thread 0
#endif
        }
        if (threadIdx.x == 1) sm90::mbar_arrive(bar);
        return;
    }
    __syncthreads();
    if (what == 3 && threadIdx.x == 0) {
        sm90::mbar_arrive_expect_tx(bar, 16);
        sm90::bulk_load(smem + 16, src, 16, bar);
    }
    if (what == 1) {
        if (threadIdx.x == 0) sm90::mbar_arrive_expect_tx(bar, 128);
        sm90::mbar_wait(bar, 0);
    } else if (what == 2) {
        if (threadIdx.x == 0) {
            *bar = 0;
            sm90::mbar_arrive(bar);
        }
    }
}

// A ping-pong of two warpgroups over named barriers, `rounds` times: warpgroup 0 writes a value
// and arrives on barrier 1 (bar.arrive: no wait); warpgroup 1 waits there (bar.sync), derives
// a value and arrives on barrier 2, where warpgroup 0 waits before reading it into out[round].
// misuse 1: warpgroup 1 announces 128 threads on barrier 1 after warpgroup 0 announced 256;
// 2: warpgroup 1 never arrives on barrier 2 (a deadlock); 3: barrier id 0; 4: warpgroup 1
// never waits on barrier 1 (warpgroup 0 arrives there twice in one phase). 256 threads.
extern "C" __global__ void sm90_named_pingpong(int rounds, int* out, int misuse) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    volatile int* v = reinterpret_cast<volatile int*>(smem);
    const int wg = threadIdx.x / 128;
    if (misuse == 1) {
        if (wg == 0) sm90::named_bar_arrive(1, 256);
        __syncthreads();
        if (wg == 1) sm90::named_bar_sync(1, 128);
        return;
    }
    const uint32_t first = misuse == 3 ? 0u : 1u;
    int last = 0;
    for (int r = 0; r < rounds; ++r) {
        if (wg == 0) {
            if (threadIdx.x == 0) v[0] = r * 10 + last % 7;
            sm90::named_bar_arrive(first, 256);
            sm90::named_bar_sync(2, 256);
            last = v[1];
            if (threadIdx.x == 0) out[r] = last;
        } else {
            if (misuse != 4) sm90::named_bar_sync(first, 256);
            if (threadIdx.x == 128) v[1] = v[0] * 3 + 1;
            if (misuse != 2) sm90::named_bar_arrive(2, 256);
        }
    }
}

// Bits of `flags` of sm90_wgmma.
constexpr int WG_ACCUMULATE = 1;      // the first product adds to d = init instead of replacing
constexpr int WG_PEEK = 2;            // probe[t] = d[0] between commit and wait
constexpr int WG_NO_FENCE = 4;        // skip the wgmma.fence
constexpr int WG_CLOBBER = 8;         // zero the operands' shared memory between commit and wait
constexpr int WG_WARP3_SKIPS = 16;    // warp 3 skips the mma_async
constexpr int WG_SETMAXNREG = 32;     // setmaxnreg.dec to WG_REGS_DEC before the product,
                                      // .inc to WG_REGS_INC after it
constexpr int WG_GROUP_PER_STEP = 64; // commit each k-step; probe[t] = d[0] after wait_group 1
constexpr int WG_NO_PROXY_FENCE = 128; // no fence.proxy.async after the operands' stores
constexpr int WG_FLAG_HANDOFF = 256;   // thread 0 stores and fences the operands, then hands them
                                       // on through a plain flag after them, not a barrier
constexpr int WG_WRITE_AFTER_FENCE = 512;  // d[0] += 1 between the wgmma.fence and the first op
constexpr int WG_A_AFTER_FENCE = 1024;     // RS: each k-step's A fragment loaded after the
                                           // fence into the same registers
constexpr int WG_WARP3_EXITS = 2048;       // warp 3 returns before the wgmma.fence
constexpr int WG_MAX_KSTEPS = 8;           // of the RS modes (A fragments held in registers)
// setmaxnreg.inc takes back only registers the block's setmaxnreg.dec released: a lone
// warpgroup under __launch_bounds__(WG_THREADS, 1) starts at the cap (255; ptxas, setmaxnreg in
// the kernel), gives some back, then takes part of them again
constexpr int WG_REGS_DEC = 232, WG_REGS_INC = 240;

// Operand modes: A K-major or M-major in shared memory, or in registers; B K- or N-major.
enum WgMode { SS_KK = 0, SS_KN = 1, RS_K = 2, RS_N = 3, SS_MK = 4 };

// Where sm90_wgmma's operands lie in its shared memory and how it walks them: byte offsets
// from the block's aligned base, the canonical layout's LBO and SBO (bytes), the advance of a
// k16 step (bytes); the descriptors are made from these on the device.
struct WgOperands {
    uint32_t a_off, a_lbo, a_sbo, a_step;    // A (SS modes; the RS modes read a_regs)
    uint32_t b_off, b_lbo, b_sbo, b_step;    // B
    uint32_t swizzle;                        // sm90::Swizzle of both
    int ksteps;                              // k16 steps, at most WG_MAX_KSTEPS
};

// d[64, N] = sum over ksteps of A_k B_k (+ init), one warpgroup: shared memory = smem_in's
// smem_bytes (16 more hold WG_FLAG_HANDOFF's flag); A and B where `ops` says, or the A
// fragments a_regs[k][thread][4]; out[thread][N / 2] = d; descs = the descriptors of A and B
// at k-step 0 and the shared address of the base (thread 0).
template <typename T, int N, int MODE>
__global__ void __launch_bounds__(WG_THREADS, 1)
sm90_wgmma(const uint4* smem_in, unsigned smem_bytes, const uint32_t* a_regs, const WgOperands ops,
           const float* init, float* out, float* probe, u64* descs, int flags) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    constexpr bool RS = MODE == RS_K || MODE == RS_N;
    constexpr bool TRANS_A = MODE == SS_MK;
    constexpr bool TRANS_B = MODE == SS_KN || MODE == RS_N;
    const int tid = threadIdx.x;
    const int ksteps = ops.ksteps;
    const sm90::Swizzle swizzle = static_cast<sm90::Swizzle>(ops.swizzle);
    const u64 desc_a0 = sm90::smem_desc(smem + ops.a_off, ops.a_lbo, ops.a_sbo, swizzle);
    const u64 desc_b0 = sm90::smem_desc(smem + ops.b_off, ops.b_lbo, ops.b_sbo, swizzle);
    if (tid == 0) {
        descs[0] = desc_a0;
        descs[1] = desc_b0;
        descs[2] = sm90::smem_addr(smem);
    }
    uint4* s = reinterpret_cast<uint4*>(smem);
    if (flags & WG_FLAG_HANDOFF) {
        volatile int* handed = reinterpret_cast<volatile int*>(smem + smem_bytes);
        if (tid == 0) {
            for (unsigned i = 0; i < smem_bytes / 16; ++i) s[i] = smem_in[i];
            sm90::fence_proxy_async();
            *handed = 1;
        }
        while (*handed != 1) {
#ifdef VARLEN_HOST_EMULATION
            std::this_thread::yield();    // spinning OS threads would starve thread 0
#endif
        }
    } else {
        for (unsigned i = tid; i < smem_bytes / 16; i += WG_THREADS) s[i] = smem_in[i];
        // these generic writes, before the async proxy reads them
        if (!(flags & WG_NO_PROXY_FENCE)) sm90::fence_proxy_async();
        __syncthreads();
    }
    if (flags & WG_SETMAXNREG) sm90::setmaxnreg<WG_REGS_DEC, false>();
    // [64, N] accumulators, this thread's N / 2
    float d[N / 2];
    for (int i = 0; i < N / 2; ++i) d[i] = (flags & WG_ACCUMULATE) ? init[tid * (N / 2) + i] : 0.f;
    // RS: the A fragments of every k-step, written before the wgmma.fence as the ISA requires
    // (with WG_A_AFTER_FENCE each one after it, into a[0])
    uint32_t a[WG_MAX_KSTEPS][4];
    const auto load_a = [&](int k, uint32_t (&dst)[4]) {
        for (int r = 0; r < 4; ++r) dst[r] = a_regs[(k * WG_THREADS + tid) * 4 + r];
    };
    if (RS && !(flags & WG_A_AFTER_FENCE)) {
        for (int k = 0; k < ksteps; ++k) load_a(k, a[k]);
    }
    if ((flags & WG_WARP3_EXITS) && tid / 32 == 3) return;
    sm90::wgmma_fence_operand(d);
    sm90::wgmma_fence_operand(a);
    if (!(flags & WG_NO_FENCE)) sm90::wgmma_fence();
    if (flags & WG_WRITE_AFTER_FENCE) d[0] += 1.f;
    if (!((flags & WG_WARP3_SKIPS) && tid / 32 == 3)) {
        for (int k = 0; k < ksteps; ++k) {
            const bool scale_d = k > 0 || (flags & WG_ACCUMULATE);
            const u64 desc_b = sm90::desc_advance(desc_b0, k * ops.b_step);
            if constexpr (RS) {
                uint32_t (&ak)[4] = a[(flags & WG_A_AFTER_FENCE) ? 0 : k];
                if (flags & WG_A_AFTER_FENCE) load_a(k, ak);
                sm90::wgmma_rs<T, N, TRANS_B>(d, ak, desc_b, scale_d);
            } else {
                const u64 desc_a = sm90::desc_advance(desc_a0, k * ops.a_step);
                sm90::wgmma_ss<T, N, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
            }
            if (flags & WG_GROUP_PER_STEP) sm90::wgmma_commit();
        }
    }
    if (flags & WG_GROUP_PER_STEP) {
        sm90::wgmma_wait<1>();
        probe[tid] = d[0];
    } else {
        sm90::wgmma_commit();
    }
    if (flags & WG_PEEK) probe[tid] = d[0];
    if (flags & WG_CLOBBER) {
        __syncthreads();
        for (unsigned i = tid; i < smem_bytes / 16; i += WG_THREADS) s[i] = uint4{0, 0, 0, 0};
        __syncthreads();
    }
    sm90::wgmma_wait<0>();
    sm90::wgmma_fence_operand(d);
    if (flags & WG_SETMAXNREG) sm90::setmaxnreg<WG_REGS_INC, true>();
    for (int i = 0; i < N / 2; ++i) out[tid * (N / 2) + i] = d[i];
}

// stmatrix.x4 (.trans) of regs[lane][4] to rows at (8 i + j) row_stride bytes; out = 512 B.
extern "C" __global__ void sm90_stmatrix(const uint32_t* regs, unsigned row_stride, int trans,
                                         unsigned char* out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    const int l = threadIdx.x;
    uint32_t r[4];
    for (int i = 0; i < 4; ++i) r[i] = regs[l * 4 + i];
    unsigned char* row = smem + l * row_stride;
    if (trans) sm90::stmatrix_x4_trans(row, r);
    else sm90::stmatrix_x4(row, r);
    __syncwarp();
    for (unsigned i = l; i < 32 * row_stride; i += 32) out[i] = smem[i];
}

// A warp-specialised pipeline as FlashAttention-3 runs one: thread 0 of the producer
// warpgroup (threads 0..127) streams fp16 tiles A_kt [64 C, 64] and B_kt [64, 64] (B K-major,
// 128B swizzle) through PIPE_STAGES stages with TMA (full barriers: one arrival plus the bytes);
// each of the C consumer warpgroups (threads 128 (1 + c) ..) waits, runs four k16 wgmmas on its
// 64 rows of A_kt and releases the stage (empty barriers: 128 C arrivals).
// out[c][thread][32] = D_c[64, 64] = sum_kt A_kt[64 c .., :] B_kt. Shared memory:
// PIPE_STAGES (C + 1) PIPE_TILE bytes of tiles, then 2 PIPE_STAGES barriers.
constexpr int PIPE_STAGES = 2;
constexpr unsigned PIPE_TILE = 64 * 64 * 2;
// Registers: setmaxnreg.inc draws on what the producer's setmaxnreg.dec released, so the split
// adds up to what the block starts with, the cap of __launch_bounds__ at two consumers (as the
// sm_90a kernels split theirs; with one consumer the block starts with as many per thread)
constexpr int PIPE_MAX_CONSUMERS = 2;
constexpr int PIPE_MAX_THREADS = (1 + PIPE_MAX_CONSUMERS) * WG_THREADS;
constexpr int PIPE_ENTRY_REGS = 65536 / PIPE_MAX_THREADS / 8 * 8;
constexpr int PIPE_PRODUCER_REGS = 24, PIPE_CONSUMER_REGS = 240;
static_assert(PIPE_PRODUCER_REGS + PIPE_MAX_CONSUMERS * PIPE_CONSUMER_REGS <=
                  (1 + PIPE_MAX_CONSUMERS) * PIPE_ENTRY_REGS,
              "the consumers' setmaxnreg.inc would wait for registers no warpgroup releases");

extern "C" __global__ void __launch_bounds__(PIPE_MAX_THREADS, 1)
sm90_pipeline(const __grid_constant__ sm90::TensorMap map_a,
              const __grid_constant__ sm90::TensorMap map_b, int ktiles, int consumers,
              float* out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    const unsigned a_tile = consumers * PIPE_TILE;
    unsigned char* s_a = smem;
    unsigned char* s_b = smem + PIPE_STAGES * a_tile;
    u64* full = reinterpret_cast<u64*>(smem + PIPE_STAGES * (a_tile + PIPE_TILE));
    u64* empty = full + PIPE_STAGES;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < PIPE_STAGES; ++s) {
            sm90::mbar_init(&full[s], 1);
            sm90::mbar_init(&empty[s], consumers * WG_THREADS);
        }
        sm90::fence_barrier_init();
    }
    __syncthreads();
    if (tid < WG_THREADS) {
        sm90::setmaxnreg<PIPE_PRODUCER_REGS, false>();
        if (tid == 0) {
            for (int kt = 0; kt < ktiles; ++kt) {
                const int s = kt % PIPE_STAGES;
                const uint32_t phase = (kt / PIPE_STAGES) & 1;
                sm90::mbar_wait(&empty[s], phase ^ 1);      // the first round passes at once
                sm90::mbar_arrive_expect_tx(&full[s], a_tile + PIPE_TILE);
                sm90::tma_load_2d(s_a + s * a_tile, &map_a, &full[s], kt * 64, 0);
                sm90::tma_load_2d(s_b + s * PIPE_TILE, &map_b, &full[s], kt * 64, 0);
            }
        }
        return;
    }
    sm90::setmaxnreg<PIPE_CONSUMER_REGS, true>();
    const int c = tid / WG_THREADS - 1, t = tid % WG_THREADS;
    // [64, 64] accumulators, this thread's 32
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    for (int kt = 0; kt < ktiles; ++kt) {
        const int s = kt % PIPE_STAGES;
        sm90::mbar_wait(&full[s], (kt / PIPE_STAGES) & 1);
        const u64 desc_a = sm90::smem_desc(s_a + s * a_tile + c * PIPE_TILE, 0, 1024,
                                           sm90::Swizzle::B128);
        const u64 desc_b = sm90::smem_desc(s_b + s * PIPE_TILE, 0, 1024, sm90::Swizzle::B128);
        sm90::wgmma_fence_operand(d);
        sm90::wgmma_fence();
        for (int k = 0; k < 4; ++k) {
            sm90::wgmma_ss<__half, 64, false, false>(d, sm90::desc_advance(desc_a, 32 * k),
                                                     sm90::desc_advance(desc_b, 32 * k), true);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::wgmma_fence_operand(d);
        sm90::mbar_arrive(&empty[s]);
    }
    for (int i = 0; i < 32; ++i) out[(c * WG_THREADS + t) * 32 + i] = d[i];
}

// The attention tile: S[64, 64] = Q K^T (wgmma, Q and K K-major in shared memory), P = S
// rounded to T in registers (the D fragment of S read as A fragments: k-step j is registers
// 8 j .. 8 j + 7), O[64, 64] = P V (V N-major). Shared memory: Q at the base, K 8 KiB and V
// 16 KiB after it, 128B swizzle; out[thread][32] = O.
template <typename T>
__global__ void sm90_attention_tile(const uint4* smem_in, float* out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    constexpr unsigned TILE = 64 * 64 * 2;
    const int tid = threadIdx.x;
    uint4* s_all = reinterpret_cast<uint4*>(smem);
    for (unsigned i = tid; i < 3 * TILE / 16; i += WG_THREADS) s_all[i] = smem_in[i];
    sm90::fence_proxy_async();      // these generic writes, before the async proxy reads them
    __syncthreads();
    const u64 desc_q = sm90::smem_desc(smem, 0, 1024, sm90::Swizzle::B128);
    const u64 desc_k = sm90::smem_desc(smem + TILE, 0, 1024, sm90::Swizzle::B128);
    const u64 desc_v = sm90::smem_desc(smem + 2 * TILE, TILE, 1024, sm90::Swizzle::B128);
    // [64, 64] scores, this thread's 32
    float s[32];
    sm90::wgmma_fence();
    for (int k = 0; k < 4; ++k) {
        sm90::wgmma_ss<T, 64, false, false>(s, sm90::desc_advance(desc_q, 32 * k),
                                            sm90::desc_advance(desc_k, 32 * k), k > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::wgmma_fence_operand(s);
    // [64, 64] output, this thread's 32, from P's four k-steps packed before the wgmma.fence
    float o[32];
    uint32_t p[4][4];
    for (int j = 0; j < 4; ++j) {
        for (int r = 0; r < 4; ++r) {
            p[j][r] = varlen::ElemTraits<T>::pack(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
        }
    }
    sm90::wgmma_fence_operand(p);
    sm90::wgmma_fence();
    for (int j = 0; j < 4; ++j) {
        sm90::wgmma_rs<T, 64, true>(o, p[j], sm90::desc_advance(desc_v, 2048 * j), j > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::wgmma_fence_operand(o);
    for (int i = 0; i < 32; ++i) out[tid * 32 + i] = o[i];
}

#ifdef VARLEN_HOST_EMULATION
#include "host_emulation_entry.cuh"

// The kernels by their NVRTC name expressions (emulation/sm90_primitives.py's KERNELS), each
// launched as a GPU launch passes its arguments (host_emulation_entry.cuh).
#define VARLEN_HARNESS_WGMMA(T, N)                                                         \
    VARLEN_EMU_KERNEL("sm90_wgmma<" #T ", " #N ", 0>", sm90_wgmma<T, N, SS_KK>),         \
    VARLEN_EMU_KERNEL("sm90_wgmma<" #T ", " #N ", 1>", sm90_wgmma<T, N, SS_KN>),         \
    VARLEN_EMU_KERNEL("sm90_wgmma<" #T ", " #N ", 2>", sm90_wgmma<T, N, RS_K>),          \
    VARLEN_EMU_KERNEL("sm90_wgmma<" #T ", " #N ", 3>", sm90_wgmma<T, N, RS_N>),          \
    VARLEN_EMU_KERNEL("sm90_wgmma<" #T ", " #N ", 4>", sm90_wgmma<T, N, SS_MK>)

namespace {
const hostemu::Kernel HARNESS_KERNELS[] = {
    VARLEN_EMU_KERNEL("sm90_tma_box", sm90_tma_box),
    VARLEN_EMU_KERNEL("sm90_mbar_phases", sm90_mbar_phases),
    VARLEN_EMU_KERNEL("sm90_mbar_misuse", sm90_mbar_misuse),
    VARLEN_EMU_KERNEL("sm90_named_pingpong", sm90_named_pingpong),
    VARLEN_EMU_KERNEL("sm90_stmatrix", sm90_stmatrix),
    VARLEN_EMU_KERNEL("sm90_pipeline", sm90_pipeline),
    VARLEN_EMU_KERNEL("sm90_attention_tile<__half>", sm90_attention_tile<__half>),
    VARLEN_EMU_KERNEL("sm90_attention_tile<__nv_bfloat16>", sm90_attention_tile<__nv_bfloat16>),
    VARLEN_HARNESS_WGMMA(__half, 32), VARLEN_HARNESS_WGMMA(__half, 64),
    VARLEN_HARNESS_WGMMA(__half, 128), VARLEN_HARNESS_WGMMA(__half, 256),
    VARLEN_HARNESS_WGMMA(__nv_bfloat16, 32), VARLEN_HARNESS_WGMMA(__nv_bfloat16, 64),
    VARLEN_HARNESS_WGMMA(__nv_bfloat16, 128), VARLEN_HARNESS_WGMMA(__nv_bfloat16, 256),
};
}  // namespace

// The name of kernel i of the table, or nullptr past its end.
extern "C" const char* sm90_kernel_name(int i) {
    constexpr int n = sizeof(HARNESS_KERNELS) / sizeof(HARNESS_KERNELS[0]);
    return i >= 0 && i < n ? HARNESS_KERNELS[i].key : nullptr;
}

// Writes the size of each parameter of kernel `key` into `sizes` and returns their number;
// -1 for an unknown kernel.
extern "C" int sm90_param_sizes(const char* key, size_t* sizes) {
    const hostemu::Kernel* k = hostemu::find_kernel(HARNESS_KERNELS, key);
    return k ? k->param_sizes(sizes) : -1;
}

// Runs kernel `key` as one block of `threads` threads with `smem` bytes of dynamic shared
// memory; 0, 1 if a thread trapped (the launch failed), or -1 for an unknown one.
extern "C" int sm90_launch(const char* key, unsigned threads, size_t smem, void** args) {
    const hostemu::Kernel* k = hostemu::find_kernel(HARNESS_KERNELS, key);
    if (!k) return -1;
    return k->run(k->key, 1, 1, threads, smem, args) ? 0 : 1;
}

// Landing of copies and schedule of wgmma operand reads (hostemu::Landing), seed.
extern "C" void sm90_configure(int landing, unsigned long long seed) {
    hostemu::g_config = hostemu::Config{landing, false, seed, false};
}

extern "C" unsigned long long sm90_make_desc(unsigned addr, unsigned lbo, unsigned sbo,
                                             unsigned swizzle) {
    return sm90::make_smem_desc(addr, lbo, sbo, static_cast<sm90::Swizzle>(swizzle));
}

// The 128 bytes of sm90::make_tensor_map's map: dims, strides (bytes, dimensions 1..), box,
// rank entries each (rank - 1 strides).
extern "C" void sm90_tensor_map_bytes(const void* global, int rank, int elem_bytes,
                                      const unsigned long long* dims,
                                      const unsigned long long* strides, const unsigned* box,
                                      int swizzle, int nan_fill, unsigned char* out) {
    uint64_t d[3], st[2] = {0, 0};
    for (int i = 0; i < rank; ++i) d[i] = dims[i];
    for (int i = 0; i + 1 < rank; ++i) st[i] = strides[i];
    const sm90::TensorMap map = sm90::make_tensor_map(global, rank, elem_bytes, d, st, box,
                                                      static_cast<sm90::Swizzle>(swizzle),
                                                      nan_fill != 0);
    std::memcpy(out, &map, sizeof(map));
}
#endif  // VARLEN_HOST_EMULATION
