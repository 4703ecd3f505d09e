// What a kernel reads of the plan and of the call: two structs, members of each kernel family's
// params struct (params.cuh), filled by the launcher in one place.
//
// PlanView has the fields of varlen.plan.KernelView, in the same order; the launchers
// (varlen/backends/cupy/launch.py, plan_view_arg) fill it from Plan.view() through a NumPy
// dtype of the same layout (PLAN_VIEW_DTYPE, compared with sizeof/offsetof by
// tests/compile/test_cupy_compile.py). Plain C++ without CUDA types, so that test compiles it with g++.
#pragma once

namespace varlen {

struct PlanView {
    const int* q_tiles;        // [num_q_tiles, 5] (seq, seg, row, rows, pos); seq -1: unused slot
    const int* q_sched;        // [num_q_tiles, mk, 4] key-tile ranges per key segment
    const int* k_tiles;        // [num_k_tiles, 5] the same for key tiles
    const int* k_sched;        // [num_k_tiles, mq, 4] query-tile ranges per query segment
    const int* q_row;          // [B, mq] first packed row of each query segment
    const int* q_len;          // [B, mq] rows of each query segment
    const int* q_pos;          // [B, mq] global position of its first row
    const int* k_row;          // [B, mk] first packed row of each key segment
    const int* k_len;          // [B, mk] rows of each key segment
    const int* k_pos;          // [B, mk] global position of its first row
    const int* seqlen_q;       // [B] global query lengths (positions past them are padding)
    const int* seqlen_k;       // [B] global key lengths
    const int* window_left;    // [B] keys visible left of the diagonal, < 0: unbounded
    const int* window_right;   // [B] keys visible right of the diagonal, < 0: unbounded
    const int* bottom_right;   // [B] 1: the diagonal ends at the last query and key
    const int* q_row_sched;    // [num_q_tiles, mk, 5] q_sched as packed key rows (row_begin,
                               // row_full_begin, row_full_end, row_end) and pos - row per segment
    const int* k_row_sched;    // [num_k_tiles, mq, 5] k_sched as packed query rows, pos - row
    int batch;                 // B
    int mq;                    // query segments per sequence
    int mk;                    // key segments per sequence
    int num_q_tiles;           // query tile slots (grid x of the forward)
    int num_k_tiles;           // key tile slots (grid x of the dK/dV kernel)
    int block_m;               // query rows per plan tile
    int block_n;               // key rows per plan tile (the kernels' BN)
    int rows_q;                // Tq, rows of the packed query array (and of lse's rows)
    int rows_k;                // Tk, rows of the packed key and value arrays
};

// The per-call sizes and scalars every attention kernel reads besides the plan and the data.
struct CallParams {
    int Hq;                    // query heads; grid y of the forward
    int Hk;                    // key/value heads; query head h reads key head h / (Hq / Hk)
    float softmax_scale;       // multiplies Q K^T before the softmax
    float softcap;             // > 0: scores become softcap * tanh(score / softcap)
};

}  // namespace varlen
