"""`varlen.jax.context_parallel_attention` on every dtype x method x partition scheme, its
inputs JAX arrays as a JAX user has them (the documented snippet: `part.shard` of JAX arrays,
concatenated), the host callback on the `numpy` backend (float64; float32 without the `cpu`
backend) and on the `cpu` backend: forward and gradients against the single-process adapter.
In a subprocess with 2 host devices (XLA_FLAGS must be set before JAX initialises).

Guards against: the callback handing JAX arrays to a backend that writes into its working
copies ("JAX arrays are immutable": every float64 call, every call without `cpu`), and
`part.shard` of a JAX array returning an array committed to device 0 ("incompatible devices"
in `jax.shard_map`)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen, varlen.comm as vc, varlen.jax as vj
    from varlen.backends import cpu_backend

    with_cpu = sys.argv[1] == "cpu"
    if not with_cpu:                       # an install without the [cpu] extra
        cpu_backend.blas_usable = lambda: False
    cu = np.array([0, 7, 7, 20], np.int32)   # a zero-length sequence in the middle
    cp, T = 2, 20
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.float64):
        q, k, v, dout = (jnp.asarray(rng.standard_normal((T, H, 8)), dtype)
                         for H in (4, 2, 2, 4))
        for scheme in ("zigzag", "document"):
            part = (vc.partition(cu, cp) if scheme == "zigzag"
                    else vc.partition(cu, cp, "document", max_doc_len=6))
            for method in ("ring", "allgather", "ulysses"):
                def attend(q, k, v):
                    return vj.context_parallel_attention(q, k, v, part, axis_name="cp",
                                                         mask="causal", method=method)
                f = jax.shard_map(attend, mesh=mesh, in_specs=(P("cp"),) * 3,
                                  out_specs=P("cp"))
                glob = lambda x: jnp.concatenate([part.shard(x, r) for r in range(cp)])
                assert isinstance(glob(q), jax.Array)
                out = f(glob(q), glob(k), glob(v))           # eager, as the docs show it
                loss = lambda q, k, v: jnp.sum(f(q, k, v) * glob(dout))
                grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(glob(q), glob(k), glob(v))
                jax.block_until_ready(grads)
                per = lambda x: [np.asarray(x)[r * part.local_rows:(r + 1) * part.local_rows]
                                 for r in range(cp)]
                got = [part.unshard(per(x)) for x in (out, *grads)]
                one, vjp = jax.vjp(lambda q, k, v: vj.varlen_attention(q, k, v, cu, cu,
                                                                       mask="causal"), q, k, v)
                want = [np.asarray(one)] + [np.asarray(g) for g in vjp(dout)]
                tol = 1e-4 if dtype == jnp.float32 else 1e-10
                for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                    err = float(np.max(np.abs(g - w)))
                    assert err <= tol, f"{dtype.__name__} {scheme} {method} {name}: {err}"
                print("ok", dtype.__name__, scheme, method, flush=True)
""")


@pytest.mark.parametrize("host_backends", ["cpu", "numpy-only"])
def test_jax_cp_with_jax_inputs_on_every_host_backend(host_backends):
    pytest.importorskip("jax")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", SCRIPT, host_backends.split("-")[0]],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert run.stdout.count("ok ") == 12, run.stdout


ERRORS = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    import varlen.comm as vc, varlen.jax as vj
    from jax.sharding import Mesh, PartitionSpec as P
    part = vc.partition(np.array([0, 7, 20], np.int32), 2)
    L = part.local_rows

    def run(devices, shapes):
        mesh = Mesh(np.array(jax.devices()[:devices]), ("cp",))
        f = jax.shard_map(lambda q, k, v: vj.context_parallel_attention(
            q, k, v, part, axis_name="cp"), mesh=mesh, in_specs=(P("cp"),) * 3,
            out_specs=P("cp"))
        try:
            f(*(jnp.zeros(s, jnp.float32) for s in shapes))
        except Exception as e:
            print(type(e).__name__ + ":", e)
    run(2, [(2 * L, 16)] * 3)                        # 2-D q, k, v
    run(4, [(2 * L, 2, 16)] * 3)                      # a mesh axis of 4 for cp_size 2
""")


def test_jax_cp_names_a_2d_input_and_a_mesh_of_the_wrong_size():
    """A 2-D q raised an IndexError; a mesh axis of the wrong size was reported as a rows
    error."""
    pytest.importorskip("jax")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", ERRORS], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2, run.stdout + run.stderr[-3000:]
    assert lines[0].startswith("ValueError: q must be 3-D [T, H, D]"), lines[0]
    assert lines[1].startswith("ValueError: mesh axis 'cp' has size 4 but part.cp_size=2"), \
        lines[1]
