// Host-emulation entry points (see host_emulation.cuh): one variant per build, chosen with
// -DEMU_T= -DEMU_D= -DEMU_BM= -DEMU_BN= -DEMU_BQ= -DEMU_SC=; each function takes the grid,
// the block size and exactly the kernel's parameters, so the Python launchers drive it
// unchanged. Compiled with g++ -x c++ -DVARLEN_HOST_EMULATION, never by NVRTC.
#include "varlen_attention.cu"

using T = EMU_T;
constexpr int D = EMU_D, BM = EMU_BM, BN = EMU_BN, BQ = EMU_BQ;
constexpr bool SC = EMU_SC;
using I = const int*;

extern "C" void emu_fwd(unsigned gx, unsigned gy, unsigned threads, const T* q, const T* k,
                        const T* v, T* out, float* lse, I q_tiles, I q_sched, I k_row, I k_len,
                        I k_pos, I sq, I sk, I wl, I wr, I br, int mk, int Tq, int Hq, int Hk,
                        float scale, float softcap) {
    launch(gx, gy, threads, [&] {
        varlen_fwd<T, D, BM, BN, SC>(q, k, v, out, lse, q_tiles, q_sched, k_row, k_len, k_pos,
                                     sq, sk, wl, wr, br, mk, Tq, Hq, Hk, scale, softcap);
    });
}

extern "C" void emu_pre(unsigned gx, unsigned gy, unsigned threads, const T* out, const T* dout,
                        const float* lse, float* delta, float* lse2, int Tq, int Hq) {
    launch(gx, gy, threads, [&] { varlen_bwd_preprocess<T, D>(out, dout, lse, delta, lse2, Tq, Hq); });
}

template <bool ATOMIC>
void dkdv(unsigned gx, unsigned gy, unsigned threads, const T* q, const T* k, const T* v,
          const T* dout, const float* lse2, const float* delta, T* dk, T* dv, float* dq_accum,
          I k_tiles, I k_sched, I q_row, I q_len, I q_pos, I sq, I sk, I wl, I wr, I br, int mq,
          int chunks, int Tq, int Hq, int Hk, float scale, float softcap) {
    launch(gx, gy, threads, [&] {
        varlen_bwd_dkdv<T, D, BN, BQ, SC, ATOMIC>(q, k, v, dout, lse2, delta, dk, dv, dq_accum,
            k_tiles, k_sched, q_row, q_len, q_pos, sq, sk, wl, wr, br, mq, chunks, Tq, Hq, Hk,
            scale, softcap);
    });
}

extern "C" void emu_dkdv_atomic(unsigned gx, unsigned gy, unsigned threads, const T* q, const T* k,
        const T* v, const T* dout, const float* lse2, const float* delta, T* dk, T* dv,
        float* dq_accum, I k_tiles, I k_sched, I q_row, I q_len, I q_pos, I sq, I sk, I wl, I wr,
        I br, int mq, int chunks, int Tq, int Hq, int Hk, float scale, float softcap) {
    dkdv<true>(gx, gy, threads, q, k, v, dout, lse2, delta, dk, dv, dq_accum, k_tiles, k_sched,
               q_row, q_len, q_pos, sq, sk, wl, wr, br, mq, chunks, Tq, Hq, Hk, scale, softcap);
}

extern "C" void emu_dkdv_plain(unsigned gx, unsigned gy, unsigned threads, const T* q, const T* k,
        const T* v, const T* dout, const float* lse2, const float* delta, T* dk, T* dv,
        float* dq_accum, I k_tiles, I k_sched, I q_row, I q_len, I q_pos, I sq, I sk, I wl, I wr,
        I br, int mq, int chunks, int Tq, int Hq, int Hk, float scale, float softcap) {
    dkdv<false>(gx, gy, threads, q, k, v, dout, lse2, delta, dk, dv, dq_accum, k_tiles, k_sched,
                q_row, q_len, q_pos, sq, sk, wl, wr, br, mq, chunks, Tq, Hq, Hk, scale, softcap);
}

extern "C" void emu_dq(unsigned gx, unsigned gy, unsigned threads, const T* q, const T* k,
                       const T* v, const T* dout, const float* lse2, const float* delta, T* dq,
                       I q_tiles, I q_sched, I k_row, I k_len, I k_pos, I sq, I sk, I wl, I wr,
                       I br, int mk, int Tq, int Hq, int Hk, float scale, float softcap) {
    launch(gx, gy, threads, [&] {
        varlen_bwd_dq<T, D, BM, BN, SC>(q, k, v, dout, lse2, delta, dq, q_tiles, q_sched, k_row,
                                        k_len, k_pos, sq, sk, wl, wr, br, mk, Tq, Hq, Hk, scale,
                                        softcap);
    });
}

extern "C" void emu_convert(unsigned gx, unsigned gy, unsigned threads, const float* acc, T* dq,
                            long long n) {
    launch(gx, gy, threads, [&] { varlen_bwd_dq_convert<T>(acc, dq, n); });
}
