"""What a context-parallel call moves: the bytes each rank sends and receives, per level.

`call_traffic(...)` predicts, from the partition and the call's shapes alone (host arithmetic,
no data), exactly what `Group.traffic` counts for one `attention_forward` or
`attention_backward` of `varlen.comm` on one rank (tests/test_comm_model.py compares them on
in-process ranks and under mpiexec). It follows the methods step by step:

* ring: `cp - 1` hops of the rank's K and V shards (forward, and again in the backward, which
  adds `cp` hops of the dK/dV accumulators: float32, float64 for float64 data). On a document partition only the rows of
  documents two ranks share travel (`part.ring_count`), and each step's dK/dV of them go back.
* allgather: K and V all-gathered (`(cp - 1)` copies each way), in the backward too, which
  reduce-scatters dK/dV in the accumulation dtype.
* ulysses: all-to-alls of q, k, v (KV heads replicated to `lcm(Hk, cp)`), of the output and
  the lse back; the backward's of dout, out, lse in and dq, dk, dv back.
* usp (`ulysses_size=u`): the Ulysses all-to-alls inside the node group (`"intra"`), the ring
  over the groups' rows of the rank's head slice across them (`"inter"`).

`scripts/cp_model.py` builds the cost model (time per layer from these bytes, the links'
bandwidths and the plans' tile counts) on top of it.
"""
from __future__ import annotations

import math

import numpy as np

from varlen._validate import dtype_name

__all__ = ["call_traffic", "ITEMSIZE"]

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _add(d: dict, level: str, sent: int, received: int | None = None) -> None:
    if not sent and not received:
        return                                  # a level that moves nothing is left out
    t = d.setdefault(level, {"sent": 0, "received": 0})
    t["sent"] += int(sent)
    t["received"] += int(sent if received is None else received)


def _a2a(n: int, nbytes: int) -> int:
    """What an all-to-all of an `[n, ...]` array of `nbytes` moves each way."""
    return (n - 1) * (nbytes // n)


def _ring(d, level, cp, kv_bytes, acc_kv_bytes, backward):
    if cp > 1:
        _add(d, level, (cp - 1) * kv_bytes)             # K/V, one hop per step but the last
        if backward:
            _add(d, level, cp * acc_kv_bytes)           # dK/dV, one hop per step


def _doc_ring(d, level, part, rank, row_bytes, acc_row_bytes, backward):
    cp = part.cp_size
    for step in range(1, cp):
        dst, src = (rank + step) % cp, (rank - step) % cp
        out_rows, in_rows = part.ring_count(rank, dst), part.ring_count(src, rank)
        _add(d, level, out_rows * row_bytes, in_rows * row_bytes)
        if backward:                                     # dK/dV of the received rows go back
            _add(d, level, in_rows * acc_row_bytes, out_rows * acc_row_bytes)


def _ulysses(d, level, n, T, Hq, Hk, D, Dv, isz, lse_isz, backward):
    """The all-to-alls of Ulysses over `n` ranks of `T` rows each."""
    f = n // math.gcd(Hk, n)                              # KV head replicas
    q = T * Hq * D * isz
    o, lse = T * Hq * Dv * isz, Hq * T * lse_isz
    if not backward:
        _add(d, level, _a2a(n, q) + _a2a(n, T * Hk * f * D * isz) +
             _a2a(n, T * Hk * f * Dv * isz) + _a2a(n, o) + _a2a(n, lse))
        return
    # in: dout, q, k, v, out, lse; back: dq, dk, dv
    moved = (_a2a(n, o) + _a2a(n, q) + _a2a(n, T * Hk * f * D * isz) +
             _a2a(n, T * Hk * f * Dv * isz) + _a2a(n, o) + _a2a(n, lse) + _a2a(n, q) +
             _a2a(n, T * Hk * f * D * isz) + _a2a(n, T * Hk * f * Dv * isz))
    _add(d, level, moved)


def call_traffic(parts, rank: int, method: str, *, heads_q: int, heads_k: int, head_dim: int,
                 head_dim_v: int | None = None, dtype="bfloat16", backward: bool = False,
                 ulysses_size: int | None = None, sinks: bool = False) -> dict:
    """`{level: {"sent": bytes, "received": bytes}}` one call moves on `rank`.

    Args:
        parts: a `varlen.comm` partition or its `(queries, keys)` pair (host metadata).
        rank, method: the rank and method (`"ring"`, `"allgather"`, `"ulysses"`, `"usp"`).
        heads_q, heads_k, head_dim, head_dim_v: `Hq`, `Hk`, `D`, `Dv` (default `D`).
        dtype: the data's dtype (name or NumPy dtype).
        backward: the backward call (default: the forward).
        ulysses_size: `u` of `"usp"`.
        sinks: the call passes sinks (its backward sums dsinks over the group: default
            `sinks_grad="group"`).
    Levels as `Group.traffic` names them: `"flat"` for a method on the caller's group,
    `"intra"`/`"inter"` for usp's node and ring groups. Aux gradients of a score_mod are not
    included (their all-gather is that of the float aux arrays' sizes).
    """
    pq, pk = parts if isinstance(parts, (tuple, list)) else (parts, parts)
    name = dtype if isinstance(dtype, str) else dtype_name(np.dtype(dtype))
    isz = ITEMSIZE[name]
    acc = 8 if name == "float64" else 4
    Hq, Hk, D = int(heads_q), int(heads_k), int(head_dim)
    Dv = D if head_dim_v is None else int(head_dim_v)
    cp, Tq, Tk = pq.cp_size, pq.local_rows, pk.local_rows
    d: dict = {}
    if method == "ring" and pk.scheme == "document":
        _doc_ring(d, "flat", pk, rank, Hk * (D + Dv) * isz, Hk * (D + Dv) * acc, backward)
    elif method == "ring":
        _ring(d, "flat", cp, Tk * Hk * (D + Dv) * isz, Tk * Hk * (D + Dv) * acc, backward)
    elif method == "allgather":
        _add(d, "flat", (cp - 1) * Tk * Hk * (D + Dv) * isz)
        if backward:
            _add(d, "flat", (cp - 1) * Tk * Hk * (D + Dv) * acc)
    elif method == "ulysses":
        if Tq != Tk:
            raise ValueError("ulysses moves queries and keys alike: Tq_local == Tk_local")
        _ulysses(d, "flat", cp, Tq, Hq, Hk, D, Dv, isz, acc, backward)
    elif method == "usp":
        u = int(ulysses_size)
        r = cp // u
        if u > 1:
            _ulysses(d, "intra", u, Tq, Hq, Hk, D, Dv, isz, acc, backward)
        f = u // math.gcd(Hk, u)
        rows, heads = u * Tk, Hk * f // u                  # a group's rows, a slice's heads
        _ring(d, "inter", r, rows * heads * (D + Dv) * isz, rows * heads * (D + Dv) * acc,
              backward)
    else:
        raise ValueError(f"unknown method {method!r}")
    if sinks and backward and cp > 1:
        _add(d, "flat", (cp - 1) * Hq * acc)              # dsinks summed over the group
    return d
