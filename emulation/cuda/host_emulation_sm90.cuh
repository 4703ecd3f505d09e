// Host emulation of the Hopper primitives of sm90.cuh (included by it under
// VARLEN_HOST_EMULATION, after host_emulation.cuh). docs/hopper.md says what is modelled.
//
//   * mbarrier: each initialised barrier (keyed by its shared-memory offset; its 8 bytes hold a
//     tag that every operation checks, so a store over a live barrier is caught) has an expected
//     arrival count, pending arrivals, a transaction count and a phase; a phase completes when
//     pending arrivals and transaction count are both 0. A wait that has not completed after
//     VARLEN_EMULATION_TIMEOUT seconds (default 60) aborts with the barrier's state. Copies may
//     complete on a barrier only once its initialising thread ran fence.mbarrier_init.
//   * TMA and bulk copies: the destination is poisoned (NaN bytes) at issue; the copy (global
//     read, zero fill outside the tensor, swizzle) and its complete_tx land at issue, at the wait
//     that needs them (once every expected arrival is in: the latest moment), or at random
//     try_waits in between, following the cp.async landing mode (hostemu::Config::landing).
//   * wgmma: a warpgroup instruction (.sync.aligned: each thread waits for its warp only; the
//     four warps must meet the same source line as the same dynamic instance with the same
//     descriptors and flags, checked without making them wait for each other); accumulators
//     are poisoned (NaN) at issue and written when wgmma.wait_group retires their group;
//     shared-memory operands are read at issue or at retirement (landing mode); products
//     follow mma.sync's model (mma_dot16). An mma_async that does not continue a pending one
//     on the same accumulators needs a wgmma.fence since this thread's last wgmma.wait_group,
//     and the register arrays a wgmma accesses (accumulators, A fragment) must hold what this
//     thread's last wgmma.fence or the wgmma ops themselves left there: a write by the thread
//     in between is reported.
//   * memory order: vector clocks per thread, merged through mbarriers, named barriers and
//     __syncthreads (a use of an mbarrier must follow its init in them); the async proxy's
//     view of shared memory, which fence.proxy.async and TMA landings publish to: a wgmma
//     operand must be published and its reader synchronised with a fence after the write, and
//     stmatrix must follow the wgmma reads retired where it writes.
//   * setmaxnreg: a warpgroup instruction as wgmma, otherwise nothing.
//   * stmatrix: a warp collective, the inverse of ldmatrix.
// Warpgroup collectives and mbarrier waits need the free-running schedule: under the turnstile
// (one warp at a time between __syncthreads) they abort with a message.
#pragma once
#include <array>
#include <chrono>
#include <map>
#include <shared_mutex>

#ifndef __grid_constant__
#define __grid_constant__
#endif

namespace hostemu {
namespace sm90 {

using Clock = std::chrono::steady_clock;

inline double timeout_s() {
    static const double t = [] {
        const char* e = std::getenv("VARLEN_EMULATION_TIMEOUT");
        return e && *e ? std::atof(e) : 60.0;
    }();
    return t;
}

// Every TMA load since the last emu_sm90_tma_trace_clear, in issue order: the block, the map's
// global address and the box's coordinates (the tests read the order of a kernel's chunks).
struct TmaRecord { uint64_t bx, by, global; int64_t c[3]; };
inline std::mutex g_tma_trace_m;
inline std::vector<TmaRecord> g_tma_trace;

inline double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The kinds of warpgroup collective.
enum WgKind : int { WG_FENCE = 1, WG_COMMIT, WG_WAIT, WG_MMA, WG_SETMAXNREG, WG_STMATRIX };
inline const char* wg_kind_name(int k) {
    static const char* names[] = {"-", "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group",
                                  "wgmma.mma_async", "setmaxnreg", "stmatrix"};
    return k >= 0 && k <= WG_STMATRIX ? names[k] : "?";
}

// A barrier of n threads whose waiters look around every 20 ms (tick(seconds waited)).
class TimedBarrier {
    std::mutex m_;
    std::condition_variable cv_;
    int expected_, arrived_ = 0;
    uint64_t phase_ = 0;

public:
    explicit TimedBarrier(int n) : expected_(n) {}
    template <typename Tick>
    void arrive_and_wait(Tick&& tick) {
        std::unique_lock lk(m_);
        const uint64_t ph = phase_;
        if (++arrived_ == expected_) {
            arrived_ = 0;
            ++phase_;
            cv_.notify_all();
            return;
        }
        const auto t0 = Clock::now();
        while (!cv_.wait_for(lk, std::chrono::milliseconds(20), [&] { return phase_ != ph; })) {
            if (t_in_kernel && g_trapped.load()) {
                --arrived_;
                throw Trapped{};
            }
            lk.unlock();
            tick(seconds_since(t0));
            lk.lock();
        }
    }
};

// What one thread brings to a collective: where it is (the call's source line: the compiler may
// duplicate a call into branches, which a return address would tell apart) and the values
// that must agree.
struct Site {
    const char* file;
    int line;
    bool operator==(const Site& o) const {
        return line == o.line && (file == o.file || std::strcmp(file, o.file) == 0);
    }
};

struct Slot {
    int kind;
    Site site;
    uint64_t count;
    uint64_t x[4];
    uint32_t a[4];
    const void* ptr;
};

struct Group {
    explicit Group(int n) : bar(n) {}
    TimedBarrier bar;
    Slot slot[128];
};

// A copy in flight towards an mbarrier: lands (writes shared memory) when called.
struct Copy {
    std::function<void()> land;
    uint32_t bytes;
    unsigned char* dst;      // the shared-memory bytes it writes: [dst, dst + span)
    size_t span;
};

struct Mbar {
    unsigned init_thread = 0;  // the thread that initialised it
    bool init_fenced = false;  // that thread has since run fence.mbarrier_init
    uint32_t expected = 0;
    int64_t pending = 0;     // arrivals still missing in the current phase
    int64_t tx = 0;          // transaction bytes still expected in the current phase
    uint64_t phase = 0;      // completed phases
    std::vector<Copy> inflight;
    std::vector<uint32_t> vc;  // what its arrivals knew (vector clock, all phases merged)
    uint32_t init_clock = 0;   // the initialising thread's clock at mbarrier.init
};

// A named barrier (bar.sync / bar.arrive id, threads): the thread count its current phase was
// announced with, the arrivals so far and the completed phases.
struct NamedBar {
    uint32_t threads = 0, arrived = 0;
    uint64_t phase = 0;
    std::vector<bool> in;      // by thread: arrived in the current phase
    std::vector<uint32_t> vc;  // what its arrivals knew (vector clock, all phases merged)
};

// A fence.proxy.async: the thread that ran it and that thread's clock then.
struct ProxyFence {
    uint32_t thread, clock;
};

// The sm_90 state of the block being run, made afresh for each block (keyed by its barrier).
struct BlockState {
    const void* key = nullptr;
    unsigned bx = 0, by = 0;                 // with key: a block's barrier may reuse an address
    std::mutex m;
    std::condition_variable cv;
    std::map<long, Mbar> bars;
    std::map<int, std::unique_ptr<Group>> warps;
    // Warpgroup instructions met by some warps of their warpgroup and not yet by all four:
    // (warpgroup, dynamic instance) -> the first warp's slot and the warps that met it
    std::map<std::pair<unsigned, uint64_t>, std::pair<Slot, unsigned>> aligned;
    // by warpgroup, per warp: 1 + the warpgroup instructions it met before it exited (0: alive)
    std::map<unsigned, std::array<uint64_t, 4>> wg_exits;
    std::map<uint32_t, NamedBar> named;      // bar.sync / bar.arrive by id
    std::vector<uint32_t> sync_vc;           // what the threads knew at __syncthreads
    // Async-proxy view of shared memory (docs/hopper.md, "What the emulation checks"): the
    // bytes as last published to the async proxy (by a fence.proxy.async, a TMA landing, or the
    // launch's 0xff fill), by 16-byte granule the fence that published its generic write
    // (1 + index into fences; 0: written by the async proxy), and every fence run so far.
    std::shared_mutex proxy_m;      // shared: checks; exclusive: publishing
    std::vector<unsigned char> pub;
    std::vector<uint32_t> stamp;
    std::vector<ProxyFence> fences;
    // By granule, the last wgmma operand read retired there: (thread + 1) << 32 | the thread's
    // clock at the retiring wgmma.wait_group (0: none).
    std::unique_ptr<std::atomic<uint64_t>[]> reads;
};

inline std::mutex g_state_m;
inline std::unique_ptr<BlockState> g_state;

inline BlockState& block() {
    std::lock_guard lk(g_state_m);
    const void* key = g_sync.bar.get();
    if (!g_state || g_state->key != key || g_state->bx != blockIdx.x || g_state->by != blockIdx.y) {
        g_state = std::make_unique<BlockState>();
        g_state->key = key;
        g_state->bx = blockIdx.x;
        g_state->by = blockIdx.y;
        const size_t granules = (g_block.smem_bytes + 15) / 16;
        g_state->pub.assign(16 * granules, 0xff);        // map_smem's fill
        g_state->stamp.assign(granules, 0);
        g_state->reads = std::make_unique<std::atomic<uint64_t>[]>(granules);
    }
    return *g_state;
}

// The block's sm_90 state if a thread of this block has made it, else null.
inline BlockState* block_if_started() {
    std::lock_guard lk(g_state_m);
    return g_state && g_state->key == g_sync.bar.get() && g_state->bx == blockIdx.x &&
                   g_state->by == blockIdx.y ? g_state.get() : nullptr;
}

// One wgmma.mma_async in flight: its operands (read at issue or at retirement) and result.
struct WgmmaOp {
    float* d;
    int n;                    // N
    bool bf16, a_in_regs, trans_a, trans_b, scale_d, have_operands = false;
    uint64_t desc_a, desc_b;
    std::shared_ptr<WgmmaOp> prev;       // the pending op whose result is this one's input
    std::vector<float> d_in, result;     // N / 2 each
    float a_rows[2][16];                 // rows 16 w + g and + 8 of A
    std::vector<float> b_cols;           // [N / 4][16]: this thread's columns of B
    Site site{};                         // the call, for reports
};
using OpPtr = std::shared_ptr<WgmmaOp>;

// A register array a wgmma accesses (accumulators, an A fragment), known to this thread from a
// wgmma or wgmma_fence_operand, and its bytes as the thread's last wgmma.fence or the async ops
// since (poisoning at issue, results at retirement) left them. The ISA orders a thread's register
// accesses before a wgmma's access to the same registers only through wgmma.fence (chained ops
// on the same accumulators aside), so bytes that differ at an issue are a write the fence misses.
struct RegArray {
    const void* p;
    size_t bytes;
    std::vector<unsigned char> seen;
};

struct ThreadState {
    const void* key = nullptr;
    unsigned bx = 0, by = 0;
    uint64_t wg_count = 0, warp_count = 0;   // warpgroup and warp collectives met
    std::vector<OpPtr> open;             // issued since the last commit
    std::deque<std::vector<OpPtr>> groups;
    bool fenced = false;
    long wait_bar = -1;                  // the barrier and parity this thread is waiting on
    uint32_t wait_parity = 0;
    Clock::time_point wait_start;
    uint64_t rng = 0;
    // Vector clock: vc[u] is the latest clock of thread u this thread has synchronised with
    // (through an mbarrier, a named barrier or __syncthreads); vc[threadIdx.x] is its own,
    // advanced at each of its arrivals.
    std::vector<uint32_t> vc;
    std::vector<RegArray> regs;          // by (address, size); the oldest dropped past REG_ARRAYS
};
inline thread_local ThreadState t_state;
constexpr size_t REG_ARRAYS = 64;

inline ThreadState& me() {
    ThreadState& t = t_state;
    if (t.key != g_sync.bar.get() || t.bx != blockIdx.x || t.by != blockIdx.y) {
        t = ThreadState{};
        t.key = g_sync.bar.get();
        t.bx = blockIdx.x;
        t.by = blockIdx.y;
        t.vc.assign(g_sync.copies.size(), 0);
        t.vc[threadIdx.x] = 1;
        t.rng = splitmix(g_config.seed ^ 0x5eed90ull ^ splitmix(((uint64_t)blockIdx.y << 40) ^
                                                                 ((uint64_t)blockIdx.x << 16) ^
                                                                 threadIdx.x));
    }
    return t;
}

inline bool coin(ThreadState& t) {
    t.rng = splitmix(t.rng);
    return t.rng & 1;
}

inline size_t block_threads() { return g_sync.copies.size(); }

// Shared-memory offset of p, which must lie in the block's shared memory with `bytes` after it.
inline long smem_check(const void* p, size_t bytes, const char* what) {
    const long off = smem_offset(p);
    if (!in_smem(p, bytes)) {
        fail("%s: shared-memory bytes [%ld, %ld) outside the block's %zu bytes", what, off,
             off + (long)bytes, g_block.smem_bytes);
    }
    return off;
}

// ---- memory order: which thread has synchronised with which -----------------------------
// An arrival (mbarrier arrive, bar.arrive / bar.sync, __syncthreads) merges the thread's vector
// clock into the barrier's and advances the thread's own clock; a completed wait merges the
// barrier's into the thread's. Merging every phase of a barrier into one clock can only make a
// thread know more than it does on the GPU: a missed report, never a false one.
inline void release_into(std::vector<uint32_t>& into) {
    ThreadState& t = me();
    if (into.size() < t.vc.size()) into.resize(t.vc.size(), 0);
    for (size_t u = 0; u < t.vc.size(); ++u) into[u] = std::max(into[u], t.vc[u]);
    ++t.vc[threadIdx.x];
}

inline void acquire_from(const std::vector<uint32_t>& from) {
    ThreadState& t = me();
    for (size_t u = 0; u < from.size() && u < t.vc.size(); ++u) {
        t.vc[u] = std::max(t.vc[u], from[u]);
    }
}

// __syncthreads, entering (leaving = false) and leaving: a barrier of the whole block.
inline void block_barrier(bool leaving) {
    BlockState* b = block_if_started();
    if (!b) return;
    std::lock_guard lk(b->m);
    if (leaving) acquire_from(b->sync_vc);
    else release_into(b->sync_vc);
}
inline const bool g_block_barrier_hooked = (g_block_barrier_hook = block_barrier, true);

// ---- the async proxy's view of shared memory -------------------------------------------
// Generic writes (plain stores, stmatrix) are not intercepted: they show as bytes that differ
// from the async proxy's view `pub`. A fence.proxy.async publishes every such difference (a
// fence covers the generic writes made before it, by whichever thread: the PTX fences are
// cumulative over what the thread has observed, which the emulation cannot tell apart) and
// logs itself; a TMA landing or poisoning publishes its bytes as async-proxy writes. An
// async-proxy read (a wgmma shared-memory operand) is then checked at issue: each byte must be
// published, and if a fence published it, the reading thread must have synchronised with a
// thread that fenced at or after that publication. Off under ThreadSanitizer, where comparing
// bytes another thread writes is a race report of its own.
#if defined(__SANITIZE_THREAD__)
constexpr bool PROXY_CHECKS = false;
#else
constexpr bool PROXY_CHECKS = true;
#endif

// An async-proxy write of [p, p + bytes) (b.m may be held: proxy_m is taken after it).
inline void async_written(BlockState& b, const unsigned char* p, size_t bytes) {
    if (!PROXY_CHECKS || bytes == 0) return;
    const long off = smem_offset(p);
    std::unique_lock lk(b.proxy_m);
    std::memcpy(&b.pub[off], p, bytes);
    for (long g = off / 16; g <= (off + (long)bytes - 1) / 16; ++g) b.stamp[g] = 0;
}

inline void proxy_fence() {
    if (!PROXY_CHECKS) return;
    BlockState& b = block();
    ThreadState& t = me();
    std::unique_lock lk(b.proxy_m);
    b.fences.push_back(ProxyFence{threadIdx.x, t.vc[threadIdx.x]});
    const uint32_t entry = (uint32_t)b.fences.size();
    const unsigned char* s = g_block.smem;
    for (size_t g = 0; g < b.stamp.size(); ++g) {
        if (std::memcmp(s + 16 * g, &b.pub[16 * g], 16) != 0) {
            std::memcpy(&b.pub[16 * g], s + 16 * g, 16);
            b.stamp[g] = entry;
        }
    }
}

// Checks an async-proxy read by this thread of the 2-byte elements at `offs` (shared offsets;
// `what` and `site` name the instruction in the report); `values`: that each byte is published
// too (at issue; at retirement only the fences are checked, as a store that no fence published
// since the issue already shows in the product under the landing modes).
inline void check_async_read(std::vector<long>& offs, const char* what, Site site,
                             bool values = true) {
    if (!PROXY_CHECKS) return;
    BlockState& b = block();
    ThreadState& t = me();
    std::shared_lock lk(b.proxy_m);
    for (long off : offs) {
        if (!values) break;
        if (off < 0 || static_cast<size_t>(off) + 2 > g_block.smem_bytes) continue;
        if (std::memcmp(g_block.smem + off, &b.pub[off], 2) != 0) {
            fail("%s (%s:%d) reads shared offset %ld through the async proxy, and a generic-proxy "
                 "write there (a plain store or stmatrix) is not yet followed by "
                 "fence.proxy.async: the async proxy may not see it", what, site.file,
                 site.line, off);
        }
    }
    for (long& off : offs) off /= 16;
    std::sort(offs.begin(), offs.end());
    offs.erase(std::unique(offs.begin(), offs.end()), offs.end());
    for (long g : offs) {
        if (g < 0 || static_cast<size_t>(g) >= b.stamp.size() || b.stamp[g] == 0) continue;
        bool ordered = false;
        for (size_t e = b.stamp[g] - 1; e < b.fences.size() && !ordered; ++e) {
            ordered = t.vc[b.fences[e].thread] >= b.fences[e].clock;
        }
        if (!ordered) {
            const ProxyFence& f = b.fences[b.stamp[g] - 1];
            fail("%s (%s:%d) reads shared offset %ld through the async proxy: a generic-proxy "
                 "write there was published by the fence.proxy.async of thread %u (clock %u), "
                 "and this thread has not synchronised with it or with any later fence since "
                 "(a missing mbarrier wait or barrier between the fence and the read)", what,
                 site.file, site.line, g * 16, f.thread, f.clock);
        }
    }
}

// Records the retirement of this thread's async-proxy reads of the 2-byte elements at `offs`.
inline void async_read_retired(std::vector<long>& offs) {
    if (!PROXY_CHECKS) return;
    BlockState& b = block();
    const uint64_t rec = (uint64_t)(threadIdx.x + 1) << 32 | me().vc[threadIdx.x];
    for (long& off : offs) off /= 16;
    std::sort(offs.begin(), offs.end());
    offs.erase(std::unique(offs.begin(), offs.end()), offs.end());
    for (long g : offs) {
        if (g >= 0 && static_cast<size_t>(g) < b.stamp.size()) {
            b.reads[g].store(rec, std::memory_order_relaxed);
        }
    }
}

// A generic write by this thread (stmatrix: the one intercepted) of the granule at shared
// offset `off` must come after the async-proxy reads retired there: this thread must have
// synchronised with their thread since.
inline void check_generic_write(long off, const char* what, Site site) {
    if (!PROXY_CHECKS || off < 0 || static_cast<size_t>(off / 16) >= block().stamp.size()) return;
    const uint64_t rec = block().reads[off / 16].load(std::memory_order_relaxed);
    const uint32_t reader = (uint32_t)(rec >> 32), clock = (uint32_t)rec;
    if (reader != 0 && reader - 1 != threadIdx.x && me().vc[reader - 1] < clock) {
        fail("%s (%s:%d) writes shared offset %ld, which a wgmma.mma_async of thread %u read "
             "(retired at that thread's clock %u), and this thread has not synchronised with "
             "thread %u since (a missing barrier between the read and the write)", what,
             site.file, site.line, off, reader - 1, clock, reader - 1);
    }
}

// ---- collectives -----------------------------------------------------------------------
// Whether thread t of the block has left its kernel (read only where TSan does not watch: the
// exit writes the tag unsynchronised).
inline bool exited(unsigned t) {
    const Warp& w = g_sync.warps[t / 32];
    return w.x[0].tag[t % 32].kind == K_EXITED || w.x[1].tag[t % 32].kind == K_EXITED;
}

// A warpgroup instruction (wgmma.*, setmaxnreg: .sync.aligned): .sync makes a thread wait for
// the other threads of its warp only, and .aligned requires the four warps of the warpgroup to
// execute the same instruction, which nothing makes them do at the same time. So lane 0 of
// each warp checks it without waiting: the first warp to meet dynamic instance k records it,
// the others compare with the record, the fourth drops it; a warp that exits with instances
// some other warp met still ahead of it is reported at its exit (on_thread_exit), one that
// exited before another warp met an instance it had not is reported then.
// A warp that exited without executing the warpgroup instruction `s` that warp `other` did.
[[noreturn]] inline void fail_skipped(const Slot& s, unsigned skipped, unsigned other) {
    fail("%s #%llu (%s:%d): warp %u of the warpgroup exited without executing it, which warp %u "
         "did (a warpgroup instruction must be executed by all four warps)", wg_kind_name(s.kind),
         (unsigned long long)s.count, s.site.file, s.site.line, skipped, other);
}

inline void check_aligned(BlockState& b, const Slot& s, const char* what) {
    const unsigned wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4;
    std::lock_guard lk(b.m);
    auto [it, fresh] = b.aligned.try_emplace({wg, s.count}, s, 0u);
    auto& [o, warps] = it->second;
    if (!fresh) {
        const unsigned ow = (unsigned)__builtin_ctz(warps);
        if (o.kind != s.kind || !(o.site == s.site)) {
            fail("warps %u and %u disagree at a warpgroup collective: warp %u at %s #%llu "
                 "(%s:%d), warp %u at %s #%llu (%s:%d)", warp, ow, warp, what,
                 (unsigned long long)s.count, s.site.file, s.site.line, ow,
                 wg_kind_name(o.kind), (unsigned long long)o.count, o.site.file, o.site.line);
        }
        for (int k = 0; k < 4; ++k) {
            if (o.x[k] != s.x[k]) {
                fail("%s: warps %u and %u pass different operands (#%d: 0x%llx and 0x%llx); "
                     "they must be uniform over the warpgroup", what, warp, ow, k,
                     (unsigned long long)s.x[k], (unsigned long long)o.x[k]);
            }
        }
    }
    warps |= 1u << warp;
    const std::array<uint64_t, 4>& exits = b.wg_exits[wg];
    for (unsigned w = 0; w < 4; ++w) {
        if (exits[w] != 0 && exits[w] - 1 < s.count) fail_skipped(s, w, warp);
    }
    if (warps == 0xfu) b.aligned.erase(it);
}

// Prologue of a collective of `n` threads (128: a warpgroup instruction, 32: a warp one) of
// thread threadIdx.x / n * n on: publish this thread's slot, wait for the other threads of the
// warp, compare with the next thread's slot (and, for a warpgroup instruction, the warp's with
// the other warps', check_aligned). The caller reads the slots of its warp, then calls leave().
inline Group& enter(int n, Slot s) {
    const unsigned wg_first = threadIdx.x / n * n;
    const char* what = wg_kind_name(s.kind);
    if (n == 128 && g_sync.turnstile) {
        fail("%s under the one-warp-at-a-time schedule: warpgroup collectives and mbarrier "
             "waits need the free-running one (no VARLEN_EMULATION_SCHEDULE without --race)", what);
    }
    if (wg_first + n > block_threads()) {
        fail("%s needs threads %u..%u, the block has %zu", what, wg_first, wg_first + n - 1,
             block_threads());
    }
    constexpr unsigned W = 32;
    const unsigned first = threadIdx.x / W * W;
    sync_point();
    BlockState& b = block();
    Group* g;
    {
        std::lock_guard lk(b.m);
        auto& p = b.warps[first / W];
        if (!p) p = std::make_unique<Group>(W);
        g = p.get();
    }
    ThreadState& t = me();
    s.count = n == 128 ? ++t.wg_count : ++t.warp_count;
    const unsigned i = threadIdx.x - first;
    g->slot[i] = s;
    g->bar.arrive_and_wait([&](double waited) {
#if !defined(__SANITIZE_THREAD__)
        for (unsigned u = first; u < first + W; ++u) {
            if (exited(u)) fail("%s: thread %u of the warp has exited", what, u);
        }
#endif
        if (waited > timeout_s()) {
            fail("%s (%s:%d): not all %u threads of the warp starting at thread %u arrived "
                 "within %.0f s", what, s.site.file, s.site.line, W, first, timeout_s());
        }
    });
    const Slot& o = g->slot[(i + 1) % W];
    if (o.kind != s.kind || !(o.site == s.site) || o.count != s.count) {
        fail("threads %u and %u disagree at a %s collective: thread %u at %s #%llu (%s:%d), "
             "thread %u at %s #%llu (%s:%d)", threadIdx.x, first + (i + 1) % W,
             n == 128 ? "warpgroup" : "warp", threadIdx.x, what, (unsigned long long)s.count,
             s.site.file, s.site.line, first + (i + 1) % W, wg_kind_name(o.kind),
             (unsigned long long)o.count, o.site.file, o.site.line);
    }
    for (int k = 0; k < 4; ++k) {
        if (o.x[k] != s.x[k]) {
            fail("%s: threads %u and %u pass different operands (#%d: 0x%llx and 0x%llx); they "
                 "must be uniform over the %s", what, threadIdx.x, first + (i + 1) % W, k,
                 (unsigned long long)s.x[k], (unsigned long long)o.x[k],
                 n == 128 ? "warpgroup" : "warp");
        }
    }
    if (n == 128 && i == 0) check_aligned(b, s, what);
    return *g;
}

// At a thread's exit (lane 0 for its warp): no warpgroup instruction another warp of its
// warpgroup met may lie ahead of this warp.
inline void on_thread_exit() {
    if (threadIdx.x % 32 != 0) return;
    BlockState* b = block_if_started();
    if (!b) return;
    const uint64_t met = me().wg_count;
    const unsigned wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4;
    std::lock_guard lk(b->m);
    b->wg_exits[wg][warp] = met + 1;
    for (const auto& [key, rec] : b->aligned) {
        if (key.first == wg && key.second > met && !(rec.second >> warp & 1u)) {
            fail_skipped(rec.first, warp, (unsigned)__builtin_ctz(rec.second));
        }
    }
}
inline const bool g_thread_exit_hooked = (g_thread_exit_hook = on_thread_exit, true);

inline void leave(Group& g) {
    g.bar.arrive_and_wait([&](double waited) {
        if (waited > timeout_s()) fail("collective epilogue: a thread did not arrive");
    });
}

// ---- mbarrier ----------------------------------------------------------------------------
constexpr uint64_t MBAR_TAG = 0x6d62617232303930ull;     // marks a live barrier's 8 bytes

inline Mbar& mbar_of(BlockState& b, const void* bar, const char* what) {
    const long off = smem_check(bar, 8, what);
    if (off % 8 != 0) fail("%s: mbarrier at shared offset %ld is not 8-byte aligned", what, off);
    auto it = b.bars.find(off);
    if (it == b.bars.end()) fail("%s: no mbarrier initialised at shared offset %ld", what, off);
    // Another thread may use it once it has synchronised with the init (__syncthreads).
    const unsigned init = it->second.init_thread;
    if (init != threadIdx.x && me().vc[init] < it->second.init_clock) {
        fail("%s: the mbarrier at shared offset %ld was initialised by thread %u, and this "
             "thread has not synchronised with that thread since (a missing __syncthreads "
             "between mbarrier.init and its use)", what, off, init);
    }
    uint64_t tag;
    std::memcpy(&tag, bar, 8);
    if (tag != (MBAR_TAG ^ (uint64_t)off)) {
        fail("%s: the mbarrier at shared offset %ld was overwritten (its 8 bytes hold 0x%llx)",
             what, off, (unsigned long long)tag);
    }
    return it->second;
}

// Completes the current phase once nothing is pending (b.m held).
inline void maybe_complete(BlockState& b, Mbar& m) {
    if (m.pending == 0 && m.tx == 0) {
        ++m.phase;
        m.pending = m.expected;
        b.cv.notify_all();
    }
}

inline void complete_tx(BlockState& b, Mbar& m, uint32_t bytes) {
    m.tx -= bytes;
    maybe_complete(b, m);
}

inline void arrive(BlockState& b, Mbar& m, long off, const char* what) {
    if (m.pending == 0) {
        fail("%s: mbarrier at shared offset %ld has no arrival pending (all %u arrived; the "
             "phase waits for %lld transaction bytes)", what, off, m.expected, (long long)m.tx);
    }
    --m.pending;
    release_into(m.vc);
    maybe_complete(b, m);
}

// Lands the copies in flight towards m: all of them, or each with probability 1/2.
inline void land_copies(BlockState& b, Mbar& m, bool all, ThreadState& t) {
    std::vector<Copy> keep;
    std::vector<Copy> todo = std::move(m.inflight);
    m.inflight.clear();
    for (Copy& c : todo) {
        if (all || coin(t)) {
            c.land();
            async_written(b, c.dst, c.span);
            complete_tx(b, m, c.bytes);
        } else {
            keep.push_back(std::move(c));
        }
    }
    for (Copy& c : keep) m.inflight.push_back(std::move(c));
}

// A copy towards barrier `bar`: poisons [dst, dst + poison_bytes), then lands it now or later.
inline void issue_copy(void* bar, unsigned char* dst, size_t poison_bytes, Copy c,
                       const char* what) {
    BlockState& b = block();
    ThreadState& t = me();
    std::lock_guard lk(b.m);
    c.dst = dst;
    c.span = poison_bytes;
    Mbar& m = mbar_of(b, bar, what);
    if (!m.init_fenced) {
        fail("%s completes on the mbarrier at shared offset %ld, whose mbarrier.init was not "
             "followed by fence.mbarrier_init (the async proxy may not see it)", what,
             smem_offset(bar));
    }
    const int mode = g_config.landing;
    if (mode == LAND_AT_ISSUE || (mode == LAND_RANDOM && coin(t))) {
        c.land();
        async_written(b, c.dst, c.span);
        complete_tx(b, m, c.bytes);
    } else {
        std::memset(dst, 0xff, poison_bytes);
        async_written(b, dst, poison_bytes);
        m.inflight.push_back(std::move(c));
    }
}

// ---- wgmma operands ------------------------------------------------------------------------
// Shared-memory offset of element (mn, k) of the 16-bit operand a descriptor describes,
// MN-major or K-major (layouts: sm90.cuh).
inline long desc_element(uint64_t desc, bool mn_major, int mn, int k) {
    const long start = (long)(desc & 0x3FFF) << 4;
    const long lbo = (long)((desc >> 16) & 0x3FFF) << 4;
    const long sbo = (long)((desc >> 32) & 0x3FFF) << 4;
    const int field = (int)(desc >> 62);
    const long S = field == 0 ? 0 : 256 >> field;       // 1: 128, 2: 64, 3: 32 bytes
    long a;
    if (!mn_major && S == 0) {
        a = start + 16 * (mn % 8) + sbo * (mn / 8) + lbo * (k / 8) + 2 * (k % 8);
    } else if (!mn_major) {
        a = start + S * (mn % 8) + sbo * (mn / 8) + 2 * k;
    } else if (S == 0) {
        a = start + 2 * (mn % 8) + sbo * (mn / 8) + 16 * (k % 8) + lbo * (k / 8);
    } else {
        a = start + 2 * (mn % (S / 2)) + lbo * (mn / (S / 2)) + S * (k % 8) + sbo * (k / 8);
    }
    if (S != 0) {
        const int bits = S == 128 ? 3 : S == 64 ? 2 : 1;
        a ^= ((a >> 7) & ((1 << bits) - 1)) << 4;
    }
    return a;
}

inline void check_desc(uint64_t desc, const char* which) {
    if ((desc >> 49) & 7) {
        fail("wgmma: descriptor of %s 0x%016llx has a nonzero base offset (not modelled: start "
             "swizzled tiles on the pattern's repeat, 1024/512/256 bytes)", which,
             (unsigned long long)desc);
    }
}

inline float smem_half(long off, bool bf16, const char* which) {
    if (off < 0 || static_cast<size_t>(off) + 2 > g_block.smem_bytes) {
        fail("wgmma: %s element at shared offset %ld, outside the block's %zu bytes", which, off,
             g_block.smem_bytes);
    }
    uint16_t bits;
    std::memcpy(&bits, g_block.smem + off, 2);
    return bf16 ? varlen::to_f<__nv_bfloat16>(bits) : varlen::to_f<__half>(bits);
}

// Calls f(a, i, offset) for each shared-memory element of this thread's rows of A (a true;
// i = 16 h + k for row 16 w + g + 8 h) and columns of B (a false; i = 16 c + k).
template <typename F>
void visit_operands(const WgmmaOp& op, F&& f) {
    const unsigned t = threadIdx.x % 128, w = t / 32, l = t % 32, g = l / 4, q = l % 4;
    if (!op.a_in_regs) {
        for (int h = 0; h < 2; ++h) {
            for (int k = 0; k < 16; ++k) {
                f(true, 16 * h + k, desc_element(op.desc_a, op.trans_a, 16 * w + g + 8 * h, k));
            }
        }
    }
    for (int c = 0; c < op.n / 4; ++c) {
        const int col = 8 * (c / 2) + 2 * q + c % 2;
        for (int k = 0; k < 16; ++k) {
            f(false, 16 * c + k, desc_element(op.desc_b, op.trans_b, col, k));
        }
    }
}

// This thread's rows of A (from shared memory) and columns of B: read at issue or retirement.
inline void read_operands(WgmmaOp& op) {
    op.b_cols.resize((size_t)op.n / 4 * 16);
    visit_operands(op, [&](bool a, int i, long off) {
        const float x = smem_half(off, op.bf16, a ? "A" : "B");
        if (a) op.a_rows[i / 16][i % 16] = x;
        else op.b_cols[(size_t)i] = x;
    });
    op.have_operands = true;
}

// Computes a retiring op and writes its accumulators (in issue order: prev is done).
inline void retire(WgmmaOp& op) {
    if (!op.have_operands) read_operands(op);
    const std::vector<float>& in = op.prev ? op.prev->result : op.d_in;
    op.result.resize((size_t)op.n / 2);
    for (int i = 0; i < op.n / 2; ++i) {
        const float c = op.scale_d ? in[i] : 0.f;
        const int row = (i / 2) % 2, col = 2 * (i / 4) + i % 2;
        float b[16];
        std::memcpy(b, &op.b_cols[(size_t)col * 16], sizeof(b));
        op.result[i] = varlen::mma_dot16(c, op.a_rows[row], b);
    }
    std::memcpy(op.d, op.result.data(), sizeof(float) * op.n / 2);
}

constexpr uint32_t ACC_POISON = 0x7fc0deadu;    // a NaN: accumulators of a wgmma in flight

inline RegArray* find_regs(ThreadState& t, const void* p, size_t bytes) {
    for (RegArray& r : t.regs) {
        if (r.p == p && r.bytes == bytes) return &r;
    }
    return nullptr;
}

// Records the bytes of [p, p + bytes) as the async ops or a fence leave them (`update`), or
// only makes the array known with its present bytes if it is not yet (`update` false).
inline void note_regs(ThreadState& t, const void* p, size_t bytes, bool update = true) {
    RegArray* r = find_regs(t, p, bytes);
    if (r && !update) return;
    if (!r) {
        // another array at the same address (a frame reused) replaces the old one
        std::erase_if(t.regs, [p](const RegArray& old) { return old.p == p; });
        if (t.regs.size() >= REG_ARRAYS) t.regs.erase(t.regs.begin());
        t.regs.push_back(RegArray{p, bytes, {}});
        r = &t.regs.back();
    }
    const unsigned char* b = static_cast<const unsigned char*>(p);
    r->seen.assign(b, b + bytes);
}

// At a wgmma's issue: the bytes of its registers [p, p + bytes) must be those recorded.
inline void check_regs(ThreadState& t, const void* p, size_t bytes, const char* what,
                       const Site& site) {
    const RegArray* r = find_regs(t, p, bytes);
    if (r && std::memcmp(p, r->seen.data(), bytes) != 0) {
        fail("wgmma.mma_async (%s:%d): its %s were written by this thread after its last "
             "wgmma.fence (the ISA orders a register write before a wgmma's access to the same "
             "registers only through wgmma.fence)", site.file, site.line, what);
    }
}

inline void issue_wgmma(float* d, int n, bool bf16, const uint32_t* a, uint64_t desc_a,
                        bool trans_a, uint64_t desc_b, bool trans_b, bool scale_d, Site site) {
    ThreadState& t = me();
    if (!a) check_desc(desc_a, "A");
    check_desc(desc_b, "B");
    Slot s{WG_MMA, site, 0, {desc_a, desc_b, (uint64_t)(n | bf16 << 10 | trans_a << 11 |
                                                        trans_b << 12 | scale_d << 13 |
                                                        (a != nullptr) << 14), 0}, {}, d};
    if (a) std::memcpy(s.a, a, sizeof(s.a));
    Group& g = enter(128, s);
    auto op = std::make_shared<WgmmaOp>();
    *op = WgmmaOp{d, n, bf16, a != nullptr, trans_a, trans_b, scale_d, false, desc_a, desc_b,
                  nullptr, {}, {}, {}, {}};
    if (a) {
        // Rows 16 w + g (+ 8) of A from the fragments of this warp's lanes 4 g .. 4 g + 3 (the
        // group's slots are this warp's: each warp's rows of A are its own lanes')
        const unsigned gq = threadIdx.x % 32 / 4;
        for (int h = 0; h < 2; ++h) {
            for (int k = 0; k < 16; ++k) {
                const uint32_t reg = g.slot[4 * gq + (k % 8) / 2].a[h + 2 * (k / 8)];
                const uint16_t bits = (uint16_t)(k % 2 ? reg >> 16 : reg & 0xffff);
                op->a_rows[h][k] = bf16 ? varlen::to_f<__nv_bfloat16>(bits)
                                        : varlen::to_f<__half>(bits);
            }
        }
    }
    leave(g);
    // Accumulators of a pending op on the same registers: this op continues it.
    for (auto it = t.open.rbegin(); it != t.open.rend() && !op->prev; ++it) {
        if ((*it)->d == d) op->prev = *it;
    }
    for (auto it = t.groups.rbegin(); it != t.groups.rend() && !op->prev; ++it) {
        for (auto jt = it->rbegin(); jt != it->rend() && !op->prev; ++jt) {
            if ((*jt)->d == d) op->prev = *jt;
        }
    }
    if (op->prev && op->prev->n != n) {
        fail("wgmma.mma_async: accumulators in flight for an N=%d op reused by an N=%d op",
             op->prev->n, n);
    }
    if (!op->prev) {
        if (!t.fenced) {
            fail("wgmma.mma_async (%s:%d) without a wgmma.fence since this thread's last "
                 "wgmma.wait_group: its accumulators or A fragment were accessed by the thread",
                 site.file, site.line);
        }
        op->d_in.assign(d, d + n / 2);
    }
    check_regs(t, d, sizeof(float) * n / 2, "accumulators", site);
    if (a) {
        check_regs(t, a, sizeof(uint32_t) * 4, "A fragment registers", site);
        note_regs(t, a, sizeof(uint32_t) * 4);
    }
    // The async proxy may read the operands from the issue on: they must be visible to it now.
    op->site = site;
    std::vector<long> offs;
    visit_operands(*op, [&](bool, int, long off) { offs.push_back(off); });
    check_async_read(offs, "wgmma.mma_async", site);
    const int mode = g_config.landing;
    if (mode == LAND_AT_ISSUE || (mode == LAND_RANDOM && coin(t))) read_operands(*op);
    const float poison = __int_as_float(ACC_POISON);
    for (int i = 0; i < n / 2; ++i) d[i] = poison;
    note_regs(t, d, sizeof(float) * n / 2);
    t.open.push_back(std::move(op));
}

}  // namespace sm90
}  // namespace hostemu

// ---- the primitives, as sm90.cuh declares them --------------------------------------------
namespace varlen {
namespace sm90 {

// The emulated tensor map (CUtensorMap's 128 bytes): what cuTensorMapEncodeTiled is given.
// Passed by value; GCC notes that 64-byte aligned parameters changed ABI in GCC 4.6.
#pragma GCC diagnostic ignored "-Wpsabi"
struct alignas(64) TensorMap {
    uint64_t tag;             // TENSOR_MAP_TAG when made by make_tensor_map
    const void* global;       // element (0, 0, 0)
    uint64_t dims[3];         // elements, innermost first (unused dimensions 1)
    uint64_t strides[2];      // bytes between consecutive indices of dimensions 1 and 2
    uint32_t box[3];          // box elements per dimension (unused dimensions 1)
    uint32_t rank;            // 2 or 3
    uint32_t elem_bytes;      // 1, 2, 4 or 8
    uint32_t swizzle;         // Swizzle
    uint32_t nan_fill;        // out-of-bounds elements NaN (FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
    unsigned char reserved[44];
};
static_assert(sizeof(TensorMap) == 128, "a tensor map is CUtensorMap's 128 bytes");
constexpr uint64_t TENSOR_MAP_TAG = 0x746d61703930ull;

// A tensor map as cuTensorMapEncodeTiled would make it (elementStrides 1, no interleave);
// aborts on a map the driver would refuse or the emulation does not model.
inline TensorMap make_tensor_map(const void* global, int rank, int elem_bytes,
                                 const uint64_t* dims, const uint64_t* strides,
                                 const uint32_t* box, Swizzle swizzle, bool nan_fill = false) {
    auto bad = [](const char* why) {
        std::fprintf(stderr, "host emulation: make_tensor_map: %s\n", why);
        std::abort();
    };
    if (rank < 2 || rank > 3) bad("rank must be 2 or 3");
    if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4 && elem_bytes != 8) {
        bad("element size must be 1, 2, 4 or 8 bytes");
    }
    if (reinterpret_cast<uintptr_t>(global) % 16) bad("global address not 16-byte aligned");
    TensorMap m{};
    m.tag = TENSOR_MAP_TAG;
    m.global = global;
    m.rank = rank;
    m.elem_bytes = elem_bytes;
    m.swizzle = static_cast<uint32_t>(swizzle);
    m.nan_fill = nan_fill;
    for (int i = 0; i < 3; ++i) {
        m.dims[i] = i < rank ? dims[i] : 1;
        m.box[i] = i < rank ? box[i] : 1;
        if (m.box[i] < 1 || m.box[i] > 256) bad("box dimensions must be 1..256");
    }
    for (int i = 0; i < 2; ++i) {
        m.strides[i] = i + 1 < rank ? strides[i] : m.strides[0] * m.dims[1];
        if (i + 1 < rank && strides[i] % 16) bad("global strides must be multiples of 16 bytes");
    }
    const uint32_t row = m.box[0] * elem_bytes;
    if (row % 16) bad("the box's inner dimension must be a multiple of 16 bytes");
    if (swizzle != Swizzle::NONE && row != swizzle_bytes(swizzle)) {
        bad("a swizzled box's inner dimension must span exactly the swizzle width (other "
            "widths are not modelled)");
    }
    return m;
}

inline uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(hostemu::sm90::smem_check(p, 0, "shared address"));
}

// ---- mbarrier --------------------------------------------------------------------------
inline void mbar_init(u64* bar, uint32_t count) {
    using namespace hostemu::sm90;
    hostemu::sync_point();
    BlockState& b = block();
    std::lock_guard lk(b.m);
    const long off = smem_check(bar, 8, "mbarrier.init");
    if (off % 8) hostemu::fail("mbarrier.init: shared offset %ld is not 8-byte aligned", off);
    if (count < 1 || count > (1u << 20) - 1) hostemu::fail("mbarrier.init: count %u", count);
    b.bars[off] = Mbar{threadIdx.x, false, count, count, 0, 0, {}, {}, me().vc[threadIdx.x]};
    const uint64_t tag = MBAR_TAG ^ (uint64_t)off;
    std::memcpy(bar, &tag, 8);
}

inline void mbar_inval(u64* bar) {
    using namespace hostemu::sm90;
    BlockState& b = block();
    std::lock_guard lk(b.m);
    Mbar& m = mbar_of(b, bar, "mbarrier.inval");
    if (!m.inflight.empty()) hostemu::fail("mbarrier.inval with copies in flight towards it");
    b.bars.erase(hostemu::smem_offset(bar));
    std::memset(bar, 0, 8);
}

inline void mbar_arrive(u64* bar) {
    using namespace hostemu::sm90;
    hostemu::sync_point();
    BlockState& b = block();
    std::lock_guard lk(b.m);
    arrive(b, mbar_of(b, bar, "mbarrier.arrive"), hostemu::smem_offset(bar), "mbarrier.arrive");
}

inline void mbar_arrive_expect_tx(u64* bar, uint32_t bytes) {
    using namespace hostemu::sm90;
    hostemu::sync_point();
    BlockState& b = block();
    std::lock_guard lk(b.m);
    Mbar& m = mbar_of(b, bar, "mbarrier.arrive.expect_tx");
    if (bytes > (1u << 20) - 1) hostemu::fail("mbarrier.expect_tx: %u bytes", bytes);
    m.tx += bytes;
    arrive(b, m, hostemu::smem_offset(bar), "mbarrier.arrive.expect_tx");
}

inline bool mbar_try_wait(u64* bar, uint32_t parity) {
    using namespace hostemu::sm90;
    hostemu::sync_point();
    BlockState& b = block();
    ThreadState& t = me();
    const long off = hostemu::smem_offset(bar);
    hostemu::stop_if_trapped();
    std::unique_lock lk(b.m);
    auto done = [&] {
        Mbar& m = mbar_of(b, bar, "mbarrier.try_wait");
        // Every expected arrival is in: the copies must land now (the latest moment); before
        // that, with random landing, each lands with probability 1/2.
        if (m.pending == 0) land_copies(b, m, true, t);
        else if (hostemu::g_config.landing == hostemu::LAND_RANDOM) land_copies(b, m, false, t);
        return (m.phase & 1) != (parity & 1);
    };
    if (done()) {
        acquire_from(b.bars[off].vc);
        t.wait_bar = -1;
        return true;
    }
    if (hostemu::g_sync.turnstile) {
        hostemu::fail("mbarrier.try_wait would block under the one-warp-at-a-time schedule "
                      "(mbarrier waits need the free-running one)");
    }
    // The hardware suspends the thread a while before answering false.
    b.cv.wait_for(lk, std::chrono::milliseconds(2));
    if (done()) {
        acquire_from(b.bars[off].vc);
        t.wait_bar = -1;
        return true;
    }
    if (t.wait_bar != off || t.wait_parity != parity) {
        t.wait_bar = off;
        t.wait_parity = parity;
        t.wait_start = Clock::now();
    } else if (seconds_since(t.wait_start) > timeout_s()) {
        const Mbar& m = b.bars[off];
        hostemu::fail("mbarrier at shared offset %ld: the phase of parity %u has not completed "
                      "within %.0f s (a deadlock?): %llu phases completed, %lld of %u arrivals "
                      "pending, %lld transaction bytes expected, %zu copies in flight", off,
                      parity & 1, timeout_s(), (unsigned long long)m.phase,
                      (long long)m.pending, m.expected, (long long)m.tx, m.inflight.size());
    }
    return false;
}

// ---- named barriers -----------------------------------------------------------------
// bar.sync / bar.arrive `id` (1..15; 0 is __syncthreads') of `threads` threads, a multiple of
// 32: every arrival of a phase must announce the same count; bar.sync waits for the phase to
// complete, bar.arrive does not. A phase that does not complete within the timeout is
// reported, as are a thread arriving twice in one phase and a named barrier under the
// one-warp-at-a-time schedule.
inline void named_barrier(uint32_t id, uint32_t threads, bool wait, const char* what) {
    using namespace hostemu::sm90;
    hostemu::sync_point();
    if (id < 1 || id > 15) {
        hostemu::fail("%s: barrier id %u (1..15; 0 is __syncthreads')", what, id);
    }
    if (threads == 0 || threads % 32 || threads > blockDim.x) {
        hostemu::fail("%s %u: %u threads (a multiple of 32, at most the block's %u)", what, id,
                      threads, blockDim.x);
    }
    if (wait && hostemu::g_sync.turnstile) {
        hostemu::fail("%s %u would block under the one-warp-at-a-time schedule (named "
                      "barriers need the free-running one)", what, id);
    }
    BlockState& b = block();
    std::unique_lock lk(b.m);
    NamedBar& n = b.named[id];
    if (n.arrived == 0) {
        n.threads = threads;
    } else if (n.threads != threads) {
        hostemu::fail("%s %u: thread %u announces %u threads, the phase began with %u", what,
                      id, threadIdx.x, threads, n.threads);
    }
    // A thread counted twice in one phase (bar.arrive again before the phase completed) would
    // complete it early on the GPU: the other side's bar.sync is missing or misplaced.
    if (n.in.size() < blockDim.x) n.in.resize(blockDim.x, false);
    if (n.in[threadIdx.x]) {
        hostemu::fail("%s %u: thread %u arrives twice in one phase (%u of %u threads in): a "
                      "bar.sync missing on the other side?", what, id, threadIdx.x, n.arrived,
                      n.threads);
    }
    n.in[threadIdx.x] = true;
    release_into(n.vc);
    const uint64_t phase = n.phase;
    if (++n.arrived == n.threads) {
        n.arrived = 0;
        std::fill(n.in.begin(), n.in.end(), false);
        ++n.phase;
        b.cv.notify_all();
        if (wait) acquire_from(n.vc);
        return;
    }
    if (!wait) return;
    const auto t0 = Clock::now();
    while (!b.cv.wait_for(lk, std::chrono::milliseconds(20),
                          [&] { return b.named[id].phase != phase; })) {
        hostemu::stop_if_trapped();
        if (seconds_since(t0) > timeout_s()) {
            hostemu::fail("%s %u: %u of %u threads arrived within %.0f s (a deadlock?)", what,
                          id, b.named[id].arrived, b.named[id].threads, timeout_s());
        }
    }
    acquire_from(b.named[id].vc);
}

inline void named_bar_sync(uint32_t id, uint32_t threads) {
    named_barrier(id, threads, true, "bar.sync");
}

inline void named_bar_arrive(uint32_t id, uint32_t threads) {
    named_barrier(id, threads, false, "bar.arrive");
}

// Publishes this thread's initialised barriers (to the async proxy: TMA may complete on them).
inline void fence_barrier_init() {
    using namespace hostemu::sm90;
    hostemu::sync_point();
    BlockState& b = block();
    std::lock_guard lk(b.m);
    for (auto& [off, m] : b.bars) {
        if (m.init_thread == threadIdx.x) m.init_fenced = true;
    }
}
// Publishes the generic writes made so far to the async proxy (proxy_fence).
inline void fence_proxy_async() {
    hostemu::sync_point();
    hostemu::sm90::proxy_fence();
}

// ---- TMA and bulk copies ---------------------------------------------------------------
inline void tma_load(void* dst, const TensorMap* map, u64* bar, int rank, const int (&c)[3]) {
    using namespace hostemu::sm90;
    hostemu::sync_point();
    if (map->tag != TENSOR_MAP_TAG) hostemu::fail("TMA load: not a tensor map (tag 0x%llx)",
                                                  (unsigned long long)map->tag);
    if ((int)map->rank != rank) {
        hostemu::fail("TMA load: %dd copy of a rank-%u map", rank, map->rank);
    }
    const uint32_t S = swizzle_bytes(static_cast<Swizzle>(map->swizzle));
    const size_t bytes = (size_t)map->box[0] * map->box[1] * map->box[2] * map->elem_bytes;
    const long off = smem_check(dst, bytes, "TMA load destination");
    const long align = S == 0 ? 128 : 8 * S;
    if (off % align) {
        hostemu::fail("TMA load: destination at shared offset %ld is not %ld-byte aligned%s", off,
                      align, S ? " (the swizzle pattern's repeat)" : "");
    }
    const TensorMap m = *map;
    {
        std::lock_guard lk(hostemu::sm90::g_tma_trace_m);
        hostemu::sm90::g_tma_trace.push_back(hostemu::sm90::TmaRecord{blockIdx.x, blockIdx.y, (uint64_t)m.global,
                                        {c[0], c[1], c[2]}});
    }
    unsigned char* base = hostemu::g_block.smem;
    Copy copy{[m, c, off, base, S] {
        const uint32_t eb = m.elem_bytes;
        const uint32_t row = m.box[0] * eb;
        for (uint32_t z = 0; z < m.box[2]; ++z) {
            for (uint32_t y = 0; y < m.box[1]; ++y) {
                for (uint32_t x = 0; x < m.box[0]; ++x) {
                    const int64_t g0 = (int64_t)c[0] + x, g1 = (int64_t)c[1] + y,
                                  g2 = (int64_t)c[2] + z;
                    long a = off + (long)((z * m.box[1] + y) * row + x * eb);
                    if (S) {
                        const int bits = S == 128 ? 3 : S == 64 ? 2 : 1;
                        a ^= ((a >> 7) & ((1 << bits) - 1)) << 4;
                    }
                    unsigned char* p = base + a;
                    const bool in = g0 >= 0 && g0 < (int64_t)m.dims[0] && g1 >= 0 &&
                                    g1 < (int64_t)m.dims[1] && g2 >= 0 && g2 < (int64_t)m.dims[2];
                    if (in) {
                        const unsigned char* src = static_cast<const unsigned char*>(m.global) +
                            g0 * eb + g1 * (int64_t)m.strides[0] + g2 * (int64_t)m.strides[1];
                        std::memcpy(p, src, eb);
                    } else {
                        std::memset(p, m.nan_fill ? 0xff : 0, eb);
                    }
                }
            }
        }
    }, (uint32_t)bytes};
    issue_copy(bar, base + off, bytes, std::move(copy), "TMA load");
}

inline void tma_load_2d(void* dst, const TensorMap* map, u64* bar, int c0, int c1) {
    tma_load(dst, map, bar, 2, {c0, c1, 0});
}

inline void tma_load_3d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2) {
    tma_load(dst, map, bar, 3, {c0, c1, c2});
}

inline void bulk_load(void* dst, const void* src, uint32_t bytes, u64* bar) {
    using namespace hostemu::sm90;
    hostemu::sync_point();
    const long off = smem_check(dst, bytes, "bulk copy destination");
    if (off % 16 || reinterpret_cast<uintptr_t>(src) % 16 || bytes % 16) {
        hostemu::fail("bulk copy: addresses (shared %ld) and size (%u) must be multiples of 16",
                      off, bytes);
    }
    unsigned char* p = static_cast<unsigned char*>(dst);
    issue_copy(bar, p, bytes, Copy{[p, src, bytes] { std::memcpy(p, src, bytes); }, bytes},
               "bulk copy");
}

// ---- wgmma -------------------------------------------------------------------------------
#define VARLEN_EMU_SITE const char* file = __builtin_FILE(), int line = __builtin_LINE()

inline void wgmma_fence(VARLEN_EMU_SITE) {
    using namespace hostemu::sm90;
    Group& g = enter(128, Slot{WG_FENCE, {file, line}, 0, {}, {}, nullptr});
    leave(g);
    ThreadState& t = me();
    t.fenced = true;
    for (RegArray& r : t.regs) {
        const unsigned char* b = static_cast<const unsigned char*>(r.p);
        r.seen.assign(b, b + r.bytes);
    }
}

inline void wgmma_commit(VARLEN_EMU_SITE) {
    using namespace hostemu::sm90;
    Group& g = enter(128, Slot{WG_COMMIT, {file, line}, 0, {}, {}, nullptr});
    leave(g);
    ThreadState& t = me();
    t.groups.push_back(std::move(t.open));
    t.open.clear();
}

inline void wgmma_wait_n(int n, hostemu::sm90::Site site) {
    using namespace hostemu::sm90;
    Group& g = enter(128, Slot{WG_WAIT, site, 0, {(uint64_t)n}, {}, nullptr});
    leave(g);
    ThreadState& t = me();
    if (!t.open.empty()) {
        hostemu::fail("wgmma.wait_group with %zu wgmma.mma_async not committed (a missing "
                      "wgmma.commit_group)", t.open.size());
    }
    std::vector<std::pair<float*, int>> written;   // accumulators (and N) written here
    while (t.groups.size() > static_cast<size_t>(n)) {
        for (OpPtr& op : t.groups.front()) {
            retire(*op);
            written.emplace_back(op->d, op->n);
            std::vector<long> offs;
            visit_operands(*op, [&](bool, int, long off) { offs.push_back(off); });
            // the async proxy may read up to the retirement: a store fenced since the issue by
            // a thread this one has not synchronised with went into the operand in flight
            std::vector<long> granules = offs;
            check_async_read(granules, "wgmma.mma_async (at its retirement)", op->site, false);
            async_read_retired(offs);
        }
        t.groups.pop_front();
    }
    // Accumulators a still-pending op continues are still in flight: poison them again.
    const float poison = __int_as_float(ACC_POISON);
    for (auto& group : t.groups) {
        for (OpPtr& op : group) {
            std::fill(op->d, op->d + op->n / 2, poison);
            written.emplace_back(op->d, op->n);
        }
    }
    for (const auto& [d, n_op] : written) note_regs(t, d, sizeof(float) * n_op / 2);
    t.fenced = false;
}

template <int N>
void wgmma_wait(VARLEN_EMU_SITE) {
    wgmma_wait_n(N, {file, line});
}

// Makes the array known to the register check (issue_wgmma) if it is not yet, so that the
// check covers it from the next wgmma.fence on, before any wgmma has used it.
template <int R>
inline void wgmma_fence_operand(float (&d)[R]) {
    hostemu::sm90::note_regs(hostemu::sm90::me(), d, sizeof(d), false);
}

template <int R>
inline void wgmma_fence_operand(uint32_t (&a)[R][4]) {
    hostemu::sm90::ThreadState& t = hostemu::sm90::me();
    for (int i = 0; i < R; ++i) hostemu::sm90::note_regs(t, a[i], sizeof(a[i]), false);
}

template <typename T, int N, bool TRANS_A, bool TRANS_B>
void wgmma_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b, bool scale_d, VARLEN_EMU_SITE) {
    static_assert(N == 32 || N == 64 || N == 128 || N == 256,
                  "wgmma m64nNk16: N of 32, 64, 128 or 256");
    hostemu::sm90::issue_wgmma(d, N, ElemTraits<T>::IS_BF16, nullptr, desc_a, TRANS_A, desc_b,
                               TRANS_B, scale_d, {file, line});
}

template <typename T, int N, bool TRANS_B>
void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], u64 desc_b, bool scale_d,
              VARLEN_EMU_SITE) {
    static_assert(N == 32 || N == 64 || N == 128 || N == 256,
                  "wgmma m64nNk16: N of 32, 64, 128 or 256");
    hostemu::sm90::issue_wgmma(d, N, ElemTraits<T>::IS_BF16, a, 0, false, desc_b, TRANS_B,
                               scale_d, {file, line});
}

// ---- setmaxnreg and stmatrix -------------------------------------------------------------
template <int REGS, bool INC>
void setmaxnreg(VARLEN_EMU_SITE) {
    static_assert(REGS >= 24 && REGS <= 256 && REGS % 8 == 0, "setmaxnreg: 24..256, step 8");
    using namespace hostemu::sm90;
    Group& g = enter(128, Slot{WG_SETMAXNREG, {file, line}, 0,
                               {(uint64_t)REGS, INC}, {}, nullptr});
    leave(g);
}

inline void stmatrix(void* p, const uint32_t (&r)[4], bool trans, hostemu::sm90::Site site) {
    using namespace hostemu::sm90;
    check_aligned16(p, "stmatrix row");
    smem_check(p, 16, "stmatrix row");
    check_generic_write(hostemu::smem_offset(p), trans ? "stmatrix.trans" : "stmatrix", site);
    Slot s{WG_STMATRIX, site, 0, {trans}, {r[0], r[1], r[2], r[3]}, p};
    Group& g = enter(32, s);
    // Lane l writes row l % 8 of matrix l / 8: 8 halves, from lanes 4 j + c / 2 (no .trans:
    // row j = l % 8, column c) or 4 c + j / 2 (.trans), register l / 8, half c % 2 (j % 2).
    const int l = threadIdx.x % 32, i = l / 8, j = l % 8;
    uint16_t row[8];
    for (int c = 0; c < 8; ++c) {
        const int src = trans ? 4 * c + j / 2 : 4 * j + c / 2;
        const int h = trans ? j % 2 : c % 2;
        const uint32_t reg = g.slot[src].a[i];
        row[c] = (uint16_t)(h ? reg >> 16 : reg & 0xffff);
    }
    leave(g);
    std::memcpy(p, row, 16);
}

inline void stmatrix_x4(void* p, const uint32_t (&r)[4], VARLEN_EMU_SITE) {
    stmatrix(p, r, false, {file, line});
}

inline void stmatrix_x4_trans(void* p, const uint32_t (&r)[4], VARLEN_EMU_SITE) {
    stmatrix(p, r, true, {file, line});
}

#undef VARLEN_EMU_SITE

}  // namespace sm90
}  // namespace varlen
