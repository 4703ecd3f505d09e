#!/usr/bin/env python
"""CPU benchmark: the `cpu` backend against the CPU attention a user would pick instead, on the
same tokens, in one run.

    python scripts/bench_cpu.py [--quick] [--threads 1 2] [--json out/bench_cpu/bench_cpu.json]

Workloads (float32, causal, packed THD batches; every runner gets the same tokens):
  uniform   documents of uniform length 512 .. 4096, --tokens in all
  longtail  log-normal lengths (many short documents, a few long ones), --tokens in all
  long16k   one causal document of 16384 tokens
  sliding   the uniform mix under a causal sliding window of 256 keys
each with the head configurations of --configs (default: Hq8/Hk2 D64 and Hq8/Hk8 D128; long16k
Hq8/Hk2 D64 only).

Runners:
  ours         varlen backend="cpu", the plan built once and reused (as a model does per layer)
  sdpa-loop    torch scaled_dot_product_attention, one call per sequence (GQA: K/V heads
               repeated inside the timed call, the fast path on CPU)
  sdpa-padded  the same on the padded batch [B, H, Lmax, D] (is_causal; a boolean band mask for
               the sliding window)
  flex         torch.compile(flex_attention) with a document (and window) block mask on the
               packed batch; forward only where torch has no CPU backward
  jax          jax.nn.dot_product_attention (XLA, jitted) on the padded batch, in a subprocess
               per thread count (XLA's threads are fixed at start-up); XLA holds the
               [B, H, Lmax, Lmax] scores, so the batch is padded in sub-batches (longest first)
               that keep them under --jax-memory-gib, and a sequence alone over it is skipped

Method: a call at n threads first pins the whole process to n CPUs (sched_setaffinity of
every thread) and sets torch, Numba and the BLAS (threadpoolctl) to n threads; at n above one
only the --scaling-runners are timed (default: ours and the SDPA loop, for the scaling
figure). Every runner is warmed up once at each thread count, then timed in --repeat rounds
that run each runner at each thread count once in turn (a change of load or of the machine's
speed hits runners and thread counts alike, so the scaling figure compares calls made
minutes apart at most seconds apart); a figure is the best wall-clock time of
its runs (a call whose warm-up took over 4 s is timed once), for the forward alone and for
forward + backward (gradients of sum(out * dout)). JAX is compiled ahead of time and timed
once (it is an order of magnitude behind the others). GFLOP/s count only visible query-key
pairs: forward 4 * pairs * D per query head, forward + backward 3.5x that (the backward's five
products against the forward's two). The float32 GEMM peak of the same CPUs (NumPy sgemm
2048^3, best of 5) is measured at the start and before each workload, at each thread count;
the best sample of the run is the peak, and figures are given as % of it. At one thread the
figures by CPU time are given too (GFLOP/s over the CPU time the process got, against the
GEMM's by CPU time): on a shared machine they show what the core did while it ran this
process. Peak memory is the extra resident memory of the warm-up call (peak RSS, reset before
it, minus RSS before it; ours' working arrays kept between calls are released before it, so
they count), run with glibc mapping every allocation of 64 KiB or more on its own
so that freed buffers leave the process; the timed runs use the heap as glibc's dynamic
threshold would after a warm-up (32 MiB). cpu/wall is the CPU time the process got per second
of wall time: below n, other load shared the CPUs.

Correctness first: before any runner is timed on a workload, its output (and gradients, where
it has a backward) on that workload are compared with the float64 reference (backend="numpy"):
max |error| must be within 1e-3 of max |reference| for every tensor. A runner that fails
reports no figure for that workload; if ours fails the script exits with status 2.

Results: JSON (with the command, machine, method and every figure) and a PNG beside it; a
summary table and the issue's targets, met or not, on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
# Idle OpenMP threads (Numba's and torch's) sleep instead of spinning, for every runner alike:
# a spinning idle thread keeps the CPU a call is pinned to busy, and after a switch from one
# to two CPUs the first calls ran at half speed until the pool settled (seen here: 56 ms
# against 15 for a sliding-window forward).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from varlen._cli import ArgumentParser, name_list, positive_int  # noqa: E402

RUNNERS = ("ours", "sdpa-loop", "sdpa-padded", "flex", "jax")
PEERS = RUNNERS[1:]
WORKLOADS = ("uniform", "longtail", "long16k", "sliding")
PHASES = ("fwd", "fwd+bwd")
# Hq/Hk/D per workload: both head configurations on the document mixes, GQA 8/2 D64 (the issue's
# figures) on the long document and the sliding window
DEFAULT_CONFIGS = {"uniform": [(8, 2, 64), (8, 8, 128)], "longtail": [(8, 2, 64), (8, 8, 128)],
                   "long16k": [(8, 2, 64)], "sliding": [(8, 2, 64)]}
WINDOW = 256
PARITY_TOL = 1e-3
GEMM_N = 2048
# A figure whose warm-up takes longer than this is timed once.
SLOW_S = 4.0


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------

def lengths_of(name: str, tokens: int, seed: int = 0) -> list:
    """Document lengths of a workload (deterministic)."""
    rng = np.random.default_rng(seed)
    if name == "long16k":
        return [16384]
    out = []
    while sum(out) < tokens:
        if name in ("uniform", "sliding"):
            out.append(int(rng.integers(512, 4097)))
        else:
            out.append(int(np.clip(rng.lognormal(6.3, 1.2), 16, 8192)))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def window_of(name: str):
    return WINDOW if name == "sliding" else None


def visible_pairs(lengths, window) -> int:
    """Query-key pairs a causal (windowed) mask lets through, per head."""
    total = 0
    for L in lengths:
        i = np.arange(L, dtype=np.int64)
        total += int((np.minimum(i + 1, window + 1) if window is not None else i + 1).sum())
    return total


def flops(pairs: int, Hq: int, D: int) -> dict:
    fwd = 4.0 * pairs * Hq * D
    return {"fwd": fwd, "fwd+bwd": 3.5 * fwd}


class Data:
    """One workload's float32 tensors, packed `[T, H, D]`, and its layout."""

    def __init__(self, lengths, Hq, Hk, D, window, seed=0):
        rng = np.random.default_rng(seed)
        self.lengths, self.Hq, self.Hk, self.D, self.window = list(lengths), Hq, Hk, D, window
        self.T = sum(lengths)
        self.cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        mk = lambda H: rng.standard_normal((self.T, H, D), dtype=np.float32)  # noqa: E731
        self.q, self.k, self.v, self.dout = mk(Hq), mk(Hk), mk(Hk), mk(Hq)

    def mask(self):
        import varlen
        if self.window is None:
            return "causal"
        return varlen.Mask(window_left=self.window, window_right=0)


# ---------------------------------------------------------------------------------------------
# threads, timing, memory
# ---------------------------------------------------------------------------------------------

def pin(n: int) -> list:
    """Pin every thread of this process to the first `n` allowed CPUs; set the thread pools."""
    cpus = sorted(os.sched_getaffinity(0) | _ALL_CPUS)[:n]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass
    import numba
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        import torch
        torch.set_num_threads(n)
    except ImportError:
        pass
    return cpus


_ALL_CPUS = set(os.sched_getaffinity(0))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3        # mallopt's parameter numbers
TRACKED_THRESHOLD = 1 << 16          # every allocation of 64 KiB or more mapped on its own
TIMED_THRESHOLD = 32 << 20           # glibc's dynamic threshold at its maximum (64-bit)


def _malloc_mode(tracked: bool) -> None:
    """Tracked: glibc maps every allocation of 64 KiB or more on its own and unmaps it when
    freed (and the heap is trimmed first), so a call's peak RSS measures what it allocates
    rather than what earlier calls left in the heap. Timed: the heap serves what glibc's
    dynamic threshold would after a warm-up, so no runner pays a page fault per buffer."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        threshold = TRACKED_THRESHOLD if tracked else TIMED_THRESHOLD
        libc.mallopt(M_MMAP_THRESHOLD, threshold)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold)     # as glibc's dynamic rule sets it
        if tracked:
            libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _tracked_run(fn) -> tuple:
    """`(seconds, extra peak MiB or None)` of one call in the tracked allocation mode."""
    _malloc_mode(True)
    getattr(fn, "release", lambda: None)()      # what a runner keeps between calls counts
    tracked = _reset_peak_rss()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    mib = (_status("VmHWM") - base) / 2 ** 20 if tracked else None
    _malloc_mode(False)
    return dt, mib


def measure(calls: dict, repeat: int, tick) -> dict:
    """`calls {key: fn}` timed in rounds: a warm-up of each (which gives its extra peak RSS),
    then `repeat` rounds that run each once in turn (so that a change of load on a shared
    machine hits them alike), keeping the best wall time and the best CPU time; a call whose
    warm-up took over SLOW_S runs in the first round only. Returns `{key: {"seconds",
    "cpu_seconds", "runs", "peak_mem_mib", "cpu_per_wall"}}`."""
    out = {}
    for key, fn in calls.items():
        tick(f"{key}: warm-up")
        dt, mib = _tracked_run(fn)
        out[key] = {"seconds": float("inf"), "cpu_seconds": float("inf"),
                    "runs": 1 if dt > SLOW_S else repeat, "peak_mem_mib": mib,
                    "wall": 0.0, "cpu": 0.0}
    for i in range(repeat):
        for key, fn in calls.items():
            rec = out[key]
            if i >= rec["runs"]:
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            rec["wall"] += dt
            rec["cpu"] += dc
            rec["seconds"] = min(rec["seconds"], dt)
            rec["cpu_seconds"] = min(rec["cpu_seconds"], dc)
    for rec in out.values():
        rec["cpu_per_wall"] = rec.pop("cpu") / max(rec.pop("wall"), 1e-12)
    return out


def gemm_peak(n_threads: int, repeat: int = 5) -> dict:
    """float32 GEMM GFLOP/s of NumPy's BLAS on `n_threads` threads, best of `repeat` by wall
    clock and by CPU time."""
    import threadpoolctl
    rng = np.random.default_rng(0)
    a = rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    b = rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    flop = 2.0 * GEMM_N ** 3
    with threadpoolctl.threadpool_limits(n_threads, user_api="blas"):
        a @ b
        wall, cpu = float("inf"), float("inf")
        for _ in range(repeat):
            c0, t0 = time.process_time(), time.perf_counter()
            a @ b
            wall = min(wall, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
    return {"wall": flop / wall / 1e9, "cpu": flop / cpu / 1e9}


# ---------------------------------------------------------------------------------------------
# runners: each returns {phase: callable} and the outputs to check, or raises why it cannot run
# ---------------------------------------------------------------------------------------------

def run_ours(d: Data):
    return _ours_with(d, d.mask())


def _torch_inputs(torch, d):
    return [torch.from_numpy(x) for x in (d.q, d.k, d.v, d.dout)]


def _band(torch, L, window, device="cpu"):
    i = torch.arange(L, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff <= window)


def _sdpa(torch, q, k, v, G, window):
    """`q [B, Hq, L, D]`, `k, v [B, Hk, L, D]`: causal (windowed) SDPA, K/V heads repeated."""
    import torch.nn.functional as F
    if G > 1:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(torch, q.shape[2], window))


def _autograd(torch, forward, inputs, dout, unpack):
    """`{phase: callable}` and outputs `(out, (dq, dk, dv))` (packed) of an autograd forward."""
    def fwd():
        with torch.no_grad():
            return forward(*inputs)

    def fwd_bwd():
        xs = [x.detach().requires_grad_(True) for x in inputs]
        out = forward(*xs)
        grads = torch.autograd.grad(out, xs, dout(out))
        return out, grads
    out, grads = fwd_bwd()
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}, {"out": unpack(out, 0),
                                               "grads": [unpack(g, i) for i, g in
                                                         enumerate(grads)]}


def run_sdpa_loop(d: Data):
    import torch
    q, k, v, do = _torch_inputs(torch, d)
    G = d.Hq // d.Hk
    spans = [(int(d.cu[i]), int(d.cu[i + 1])) for i in range(len(d.lengths))]
    t = lambda x: x.transpose(0, 1).unsqueeze(0)                      # noqa: E731 [1, H, L, D]

    def forward(q, k, v):
        return [_sdpa(torch, t(q[a:b]), t(k[a:b]), t(v[a:b]), G, d.window) for a, b in spans]

    def dout(outs):
        return [t(do[a:b]) for a, b in spans]

    def fwd_bwd():
        xs = [x.detach().requires_grad_(True) for x in (q, k, v)]
        outs = forward(*xs)
        return outs, torch.autograd.grad(outs, xs, dout(outs))

    def fwd():
        with torch.no_grad():
            return forward(q, k, v)
    outs, grads = fwd_bwd()
    packed = torch.cat([o[0].transpose(0, 1) for o in outs]).detach().numpy()
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}, {"out": packed, "grads": [g.numpy() for g in grads]}


def _padded(torch, d, x):
    """`[T, H, D]` -> `[B, H, Lmax, D]` (zeros past each sequence)."""
    Lmax = max(d.lengths)
    out = torch.zeros(len(d.lengths), x.shape[1], Lmax, x.shape[2])
    for i, (a, b) in enumerate(zip(d.cu[:-1], d.cu[1:])):
        out[i, :, :b - a] = x[a:b].transpose(0, 1)
    return out


def _unpad(d, x):
    """`[B, H, Lmax, D]` -> packed `[T, H, D]` (NumPy)."""
    x = x.detach().numpy()
    return np.concatenate([x[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(d.lengths)])


def run_sdpa_padded(d: Data):
    import torch
    q, k, v, do = (_padded(torch, d, x) for x in _torch_inputs(torch, d))
    G = d.Hq // d.Hk

    def forward(q, k, v):
        return _sdpa(torch, q, k, v, G, d.window)
    return _autograd(torch, forward, (q, k, v), lambda o: do, lambda x, i: _unpad(d, x))


_FLEX = {}


def run_flex(d: Data):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    doc = torch.repeat_interleave(torch.arange(len(d.lengths)), torch.tensor(d.lengths))
    window = d.window

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        if window is not None:
            ok = ok & (q_idx - kv_idx <= window)
        return ok
    block_mask = create_block_mask(mask_mod, None, None, d.T, d.T, device="cpu")
    t = lambda x: x.transpose(0, 1).unsqueeze(0).contiguous()       # noqa: E731 [1, H, T, D]
    q, k, v, do = (t(x) for x in _torch_inputs(torch, d))

    def forward(q, k, v):
        return _FLEX["fn"](q, k, v, block_mask=block_mask, enable_gqa=d.Hq != d.Hk)

    def fwd():
        with torch.no_grad():
            return forward(q, k, v)
    out = fwd()[0].transpose(0, 1).numpy()
    phases, outputs = {"fwd": fwd}, {"out": out}
    try:
        calls, both = _autograd(torch, forward, (q, k, v), lambda o: do,
                                lambda x, i: x[0].transpose(0, 1).detach().numpy())
        phases["fwd+bwd"], outputs["grads"] = calls["fwd+bwd"], both["grads"]
    except Exception as e:  # noqa: BLE001 - torch's own "not supported" for the CPU backward
        outputs["no_backward"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        # after the failed attempt Dynamo would run flex_attention eagerly (scores in full):
        # start over and compile the forward again
        torch._dynamo.reset()
        fwd()
    return phases, outputs


def _jax_gib(batch: int, Hq: int, L: int) -> float:
    """Scores and their gradients of XLA's attention on a padded batch (five [B, H, L, L])."""
    return 5 * batch * Hq * L * L * 4 / 2 ** 30


def jax_sub_batches(d: Data, limit_gib: float) -> list:
    """Sequence indices per padded sub-batch: longest first, as many per sub-batch as keep its
    scores under `limit_gib` (a user's way to fit XLA's attention in memory)."""
    order = sorted(range(len(d.lengths)), key=lambda i: -d.lengths[i])
    groups, cur = [], []
    for i in order:
        L = d.lengths[cur[0]] if cur else d.lengths[i]
        if cur and _jax_gib(len(cur) + 1, d.Hq, L) > limit_gib:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    worst = max(_jax_gib(1, d.Hq, d.lengths[g[0]]) for g in groups)
    if worst > limit_gib:
        raise RuntimeError(f"skipped: XLA's padded attention of one {max(d.lengths)}-token "
                           f"sequence holds ~{worst:.0f} GiB of scores (over --jax-memory-gib "
                           f"{limit_gib:g})")
    return groups


# The JAX runner runs in a child process: XLA's thread count is fixed when it starts.
JAX_CHILD = r"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
src, dst, repeat, window = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
z = np.load(src)
lengths, groups = z["lengths"], json.loads(str(z["groups"]))
cu = np.concatenate([[0], np.cumsum(lengths)])
kw = dict(is_causal=True, implementation="xla")
if window >= 0:
    kw["local_window_size"] = (window, 0)


def attn(q, k, v, lens):
    return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=lens,
                                        key_value_seq_lengths=lens, **kw)


def both(q, k, v, do, lens):
    out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, lens), q, k, v)
    return out, vjp(do)


fns = {"fwd": jax.jit(attn), "fwd+bwd": jax.jit(both)}
batches = []
for g in groups:                        # one padded [b, L, H, D] batch per sub-batch
    L = int(lengths[g].max())
    def pad(x):
        out = np.zeros((len(g), L) + x.shape[1:], x.dtype)
        for j, i in enumerate(g):
            out[j, :lengths[i]] = x[cu[i]:cu[i + 1]]
        return jnp.asarray(out)
    batches.append((g, [pad(z[n]) for n in ("q", "k", "v", "dout")],
                    jnp.asarray(lengths[g], jnp.int32)))


def args_of(phase, q, k, v, do, lens):
    return (q, k, v, lens) if phase == "fwd" else (q, k, v, do, lens)


# compiled ahead of time (one executable per sub-batch shape), so no timed run compiles
compiled = {(phase, i): fns[phase].lower(*args_of(phase, *xs, lens)).compile()
            for phase in fns for i, (g, xs, lens) in enumerate(batches)}


def run(phase):
    return [jax.block_until_ready(compiled[phase, i](*args_of(phase, *xs, lens)))
            for i, (g, xs, lens) in enumerate(batches)]


times, results = {}, {}
for phase in fns:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        results[phase] = run(phase)
        best = min(best, time.perf_counter() - t0)
    times[phase] = best
outs = {n: np.zeros((int(cu[-1]),) + z[x].shape[1:], np.float32)
        for n, x in (("out", "q"), ("dq", "q"), ("dk", "k"), ("dv", "v"))}
for (g, _, _), (out, grads) in zip(batches, results["fwd+bwd"]):
    for n, a in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        a = np.asarray(a)
        for j, i in enumerate(g):
            outs[n][cu[i]:cu[i + 1]] = a[j, :lengths[i]]
np.savez(dst, **outs)
print(json.dumps(times))
"""


def run_jax(d: Data, n_threads: int, cpus: list, repeat: int, limit_gib: float):
    """Times `{phase: seconds}` and outputs of the JAX runner, from a child process pinned to
    `cpus` with XLA limited to `n_threads`."""
    import importlib.util
    if importlib.util.find_spec("jax") is None:
        raise RuntimeError("skipped: jax is not installed")
    groups = jax_sub_batches(d, limit_gib)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        np.savez(src, q=d.q, k=d.k, v=d.v, dout=d.dout, lengths=np.asarray(d.lengths),
                 groups=json.dumps(groups))
        env = dict(os.environ, XLA_FLAGS=(f"--xla_cpu_multi_thread_eigen={n_threads > 1} "
                                          f"intra_op_parallelism_threads={n_threads}"),
                   JAX_PLATFORMS="cpu", OMP_NUM_THREADS=str(n_threads))
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), sys.executable, "-c", JAX_CHILD, src,
               dst, str(repeat), str(d.window if d.window is not None else -1)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"jax child failed: {r.stderr.strip().splitlines()[-1:]}")
        times = json.loads(r.stdout.strip().splitlines()[-1])
        z = np.load(dst)
        outputs = {"out": z["out"], "grads": [z["dq"], z["dk"], z["dv"]]}
    return times, outputs, len(groups)


# ---------------------------------------------------------------------------------------------
# parity
# ---------------------------------------------------------------------------------------------

def reference(d: Data):
    """float64 out and gradients from backend="numpy" (the oracle of the test suite)."""
    import varlen
    x = [a.astype(np.float64) for a in (d.q, d.k, d.v, d.dout)]
    mask = d.mask()
    out, lse = varlen.attention_forward(*x[:3], d.cu, d.cu, mask=mask, backend="numpy")
    grads = varlen.attention_backward(x[3], *x[:3], out, lse, d.cu, d.cu, mask=mask,
                                      backend="numpy")
    return {"out": out, "grads": list(grads)}


def parity(outputs: dict, ref: dict) -> dict:
    """max |error| / max |reference| per tensor; raises AssertionError beyond PARITY_TOL."""
    pairs = [("out", outputs["out"], ref["out"])]
    if "grads" in outputs:
        pairs += list(zip(("dq", "dk", "dv"), outputs["grads"], ref["grads"]))
    errors = {}
    for name, got, want in pairs:
        got = np.asarray(got, np.float64)
        if got.shape != want.shape:
            raise AssertionError(f"{name}: shape {got.shape} != {want.shape}")
        rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
        errors[name] = rel
        if not rel <= PARITY_TOL:          # NaN fails too
            raise AssertionError(f"{name}: max |error| {rel:.2e} x max |ref| > {PARITY_TOL}")
    return errors


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def machine() -> dict:
    info = dict(python=platform.python_version(), numpy=np.__version__,
                cpus_allowed=len(_ALL_CPUS), load_average=list(os.getloadavg()),
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        info["cpu"] = platform.processor()
    for mod in ("numba", "scipy", "torch", "jax", "threadpoolctl"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    try:
        import threadpoolctl
        info["blas"] = [{k: lib.get(k) for k in ("internal_api", "version", "architecture",
                                                  "filepath")}
                        for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    except ImportError:
        pass
    return info


class Progress:
    """A progress bar on stderr, one line per step: `[####----] i/N elapsed  step`."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.t0, self.enabled = total, 0, time.time(), enabled

    def __call__(self, step: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        elapsed = time.time() - self.t0
        print(f"[{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total} "
              f"{elapsed // 60:3.0f}m{elapsed % 60:02.0f}s  {step}", file=sys.stderr, flush=True)


def plot(results, peaks, threads, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot", file=sys.stderr)
        return None
    labels = sorted({r["label"] for r in results}, key=[r["label"] for r in results].index)
    fig, axes = plt.subplots(len(PHASES), len(threads), squeeze=False,
                             figsize=(max(8, 1.2 * len(labels)) * len(threads), 8))
    width = 0.8 / len(RUNNERS)
    for col, n in enumerate(threads):
        for row, phase in enumerate(PHASES):
            ax = axes[row][col]
            for j, runner in enumerate(RUNNERS):
                ys = []
                for label in labels:
                    rec = next((r for r in results if r["label"] == label and
                                r["threads"] == n), {})
                    ys.append((rec.get("runners", {}).get(runner, {}).get(phase) or {})
                              .get("gflops") or 0)
                ax.bar(np.arange(len(labels)) + j * width, ys, width, label=runner)
            ax.axhline(peaks[str(n)]["wall"], color="k", ls="--", lw=0.8, label="fp32 GEMM peak")
            ax.set_title(f"{phase}, {n} thread{'s' if n > 1 else ''}")
            ax.set_ylabel("GFLOP/s (visible pairs)")
            ax.set_xticks(np.arange(len(labels)) + 0.4, labels, rotation=30, ha="right",
                          fontsize=7)
            ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _ms(rec, runner, phase):
    r = (rec["runners"].get(runner) or {}).get(phase)
    return f"{r['seconds'] * 1e3:.0f}" if r else "-"


def summary(results, threads) -> list:
    """Per thread count: ms of every runner (fwd / fwd+bwd), ours vs the best peer, ours as %
    of the GEMM peak, extra peak memory of ours and of the per-sequence SDPA loop."""
    lines = []
    for n in threads:
        lines.append(f"\n{n} thread(s): ms fwd / fwd+bwd per runner; ours vs the best peer "
                     f"(x faster); ours % of GEMM peak; extra peak MiB (f+b) ours | sdpa-loop")
        lines.append(f"{'workload':26}" + "".join(f"{r:>17}" for r in RUNNERS) +
                     f"{'vs best peer':>16}{'% peak':>13}{'MiB':>13}")
        for rec in (r for r in results if r["threads"] == n):
            cells = "".join(f"{_ms(rec, r, 'fwd') + ' / ' + _ms(rec, r, 'fwd+bwd'):>17}"
                            for r in RUNNERS)
            best = rec.get("vs_best_peer", {})
            ratio = " / ".join(f"{best[p]['ratio']:.2f}" if best.get(p) else "-"
                               for p in PHASES)
            ours = rec["runners"].get("ours", {})
            pct = " / ".join(f"{ours[p]['pct_gemm_peak']:.0f}" if ours.get(p) else "-"
                             for p in PHASES)
            mem = [(rec["runners"].get(r) or {}).get("fwd+bwd") for r in ("ours", "sdpa-loop")]
            mem = " | ".join(f"{m['peak_mem_mib']:.0f}" if m and m["peak_mem_mib"] is not None
                             else "-" for m in mem)
            lines.append(f"{rec['label']:26}{cells}{ratio:>16}{pct:>13}{mem:>13}")
    return lines


def _target(values, ok):
    """`{"met": True/False, "values": [...]}`; met is None (not measured) without values.
    Values stay unrounded: a ratio of 1.799 does not meet 1.8."""
    return {"met": all(ok(v) for v in values) if values else None, "values": values}


def targets(results, threads) -> dict:
    """The issue's targets, from this run's figures."""
    ones = [r for r in results if r["threads"] == 1]
    out = {"ours >= 1.0x the best CPU peer, fwd and fwd+bwd, 1 thread": _target(
        [(r["label"], p, r["vs_best_peer"][p]["peer"], r["vs_best_peer"][p]["ratio"])
         for r in ones for p in PHASES if r["vs_best_peer"].get(p)], lambda v: v[3] >= 1.0)}
    scal = []
    for r in ones:
        two = next((x for x in results if x["threads"] == 2 and x["label"] == r["label"]), None)
        for p in PHASES:
            a = r["runners"].get("ours", {}).get(p)
            b = two and two["runners"].get("ours", {}).get(p)
            if a and b:
                scal.append((r["label"], p, a["seconds"] / b["seconds"]))
    out["ours on 2 threads >= 1.8x 1 thread"] = _target(scal, lambda v: v[2] >= 1.8)
    mem = []
    for r in ones:
        a = r["runners"].get("ours", {}).get("fwd+bwd")
        b = (r["runners"].get("sdpa-loop") or {}).get("fwd+bwd")
        if a and b and a["peak_mem_mib"] is not None and b["peak_mem_mib"]:
            mem.append((r["label"], a["peak_mem_mib"], b["peak_mem_mib"]))
    out["ours' extra peak memory <= 2x the sdpa-loop's (fwd+bwd, 1 thread)"] = _target(
        mem, lambda v: v[1] <= 2 * v[2])
    long = [(r["label"], p, r["runners"]["ours"][p]["pct_gemm_peak"],
             r["runners"]["ours"][p].get("pct_gemm_peak_cpu_time", float("nan")))
            for r in ones if r["workload"] == "long16k" for p in PHASES
            if r["runners"].get("ours", {}).get(p)]
    out[">= 60% of the GEMM peak on long16k, 1 thread (wall clock; CPU time)"] = _target(
        long, lambda v: v[2] >= 60)
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------

def parse_config(text: str):
    """`Hq/Hk/D`, e.g. `8/2/64`."""
    try:
        hq, hk, d = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Hq/Hk/D such as 8/2/64, got {text!r}") \
            from None
    if min(hq, hk, d) < 1 or hq % hk:
        raise argparse.ArgumentTypeError(f"{text!r}: need positive sizes with Hq % Hk == 0")
    return hq, hk, d


def parse_args(argv):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (about two minutes): 4096 tokens, uniform and sliding, "
                         "8/2/64, one timed run")
    ap.add_argument("--threads", type=positive_int, nargs="+", default=None,
                    help="thread counts (default: 1 2)")
    ap.add_argument("--workloads", type=name_list(WORKLOADS), default=None,
                    help=f"comma-separated workloads (default: {','.join(WORKLOADS)})")
    ap.add_argument("--runners", type=name_list(RUNNERS), default=list(RUNNERS),
                    help=f"comma-separated runners (default: {','.join(RUNNERS)})")
    ap.add_argument("--scaling-runners", type=name_list(RUNNERS), default=["ours", "sdpa-loop"],
                    help="runners timed at thread counts above one as well (default: "
                         "ours,sdpa-loop)")
    ap.add_argument("--configs", type=parse_config, nargs="+", default=None,
                    help="head configurations Hq/Hk/D (default: 8/2/64 8/8/128 for uniform "
                         "and longtail, 8/2/64 for long16k and sliding)")
    ap.add_argument("--tokens", type=positive_int, default=None,
                    help="tokens of the uniform, longtail and sliding mixes (default 16384)")
    ap.add_argument("--repeat", type=positive_int, default=None,
                    help="timed runs per figure, the best is kept (default 3)")
    ap.add_argument("--jax-memory-gib", type=float, default=6.0,
                    help="memory for the scores of one JAX sub-batch (default 6)")
    ap.add_argument("--json", default=os.path.join(ROOT, "out", "bench_cpu", "bench_cpu.json"),
                    help="JSON report, its folder created if missing (default: "
                         "out/bench_cpu/bench_cpu.json in the repository)")
    ap.add_argument("--png", default=None, help="plot (default: beside the JSON)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--features", action="store_true",
                    help="the sinks target (one thread): 16k causal forward + backward with "
                         "and without sinks; JSON beside --json (_features)")
    ap.add_argument("--mods", action="store_true",
                    help="user functions instead (one thread, about five minutes): "
                         "MaskMod(k <= q) against built-in causal on 16k tokens, chunked "
                         "causal on 32k, the plan's tile classes at 64k, MaskMod documents "
                         "against compiled flex_attention; JSON beside --json (_mods)")
    ap.add_argument("--dropout", action="store_true",
                    help="attention dropout instead (one thread, about two minutes): forward "
                         "and forward + backward at dropout_p=0.1 against no dropout on the "
                         "uniform mix (--tokens, default 16384), Hq8/Hk2 D64 causal; JSON beside "
                         "--json (_dropout)")
    ap.add_argument("--markdown", metavar="JSON", default=None,
                    help="print the per-workload Markdown tables of a saved JSON report and exit")
    args = ap.parse_args(argv)
    if args.quick:
        args.workloads = args.workloads or ["uniform", "sliding"]
        args.configs = args.configs or [(8, 2, 64)]
        args.tokens = args.tokens or 4096
        args.repeat = args.repeat or 1
    args.threads = sorted(set(args.threads or [1, min(2, len(_ALL_CPUS))]))
    if max(args.threads) > len(_ALL_CPUS):
        ap.error(f"--threads {max(args.threads)}: only {len(_ALL_CPUS)} CPUs are available")
    args.workloads = args.workloads or list(WORKLOADS)
    args.tokens = args.tokens or 16384
    args.repeat = args.repeat or 3
    args.png = args.png or os.path.splitext(args.json)[0] + ".png"
    return args


def plan_cases(args) -> list:
    """[(workload, (Hq, Hk, D))] of this run."""
    cases = []
    for w in args.workloads:
        configs = args.configs or DEFAULT_CONFIGS[w]
        cases += [(w, c) for c in configs]
    return cases


LOCAL_RUNNERS = {"ours": run_ours, "sdpa-loop": run_sdpa_loop, "sdpa-padded": run_sdpa_padded,
                 "flex": run_flex}


def check_runner(runner: str, d: Data, ref: dict):
    """`(phases, status)`: the runner's timed calls (None when it cannot run or fails parity)
    and its parity record."""
    if runner == "sdpa-padded" and len(d.lengths) == 1:
        return None, {"skipped": "one sequence: the same call as sdpa-loop"}
    try:
        phases, outputs = LOCAL_RUNNERS[runner](d)
        status = {"ok": parity(outputs, ref)}
        if outputs.get("no_backward"):
            status["no_backward"] = outputs["no_backward"]
        return phases, status
    except Exception as e:  # noqa: BLE001 - reported, and the runner gets no figure
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return None, {"error": f"{type(e).__name__}: {e}"}


def _pinned(fn, n: int):
    """`fn` run with the process pinned to `n` CPUs (what it keeps, `release`, comes along)."""
    def call():
        pin(n)
        return fn()
    call.release = getattr(fn, "release", lambda: None)
    return call


def time_runners(records: dict, prepared: dict, args, tick) -> None:
    """Figures of the runners that passed parity, at every thread count of `records`, into
    each record's `runners`: one `measure` over every (runner, phase, thread count), so the
    rounds alternate thread counts as they alternate runners."""
    calls = {}
    for n, rec in records.items():
        for runner in (r for r in runners_at(args, n) if r in prepared):
            rec["runners"][runner] = dict.fromkeys(PHASES)
            for phase, fn in prepared[runner].items():
                key = f"{rec['label']}: {runner} {phase}, {n} thread(s)"
                calls[key] = (n, runner, phase, _pinned(fn, n))
    timed = measure({k: c[3] for k, c in calls.items()}, args.repeat, tick)
    for key, (n, runner, phase, _) in calls.items():
        records[n]["runners"][runner][phase] = timed[key]


def time_jax(rec: dict, d: Data, ref: dict, n: int, cpus: list, limit_gib: float) -> None:
    """The JAX runner's parity and figures (one run after compiling) into `rec`."""
    try:
        times, outputs, parts = run_jax(d, n, cpus, 1, limit_gib)
        rec["parity"]["jax"] = {"ok": parity(outputs, ref), "sub_batches": parts}
        rec["runners"]["jax"] = {p: {"seconds": times[p], "cpu_seconds": None, "runs": 1,
                                     "peak_mem_mib": None, "cpu_per_wall": None}
                                 for p in PHASES}
    except Exception as e:  # noqa: BLE001 - reported, and the runner gets no figure
        key = "skipped" if str(e).startswith("skipped") else "error"
        rec["parity"]["jax"] = {key: f"{e}"}


def case_data(args, workload: str, config) -> tuple:
    """The tensors of one case and the fields every record of it shares."""
    Hq, Hk, D = config
    lengths = lengths_of(workload, args.tokens)
    d = Data(lengths, Hq, Hk, D, window_of(workload))
    pairs = visible_pairs(lengths, d.window)
    base = dict(workload=workload, label=f"{workload} Hq{Hq}/Hk{Hk} D{D}", Hq=Hq, Hk=Hk, D=D,
                tokens=d.T, sequences=len(lengths), max_len=max(lengths), window=d.window,
                visible_pairs_per_head=pairs, flops=flops(pairs, Hq, D))
    return d, base


def runners_at(args, n: int) -> list:
    return [r for r in args.runners if n == 1 or r in args.scaling_runners]


def run_case(args, workload, config, peaks, tick, failed) -> list:
    """Parity for every runner, then its figures at every thread count (above one, only the
    --scaling-runners): one record per thread count."""
    d, base = case_data(args, workload, config)
    label = base["label"]
    pin(max(args.threads))              # the reference's BLAS threads each get a CPU
    tick(f"{label}: float64 reference")
    ref = reference(d)
    records = {n: dict(base, threads=n, runners={}, parity={}) for n in args.threads}
    prepared = {}
    for runner in (r for r in args.runners if r != "jax"):
        tick(f"{label}: {runner} parity")
        phases, status = check_runner(runner, d, ref)
        if phases is not None:
            prepared[runner] = phases
        elif runner == "ours":
            failed.append(label)
        for n, rec in records.items():
            if runner in runners_at(args, n):
                rec["parity"][runner] = status
    for n in args.threads:
        pin(n)
        peaks[str(n)].append(gemm_peak(n))           # sampled per case: the machine may be shared
    time_runners(records, prepared, args, tick)
    for n in args.threads:
        if "jax" in runners_at(args, n):
            cpus = pin(n)
            tick(f"{label}: jax, {n} thread(s)")
            time_jax(records[n], d, ref, n, cpus, args.jax_memory_gib)
    return list(records.values())


def finish(rec, peak):
    """GFLOP/s, % of GEMM peak and ratios to the peers of one record. `peak` is the best GEMM
    figure of the run at this thread count, by wall clock and by CPU time; at one thread the
    CPU-time figures say what the core did while it ran this process."""
    for runner, phases in rec["runners"].items():
        for phase, r in phases.items():
            if r:
                r["gflops"] = rec["flops"][phase] / r["seconds"] / 1e9
                r["pct_gemm_peak"] = 100.0 * r["gflops"] / peak["wall"]
                if rec["threads"] == 1 and r.get("cpu_seconds"):
                    r["gflops_cpu_time"] = rec["flops"][phase] / r["cpu_seconds"] / 1e9
                    r["pct_gemm_peak_cpu_time"] = 100.0 * r["gflops_cpu_time"] / peak["cpu"]
    ours = rec["runners"].get("ours", {})
    rec["ratio_vs"] = {}
    rec["vs_best_peer"] = {}
    for phase in PHASES:
        if not ours.get(phase):
            continue
        best = None
        for peer in PEERS:
            r = rec["runners"].get(peer, {}).get(phase)
            if r:
                x = r["seconds"] / ours[phase]["seconds"]
                rec["ratio_vs"].setdefault(peer, {})[phase] = x
                if best is None or r["seconds"] < best[1]:
                    best = (peer, r["seconds"])
        if best:
            rec["vs_best_peer"][phase] = dict(peer=best[0],
                                              ratio=best[1] / ours[phase]["seconds"])


def best_peaks(samples: dict) -> dict:
    """Per thread count, the best wall and CPU-time GEMM figures among the samples."""
    return {n: {k: max(x[k] for x in xs) for k in ("wall", "cpu")} for n, xs in samples.items()}


def count_steps(args, cases) -> int:
    """Progress steps of the run (an upper bound where a runner turns out to have no backward
    or no figure)."""
    local = [r for r in args.runners if r != "jax"]
    per_case = 1 + len(local)
    for n in args.threads:
        here = runners_at(args, n)
        per_case += len(PHASES) * len([r for r in here if r != "jax"]) + ("jax" in here)
    return len(args.threads) + len(cases) * per_case


def markdown(report) -> str:
    """Per-workload Markdown tables of a JSON report (the tables of docs/benchmarks.md): ms,
    GFLOP/s, each peer's time over ours, % of the GEMM peak, extra peak memory and cpu/wall."""
    out = []
    labels = list(dict.fromkeys(r["label"] for r in report["results"]))
    head = ("| threads | runner | fwd ms | fwd GFLOP/s | f+b ms | f+b GFLOP/s | peer \u00f7 ours "
            "(fwd / f+b) | % GEMM peak (fwd / f+b) | extra peak MiB (fwd / f+b) | "
            "cpu/wall (f+b) |\n|" + "---|" * 10)

    def fmt(x, spec):
        return "\u2014" if x is None else format(x, spec)
    for label in labels:
        recs = [r for r in report["results"] if r["label"] == label]
        r0 = recs[0]
        out += [f"#### {label}", "",
                f"{r0['tokens']} tokens, {r0['sequences']} documents (longest {r0['max_len']})"
                + (f", window {r0['window']}" if r0.get("window") else "") + "; "
                f"{r0['visible_pairs_per_head']:,} visible pairs per head; "
                f"{r0['flops']['fwd'] / 1e9:.1f} GFLOP forward, "
                f"{r0['flops']['fwd+bwd'] / 1e9:.1f} forward + backward.", "", head]
        for rec in recs:
            ours = rec["runners"].get("ours") or {}
            for name, ph in rec["runners"].items():
                if not ph:
                    continue
                get = lambda p, k: (ph.get(p) or {}).get(k)          # noqa: E731
                ratio = "\u2014" if name == "ours" else " / ".join(
                    fmt(get(p, "seconds") / ours[p]["seconds"]
                        if get(p, "seconds") and ours.get(p) else None, ".2f") for p in PHASES)
                ms = [fmt(get(p, "seconds") and get(p, "seconds") * 1e3, ".0f") for p in PHASES]
                out.append(
                    f"| {rec['threads']} | {name} | {ms[0]} | {fmt(get('fwd', 'gflops'), '.1f')} "
                    f"| {ms[1]} | {fmt(get('fwd+bwd', 'gflops'), '.1f')} | {ratio} | "
                    + " / ".join(fmt(get(p, "pct_gemm_peak"), ".0f") for p in PHASES) + " | "
                    + " / ".join(fmt(get(p, "peak_mem_mib"), ".0f") for p in PHASES) + " | "
                    + fmt(get("fwd+bwd", "cpu_per_wall"), ".2f") + " |")
        out.append("")
    return "\n".join(out)



# ---------------------------------------------------------------------------------------------
# --mods: user functions (MaskMod) against the built-in masks and flex_attention
# ---------------------------------------------------------------------------------------------

MODS_CHUNK = 1024


def _causal(b, q_idx, k_idx):
    return k_idx <= q_idx


def _chunked(b, q_idx, k_idx):
    return (k_idx <= q_idx) & (q_idx // MODS_CHUNK == k_idx // MODS_CHUNK)


def _ours_with(d: Data, mask, cu=None, **extra):
    """`varlen` on `d` (backend="cpu", the plan built once) with `mask` (the workload's, a
    MaskMod, ...) and cu_seqlens `cu` (default the workload's; the same packed rows), and the
    keywords `extra` (sinks=, dropout_p= and seed=) on both calls."""
    import varlen
    from varlen.backends import get
    from varlen.backends.cpu_backend import release_workspace
    cu = d.cu if cu is None else cu
    bm, bn = get("cpu").default_blocks("float32", d.D)
    plan = varlen.plan(cu, cu, mask=mask, block_m=bm, block_n=bn)
    kw = dict(mask=mask, plan=plan, backend="cpu", **extra)

    def fwd():
        return varlen.attention_forward(d.q, d.k, d.v, cu, cu, **kw)

    def fwd_bwd():
        out, lse = fwd()
        return out, varlen.attention_backward(d.dout, d.q, d.k, d.v, out, lse, cu, cu, **kw)
    fwd.release = fwd_bwd.release = release_workspace
    out, grads = fwd_bwd()
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}, {"out": out, "grads": [np.asarray(g, np.float64)
                                                                     for g in grads]}


def _same(outputs: dict, ref: dict, label: str) -> dict:
    """`parity` of two runs (the second the checked built-in path); raises naming `label`."""
    try:
        return parity(outputs, {k: (np.asarray(v, np.float64) if k == "out" else v)
                                for k, v in ref.items()})
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


def _write(args, suffix: str, report: dict) -> str:
    """`report` as JSON beside `--json` (`<name>_<suffix>.json`); returns the path."""
    path = os.path.splitext(args.json)[0] + f"_{suffix}.json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=float)
    return path


def _print_rows(rows) -> None:
    print("| case | phase | ms (1 thread) |\n| --- | --- | --- |")
    for name, ph, v in rows:
        print(f"| {name} | {ph} | {v:.0f} |")


def mods_bench(args) -> int:
    """The issue's targets for user functions, one thread, side by side in one run."""
    from varlen import MaskMod
    tick = Progress(14, not args.no_progress)
    pin(1)
    rep = args.repeat
    Hq, Hk, D = 8, 2, 64
    report = dict(command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                  machine=machine(), threads=1, repeat=rep, parity_tolerance=PARITY_TOL)
    causal = MaskMod(_causal)
    # (1) one causal document of 16384 tokens: built-in causal vs MaskMod(k <= q)
    tick("16k causal: built-in and MaskMod")
    d16 = Data([16384], Hq, Hk, D, None)
    b_calls, b_out = _ours_with(d16, "causal")
    m_calls, m_out = _ours_with(d16, causal)
    parities = {"maskmod-causal": _same(m_out, b_out, "MaskMod causal vs built-in causal")}
    t16 = measure({("built-in", ph): b_calls[ph] for ph in PHASES} |
                  {("maskmod", ph): m_calls[ph] for ph in PHASES}, rep, tick)
    pairs16 = visible_pairs([16384], None)
    # (2) chunked causal, chunks of 1024 over one 32k document (against documents of 1024)
    tick("32k chunked causal")
    d32 = Data([32768], Hq, Hk, D, None)
    c_calls, c_out = _ours_with(d32, MaskMod(_chunked))
    docs = np.arange(0, 32768 + 1, MODS_CHUNK, dtype=np.int32)
    _, doc_out = _ours_with(d32, "causal", cu=docs)
    parities["chunked"] = _same(c_out, doc_out, "chunked MaskMod vs documents of 1024")
    t32 = measure({("chunked", ph): c_calls[ph] for ph in PHASES}, rep, tick)
    pairs32 = visible_pairs([MODS_CHUNK] * 32, None)
    # (3) plan build with tile classes at 64k tokens
    tick("64k plan with a MaskMod")
    import varlen
    cu64 = np.array([0, 65536], np.int32)

    def build():
        p = varlen.plan(cu64, cu64, mask=causal, block_m=64, block_n=128)
        p.tile_classes("q")
        p.tile_classes("k")
    plan_s = measure({"plan": build}, max(rep, 3), tick)["plan"]["seconds"]
    per_pair = t16[("maskmod", "fwd")]["seconds"] / pairs16
    fwd64 = per_pair * visible_pairs([65536], None)
    # (4) documents (the uniform mix of 16384 tokens): MaskMod(k <= q) vs compiled flex
    tick("documents: MaskMod and flex_attention")
    dd = Data(lengths_of("uniform", 16384), Hq, Hk, D, None)
    o_calls, o_out = _ours_with(dd, causal)
    _, ob_out = _ours_with(dd, "causal")
    parities["documents"] = _same(o_out, ob_out, "MaskMod documents vs built-in causal")
    flex = {}
    try:
        f_phases, f_out = run_flex(dd)
        parities["flex"] = _same({"out": f_out["out"]}, {"out": o_out["out"]},
                                 "flex vs ours")
        flex = measure({"flex": f_phases["fwd"]}, rep, tick)["flex"]
    except Exception as e:  # noqa: BLE001 - reported, not timed
        report["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    tdoc = measure({"maskmod": o_calls["fwd"]}, rep, tick)["maskmod"]
    ms = lambda r: 1e3 * r["seconds"]                             # noqa: E731
    rows = [
        ("16k causal, built-in", "fwd", ms(t16[("built-in", "fwd")])),
        ("16k causal, built-in", "fwd+bwd", ms(t16[("built-in", "fwd+bwd")])),
        ("16k causal, MaskMod(k <= q)", "fwd", ms(t16[("maskmod", "fwd")])),
        ("16k causal, MaskMod(k <= q)", "fwd+bwd", ms(t16[("maskmod", "fwd+bwd")])),
        ("32k chunked causal (1024), MaskMod", "fwd", ms(t32[("chunked", "fwd")])),
        ("32k chunked causal (1024), MaskMod", "fwd+bwd", ms(t32[("chunked", "fwd+bwd")])),
        ("64k plan + tile_classes(q, k), MaskMod", "plan", 1e3 * plan_s),
        (f"documents {len(dd.lengths)} x ~{dd.T // len(dd.lengths)}, MaskMod(k <= q)", "fwd",
         ms(tdoc)),
    ]
    if flex:
        rows.append(("documents, compiled flex_attention", "fwd", ms(flex)))
    ratio = lambda a, b: a / b                                    # noqa: E731
    per = {ph: ratio(t32[("chunked", ph)]["seconds"] / pairs32,
                     t16[("maskmod", ph)]["seconds"] / pairs16) for ph in PHASES}
    targets_ = {
        "MaskMod(k <= q) within 1.15x of built-in causal, fwd":
            ratio(t16[("maskmod", "fwd")]["seconds"], t16[("built-in", "fwd")]["seconds"]),
        "MaskMod(k <= q) within 1.15x of built-in causal, fwd+bwd":
            ratio(t16[("maskmod", "fwd+bwd")]["seconds"],
                  t16[("built-in", "fwd+bwd")]["seconds"]),
        "chunked: time per visible pair within 1.3x of causal's, fwd": per["fwd"],
        "chunked: time per visible pair within 1.3x of causal's, fwd+bwd": per["fwd+bwd"],
        "plan with tile classes <= 5% of the forward at 64k (forward estimated)":
            plan_s / fwd64,
    }
    limits = [1.15, 1.15, 1.3, 1.3, 0.05]
    met = {k: v <= lim for (k, v), lim in zip(targets_.items(), limits)}
    if flex:
        targets_["forward >= 1.5x compiled flex_attention (flex / ours)"] = ratio(
            flex["seconds"], tdoc["seconds"])
        met["forward >= 1.5x compiled flex_attention (flex / ours)"] = targets_[
            "forward >= 1.5x compiled flex_attention (flex / ours)"] >= 1.5
    report.update(rows=rows, targets={k: {"value": v, "met": met[k]} for k, v in
                                      targets_.items()}, parity=parities,
                  visible_pairs_per_head={"16k causal": pairs16, "32k chunked": pairs32,
                                          "documents": visible_pairs(dd.lengths, None)},
                  forward_64k_estimate_s=fwd64)
    path = _write(args, "mods", report)
    _print_rows(rows)
    if "flex_error" in report:
        print(f"flex_attention did not run: {report['flex_error']}")
    print("\ntargets:")
    for k, v in targets_.items():
        print(f"  {'MET' if met[k] else 'NOT MET'}: {k}: {v:.3f}")
    print(f"\nJSON: {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# --features: what today's models train with (attention sinks) against the plain call
# ---------------------------------------------------------------------------------------------

def features_bench(args) -> int:
    """The sinks target, one thread: one causal document of 16384 tokens, Hq8/Hk2 D64,
    forward + backward with and without sinks, side by side (checked first on 2048 tokens
    against the float64 reference)."""
    from varlen import reference as ref
    tick = Progress(5, not args.no_progress)
    pin(1)
    rep = args.repeat
    Hq, Hk, D = 8, 2, 64
    report = dict(command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                  machine=machine(), threads=1, repeat=rep, parity_tolerance=PARITY_TOL)
    sinks = np.random.default_rng(0).standard_normal(Hq).astype(np.float32)
    tick("sinks: parity on 2048 tokens")
    small = Data([2048], Hq, Hk, D, None)
    _, s_out = _ours_with(small, "causal", sinks=sinks)
    want, _ = ref.attention_dense(small.q, small.k, small.v, small.cu, small.cu, mask="causal",
                                  sinks=sinks)
    grads = ref.attention_dense_backward(small.dout, small.q, small.k, small.v, small.cu,
                                         small.cu, mask="causal", sinks=sinks)
    parities = {"sinks": parity(s_out, {"out": want, "grads": list(grads)})}
    tick("16k causal: plain and with sinks")
    d16 = Data([16384], Hq, Hk, D, None)
    p_calls, _ = _ours_with(d16, "causal")
    s_calls, _ = _ours_with(d16, "causal", sinks=sinks)
    t = measure({("plain", ph): p_calls[ph] for ph in PHASES} |
                {("sinks", ph): s_calls[ph] for ph in PHASES}, rep, tick)
    ms = lambda r: 1e3 * r["seconds"]                             # noqa: E731
    rows = [(f"16k causal, {name}", ph, ms(t[(key, ph)]))
            for key, name in (("plain", "no sinks"), ("sinks", "sinks=")) for ph in PHASES]
    over = t[("sinks", "fwd+bwd")]["seconds"] / t[("plain", "fwd+bwd")]["seconds"] - 1
    over_cpu = t[("sinks", "fwd+bwd")]["cpu_seconds"] / t[("plain", "fwd+bwd")][
        "cpu_seconds"] - 1
    targets_ = {"sinks cost at most 3% of forward + backward": over}
    met = {k: v <= 0.03 for k, v in targets_.items()}
    report["overhead_cpu_time"] = over_cpu
    report["machine"]["load_average_end"] = list(os.getloadavg())
    report.update(rows=rows, parity=parities,
                  targets={k: {"value": v, "met": met[k]} for k, v in targets_.items()})
    path = _write(args, "features", report)
    _print_rows(rows)
    print("\ntargets:")
    for k, v in targets_.items():
        print(f"  {'MET' if met[k] else 'NOT MET'}: {k}: {100 * v:+.1f} % "
              f"(by CPU time {100 * over_cpu:+.1f} %)")
    print(f"\nJSON: {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# --dropout: attention dropout (Philox keep bits inside the kernels) against no dropout
# ---------------------------------------------------------------------------------------------

DROPOUT_P = 0.1
DROPOUT_SEED = 0x5EED_0F_D20F


def dropout_bench(args) -> int:
    """The dropout target: forward + backward at p = 0.1 within 1.3x of no dropout,
    one thread, side by side in one run. Parity first: ours with dropout against the numpy
    backend (float64 inside) with the same seed, which draws the same pairs."""
    import varlen
    tick = Progress(7, not args.no_progress)
    pin(1)
    rep = args.repeat
    d = Data(lengths_of("uniform", args.tokens), 8, 2, 64, None)
    report = dict(command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                  machine=machine(), threads=1, repeat=rep, parity_tolerance=PARITY_TOL,
                  dropout_p=DROPOUT_P, documents=len(d.lengths), tokens=d.T)
    tick("no dropout")
    plain, _ = _ours_with(d, "causal")
    tick("dropout")
    drop, out = _ours_with(d, "causal", dropout_p=DROPOUT_P, seed=DROPOUT_SEED)
    tick("parity: the numpy backend with the same seed")
    x = [a.astype(np.float64) for a in (d.q, d.k, d.v, d.dout)]
    kw = dict(mask="causal", backend="numpy", dropout_p=DROPOUT_P, seed=DROPOUT_SEED)
    ref_out, ref_lse = varlen.attention_forward(*x[:3], d.cu, d.cu, **kw)
    ref_grads = varlen.attention_backward(x[3], *x[:3], ref_out, ref_lse, d.cu, d.cu, **kw)
    report["parity"] = _same(out, {"out": ref_out, "grads": list(ref_grads)},
                             "cpu dropout vs numpy dropout")
    times = measure({("no dropout", ph): plain[ph] for ph in PHASES} |
                    {(f"dropout {DROPOUT_P}", ph): drop[ph] for ph in PHASES}, rep, tick)
    rows = [(name, ph, 1e3 * t["seconds"], 1e3 * t["cpu_seconds"])
            for (name, ph), t in times.items()]
    ratio = {ph: times[(f"dropout {DROPOUT_P}", ph)]["seconds"] /
             times[("no dropout", ph)]["seconds"] for ph in PHASES}
    ratio_cpu = {ph: times[(f"dropout {DROPOUT_P}", ph)]["cpu_seconds"] /
                 times[("no dropout", ph)]["cpu_seconds"] for ph in PHASES}
    target = f"dropout_p={DROPOUT_P} forward + backward within 1.3x of no dropout"
    report.update(rows=rows, ratio=ratio, ratio_cpu_time=ratio_cpu,
                  targets={target: {"value": ratio["fwd+bwd"],
                                    "met": ratio["fwd+bwd"] <= 1.3}})
    report["machine"]["load_average_end"] = list(os.getloadavg())
    path = _write(args, "dropout", report)
    print(f"{len(d.lengths)} documents, {d.T} tokens, Hq8/Hk2 D64 causal, float32, 1 thread")
    print("| case | phase | ms (wall) | ms (CPU time) |\n| --- | --- | --- | --- |")
    for name, ph, w, c in rows:
        print(f"| {name} | {ph} | {w:.0f} | {c:.0f} |")
    print("\nratios (dropout / none): " + ", ".join(
        f"{ph} {ratio[ph]:.3f} (CPU time {ratio_cpu[ph]:.3f})" for ph in PHASES))
    print(f"\ntargets:\n  {'MET' if ratio['fwd+bwd'] <= 1.3 else 'NOT MET'}: {target}: "
          f"{ratio['fwd+bwd']:.3f}")
    print(f"\nJSON: {path}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.features:
        _malloc_mode(False)
        return features_bench(args)
    if args.mods:
        _malloc_mode(False)
        return mods_bench(args)
    if args.dropout:
        _malloc_mode(False)
        return dropout_bench(args)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    _malloc_mode(False)
    import varlen  # noqa: F401 - fail early when the package does not import
    cases = plan_cases(args)
    tick = Progress(count_steps(args, cases), not args.no_progress)
    from varlen.backends import _cpu_kernels  # noqa: F401 - loads the kernels' BLAS for machine()
    report = dict(command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                  machine=machine(), method=__doc__.split("Method: ")[1].split("\n\n")[0],
                  threads=args.threads, parity_tolerance=PARITY_TOL, results=[])
    samples = {str(n): [] for n in args.threads}
    for n in args.threads:
        tick(f"float32 GEMM peak, {n} thread(s)")
        pin(n)
        samples[str(n)].append(gemm_peak(n))
    failed = []
    for workload, config in cases:
        report["results"] += run_case(args, workload, config, samples, tick, failed)
    report["gemm_peak_gflops"] = best_peaks(samples)
    report["gemm_peak_samples"] = samples
    for rec in report["results"]:
        finish(rec, report["gemm_peak_gflops"][str(rec["threads"])])
    report["machine"]["load_average_end"] = list(os.getloadavg())
    report["targets"] = targets(report["results"], args.threads)
    report["failed_parity"] = failed
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=float)
    report["png"] = plot(report["results"], report["gemm_peak_gflops"], args.threads, args.png)
    print("float32 GEMM peak, best of the run (GFLOP/s): " + ", ".join(
        f"{n} thread(s) {v['wall']:.1f} (CPU time: {v['cpu']:.1f})"
        for n, v in report["gemm_peak_gflops"].items()))
    print("\n".join(summary(report["results"], args.threads)))
    print("\ntargets:")
    for name, t in report["targets"].items():
        state = {True: "MET", False: "NOT MET", None: "n/a (not measured)"}[t["met"]]
        print(f"  {state}: {name}: " + "; ".join(
            " ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in v)
            for v in t["values"]))
    print(f"\nJSON: {args.json}" + (f"\nPNG: {args.png}" if report["png"] else ""))
    if failed:
        print(f"parity FAILED for ours: {'; '.join(failed)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
