"""A tiny transformer trained on packed documents with context parallelism (JAX).

    python docs/examples/train_cp_jax.py         # CP=2 and CP=4 on 4 host CPU devices, then CP=1

The packed rows (tokens, targets, positions) are split by `varlen.comm.partition` into zigzag
shards; the global arrays are the shards concatenated by rank, sharded along rows over the mesh
axis "cp". Everything but attention is per token, so inside `jax.shard_map` only
`varlen.jax.context_parallel_attention` talks to the other devices. The loss is the sum over all
shards' tokens (`lax.psum`) divided by the number of targets; the parameters are replicated, and
`jax.grad` through the shard_map sums their gradients over the devices. The whole step runs
under `jax.jit` with shard_map's default checks.

The script then trains the same model without context parallelism (`varlen.jax.varlen_attention`
on the whole batch) and checks that the per-step losses agree to float32 rounding; it exits with
status 1 if they do not. The toy data: packed_documents.py, beside it.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import packed_documents  # noqa: E402
import varlen  # noqa: E402
import varlen.comm as vc  # noqa: E402
import varlen.jax as vj  # noqa: E402
from packed_documents import LENGTHS  # noqa: E402

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, STEPS, LR = 32, 32, 4, 2, 2, 5, 0.5
MASK = varlen.Mask(window_left=np.array([-1, 8, -1, -1, 4], np.int32), window_right=0)


def init_params(seed: int = 0) -> dict:
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 5 * LAYERS))
    d_kv = KV_HEADS * DIM // HEADS

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) / np.sqrt(n_in)
    blocks = [dict(q=dense(DIM, DIM), kv=dense(DIM, 2 * d_kv), o=dense(DIM, DIM),
                   up=dense(DIM, 4 * DIM), down=dense(4 * DIM, DIM)) for _ in range(LAYERS)]
    return dict(tok=dense(VOCAB, DIM), pos=dense(max(LENGTHS), DIM), head=dense(DIM, VOCAB),
                blocks=blocks)


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def model(params, tokens, positions, attend):
    """Logits `[T, VOCAB]` of packed rows; `attend(q, k, v)` is the only cross-token step."""
    T, d = tokens.shape[0], DIM // HEADS
    x = params["tok"][tokens] + params["pos"][positions]
    for p in params["blocks"]:
        h = rms_norm(x)
        q = (h @ p["q"]).reshape(T, HEADS, d)
        k, v = jnp.split((h @ p["kv"]).reshape(T, 2 * KV_HEADS, d), 2, axis=1)
        x = x + attend(q, k, v).reshape(T, DIM) @ p["o"]
        x = x + jax.nn.gelu(rms_norm(x) @ p["up"]) @ p["down"]
    return rms_norm(x) @ params["head"]


def token_loss_sum(logits, targets):
    """Sum of the cross-entropy over rows with a target (`targets >= 0`)."""
    logp = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], axis=1)[:, 0]
    return -jnp.sum(jnp.where(targets >= 0, picked, 0.0))


def packed_batch(step: int):
    """cu_seqlens, tokens, next-token targets (-1: none) and in-document positions."""
    cu, *rows = packed_documents.packed_batch(step, VOCAB, ignore=-1)
    return (cu, *(x.astype(np.int32) for x in rows))


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def train_cp(cp: int) -> list:
    """STEPS steps with context parallelism over `cp` devices."""
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    params, losses = init_params(), []
    for step in range(STEPS):
        cu, tokens, targets, positions = packed_batch(step)
        part = vc.partition(cu, cp)                  # once per batch: plans cached on it

        def glob(x, fill=0):                         # rank r's shard at rows r * local_rows
            return jnp.concatenate([part.shard(x, r, fill=fill) for r in range(cp)])
        n_targets = int((targets >= 0).sum())

        def shard_loss(params, tok, pos, tgt):
            def attend(q, k, v):
                return vj.context_parallel_attention(q, k, v, part, axis_name="cp", mask=MASK,
                                                     method="ring")
            logits = model(params, tok, pos, attend)
            return jax.lax.psum(token_loss_sum(logits, tgt), "cp") / n_targets

        loss_fn = jax.shard_map(shard_loss, mesh=mesh, in_specs=(P(), P("cp"), P("cp"),
                                                                 P("cp")), out_specs=P())
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(
            params, glob(tokens), glob(positions), glob(targets, fill=-1))
        params = sgd(params, grads)
        losses.append(float(loss))
    return losses


def train_single() -> list:
    """The same training without context parallelism."""
    params, losses = init_params(), []
    for step in range(STEPS):
        cu, tokens, targets, positions = packed_batch(step)

        def loss_fn(params):
            def attend(q, k, v):
                return vj.varlen_attention(q, k, v, cu, cu, mask=MASK)
            logits = model(params, tokens, positions, attend)
            return token_loss_sum(logits, targets) / int((targets >= 0).sum())

        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
        params = sgd(params, grads)
        losses.append(float(loss))
    return losses


def main() -> int:
    runs = {cp: train_cp(cp) for cp in (2, 4) if cp <= len(jax.devices())}
    single = train_single()
    worst = 0.0
    for step, b in enumerate(single):
        cols = "  ".join(f"CP={cp} {losses[step]:.6f}" for cp, losses in runs.items())
        print(f"step {step}: loss {cols}  CP=1 {b:.6f}")
        worst = max([worst] + [abs(r[step] - b) / abs(b) for r in runs.values()])
    print(f"largest relative difference {worst:.1e}")
    if not runs or worst > 1e-5:
        print("losses differ")
        return 1
    print("losses match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
