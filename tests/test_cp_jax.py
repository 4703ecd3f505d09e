"""`varlen.jax.varlen_attention` inside `jax.shard_map` with its default checks: the backward's
cotangents carry the primal inputs' varying-manual-axes type, so `jax.grad` under `jax.jit`
works without `check_vma=False`. Runs in a subprocess with 4 host devices (XLA_FLAGS must be
set before JAX initialises)."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen
    import varlen.jax as vj

    mesh = Mesh(np.array(jax.devices()), ("dp",))
    cu = np.array([0, 3, 10, 11], np.int32)          # every device: its own packed batch
    mask = varlen.Mask(window_left=np.array([-1, 2, -1], np.int32), window_right=0)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((4 * 11, H, 8)), jnp.float32)
               for H in (4, 2, 2))

    def loss_one(q, k, v):
        out = vj.varlen_attention(q, k, v, cu, cu, mask=mask)
        return jnp.sum(out * jnp.sin(jnp.arange(out.size).reshape(out.shape)))

    def loss_sharded(q, k, v):
        per = jax.shard_map(lambda q, k, v: loss_one(q, k, v)[None], mesh=mesh,
                            in_specs=(P("dp"),) * 3, out_specs=P("dp"))
        return per(q, k, v).sum()

    got = [np.asarray(g) for g in jax.jit(jax.grad(loss_sharded, argnums=(0, 1, 2)))(q, k, v)]
    for name, g, i in zip("qkv", got, range(3)):
        for d in range(4):
            rows = slice(11 * d, 11 * d + 11)
            want = jax.grad(loss_one, argnums=i)(q[rows], k[rows], v[rows])
            err = float(np.max(np.abs(g[rows] - np.asarray(want))))
            assert err < 1e-5, f"d{name} on device {d}: max error {err}"
    print("ok")
""")


def test_grad_inside_shard_map_with_default_checks():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    assert run.stdout.strip().endswith("ok"), run.stdout
