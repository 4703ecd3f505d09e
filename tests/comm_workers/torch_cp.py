"""`varlen.torch.context_parallel_attention` checked on one rank of any group.

`check_rank(group, spec)` builds the same global batch on every rank (from the spec's seed),
shards it, runs the forward and backward through autograd, and compares this rank's shards of
out, dq, dk and dv with the shards of the single-process `varlen.torch.varlen_attention` and of
the float64 reference. Run as a script, it is one rank of a gloo job (`torchrun` or
`python torch_cp.py spawn N`), running `SPECS` and the bad-input checks.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

import varlen
import varlen.comm as vc
import varlen.torch as vt
from varlen._torch_ops import _cp_group
from varlen import reference

TOL = {torch.float64: 1e-10, torch.float32: 3e-5}   # relative to max(1, |reference|)


@dataclass(frozen=True)
class Spec:
    lengths: tuple
    method: str = "ring"
    mask: object = "causal"
    Hq: int = 4
    Hk: int = 2
    D: int = 8
    dtype: torch.dtype = torch.float32
    seed: int = 0
    # The document scheme when set: documents longer than `max_doc_len` are split, and each
    # rank holds `ceil(slack * T / cp) + 1` rows when `slack` is given (trailing pad rows).
    max_doc_len: int | None = None
    slack: float | None = None

    @property
    def scheme(self):
        return "zigzag" if self.max_doc_len is None else "document"

    @property
    def id(self):
        m = self.mask if isinstance(self.mask, str) else "mask"
        return (f"T{sum(self.lengths)}-B{len(self.lengths)}-Hq{self.Hq}-Hk{self.Hk}-{m}-"
                f"{self.method}-{str(self.dtype)[6:]}-{self.scheme}")

    def partition(self, cu, cp):
        """The spec's partition of `cu` (host) over `cp` ranks."""
        if self.max_doc_len is None:
            return vc.partition(cu, cp)
        rows = None if self.slack is None else int(np.ceil(self.slack * int(cu[-1]) / cp)) + 1
        part = vc.partition(cu, cp, "document", max_doc_len=self.max_doc_len, local_rows=rows)
        assert cp == 1 or any(len(g) > 1 for g in part.groups), part.groups
        return part


def mixed_mask(B):
    """Causal, bidirectional and windowed sequences in one batch (per-sequence arrays)."""
    left = np.array([-1, 3, -1, 2, -1, 1][:B] + [-1] * max(B - 6, 0), np.int32)
    right = np.array([0, 0, -1, 1, 0, -1][:B] + [0] * max(B - 6, 0), np.int32)
    return varlen.Mask(window_left=left, window_right=right)


def global_batch(spec: Spec):
    g = torch.Generator().manual_seed(spec.seed)
    T = sum(spec.lengths)

    def rnd(H):
        return torch.randn(T, H, spec.D, generator=g, dtype=torch.float64).to(spec.dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(spec.lengths)]), dtype=torch.int32)
    return dict(q=rnd(spec.Hq), k=rnd(spec.Hk), v=rnd(spec.Hk), dout=rnd(spec.Hq), cu=cu)


def single_process(spec: Spec, b):
    """out, dq, dk, dv of the single-process adapter, and of the float64 reference."""
    q, k, v = (b[n].clone().requires_grad_() for n in "qkv")
    out = vt.varlen_attention(q, k, v, b["cu"], b["cu"], mask=spec.mask)
    out.backward(b["dout"])
    adapter = [out.detach(), q.grad, k.grad, v.grad]
    arrays = [b[n].double().numpy() for n in ("q", "k", "v", "dout")]
    cu = b["cu"].numpy()
    ref_out, _ = reference.attention_dense(*arrays[:3], cu, cu, mask=spec.mask)
    ref_grads = reference.attention_dense_backward(arrays[3], *arrays[:3], cu, cu,
                                                   mask=spec.mask)
    return adapter, [ref_out, *ref_grads]


def close(name, got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want) / np.maximum(1.0, np.abs(want))
    assert err.max(initial=0.0) <= tol, f"{name}: max relative error {err.max():.3g} > {tol:g}"


def check_rank(group, spec: Spec, tol_scale=1.0):
    """Run one spec on this rank of `group` (a varlen.comm Group, a ProcessGroup or None) and
    assert that its shards match; returns this rank's loss term."""
    vc_group = _cp_group(group)
    rank, cp = vc_group.rank, vc_group.size
    b = global_batch(spec)
    part = spec.partition(b["cu"].numpy(), cp)
    q, k, v = (part.shard(b[n], rank).clone().requires_grad_() for n in "qkv")
    dout = part.shard(b["dout"], rank)
    out = vt.context_parallel_attention(q, k, v, part, group, mask=spec.mask,
                                        method=spec.method)
    assert out.requires_grad and out.dtype == spec.dtype, "out must be differentiable"
    out.backward(dout)
    adapter, ref = single_process(spec, b)
    tol = TOL[spec.dtype] * tol_scale
    for name, got, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad,
                                                           v.grad), adapter, ref):
        assert got.dtype == spec.dtype, f"{name} has dtype {got.dtype}"
        close(f"rank {rank} {name} vs varlen_attention", got, part.shard(a, rank), tol)
        close(f"rank {rank} {name} vs reference", got, part.shard(torch.as_tensor(r), rank),
              tol)
    return rank


SPECS = [
    Spec((7, 0, 13, 5), "ring", "causal"),
    Spec((7, 0, 13, 5), "allgather", "full"),
    Spec((7, 0, 13, 5), "ulysses", "causal"),
    Spec((9, 4, 11), "ring", None, Hk=1),            # mixed per-sequence mask, MQA
    Spec((9, 4, 11), "ulysses", None),
    Spec((5, 0, 13, 1, 8, 31, 3), "ring", None, max_doc_len=6, slack=1.5),
    Spec((5, 0, 13, 1, 8, 31, 3), "allgather", "causal", max_doc_len=6),
    Spec((5, 0, 13, 1, 8, 31, 3), "ulysses", None, Hk=1, max_doc_len=6),
]


def resolved(spec: Spec) -> Spec:
    if spec.mask is None:
        return Spec(**{**spec.__dict__, "mask": mixed_mask(len(spec.lengths))})
    return spec


# --------------------------------------------------------------------------------------------
# Bad inputs: every rank raises the same error, none hangs
# --------------------------------------------------------------------------------------------

def expect_error(fn, words):
    try:
        fn()
    except (ValueError, TypeError) as e:
        assert all(w in str(e) for w in words), f"unexpected message: {e}"
        return str(e)
    raise AssertionError(f"no error; expected one mentioning {words}")


def check_bad_inputs(group):
    vg = _cp_group(group)
    rank, cp = vg.rank, vg.size
    spec = Spec((7, 0, 13, 5))
    b = global_batch(spec)
    q, k, v = (b[n][:10] for n in "qkv")
    # A partition for another number of ranks than the group has.
    wrong = vc.partition(b["cu"].numpy(), cp + 1)
    expect_error(lambda: vt.context_parallel_attention(
        *(wrong.shard(b[n], rank) for n in "qkv"), wrong, group), ["cp_size"])
    part = vc.partition(b["cu"].numpy(), cp)
    shards = [part.shard(b[n], rank) for n in "qkv"]
    # Rank 0 passes a shard of the wrong length: every rank raises.
    if rank == 0:
        shards[0] = shards[0][:-1]
    expect_error(lambda: vt.context_parallel_attention(*shards, part, group), ["rank"])
    # Ranks disagree on the mask.
    shards = [part.shard(b[n], rank) for n in "qkv"]
    expect_error(lambda: vt.context_parallel_attention(
        *shards, part, group, mask="causal" if rank else "full"), ["disagree", "mask"])
    del q, k, v


# --------------------------------------------------------------------------------------------
# As a script: one rank of a gloo job
# --------------------------------------------------------------------------------------------

def _rank_main():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    varlen.set_nan_fill(True)
    try:
        for spec in SPECS:
            if spec.method == "ulysses" and spec.Hq % dist.get_world_size():
                continue
            check_rank(None, resolved(spec))
        # A sub-group given as a ProcessGroup (here: all ranks, in reverse order).
        sub = dist.new_group(list(range(dist.get_world_size()))[::-1])
        check_rank(sub, resolved(SPECS[0]))
        check_bad_inputs(None)
        dist.barrier()
        print(f"rank {dist.get_rank()} ok", flush=True)
    finally:
        dist.destroy_process_group()


def _spawned(rank, n, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(n), LOCAL_RANK=str(rank))
    _rank_main()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) > 1 and sys.argv[1] == "spawn":
        import socket
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        n = int(sys.argv[2])
        mp.spawn(_spawned, args=(n, port), nprocs=n, join=True)
    else:
        _rank_main()
