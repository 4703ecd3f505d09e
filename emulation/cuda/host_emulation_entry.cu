// Host-emulation entry points (see host_emulation.cuh): one variant per build, chosen with
// -DEMU_T= -DEMU_D= -DEMU_BM= -DEMU_BN= -DEMU_BQ= -DEMU_SC= (-DEMU_DV=, head_dim_v, default
// EMU_D; -DEMU_DROP=1, the mma.sync kernels with dropout, default 0) and the tiles of
// traits.tile_size
// the launchers pass as template arguments, -DEMU_KN= -DEMU_STAGES= (the mma.sync forward's
// key chunk and stages) -DEMU_KN90= (the sm_90a forward's key chunk). Compiled with g++ -x c++
// -DVARLEN_HOST_EMULATION, never by NVRTC.
//
// Arguments travel as a GPU launch passes them (host_emulation_entry.cuh), the FwdParams and
// BwdParams structs included.
// The module's generated mask_mod (varlen/backends/cupy/mods.py: MASK_FN, named by
// VARLEN_MASK_MOD in its prelude) behind a wrapper that counts the pairs it is evaluated on
// (emu_user_mask_calls): the kernels themselves unchanged.
#ifdef VARLEN_MASK_MOD
#undef VARLEN_MASK_MOD
inline bool emu_counted_user_mask(long long b, long long q_idx, long long k_idx,
                                  const ModAux& aux) {
    hostemu::count_user_mask();
    return varlen_user_mask(b, q_idx, k_idx, aux);
}
#define VARLEN_MASK_MOD emu_counted_user_mask
#endif

#include "varlen_attention.cu"
#include "host_emulation_entry.cuh"

namespace {

using T = EMU_T;
#ifndef EMU_DV
#define EMU_DV EMU_D
#endif
constexpr int D = EMU_D, BM = EMU_BM, BN = EMU_BN, BQ = EMU_BQ, DV = EMU_DV;
constexpr int KN = EMU_KN, STAGES = EMU_STAGES, KN90 = EMU_KN90;
constexpr bool SC = EMU_SC;
#ifndef EMU_DROP
#define EMU_DROP 0
#endif
constexpr bool DROP = EMU_DROP;

using hostemu::Kernel;

const Kernel KERNELS[] = {
    VARLEN_EMU_KERNEL("varlen_fwd", varlen_fwd<T, D, BM, BN, SC, KN, STAGES, DV, DROP>),
    VARLEN_EMU_KERNEL("varlen_bwd_preprocess", varlen_bwd_preprocess<T, D, DV>),
    VARLEN_EMU_KERNEL("varlen_bwd_dkdv_atomic",
                      varlen_bwd_dkdv<T, D, BN, BQ, SC, true, false, DV, DROP>),
    VARLEN_EMU_KERNEL("varlen_bwd_dkdv_ordered", varlen_bwd_dkdv<T, D, BN, BQ, SC, true, true, DV,
                                                                    DROP>),
    VARLEN_EMU_KERNEL("varlen_bwd_dq_convert", varlen_bwd_dq_convert<T, D>),
    VARLEN_EMU_KERNEL("varlen_plan_scan", varlen_plan_scan),
    VARLEN_EMU_KERNEL("varlen_plan_tiles", varlen_plan_tiles),
};

const Kernel* find(const char* key) { return hostemu::find_kernel(KERNELS, key); }

}  // namespace

// Writes the size of each parameter of kernel `key` into `sizes` and returns their number;
// -1 for an unknown kernel.
extern "C" int emu_param_sizes(const char* key, size_t* sizes) {
    const Kernel* k = find(key);
    return k ? k->param_sizes(sizes) : -1;
}

// Runs kernel `key` on a (gx, gy) grid of `threads`-thread blocks with `smem` bytes of dynamic
// shared memory each; 0, 1 if a thread trapped (the launch failed), or -1 for an unknown one.
extern "C" int emu_launch(const char* key, unsigned gx, unsigned gy, unsigned threads,
                          size_t smem, void** args) {
    const Kernel* k = find(key);
    if (!k) return -1;
    return k->run(k->key, gx, gy, threads, smem, args) ? 0 : 1;
}

// Sets how copies land (hostemu::Landing), the turnstile, the seed and whether a cp.async bank
// conflict is fatal, for the launches that follow.
extern "C" void emu_configure(int landing, int turnstile, unsigned long long seed,
                              int strict_copy_banks) {
    hostemu::g_config = hostemu::Config{landing, turnstile != 0, seed, strict_copy_banks != 0};
}

// Bank-conflict counts of every launch so far: ldmatrix phases, their extra wavefronts,
// cp.async quarter-warp writes, their extra wavefronts.
extern "C" void emu_bank_counts(unsigned long long* out) {
    const hostemu::BankCounts& b = hostemu::g_banks;
    const unsigned long long v[] = {b.ldsm_phases, b.ldsm_conflicts, b.copy_phases,
                                    b.copy_conflicts};
    std::memcpy(out, v, sizeof(v));
}

// Pairs a mask_mod was evaluated on by every launch so far (user_mask, mods.cuh), and where the
// count lives: the dynamic linker may bind two loaded builds to one inline counter.
extern "C" unsigned long long emu_user_mask_calls() { return hostemu::g_user_mask_calls.load(); }
extern "C" const void* emu_user_mask_counter() { return &hostemu::g_user_mask_calls; }

// The sm_90a forward (fwd_sm90.cuh), in variants it supports (D of 64, 128 or 256, and 192 with
// DV = 128; BM of 64 or 128; query heads packed 1, 2, 4 or 8 per position, `_pack` P: BM the
// kernel's rows, BM / P the plan's query tile), the sm_90a dK/dV kernel (bwd_sm90.cuh: key
// tiles of 64 or 128 at D = 64 and 128, of 64 at D = 256), and the tensor maps their launchers pass
// (varlen/backends/_cupy_sm90.py): entry points of their own, so that the table above stays
// that of the mma.sync kernels.
#if (EMU_D == 64 || EMU_D == 128 || EMU_D == 256 || (EMU_D == 192 && EMU_DV == 128)) && \
    (EMU_BM == 64 || EMU_BM == 128) && EMU_DV % 64 == 0
namespace {
const Kernel SM90_KERNELS[] = {
    VARLEN_EMU_KERNEL("varlen_fwd_sm90", varlen_fwd_sm90<T, D, BM, BN, SC, KN90, 1, DV>),
    VARLEN_EMU_KERNEL("varlen_fwd_sm90_pack2", varlen_fwd_sm90<T, D, BM, BN, SC, KN90, 2, DV>),
    VARLEN_EMU_KERNEL("varlen_fwd_sm90_pack4", varlen_fwd_sm90<T, D, BM, BN, SC, KN90, 4, DV>),
    VARLEN_EMU_KERNEL("varlen_fwd_sm90_pack8", varlen_fwd_sm90<T, D, BM, BN, SC, KN90, 8, DV>),
// (not in a build with a call's score_mod: the sm_90a backward runs a mask_mod only)
#if ((EMU_D <= 128 && EMU_BN <= 128) || (EMU_D == 256 && EMU_BN == 64)) && \
    !defined(VARLEN_SCORE_MOD)
    VARLEN_EMU_KERNEL("varlen_bwd_dkdv_sm90", varlen_bwd_dkdv_sm90<T, D, BN, 64, SC, false>),
    VARLEN_EMU_KERNEL("varlen_bwd_dkdv_sm90_ordered",
                      varlen_bwd_dkdv_sm90<T, D, BN, 64, SC, true>),
#endif
};
}  // namespace

extern "C" int emu_sm90_param_sizes(const char* key, size_t* sizes) {
    const Kernel* k = hostemu::find_kernel(SM90_KERNELS, key);
    return k ? k->param_sizes(sizes) : -1;
}

extern "C" int emu_sm90_launch(const char* key, unsigned gx, unsigned gy, unsigned threads,
                               size_t smem, void** args) {
    const Kernel* k = hostemu::find_kernel(SM90_KERNELS, key);
    if (!k) return -1;
    return k->run(k->key, gx, gy, threads, smem, args) ? 0 : 1;
}

// The TMA loads recorded since the last clear (hostemu::sm90::TmaRecord, 6 x 64 bits each):
// up to `max` into `out`; returns how many there are.
extern "C" size_t emu_sm90_tma_trace(void* out, size_t max) {
    using namespace hostemu::sm90;
    std::lock_guard lk(g_tma_trace_m);
    if (max) std::memcpy(out, g_tma_trace.data(), std::min(max, g_tma_trace.size()) * sizeof(TmaRecord));
    return g_tma_trace.size();
}

extern "C" void emu_sm90_tma_trace_clear() {
    using namespace hostemu::sm90;
    std::lock_guard lk(g_tma_trace_m);
    g_tma_trace.clear();
}

// cuTensorMapEncodeTiled's emulated counterpart: the 128 bytes of the map into `out`.
extern "C" void emu_sm90_tensor_map(const void* global, int rank, int elem_bytes,
                                    const uint64_t* dims, const uint64_t* strides,
                                    const uint32_t* box, int swizzle, void* out) {
    const varlen::sm90::TensorMap m = varlen::sm90::make_tensor_map(
        global, rank, elem_bytes, dims, strides, box, static_cast<varlen::sm90::Swizzle>(swizzle));
    std::memcpy(out, &m, sizeof(m));
}
#endif
