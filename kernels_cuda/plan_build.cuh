// The plan of varlen/plan.py (`build_plan`, `segments_from_cu_seqlens`) built on the device by
// two kernels, bit for bit the same int32 arrays (docs/plan.md):
//
//   varlen_plan_scan   one block: the segments of both sides (from cu_seqlens and offsets, or
//                      given), the mask policy arrays, and per side the inclusive prefix sum
//                      `ends` of tiles per segment; sets the device-error flags.
//   varlen_plan_tiles  a grid over the tile slots of both sides: each slot's tile-table row,
//                      its partner-tile ranges (`q_sched` / `k_sched`) and the same ranges in
//                      packed partner rows (`q_row_sched` / `k_row_sched`).
//
// Every size (slots, segments, threads) is host-known; nothing is read back. Arithmetic is in
// 64-bit with floor division where the NumPy code divides (`//` floors negative numerators),
// and results are cast to int32 as `astype(np.int32)` does. Launched by
// varlen/backends/cupy/plan.py, which fills `PlanBuildParams` in one place.
#pragma once

#include "tile_scheduler.cuh"

namespace varlen {

// One side of the plan: the query rows (tiles of block_m) or the key rows (tiles of block_n).
struct PlanSide {
    const int* cu;             // [B+1] cu_seqlens; null: the segments below are given (read)
    const int* off;            // [B+1] seq_offsets (with cu; cu itself when there are none)
    int* row;                  // [B, m] first packed row of each segment (written when cu is set)
    int* len;                  // [B, m] rows of each segment
    int* pos;                  // [B, m] global position of its first row
    int* seqlen;               // [B] global sequence lengths
    int64_t* ends;             // [B * m] scratch: inclusive prefix sum of tiles per segment
    int* tiles;                // [num_slots, 5] (seq, seg, row, rows, pos)
    int* sched;                // [num_slots, m of the other side, 4] partner-tile ranges
    int* row_sched;            // [num_slots, m of the other side, 5] the same in partner rows,
                               // and pos - row of the partner segment
    unsigned char* outside;    // bool: a sequence lies outside the buffer (set, never cleared;
                               // null when the segments are given)
    unsigned char* overflow;   // bool: more tiles than slots (lengths past max_seqlen)
    int num_rows;              // T, rows of the packed array
    int m;                     // segments per sequence
    int block;                 // rows per tile
    int num_slots;             // tile-table slots (plan.tile_bound)
};

// Everything both kernels read and write, passed by value.
struct PlanBuildParams {
    PlanSide q;
    PlanSide k;
    const int* mask_in[3];     // [B] window_left, window_right, bottom_right; null: scalar
    int mask_value[3];         // the scalar of a field whose mask_in is null
    int* mask_out[3];          // [B] the plan's int32 policy arrays
    int batch;                 // B
};

// Python's a // b for b > 0.
__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {
    const int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

__device__ __forceinline__ int64_t clip64(int64_t x, int64_t lo, int64_t hi) {
    return min(max(x, lo), hi);
}

__device__ __forceinline__ int64_t tiles_of(int64_t length, int block) {
    return floor_div(length + block - 1, block);
}

// Segment s of a side built from cu_seqlens (m = 1, s = b): rows [off[b], off[b] + L) clamped
// into [0, T) (`segments_from_cu_seqlens`). Writes it and returns its clamped length; a clamp
// that cuts rows sets bit 0 of `bits`.
__device__ __forceinline__ int64_t segment_from_cu(const PlanSide& side, int64_t b,
                                                   unsigned& bits) {
    const int64_t L = static_cast<int64_t>(side.cu[b + 1]) - side.cu[b];
    const int64_t r0 = side.off[b];
    const int64_t T = side.num_rows;
    const int64_t fits = max(min(L, T - clip64(r0, 0, T)), int64_t(0));
    if (fits < L || (r0 < 0 && L > 0)) bits |= 1u;
    side.row[b] = static_cast<int>(clip64(r0, 0, T));
    side.len[b] = static_cast<int>(fits);
    side.pos[b] = 0;
    side.seqlen[b] = static_cast<int>(L);
    return fits;
}

// This thread's contiguous chunk [lo, hi) of n items.
struct Chunk1d {
    int64_t lo;
    int64_t hi;
};

__device__ __forceinline__ Chunk1d thread_chunk(int64_t n) {
    const int64_t per = (n + blockDim.x - 1) / blockDim.x;
    const int64_t lo = min(static_cast<int64_t>(threadIdx.x) * per, n);
    return Chunk1d{lo, min(lo + per, n)};
}

// Tiles of the segments of this thread's chunk (building them first when cu is set).
__device__ __forceinline__ int64_t chunk_tiles(const PlanSide& side, int batch, unsigned& bits) {
    const Chunk1d c = thread_chunk(static_cast<int64_t>(batch) * side.m);
    int64_t acc = 0;
    for (int64_t s = c.lo; s < c.hi; ++s) {
        const int64_t L = side.cu ? segment_from_cu(side, s, bits) : side.len[s];
        acc += tiles_of(L, side.block);
    }
    return acc;
}

// `searchsorted(ends[:n], t, side="right")`: the segment holding tile slot t (n when none).
__device__ __forceinline__ int64_t segment_of(const int64_t* ends, int64_t n, int64_t t) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (ends[mid] <= t) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Tile-range helpers of varlen/plan.py, local to a partner segment of n rows in tiles of b
// (tile t spans [t b, min((t + 1) b, n) - 1]).
__device__ __forceinline__ int64_t first_last_ge(int64_t c, int64_t n, int64_t b, int64_t nt) {
    return c >= n ? nt : clip64(floor_div(c, b), 0, nt);          // smallest t, last row >= c
}

__device__ __forceinline__ int64_t count_first_le(int64_t d, int64_t b, int64_t nt) {
    return d < 0 ? 0 : min(nt, floor_div(d, b) + 1);              // tiles whose first row <= d
}

__device__ __forceinline__ int64_t first_first_ge(int64_t e, int64_t b, int64_t nt) {
    return clip64(-floor_div(-e, b), 0, nt);                       // smallest t, first row >= e
}

__device__ __forceinline__ int64_t count_last_le(int64_t f, int64_t n, int64_t b, int64_t nt) {
    return f >= n - 1 ? nt : clip64(floor_div(f + 1, b), 0, nt);   // tiles whose last row <= f
}

// An unbounded band edge in position arithmetic (varlen.masks.UNBOUNDED).
constexpr int64_t UNBOUNDED = int64_t(1) << 40;

// Tile slot t of side `own` against the segments of `partner` (masks.key_band for query
// tiles, masks.query_band for key tiles): its table row, ranges and row ranges
// (plan._tile_table, plan._schedule, plan._ranges, plan.row_schedule).
__device__ void plan_slot(const PlanBuildParams& p, const PlanSide& own, const PlanSide& partner,
                          bool own_is_k, int64_t t) {
    int* tile = own.tiles + t * TILE_FIELDS;
    int* sched = own.sched + t * partner.m * SCHED_FIELDS;
    int* row_sched = own.row_sched + t * partner.m * ROW_SCHED_FIELDS;
    const int64_t S = static_cast<int64_t>(p.batch) * own.m;
    const int64_t s = segment_of(own.ends, S, t);
    if (s >= S) {
        tile[0] = -1; tile[1] = -1; tile[2] = 0; tile[3] = 0; tile[4] = 0;
        for (int i = 0; i < partner.m * SCHED_FIELDS; ++i) sched[i] = 0;
        for (int i = 0; i < partner.m * ROW_SCHED_FIELDS; ++i) row_sched[i] = 0;
        return;
    }
    const int64_t L = own.len[s];
    const int64_t offset = (t - (own.ends[s] - tiles_of(L, own.block))) * own.block;
    const int b = static_cast<int>(s / own.m);
    tile[0] = b;
    tile[1] = static_cast<int>(s % own.m);
    tile[2] = static_cast<int>(own.row[s] + offset);
    tile[3] = static_cast<int>(min(static_cast<int64_t>(own.block), L - offset));
    tile[4] = static_cast<int>(own.pos[s] + offset);

    // The band edges of the tile's first and last rows, from the int32 values just written.
    const int64_t p0 = tile[4];
    const int64_t p1 = p0 + tile[3] - 1;
    const int64_t left = p.mask_out[0][b], right = p.mask_out[1][b];
    const int64_t shift = (static_cast<int64_t>(p.k.seqlen[b]) - p.q.seqlen[b]) *
                          p.mask_out[2][b];
    int64_t lo0, hi0, lo1, hi1;
    if (own_is_k) {     // queries that see key positions p0, p1
        lo0 = right < 0 ? -UNBOUNDED : p0 - shift - right;
        hi0 = left < 0 ? UNBOUNDED : p0 - shift + left;
        lo1 = right < 0 ? -UNBOUNDED : p1 - shift - right;
        hi1 = left < 0 ? UNBOUNDED : p1 - shift + left;
    } else {            // keys seen by query positions p0, p1
        lo0 = left < 0 ? -UNBOUNDED : p0 + shift - left;
        hi0 = right < 0 ? UNBOUNDED : p0 + shift + right;
        lo1 = left < 0 ? -UNBOUNDED : p1 + shift - left;
        hi1 = right < 0 ? UNBOUNDED : p1 + shift + right;
    }
    const int64_t pb = partner.block;
    for (int i = 0; i < partner.m; ++i) {
        const int64_t ppos = partner.pos[static_cast<int64_t>(b) * partner.m + i];
        const int64_t prow = partner.row[static_cast<int64_t>(b) * partner.m + i];
        const int64_t n = partner.len[static_cast<int64_t>(b) * partner.m + i];
        const int64_t nt = tiles_of(n, partner.block);
        int64_t begin = first_last_ge(lo0 - ppos, n, pb, nt);
        int64_t end = count_first_le(hi1 - ppos, pb, nt);
        int64_t fbegin = first_first_ge(lo1 - ppos, pb, nt);
        int64_t fend = count_last_le(hi0 - ppos, n, pb, nt);
        if (begin >= end) {
            begin = 0;
            end = 0;
        }
        fbegin = clip64(fbegin, begin, end);
        fend = clip64(fend, fbegin, end);
        if (fbegin >= fend) {
            fbegin = end;
            fend = end;
        }
        int* r = sched + i * SCHED_FIELDS;
        r[0] = static_cast<int>(begin);
        r[1] = static_cast<int>(fbegin);
        r[2] = static_cast<int>(fend);
        r[3] = static_cast<int>(end);
        // Each bound as a packed row, clipped to the segment: prow + min(tile * pb, n).
        int* rr = row_sched + i * ROW_SCHED_FIELDS;
        rr[0] = static_cast<int>(prow + min(begin * pb, n));
        rr[1] = static_cast<int>(prow + min(fbegin * pb, n));
        rr[2] = static_cast<int>(prow + min(fend * pb, n));
        rr[3] = static_cast<int>(prow + min(end * pb, n));
        rr[4] = static_cast<int>(ppos - prow);
    }
}

}  // namespace varlen

// Kernels live at global scope so that their name expressions are short.
using namespace varlen;

// Grid (1), dynamic shared memory 2 * 8 + 4 bytes per thread. Each thread takes a contiguous
// chunk of segments of each side: sums their tiles, thread 0 scans the chunk totals (and
// checks them against the slots), then each thread writes the running sums of its chunk.
__global__ void varlen_plan_scan(PlanBuildParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int nthreads = blockDim.x;
    const int tid = threadIdx.x;
    int64_t* s_part = reinterpret_cast<int64_t*>(smem_raw);           // [2][nthreads]
    unsigned* s_bits = reinterpret_cast<unsigned*>(s_part + 2 * nthreads);   // [nthreads]

    // bit 0: query rows outside, 1: key rows outside, 2: query overflow, 3: key overflow
    unsigned q_bits = 0, k_bits = 0;
    s_part[tid] = chunk_tiles(p.q, p.batch, q_bits);
    s_part[nthreads + tid] = chunk_tiles(p.k, p.batch, k_bits);
    s_bits[tid] = q_bits | (k_bits << 1);
    for (int b = tid; b < p.batch; b += nthreads) {
        #pragma unroll
        for (int f = 0; f < 3; ++f) {
            p.mask_out[f][b] = p.mask_in[f] ? p.mask_in[f][b] : p.mask_value[f];
        }
    }
    __syncthreads();
    if (tid == 0) {
        unsigned bits = 0;
        for (int t = 0; t < nthreads; ++t) bits |= s_bits[t];
        for (int side = 0; side < 2; ++side) {
            const PlanSide& ps = side ? p.k : p.q;
            int64_t run = 0;
            for (int t = 0; t < nthreads; ++t) {
                const int64_t x = s_part[side * nthreads + t];
                s_part[side * nthreads + t] = run;
                run += x;
            }
            if (static_cast<int64_t>(p.batch) * ps.m > 0 && run > ps.num_slots) {
                bits |= 4u << side;
            }
        }
        // Or-ed into the caller's flags: set, never cleared (varlen._device_errors).
        if ((bits & 1u) && p.q.outside) *p.q.outside = 1;
        if ((bits & 2u) && p.k.outside) *p.k.outside = 1;
        if ((bits & 4u) && p.q.overflow) *p.q.overflow = 1;
        if ((bits & 8u) && p.k.overflow) *p.k.overflow = 1;
    }
    __syncthreads();
    for (int side = 0; side < 2; ++side) {
        const PlanSide& ps = side ? p.k : p.q;
        const Chunk1d c = thread_chunk(static_cast<int64_t>(p.batch) * ps.m);
        int64_t acc = s_part[side * nthreads + tid];
        for (int64_t s = c.lo; s < c.hi; ++s) {
            acc += tiles_of(ps.len[s], ps.block);     // this thread wrote len[s] when cu is set
            ps.ends[s] = acc;
        }
    }
}

// Grid-stride over the query slots, then the key slots; after varlen_plan_scan on the stream.
__global__ void varlen_plan_tiles(PlanBuildParams p) {
    const int64_t n = static_cast<int64_t>(p.q.num_slots) + p.k.num_slots;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        if (i < p.q.num_slots) plan_slot(p, p.q, p.k, false, i);
        else plan_slot(p, p.k, p.q, true, i - p.q.num_slots);
    }
}
