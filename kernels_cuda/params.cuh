// What each kernel family reads: one params struct per family, passed by value and filled by
// the launcher in one place (FlashAttention's Flash_fwd_params / Flash_bwd_params): the data
// pointers, where each array's rows and heads lie (Strides), the plan (PlanView) and the
// call's scalars (CallParams). The sm_90a kernels take their TensorMaps as kernel parameters
// of their own before it (a tensor map must be a __grid_constant__ parameter).
//
// The launchers fill them through NumPy dtypes of the same layout (varlen/backends/cupy/
// launch.py: STRIDES_DTYPE, FWD_PARAMS_DTYPE, BWD_PARAMS_DTYPE), which tests/compile/test_cupy_compile.py
// compares with sizeof/offsetof. Plain C++ without CUDA types, so that test compiles it with g++.
#pragma once

// NVRTC compiles without the C library headers: the fixed-width types come from here.
#if defined(__CUDACC_RTC__)
using int64_t = long long;
using uint32_t = unsigned int;
#else
#include <cstdint>
#endif

#include "plan_view.cuh"

// What a generated mask_mod / score_mod reads of its aux arrays (varlen/mods/codegen.py's
// CUDA_PRELUDE defines the same struct under the same guard, for the generated functions, which
// take it at global scope): base pointers and shapes (at most 4 dimensions each), row-major
// and contiguous, and the device flag set when an index falls outside its array.
#ifndef VARLEN_MOD_AUX
#define VARLEN_MOD_AUX
#define VARLEN_MAX_AUX 8
struct ModAux {
    const void* ptr[VARLEN_MAX_AUX];
    long long shape[VARLEN_MAX_AUX][4];
    int* err;                           // device flag: an aux index was out of range
};
#endif

namespace varlen {

using ::ModAux;

// The aux arrays of the call's mask_mod and score_mod (each function's own numbering; all
// zero in a call without them, and never read by a kernel compiled without them: mods.cuh).
struct ModParams {
    ModAux mask;
    ModAux score;
    // the score_mod's aux gradients (aux_grads): flat float32 buffers of its float aux arrays,
    // null for the others; read only by a dK/dV kernel compiled with VARLEN_SCORE_MOD_AUX_GRAD
    float* grad[VARLEN_MAX_AUX];
    // nonzero (deterministic=True): each grad[i] holds uint64 fixed-point words instead,
    // aux_fixed.WORDS per entry (aux_fixed.cuh, varlen/backends/_aux_fixed.py)
    int grad_fixed;
};

// Attention dropout (docs/semantics.md, "Dropout"; dropout.cuh): read only by the kernels
// compiled with DROPOUT = true, zero otherwise. A seed or offset that changes is a new value
// here, never a new module.
struct DropoutParams {
    uint32_t seed_lo;          // Philox key word 0: seed & 0xFFFFFFFF
    uint32_t seed_hi;          // seed >> 32; key word 1 is seed_hi ^ (b * SEQ_MIX)
    uint32_t offset;           // counter word 3
    uint32_t threshold;        // a word below it drops its pair: min(round(p 2^32), 2^32 - 1)
    float scale;               // 1 / (1 - p), on kept probabilities
    uint32_t head_offset;      // the global query head of local head 0 (context parallelism's
                               // Ulysses ranks hold a slice of the heads); counter word 2 is
                               // head_offset + the kernel's query head
};

// Where the elements of a [T, H, D] array lie: element (t, h, d) is t * row + h * head + d
// elements from element (0, 0, 0), the last dim contiguous. The launcher passes a view's own
// strides (q given as x.transpose(1, 0, 2) of an [H, T, D] array, or a slice of a packed QKV
// buffer). Every offset computed from them is 64-bit (T H D may exceed 2^31); the strides
// themselves are 32-bit, so that a row or head offset is one wide multiply that ptxas
// recomputes where needed: with 64-bit strides the row and head offsets took registers from
// the accumulators (spills of 4-60 B in the mma.sync forward at D = 96 on sm_80 and in the
// sm_90a forward at D = 256 and with packed heads). The launcher copies, with a warning, a
// view whose strides exceed 2^31 - 1 elements.
struct Strides {
    int row;                   // elements from one row t to the next
    int head;                  // elements from one head h to the next
};

// The forward: varlen_fwd (every field) and varlen_fwd_sm90 (which reads q, k, v through its
// tensor maps, made from the same pointers and their own strides).
struct FwdParams {
    const void* q;             // [Tq, Hq, D] of T
    const void* k;             // [Tk, Hk, D]
    const void* v;             // [Tk, Hk, DV] (DV = head_dim_v <= D)
    void* out;                 // [Tq, Hq, DV] of T, output: every row written (pad rows 0)
    float* lse;                // [Hq, Tq] output, natural log (-inf: no visible key)
    Strides q_strides;
    Strides k_strides;
    Strides v_strides;
    Strides out_strides;
    int64_t lse_stride;        // elements from one head of lse to the next
    PlanView plan;
    CallParams call;
    ModParams mods;
    DropoutParams dropout;
};

// The backward: varlen_bwd_preprocess, varlen_bwd_dkdv, varlen_bwd_dkdv_sm90 (which reads q,
// k, v and dout through its tensor maps) and varlen_bwd_dq_convert, in that order on a stream.
struct BwdParams {
    const void* q;             // [Tq, Hq, D] of T
    const void* k;             // [Tk, Hk, D]
    const void* v;             // [Tk, Hk, DV] (DV = head_dim_v <= D)
    const void* out;           // [Tq, Hq, DV], the forward's output
    const void* dout;          // [Tq, Hq, DV]
    const float* lse;          // [Hq, Tq], the forward's
    float* lse2;               // [Hq, Tq] packed workspace: lse in base 2, +inf: no key
    float* delta;              // [Hq, Tq] packed workspace: rowsum(dO * O)
    float* dq_accum;           // [Tq, Hq, D] packed fp32 workspace: dQ's atomic additions
    int* dq_order;             // [Hq + 1, Tq]: ordered dQ's counters and slots; null: unordered
    void* dq;                  // [Tq, Hq, D] of T, output
    void* dk;                  // [Tk, Hk, D] of T, output
    void* dv;                  // [Tk, Hk, DV] of T, output
    Strides q_strides;
    Strides k_strides;
    Strides v_strides;
    Strides out_strides;
    Strides dout_strides;
    Strides dq_strides;
    Strides dk_strides;
    Strides dv_strides;
    int64_t lse_stride;        // elements from one head of lse to the next
    PlanView plan;
    CallParams call;
    ModParams mods;
    DropoutParams dropout;
};

}  // namespace varlen
