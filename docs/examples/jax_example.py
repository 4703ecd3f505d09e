"""varlen in JAX: a packed batch, a different mask per sequence, jax.jit(jax.grad(...)),
a plan reused across layers.

    python docs/examples/jax_example.py             # CPU (NumPy backend), or a GPU if present

Three sequences of lengths 5, 1 and 7 are packed into one `[13, H, D]` array; the first and the
last are causal (decoder), the middle one bidirectional (encoder), all in one call. The metadata
(`cu_seqlens`, the per-sequence flags) are ordinary traced arguments: a new batch with the same
shapes reuses the compiled function.
"""
import jax
import jax.numpy as jnp
import numpy as np

import varlen
import varlen.jax


def loss(q, k, v, cu_seqlens, is_causal):
    mask = varlen.Mask.causal_where(is_causal)         # window_right = 0 where causal, else -1
    out = varlen.jax.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, mask=mask)
    return jnp.sum(out.astype(jnp.float32) ** 2)


def main():
    lengths = [5, 1, 7]
    T, Hq, Hk, D = sum(lengths), 4, 2, 16                # GQA: 2 query heads per key head
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (T, Hq, D), jnp.float32)
    k = jax.random.normal(kk, (T, Hk, D), jnp.float32)
    v = jax.random.normal(kv, (T, Hk, D), jnp.float32)
    cu_seqlens = jnp.asarray([0, 5, 6, 13], jnp.int32)
    is_causal = jnp.asarray([True, False, True])

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    value, (dq, dk, dv) = value_and_grad(q, k, v, cu_seqlens, is_causal)

    # The same gradients from the float64 reference, which recomputes the forward itself.
    mask = varlen.Mask.causal_where(np.asarray(is_causal))
    args = [np.asarray(x, np.float64) for x in (q, k, v)]
    out, _ = varlen.reference.attention_dense(*args, cu_seqlens, cu_seqlens, mask=mask)
    ref = varlen.reference.attention_dense_backward(2 * out, *args, cu_seqlens, cu_seqlens,
                                                    mask=mask)
    for got, want in zip((dq, dk, dv), ref):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)

    # A plan built once per batch and reused by every layer; it is a static argument (a new
    # Plan object is a new trace under jax.jit).
    plan = varlen.plan(cu_seqlens, cu_seqlens, mask=varlen.Mask.causal_where(is_causal),
                       num_rows_q=T, num_rows_k=T)
    with_plan = varlen.jax.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, plan=plan,
                                            mask=varlen.Mask.causal_where(is_causal))
    np.testing.assert_array_equal(np.asarray(with_plan), np.asarray(
        varlen.jax.varlen_attention(q, k, v, cu_seqlens, cu_seqlens,
                                    mask=varlen.Mask.causal_where(is_causal))))

    # Other lengths, same shapes: no retrace.
    value2, _ = value_and_grad(q, k, v, jnp.asarray([0, 2, 10, 13], jnp.int32), is_causal)
    print(f"backend={jax.default_backend()} loss {float(value):.4f} -> {float(value2):.4f}; "
          f"gradients match the float64 reference")


if __name__ == "__main__":
    main()
