"""The host emulation's GPU arithmetic (emulation/cuda/host_emulation_math.cuh) against the PTX
ISA's stated bounds: each approximate special function within its bound and reaching it, flush to
zero of subnormal inputs and results, the tensor-core accumulation model (exact products,
alignment to the largest exponent with truncation, round toward zero, blocks of 16 or 8), and the
pattern fill of uninitialised locals. A small g++ program includes the header and evaluates it
on arrays sent through a pipe."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from emulation.cupy import EMULATION_DIR
from varlen.kernels_cuda import SOURCE_DIR

CXX = os.environ.get("CXX", "g++")
pytestmark = pytest.mark.skipif(shutil.which(CXX) is None, reason="needs a C++20 compiler")

PROBE = r"""
#include "host_emulation_math.cuh"
#include <cstdio>
#include <thread>
#include <vector>

static std::vector<float> read_all() {
    std::vector<float> v;
    float x;
    while (std::fread(&x, 4, 1, stdin) == 1) v.push_back(x);
    return v;
}
static void write_all(const std::vector<float>& v) { std::fwrite(v.data(), 4, v.size(), stdout); }

__attribute__((noinline)) static void sink(void* p) { asm volatile("" ::"r"(p) : "memory"); }
__attribute__((noinline)) static unsigned uninitialised_word(int n) {
    unsigned w[4];
    for (int i = 0; i < n; ++i) w[i] = 0;
    sink(w);
    return w[3];
}
static float product(float a, float b) { volatile float x = a, y = b; return x * y; }

int main(int argc, char** argv) {
    const std::string op = argv[1];
    std::vector<float> in = read_all(), out;
    // Each op runs in its own thread, as an emulated CUDA thread does.
    std::thread([&] {
        if (op == "ex2") for (float x : in) out.push_back(exp2f(x));
        if (op == "lg2") for (float x : in) out.push_back(log2f(x));
        if (op == "tanh") for (float x : in) out.push_back(tanhf(x));
        if (op == "rcp") for (float x : in) out.push_back(varlen::gpu_math::rcp_approx_ftz(x));
        if (op == "div") for (size_t i = 0; i + 1 < in.size(); i += 2)
            out.push_back(__fdividef(in[i], in[i + 1]));
        if (op == "mma") for (size_t i = 0; i + 33 <= in.size(); i += 33) {
            float a[16], b[16];
            for (int k = 0; k < 16; ++k) { a[k] = in[i + 1 + k]; b[k] = in[i + 17 + k]; }
            out.push_back(varlen::mma_dot16(in[i], a, b));
        }
        if (op == "ftz") {
            out.push_back(product(in[0], in[1]));              // before the thread's first call
            (void)__half2float(__half{0});
            out.push_back(product(in[0], in[1]));              // after it
        }
    }).join();
    if (op == "pattern") std::printf("%08x\n", uninitialised_word(1));
    write_all(out);
}
"""

F32 = np.float32
TINY = F32(2.0 ** -126)


def _build(tmp_path_factory, defines=()):
    d = tmp_path_factory.mktemp("emu_math")
    src = d / "probe.cc"
    src.write_text(PROBE)
    exe = d / "probe"
    subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", f"-I{SOURCE_DIR}", f"-I{EMULATION_DIR}",
                    *(f"-D{x}" for x in defines), str(src), "-o", str(exe)], check=True)
    return str(exe)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return _build(tmp_path_factory)


def run(exe, op, values=()):
    data = np.asarray(values, F32).tobytes()
    res = subprocess.run([exe, op], input=data, capture_output=True, check=True, timeout=120)
    return res.stdout if op == "pattern" else np.frombuffer(res.stdout, F32)


def ulps(got, exact):
    """|got - exact| in units of the float32 ulp at the correctly rounded result."""
    cr = exact.astype(F32)
    spacing = np.spacing(np.abs(cr)).astype(np.float64)
    return np.abs(got.astype(np.float64) - exact) / spacing


def _fractional(rng, lo, hi, n):
    x = rng.uniform(lo, hi, n).astype(F32)
    return x[x != np.trunc(x)]


# ---- special functions ---------------------------------------------------------------------

def test_ex2_within_two_ulp_and_reaching_it(probe):
    x = _fractional(np.random.default_rng(0), -125.0, 127.0, 20000)
    err = ulps(run(probe, "ex2", x), np.exp2(x.astype(np.float64)))
    assert err.max() <= 2.5, f"ex2.approx: {err.max():.2f} ulp > 2 ulp (+0.5 for rounding)"
    assert err.max() >= 1.5, f"ex2 model never uses its 2-ulp bound (max {err.max():.2f} ulp)"
    assert 0.3 < np.mean(run(probe, "ex2", x) > np.exp2(x.astype(np.float64))) < 0.7, \
        "ex2 errors are not split between both directions"


def test_ex2_corner_cases_and_flush_to_zero(probe):
    x = np.array([-np.inf, -0.0, 0.0, np.inf, np.nan, 3.0, -7.0, -126.5, -149.0,
                  np.float32(1e-40), -1e-40], F32)
    got = run(probe, "ex2", x)
    want = np.array([0, 1, 1, np.inf, np.nan, 8, 2.0 ** -7, 0, 0, 1, 1], F32)
    np.testing.assert_array_equal(got, want, err_msg="ex2.approx.ftz corner cases "
                                  "(subnormal results and inputs flushed)")


def test_lg2_within_its_absolute_and_relative_bounds(probe):
    rng = np.random.default_rng(1)
    near = rng.uniform(0.5, 2.0, 10000).astype(F32)
    far = np.exp2(rng.uniform(-120, 120, 10000)).astype(F32)
    far = far[(far <= 0.5) | (far >= 2.0)]
    e_near = np.abs(run(probe, "lg2", near) - np.log2(near.astype(np.float64)))
    exact_far = np.log2(far.astype(np.float64))
    e_far = np.abs(run(probe, "lg2", far) - exact_far) / np.abs(exact_far)
    assert e_near.max() <= 2.0 ** -22, f"lg2 absolute error {e_near.max():.3e} > 2^-22"
    assert e_near.max() >= 0.75 * 2.0 ** -22, "lg2 model never uses its absolute bound"
    assert e_far.max() <= 2.0 ** -22, f"lg2 relative error {e_far.max():.3e} > 2^-22"
    got = run(probe, "lg2", np.array([1.0, 8.0, 0.0, 1e-40, -1.0, np.inf], F32))
    np.testing.assert_array_equal(got, np.array([0, 3, -np.inf, -np.inf, np.nan, np.inf], F32),
                                  err_msg="lg2.approx.ftz corner cases")


def test_tanh_within_relative_bound(probe):
    x = np.random.default_rng(2).uniform(-12, 12, 20000).astype(F32)
    exact = np.tanh(x.astype(np.float64))
    rel = np.abs(run(probe, "tanh", x) - exact) / np.abs(exact)
    assert rel.max() <= 2.0 ** -11, f"tanh.approx relative error {rel.max():.3e} > 2^-11"
    assert rel[np.abs(x) < 3].max() >= 0.75 * 2.0 ** -11, "tanh model never uses its bound"
    got = run(probe, "tanh", np.array([0.0, -np.inf, np.inf, 1e-40, -1e-40], F32))
    np.testing.assert_array_equal(got, np.array([0, -1, 1, 1e-40, -1e-40], F32),
                                  err_msg="tanh.approx corner cases (subnormals pass through)")


def test_rcp_and_div_within_their_ulp_bounds(probe):
    rng = np.random.default_rng(3)
    b = (rng.uniform(1, 2, 10000) * np.exp2(rng.integers(-100, 100, 10000))).astype(F32)
    b *= np.where(rng.random(b.size) < 0.5, -1, 1).astype(F32)
    a = rng.standard_normal(b.size).astype(F32)
    e_rcp = ulps(run(probe, "rcp", b), 1.0 / b.astype(np.float64))
    got_div = run(probe, "div", np.stack([a, b], 1).ravel())
    e_div = ulps(got_div, a.astype(np.float64) / b.astype(np.float64))
    assert 0.5 <= e_rcp.max() <= 1.5, f"rcp.approx: max {e_rcp.max():.2f} ulp, bound 1"
    assert 1.5 <= e_div.max() <= 2.5, f"div.approx: max {e_div.max():.2f} ulp, bound 2"
    got = run(probe, "rcp", np.array([0.0, -0.0, 1e-40, 4.0, 2.0 ** 127], F32))
    np.testing.assert_array_equal(got, np.array([np.inf, -np.inf, np.inf, 0.25, 0], F32),
                                  err_msg="rcp.approx.ftz corner cases")
    got = run(probe, "div", np.array([1.0, 2.0 ** 127, np.inf, 2.0 ** 127, 1e-40, 1.0], F32))
    np.testing.assert_array_equal(got, np.array([0, np.nan, 0], F32),
                                  err_msg="div.approx.ftz: |b| > 2^126 and a subnormal a")


def test_exact_mode_is_correctly_rounded(tmp_path_factory):
    """VARLEN_EMU_APPROX=0 rounds correctly: the bound checks above tell the two modes apart."""
    exe = _build(tmp_path_factory, ["VARLEN_EMU_APPROX=0"])
    x = _fractional(np.random.default_rng(4), -20.0, 20.0, 5000)
    err = ulps(run(exe, "ex2", x), np.exp2(x.astype(np.float64)))
    assert err.max() <= 0.5 + 1e-6, f"correctly rounded ex2 off by {err.max():.2f} ulp"


def test_float_operations_flush_subnormals_in_emulated_threads(probe):
    before, after = run(probe, "ftz", [1e-30, 1e-10])
    assert before > 0, "a subnormal product before the thread's first emulated call"
    assert after == 0, f"1e-30 * 1e-10 = {after!r} in an emulated thread; the GPU flushes it"


def test_uninitialised_locals_hold_a_pattern(probe):
    assert run(probe, "pattern").decode().strip() == "fefefefe", \
        "-ftrivial-auto-var-init=pattern is not in effect after the header"


# ---- tensor cores --------------------------------------------------------------------------

def bf16_values(x):
    """float32 values representable in bfloat16 (x with its low 16 bits cleared)."""
    return (np.asarray(x, F32).view(np.uint32) & 0xffff0000).view(F32)


def mma(exe, c, a, b):
    rows = np.concatenate([np.asarray(c, F32)[:, None], np.asarray(a, F32),
                           np.asarray(b, F32)], 1)
    return run(exe, "mma", rows.ravel())


def one_hot(values):
    """a[k] = values[k], b[k] = 1: the products are the values themselves."""
    a = np.zeros((1, 16), F32)
    a[0, :len(values)] = values
    return a, np.ones((1, 16), F32)


def test_mma_truncates_toward_zero(probe):
    # exact 1 + 0.75 * 2^-23: round to nearest would give 1 + 2^-23
    a, b = one_hot([0.75 * 2.0 ** -23])
    assert mma(probe, [1.0], a, b)[0] == F32(1.0), "the float32 sum is not truncated"
    a, b = one_hot([-0.75 * 2.0 ** -23])
    assert mma(probe, [-1.0], a, b)[0] == F32(-1.0), "negative sums truncate toward zero"


def test_mma_aligns_to_the_largest_exponent(probe):
    # 16 products of 2^-17 against c = 2^10: each falls below the 27 aligned bits
    a, b = one_hot([2.0 ** -17] * 16)
    assert mma(probe, [1024.0], a, b)[0] == F32(1024.0), (
        "products below the aligned significand of the largest term are kept (exact sum "
        "1024 + 2^-13 is a float)")
    # within the 3 extra bits they count: 2^-15 * 16 = 2^-11
    a, b = one_hot([2.0 ** -15] * 16)
    assert mma(probe, [1024.0], a, b)[0] == F32(1024.0 + 2.0 ** -11)


def test_mma_block_size(tmp_path_factory, probe):
    """2^20 - 2^20 cancel in the first 8 products; 2^-10 at k = 8 survives only when the
    first eight are a block of their own (Ampere), not in one block of 16 (Hopper)."""
    vals = [2.0 ** 20, -2.0 ** 20] + [0.0] * 6 + [2.0 ** -10]
    a, b = one_hot(vals)
    assert mma(probe, [0.0], a, b)[0] == 0.0, "one block of 16: 2^-10 is truncated"
    ampere = _build(tmp_path_factory, ["VARLEN_EMU_MMA_BLOCK=8"])
    assert mma(ampere, [0.0], a, b)[0] == F32(2.0 ** -10), "blocks of 8: 2^-10 is kept"


def test_mma_exact_products_nonfinite_and_subnormal_inputs(probe):
    a, b = one_hot([2.0 ** -130])               # a float32 subnormal operand (a bf16 one)
    b[0, 0] = 2.0 ** 100
    assert mma(probe, [0.0], a, b)[0] == F32(2.0 ** -30), "subnormal operands are not flushed"
    a, b = one_hot([np.inf, 0.0])
    b[0, 1] = np.inf
    assert np.isnan(mma(probe, [0.0], a, b)[0]), "inf * 0 in an mma gives NaN"
    a, b = one_hot([np.inf])
    assert mma(probe, [1.0], a, b)[0] == np.inf


def test_mma_error_against_exact_dot_products(probe):
    """Random bf16 operands: within the model's error (17 truncations of 2^-26 relative to the
    largest term, one of 2^-23 relative to the result), and not the exact sum."""
    rng = np.random.default_rng(5)
    n = 4000
    a, b = bf16_values(rng.standard_normal((n, 16))), bf16_values(rng.standard_normal((n, 16)))
    c = rng.standard_normal(n).astype(F32) * 4
    terms = np.concatenate([c[:, None].astype(np.float64), a.astype(np.float64) * b], 1)
    exact = terms.sum(1)
    got = mma(probe, c, a, b).astype(np.float64)
    bound = 17 * 2.0 ** -26 * np.abs(terms).max(1) + 2.0 ** -23 * np.abs(exact)
    assert (np.abs(got - exact) <= bound).all(), "mma model outside its own error bound"
    rn = exact.astype(F32).astype(np.float64)
    assert np.mean(got != rn) > 0.2, "mma model agrees with a correctly rounded sum"
