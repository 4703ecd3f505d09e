"""Numba CPU kernels of the `cpu` backend: fused attention tiles, forward and backward.

Kernel source only; the launcher (dtypes, work lists, threads, BLAS scope) is `cpu_backend.py`
and the method is described in `docs/cpu_backend.md`. Every kernel reads the plan as one
`KernelView` named tuple and walks its schedule: for a query tile, the key tiles
`[begin, end)` of each key segment, the mask evaluated only outside `[full_begin, full_end)`.

Working layouts (built by `pack_rows` / `pack_grad_rows`, non-finite values replaced by 0 and
flagged per row, as docs/semantics.md asks):

* queries (and dO) `[Hk, Tq * G, D]`: the `G = Hq / Hk` query heads of a key head stacked row
  by row, so one query tile of a GQA group is one contiguous `[BM * G, D]` block and the group
  shares every K/V tile it reads;
* keys and values `[Hk, Tk, D]`: one key tile is a contiguous `[BN, D]` block.

Scores are kept key-major, `St [BN, R]` (`R = rows * G` stacked query rows), so the softmax
work (scale, mask, running max, exp, row sums) is elementwise along contiguous rows and
vectorises without a horizontal reduction. Tile products go to BLAS (`?gemm`, one call in the
calling thread) when they are large enough, else to plain loops; which one depends only on the
tile's sizes, so results are the same for any thread count.

Work items run on `nw` workers that take items longest first from a shared atomic counter; an
item writes only rows it owns (forward: one query tile of one key head; backward: a range of
one sequence's key tiles of one key head, with dQ in a partial of its own when the sequence
is cut into several ranges), so everything accumulates in a fixed order without atomics.
"""
from __future__ import annotations

import ctypes
import math
import os

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..masks import UNBOUNDED
from ..mods import EMPTY, FULL, PARTIAL
from ._philox import philox_bump, philox_round, philox_sequence_key

LOG2E = 1.4426950408889634          # 1/ln(2)
LN2 = 0.6931471805599453            # ln(2)
# Arguments of exp2 below this give 0 (2^-127 is below float32's smallest normal).
EXP2_FLOOR = -127.0
# tanh(|x|) rounds to 1 in float32 and float64 beyond this.
TANH_CLAMP = 20.0
# Keys whose probabilities the forward sums in the working dtype before it adds them to the
# softmax denominator, kept in float64 (docs/cpu_backend.md, "Accuracy").
L_BLOCK = 16
# Fast-math flags: FMA contraction, reciprocals and signed zeros only. No `nnan`/`ninf` (masked
# scores are -inf, and the non-finite rules must hold) and no `reassoc` (summation order fixed).
FASTMATH = {"contract", "arcp", "nsz"}
# IEEE division: Python's ZeroDivisionError check would keep loops from vectorising.
ERROR_MODEL = "numpy"
_OVERLOAD_OPTIONS = {"fastmath": FASTMATH, "error_model": ERROR_MODEL}


def kernel(*args, **options):
    """`numba.njit` with the kernels' error model (used as `@kernel` or `@kernel(...)`)."""
    return njit(*args, error_model=ERROR_MODEL, **options)

# Columns of the tile tables and schedules (plan.TILE_FIELDS, plan.SCHED_FIELDS).
T_SEQ, T_SEG, T_ROW, T_ROWS, T_POS = range(5)
S_BEGIN, S_FULL_BEGIN, S_FULL_END, S_END = range(4)


# --------------------------------------------------------------------------------------------
# BLAS: ?gemm of an OpenBLAS wheel or of SciPy, called by symbol so compiled kernels stay
# cacheable
# --------------------------------------------------------------------------------------------

GEMM_SYMBOLS = {"float32": "varlen_cpu_sgemm", "float64": "varlen_cpu_dgemm"}
_GEMM_ARGS = 13                      # Fortran ?gemm: every argument by pointer
_STUBS = []
_WHEEL_LIBRARY = []                  # the loaded `scipy-openblas32` library, kept alive


def _wheel_gemm():
    """`?gemm` addresses of the `scipy-openblas32` wheel's OpenBLAS (Fortran interface, 32-bit
    integers, symbols prefixed `scipy_`), or None when it is not installed. Preferred over
    SciPy's: newer OpenBLAS releases run the forward's `P^T V` tile product, 64 columns wide,
    up to a quarter faster (docs/cpu_backend.md)."""
    try:
        import scipy_openblas32 as wheel
        lib = ctypes.CDLL(os.path.join(wheel.get_lib_dir(), wheel.get_library(fullname=True)))
        addresses = {dtype: ctypes.cast(getattr(lib, "scipy_" + name), ctypes.c_void_p).value
                     for dtype, name in (("float32", "sgemm_"), ("float64", "dgemm_"))}
    except (ImportError, OSError, AttributeError, IndexError):
        return None
    _WHEEL_LIBRARY.append(lib)
    return addresses


def _scipy_gemm():
    """`?gemm` addresses of the BLAS SciPy links (the same interface), or None."""
    try:
        import scipy.linalg.cython_blas  # noqa: F401
        from numba.extending import get_cython_function_address
        return {dtype: get_cython_function_address("scipy.linalg.cython_blas", name)
                for dtype, name in (("float32", "sgemm"), ("float64", "dgemm"))}
    except (ImportError, ValueError, AttributeError):
        return None


def _bind_blas() -> bool:
    """Make the `GEMM_SYMBOLS` resolvable by the JIT linker (also for kernels loaded from the
    on-disk cache). True when they are a BLAS library's (the wheel's, else SciPy's); otherwise
    they are inert stubs and the kernels are told never to call them (`blas_min` beyond any
    tile)."""
    addresses = _wheel_gemm() or _scipy_gemm()
    bound = addresses is not None
    if not bound:
        stub = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * _GEMM_ARGS)(lambda *args: None)
        _STUBS.append(stub)
        addresses = dict.fromkeys(GEMM_SYMBOLS, ctypes.cast(stub, ctypes.c_void_p).value)
    for dtype, symbol in GEMM_SYMBOLS.items():
        llvm.add_symbol(symbol, addresses[dtype])
    return bound


BLAS_BOUND = _bind_blas()


@intrinsic
def _xgemm(typingctx, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Column-major `c = alpha op(a) op(b) + beta c` through `GEMM_SYMBOLS[c.dtype]`; `trans*`
    are the characters' codes, `a`, `b`, `c` arrays whose data pointers start the matrices."""
    dtype = c.dtype
    if dtype not in (types.float32, types.float64) or a.dtype != dtype or b.dtype != dtype:
        return None
    sig = types.void(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    symbol = GEMM_SYMBOLS[str(dtype)]

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p] * _GEMM_ARGS)
        fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
        tys = signature.args

        def by_ref(i, to):
            value = context.cast(builder, args[i], tys[i], to)
            slot = cgutils.alloca_once_value(builder, value)
            return builder.bitcast(slot, i8p)

        def char(i):
            value = builder.trunc(context.cast(builder, args[i], tys[i], types.int32),
                                  ir.IntType(8))
            return builder.bitcast(cgutils.alloca_once_value(builder, value), i8p)

        def data(i):
            arr = context.make_array(tys[i])(context, builder, args[i])
            return builder.bitcast(arr.data, i8p)

        call_args = [char(0), char(1), by_ref(2, types.int32), by_ref(3, types.int32),
                     by_ref(4, types.int32), by_ref(5, dtype), data(6), by_ref(7, types.int32),
                     data(8), by_ref(9, types.int32), by_ref(10, dtype), data(11),
                     by_ref(12, types.int32)]
        builder.call(fn, call_args)
        return context.get_dummy_value()

    return sig, codegen


_N, _T = ord("N"), ord("T")


# Products too small for a BLAS call (or no BLAS) take loop nests. Like BLAS, they form the
# product from zero and add it to `c` once, so an accumulator is rounded once per product.
#
# The inner dimension of a product is cut into chunks of at most KBLOCK, each added into `c`
# in turn: a float32 sum runs sequentially along it (BLAS's micro-kernels and the loops
# alike), and its rounding error grows with its length (docs/cpu_backend.md, "Accuracy").
KBLOCK = 128
# `mm_nn`'s chunks (the backward's dK/dV products, whose inner dimension is up to
# PRODUCT_ROWS x G stacked query rows): twice as long, half the BLAS calls.
NN_KBLOCK = 2 * KBLOCK
# `mm_nt` (the scores, forward and backward) sends products of at most this many
# multiply-adds to its loops even where BLAS is used: BLAS libraries run small products
# through kernels that sum in another order than their large ones (OpenBLAS's Skylake-X
# kernels for this transpose up to M * N = 1200, its SVE kernels up to 64^3), and the
# backward's scores must be bitwise the forward's, which are formed in products of other
# shapes (docs/cpu_backend.md, "Accuracy"). The loops and a large BLAS product both form each
# element as one FMA chain along the inner dimension where BLAS chains (`cpu_backend.blas_chains`:
# OpenBLAS's Skylake-X kernels do, its Haswell kernels, run on AMD Zen too, do not for float32).
NT_LOOPS_MAX = 64 ** 3


@kernel(fastmath=FASTMATH)
def _mm_loops(a, a_i, a_k, b, b_k, b_j, c, M, N, K, beta):
    """`c[i, j] = sum_k a[i * a_i + k * a_k] * b[k * b_k + j * b_j] (+ c[i, j] if beta)` on
    flat views."""
    for i in range(M):
        for j in range(N):
            acc = like(c, 0.0)
            for kk in range(K):
                acc += a[i * a_i + kk * a_k] * b[kk * b_k + j * b_j]
            c[i, j] = c[i, j] + acc if beta != 0 else acc


@kernel(fastmath=FASTMATH)
def _mm_nt_loops(a, b, c, k0, kn, beta, bt):
    """`c[M, N] = a[:, k0:k0 + kn] @ b[:, k0:k0 + kn].T (+ c if beta)`, with `b`'s chunk
    transposed into the scratch `bt` (at least `(kn + 1) * N`) so that a row of `c` is formed
    by vector FMAs along it, one chain per element along k (as `_mm_loops` forms it)."""
    M, N = c.shape
    t = bt[:kn * N].reshape(kn, N)                           # [kn, N]
    for j in range(N):
        for k in range(kn):
            t[k, j] = b[j, k0 + k]
    acc = bt[kn * N:kn * N + N]
    for i in range(M):
        row = acc if beta != 0 else c[i]
        fill(row, 0, N, 0)
        for k in range(kn):
            x, tk = a[i, k0 + k], t[k]
            for j in range(N):
                row[j] += x * tk[j]
        if beta != 0:
            out = c[i]
            for j in range(N):
                out[j] = out[j] + acc[j]


@kernel(cache=True)
def mm_nt(a, b, c, beta, blas_min, bt):
    """Row-major `c[M, N] = a[M, K] @ b[N, K].T (+ c if beta)`; contiguous operands, `bt`
    scratch of at least `(KBLOCK + 1) * N` (`_mm_nt_loops`)."""
    M, K = a.shape
    N = b.shape[0]
    for k0 in range(0, max(K, 1), KBLOCK):
        kn, bk = min(KBLOCK, K - k0), beta if k0 == 0 else 1.0
        if M * N * kn >= blas_min and M * N * kn > NT_LOOPS_MAX:
            _xgemm(_T, _N, N, M, kn, 1.0, b[:, k0:], K, a[:, k0:], K, bk, c, N)
        elif M > 0 and N > 0:
            _mm_nt_loops(a, b, c, k0, kn, bk, bt)


@kernel(cache=True)
def mm_nn(a, b, c, beta, blas_min):
    """Row-major `c[M, N] = a[M, K] @ b[K, N] (+ c if beta)`; contiguous operands. Its inner
    dimension is a backward product's stacked query rows (dV's `P dO`, dK's `dS Q`), cut into
    chunks of NN_KBLOCK."""
    M, K = a.shape
    N = b.shape[1]
    for k0 in range(0, max(K, 1), NN_KBLOCK):
        kn, bk = min(NN_KBLOCK, K - k0), beta if k0 == 0 else 1.0
        if M * N * kn >= blas_min:
            _xgemm(_N, _N, N, M, kn, 1.0, b[k0:], N, a[:, k0:], K, bk, c, N)
        elif M > 0 and N > 0:
            _mm_loops(a.ravel()[k0:], K, 1, b.ravel()[k0 * N:], N, 1, c, M, N, kn, bk)


@kernel(cache=True)
def mm_tn(a, b, c, beta, blas_min):
    """Row-major `c[M, N] = a[K, M].T @ b[K, N] (+ c if beta)`; contiguous operands. Its inner
    dimension is a product's keys (the forward's `P^T V`, the backward's `dS^T K`), at most
    PRODUCT_KEYS or a key tile: not cut into KBLOCK chunks."""
    K, M = a.shape
    N = b.shape[1]
    if M * N * K >= blas_min:
        _xgemm(_N, _T, N, M, K, 1.0, b, N, a, M, beta, c, N)
    elif M > 0 and N > 0:
        _mm_loops(a.ravel(), 1, M, b.ravel(), N, 1, c, M, N, K, beta)


# --------------------------------------------------------------------------------------------
# Small intrinsics: bit casts for exp2, an atomic counter for the work queue
# --------------------------------------------------------------------------------------------

def _bit_cast(name, casts, doc):
    """An intrinsic `name(x)` that reinterprets the bits of `x`, of a type in `casts`, as
    `casts[type of x]` (`(Numba type, LLVM type)` of the same width)."""
    def typer(typingctx, x):
        if x not in casts:
            return None
        result, llvm_type = casts[x]

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_type)
        return result(x), codegen
    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


# float and int types of the same width, as (Numba type, LLVM type) pairs
_WIDTHS = [((types.float32, ir.FloatType()), (types.int32, ir.IntType(32))),
           ((types.float64, ir.DoubleType()), (types.int64, ir.IntType(64)))]

_bits_to_float = _bit_cast(
    "_bits_to_float", {i[0]: f for f, i in _WIDTHS},
    "The float whose bit pattern is `x`: a float32 for an int32, a float64 for an int64.")

float_bits = _bit_cast(
    "float_bits", {f[0]: i for f, i in _WIDTHS},
    """The bit pattern of `x`: an int32 for a float32, an int64 for a float64. For `x >= 0`
    the patterns order as the values do, and a maximum of them vectorises without fast-math
    flags (the packing kernels' largest magnitudes).""")


@intrinsic
def fetch_add(typingctx, counter, index, value):
    """Atomically `old = counter[index]; counter[index] += value; return old` (int64)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], arr, [idx])
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")
    return types.int64(counter, index, value), codegen


def like(x, value):
    """`value` in the float type of `x` (a float scalar or array): constants in kernels that
    serve float32 and float64 (a bare literal would promote float32 arithmetic to float64)."""


@overload(like)
def _like_impl(x, value):
    ty = x.dtype if isinstance(x, types.Array) else x
    if ty == types.float32:
        return lambda x, value: np.float32(value)
    if ty == types.float64:
        return lambda x, value: np.float64(value)
    return None


def exp2(x):
    """`2 ** x` (masked scores: -inf -> 0); float32: a polynomial that vectorises, float64:
    libm."""


@kernel(fastmath=FASTMATH)
def _exp2_parts(x):
    """float32 `(2^n, f * q(f))` with `2^x = 2^n (1 + f q(f))`: Cody-Waite, `x = n + f`,
    `|f| <= 1/2`, Cephes exp2f's polynomial (rel. err ~2e-8), 2^n built in the exponent bits;
    `x` is clamped to [-127, 127] and n = -127 gives 2^n = 0 exactly."""
    x = min(max(x, np.float32(EXP2_FLOOR)), np.float32(-EXP2_FLOOR))
    n = np.floor(x + np.float32(0.5))
    f = x - n
    p = np.float32(1.535336188319500e-4)
    p = p * f + np.float32(1.339887440266574e-3)
    p = p * f + np.float32(9.618437357674640e-3)
    p = p * f + np.float32(5.550332471162809e-2)
    p = p * f + np.float32(2.402264791363012e-1)
    p = p * f + np.float32(6.931472028550421e-1)
    return _bits_to_float(np.int32((np.int32(n) + np.int32(127)) << np.int32(23))), p * f


@overload(exp2, jit_options=_OVERLOAD_OPTIONS)
def _exp2_impl(x):
    if x == types.float32:
        def impl(x):
            two_n, fq = _exp2_parts(x)
            return two_n + two_n * fq
        return impl
    if x == types.float64:
        return lambda x: np.exp2(x)
    return None


# Taylor coefficients of (2^f - 1) / f = sum_k ln2^k f^(k-1) / k!, k = 1 .. 10
_E1, _E2, _E3, _E4, _E5, _E6, _E7, _E8, _E9, _E10 = (
    LN2 ** k / math.factorial(k) for k in range(1, 11))


@kernel(fastmath=FASTMATH)
def _exp2m1_f64(x):
    """float64 `2^x - 1` for `-60 <= x <= 0` that vectorises: `x = n + f`, `|f| <= 1/2`,
    `2^f - 1 = f q(f)` by its Taylor series to degree 10 (rel. err < 1e-11), no cancellation
    near 0."""
    n = np.floor(x + 0.5)
    f = x - n
    q = ((((((((_E10 * f + _E9) * f + _E8) * f + _E7) * f + _E6) * f + _E5) * f + _E4) * f
          + _E3) * f + _E2) * f + _E1
    two_n = _bits_to_float((np.int64(n) + np.int64(1023)) << np.int64(52))
    return (two_n - 1.0) + two_n * (f * q)          # n = 0: exactly f q(f), no branch


def softcap_score(s, c, cap):
    """`(cap * tanh(s * c), 1 - tanh(s * c)^2)` in the dtype of `s`, for the softcap: float32
    computes in float64 (rounded once at the end, as a float32 tanh would be), float64 with
    libm's tanh."""


@overload(softcap_score, jit_options=_OVERLOAD_OPTIONS)
def _softcap_score_impl(s, c, cap):
    if s == types.float32:
        def impl(s, c, cap):
            y = np.float64(s) * c
            em = _exp2m1_f64(min(abs(y), TANH_CLAMP) * (-2.0 * LOG2E))   # e^(-2|y|) - 1
            t = -em / (2.0 + em)
            return np.float32(cap * math.copysign(t, y)), np.float32((1.0 - t) * (1.0 + t))
        return impl
    if s == types.float64:
        def impl(s, c, cap):
            t = np.tanh(s * c)
            return cap * t, (1.0 - t) * (1.0 + t)
        return impl
    return None


# --------------------------------------------------------------------------------------------
# The mask predicate (varlen.masks.visible / key_band / query_band), one home for Numba
# --------------------------------------------------------------------------------------------

@kernel
def shift_of(pv, b):
    """`(Lk - Lq) * bottom_right` of sequence `b`."""
    return (np.int64(pv.seqlen_k[b]) - np.int64(pv.seqlen_q[b])) * np.int64(pv.bottom_right[b])


@kernel
def visible(i, j, shift, left, right):
    """Query position `i` sees key position `j` (masks.visible with `shift` precomputed)."""
    return (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)


@kernel
def key_band(i, shift, left, right):
    """`(lo, hi)`: query `i` sees exactly the keys `lo <= j <= hi` (masks.key_band)."""
    lo = -UNBOUNDED if left < 0 else i + shift - left
    hi = UNBOUNDED if right < 0 else i + shift + right
    return lo, hi


@kernel
def query_band(j, shift, left, right):
    """`(lo, hi)`: key `j` is seen by exactly the queries `lo <= i <= hi` (masks.query_band)."""
    lo = -UNBOUNDED if right < 0 else j - shift - right
    hi = UNBOUNDED if left < 0 else j - shift + left
    return lo, hi


@kernel
def stacked_band(jpos, qpos0, rows, G, shift, left, right):
    """Stacked rows `[lo, hi)` (row = query * G + head) of a query tile whose first query is
    at position `qpos0` that see the key at `jpos`."""
    qlo, qhi = query_band(jpos, shift, left, right)
    tlo = max(qlo - qpos0, 0)
    thi = min(qhi - qpos0, rows - 1)
    if thi < tlo:
        return 0, 0
    return tlo * G, (thi + 1) * G


@kernel(cache=True)
def visible_pairs(pv, i, j, b):
    """The predicate for arrays of positions (for tests: the njit mirror of masks.visible)."""
    out = np.zeros(i.size, np.bool_)
    for n in range(i.size):
        s = shift_of(pv, b[n])
        out[n] = visible(i[n], j[n], s, pv.window_left[b[n]], pv.window_right[b[n]])
    return out


# --------------------------------------------------------------------------------------------
# Packing: working layouts, non-finite values replaced by 0 and flagged per row
# --------------------------------------------------------------------------------------------

# Packing and unpacking run in the calling thread: they move O(T H D) values, a parallel launch
# would cost more than it saves on small calls and little on large ones.

@kernel(parallel=True, cache=True)
def pack_rows(x, G, out, flag, top):
    """`x [T, Hk * G, d]` -> `out [Hk, T * G, d]` (working dtype), `flag [Hk, T * G]` and
    `top [Hk, T * G]`, the bit pattern (`float_bits`) of the row's largest finite magnitude:
    the launcher's bound on what the products can reach. Rows in parallel: each writes only
    its own elements."""
    T, H, d = x.shape
    zero = like(out, 0.0)
    for t in prange(T):
        for h in range(H):
            kh, g = h // G, h % G
            r = t * G + g
            bad = False
            m = float_bits(zero)
            for e in range(d):
                v = x[t, h, e]
                ok = np.isfinite(v)
                bad |= not ok
                v = v if ok else zero
                out[kh, r, e] = v
                m = max(m, float_bits(abs(v)))
            flag[kh, r] = bad
            top[kh, r] = m


@kernel(fastmath=FASTMATH)
def _dot64(x, y):
    """`sum_e x[e] * y[e]` in float64 (each product exact for float32 inputs) in four
    interleaved partial sums added pairwise: a fixed order, and four independent chains where
    one would wait on each add."""
    d = x.size
    s0 = s1 = s2 = s3 = 0.0
    full = d - d % 4
    for e in range(0, full, 4):
        s0 += np.float64(x[e]) * np.float64(y[e])
        s1 += np.float64(x[e + 1]) * np.float64(y[e + 1])
        s2 += np.float64(x[e + 2]) * np.float64(y[e + 2])
        s3 += np.float64(x[e + 3]) * np.float64(y[e + 3])
    for e in range(full, d):
        s0 += np.float64(x[e]) * np.float64(y[e])
    return (s0 + s2) + (s1 + s3)


@kernel(parallel=True, cache=True)
def pack_grad_rows(dout, o, lse, G, dout_w, delta, lse2, lse2_lo, flag, top):
    """Backward query side: `dout_w [Hk, Tq * G, Dv]` as `pack_rows`, `delta = rowsum(dO * O)`
    (float64, `_dot64`; 0 on a row whose dout or out is not finite, which is flagged), `lse *
    log2(e)` as the working-dtype pair `lse2 + lse2_lo` (the product in float64, split;
    `lse2 = +inf` where lse is not finite, so such a row's P is 0), `flag` raised where dout,
    out or lse of the row is not finite (OR-ed into `flag`), and `top [2, Hk, Tq * G]` the
    row's largest finite magnitudes of dout and out (as `pack_rows`'). Rows in parallel, each
    summed in a fixed order."""
    T, H, d = dout.shape
    zero = like(dout_w, 0.0)
    for t in prange(T):
        for h in range(H):
            kh, g = h // G, h % G
            r = t * G + g
            bad = False
            m_a = m_b = float_bits(zero)
            a_row, b_row, w_row = dout[t, h], o[t, h], dout_w[kh, r]
            # no short-circuit `and` here: a branch would keep the loop from vectorising
            for e in range(d):
                a, b = a_row[e], b_row[e]
                ok_a, ok_b = np.isfinite(a), np.isfinite(b)
                bad |= not ok_a
                bad |= not ok_b
                a = a if ok_a else zero
                w_row[e] = a
                m_a = max(m_a, float_bits(abs(a)))
                m_b = max(m_b, float_bits(abs(b if ok_b else zero)))
            # delta cancels against dP: float64
            delta[kh, r] = 0.0 if bad else _dot64(w_row, b_row)
            top[0, kh, r], top[1, kh, r] = m_a, m_b
            s = lse[h, t]
            if np.isfinite(s):
                x = np.float64(s) * LOG2E
                lse2[kh, r] = x
                lse2_lo[kh, r] = x - np.float64(lse2[kh, r])
            else:
                lse2[kh, r] = np.inf
                lse2_lo[kh, r] = 0
                bad = True
            if bad:
                flag[kh, r] = True


@kernel(parallel=True, cache=True)
def zero_rows(a, b, c):
    """Zero three `[H, rows, d]` arrays, rows in parallel."""
    for t in prange(a.shape[0] * a.shape[1]):
        fill(a[t // a.shape[1], t % a.shape[1]], 0, a.shape[2], 0)
    for t in prange(b.shape[0] * b.shape[1]):
        fill(b[t // b.shape[1], t % b.shape[1]], 0, b.shape[2], 0)
        fill(c[t // c.shape[1], t % c.shape[1]], 0, c.shape[2], 0)


@kernel(cache=True)
def flag_prefix(flag):
    """`[Hk, n + 1]` running count of raised flags: a tile's flags in O(1)."""
    Hk, n = flag.shape
    out = np.zeros((Hk, n + 1), np.int64)
    for h in range(Hk):
        for i in range(n):
            out[h, i + 1] = out[h, i] + flag[h, i]
    return out


# --------------------------------------------------------------------------------------------
# Forward: one query tile of one key head (its G query heads stacked), FlashAttention-2
# --------------------------------------------------------------------------------------------

@kernel
def fill(x, start, stop, value):
    """`x[start:stop] = value` for a 1-D array, as a plain loop (cheaper to compile than a
    slice assignment)."""
    for i in range(start, stop):
        x[i] = value


@kernel(fastmath=FASTMATH)
def _scores_pass(S, n, lo, hi, c, cap, tile_max):
    """Scores in the log2 domain from the products `s = q . k` in `S[:n]`: `cap * tanh(s * c)`
    under softcap, else `s * c`, -inf outside each key's rows `[lo[j], hi[j])`; `tile_max`
    gets the per-row maximum of the scores. Returns whether `S` holds the scores; it keeps the
    products (masked: -inf) where `c > 0` without softcap, and the exp pass scales them: a
    maximum of them times `c` is the maximum of the scores, rounding being monotonic."""
    # Loops run over views from 0 so that Numba's index wraparound folds away and they vectorise.
    scaled = cap > 0 or not c > 0
    for j in range(n):
        a, z = lo[j], hi[j]
        row = S[j]
        fill(row, 0, a, -np.inf)
        fill(row, z, row.size, -np.inf)
        seg, top = row[a:z], tile_max[a:z]
        if cap > 0:
            for i in range(seg.size):
                x, _ = softcap_score(seg[i], c, cap)
                seg[i] = x
                top[i] = max(top[i], x)
        elif scaled:
            cw = like(S, c)
            for i in range(seg.size):
                x = seg[i] * cw
                seg[i] = x
                top[i] = max(top[i], x)
        else:
            for i in range(seg.size):
                top[i] = max(top[i], seg[i])
    if not scaled:
        cw = like(S, c)
        for i in range(tile_max.size):
            tile_max[i] *= cw
    return scaled


@kernel
def _key_bands(lo, hi, n, first, fbegin, fend, block_n, jpos0, qpos0, rows, G, shift, left,
               right):
    """Visible stacked rows `[lo[j], hi[j])` of a query tile for keys `j < n` of consecutive
    key tiles from tile `first` on: all rows in the schedule's full tiles, the predicate's band
    elsewhere."""
    R = rows * G
    for j in range(n):
        u = first + j // block_n
        if fbegin <= u < fend:
            lo[j], hi[j] = 0, R
        else:
            lo[j], hi[j] = stacked_band(jpos0 + j, qpos0, rows, G, shift, left, right)


@kernel
def _chunk_range(sched, first, count, r):
    """`(begin, full_begin, full_end, end)` of tiles `first .. first + count` against segment
    `r`: the union of what they visit, the intersection of what is full for each."""
    begin, end = sched[first, r, S_BEGIN], sched[first, r, S_END]
    fbegin, fend = sched[first, r, S_FULL_BEGIN], sched[first, r, S_FULL_END]
    for t in range(first + 1, first + count):
        b, e = sched[t, r, S_BEGIN], sched[t, r, S_END]
        if e > b:
            begin, end = (b, e) if end <= begin else (min(begin, b), max(end, e))
        fbegin = max(fbegin, sched[t, r, S_FULL_BEGIN])
        fend = min(fend, sched[t, r, S_FULL_END])
    for t in range(first, first + count):
        if sched[t, r, S_END] <= sched[t, r, S_BEGIN]:     # a tile that sees none of them
            fend = fbegin
    if fend <= fbegin:
        fbegin = fend = end
    return begin, fbegin, fend, end


@kernel
def trim(lo, hi, n):
    """The part of a product that holds visible pairs: `(j_first, j_end, row_first, row_end)`
    over keys `j < n` with bands `[lo[j], hi[j])`; bands become relative to `row_first` and
    move to index 0. Empty: `j_end <= j_first`."""
    j_first, j_end, r_first, r_end = n, 0, 1 << 62, 0
    for j in range(n):
        if hi[j] > lo[j]:
            j_first = min(j_first, j)
            j_end = j + 1
            r_first = min(r_first, lo[j])
            r_end = max(r_end, hi[j])
    for j in range(j_first, j_end):
        lo[j - j_first] = min(max(lo[j] - r_first, 0), r_end - r_first)
        hi[j - j_first] = max(min(hi[j] - r_first, r_end - r_first), lo[j - j_first])
    return j_first, j_end, r_first, r_end


@kernel(fastmath=FASTMATH)
def _forward_product(Qb, Kb, Vb, O, m, l, lp, tmax, lo, hi, S_buf, T_buf, c, cap, blas_min, M,
                     use_m, md, G, kh, b, qpos, kpos, row_flag, dp):
    """One product of the online softmax (FlashAttention-2, Alg. 1, lines 6-10), in the log2
    domain: the rows of `Qb [R, D]` against keys `Kb [n, D]` whose visible rows are
    `[lo[j], hi[j])`; updates `O [R, Dv]`, the running max `m` and the float64 sum `l`
    (`lp`: scratch for the partial sums of L_BLOCK keys, zero on entry and on exit; `T_buf`:
    `mm_nt`'s). `M` ... `row_flag`: the user functions' part (`_scores`); `dp`: the call's
    dropout (`dropout_rows`) or None."""
    n, R = Kb.shape[0], Qb.shape[0]
    S = S_buf[:n * R].reshape(n, R)                         # [keys, R] key-major scores
    mm_nt(Kb, Qb, S, 0.0, blas_min, T_buf)
    fill(tmax, 0, R, -np.inf)
    scaled = _scores(S, n, lo, hi, M, use_m, md, c, cap, tmax, G, kh, b, qpos, kpos, row_flag)
    cw = like(S, 1.0) if scaled else like(S, c)
    _online_softmax(S, n, R, Vb, O, m, l, lp, tmax, blas_min, cw)
    if dp is not None:              # FlashAttention 2: l sums P, O sums (P * keep / (1-p)) V
        dropout_rows(S, n, R, dp, G, kh, b, qpos, kpos, np.zeros((0, R), np.bool_))
    mm_tn(S, Vb, O, 1.0, blas_min)


@kernel(fastmath=FASTMATH)
def _online_softmax(S, n, R, Vb, O, m, l, lp, tmax, blas_min, cw):
    """The online softmax update of one product from its log2-domain scores `S [n, R]` times
    `cw` (1, or `c` where the score pass kept the raw products) and their row maxima `tmax`
    (FlashAttention-2, Alg. 1, lines 8-10): rescale `O`, `l` by the new running max `m`,
    `S <- P`, `l += rowsum(P)` (in L_BLOCK partial sums); the caller adds `P^T V` to `O`."""
    zero = like(O, 0.0)
    for i in range(R):
        mn = max(m[i], tmax[i])
        ms = mn if mn > -np.inf else zero
        alpha = exp2(m[i] - ms)
        m[i] = mn
        tmax[i] = ms
        l[i] *= alpha
        if alpha != 1:
            for e in range(O.shape[1]):
                O[i, e] *= alpha
    for j in range(n):
        row = S[j]
        if j % L_BLOCK == L_BLOCK - 1 or j == n - 1:      # a block's last key: its sum to l
            for i in range(R):
                p = exp2(row[i] * cw - tmax[i])
                row[i] = p
                l[i] += lp[i] + p
                lp[i] = 0
        else:
            for i in range(R):
                p = exp2(row[i] * cw - tmax[i])
                row[i] = p
                lp[i] += p


@kernel
def _reset_rows(O_buf, m, l, lp, row_flag, R, Dv):
    """Clear a forward item's running output, max, sums and flags for `R` stacked rows."""
    fill(O_buf, 0, R * Dv, 0)
    fill(m, 0, R, -np.inf)
    fill(l, 0, R, 0)
    fill(lp, 0, R, 0)
    fill(row_flag, 0, R, False)


@kernel
def _flag_keys(row_flag, k_cum, j0, jn, lo, hi, M, use_m):
    """Flag the rows that see one of the keys `j0 .. j0 + jn` flagged non-finite (`k_cum`:
    the key head's flag prefix; key j is visible to rows `lo[j] .. hi[j]` of `row_flag`, and
    there, when `use_m`, to those `M` leaves visible)."""
    if k_cum[j0 + jn] != k_cum[j0]:
        for j in range(jn):
            if k_cum[j0 + j + 1] != k_cum[j0 + j]:
                if not use_m:
                    fill(row_flag, lo[j], hi[j], True)
                    continue
                for i in range(lo[j], hi[j]):
                    if M[j, i] != 0:
                        row_flag[i] = True


@kernel(fastmath=FASTMATH)
def _write_rows(out, lse, O, m, l, q_flag, row_flag, kh, t0, rows, G):
    """Write a forward item's `rows` query rows from packed row `t0` (key head `kh`, `G` query
    heads each) into `out [Tq, Hq, Dv]` and `lse [Hq, Tq]` (natural log): NaN where a
    non-finite value reached the row, 0 and -inf where it saw no key, else `O / l`."""
    Dv = out.shape[2]
    for t in range(rows):
        for g in range(G):
            i = t * G + g
            h = kh * G + g
            seen = l[i] > 0
            if (seen and q_flag[t0 * G + i]) or row_flag[i]:
                fill(out[t0 + t, h], 0, Dv, np.nan)
                lse[h, t0 + t] = np.nan
            elif seen:
                inv = 1.0 / l[i]
                for e in range(Dv):
                    out[t0 + t, h, e] = O[i, e] * inv
                lse[h, t0 + t] = (np.float64(m[i]) + math.log2(np.float64(l[i]))) * LN2
            else:
                fill(out[t0 + t, h], 0, Dv, 0)
                lse[h, t0 + t] = -np.inf


@kernel(cache=True, fastmath=FASTMATH)
def forward_tile(pv, item, chunks, kstep, Qw, Kw, Vw, q_flag, k_cum, c, cap, blas_min, out, lse,
                 ws, M_buf, md, dp):
    """Query tiles `chunks[item // Hk]` (first slot, count: consecutive tiles of one segment)
    of key head `item % Hk`: writes their rows of `out [Tq, Hq, Dv]` and `lse [Hq, Tq]`.

    The key tiles any of them visits make the products: up to `kstep` consecutive tiles that
    are full for every query tile of the chunk in one product, each partially masked tile in
    its own, cut to the keys and the rows that hold a visible pair (`trim`).
    `c`, `cap`: see `_scores_pass`. `ws` is the worker's scratch (`forward_scratch`); `md` the
    call's user functions or None, `M_buf` the scratch of their visibility ("User functions":
    with them, the tiles' classes come from the plan's and EMPTY ones are skipped). `dp`: the
    call's dropout or None (`dropout_rows`).
    """
    S_buf, O_buf, m, l, lp, tmax, row_flag, lo, hi, T_buf = ws
    Hk = Kw.shape[0]
    Dv = Vw.shape[2]
    G = out.shape[1] // Hk
    BN = pv.block_n
    first, count, kh = chunks[item // Hk, 0], chunks[item // Hk, 1], item % Hk
    b = pv.q_tiles[first, T_SEQ]
    t0, qpos0 = pv.q_tiles[first, T_ROW], pv.q_tiles[first, T_POS]
    last = first + count - 1
    rows = pv.q_tiles[last, T_ROW] + pv.q_tiles[last, T_ROWS] - t0
    R = rows * G
    Qb = Qw[kh, t0 * G:(t0 + rows) * G]                      # [R, D]
    O = O_buf[:R * Dv].reshape(R, Dv)                       # [R, Dv]
    _reset_rows(O_buf, m, l, lp, row_flag, R, Dv)
    shift = shift_of(pv, b)
    left, right = pv.window_left[b], pv.window_right[b]
    for r in range(pv.mk):
        begin, fbegin, fend, end = _chunk_range(pv.q_sched, first, count, r)
        kt = begin
        while kt < end:
            kind = _chunk_class(md, pv.q_sched, first, count, r, kt, fbegin, fend)
            if kind == EMPTY:
                kt += 1
                continue
            stop = kt + 1
            if kind == FULL:
                while stop < min(kt + kstep, end) and _chunk_class(
                        md, pv.q_sched, first, count, r, stop, fbegin, fend) == FULL:
                    stop += 1
            off = kt * BN
            n = min(stop * BN, pv.k_len[b, r]) - off
            fb, fe = (kt, stop) if kind == FULL else (end, end)
            _key_bands(lo, hi, n, kt, fb, fe, BN, pv.k_pos[b, r] + off, qpos0, rows, G, shift,
                       left, right)
            tile = kt
            kt = stop
            ja, jz, ra, rz = trim(lo, hi, n)
            if jz <= ja:
                continue
            j0 = pv.k_row[b, r] + off + ja
            jn, Rr = jz - ja, rz - ra
            kpos = np.int64(pv.k_pos[b, r]) + off + ja
            qpos = np.int64(qpos0) + ra // G
            M = _visibility(M_buf, jn, Rr)                  # [keys, R]
            use_m = _mask_forward(M, jn, lo, hi, ra, rz, np.int64(t0), G, pv, first, count, r,
                                  tile, b, qpos, kpos, kind, md)
            _forward_product(Qb[ra:rz], Kw[kh, j0:j0 + jn], Vw[kh, j0:j0 + jn], O[ra:rz],
                             m[ra:rz], l[ra:rz], lp[ra:rz], tmax[ra:rz], lo, hi, S_buf, T_buf,
                             c, cap, blas_min, M, use_m, md, G, kh, b, qpos, kpos,
                             row_flag[ra:rz], dp)
            _flag_keys(row_flag[ra:rz], k_cum[kh], j0, jn, lo, hi, M, use_m)
    _write_rows(out, lse, O, m, l, q_flag[kh], row_flag, kh, t0, rows, G)


@kernel(cache=True)
def forward_scratch(dtype_probe, rows_max, keys_max, Dv):
    """One worker's scratch for `forward_tile`: `(S, O, m, l (float64), partial sums,
    tile max, row flags, lo, hi, mm_nt's)`."""
    dt = dtype_probe.dtype
    return (np.empty(keys_max * rows_max, dt), np.empty(rows_max * Dv, dt),
            np.empty(rows_max, dt), np.empty(rows_max, np.float64), np.empty(rows_max, dt),
            np.empty(rows_max, dt), np.zeros(rows_max, np.bool_), np.zeros(keys_max, np.int64),
            np.zeros(keys_max, np.int64), np.empty((KBLOCK + 1) * rows_max, dt))


@kernel(parallel=True, cache=True)
def forward(pv, order, chunks, nw, kstep, rows_max, Qw, Kw, Vw, q_flag, k_cum, c, cap, blas_min,
            out, lse, md, dp):
    """Every item of `order` (longest first) on `nw` workers: see `forward_tile`;
    `rows_max` bounds a chunk's stacked rows; `md`: the call's user functions, or None; `dp`:
    the call's dropout, or None."""
    counter = np.zeros(1, np.int64)
    for _ in prange(nw):
        ws = forward_scratch(Qw, rows_max, kstep * pv.block_n, Vw.shape[2])
        M_buf = visibility_scratch(md, kstep * pv.block_n * rows_max)
        t = fetch_add(counter, 0, 1)
        while t < order.size:
            forward_tile(pv, order[t], chunks, kstep, Qw, Kw, Vw, q_flag, k_cum, c, cap,
                         blas_min, out, lse, ws, M_buf, md, dp)
            t = fetch_add(counter, 0, 1)


# --------------------------------------------------------------------------------------------
# Dropout: the Philox 4x32-10 keep bits of `varlen.dropout`, drawn inside the products
# --------------------------------------------------------------------------------------------

# The round and key schedule are shared with the Numba CUDA kernels (`_philox.py`). Numba keys
# this module's disk cache on this file alone, so this line names the digest of the shared one
# (sha256, first 16 hex digits): an edit there fails tests/test_dropout.py until the digest here
# is updated, and that edit invalidates the cache of the kernels compiled with the old rounds.
PHILOX_SOURCE_SHA256 = "f859b22fd39c3de0"
_philox_round = kernel(inline="always")(philox_round)
_philox_bump = kernel(inline="always")(philox_bump)
_philox_sequence_key = kernel(inline="always")(philox_sequence_key)


@kernel
def philox_keys(k0, k1):
    """The ten round keys `(ks0, ks1)` (uint32 `[10]`) of key `(k0, k1)`: round r's is the key
    bumped r times by `(PHILOX_W0, PHILOX_W1)`."""
    ks0, ks1 = np.empty(10, np.uint32), np.empty(10, np.uint32)
    a, b = np.uint32(k0), np.uint32(k1)
    for r in range(10):
        ks0[r], ks1[r] = a, b
        a, b = _philox_bump(a, b)
    return ks0, ks1


@kernel
def philox_words(W, c0, c1, c2, c3, ks0, ks1):
    """`W [4, R]` (uint32) <- Philox 4x32-10 of counters `(c0, c1[i], c2[i], c3)`, round keys
    `philox_keys(...)`: `varlen.dropout.philox4x32_10`, bit for bit. A plain loop over i
    that vectorises (the products are 32 x 32 -> 64 bits of zero-extended words)."""
    W0, W1, W2, W3 = W[0], W[1], W[2], W[3]
    for i in range(c1.size):
        w0, w1, w2, w3 = c0, c1[i], c2[i], c3
        for r in range(10):
            w0, w1, w2, w3 = _philox_round(w0, w1, w2, w3, ks0[r], ks1[r])
        W0[i], W1[i], W2[i], W3[i] = w0, w1, w2, w3


@kernel(fastmath=FASTMATH)
def _drop_row(x, w, thr, sw, zero):
    for i in range(x.size):
        x[i] = x[i] * sw if w[i] >= thr else zero


@kernel(fastmath=FASTMATH)
def _drop_row_bits(x, w, thr, sw, zero, bits):
    for i in range(x.size):
        keep = w[i] >= thr
        bits[i] = keep
        x[i] = x[i] * sw if keep else zero


@kernel(fastmath=FASTMATH)
def dropout_rows(X, n, R, dp, G, kh, b, qpos, kpos, bits):
    """`X [n, R]` (keys x stacked rows, row `i` = query `qpos + i // G` of head
    `kh * G + i % G`; key `j` at position `kpos + j`) times `scale` where the pair is kept and
    0 where it is dropped (`varlen.dropout`'s rule: one Philox draw per four keys of a row);
    the keep bits also go to `bits [n, R]` unless it is empty. `dp = (threshold, seed lo,
    seed hi, offset, scale, head offset)`: four uint64 words, a float, a uint64 word (the
    global head of local head 0, `Dropout.head_offset`)."""
    thr_, k0, seed_hi, off_, scale, h0 = dp
    thr, off = np.uint32(thr_), np.uint32(off_)
    sw, zero = like(X, scale), like(X, 0.0)
    ks0, ks1 = philox_keys(k0, _philox_sequence_key(seed_hi, b))
    c1 = np.empty(R, np.uint32)                        # query position of each stacked row
    c2 = np.empty(R, np.uint32)                        # its query head
    for i in range(R):
        t = i // G
        c1[i] = np.uint32(qpos + t)
        c2[i] = np.uint32(h0 + np.uint64(kh * G + i - t * G))
    W = np.empty((4, R), np.uint32)
    store = bits.size > 0
    for g in range(kpos >> 2, (kpos + n + 3) >> 2):
        philox_words(W, np.uint32(g), c1, c2, off, ks0, ks1)
        for lane in range(4):
            j = g * 4 + lane - kpos
            if 0 <= j < n:
                if store:
                    _drop_row_bits(X[j], W[lane], thr, sw, zero, bits[j])
                else:
                    _drop_row(X[j], W[lane], thr, sw, zero)


@kernel(fastmath=FASTMATH)
def apply_bits(X, n, bits, scale):
    """`X [n, R]` times `scale` where `bits` keeps the pair, 0 elsewhere (`dropout_rows`'
    bits of the same product)."""
    sw = like(X, scale)
    zero = like(X, 0.0)
    for j in range(n):
        xr, br = X[j], bits[j]
        for i in range(xr.size):
            xr[i] = xr[i] * sw if br[i] else zero


@kernel
def dropout_bits(dp, size):
    """A product's keep-bit scratch (`size` pairs): empty for a call without dropout."""
    if dp is None:
        return np.zeros(0, np.bool_)
    return np.zeros(size, np.bool_)


# --------------------------------------------------------------------------------------------
# Backward: key tiles of one sequence (all or a part) of one key head, every visible (key
# tile, query tile) pair once
# --------------------------------------------------------------------------------------------

# Stacked dQ rows per parallel block of `reduce_partials`.
REDUCE_ROWS = 256

@kernel(fastmath=FASTMATH)
def _grad_pass(S, dP, n, lo, hi, lse2, lse2_lo, delta, one_cum, c, cap, scale):
    """`S <- P = 2^(s - lse2 - lse2_lo)` and `dP <- dS = P (dP - delta) scale` (times
    `1 - tanh^2` under softcap), both 0 outside each key's rows `[lo[j], hi[j])`
    (FlashAttention-2, Alg. 2, lines 11-14); scores as in `_scores_pass`. A row that sees one
    key in its whole sequence (row i where `one_cum[i + 1] != one_cum[i]`) has the softmax of
    one score: P = 1 and dS = 0 exactly (dP - delta cancels only to rounding when
    delta = rowsum(dO * O) is formed apart)."""
    sw = like(S, scale)
    for j in range(n):
        a, z = lo[j], hi[j]
        s_row, d_row = S[j], dP[j]
        fill(s_row, 0, a, 0)
        fill(s_row, z, s_row.size, 0)
        fill(d_row, 0, a, 0)
        fill(d_row, z, d_row.size, 0)
        ps, ds, l2, l2lo, dl = s_row[a:z], d_row[a:z], lse2[a:z], lse2_lo[a:z], delta[a:z]
        if cap > 0:
            for i in range(ps.size):
                x, sech2 = softcap_score(ps[i], c, cap)
                p = exp2((x - l2[i]) - l2lo[i])
                ps[i] = p
                ds[i] = p * (ds[i] - dl[i]) * (sech2 * sw)
        else:
            cw = like(S, c)
            for i in range(ps.size):
                p = exp2((ps[i] * cw - l2[i]) - l2lo[i])
                ps[i] = p
                ds[i] = p * (ds[i] - dl[i]) * sw
    if one_cum[one_cum.size - 1] != one_cum[0]:             # rare: rows that see one key
        for j in range(n):
            for i in range(lo[j], hi[j]):
                if one_cum[i + 1] != one_cum[i]:
                    S[j, i] = like(S, 1.0)
                    dP[j, i] = like(S, 0.0)


@kernel(fastmath=FASTMATH)
def _backward_product(Qb, dOb, Kb, Vb, lse2, lse2_lo, delta, one_cum, dQ, dK, dV, lo, hi, S_buf,
                      P_buf, T_buf, c, cap, scale, blas_min, M, use_m, md, G, kh, b, qpos, kpos,
                      gaux, dp, D_buf):
    """One pass over a (key tile, query rows) pair (FlashAttention-2, Alg. 2, lines 8-15):
    the rows of `Qb [R, D]`, `dOb [R, Dv]` against keys `Kb [n, D]`, `Vb [n, Dv]` with visible
    rows `[lo[j], hi[j])`; adds the pair's share to `dQ [R, D]`, `dK [n, D]`, `dV [n, Dv]`.
    `M` ... `gaux`: the user functions' part (`_grads`). With dropout (`dp`, else None;
    `D_buf` the keep bits' scratch) out = (P * keep / (1-p)) V: dP takes the factor before
    dS is formed, dV the dropped P (FlashAttention 2's backward; delta = rowsum(dO * out)
    is rowsum(P * dP) still)."""
    n, R = Kb.shape[0], Qb.shape[0]
    S = S_buf[:n * R].reshape(n, R)                         # [keys, R] key-major
    dP = P_buf[:n * R].reshape(n, R)
    mm_nt(Kb, Qb, S, 0.0, blas_min, T_buf)                  # the forward's scores, bitwise
    mm_nt(Vb, dOb, dP, 0.0, blas_min, T_buf)
    if dp is not None:
        bits = D_buf[:n * R].reshape(n, R)
        dropout_rows(dP, n, R, dp, G, kh, b, qpos, kpos, bits)
    _grads(S, dP, n, lo, hi, lse2, lse2_lo, delta, one_cum, c, cap, scale, M, use_m, md, G, kh,
           b, qpos, kpos, gaux)
    if dp is not None:
        apply_bits(S, n, bits, dp[4])
    mm_nn(S, dOb, dV, 1.0, blas_min)                        # dV += P dO
    mm_nn(dP, Qb, dK, 1.0, blas_min)                        # dK += dS Q
    mm_tn(dP, Kb, dQ, 1.0, blas_min)                        # dQ += dS^T K


@kernel(cache=True, fastmath=FASTMATH)
def backward_item(pv, item, slot, qstep, parts, Qw, dOw, Kw, Vw, delta, lse2, lse2_lo, one_cum,
                  q_flag, k_flag, q_cum, k_cum, c, cap, scale, blas_min, dQ, dq_part, dK, dV,
                  dq_nan, dk_nan, ws, M_buf, md, gaux, dp, D_buf):
    """Part `item // Hk` (`parts` row: sequence, key tile slots `[s0, s1)`, partial, shift,
    stacked rows `[r0, r1)`), key head `item % Hk`: for each of its key tiles and the query
    tiles of its transposed schedule, `qstep` at a time, cut to the keys and rows that hold a
    visible pair (`trim`), one pass gives the pair's dV, dK and dQ contributions, accumulated
    in place in a fixed order: the part owns its dK/dV rows, and its dQ rows too (in dQ, or
    for a partial part in `dq_part` at `row + shift`, zeroed here first). `md`: the call's
    user functions or None, `M_buf` the scratch of their visibility ("User functions"); the
    aux gradients of the item go to row `slot` of `gaux`. `dp`: the call's dropout or None,
    `D_buf` the scratch of its keep bits."""
    S_buf, P_buf, lo, hi, T_buf = ws
    Hk = Kw.shape[0]
    G = dQ.shape[1] // max(pv.rows_q, 1)
    BM = pv.block_m
    p, kh = item // Hk, item % Hk
    b, s0, s1 = parts[p, 0], parts[p, 1], parts[p, 2]
    shift = parts[p, 4]
    if parts[p, 3]:
        acc = dq_part[kh]
        for i in range(parts[p, 5] + shift, parts[p, 6] + shift):
            fill(acc[i], 0, acc.shape[1], 0)
    else:
        acc = dQ[kh]
    g_row = gaux[min(slot, gaux.shape[0] - 1)]
    shift_k = shift_of(pv, b)
    left, right = pv.window_left[b], pv.window_right[b]
    for s in range(s0, s1):
        j0, n, jpos0 = pv.k_tiles[s, T_ROW], pv.k_tiles[s, T_ROWS], pv.k_tiles[s, T_POS]
        for r in range(pv.mq):
            begin, fbegin = pv.k_sched[s, r, S_BEGIN], pv.k_sched[s, r, S_FULL_BEGIN]
            fend, end = pv.k_sched[s, r, S_FULL_END], pv.k_sched[s, r, S_END]
            for qt in range(begin, end, qstep):
                last = min(qt + qstep, end)
                kind = _span_kind(md, pv.k_sched, s, r, qt, last, fbegin, fend)
                if kind == EMPTY:
                    continue
                off = qt * BM
                t0 = pv.q_row[b, r] + off
                rows = min(last * BM, pv.q_len[b, r]) - off
                qpos0 = pv.q_pos[b, r] + off
                for j in range(n):
                    if kind == FULL:
                        lo[j], hi[j] = 0, rows * G
                    else:
                        lo[j], hi[j] = stacked_band(jpos0 + j, qpos0, rows, G, shift_k, left,
                                                    right)
                ja, jz, ra, rz = trim(lo, hi, n)
                if jz <= ja:
                    continue
                jn, Rr = jz - ja, rz - ra
                qpos = np.int64(qpos0) + ra // G
                kpos = np.int64(jpos0) + ja
                M = _visibility(M_buf, jn, Rr)              # [keys, R]
                use_m = _mask_backward(M, jn, lo, hi, ra, Rr, qt, last, rows, BM, G, pv, s, r,
                                       b, qpos, kpos, kind, md)
                i0, i1, k0, k1 = t0 * G + ra, t0 * G + rz, j0 + ja, j0 + jz
                _backward_product(Qw[kh, i0:i1], dOw[kh, i0:i1], Kw[kh, k0:k1], Vw[kh, k0:k1],
                                  lse2[kh, i0:i1], lse2_lo[kh, i0:i1], delta[kh, i0:i1],
                                  one_cum[i0:i1 + 1], acc[i0 + shift:i1 + shift], dK[kh, k0:k1],
                                  dV[kh, k0:k1], lo, hi, S_buf, P_buf, T_buf, c, cap, scale,
                                  blas_min, M, use_m, md, G, kh, b, qpos, kpos, g_row, dp,
                                  D_buf)
                if k_cum[kh, k1] != k_cum[kh, k0] or q_cum[kh, i1] != q_cum[kh, i0]:
                    for j in range(k1 - k0):
                        for i in range(lo[j], hi[j]):
                            if (not use_m or M[j, i] != 0) and (k_flag[kh, k0 + j] or
                                                                q_flag[kh, i0 + i]):
                                dq_nan[kh, i0 + i] = True      # the same value from any part
                                dk_nan[kh, k0 + j] = True


@kernel(parallel=True, cache=True)
def backward(pv, order, nw, qstep, parts, Qw, dOw, Kw, Vw, delta, lse2, lse2_lo, one_cum, q_flag,
             k_flag, q_cum, k_cum, c, cap, scale, blas_min, dQ, dq_part, dK, dV, dq_nan, dk_nan,
             md, gaux, dp):
    """Every item of `order` (longest first) on `nw` workers: see `backward_item` (the
    launcher then adds the dQ partials, `reduce_partials`); `md`: the call's user functions,
    or None; item `order[t]` adds its aux gradients into `gaux[t]` (the launcher sums the rows
    in a fixed order); `dp`: the call's dropout, or None."""
    counter = np.zeros(1, np.int64)
    rows_max = qstep * pv.block_m * (dQ.shape[1] // max(pv.rows_q, 1))
    for _ in prange(nw):
        ws = backward_scratch(Qw, rows_max, pv.block_n)
        M_buf = visibility_scratch(md, pv.block_n * rows_max)
        D_buf = dropout_bits(dp, pv.block_n * rows_max)
        t = fetch_add(counter, 0, 1)
        while t < order.size:
            backward_item(pv, order[t], t, qstep, parts, Qw, dOw, Kw, Vw, delta, lse2, lse2_lo,
                          one_cum, q_flag, k_flag, q_cum, k_cum, c, cap, scale, blas_min, dQ,
                          dq_part, dK, dV, dq_nan, dk_nan, ws, M_buf, md, gaux, dp, D_buf)
            t = fetch_add(counter, 0, 1)


@kernel(parallel=True, cache=True, fastmath=FASTMATH)
def reduce_partials(parts, dQ, dq_part):
    """`dQ[kh, i] += dq_part[kh, i + shift]` for every partial part (rows `[r0, r1)`), in
    part order for each row: blocks of REDUCE_ROWS rows of each key head in parallel."""
    Hk, rows = dQ.shape[0], dQ.shape[1]
    blocks = (rows + REDUCE_ROWS - 1) // REDUCE_ROWS
    any_partial = False
    for p in range(parts.shape[0]):
        any_partial = any_partial or parts[p, 3] != 0
    if not any_partial:
        return
    for t in prange(Hk * blocks):
        kh, a = t // blocks, (t % blocks) * REDUCE_ROWS
        z = min(a + REDUCE_ROWS, rows)
        for p in range(parts.shape[0]):
            if parts[p, 3] == 0:
                continue
            shift = parts[p, 4]
            for i in range(max(a, parts[p, 5]), min(z, parts[p, 6])):
                d, x = dQ[kh, i], dq_part[kh, i + shift]
                for e in range(d.size):
                    d[e] += x[e]


@kernel(cache=True)
def backward_scratch(dtype_probe, rows_max, block_n):
    """One worker's scratch for `backward_item`: `(S, dP, lo, hi, mm_nt's)`."""
    size = block_n * rows_max
    return (np.empty(size, dtype_probe.dtype), np.empty(size, dtype_probe.dtype),
            np.zeros(block_n, np.int64), np.zeros(block_n, np.int64),
            np.empty((KBLOCK + 1) * rows_max, dtype_probe.dtype))


@kernel(parallel=True, cache=True)
def unpack_rows(acc, nan, out):
    """`acc [Hk, T * G, d]` -> `out [T, Hk * G, d]`, NaN on the rows `nan [Hk, T * G]` flags.
    Rows in parallel (a fresh `out` is first touched here, on every worker)."""
    T, H, d = out.shape
    G = H // acc.shape[0]
    for t in prange(T):
        for h in range(H):
            kh, g = h // G, h % G
            r = t * G + g
            if nan[kh, r]:
                fill(out[t, h], 0, d, np.nan)
            else:
                for e in range(d):
                    out[t, h, e] = acc[kh, r, e]


# --------------------------------------------------------------------------------------------
# User functions (mask_mod, score_mod): the same walks, driven by the plan's tile classes
# --------------------------------------------------------------------------------------------
#
# `forward` and `backward` take the call's user functions as `md`, or None: Numba compiles
# that case apart and prunes every `md is None` branch, so a call without them runs the walks
# above as they read, and the helpers below only pick between the two.
#
# `md`, the call's user functions as the kernels read them (built by `cpu_backend._mods_data`):
# forward (cstart, cls, has_mask, mask_fn, *mask aux, has_score, score_fn, *score aux, scale,
# softcap); backward (..., has_score, grad_fn, *score aux, softcap, want_aux). Each aux is four
# arrays (ints, floats, table, err) of `_cpu_mods.AuxPack` (flat: Numba's parallel loops take
# no nested tuples). `cstart`/`cls` are
# `Plan.tile_classes` of the walk's side: EMPTY partner tiles are skipped, FULL ones run with
# no mask arithmetic, PARTIAL ones get the visibility `M [keys, rows]` of the mask_mod (a
# generated tile kernel, `_cpu_mods.py`). The functions are first-class functions of fixed
# signatures: one indirect call per tile. `err [1]` is set when an aux index was clamped.

@kernel
def _tile_class(sched, cstart, cls, i, r, t):
    """Class of partner tile `t` of tile `i` against partner segment `r` (EMPTY outside the
    schedule's range)."""
    b0 = sched[i, r, S_BEGIN]
    if t < b0 or t >= sched[i, r, S_END]:
        return EMPTY
    return np.int64(cls[cstart[i, r] + t - b0])


@kernel
def _group_class(sched, cstart, cls, first, count, r, t):
    """Class of partner tile `t` for tiles `first .. first + count` together: FULL when full
    for each, EMPTY when empty for each, else PARTIAL."""
    full, seen = True, False
    for i in range(first, first + count):
        k = _tile_class(sched, cstart, cls, i, r, t)
        full = full and k == FULL
        seen = seen or k != EMPTY
    return FULL if full else (PARTIAL if seen else EMPTY)


@kernel
def _span_class(sched, cstart, cls, i, r, t0, t1):
    """Class of partner tiles `t0 .. t1` of tile `i` together (as `_group_class`)."""
    full, seen = True, False
    for t in range(t0, t1):
        k = _tile_class(sched, cstart, cls, i, r, t)
        full = full and k == FULL
        seen = seen or k != EMPTY
    return FULL if full else (PARTIAL if seen else EMPTY)


@kernel
def _fill_rows(M, n, a, z, value):
    for j in range(n):
        fill(M[j], a, z, value)


@kernel
def _scores_pass_masked(S, n, lo, hi, M, use_m, c, cap, tile_max):
    """`_scores_pass`, and -inf where `M` hides a pair (when `use_m`)."""
    if not use_m:
        return _scores_pass(S, n, lo, hi, c, cap, tile_max)
    for j in range(n):
        a, z = lo[j], hi[j]
        row, vis = S[j], M[j]
        fill(row, 0, a, -np.inf)
        fill(row, z, row.size, -np.inf)
        for i in range(a, z):
            if vis[i] == 0:
                row[i] = -np.inf
                continue
            if cap > 0:
                x, _ = softcap_score(row[i], c, cap)
            else:
                x = row[i] * like(S, c)
            row[i] = x
            tile_max[i] = max(tile_max[i], x)
    return True


@kernel
def _chunk_class(md, sched, first, count, r, t, fbegin, fend):
    """Class of key tile `t` for the forward's chunk of query tiles `first ..`: with user
    functions (`md`) the plan's (`_group_class`), else FULL inside the schedule's full range
    `[fbegin, fend)` (`_chunk_range`) and PARTIAL elsewhere."""
    if md is None:
        return FULL if fbegin <= t < fend else PARTIAL
    return _group_class(sched, md[0], md[1], first, count, r, t)


@kernel
def _span_kind(md, sched, s, r, t0, t1, fbegin, fend):
    """Class of query tiles `t0 .. t1` for the backward's key tile `s`: with user functions
    the plan's (`_span_class`), else FULL inside the schedule's full range."""
    if md is None:
        return FULL if fbegin <= t0 and t1 <= fend else PARTIAL
    return _span_class(sched, md[0], md[1], s, r, t0, t1)


@kernel
def visibility_scratch(md, size):
    """A worker's scratch for `M` (`size` pairs): empty for a call without user functions."""
    if md is None:
        return np.zeros(0, np.uint8)
    return np.zeros(size, np.uint8)


@kernel
def _visibility(M_buf, n, R):
    """`M [n, R]` in `M_buf`; an empty one (never read) where `M_buf` is."""
    if M_buf.size == 0:
        return M_buf.reshape(0, R)
    return M_buf[:n * R].reshape(n, R)


@kernel(fastmath=FASTMATH)
def _scores(S, n, lo, hi, M, use_m, md, c, cap, tile_max, G, kh, b, qpos, kpos, row_flag):
    """The score pass of a forward product: `_scores_pass`; with user functions the
    score_mod's tile kernel (`score_fn`), or `_scores_pass_masked`. Returns whether `S` holds
    the scores (else the products, which the exp pass scales: `_scores_pass`)."""
    if md is None:
        return _scores_pass(S, n, lo, hi, c, cap, tile_max)
    if md[8]:
        score_fn, saux = md[9], md[10:14]
        score_fn(S, np.int64(n), lo, hi, M, use_m, np.int64(G), np.int64(kh), np.int64(b), qpos,
                 kpos, md[14], md[15], tile_max, row_flag, saux[0], saux[1], saux[2], saux[3])
        return True
    return _scores_pass_masked(S, n, lo, hi, M, use_m, c, cap, tile_max)


@kernel(fastmath=FASTMATH)
def _grads(S, dP, n, lo, hi, lse2, lse2_lo, delta, one_cum, c, cap, scale, M, use_m, md, G, kh,
           b, qpos, kpos, gaux):
    """P and dS of a backward product: `_grad_pass`; with user functions the score_mod's tile
    kernel (`grad_fn`), or `_grad_pass` with the pairs `M` hides zeroed."""
    if md is None:
        _grad_pass(S, dP, n, lo, hi, lse2, lse2_lo, delta, one_cum, c, cap, scale)
    elif md[8]:
        grad_fn, saux = md[9], md[10:14]
        grad_fn(S, dP, np.int64(n), lo, hi, M, use_m, np.int64(G), np.int64(kh), np.int64(b),
                qpos, kpos, lse2, lse2_lo, delta, one_cum, np.float64(scale), md[14], gaux,
                md[15], saux[0], saux[1], saux[2], saux[3])
    else:
        _grad_pass(S, dP, n, lo, hi, lse2, lse2_lo, delta, one_cum, c, cap, scale)
        if use_m:
            for j in range(n):
                for i in range(lo[j], hi[j]):
                    if M[j, i] == 0:
                        S[j, i] = 0
                        dP[j, i] = 0


@kernel
def _mask_forward(M, n, lo, hi, ra, rz, t0, G, pv, first, count, r, t, b, qpos, kpos, kind, md):
    """Whether the forward's product needs the visibility `M [n, rz - ra]`: with a mask_mod,
    in a PARTIAL product. Then fills it for the product's stacked rows `[ra, rz)` (rows of the
    chunk of query tiles `first ..`, from packed row `t0`) and the keys of key tile `t`, per
    query tile: its class against `t`, the mask_mod evaluated only in a PARTIAL one."""
    if md is None:
        return False
    if not md[2] or kind != PARTIAL:
        return False
    cstart, cls, mask_fn, maux = md[0], md[1], md[3], md[4:8]
    for i in range(first, first + count):
        a = max((np.int64(pv.q_tiles[i, T_ROW]) - t0) * G - ra, 0)
        z = min((np.int64(pv.q_tiles[i, T_ROW]) + pv.q_tiles[i, T_ROWS] - t0) * G - ra, rz - ra)
        if z <= a:
            continue
        k = _tile_class(pv.q_sched, cstart, cls, i, r, t)
        if k == PARTIAL:
            mask_fn(M, np.int64(n), lo, hi, np.int64(a), np.int64(z), np.int64(G),
                    np.int64(b), np.int64(qpos), np.int64(kpos), maux[0], maux[1], maux[2], maux[3])
        else:
            _fill_rows(M, n, a, z, 1 if k == FULL else 0)
    return True


@kernel
def _mask_backward(M, n, lo, hi, ra, R, qt, last, rows, BM, G, pv, s, r, b, qpos, kpos, kind, md):
    """The backward's `_mask_forward`: `M [n, R]` for the stacked rows from `ra` of query
    tiles `qt .. last` (`rows` rows from tile `qt`'s first) against key tile `s`."""
    if md is None:
        return False
    if not md[2] or kind != PARTIAL:
        return False
    cstart, cls, mask_fn, maux = md[0], md[1], md[3], md[4:8]
    for u in range(qt, last):
        a = max((u - qt) * BM * G - ra, 0)
        z = min(min((u - qt + 1) * BM, rows) * G - ra, R)
        if z <= a:
            continue
        k = _tile_class(pv.k_sched, cstart, cls, s, r, u)
        if k == PARTIAL:
            mask_fn(M, np.int64(n), lo, hi, np.int64(a), np.int64(z), np.int64(G), np.int64(b),
                    qpos, kpos, maux[0], maux[1], maux[2], maux[3])
        else:
            _fill_rows(M, n, a, z, 1 if k == FULL else 0)
    return True
