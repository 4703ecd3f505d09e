"""Dropout through the JAX adapter (`varlen.jax.varlen_attention(dropout_p=, dropout_rng=)`):
the pairs of the core API for the key's seed (`varlen.dropout.seed_of_words`), forward and
gradients against the float64 reference with that seed, eager and jitted bitwise alike, vmap,
both callback paths, and the arguments it refuses."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import varlen  # noqa: E402
import varlen.jax as vj  # noqa: E402
from varlen.dropout import seed_of_words  # noqa: E402
from helpers import check_against_reference, make_batch  # noqa: E402

KEY = 7


def seed_of(key) -> int:
    """The seed the adapter draws from `key`."""
    return seed_of_words(np.asarray(jax.random.bits(key, (2,), jnp.uint32)))


def adversarial(dtype, seed=4):
    """Zero-length sequences (the last one too), length 1, lengths not tile multiples,
    Lq != Lk, padding gaps, GQA."""
    return make_batch(np.random.default_rng(seed), [0, 33, 1, 70, 0], [2, 40, 1, 70, 0],
                      Hq=4, Hk=2, D=16, dtype=dtype, mask="causal", gaps=True)


def run(bt, key, *, jit, p=0.3, offset=2, **kw):
    """`(out, lse, (dq, dk, dv))` of `bt` with dropout, through `jax.vjp` (jitted or not)."""
    meta = tuple(jnp.asarray(x) for x in (bt.cu_q, bt.cu_k, bt.off_q, bt.off_k))

    def fn(q, k, v, dout, key, cu_q, cu_k, off_q, off_k):
        (out, lse), pullback = jax.vjp(lambda q, k, v: vj.varlen_attention(
            q, k, v, cu_q, cu_k, seq_offsets_q=off_q, seq_offsets_k=off_k, mask=bt.mask,
            return_lse=True, dropout_p=p, dropout_rng=key, offset=offset, **kw), q, k, v)
        return out, lse, pullback((dout, jnp.zeros_like(lse)))
    fn = jax.jit(fn) if jit else fn
    out, lse, grads = fn(*(jnp.asarray(x) for x in (bt.q, bt.k, bt.v, bt.dout)), key, *meta)
    return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


def x64(dtype):
    return jax.enable_x64(dtype == "float64")


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_forward_and_grads_match_the_reference(dtype, jit):
    """The reference with the key's seed: the backward draws the forward's pairs."""
    with x64(dtype):
        bt, key = adversarial(dtype), jax.random.key(KEY)
        out, lse, grads = run(bt, key, jit=jit)
        check_against_reference(bt, out, lse, grads, dropout_p=0.3, seed=seed_of(key),
                                offset=2, label=f"jax dropout {dtype}")


def test_keep_set_is_the_references():
    """q = 0 spreads each row evenly over its keys and v is one-hot over key positions, so an
    output entry is nonzero exactly where its pair is kept: the keep set, read back, equals
    `varlen.reference.dropout_keep` for the key's seed (and the numpy backend's call)."""
    lengths, Hq, Lk = [5, 0, 13, 1], 2, 13
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(cu[-1])
    q = np.zeros((T, Hq, 4), np.float64)
    v = np.zeros((T, 1, Lk), np.float64)
    for b in range(len(lengths)):
        v[cu[b]:cu[b + 1], 0, :lengths[b]] = np.eye(lengths[b])
    key = jax.random.key(11)
    with jax.enable_x64(True):
        out = np.asarray(jax.jit(lambda q, k, v, key: vj.varlen_attention(
            q, k, v, cu, cu, dropout_p=0.4, dropout_rng=key, offset=5, backend="numpy"))(
                q, q[:, :1], v, key))
        core, _ = varlen.attention_forward(q, q[:, :1], v, cu, cu, dropout_p=0.4,
                                           seed=seed_of(key), offset=5, backend="numpy")
    assert np.array_equal(out, core), "the adapter's output is not the core API's"
    keep = varlen.reference.dropout_keep(cu, cu, Hq, 0.4, seed_of(key), 5)
    for b, L in enumerate(lengths):
        got = out[cu[b]:cu[b + 1], :, :L].transpose(1, 0, 2) != 0     # [Hq, Lq, Lk]
        assert np.array_equal(got, keep[b]), f"sequence {b}: another keep set"
    dropped = 1 - np.mean(np.concatenate([k.ravel() for k in keep]))
    assert 0.25 < dropped < 0.55, f"dropped fraction {dropped:.3f} for p = 0.4"


def test_same_key_bitwise_another_key_differs_jit_equals_eager():
    bt = adversarial("float32", seed=2)
    key = jax.random.key(KEY)
    eager = run(bt, key, jit=False)
    for again in (run(bt, key, jit=True), run(bt, key, jit=True)):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*eager[:2], *eager[2]),
                              (*again[:2], *again[2])):
            assert np.array_equal(a, b), f"{name}: jit and eager differ for one key"
    other = run(bt, jax.random.key(KEY + 1), jit=True)
    assert not np.array_equal(eager[0], other[0]), "another key drops the same pairs"
    assert not np.array_equal(eager[2][2], other[2][2]), "another key, the same dv"
    assert not np.array_equal(eager[0], run(bt, key, jit=True, offset=3)[0]), "offset unused"
    raw = run(bt, jax.random.PRNGKey(KEY), jit=True)          # a raw uint32[2] key works too
    assert np.isfinite(raw[0]).all()


def test_p_zero_is_the_path_without_dropout():
    bt = adversarial("float32", seed=3)
    plain = run(bt, None, jit=True, p=0.0, offset=0)
    with_key = run(bt, jax.random.key(1), jit=True, p=0.0)
    for a, b in zip((*plain[:2], *plain[2]), (*with_key[:2], *with_key[2])):
        assert np.array_equal(a, b)
    cu = jnp.asarray(bt.cu_q)
    q = jnp.asarray(bt.q)
    without = vj.varlen_attention(q, q[:, :2], q[:, :2], cu, cu)
    assert np.array_equal(without, vj.varlen_attention(q, q[:, :2], q[:, :2], cu, cu,
                                                       dropout_p=0.0))


def test_jit_grad_of_a_loss_with_traced_key():
    """`jax.jit(jax.grad(loss))` with the key an argument of the jitted function: one trace for
    every key, each key's gradient the reference's."""
    with jax.enable_x64(True):
        bt = make_batch(np.random.default_rng(5), [6, 0, 17], [9, 3, 17], Hq=2, Hk=1, D=8,
                        mask="causal_bottom_right")
        cu_q, cu_k = jnp.asarray(bt.cu_q), jnp.asarray(bt.cu_k)

        def loss(q, k, v, key):
            out = vj.varlen_attention(q, k, v, cu_q, cu_k, mask="causal_bottom_right",
                                      dropout_p=0.25, dropout_rng=key)
            return jnp.sum(out * bt.dout)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        for i in (0, 1):
            key = jax.random.key(i)
            grads = grad(*(jnp.asarray(x) for x in (bt.q, bt.k, bt.v)), key)
            ref = varlen.reference.attention_dense_backward(
                bt.dout, bt.q, bt.k, bt.v, bt.cu_q, bt.cu_k, mask="causal_bottom_right",
                dropout_p=0.25, seed=seed_of(key))
            for name, g, r in zip("qkv", grads, ref):
                assert np.allclose(np.asarray(g), r, atol=1e-10), f"key {i}: d{name}"
        assert grad._cache_size() == 1, "a new key retraced"


def test_vmap_over_keys_and_over_data():
    bt = make_batch(np.random.default_rng(6), [9, 14], Hq=2, Hk=2, D=8, dtype="float32")
    q, k, v, cu = (jnp.asarray(x) for x in (bt.q, bt.k, bt.v, bt.cu_q))

    def f(q, key):
        return vj.varlen_attention(q, k, v, cu, cu, dropout_p=0.5, dropout_rng=key)
    keys = jax.random.split(jax.random.key(3), 2)
    mapped = jax.jit(jax.vmap(f, in_axes=(None, 0)))(q, keys)
    for i in range(2):
        assert np.array_equal(mapped[i], f(q, keys[i])), f"key {i}"
    assert not np.array_equal(mapped[0], mapped[1])
    qs = jnp.stack([q, 2 * q])
    mapped = jax.vmap(f, in_axes=(0, None))(qs, keys[0])
    for i in range(2):
        assert np.array_equal(mapped[i], f(qs[i], keys[0])), f"element {i}"


def test_with_sinks_under_jit_grad():
    """Dropout and sinks at once: out, lse and the gradients of q, k, v and sinks (jitted)
    against the reference drawing the same pairs."""
    with jax.enable_x64(True):
        bt = adversarial("float64", seed=9)
        sinks = np.random.default_rng(9).standard_normal(4)
        key = jax.random.key(KEY)
        meta = tuple(jnp.asarray(x) for x in (bt.cu_q, bt.cu_k, bt.off_q, bt.off_k))

        @jax.jit
        def fn(q, k, v, sinks, dout, key):
            (out, lse), pullback = jax.vjp(lambda q, k, v, s: vj.varlen_attention(
                q, k, v, meta[0], meta[1], seq_offsets_q=meta[2], seq_offsets_k=meta[3],
                mask="causal", sinks=s, return_lse=True, dropout_p=0.2, dropout_rng=key),
                q, k, v, sinks)
            return out, lse, pullback((dout, jnp.zeros_like(lse)))
        out, lse, grads = fn(*(jnp.asarray(x) for x in (bt.q, bt.k, bt.v, sinks, bt.dout)), key)
    check_against_reference(bt, np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads],
                            sinks=sinks, dropout_p=0.2, seed=seed_of(key),
                            label="jax dropout sinks")


def test_buffer_callback_path_on_cpu(monkeypatch):
    """The CUDA path's plumbing (the words an XLA buffer in the callback), run on the CPU."""
    monkeypatch.setattr(vj, "_CPU_BUFFER_PATH", True)

    def no_pure_callback(*a, **k):
        raise AssertionError("pure_callback used on the buffer path")
    monkeypatch.setattr(vj.jax, "pure_callback", no_pure_callback)
    bt, key = adversarial("float32", seed=8), jax.random.key(KEY)
    out, lse, grads = run(bt, key, jit=True)
    check_against_reference(bt, out, lse, grads, dropout_p=0.3, seed=seed_of(key), offset=2,
                            label="buffer path dropout")


# --------------------------------------------------------------------------------------------
# Errors name the argument
# --------------------------------------------------------------------------------------------

def _call(**kw):
    q = jnp.zeros((6, 2, 8), jnp.float32)
    cu = jnp.asarray([0, 2, 6], jnp.int32)
    return vj.varlen_attention(q, q, q, cu, cu, **kw)


@pytest.mark.parametrize("kw,err,match", [
    pytest.param(dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)", id="p-one"),
    pytest.param(dict(dropout_p=-0.1), ValueError, "dropout_p must be in", id="p-negative"),
    pytest.param(dict(dropout_p=float("nan")), ValueError, "dropout_p must be in", id="p-nan"),
    pytest.param(dict(dropout_p="0.1"), TypeError, "dropout_p must be a float", id="p-str"),
    pytest.param(dict(dropout_p=True), TypeError, "dropout_p must be a float", id="p-bool"),
    pytest.param(dict(dropout_p=jnp.float32(0.1)), TypeError, "dropout_p must be a float",
                 id="p-array"),
    pytest.param(dict(dropout_p=0.1), ValueError, "dropout_rng is required", id="no-rng"),
    pytest.param(dict(dropout_p=0.1, dropout_rng=0), TypeError,
                 "dropout_rng must be a jax.random key", id="rng-int"),
    pytest.param(dict(dropout_p=0.1, dropout_rng=jnp.zeros(2, jnp.float32)), TypeError,
                 "dropout_rng must be a jax.random key", id="rng-float"),
    pytest.param(dict(dropout_p=0.1, dropout_rng=jnp.zeros(3, jnp.uint32)), TypeError,
                 "dropout_rng must be a jax.random key", id="rng-shape"),
    pytest.param(dict(dropout_p=0.1, dropout_rng=jax.random.split(jax.random.key(0))),
                 TypeError, "dropout_rng must be a jax.random key", id="rng-batch"),
    pytest.param(dict(dropout_p=0.1, dropout_rng=jax.random.key(0), offset=-1), ValueError,
                 r"offset must be an int in \[0, 2\*\*32\)", id="offset-negative"),
    pytest.param(dict(dropout_p=0.1, dropout_rng=jax.random.key(0), offset=2**32), ValueError,
                 "offset must be an int", id="offset-wide"),
    pytest.param(dict(offset=1.5), TypeError, "offset must be an int", id="offset-float"),
])
def test_errors_name_the_argument(kw, err, match):
    with pytest.raises(err, match=match):
        _call(**kw)


def test_traced_dropout_p_is_refused_while_tracing():
    with pytest.raises(TypeError, match="dropout_p and offset must be Python numbers"):
        jax.jit(lambda p: _call(dropout_p=p, dropout_rng=jax.random.key(0)))(0.1)
