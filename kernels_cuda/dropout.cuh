// Attention dropout in the mma.sync kernels (FlashAttention-2's: a dropped probability counts
// 0 in the output and in dV and dP, a kept one 1 / (1 - p); lse and delta are those without
// dropout). The keep bit of pair (sequence b, query head h, query position i, key position j)
// is the rule of docs/semantics.md ("Dropout"), bit for bit that of varlen/dropout.py:
//     counter (j >> 2, i, h, offset), key (seed_lo, seed_hi ^ b * SEQ_MIX), Philox 4x32-10,
//     word j & 3 of the draw, kept when word >= threshold.
// It is drawn where a tile's elements lie, in the forward and again in the backward: nothing of
// size rows x keys is stored. One draw gives the words of 4 consecutive keys of one query; in a
// C-fragment tile a lane holds 2 of them per row (forward: lanes t and t ^ 1 hold the 4) or 1
// (dK/dV, keys as rows: lanes g = 4a .. 4a + 3 hold the 4), so the lanes that share a draw
// split the draws among them and exchange the keep bits by shuffles: one draw per 4 elements.
// A tile whose keys do not start at a multiple of 4 (segments at any position, under context
// parallelism) draws per element instead.
#pragma once

#include "common.cuh"

namespace varlen {

// Philox 4x32 constants (Random123's PHILOX_M4x32_0/1, PHILOX_W32_0/1) and the sequence mix.
constexpr uint32_t PHILOX_M0 = 0xD2511F53u;
constexpr uint32_t PHILOX_M1 = 0xCD9E8D57u;
constexpr uint32_t PHILOX_W0 = 0x9E3779B9u;     // golden ratio
constexpr uint32_t PHILOX_W1 = 0xBB67AE85u;     // sqrt(3) - 1
constexpr int PHILOX_ROUNDS = 10;
constexpr uint32_t SEQ_MIX = 0x85EBCA6Bu;       // odd: every sequence of a batch its own key
constexpr unsigned FULL_WARP = 0xffffffffu;

// Philox 4x32-10 (Salmon et al., SC'11): the four words of counter (c0, c1, c2, c3) under key
// (k0, k1); round r uses the key bumped r times. Each product is one 32 x 32 -> 64-bit multiply
// (its high and low words at once).
__device__ __forceinline__ uint4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2,
                                               uint32_t c3, uint32_t k0, uint32_t k1) {
    #pragma unroll
    for (int r = 0; r < PHILOX_ROUNDS; ++r) {
        if (r) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const unsigned long long p0 = static_cast<unsigned long long>(PHILOX_M0) * c0;
        const unsigned long long p1 = static_cast<unsigned long long>(PHILOX_M1) * c2;
        const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
        c1 = static_cast<uint32_t>(p1);
        c3 = static_cast<uint32_t>(p0);
        c0 = n0;
        c2 = n2;
    }
    return uint4{c0, c1, c2, c3};
}

// The draws of one sequence and query head. The call's words (seed, offset, threshold, head
// offset) are read from the kernel's parameters at each draw, so they hold no registers.
struct DropoutDraw {
    const DropoutParams& p;
    uint32_t k1;             // the Philox key's high word: the seed's, the sequence mixed in
    uint32_t head;           // the kernel's query head (p.head_offset added at the draw)

    // Bit s: whether key 4 * group + s is kept for query position i (one draw).
    __device__ __forceinline__ uint32_t keep4(int i, int group) const {
        const uint4 w = philox4x32_10(static_cast<uint32_t>(group), static_cast<uint32_t>(i),
                                      head + p.head_offset, p.offset, p.seed_lo, k1);
        const uint32_t threshold = p.threshold;
        return (w.x >= threshold ? 1u : 0u) | (w.y >= threshold ? 2u : 0u) |
               (w.z >= threshold ? 4u : 0u) | (w.w >= threshold ? 8u : 0u);
    }

    // Whether the pair (query position i, key position j) is kept.
    __device__ __forceinline__ uint32_t keep(int i, int j) const {
        return (keep4(i, j >> 2) >> (j & 3)) & 1u;
    }
};

__device__ __forceinline__ DropoutDraw dropout_draw(const DropoutParams& d, int seq, int head) {
    return DropoutDraw{d, d.seed_hi ^ (static_cast<uint32_t>(seq) * SEQ_MIX),
                       static_cast<uint32_t>(head)};
}

// The keep bits of a lane's elements of a warp's [16, 8 NB] C-fragment tile: element
// [nb][2 half + e] (row g + 8 half, column nb * 8 + 2t + e) is bit 2 (NB half + nb) + e.
template <int NB>
struct KeepBits {
    static_assert(NB >= 1 && NB <= 8, "4 NB keep bits per lane in one 32-bit word");
    uint32_t bits;

    __device__ __forceinline__ bool at(int nb, int i) const {
        return (bits >> (2 * (NB * (i / 2) + nb) + i % 2)) & 1u;
    }
};

// Rows are queries (positions row_pos and row_pos + 8 of rows g and g + 8), columns keys from
// position col_pos0 on: the forward. With keys from a multiple of 4 on, the 4 keys of a draw
// lie in lanes t and t ^ 1 of each row: lane parity p draws for row g + 8 p, and each lane takes
// its two keys of the other lane's draws by one shuffle per row.
template <int NB>
__device__ __forceinline__ KeepBits<NB> keep_query_rows(const DropoutDraw& d, int row_pos,
                                                        int col_pos0, int lane) {
    const int t = lane % 4;
    uint32_t bits = 0;
    if ((col_pos0 & 3) == 0) {
        const int p = t & 1;
        const int group0 = (col_pos0 >> 2) + (t >> 1);
        uint32_t mine = 0;          // nibble nb: the draw of row g + 8 p, keys of n-block nb
        // one draw at a time: unrolled, ptxas overlaps the draws and spills the accumulators
        #pragma unroll 1
        for (int nb = 0; nb < NB; ++nb) {
            mine |= d.keep4(row_pos + 8 * p, group0 + 2 * nb) << (4 * nb);
        }
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            // the draws of row g + 8 half, this lane's keys (2p, 2p + 1 of each) at bits 4 nb
            const uint32_t w = __shfl_xor_sync(FULL_WARP, mine, half ^ p) >> (2 * p);
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                bits |= ((w >> (4 * nb)) & 3u) << (2 * (NB * half + nb));
            }
        }
    } else {
        #pragma unroll 1
        for (int n = 0; n < 4 * NB; ++n) {      // bit n: half n / (2 NB), nb n / 2 % NB, e n % 2
            const int half = n / (2 * NB), nb = n / 2 % NB, e = n % 2;
            bits |= d.keep(row_pos + 8 * half, col_pos0 + nb * 8 + 2 * t + e) << n;
        }
    }
    return KeepBits<NB>{bits};
}

// Rows are keys (positions row_pos and row_pos + 8 of rows g and g + 8), columns queries from
// position col_pos0 on: the dK/dV kernel. With the warp's keys from a multiple of 4 on, the 4
// keys of a draw lie in lanes g = 4a + s (s = 0 .. 3, the same t), which hold the same query
// columns: lane s draws for row half s / 2 and column parity s % 2, and each lane takes its
// key's bit of the four lanes' draws by four shuffles.
template <int NB>
__device__ __forceinline__ KeepBits<NB> keep_key_rows(const DropoutDraw& d, int row_pos,
                                                      int col_pos0, int lane) {
    const int g = lane / 4, t = lane % 4;
    const int s = g & 3;                         // this lane's key among its draw's four
    uint32_t bits = 0;
    if (((row_pos - s) & 3) == 0) {
        const int group = ((row_pos - s) >> 2) + 2 * (s >> 1);
        const int col = col_pos0 + 2 * t + (s & 1);
        uint32_t mine = 0;          // nibble nb: the draw of query col + 8 nb, key group `group`
        #pragma unroll 1
        for (int nb = 0; nb < NB; ++nb) mine |= d.keep4(col + 8 * nb, group) << (4 * nb);
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
            // lane s = c's draws (row half c / 2, column parity c % 2), this lane's key at 4 nb
            const uint32_t w = __shfl_xor_sync(FULL_WARP, mine, 4 * (c ^ s)) >> s;
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                bits |= ((w >> (4 * nb)) & 1u) << (2 * (NB * (c >> 1) + nb) + (c & 1));
            }
        }
    } else {
        #pragma unroll 1
        for (int n = 0; n < 4 * NB; ++n) {      // bit n: half n / (2 NB), nb n / 2 % NB, e n % 2
            const int half = n / (2 * NB), nb = n / 2 % NB, e = n % 2;
            bits |= d.keep(col_pos0 + nb * 8 + 2 * t + e, row_pos + 8 * half) << n;
        }
    }
    return KeepBits<NB>{bits};
}

// Probabilities of a [16, 8 NB] tile with the dropped ones 0 (the forward: their row sums
// keep them, the kept ones are scaled once, at the output).
template <int NB>
__device__ __forceinline__ void drop_probs(float (&p)[NB][4], const KeepBits<NB>& keep) {
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (!keep.at(nb, i)) p[nb][i] = 0.f;
        }
    }
}

// What softmax_backward multiplies a pair's P (for dV) and dP by: nothing without dropout.
struct NoDropout {
    static constexpr bool ON = false;
    __device__ __forceinline__ float factor(int, int) const { return 1.f; }
};

// With dropout: 1 / (1 - p) for a kept pair, 0 for a dropped one (0 times a NaN or inf operand
// stays NaN, so a pair that sees one is NaN whether it is kept or not).
template <int NB>
struct TileDropout {
    static constexpr bool ON = true;
    KeepBits<NB> keep;
    float scale;
    __device__ __forceinline__ float factor(int nb, int i) const {
        return keep.at(nb, i) ? scale : 0.f;
    }
};

}  // namespace varlen
