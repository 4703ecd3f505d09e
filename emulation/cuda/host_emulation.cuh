// Host emulation of the CUDA features the varlen kernels use, so that the kernels themselves run
// and are checked on a CPU (varlen/backends/_cupy_emulation.py compiles them with g++
// -DVARLEN_HOST_EMULATION; docs/cupy_backend.md, "Host emulation: what it catches").
//
// One OS thread per CUDA thread, the blocks of a launch one after the other. Warp-collective
// PTX primitives (ldmatrix, mma.sync, shuffles) exchange operands through a per-warp slot array
// between two warp barriers and follow the fragment ownership of the PTX ISA spelled out in
// mma.cuh: an independent statement of the same layouts, so an index error in a kernel shows up
// as a wrong result. What is checked, as a GPU (or compute-sanitizer) would:
//   * cp.async: the destination is poisoned (NaN bytes) at issue and the copy lands at issue, at
//     the cp.async.wait_group that retires its group (the latest moment the PTX ISA allows), or
//     at a seeded random synchronisation point of the issuing thread in between (emu_configure);
//     reading a stage before its wait, or refilling one another warp still reads, shows up as
//     NaN or as a data race. Copies still in flight when a thread exits land then.
//   * Races: built with -fsanitize=thread, every shared- and global-memory access of the kernels
//     is checked against the happens-before order of barriers, warp collectives and atomics;
//     a report stops the run and names the kernel and block (the death callback below).
//   * Schedules: with the turnstile on, one warp runs at a time between two __syncthreads, in a
//     seeded permuted order drawn anew at every barrier.
//   * Shared memory: each block gets exactly its requested dynamic size, ending at a PROT_NONE
//     guard page (an overrun faults and is reported with its offset); the bytes before it are a
//     canary checked after the block; it starts as NaN bytes.
//   * Collectives: all 32 lanes must meet at the same ldmatrix / mma / shfl call site, as the
//     same dynamic instance (per-lane count), with no lane exited; otherwise the run aborts.
//   * Spin-waits on global counters (spin_wait_equal): blocks run in the GPU's dispatch order,
//     so a wait that is not satisfied at once waits for a later block: the run aborts (in a
//     build with VARLEN_POLL_LIMIT, after that many polls, through the kernels' own message).
//   * printf and __trap: printf is the C library's; __trap ends the launch as a GPU does: the
//     trapping thread unwinds, every other thread of the block unwinds at its next wait or
//     check, no later block runs, and the launch returns an error (emu_launch: 1), which the
//     stand-in launchers raise. The process goes on.
//   * Alignment: ldmatrix row addresses and both cp.async addresses must be 16-byte aligned.
//   * Bank conflicts: each 8-address phase of an ldmatrix must hit 8 distinct 16-byte bank
//     groups (the padding invariant of common.cuh: a conflict aborts); the 16-byte cp.async
//     writes of each quarter-warp are counted the same way (reported; fatal when strict).
// Not a GPU: no timing, no register budget, no hardware rounding (host_emulation_math.cuh).
#pragma once
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <algorithm>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <chrono>
#include <thread>
#include <tuple>
#include <vector>
#include <functional>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/common_interface_defs.h>
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define __noinline__ __attribute__((noinline))
#ifndef __grid_constant__
#define __grid_constant__
#endif

using std::min;
using std::max;

struct dim3e { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3e threadIdx, blockIdx;
inline dim3e gridDim;
inline dim3e blockDim;

struct alignas(16) uint4 { unsigned x, y, z, w; };

inline float __int_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }

#include "host_emulation_math.cuh"

// ---- configuration and the block being run --------------------------------------------
namespace hostemu {

enum Landing : int { LAND_AT_WAIT = 0, LAND_AT_ISSUE = 1, LAND_RANDOM = 2 };

struct Config {
    int landing = LAND_AT_WAIT;
    bool turnstile = false;          // one warp at a time between barriers, permuted order
    uint64_t seed = 0;
    bool strict_copy_banks = false;  // a cp.async bank conflict aborts too
};
inline Config g_config;

// Bank-conflict counts since the library was loaded: phases checked and extra wavefronts.
struct BankCounts { uint64_t ldsm_phases, ldsm_conflicts, copy_phases, copy_conflicts; };
inline BankCounts g_banks{};

// Pairs the kernels have evaluated a mask_mod on since the library was loaded (the counting
// wrapper of host_emulation_entry.cu): what the tile classes save is counted, not inferred.
inline std::atomic<uint64_t> g_user_mask_calls{0};
inline void count_user_mask() { g_user_mask_calls.fetch_add(1, std::memory_order_relaxed); }

struct Block {
    const char* kernel = "";
    unsigned char* smem = nullptr;   // the requested bytes end at guard
    size_t smem_bytes = 0;
    unsigned char* map = nullptr;    // whole mapping: canary, smem, guard page
    size_t map_bytes = 0;
    unsigned char* guard = nullptr;
};
inline Block g_block;

// A __trap in the launch being run: its threads unwind (Trapped) at their next wait or check.
struct Trapped {};
inline std::atomic<bool> g_trapped{false};
inline thread_local bool t_in_kernel = false;    // an emulated CUDA thread, in its kernel body

inline void stop_if_trapped() {
    if (t_in_kernel && g_trapped.load()) throw Trapped{};
}

[[noreturn]] inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void fail(const char* fmt, ...) {
    // After a trap, a thread may meet a check the trap broke (a warp partner gone): it unwinds.
    stop_if_trapped();
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "host emulation: kernel %s, block (%u, %u), thread %u: %s\n",
                 g_block.kernel, blockIdx.x, blockIdx.y, threadIdx.x, msg);
    std::fflush(stderr);
    std::abort();
}

inline uint64_t splitmix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Offset of p from the block's shared memory, for messages.
inline long smem_offset(const void* p) { return (const unsigned char*)p - g_block.smem; }

// Whether `bytes` from p lie in the block's shared memory.
inline bool in_smem(const void* p, size_t bytes = 1) {
    const long off = smem_offset(p);
    return off >= 0 && static_cast<size_t>(off) + bytes <= g_block.smem_bytes;
}

// ---- warps -----------------------------------------------------------------------------
enum Kind : int { K_NONE, K_LDSM, K_LDSM_T, K_MMA, K_SHFL, K_EXITED };
inline const char* kind_name(int k) {
    static const char* names[] = {"-", "ldmatrix", "ldmatrix.trans", "mma.sync", "shfl.sync",
                                  "(exited)"};
    return names[k];
}

// A barrier that sleeps (a mutex and a condition variable) instead of spinning: hundreds of
// emulated threads share a few cores. arrive_and_drop: this thread leaves for good.
class Barrier {
    std::mutex m_;
    std::condition_variable cv_;
    int expected_, arrived_ = 0;
    uint64_t phase_ = 0;

    void complete() { arrived_ = 0; ++phase_; cv_.notify_all(); }

public:
    explicit Barrier(int expected) : expected_(expected) {}
    void arrive_and_wait() {
        std::unique_lock lk(m_);
        const uint64_t ph = phase_;
        if (++arrived_ == expected_) {
            complete();
            return;
        }
        while (!cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return phase_ != ph; })) {
            if (t_in_kernel && g_trapped.load()) {
                --arrived_;
                throw Trapped{};
            }
        }
    }
    void arrive_and_drop() {
        std::unique_lock lk(m_);
        if (--expected_ > 0 && arrived_ == expected_) complete();
    }
};

// Where a lane is: the collective's kind, its call site and how many collectives it has met.
struct Tag { int kind; const void* site; uint64_t count; };

// What the lanes of a warp hand each other at a collective, in two copies used in turns (by the
// parity of the lanes' collective count): one barrier per collective then suffices. A lane
// writes the copy of collective n + 2 only after the barrier of collective n + 1, which every
// lane reaches after it has read the copy of collective n.
struct Exchange {
    Tag tag[32];
    const void* ptr[32];
    uint32_t a[32][4];
    uint32_t b[32][2];
    float f[32];
};

struct Warp {
    Barrier bar{32};
    Exchange x[2];
    uint64_t ldsm_phases = 0, ldsm_conflicts = 0;
};

// One warp at a time between two __syncthreads, the order drawn anew (seeded) at each.
struct Turnstile {
    std::mutex m;
    std::condition_variable cv;
    int num_warps;
    std::vector<int> order, live, arrived;
    int turn = 0;
    unsigned phase = 0;
    std::mt19937_64 rng;

    // `threads` of the block: its last warp may be partial (a block of 8 threads is one warp
    // of 8 live lanes).
    Turnstile(int threads, uint64_t seed)
        : num_warps((threads + 31) / 32), order(num_warps), live(num_warps, 32),
          arrived(num_warps, 0), rng(seed) {
        live[num_warps - 1] = threads - 32 * (num_warps - 1);
        shuffle();
    }
    void shuffle() {
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        turn = 0;
        skip_dead();
    }
    void skip_dead() { while (turn < num_warps && live[order[turn]] == 0) ++turn; }
    void wait_turn(std::unique_lock<std::mutex>& lk, int w, unsigned ph) {
        cv.wait(lk, [&] { return phase == ph && turn < num_warps && order[turn] == w; });
    }
    void start(int w) { std::unique_lock lk(m); wait_turn(lk, w, 0); }
    // This lane is done with the current phase: at a barrier, or exiting.
    void done(int w, bool exiting) {
        std::unique_lock lk(m);
        const unsigned ph = phase;
        if (exiting) --live[w]; else ++arrived[w];
        if (arrived[w] == live[w]) {
            ++turn;
            skip_dead();
            if (turn >= num_warps) {
                ++phase;
                std::fill(arrived.begin(), arrived.end(), 0);
                shuffle();
            }
            cv.notify_all();
        }
        if (!exiting) wait_turn(lk, w, ph + 1);
    }
};

// One 16-byte cp.async write to shared memory, for the bank-conflict count.
struct CopyRecord { const void* site; uint32_t ordinal; uint32_t thread; long offset; };

struct BlockSync {
    std::unique_ptr<Barrier> bar;
    std::unique_ptr<Warp[]> warps;
    std::unique_ptr<Turnstile> turnstile;
    std::vector<std::vector<CopyRecord>> copies;     // per thread
    // __syncthreads_or: three tallies used in turn (vote n uses n % 3, and clears the one of
    // vote n + 1 before its barrier: that tally was last read before vote n - 1's barrier
    // was left, and is next written after vote n's), and each thread's count of votes.
    std::atomic<int> votes[3];
    std::vector<uint64_t> voted;                     // per thread
};
inline BlockSync g_sync;
// Run by each thread entering (false) and leaving (true) __syncthreads, when set (the sm_90
// emulation's memory-order tracking).
inline void (*g_block_barrier_hook)(bool leaving) = nullptr;
// Run by each thread as its kernel body returns, before it leaves the barriers, when set (the
// sm_90 emulation's check that no warp of a warpgroup skipped a warpgroup instruction).
inline void (*g_thread_exit_hook)() = nullptr;

inline Warp& my_warp() { return g_sync.warps[threadIdx.x / 32]; }
inline int my_lane() { return threadIdx.x % 32; }

// This thread's cp.async copies since its last commit, and its committed groups, oldest first.
struct AsyncCopy { void* dst; const void* src; bool valid; bool landed; unsigned bytes = 16; };
struct ThreadState {
    std::vector<AsyncCopy> open;
    std::deque<std::vector<AsyncCopy>> committed;
    uint64_t rng = 0;
    uint64_t collectives = 0;
    uint64_t fences = 0;                                         // __threadfence calls
    std::vector<std::pair<const void*, uint32_t>> copy_sites;    // ordinal per call site
    std::vector<CopyRecord> copies;
};
inline thread_local ThreadState t_state;

inline void land(AsyncCopy& c) {
    if (c.landed) return;
    if (c.valid) std::memcpy(c.dst, c.src, c.bytes); else std::memset(c.dst, 0, c.bytes);
    c.landed = true;
}

// A synchronisation point of this thread: with random landing, each copy in flight lands here
// with probability 1/2.
inline void sync_point() {
    if (g_config.landing != LAND_RANDOM) return;
    ThreadState& s = t_state;
    auto maybe = [&](AsyncCopy& c) {
        s.rng = splitmix(s.rng);
        if (s.rng & 1) land(c);
    };
    for (auto& g : s.committed) for (AsyncCopy& c : g) maybe(c);
    for (AsyncCopy& c : s.open) maybe(c);
}

// Every lane of the warp must be at the same collective (kind, call site, count); lane l
// compares itself with lane l + 1, so an exited lane is seen by its neighbour.
inline void check_collective(const Exchange& x, int l) {
    const Tag& me = x.tag[l];
    const Tag& next = x.tag[(l + 1) % 32];
    if (me.kind != next.kind || me.site != next.site || me.count != next.count) {
        fail("warp %u: lanes %d and %d disagree at a warp collective: lane %d at %s #%llu "
             "(call site %p), lane %d at %s #%llu (call site %p)",
             threadIdx.x / 32, l, (l + 1) % 32, l, kind_name(me.kind),
             (unsigned long long)me.count, me.site, (l + 1) % 32, kind_name(next.kind),
             (unsigned long long)next.count, next.site);
    }
}

// The copy of the exchange this lane's next collective uses.
inline Exchange& next_exchange(Warp& w) { return w.x[(t_state.collectives + 1) % 2]; }

// Prologue of a warp collective whose operands this lane has put in `x` (next_exchange):
// publish where this lane is, wait for the warp, check.
inline void meet(Warp& w, Exchange& x, int l, int kind, const void* site) {
    sync_point();
    x.tag[l] = Tag{kind, site, ++t_state.collectives};
    w.bar.arrive_and_wait();
    check_collective(x, l);
}

// Extra wavefronts of n 16-byte accesses served together: the most that fall into one 16-byte
// bank group (of the 128-byte bank row), minus one.
inline int extra_wavefronts(const long* offsets, int n) {
    int count[8] = {0};
    int worst = 0;
    for (int i = 0; i < n; ++i) worst = std::max(worst, ++count[(offsets[i] >> 4) & 7]);
    return worst - 1;
}

}  // namespace hostemu

inline void __syncthreads() {
    hostemu::sync_point();
    if (hostemu::g_block_barrier_hook) hostemu::g_block_barrier_hook(false);
    if (hostemu::g_sync.turnstile) hostemu::g_sync.turnstile->done(threadIdx.x / 32, false);
    else hostemu::g_sync.bar->arrive_and_wait();
    if (hostemu::g_block_barrier_hook) hostemu::g_block_barrier_hook(true);
}
// A barrier that also returns whether any thread of the block passed a nonzero predicate.
inline int __syncthreads_or(int predicate) {
    hostemu::BlockSync& s = hostemu::g_sync;
    const uint64_t n = s.voted[threadIdx.x]++;
    s.votes[(n + 1) % 3].store(0);
    if (predicate) s.votes[n % 3].store(1);
    __syncthreads();
    return s.votes[n % 3].load();
}
inline void __syncwarp() { hostemu::sync_point(); hostemu::my_warp().bar.arrive_and_wait(); }

__attribute__((noinline)) inline float __shfl_xor_sync(unsigned, float x, int m) {
    hostemu::Warp& w = hostemu::my_warp(); int l = hostemu::my_lane();
    hostemu::Exchange& e = hostemu::next_exchange(w);
    e.f[l] = x;
    hostemu::meet(w, e, l, hostemu::K_SHFL, __builtin_return_address(0));
    return e.f[l ^ m];
}
// The 32-bit integer form (dropout's keep bits): the bits travel unchanged.
__attribute__((noinline)) inline unsigned __shfl_xor_sync(unsigned, unsigned x, int m) {
    hostemu::Warp& w = hostemu::my_warp(); int l = hostemu::my_lane();
    hostemu::Exchange& e = hostemu::next_exchange(w);
    std::memcpy(&e.f[l], &x, sizeof(x));
    hostemu::meet(w, e, l, hostemu::K_SHFL, __builtin_return_address(0));
    unsigned r; std::memcpy(&r, &e.f[l ^ m], sizeof(r));
    return r;
}

namespace hostemu {
// The turn a block last waited for (spin_wait_equal), written by the waiting thread and read by
// every fp32 atomic as plain memory: under ThreadSanitizer an addition not ordered after the
// wait by a barrier is a race on it (in atomic mode nobody writes it).
inline int g_turn = 0;
inline thread_local int t_turn_seen = 0;
// fp32 atomics to global memory of the block being run, per epoch, the epoch of a thread being
// one more than its __threadfence calls so far (ordered dQ: a thread fences once per chunk,
// after its additions, so epoch k holds its additions to the k-th chunk the block waited for).
// Reset per block.
constexpr int MAX_EPOCHS = 4096;
inline std::atomic<int> g_adds_in_epoch[MAX_EPOCHS];
}  // namespace hostemu

// fp32 atomics: dQ in global memory, and the non-finite flags of a chunk's rows in shared
// memory. With random landing a thread yields before one at seeded random, so that the order
// of two threads' additions to an element varies between runs as on a GPU (an unordered sum
// then differs in its last bits; the deterministic mode's must not). Only the additions to
// global memory take part in the ordered-dQ checks.
inline float atomicAdd(float* p, float v) {
    if (!hostemu::in_smem(p)) {
        hostemu::t_turn_seen = hostemu::g_turn;
        const uint64_t epoch = hostemu::t_state.fences + 1;
        if (epoch < hostemu::MAX_EPOCHS) hostemu::g_adds_in_epoch[epoch].fetch_add(1);
    }
    if (hostemu::g_config.landing == hostemu::LAND_RANDOM) {
        hostemu::ThreadState& s = hostemu::t_state;
        s.rng = hostemu::splitmix(s.rng);
        if (s.rng & 1) std::this_thread::yield();
    }
    std::atomic_ref<float> ref(*p);
    return ref.fetch_add(v);
}

// 64-bit integer atomics (the deterministic aux gradients' fixed-point words, aux_fixed.cuh):
// with random landing they yield at random too, so their order varies between runs.
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    if (hostemu::g_config.landing == hostemu::LAND_RANDOM) {
        hostemu::ThreadState& s = hostemu::t_state;
        s.rng = hostemu::splitmix(s.rng);
        if (s.rng & 1) std::this_thread::yield();
    }
    return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}

inline unsigned long long atomicOr(unsigned long long* p, unsigned long long v) {
    return std::atomic_ref<unsigned long long>(*p).fetch_or(v);
}

// __threadfence calls, and counter releases (bwd_dq_ordered.cuh), of the block being run
// (reset per block), for the releases' checks.
inline std::atomic<uint64_t> g_block_fences{0};
inline std::atomic<uint64_t> g_block_releases{0};
namespace hostemu {
inline std::atomic<uint64_t> g_block_waits{0};      // spin_wait_equal calls, reset per block
}  // namespace hostemu

// The k-th fence of a thread orders its additions before the k-th release of its block: a
// thread fencing after that release added past the hand-on (a missing barrier before it).
inline void __threadfence() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    g_block_fences.fetch_add(1);
    const uint64_t mine = ++hostemu::t_state.fences;
    if (g_block_releases.load() >= mine) {
        hostemu::fail("thread %u fenced its additions for the %llu-th time after the block "
                      "handed the counter on for the %llu-th time (a missing barrier before "
                      "the release)", threadIdx.x, static_cast<unsigned long long>(mine),
                      static_cast<unsigned long long>(g_block_releases.load()));
    }
}

namespace varlen {

// common.cuh's report of a wait past VARLEN_POLL_LIMIT polls (printf, then __trap).
[[noreturn]] void poll_limit_reached(const char* file, int line, const char* function, const char* kind,
                        const char* name, long long where, long long expected, bool has_seen,
                        long long seen);

// A spin-wait on a counter in global memory (bwd_dq_ordered.cuh). Blocks run one after the
// other here, so the value a block waits for must already be there at the first poll; if it is
// not, the block would wait for a later block (on a GPU, a possible deadlock: blocks are
// dispatched in order of their linear index) or its rank is wrong. Either way the run stops,
// naming the kernel, the block and the counter. On a GPU the wait may last while an earlier
// block adds: under random landing the waiting thread lets the others run first (a few ms),
// and an addition to the chunk made before the wait returns stops the run (a thread that did
// not wait for its block's turn: a missing barrier after the wait). With VARLEN_POLL_LIMIT the
// wait polls that often, then reports as the kernel's own loop does (and traps).
inline void spin_wait_equal(const int* counter, int value, const char* what, int64_t index,
                            const char* file, int line, const char* function) {
    const uint64_t epoch = hostemu::g_block_waits.fetch_add(1) + 1;
    if (hostemu::g_config.landing == hostemu::LAND_RANDOM) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    int& value_now = *const_cast<int*>(counter);
    int got = std::atomic_ref<int>(value_now).load(std::memory_order_acquire);
    if constexpr (VARLEN_POLL_LIMIT > 0) {
        for (int polls = 1; got != value; ++polls) {
            if (polls == VARLEN_POLL_LIMIT) {
                poll_limit_reached(file, line, function, "counter", what, index, value, true,
                                   got);
            }
            std::this_thread::yield();
            got = std::atomic_ref<int>(value_now).load(std::memory_order_acquire);
        }
    }
    if (got != value) {
        hostemu::fail("spin-wait on %s counter %lld: it holds %d and the block waits for %d, "
                      "which no earlier block provides (a wait on a later block, or a wrong "
                      "rank)", what, static_cast<long long>(index), got, value);
    }
    if (epoch < hostemu::MAX_EPOCHS) {
        const int early = hostemu::g_adds_in_epoch[epoch].load();
        if (early > 0) {
            hostemu::fail("%d fp32 additions to the dQ of the block's chunk %llu made before its "
                          "wait on %s counter %lld returned (a thread that did not wait for the "
                          "block's turn: a missing barrier after the wait)", early,
                          static_cast<unsigned long long>(epoch), what,
                          static_cast<long long>(index));
        }
    }
    hostemu::g_turn = value;
}

// The release that hands a counter on (bwd_dq_ordered.cuh) follows a fence by each of the
// `fenced_by` threads that add (the whole block, or its consumer warpgroups) and a barrier:
// each must have fenced as often as the others (the others never fence). A release without the
// barrier shows here when another thread has not reached its fence yet (with the turnstile,
// whenever the releasing warp runs first), or at that thread's fence (above). Two releases: a
// store of the next value, or an increment.
inline void check_block_fenced(int fenced_by) {
    const uint64_t fences = g_block_fences.load();
    if (fences % static_cast<uint64_t>(fenced_by) != 0) {
        hostemu::fail("release of a counter after %llu fences of the %d threads that add: some "
                      "thread has not fenced its additions yet (a missing barrier)",
                      static_cast<unsigned long long>(fences), fenced_by);
    }
    g_block_releases.fetch_add(1);
}

inline void store_release_gpu(int* p, int value, int fenced_by) {
    check_block_fenced(fenced_by);
    std::atomic_ref<int>(*p).store(value, std::memory_order_release);
}

inline void release_increment_gpu(int* p, int fenced_by) {
    check_block_fenced(fenced_by);
    std::atomic_ref<int>(*p).fetch_add(1, std::memory_order_release);
}

// A turn passed on by a block that added nothing at the counter (OrderedDq::pass): not a
// release of additions, so neither checked against the fences nor counted as one.
inline void pass_increment_gpu(int* p) {
    std::atomic_ref<int>(*p).fetch_add(1, std::memory_order_release);
}

}  // namespace varlen

// The kernels' `extern __shared__ unsigned char smem_raw[]` becomes a block-scope declaration
// of this function, and each use of smem_raw its result: the block's shared memory.
inline unsigned char (*varlen_emu_smem())[] {
    return reinterpret_cast<unsigned char (*)[]>(hostemu::g_block.smem);
}
#define smem_raw (*varlen_emu_smem())

// ---- PTX primitives, emulated from the PTX ISA description ---------------------------
namespace varlen {

inline uint16_t ld16(const void* p, int elem) { uint16_t v; std::memcpy(&v, (const char*)p + 2 * elem, 2); return v; }

// ldmatrix row addresses and cp.async 16-byte copies must be 16-byte aligned on the GPU.
inline void check_aligned16(const void* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) hostemu::fail("%s address %p is not 16-byte aligned", what, p);
}

// The four 8-address phases of an x4 ldmatrix (lanes 8i .. 8i+7 address matrix i): each must
// hit 8 distinct 16-byte bank groups. Lane 0 counts, for the warp.
inline void count_ldmatrix_banks(hostemu::Warp& w, const hostemu::Exchange& x, int l) {
    if (l != 0) return;
    for (int i = 0; i < 4; ++i) {
        long off[8];
        for (int j = 0; j < 8; ++j) off[j] = hostemu::smem_offset(x.ptr[8 * i + j]);
        const int extra = hostemu::extra_wavefronts(off, 8);
        ++w.ldsm_phases;
        if (extra > 0) {
            w.ldsm_conflicts += extra;
            hostemu::fail("warp %u: ldmatrix matrix %d has a %d-way bank conflict: row offsets "
                      "%ld %ld %ld %ld %ld %ld %ld %ld (16-byte bank groups must differ)",
                      threadIdx.x / 32, i, extra + 1, off[0], off[1], off[2], off[3], off[4],
                      off[5], off[6], off[7]);
        }
    }
}

// ldmatrix.m8n8.x4: lanes 8i..8i+7 address the rows of matrix i; lane l gets, in register
// i, M_i[l/4][2(l%4)] (low 16 bits) and M_i[l/4][2(l%4)+1] (high 16 bits); with .trans
// (`trans`), M_i[2(l%4)][l/4] (low) and M_i[2(l%4)+1][l/4] (high). `site`: the call site of
// the instruction in the kernel, which every lane of the warp must share.
inline void ldmatrix_x4_at(uint32_t (&r)[4], const void* p, bool trans, const void* site) {
    hostemu::Warp& w = hostemu::my_warp(); int l = hostemu::my_lane();
    check_aligned16(p, trans ? "ldmatrix.trans row" : "ldmatrix row");
    hostemu::Exchange& x = hostemu::next_exchange(w);
    x.ptr[l] = p;
    hostemu::meet(w, x, l, trans ? hostemu::K_LDSM_T : hostemu::K_LDSM, site);
    count_ldmatrix_banks(w, x, l);
    for (int i = 0; i < 4; ++i) {
        const void* const* rows = x.ptr + 8 * i;
        r[i] = trans ? ld16(rows[2 * (l % 4)], l / 4) |
                           ((uint32_t)ld16(rows[2 * (l % 4) + 1], l / 4) << 16)
                     : ld16(rows[l / 4], 2 * (l % 4)) |
                           ((uint32_t)ld16(rows[l / 4], 2 * (l % 4) + 1) << 16);
    }
}

__attribute__((noinline)) inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    ldmatrix_x4_at(r, p, false, __builtin_return_address(0));
}

__attribute__((noinline)) inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    ldmatrix_x4_at(r, p, true, __builtin_return_address(0));
}

template <typename T> float to_f(uint16_t bits);
template <> inline float to_f<__half>(uint16_t bits) { return __half2float(__half{bits}); }
template <> inline float to_f<__nv_bfloat16>(uint16_t bits) { return __bfloat162float(__nv_bfloat16{bits}); }

// mma.m16n8k16, fragment ownership from the PTX ISA:
//   A[r][k]: lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2
//   B[k][n]: lane 4 n + (k % 8) / 2, register (k >= 8), half k % 2
//   C[r][n]: lane 4 (r % 8) + (n % 8) / 2, element 2 (r >= 8) + n % 2
template <typename T>
__attribute__((noinline)) void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    hostemu::Warp& w = hostemu::my_warp(); int l = hostemu::my_lane();
    hostemu::Exchange& x = hostemu::next_exchange(w);
    for (int i = 0; i < 4; ++i) x.a[l][i] = a[i];
    x.b[l][0] = b0; x.b[l][1] = b1;
    hostemu::meet(w, x, l, hostemu::K_MMA, __builtin_return_address(0));
    const int g = l / 4, t = l % 4;
    auto half = [](uint32_t reg, int k) {
        return to_f<T>((uint16_t)(k % 2 ? reg >> 16 : reg & 0xffff));
    };
    // This lane's rows g, g + 8 of A and columns 2t, 2t + 1 of B, gathered from their owners.
    float a_row[2][16], b_col[2][16];
    for (int k = 0; k < 16; ++k) {
        for (int h = 0; h < 2; ++h) {
            a_row[h][k] = half(x.a[4 * g + (k % 8) / 2][h + 2 * (k >= 8)], k);
            b_col[h][k] = half(x.b[4 * (2 * t + h) + (k % 8) / 2][k >= 8], k);
        }
    }
    for (int e = 0; e < 4; ++e) d[e] = mma_dot16(d[e], a_row[e / 2], b_col[e % 2]);
}

// cp.async.cg 16 bytes: the destination is poisoned at issue; the copy lands (global read,
// shared write) at issue, at the wait that retires its group, or at random in between.
__attribute__((noinline)) inline void cp_async_16(void* dst, const void* src, bool valid) {
    check_aligned16(dst, "cp.async shared");
    check_aligned16(src, "cp.async global");
    hostemu::ThreadState& s = hostemu::t_state;
    const void* site = __builtin_return_address(0);
    auto it = std::find_if(s.copy_sites.begin(), s.copy_sites.end(),
                           [&](const auto& x) { return x.first == site; });
    if (it == s.copy_sites.end()) it = s.copy_sites.insert(it, {site, 0u});
    s.copies.push_back(hostemu::CopyRecord{site, it->second++, threadIdx.x, hostemu::smem_offset(dst)});
    std::memset(dst, 0xff, 16);
    s.open.push_back(hostemu::AsyncCopy{dst, src, valid, false});
    if (hostemu::g_config.landing == hostemu::LAND_AT_ISSUE) hostemu::land(s.open.back());
}
// cp.async.ca 4 bytes (a float of lse2 or delta): poisoned at issue and landing like the
// 16-byte copy, in the same groups. Consecutive threads write consecutive words, so no bank
// check is recorded for it (the quarter-warp check is about 16-byte copies).
__attribute__((noinline)) inline void cp_async_4(void* dst, const void* src, bool valid) {
    if (reinterpret_cast<uintptr_t>(dst) % 4 != 0 || reinterpret_cast<uintptr_t>(src) % 4 != 0) {
        hostemu::fail("cp.async 4-byte addresses %p, %p are not 4-byte aligned", dst, src);
    }
    hostemu::ThreadState& s = hostemu::t_state;
    std::memset(dst, 0xff, 4);
    s.open.push_back(hostemu::AsyncCopy{dst, src, valid, false, 4});
    if (hostemu::g_config.landing == hostemu::LAND_AT_ISSUE) hostemu::land(s.open.back());
}
inline void cp_async_commit() {
    hostemu::sync_point();
    hostemu::t_state.committed.push_back(std::move(hostemu::t_state.open));
    hostemu::t_state.open.clear();
}
template <int N> inline void cp_async_wait() {
    hostemu::sync_point();
    auto& committed = hostemu::t_state.committed;
    while (committed.size() > static_cast<size_t>(N)) {
        for (hostemu::AsyncCopy& c : committed.front()) hostemu::land(c);
        committed.pop_front();
    }
}

}  // namespace varlen

// ---- launching -----------------------------------------------------------------------
namespace hostemu {

inline void on_segv(int sig, siginfo_t* info, void*) {
    const unsigned char* a = static_cast<const unsigned char*>(info->si_addr);
    const long page = sysconf(_SC_PAGESIZE);
    if (g_block.guard && a >= g_block.guard && a < g_block.guard + page) {
        char msg[512];
        const int n = std::snprintf(msg, sizeof(msg),
            "host emulation: kernel %s, block (%u, %u), thread %u: shared-memory access at "
            "byte %ld, past the %zu bytes the launch requested\n", g_block.kernel, blockIdx.x,
            blockIdx.y, threadIdx.x, (long)(a - g_block.smem), g_block.smem_bytes);
        if (write(2, msg, n) < 0) {}
        _exit(134);
    }
    signal(sig, SIG_DFL);        // any other fault: the default action, at the same access
}

inline void install_segv_handler() {
    static bool done = false;
    if (done) return;
    done = true;
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
}

#if defined(__SANITIZE_THREAD__)
inline void on_sanitizer_death() {
    std::fprintf(stderr, "host emulation: ThreadSanitizer report (above) in kernel %s, block "
                 "(%u, %u)\n", g_block.kernel, blockIdx.x, blockIdx.y);
}
#endif

constexpr unsigned char CANARY = 0xa5;

// The block's shared memory: exactly `bytes` (rounded up to 16), ending at a PROT_NONE page,
// NaN bytes; the rest of the first page before it is a canary.
inline void map_smem(size_t bytes) {
    const size_t page = sysconf(_SC_PAGESIZE);
    const size_t size = (bytes + 15) / 16 * 16;
    const size_t data = (size + page - 1) / page * page;
    void* m = mmap(nullptr, data + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) { std::perror("host emulation: mmap"); std::abort(); }
    g_block.map = static_cast<unsigned char*>(m);
    g_block.map_bytes = data + page;
    g_block.guard = g_block.map + data;
    mprotect(g_block.guard, page, PROT_NONE);
    g_block.smem = g_block.guard - size;
    g_block.smem_bytes = bytes;
    std::memset(g_block.map, CANARY, g_block.smem - g_block.map);
    std::memset(g_block.smem, 0xff, size);         // garbage (NaN) shared memory
}

inline void unmap_smem() {
    for (const unsigned char* p = g_block.map; p < g_block.smem; ++p) {
        if (*p != CANARY) {
            fail("shared memory written at byte %ld, before its start",
                 (long)(p - g_block.smem));
        }
    }
    munmap(g_block.map, g_block.map_bytes);
    g_block.map = g_block.smem = g_block.guard = nullptr;
}

// The cp.async writes of each quarter-warp (8 consecutive lanes) issued by one instruction (call
// site and per-thread ordinal) must hit distinct 16-byte bank groups.
inline void count_copy_banks() {
    std::vector<CopyRecord> all;
    for (auto& v : g_sync.copies) all.insert(all.end(), v.begin(), v.end());
    auto key = [](const CopyRecord& r) {
        return std::make_tuple(r.site, r.ordinal, r.thread / 8);
    };
    std::sort(all.begin(), all.end(), [&](const CopyRecord& x, const CopyRecord& y) {
        return std::make_tuple(key(x), x.thread) < std::make_tuple(key(y), y.thread);
    });
    for (size_t i = 0; i < all.size();) {
        size_t j = i;
        long off[8];
        int n = 0;
        while (j < all.size() && key(all[j]) == key(all[i])) {
            if (n < 8) off[n++] = all[j].offset;
            ++j;
        }
        const int extra = extra_wavefronts(off, n);
        ++g_banks.copy_phases;
        g_banks.copy_conflicts += extra;
        if (extra > 0 && g_config.strict_copy_banks) {
            fail("cp.async writes of threads %u..%u have a %d-way bank conflict (offsets %ld "
                 "%ld ...)", all[i].thread / 8 * 8, all[i].thread / 8 * 8 + 7, extra + 1,
                 off[0], n > 1 ? off[1] : 0L);
        }
        i = j;
    }
}

// What a thread leaves when its kernel body returns: copies in flight land, its lanes leave
// the warp's and block's barriers.
inline void thread_exit() {
    t_in_kernel = false;
    if (g_thread_exit_hook && !g_trapped.load()) g_thread_exit_hook();
    ThreadState& s = t_state;
    for (auto& g : s.committed) for (AsyncCopy& c : g) land(c);
    for (AsyncCopy& c : s.open) land(c);
    s.committed.clear();
    s.open.clear();
    // Marked in the copy of the collective it would meet next, where a neighbour still at
    // that collective looks; the other copy may still be read for the one before.
    Warp& w = my_warp();
    next_exchange(w).tag[my_lane()] = Tag{K_EXITED, nullptr, 0};
    w.bar.arrive_and_drop();
    if (g_sync.turnstile) g_sync.turnstile->done(threadIdx.x / 32, true);
    else g_sync.bar->arrive_and_drop();
    g_sync.copies[threadIdx.x] = std::move(s.copies);
}

inline void thread_start(unsigned t, unsigned bx, unsigned by) {
    threadIdx = dim3e{t, 0, 0};
    blockIdx = dim3e{bx, by, 0};
    ThreadState& s = t_state;
    s.collectives = 0;
    s.fences = 0;
    s.copy_sites.clear();
    s.copies.clear();
    s.rng = splitmix(g_config.seed ^ splitmix(((uint64_t)by << 40) ^ ((uint64_t)bx << 16) ^ t));
    if (g_sync.turnstile) g_sync.turnstile->start(t / 32);
    t_in_kernel = true;
}

}  // namespace hostemu

// Runs `body` as kernel `kernel` on a (gx, gy) grid of `threads`-thread blocks with
// `smem_bytes` of dynamic shared memory: one pool of `threads` OS threads, block after block.
// Returns false if a thread trapped (__trap): the launch stopped after that block.
template <typename F>
bool launch(const char* kernel, unsigned gx, unsigned gy, unsigned threads, size_t smem_bytes,
            F&& body) {
    using namespace hostemu;
    install_segv_handler();
#if defined(__SANITIZE_THREAD__)
    __sanitizer_set_death_callback(on_sanitizer_death);
#endif
    gridDim = dim3e{gx, gy, 1};
    blockDim = dim3e{threads, 1, 1};
    g_block.kernel = kernel;
    g_trapped.store(false);
    Barrier start((int)threads + 1), end((int)threads + 1);
    unsigned bx = 0, by = 0;
    bool done = false;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            for (;;) {
                start.arrive_and_wait();
                if (done) return;
                thread_start(t, bx, by);
                try {
                    body();
                } catch (const Trapped&) {
                }
                thread_exit();
                end.arrive_and_wait();
            }
        });
    }
    for (by = 0; by < gy && !g_trapped.load(); ++by) {
        for (bx = 0; bx < gx && !g_trapped.load(); ++bx) {
            map_smem(smem_bytes);
            g_sync.bar = std::make_unique<Barrier>((int)threads);
            g_sync.warps = std::make_unique<Warp[]>((threads + 31) / 32);
            g_sync.turnstile.reset();
            if (g_config.turnstile) {
                g_sync.turnstile = std::make_unique<Turnstile>(
                    threads, splitmix(g_config.seed ^ (((uint64_t)by << 32) | bx)));
            }
            g_sync.copies.assign(threads, {});
            g_sync.voted.assign(threads, 0);
            for (std::atomic<int>& v : g_sync.votes) v.store(0);
            g_block_fences.store(0);
            g_block_releases.store(0);
            g_block_waits.store(0);
            for (std::atomic<int>& n : g_adds_in_epoch) n.store(0);
            start.arrive_and_wait();
            end.arrive_and_wait();
            for (unsigned w = 0; w < (threads + 31) / 32; ++w) {
                g_banks.ldsm_phases += g_sync.warps[w].ldsm_phases;
                g_banks.ldsm_conflicts += g_sync.warps[w].ldsm_conflicts;
            }
            if (!g_trapped.load()) count_copy_banks();
            unmap_smem();
        }
    }
    done = true;
    start.arrive_and_wait();
    for (auto& th : pool) th.join();
    return !g_trapped.load();
}

// __trap: the message goes to stderr after the kernel's printf output; the thread unwinds and
// the launch ends with an error (launch above).
[[noreturn]] inline void __trap() {
    std::fflush(stdout);
    std::fprintf(stderr, "host emulation: kernel %s, block (%u, %u), thread %u: trap: the "
                 "launch ends with an error, as on a GPU\n", hostemu::g_block.kernel,
                 blockIdx.x, blockIdx.y, threadIdx.x);
    std::fflush(stderr);
    hostemu::g_trapped.store(true);
    throw hostemu::Trapped{};
}
