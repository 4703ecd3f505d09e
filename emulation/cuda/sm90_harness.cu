// Kernels that exercise the primitives of kernels_cuda/sm90.cuh one at a time, for
// tests/emulation/test_emulation_sm90.py. Compiled with g++ through the host emulation (the
// extern "C" entry points at the end launch them) and with NVRTC for sm_90a (the inline PTX
// assembles).
// Layout expectations live in the test, written from the PTX ISA; here only data moves.
#include "sm90.cuh"

using varlen::sm90::u64;
namespace sm90 = varlen::sm90;

constexpr int WG_THREADS = 128;

// Box of `map` at (c0, c1, c2) into shared memory at 0 (barrier at bar_off), out = its bytes.
extern "C" __global__ void sm90_tma_box(const __grid_constant__ sm90::TensorMap map, int rank,
                                        int c0, int c1, int c2, unsigned box_bytes,
                                        unsigned bar_off, unsigned char* out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u64* bar = reinterpret_cast<u64*>(smem_raw + bar_off);
    if (threadIdx.x == 0) {
        sm90::mbar_init(bar, 1);
        sm90::fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        sm90::mbar_arrive_expect_tx(bar, box_bytes);
        if (rank == 2) sm90::tma_load_2d(smem_raw, &map, bar, c0, c1);
        else sm90::tma_load_3d(smem_raw, &map, bar, c0, c1, c2);
    }
    sm90::mbar_wait(bar, 0);
    for (unsigned i = threadIdx.x; i < box_bytes; i += WG_THREADS) out[i] = smem_raw[i];
}

// Phases and transaction counts of one barrier of count 32 (warp 1 arrives), observed by
// thread 0 between block barriers: out[0..5] = try_wait results, out[6] = the waits passed;
// then out_bytes = the 64 bytes bulk-copied from src. 64 threads.
extern "C" __global__ void sm90_mbar_phases(const unsigned char* src, int* out,
                                            unsigned char* out_bytes) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u64* bar = reinterpret_cast<u64*>(smem_raw + 128);
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
    if (tid == 32) sm90::bulk_load(smem_raw, src, 64, bar);
    sm90::mbar_wait(bar, 1);
    if (tid == 0) {
        out[4] = sm90::mbar_try_wait(bar, 1);
        out[5] = sm90::mbar_try_wait(bar, 0);                     // phase 2 (parity 0) open
        out[6] = 1;
    }
    if (tid < 64) out_bytes[tid] = smem_raw[tid];
}

// Misuses of an mbarrier, each of which the emulation must report (never hang):
// 1: expect 128 bytes that no copy brings, then wait; 2: store over the barrier, then arrive;
// 3: a bulk copy completing on a barrier whose init was not fenced; 4: thread 1 arrives after
// seeing a plain flag thread 0 set after the init, with no barrier between.
extern "C" __global__ void sm90_mbar_misuse(int what, const unsigned char* src) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u64* bar = reinterpret_cast<u64*>(smem_raw);
    if (threadIdx.x == 0) {
        sm90::mbar_init(bar, 1);
        if (what != 3) sm90::fence_barrier_init();
    }
    if (what == 4) {
        volatile int* inited = reinterpret_cast<volatile int*>(smem_raw + 32);
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
        sm90::bulk_load(smem_raw + 16, src, 16, bar);
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
    volatile int* v = reinterpret_cast<volatile int*>(smem_raw);
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
constexpr int WG_SETMAXNREG = 32;     // setmaxnreg.dec / .inc around the product
constexpr int WG_GROUP_PER_STEP = 64; // commit each k-step; probe[t] = d[0] after wait_group 1
constexpr int WG_NO_PROXY_FENCE = 128; // no fence.proxy.async after the operands' stores
constexpr int WG_FLAG_HANDOFF = 256;   // thread 0 stores and fences the operands, then hands them
                                       // on through a plain flag after them, not a barrier
constexpr int WG_WRITE_AFTER_FENCE = 512;  // d[0] += 1 between the wgmma.fence and the first op
constexpr int WG_A_AFTER_FENCE = 1024;     // RS: each k-step's A fragment loaded after the
                                           // fence into the same registers
constexpr int WG_WARP3_EXITS = 2048;       // warp 3 returns before the wgmma.fence
constexpr int WG_MAX_KSTEPS = 8;           // of the RS modes (A fragments held in registers)

// Operand modes: A K-major or M-major in shared memory, or in registers; B K- or N-major.
enum WgMode { SS_KK = 0, SS_KN = 1, RS_K = 2, RS_N = 3, SS_MK = 4 };

// d[64, N] = sum over ksteps of A_k B_k (+ init), one warpgroup: shared memory = smem_in's
// bytes (16 more hold WG_FLAG_HANDOFF's flag); step k uses desc_a0 / desc_b0 advanced by
// k a_step / b_step bytes, or A fragments
// a_regs[k][thread][4]; out[thread][N / 2] = d.
template <typename T, int N, int MODE>
__global__ void sm90_wgmma(const uint4* smem_in, unsigned smem_bytes, const uint32_t* a_regs,
                           u64 desc_a0, u64 desc_b0, unsigned a_step, unsigned b_step,
                           int ksteps, const float* init, float* out, float* probe, int flags) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr bool RS = MODE == RS_K || MODE == RS_N;
    constexpr bool TRANS_A = MODE == SS_MK;
    constexpr bool TRANS_B = MODE == SS_KN || MODE == RS_N;
    const int tid = threadIdx.x;
    uint4* s = reinterpret_cast<uint4*>(smem_raw);
    if (flags & WG_FLAG_HANDOFF) {
        volatile int* handed = reinterpret_cast<volatile int*>(smem_raw + smem_bytes);
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
    if (flags & WG_SETMAXNREG) sm90::setmaxnreg<240, true>();
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
            const u64 desc_b = sm90::desc_advance(desc_b0, k * b_step);
            if constexpr (RS) {
                uint32_t (&ak)[4] = a[(flags & WG_A_AFTER_FENCE) ? 0 : k];
                if (flags & WG_A_AFTER_FENCE) load_a(k, ak);
                sm90::wgmma_rs<T, N, TRANS_B>(d, ak, desc_b, scale_d);
            } else {
                const u64 desc_a = sm90::desc_advance(desc_a0, k * a_step);
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
    if (flags & WG_SETMAXNREG) sm90::setmaxnreg<24, false>();
    for (int i = 0; i < N / 2; ++i) out[tid * (N / 2) + i] = d[i];
}

// stmatrix.x4 (.trans) of regs[lane][4] to rows at (8 i + j) row_stride bytes; out = 512 B.
extern "C" __global__ void sm90_stmatrix(const uint32_t* regs, unsigned row_stride, int trans,
                                         unsigned char* out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int l = threadIdx.x;
    uint32_t r[4];
    for (int i = 0; i < 4; ++i) r[i] = regs[l * 4 + i];
    unsigned char* row = smem_raw + l * row_stride;
    if (trans) sm90::stmatrix_x4_trans(row, r);
    else sm90::stmatrix_x4(row, r);
    __syncwarp();
    for (unsigned i = l; i < 32 * row_stride; i += 32) out[i] = smem_raw[i];
}

// A warp-specialised pipeline as FlashAttention-3 runs one: thread 0 of the producer
// warpgroup (threads 0..127) streams fp16 tiles A_kt [64 C, 64] and B_kt [64, 64] (B K-major,
// 128B swizzle) through PIPE_STAGES stages with TMA (full barriers: one arrival plus the bytes);
// each of the C consumer warpgroups (threads 128 (1 + c) ..) waits, runs four k16 wgmmas on its
// 64 rows of A_kt and releases the stage (empty barriers: 128 C arrivals).
// out[c][thread][32] = D_c[64, 64] = sum_kt A_kt[64 c .., :] B_kt.
constexpr int PIPE_STAGES = 2;
constexpr unsigned PIPE_TILE = 64 * 64 * 2;

__host__ __device__ constexpr unsigned pipe_smem(int consumers) {
    return PIPE_STAGES * (consumers + 1) * PIPE_TILE + 2 * PIPE_STAGES * 8;
}

extern "C" __global__ void sm90_pipeline(const __grid_constant__ sm90::TensorMap map_a,
                                         const __grid_constant__ sm90::TensorMap map_b,
                                         int ktiles, int consumers, float* out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned a_tile = consumers * PIPE_TILE;
    unsigned char* s_a = smem_raw;
    unsigned char* s_b = smem_raw + PIPE_STAGES * a_tile;
    u64* full = reinterpret_cast<u64*>(smem_raw + PIPE_STAGES * (a_tile + PIPE_TILE));
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
        sm90::setmaxnreg<24, false>();
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
    sm90::setmaxnreg<240, true>();
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
// 8 j .. 8 j + 7), O[64, 64] = P V (V N-major). Shared memory: Q at 0, K at 8 KiB, V at 16 KiB,
// 128B swizzle; out[thread][32] = O.
template <typename T>
__global__ void sm90_attention_tile(const uint4* smem_in, float* out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr unsigned TILE = 64 * 64 * 2;
    const int tid = threadIdx.x;
    uint4* s_all = reinterpret_cast<uint4*>(smem_raw);
    for (unsigned i = tid; i < 3 * TILE / 16; i += WG_THREADS) s_all[i] = smem_in[i];
    sm90::fence_proxy_async();      // these generic writes, before the async proxy reads them
    __syncthreads();
    const u64 desc_q = sm90::smem_desc(smem_raw, 0, 1024, sm90::Swizzle::B128);
    const u64 desc_k = sm90::smem_desc(smem_raw + TILE, 0, 1024, sm90::Swizzle::B128);
    const u64 desc_v = sm90::smem_desc(smem_raw + 2 * TILE, TILE, 1024, sm90::Swizzle::B128);
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
namespace {

using WgKernel = void (*)(const uint4*, unsigned, const uint32_t*, u64, u64, unsigned, unsigned,
                          int, const float*, float*, float*, int);

template <typename T, int N>
WgKernel wg_kernel(int mode) {
    switch (mode) {
        case SS_KK: return sm90_wgmma<T, N, SS_KK>;
        case SS_KN: return sm90_wgmma<T, N, SS_KN>;
        case RS_K: return sm90_wgmma<T, N, RS_K>;
        case RS_N: return sm90_wgmma<T, N, RS_N>;
        case SS_MK: return sm90_wgmma<T, N, SS_MK>;
    }
    return nullptr;
}

template <typename T>
WgKernel wg_kernel(int n, int mode) {
    return n == 32 ? wg_kernel<T, 32>(mode) : n == 64 ? wg_kernel<T, 64>(mode)
         : n == 128 ? wg_kernel<T, 128>(mode) : n == 256 ? wg_kernel<T, 256>(mode) : nullptr;
}

}  // namespace

// Landing of copies and schedule of wgmma operand reads (hostemu::Landing), seed.
extern "C" void sm90_configure(int landing, unsigned long long seed) {
    hostemu::g_config = hostemu::Config{landing, false, seed, false};
}

extern "C" unsigned long long sm90_make_desc(unsigned addr, unsigned lbo, unsigned sbo,
                                             unsigned swizzle) {
    return sm90::make_smem_desc(addr, lbo, sbo, static_cast<sm90::Swizzle>(swizzle));
}

// dims, strides (bytes, dimensions 1..), box: rank entries each (rank - 1 strides).
static sm90::TensorMap harness_map(const void* global, int rank, int elem_bytes,
                                   const unsigned long long* dims,
                                   const unsigned long long* strides, const unsigned* box,
                                   int swizzle, int nan_fill) {
    uint64_t d[3], s[2] = {0, 0};
    for (int i = 0; i < rank; ++i) d[i] = dims[i];
    for (int i = 0; i + 1 < rank; ++i) s[i] = strides[i];
    return sm90::make_tensor_map(global, rank, elem_bytes, d, s, box,
                                 static_cast<sm90::Swizzle>(swizzle), nan_fill != 0);
}

extern "C" void sm90_run_tma(const void* global, int rank, int elem_bytes,
                             const unsigned long long* dims, const unsigned long long* strides,
                             const unsigned* box, int swizzle, int nan_fill, const int* coords,
                             unsigned char* out) {
    const sm90::TensorMap map = harness_map(global, rank, elem_bytes, dims, strides, box,
                                            swizzle, nan_fill);
    unsigned bytes = elem_bytes;
    for (int i = 0; i < rank; ++i) bytes *= box[i];
    const unsigned bar_off = (bytes + 1023) / 1024 * 1024;
    launch("sm90_tma_box", 1, 1, WG_THREADS, bar_off + 16, [&] {
        sm90_tma_box(map, rank, coords[0], coords[1], rank > 2 ? coords[2] : 0, bytes, bar_off,
                     out);
    });
}

// The 128 bytes sm90_run_tma's map would have.
extern "C" void sm90_tensor_map_bytes(const void* global, int rank, int elem_bytes,
                                      const unsigned long long* dims,
                                      const unsigned long long* strides, const unsigned* box,
                                      int swizzle, int nan_fill, unsigned char* out) {
    const sm90::TensorMap map = harness_map(global, rank, elem_bytes, dims, strides, box,
                                            swizzle, nan_fill);
    std::memcpy(out, &map, sizeof(map));
}

extern "C" void sm90_run_mbar_phases(const unsigned char* src, int* out, unsigned char* bytes) {
    launch("sm90_mbar_phases", 1, 1, 64, 256, [&] { sm90_mbar_phases(src, out, bytes); });
}

extern "C" void sm90_run_named(int rounds, int* out, int misuse) {
    launch("sm90_named_pingpong", 1, 1, 2 * WG_THREADS, 64, [&] {
        sm90_named_pingpong(rounds, out, misuse);
    });
}

extern "C" void sm90_run_mbar_misuse(int what) {
    alignas(16) static const unsigned char src[16] = {};
    launch("sm90_mbar_misuse", 1, 1, 32, 64, [&] { sm90_mbar_misuse(what, src); });
}

// 0, or -1 for an unsupported (bf16, n, mode).
extern "C" int sm90_run_wgmma(int bf16, int n, int mode, const void* smem_in,
                              unsigned smem_bytes, const uint32_t* a_regs, u64 desc_a,
                              u64 desc_b, unsigned a_step, unsigned b_step, int ksteps,
                              const float* init, float* out, float* probe, int flags) {
    const WgKernel k = bf16 ? wg_kernel<__nv_bfloat16>(n, mode) : wg_kernel<__half>(n, mode);
    if (!k || ksteps > WG_MAX_KSTEPS) return -1;
    launch("sm90_wgmma", 1, 1, WG_THREADS, smem_bytes + 16, [&] {
        k(static_cast<const uint4*>(smem_in), smem_bytes, a_regs, desc_a, desc_b, a_step, b_step,
          ksteps, init, out, probe, flags);
    });
    return 0;
}

extern "C" void sm90_run_stmatrix(const uint32_t* regs, unsigned row_stride, int trans,
                                  unsigned char* out) {
    launch("sm90_stmatrix", 1, 1, 32, 32 * row_stride, [&] {
        sm90_stmatrix(regs, row_stride, trans, out);
    });
}
// a: [64 consumers][64 ktiles], b: [64][64 ktiles] fp16, row-major (K innermost).
extern "C" void sm90_run_pipeline(const void* a, const void* b, int ktiles, int consumers,
                                  float* out) {
    const uint64_t dims_a[2] = {64ull * ktiles, 64ull * consumers};
    const uint64_t dims_b[2] = {64ull * ktiles, 64};
    const uint64_t strides[1] = {128ull * ktiles};
    const uint32_t box_a[2] = {64, 64u * consumers};
    const uint32_t box_b[2] = {64, 64};
    const sm90::TensorMap map_a = sm90::make_tensor_map(a, 2, 2, dims_a, strides, box_a,
                                                        sm90::Swizzle::B128);
    const sm90::TensorMap map_b = sm90::make_tensor_map(b, 2, 2, dims_b, strides, box_b,
                                                        sm90::Swizzle::B128);
    launch("sm90_pipeline", 1, 1, (1 + consumers) * WG_THREADS, pipe_smem(consumers), [&] {
        sm90_pipeline(map_a, map_b, ktiles, consumers, out);
    });
}
extern "C" void sm90_run_attention_tile(int bf16, const void* smem_in, float* out) {
    launch("sm90_attention_tile", 1, 1, WG_THREADS, 3 * 64 * 64 * 2, [&] {
        if (bf16) sm90_attention_tile<__nv_bfloat16>(static_cast<const uint4*>(smem_in), out);
        else sm90_attention_tile<__half>(static_cast<const uint4*>(smem_in), out);
    });
}
#endif  // VARLEN_HOST_EMULATION
