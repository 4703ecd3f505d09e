"""`varlen.jax` inside `jax.shard_map` with its default checks, in subprocesses with 4 host
devices (XLA_FLAGS must be set before JAX initialises):

* `varlen_attention` on each device's own packed batch: the backward's cotangents carry the
  primal inputs' varying-manual-axes type, so `jax.grad` under `jax.jit` works without
  `check_vma=False`;
* `context_parallel_attention` over cp = 2 and 4 devices: outputs and gradients of the global
  (concatenated) shards against the single-process `varlen_attention` and the float64
  reference, every method, causal, full, sliding-window and mixed per-sequence masks, GQA/MQA,
  lengths that do not divide by 2·cp, zigzag and document partitions, pad rows exactly zero;
* the document ring's collectives: one `ppermute` per array for each step where some ranks
  share a document, none for the others;
* the training example, whose per-step losses match the CP=1 run.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import cases, covering

ROOT = Path(__file__).resolve().parents[2]

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


def _run(args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_grad_inside_shard_map_with_default_checks():
    run = _run(["-c", SCRIPT], timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    assert run.stdout.strip().endswith("ok"), run.stdout


# --------------------------------------------------------------------------------------------
# context_parallel_attention
# --------------------------------------------------------------------------------------------

# (lengths, method, mask, Hq, Hk[, document partition keywords]); mask "mixed": causal,
# bidirectional and windowed sequences. With keywords the partition is
# `vc.partition(cu, cp, "document", **kw)`: max_doc_len forces splits in these small batches,
# slack=s fixes the capacity at ceil(s * T / cp) + 1 rows (static shapes, trailing pad rows).
CASES = [
    ((7, 0, 13, 5), "ring", "causal", 4, 2),
    ((7, 0, 13, 5), "ring", "full", 4, 1),
    ((11, 6), "ring", "window", 4, 4),
    ((9, 4, 11, 1), "ring", "mixed", 4, 2),
    ((7, 0, 13, 5), "allgather", "causal", 4, 2),
    ((9, 4, 11, 1), "allgather", "mixed", 4, 1),
    ((11, 6), "allgather", "window", 4, 2),
    ((7, 0, 13, 5), "ulysses", "full", 4, 2),
    ((9, 4, 11, 1), "ulysses", "mixed", 4, 1),
    ((11, 6), "ulysses", "window", 8, 2),
    ((5, 0, 13, 1, 8, 31, 3), "ring", "causal", 4, 2, dict(max_doc_len=6)),
    ((5, 0, 13, 1, 8, 31, 3), "ring", "mixed", 4, 1, dict(max_doc_len=6, slack=1.5)),
    ((11, 6, 23, 2), "ring", "window", 4, 4, dict(max_doc_len=5, mask="full")),
    ((9, 4, 30, 1, 0), "ring", "full", 4, 2, {}),
    ((5, 0, 13, 1, 8, 31, 3), "allgather", "mixed", 4, 2, dict(max_doc_len=6)),
    ((11, 6, 23, 2), "allgather", "window", 4, 1, dict(max_doc_len=5, slack=1.5)),
    ((5, 0, 13, 1, 8, 31, 3), "ulysses", "causal", 4, 1, dict(max_doc_len=6, slack=1.5)),
    ((11, 6, 23, 2), "ulysses", "window", 8, 2, dict(max_doc_len=5)),
]


def _id(case, cp):
    lengths, method, mask, Hq, Hk, *doc = case
    scheme = "-document" if doc else ""
    return f"cp{cp}-T{sum(lengths)}-B{len(lengths)}-Hq{Hq}-Hk{Hk}-{mask}-{method}{scheme}"


# every case on 2 and 4 devices; at the quick size every case, and both sizes
COMBOS = cases([(case, cp) for case in CASES for cp in (2, 4)],
               covering(lambda c: CASES.index(c[0]), lambda c: c[1]))

CP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen
    import varlen.comm as vc
    import varlen.jax as vj
    from varlen.reference import attention_dense, attention_dense_backward

    varlen.set_nan_fill(True)          # a row no kernel writes shows up as NaN
    MASKS = {"causal": "causal", "full": "full",
             "window": varlen.Mask(window_left=3, window_right=1)}

    def mixed(B):
        left = np.resize(np.array([-1, 3, -1, 2], np.int32), B)
        right = np.resize(np.array([0, 0, -1, 1], np.int32), B)
        return varlen.Mask(window_left=left, window_right=right)

    def partition(cu, cp, doc):
        if doc is None:
            return vc.partition(cu, cp)
        kw = dict(doc)
        slack = kw.pop("slack", None)
        if slack is not None:
            kw["local_rows"] = int(np.ceil(slack * int(cu[-1]) / cp)) + 1
        part = vc.partition(cu, cp, "document", **kw)
        if kw.get("max_doc_len") is not None:
            assert any(len(g) > 1 for g in part.groups), part.groups
        return part

    def check(lengths, method, mask_name, Hq, Hk, cp, *doc):
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        T, D = int(cu[-1]), 8
        mask = mixed(len(lengths)) if mask_name == "mixed" else MASKS[mask_name]
        rng = np.random.default_rng(cp * 100 + T)
        q, k, v, dout = (rng.standard_normal((T, H, D)).astype(np.float32)
                         for H in (Hq, Hk, Hk, Hq))
        part = partition(cu, cp, doc[0] if doc else None)
        mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))

        def glob(x):               # the global array: rank r's shard at rows r*local_rows
            return jnp.concatenate([part.shard(x, r) for r in range(cp)])

        def attend(q, k, v):
            return vj.context_parallel_attention(q, k, v, part, axis_name="cp", mask=mask,
                                                 method=method)
        attend_all = jax.shard_map(attend, mesh=mesh, in_specs=(P("cp"),) * 3,
                                   out_specs=P("cp"))

        def loss(q, k, v):
            return jnp.sum(attend_all(q, k, v) * glob(dout))

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        out = np.asarray(jax.jit(attend_all)(glob(q), glob(k), glob(v)))
        _, grads = step(glob(q), glob(k), glob(v))
        n_steps = len(part._steps)
        # a second call reuses the same step plans; waited for, since a process that exits while
        # a multi-device computation with host callbacks runs aborts inside JAX
        jax.block_until_ready(step(glob(q), glob(k), glob(v)))
        assert len(part._steps) == n_steps, "step plans were rebuilt"

        def per_rank(x):
            return [np.asarray(x)[r * part.local_rows:(r + 1) * part.local_rows]
                    for r in range(cp)]
        pads = [~part.valid(r) for r in range(cp)]
        pad_values = max(float(np.max(np.abs(s[p]), initial=0.0)) if p.any() else 0.0
                         for x in (out, *grads) for s, p in zip(per_rank(x), pads))
        got = [part.unshard(per_rank(out))] + [part.unshard(per_rank(g)) for g in grads]
        one_out, one_vjp = jax.vjp(lambda q, k, v: vj.varlen_attention(q, k, v, cu, cu,
                                                                       mask=mask), q, k, v)
        one = [np.asarray(one_out)] + [np.asarray(g) for g in one_vjp(jnp.asarray(dout))]
        ref = [attention_dense(q, k, v, cu, cu, mask=mask)[0]] + list(
            attention_dense_backward(dout, q, k, v, cu, cu, mask=mask))
        errors = {}
        for name, g, o, r in zip(("out", "dq", "dk", "dv"), got, one, ref):
            scale = max(float(np.max(np.abs(r))), 1.0)
            errors[name] = dict(vs_adapter=float(np.max(np.abs(g - o))) / scale,
                                vs_reference=float(np.max(np.abs(g - r))) / scale,
                                adapter_vs_reference=float(np.max(np.abs(o - r))) / scale)
        return dict(errors=errors, pad_rows=sum(int(p.sum()) for p in pads), pad_max=pad_values)

    results = {}
    for spec in json.loads(sys.argv[1]):
        results[spec["id"]] = check(*spec["args"])
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def cp_errors():
    specs = [dict(id=_id(case, cp), args=[*case[:5], cp, *case[5:]]) for case, cp in COMBOS]
    run = _run(["-c", CP_SCRIPT, json.dumps(specs)])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case, cp", [pytest.param(c, cp, id=_id(c, cp)) for c, cp in COMBOS])
def test_context_parallel_matches_single_process(cp_errors, case, cp):
    """Each rank's output and gradient shards, reassembled, equal the single-process adapter's
    (float32 rounding) and are as close to the float64 reference as it is (2x output, 3x
    gradients, plus a rounding floor); pad rows hold exact zeros (NaN-filled buffers)."""
    res = cp_errors[_id(case, cp)]
    assert res["pad_max"] == 0.0, f"{res['pad_rows']} pad rows: max |value| {res['pad_max']}"
    for name, e in res["errors"].items():
        factor = 2 if name == "out" else 3
        assert e["vs_adapter"] < 1e-5, f"{name}: relative max error vs adapter {e}"
        assert e["vs_reference"] <= factor * e["adapter_vs_reference"] + 1e-6, \
            f"{name}: relative max error vs float64 reference {e}"


ROUTE_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen.comm as vc
    import varlen.jax as vj

    mesh = Mesh(np.array(jax.devices()), ("cp",))
    # One document split over two ranks (steps 1 and 3 exchange, step 2 does not); then only
    # whole documents (no step exchanges).
    for lengths, active in (((20, 9, 9, 9, 9, 9, 9, 9, 9), 2), ((9, 8, 7, 6, 5, 4), 0)):
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        part = vc.partition(cu, 4, "document", max_doc_len=10)
        assert sum(bool(part.ring_route(s)[1].any()) for s in range(4)) == active
        f = jax.shard_map(lambda q: vj.context_parallel_attention(q, q, q, part,
                          axis_name="cp", mask="causal"), mesh=mesh, in_specs=P("cp"),
                          out_specs=P("cp"))
        x = jnp.zeros((4 * part.local_rows, 2, 8), jnp.float32)
        forward = str(jax.make_jaxpr(f)(x)).count("ppermute")
        both = str(jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(x)).count("ppermute")
        # Forward: k and v; backward: k and v again, then dk and dv back to their owners.
        assert (forward, both) == (2 * active, 6 * active), (lengths, forward, both)
    print("ok")
""")


def test_document_ring_exchanges_only_at_steps_that_share():
    run = _run(["-c", ROUTE_SCRIPT], timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    assert run.stdout.strip().endswith("ok"), run.stdout


BAD_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen.comm as vc
    import varlen.jax as vj

    part = vc.partition(np.array([0, 5, 12], np.int32), 2)
    mesh = Mesh(np.array(jax.devices()), ("cp",))         # size 4, the partition's cp is 2
    x = jnp.zeros((4 * part.local_rows, 2, 8), jnp.float32)
    f = jax.shard_map(lambda q: vj.context_parallel_attention(q, q, q, part, axis_name="cp"),
                      mesh=mesh, in_specs=P("cp"), out_specs=P("cp"))
    try:
        f(x)
    except ValueError as e:
        assert "cp_size=2" in str(e), e
    else:
        raise AssertionError("a mesh axis of size 4 was accepted for cp_size=2")
    for bad in ((part, part), np.array([0, 5, 12], np.int32)):
        try:
            vj.context_parallel_attention(x, x, x, bad, axis_name="cp")
        except TypeError as e:
            assert "part must be a varlen.comm.Partition" in str(e), e
        else:
            raise AssertionError(f"part={bad!r} was accepted")
    print("ok")
""")


def test_context_parallel_bad_axis_size_or_partition():
    run = _run(["-c", BAD_SCRIPT], timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    assert run.stdout.strip().endswith("ok"), run.stdout


def test_training_example_matches_cp1():
    """`docs/examples/train_cp_jax.py` on 4 host devices: its per-step losses with CP=2 and
    CP=4 equal the CP=1 run's (it asserts and prints them)."""
    run = _run([str(ROOT / "docs/examples/train_cp_jax.py")], timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    assert "losses match" in run.stdout, run.stdout
