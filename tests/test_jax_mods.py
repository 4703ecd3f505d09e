"""MaskMod and ScoreMod through `varlen.jax.varlen_attention`: the gallery against the float64
reference under `jax.jit(jax.grad(...))` and eagerly (float aux gradients, float0 for int aux),
mods as pytrees without retracing, learnable aux, determinism, and the errors a caller meets."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import varlen  # noqa: E402
import varlen.jax as vj  # noqa: E402
from varlen import MaskMod, ScoreMod  # noqa: E402
from varlen.reference import attention_dense, attention_dense_backward  # noqa: E402

from adapter_cases import needs_numba_simulator  # noqa: E402
from helpers import assert_close  # noqa: E402
from mods_cases import (MASK_IDS, SCORE_IDS, alibi, mask_cases, prefix_lm,  # noqa: E402
                        relative_bias, score_cases)


def _batch(lengths, Hq, Hk, dtype, seed=0, D=8):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(cu[-1])
    q, k, v, do = (rng.standard_normal((T, h, D)).astype(dtype) for h in (Hq, Hk, Hk, Hq))
    return cu, q, k, v, do


def _jax_mod(mod):
    return None if mod is None else mod.with_aux([jnp.asarray(a) for a in mod.aux])


def _loss(q, k, v, cu, do, mask, score_mod, **kw):
    out = vj.varlen_attention(q, k, v, cu, cu, mask=mask, score_mod=score_mod, **kw)
    return (out * do).sum(), out


def _grads(jit, q, k, v, cu, do, mask, score_mod, **kw):
    """`((dq, dk, dv, d score_mod), out)`: the score_mod's cotangent is a ScoreMod (pytree)."""
    fn = jax.grad(lambda *a: _loss(*a, **kw), argnums=(0, 1, 2, 6), has_aux=True,
                  allow_int=True)
    if jit:
        fn = jax.jit(fn)
    return fn(q, k, v, cu, do, mask, score_mod)


def _check(label, got, q, k, v, do, cu, mask, score_mod, dtype, **kw):
    (dq, dk, dv, dmod), out = got
    args = [x.astype(np.float64) for x in (q, k, v)]
    want_out, _ = attention_dense(*args, cu, cu, mask=mask, score_mod=score_mod, **kw)
    want = attention_dense_backward(do.astype(np.float64), *args, cu, cu, mask=mask,
                                    score_mod=score_mod, aux_grads=score_mod is not None, **kw)
    assert_close(f"{label} out", np.asarray(out), want_out, dtype=dtype)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want[:3]):
        assert_close(f"{label} {name}", np.asarray(g), w, dtype=dtype, factor=3.0, floor=16.0)
    if score_mod is None:
        return
    for i, (g, w, a) in enumerate(zip(dmod.aux, want[3], score_mod.aux)):
        if w is None:
            assert g.dtype == jax.dtypes.float0, f"{label} int aux {i}: {g.dtype} cotangent"
            continue
        assert g.dtype == np.asarray(a).dtype and g.shape == np.shape(a), f"{label} aux {i}"
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5 * np.abs(w).max(),
                                   err_msg=f"{label} daux {i}")


# (mask, score) pairs: every gallery function once, both ways of running
PAIRS = list(zip(MASK_IDS, (None, *SCORE_IDS, "alibi")))
LENGTHS = [0, 1, 13, 29, 0]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("mask_id,score_id", PAIRS, ids=[f"{m}-{s}" for m, s in PAIRS])
def test_gallery_matches_the_reference(mask_id, score_id, jit):
    with jax.enable_x64(True):
        cu, q, k, v, do = _batch(LENGTHS, 4, 2, np.float64)
        mask = dict(mask_cases(LENGTHS))[mask_id]
        score_mod = None if score_id is None else dict(score_cases(4))[score_id]
        kw = dict(softcap=2.5) if score_id == "t5" else {}
        got = _grads(jit, q, k, v, cu, do, _jax_mod(mask), _jax_mod(score_mod), **kw)
        _check(f"{mask_id} {score_id}", got, q, k, v, do, cu, mask, score_mod, "float64", **kw)


def test_float32_with_numpy_aux_of_64_bit_ints():
    """Without x64, JAX makes the int64 NumPy aux int32 on its way into jit: the function is
    traced again over what it runs on, and the results stay right."""
    cu, q, k, v, do = _batch(LENGTHS, 4, 1, np.float32, seed=2)
    mask = MaskMod(prefix_lm, np.array([0, 1, 5, 30, 0]))         # int64
    score_mod = dict(score_cases(4))["relative-bias"]
    got = _grads(True, q, k, v, cu, do, mask, _jax_mod(score_mod))
    assert got[0][3].aux[0].dtype == np.float32
    _check("float32", got, q, k, v, do, cu, mask, score_mod, "float32")


def test_buffer_callback_path(monkeypatch):
    """The CUDA plumbing (XLA's buffers handed to the callback), run on the CPU."""
    monkeypatch.setattr(vj, "_CPU_BUFFER_PATH", True)
    cu, q, k, v, do = _batch(LENGTHS, 2, 2, np.float32, seed=3)
    mask = dict(mask_cases(LENGTHS))["segments"]
    score_mod = dict(score_cases(2))["t5"]
    got = _grads(True, q, k, v, cu, do, _jax_mod(mask), _jax_mod(score_mod))
    _check("buffer path", got, q, k, v, do, cu, mask, score_mod, "float32")


# --------------------------------------------------------------------------------------------
# Tracing: mods as pytrees, built inside, static; aux gradients only when differentiated
# --------------------------------------------------------------------------------------------

def test_new_mod_objects_each_step_reuse_the_trace():
    traces = []

    def loss(q, cu, mask, score_mod):
        traces.append(1)
        return (vj.varlen_attention(q, q, q, cu, cu, mask=mask, score_mod=score_mod) ** 2).sum()
    step = jax.jit(jax.grad(loss, argnums=(0, 3)))
    rng = np.random.default_rng(0)
    for lengths in ([5, 3, 12], [2, 9, 9], [20, 0, 0]):
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        q = jnp.asarray(rng.standard_normal((20, 2, 8)), jnp.float32)
        mask = varlen.Mask(window_left=4) & MaskMod(
            prefix_lm, jnp.asarray(rng.integers(0, 6, 3), jnp.int32))
        score_mod = ScoreMod(relative_bias, jnp.asarray(rng.standard_normal((2, 13)),
                                                        jnp.float32))
        dq, dmod = step(q, cu, mask, score_mod)
        assert isinstance(dmod, ScoreMod) and dmod.aux[0].shape == (2, 13)
    assert len(traces) == 1, f"{len(traces)} traces for 3 steps"


def test_mods_built_inside_jit_and_as_static_arguments():
    cu, q, k, v, do = _batch([6, 0, 9], 2, 1, np.float32)
    slopes = np.array([0.5, 0.25], np.float32)
    want = vj.varlen_attention(q, k, v, cu, cu, score_mod=ScoreMod(alibi, slopes))

    @jax.jit
    def inside(q, k, v, slopes):
        return vj.varlen_attention(q, k, v, cu, cu, score_mod=ScoreMod(alibi, slopes))
    np.testing.assert_array_equal(inside(q, k, v, jnp.asarray(slopes)), want)

    static = jax.jit(lambda q, k, v, sm: vj.varlen_attention(q, k, v, cu, cu, score_mod=sm),
                     static_argnums=3)
    np.testing.assert_array_equal(static(q, k, v, ScoreMod(alibi, jnp.asarray(slopes))), want)


def test_aux_gradients_are_computed_only_when_differentiated(monkeypatch):
    asked = []
    original = vj.attention_backward

    def spy(*args, aux_grads=False, **kw):
        asked.append(aux_grads)
        return original(*args, aux_grads=aux_grads, **kw)
    monkeypatch.setattr(vj, "attention_backward", spy)
    cu, q, k, v, do = _batch([6, 9], 2, 1, np.float32)
    score_mod = _jax_mod(dict(score_cases(2))["relative-bias"])
    jax.grad(lambda q: _loss(q, k, v, cu, do, None, score_mod)[0])(q)
    jax.grad(lambda sm: _loss(q, k, v, cu, do, None, sm)[0])(score_mod)
    assert asked == [False, True]


# --------------------------------------------------------------------------------------------
# Learnable aux, determinism, errors
# --------------------------------------------------------------------------------------------

def test_a_learnable_slope_trained_for_a_step_changes_the_loss_as_predicted():
    with jax.enable_x64(True):
        cu, q, k, v, do = _batch([0, 12, 5, 20], 4, 2, np.float64, seed=4)

        def loss(slopes):
            return _loss(q, k, v, cu, do, "causal", ScoreMod(alibi, slopes))[0]
        slopes = jnp.full((4,), 0.25)
        before, grad = jax.jit(jax.value_and_grad(loss))(slopes)
        assert float(jnp.abs(grad).min()) > 0, "every head's slope has a gradient"
        lr = 1e-3
        after = float(loss(slopes - lr * grad))
        predicted = float(before) - lr * float((grad ** 2).sum())
        assert after < float(before)
        assert abs(after - predicted) < 0.05 * lr * float((grad ** 2).sum()), (after, predicted)


def test_deterministic_repeats_are_bitwise_equal():
    cu, q, k, v, do = _batch([17, 5, 0, 11], 2, 2, np.float32)
    mask = _jax_mod(dict(mask_cases([17, 5, 0, 11]))["segments"])
    score_mod = _jax_mod(dict(score_cases(2))["relative-bias"])
    first, second = (jax.tree.leaves(_grads(True, q, k, v, cu, do, mask, score_mod,
                                            deterministic=True)) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_errors_name_the_aux_argument():
    cu, q, k, v, do = _batch([3, 4], 2, 1, np.float32)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"score_mod aux argument 0 is a torch.Tensor; "
                                        r"varlen.jax takes aux arrays as JAX"):
        vj.varlen_attention(q, k, v, cu, cu, score_mod=ScoreMod(alibi, torch.ones(2)))
    with pytest.raises(TypeError, match="score_mod must be a varlen.ScoreMod or None, got "
                                        "MaskMod"):
        vj.varlen_attention(q, k, v, cu, cu, score_mod=MaskMod(prefix_lm, np.ones(2, np.int32)))


@needs_numba_simulator
def test_numba_kernels_behind_the_callback_in_the_simulator():
    cu, q, k, v, do = _batch([5, 0, 7], 2, 1, np.float32)
    mask = dict(mask_cases([5, 0, 7]))["prefix-lm"]
    score_mod = dict(score_cases(2))["relative-bias"]
    got = _grads(True, q, k, v, cu, do, _jax_mod(mask), _jax_mod(score_mod), backend="numba")
    _check("numba", got, q, k, v, do, cu, mask, score_mod, "float32")
