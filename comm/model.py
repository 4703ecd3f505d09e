"""What a context-parallel call moves: the bytes each rank sends and receives, per level.

`call_traffic(...)` predicts, from the partition and the call's shapes alone (host arithmetic,
no data), exactly what `Group.traffic` counts for one `attention_forward` or
`attention_backward` of `varlen.comm` on one rank (tests/test_comm_model.py compares them on
in-process ranks and under mpiexec). It follows the methods step by step:

* ring: `cp - 1` hops of the rank's K and V shards (forward, and again in the backward,
  which adds `cp` hops of the dK/dV accumulators: float32, float64 for float64 data). On a
  document partition only the rows of documents two ranks share travel (`part.ring_count`),
  and each step's dK/dV of them go back.
* allgather: K and V all-gathered (`(cp - 1)` copies each way), in the backward too, which
  reduce-scatters dK/dV in the accumulation dtype.
* ulysses: all-to-alls of q, k, v (KV heads replicated to `lcm(Hk, cp)`), of the output and
  the lse back; the backward's of dout, out, lse in and dq, dk, dv back.
* usp (`ulysses_size=u`): the Ulysses all-to-alls inside the node group (`"intra"`), the ring
  over the groups' rows of the rank's head slice across them (`"inter"`).

On top of it the cost model (`predict`, `model`; `scripts/cp_model.py` is its command line,
with the method in its docstring): time per layer from these bytes, the links' bandwidths and
latencies, and the plans' tile counts; `choose` is what `method="auto"` asks.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from varlen._validate import dtype_name
from varlen.masks import Mask, as_mask
from varlen.plan import build_plan

from .partition import partition as make_partition

__all__ = ["call_traffic", "ring_kv_elements", "ITEMSIZE", "Cluster", "PRESETS", "Batch",
           "predict", "model", "lower_bound", "candidates", "choose"]

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


def ring_kv_elements(rows: int, heads_k: int, head_dim: int, head_dim_v: int,
                     ulysses_size: int | None = None) -> int:
    """Elements of the K and V one ring hop carries: a rank's `rows` (under usp, its group's
    `u * rows`, the `lcm(Hk, u) / u` KV heads of its slice after Ulysses' replication)."""
    u = ulysses_size or 1
    heads = heads_k * (u // math.gcd(heads_k, u)) // u
    return u * rows * heads * (head_dim + head_dim_v)


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
        kv = ring_kv_elements(Tk, Hk, D, Dv)
        _ring(d, "flat", cp, kv * isz, kv * acc, backward)
    elif method == "allgather":
        kv = ring_kv_elements(Tk, Hk, D, Dv)
        _add(d, "flat", (cp - 1) * kv * isz)
        if backward:
            _add(d, "flat", (cp - 1) * kv * acc)
    elif method == "ulysses":
        if Tq != Tk:
            raise ValueError("ulysses moves queries and keys alike: Tq_local == Tk_local")
        _ulysses(d, "flat", cp, Tq, Hq, Hk, D, Dv, isz, acc, backward)
    elif method == "usp":
        u = int(ulysses_size)
        r = cp // u
        if u > 1:
            _ulysses(d, "intra", u, Tq, Hq, Hk, D, Dv, isz, acc, backward)
        kv = ring_kv_elements(Tk, Hk, D, Dv, u)      # a group's rows, a head slice's KV heads
        _ring(d, "inter", r, kv * isz, kv * acc, backward)
    else:
        raise ValueError(f"unknown method {method!r}")
    if sinks and backward and cp > 1:
        _add(d, "flat", (cp - 1) * Hq * acc)              # dsinks summed over the group
    return d


# --------------------------------------------------------------------------------------------
# The cost model
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cluster:
    """Per GPU: `gpus_per_node`, attention TFLOP/s forward and backward, GB/s and latency (us)
    of the links inside a node and between nodes."""

    name: str
    gpus_per_node: int = 8
    tflops_fwd: float = 500.0
    tflops_bwd: float = 400.0
    intra_gbps: float = 450.0
    intra_lat_us: float = 3.0
    inter_gbps: float = 50.0
    inter_lat_us: float = 8.0


PRESETS = {"h100": Cluster("H100 SXM, 8 per node, NVLink 4 + NDR InfiniBand"),
           "h200": Cluster("H200 SXM, 8 per node, NVLink 4 + NDR InfiniBand")}
BLOCK = (128, 128)          # the tiles the cost is counted in (the sm_90a forward's)


@dataclass(frozen=True)
class Batch:
    lengths: tuple
    heads_q: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    mask: object            # "causal", "full", "sliding:W", or a varlen.Mask of scalars

    def mask_obj(self):
        if isinstance(self.mask, Mask):
            return self.mask
        if self.mask in ("causal", "full"):
            return as_mask(self.mask)
        w = int(self.mask.split(":")[1])
        return Mask(window_left=w, window_right=0)


# --------------------------------------------------------------------------------------------
# Compute: tiles of the plans
# --------------------------------------------------------------------------------------------

def _tiles_by_owner(plan, owners: int) -> np.ndarray:
    """Tiles `plan` visits, per owner of its key segments: the plan's key segments are the
    owners' (ranks' or groups') segments in owner order, the same number each, and
    `q_sched[:, j]` holds each query tile's range of tiles of key segment `j`."""
    s = np.asarray(plan.q_sched).astype(np.int64)
    spans = np.clip(s[..., 3] - s[..., 0], 0, None).sum(axis=0)        # [key segments]
    return spans.reshape(owners, -1).sum(axis=1)


def _work(part, ranks, mask, owners_group: int = 1) -> dict:
    """Per rank of `ranks` (or per group of `owners_group` ranks): tiles of its query rows
    against each owner's key rows (`[owners]`)."""
    bm, bn = BLOCK
    keys = part.gathered_segments()
    out = {}
    u = owners_group
    for r in ranks:
        g = r // u
        q = part.gathered_segments(range(g * u, g * u + u))
        plan = build_plan(q, keys, mask, block_m=bm, block_n=bn)
        out[r] = _tiles_by_owner(plan, part.cp_size // u)
    return out


# --------------------------------------------------------------------------------------------
# Time
# --------------------------------------------------------------------------------------------

def _link(cl: Cluster, span: int):
    """`(GB/s, latency s)` of a ring or collective over `span` consecutive ranks: the slowest
    link's."""
    if span > cl.gpus_per_node:
        return cl.inter_gbps * 1e9, cl.inter_lat_us * 1e-6
    return cl.intra_gbps * 1e9, cl.intra_lat_us * 1e-6


def _a2a_time(cl: Cluster, n: int, moved: int) -> float:
    """An all-to-all over `n` consecutive ranks moving `moved` bytes each way per rank."""
    if n <= 1 or not moved:
        return 0.0
    on_node = min(n, cl.gpus_per_node) - 1
    intra = moved * on_node / (n - 1)
    inter = moved - intra
    t = intra / (cl.intra_gbps * 1e9) + cl.intra_lat_us * 1e-6
    if inter:
        t = max(t, inter / (cl.inter_gbps * 1e9) + cl.inter_lat_us * 1e-6)
    return t


def _tile_seconds(b: Batch, heads: float, tflops: float, backward: bool) -> float:
    bm, bn = BLOCK
    flops = 2.0 * bm * bn * (b.head_dim + b.head_dim_v) * heads * (2.5 if backward else 1.0)
    return flops / (tflops * 1e12)


def _ring_time(step_tiles, step_bytes, tile_s, bw, lat) -> float:
    """Steps of a ring: each takes the longer of its kernels and the next step's transfer.
    `bw`, `lat`: one link for every step, or per step (lists)."""
    t = 0.0
    for s, tiles in enumerate(step_tiles):
        moved = step_bytes[s] if s + 1 < len(step_tiles) else 0
        b, l = (bw[s], lat[s]) if isinstance(bw, list) else (bw, lat)
        t += max(tiles * tile_s, moved / b + l if moved else 0.0)   # nothing posted: free
    return t


def _doc_ring_time(step_tiles, kv_t, dkv_t, tile_s) -> float:
    """The document ring: every step's K/V posted before step 0, so they overlap its kernels;
    each step's dK/dV go back under the next step's kernels."""
    t = max(step_tiles[0] * tile_s, sum(kv_t))
    for s in range(1, len(step_tiles)):
        t += max(step_tiles[s] * tile_s, dkv_t[s - 1])
    return t + (dkv_t[-1] if dkv_t else 0.0)


def predict(cl: Cluster, b: Batch, cp: int, method: str, scheme: str, u: int | None,
            work_cache: dict, part=None) -> dict:
    """Forward and backward seconds per layer (the busiest sampled rank) and its bytes."""
    cu = np.concatenate([[0], np.cumsum(b.lengths)]).astype(np.int32)
    key = (cp, scheme)
    if key not in work_cache:
        if part is None:                # the document scheme splits as its default says
            part = make_partition(cu, cp, scheme, mask=b.mask_obj())
        ranks = list(range(cp)) if cp <= 64 else sorted(set(np.linspace(0, cp - 1, 16)
                                                              .astype(int).tolist()))
        work_cache[key] = (part, ranks, {})
    part, ranks, works = work_cache[key]
    mask = b.mask_obj()
    isz, acc = ITEMSIZE[b.dtype], 8 if b.dtype == "float64" else 4
    shape = dict(heads_q=b.heads_q, heads_k=b.heads_k, head_dim=b.head_dim,
                 head_dim_v=b.head_dim_v, dtype=b.dtype)
    res = {"fwd": 0.0, "bwd": 0.0, "inter_bytes": 0, "bytes": 0}
    for backward in (False, True):
        tflops = cl.tflops_bwd if backward else cl.tflops_fwd
        worst = 0.0
        for r in ranks:
            t = call_traffic(part, r, method, backward=backward, ulysses_size=u, **shape)
            moved = sum(v["sent"] for v in t.values())
            inter_moved = 0
            if method in ("ring", "allgather"):
                if 1 not in works:
                    works[1] = _work(part, ranks, mask)
                wk = works[1][r]
                tile_s = _tile_seconds(b, b.heads_q, tflops, backward)
                bw, lat = _link(cl, cp)
                if method == "ring":
                    tiles = [wk[(r - s) % cp] for s in range(cp)]
                    if scheme == "document":
                        # step s's rows, to rank r + s and from r - s: on this node's links
                        # when both peers share it, else between nodes
                        rows_s = [part.ring_count(r, (r + s) % cp) for s in range(cp)]
                        row = b.heads_k * (b.head_dim + b.head_dim_v)
                        node, gpn = r // cl.gpus_per_node, cl.gpus_per_node
                        links = [_link(cl, 1 if ((r + s) % cp) // gpn == node ==
                                       ((r - s) % cp) // gpn else cp + 1) for s in range(cp)]
                        kv_t = [n * row * isz / x[0] + x[1] if n and s else 0.0
                                for s, (n, x) in enumerate(zip(rows_s, links))]
                        dkv_t = [n * row * acc / x[0] + x[1] if n and s and backward else 0.0
                                 for s, (n, x) in enumerate(zip(rows_s, links))]
                        sec = _doc_ring_time(tiles, kv_t, dkv_t, tile_s)
                        step_bytes = [n * row * (isz + (acc if backward else 0))
                                      for n in rows_s]
                    else:
                        kv = ring_kv_elements(part.local_rows, b.heads_k, b.head_dim,
                                              b.head_dim_v)
                        step_bytes = [kv * (isz + (acc if backward else 0))] * cp
                        sec = _ring_time(tiles, step_bytes, tile_s, bw, lat)
                else:
                    sec = moved / bw + (cp - 1) * lat + wk.sum() * tile_s
                inter_moved = moved if cp > cl.gpus_per_node and (
                    method == "allgather" or (r + 1) % cl.gpus_per_node == 0) else 0
                if method == "ring" and scheme == "document":
                    inter_moved = sum(n for s, (n, (x, _)) in enumerate(zip(step_bytes, links))
                                      if s and x < cl.intra_gbps * 1e9)
            elif method == "ulysses":
                if "all" not in works:
                    works["all"] = _work(part, [0], mask, owners_group=cp)[0]
                wk = works["all"]
                sec = _a2a_time(cl, cp, moved) + wk.sum() * _tile_seconds(
                    b, b.heads_q / cp, tflops, backward)
                on_node = min(cp, cl.gpus_per_node) - 1
                inter_moved = moved - moved * on_node // max(cp - 1, 1)
            else:                                           # usp
                r_groups = cp // u
                if ("usp", u) not in works:
                    works[("usp", u)] = _work(part, ranks, mask, owners_group=u)
                wk = works[("usp", u)][r]
                tile_s = _tile_seconds(b, b.heads_q / u, tflops, backward)
                intra = t.get("intra", {"sent": 0})["sent"]
                inter = t.get("inter", {"sent": 0})["sent"]
                bw, lat = _link(cl, cp) if r_groups > 1 else (1.0, 0.0)
                hop = inter / max(r_groups - 1, 1) if not backward else 0
                if backward:        # K/V hops (r - 1) and dK/dV hops (r): per step
                    hop = ring_kv_elements(part.local_rows, b.heads_k, b.head_dim,
                                           b.head_dim_v, u) * (isz + acc)
                g = r // u
                tiles = [wk[(g - s) % r_groups] for s in range(r_groups)]
                sec = _a2a_time(cl, u, intra) + _ring_time(tiles, [hop] * r_groups, tile_s,
                                                           bw, lat)
                inter_moved = inter if cp > cl.gpus_per_node else 0
            worst = max(worst, sec)
            res["inter_bytes"] = max(res["inter_bytes"], inter_moved)
            res["bytes"] = max(res["bytes"], moved)
        res["bwd" if backward else "fwd"] = worst
    return res


def lower_bound(cl: Cluster, b: Batch, cp: int, work_cache: dict) -> dict:
    """The batch's tiles over cp ranks, no communication."""
    cu = np.concatenate([[0], np.cumsum(b.lengths)]).astype(np.int32)
    part = make_partition(cu, 1, "contiguous")          # one segment per document
    key = ("whole",)
    if key not in work_cache:
        work_cache[key] = int(_work(part, [0], b.mask_obj())[0].sum())
    tiles = work_cache[key]
    return {ph: tiles * _tile_seconds(b, b.heads_q, t, ph == "bwd") / cp
            for ph, t in (("fwd", cl.tflops_fwd), ("bwd", cl.tflops_bwd))}


def candidates(cl: Cluster, b: Batch, cp: int) -> list:
    out = [("ring", None), ("allgather", None)]
    if b.heads_q % cp == 0:
        out.append(("ulysses", None))
    for u in range(2, min(cl.gpus_per_node, cp) + 1):
        if cp % u == 0 and b.heads_q % u == 0 and u < cp:
            out.append(("usp", u))
    return out


SCHEMES = ("zigzag", "document")


def model(cl: Cluster, b: Batch, cps, schemes=SCHEMES) -> dict:
    rows = []
    cache = {}
    for cp in cps:
        lb = lower_bound(cl, b, cp, cache)
        for method, u in candidates(cl, b, cp):
            for scheme in schemes:
                p = predict(cl, b, cp, method, scheme, u, cache)
                rows.append(dict(cp=cp, method=method, ulysses_size=u, scheme=scheme, **p,
                                 total=p["fwd"] + p["bwd"],
                                 lower_bound=lb["fwd"] + lb["bwd"]))
        for key in [k for k in cache if k[0] == cp]:     # keep the memory of one cp at a time
            del cache[key]
    return {"cluster": asdict(cl), "batch": asdict(b), "rows": rows}




def choose(part, *, heads_q: int, heads_k: int, head_dim: int, head_dim_v: int, dtype: str,
           mask, cluster: Cluster, cache: dict | None = None) -> dict:
    """What `method="auto"` runs on partition `part` (its scheme is the caller's): the
    candidate with the least predicted forward + backward time per layer. Returns
    `{"method", "ulysses_size", "predicted_ms", "why"}`; `mask` a mask name, a `varlen.Mask`
    of scalars, or None for full."""
    lengths = tuple(int(x) for x in np.asarray(part.seqlens).tolist())
    b = Batch(lengths, int(heads_q), int(heads_k), int(head_dim), int(head_dim_v), dtype,
              "full" if mask is None else as_mask(mask))
    cache = {} if cache is None else cache
    cp = part.cp_size
    options = []
    for method, u in candidates(cluster, b, cp):
        p = predict(cluster, b, cp, method, part.scheme, u, cache, part=part)
        options.append((p["fwd"] + p["bwd"], method, u, p))
    options.sort(key=lambda o: o[0])
    t, method, u, p = options[0]
    others = ", ".join(f"{m}{f'({v})' if v else ''} {1e3 * o:.2f} ms"
                       for o, m, v, _ in options[1:4])
    why = (f"predicted {1e3 * t:.2f} ms per layer (forward + backward) on "
           f"{cluster.name} with {cluster.gpus_per_node} GPUs per node for cp={cp}, "
           f"{part.scheme} partition; next: {others or 'none'}")
    return {"method": method, "ulysses_size": u, "predicted_ms": float(1e3 * t), "why": why}

