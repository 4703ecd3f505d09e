#!/usr/bin/env python
"""Benchmark of the CuPy tensor-core backend against its peers, on one GPU, in one run.

    python scripts/bench.py [--quick] [--json bench.json] [--png bench.png]

Workloads (packed THD batches, bf16, D=128 by default, a fixed token budget per batch):
uniform lengths 512 .. 16k (causal and full), a long-tail document mix (causal) and a mixed
causal/bidirectional batch (one mask policy per sequence).

Runners, all timed on the same tensors:
  cupy        this backend (plan built once and reused, as a model reuses it per layer)
  numba       the Numba backend, same API
  sdpa-flash  torch scaled_dot_product_attention, FlashAttention backend, on the padded batch
  sdpa-cudnn  the same with the cuDNN backend
  varlen      torch.nn.attention.varlen.varlen_attn on the packed batch, where present
  flex        torch flex_attention (torch.compile'd) with a document mask on the packed batch
Peers that take one mask per call (sdpa, varlen) get one call per policy group on the mixed
batch; their times are summed.

Method: 3 warm-up runs, then the median of N timed runs with CUDA events, the L2 cache
flushed (a 256 MiB write) before each. TFLOP/s counts only visible query-key pairs (masked or
padded work is not credited): forward 4 * pairs * D per head, backward 2.5x that (five
matmuls instead of two), forward+backward 3.5x. The GPU's bf16 matmul peak is measured in the
same run (torch.matmul, 8192^3) and each figure is also given as % of it.

Correctness first: before timing a workload, the cupy backend's forward and backward on a
cut-down copy of it (first sequences, at most 512 tokens each) are compared with the float64
reference (STYLE.md ratio tolerances), and its full-size output with flex_attention's. A
workload that fails reports no cupy figure, and the script exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402

from varlen._cli import ArgumentParser, name_list, positive_int  # noqa: E402

L2_FLUSH_BYTES = 256 << 20
WARMUP = 3
RUNNERS = ("cupy", "numba", "sdpa-flash", "sdpa-cudnn", "varlen", "flex")
# Every runner must be within this of flex/SDPA (bf16 vs bf16, relative to max |out|).
FULL_SIZE_TOL = 2e-2


# ---------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------

def workloads(quick: bool, tokens: int):
    """[(label, lengths, causal flags per sequence)]."""
    rng = np.random.default_rng(0)
    out = []
    sizes = (1024, 4096) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    for L in sizes:
        B = max(1, tokens // L)
        for causal in ((True,) if quick else (True, False)):
            out.append((f"uniform-L{L}-{'causal' if causal else 'full'}", [L] * B,
                        [causal] * B))
    # long tail: many short documents, a few long ones (log-normal, capped at 16k)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(16384, max(16, rng.lognormal(6.0, 1.3)))))
    lengths[-1] -= sum(lengths) - tokens
    lengths = [n for n in lengths if n > 0]
    out.append(("doc-mix-causal", lengths, [True] * len(lengths)))
    L = 2048
    B = max(2, tokens // L)
    out.append(("mixed-causal-bidirectional-L2048", [L] * B, [b % 2 == 0 for b in range(B)]))
    return out


def visible_pairs(lengths, causal):
    return int(sum(L * (L + 1) // 2 if c else L * L for L, c in zip(lengths, causal)))


def flops(lengths, causal, H, D):
    fwd = 4.0 * visible_pairs(lengths, causal) * D * H
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------

class Timer:
    def __init__(self, torch, iters):
        self.torch = torch
        self.iters = iters
        self.flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def __call__(self, fn):
        torch = self.torch
        for _ in range(WARMUP):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.iters):
            self.flush_buf.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(times)


def matmul_peak(torch, timer):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    t = timer(lambda: torch.matmul(a, b, out=c))
    return 2.0 * n ** 3 / t / 1e12


# ---------------------------------------------------------------------------------------
# runners: each returns (fwd(), bwd()) callables or raises with the reason it cannot run
# ---------------------------------------------------------------------------------------

class Data:
    """One workload's tensors, packed [T, H, D] plus what the peers need."""

    def __init__(self, torch, lengths, causal, H, D, dtype):
        self.torch = torch
        self.lengths, self.causal = list(lengths), list(causal)
        self.T, self.H, self.D = sum(lengths), H, D
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda: torch.randn(self.T, H, D, device="cuda", dtype=dtype, generator=g)  # noqa
        self.q, self.k, self.v, self.dout = mk(), mk(), mk(), mk()
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        self.cu_np = cu
        self.cu = torch.from_numpy(cu).cuda()
        self.causal_t = torch.tensor(causal, device="cuda")

    def groups(self):
        """Sequence indices per mask policy (causal, bidirectional)."""
        return [(c, [i for i, x in enumerate(self.causal) if x == c])
                for c in (True, False) if c in self.causal]

    def rows(self, idx):
        return self.torch.cat([self.torch.arange(int(self.cu_np[i]), int(self.cu_np[i + 1]),
                                                 device="cuda") for i in idx])


def _autograd_pair(torch, forward, inputs, dout):
    def fwd():
        with torch.no_grad():
            forward(*inputs)

    state = {}

    def prep():
        xs = [x.detach().requires_grad_(True) for x in inputs]
        state["xs"], state["out"] = xs, forward(*xs)

    prep()

    def bwd():
        torch.autograd.grad(state["out"], state["xs"], dout(state["out"]), retain_graph=True)
    return fwd, bwd


def run_cupy(torch, d, backend="cupy"):
    import cupy as cp
    import varlen
    from varlen import Mask
    from varlen import backends
    q, k, v, dout = (cp.from_dlpack(x) for x in (d.q, d.k, d.v, d.dout))
    cu = cp.asarray(d.cu_np)
    flags = cp.asarray(np.asarray(d.causal, bool))
    mask = Mask.causal_where(flags)
    mod = backends.get(backend)
    if mod is None:
        raise RuntimeError(f"backend {backend!r} is not built in this installation")
    bm, bn = mod.default_blocks("bfloat16", d.D)
    plan = varlen.plan(cu, cu, mask=mask, num_rows_q=d.T, num_rows_k=d.T,
                       max_seqlen_q=max(d.lengths), max_seqlen_k=max(d.lengths),
                       block_m=bm, block_n=bn)
    if mod.check_plan(plan):
        plan = None             # this backend builds its own plan inside each call
    kw = dict(mask=mask, plan=plan, backend=backend, max_seqlen_q=max(d.lengths),
              max_seqlen_k=max(d.lengths))
    out, lse = varlen.attention_forward(q, k, v, cu, cu, **kw)

    def fwd():
        varlen.attention_forward(q, k, v, cu, cu, **kw)

    def bwd():
        varlen.attention_backward(dout, q, k, v, out, lse, cu, cu, **kw)
    return fwd, bwd, torch.from_dlpack(out)


def run_sdpa(torch, d, backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[
        backend_name]
    calls = []
    for causal, idx in d.groups():
        Lmax = max(d.lengths[i] for i in idx)
        pad = lambda x: torch.stack([torch.nn.functional.pad(  # noqa: E731
            x[int(d.cu_np[i]):int(d.cu_np[i + 1])], (0, 0, 0, 0, 0, Lmax - d.lengths[i]))
            for i in idx]).transpose(1, 2).contiguous()       # [B, H, Lmax, D]
        qp, kp, vp, dp = pad(d.q), pad(d.k), pad(d.v), pad(d.dout)

        def forward(q, k, v, causal=causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        calls.append(_autograd_pair(torch, forward, (qp, kp, vp), lambda o, dp=dp: dp))
    return (lambda: [f() for f, _ in calls]), (lambda: [b() for _, b in calls]), None


def run_varlen(torch, d):
    import inspect
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    calls = []
    for causal, idx in d.groups():
        rows = d.rows(idx)
        lengths = [d.lengths[i] for i in idx]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                          device="cuda")
        L = max(lengths)
        if "window_size" in params:
            kw = {"window_size": (-1, 0) if causal else (-1, -1)}
        elif "is_causal" in params:
            kw = {"is_causal": causal}
        elif causal:
            raise RuntimeError("this torch's varlen_attn takes no causal mask")
        else:
            kw = {}

        def forward(q, k, v, cu=cu, L=L, kw=kw):
            return varlen_attn(q, k, v, cu, cu, L, L, **kw)
        dp = d.dout[rows]
        calls.append(_autograd_pair(torch, forward, (d.q[rows], d.k[rows], d.v[rows]),
                                    lambda o, dp=dp: dp))
    return (lambda: [f() for f, _ in calls]), (lambda: [b() for _, b in calls]), None


_FLEX = {}


def run_flex(torch, d):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    doc = torch.repeat_interleave(torch.arange(len(d.lengths), device="cuda"),
                                  torch.tensor(d.lengths, device="cuda"))
    start = d.cu[:-1].long()[doc]
    causal = d.causal_t

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        ok = torch.logical_or(~causal[doc[q_idx]], (q_idx - start[q_idx]) >= (kv_idx - start[kv_idx]))
        return same & ok
    block_mask = create_block_mask(mask_mod, 1, None, d.T, d.T, device="cuda")
    t = lambda x: x.transpose(0, 1).unsqueeze(0).contiguous()     # noqa: E731  [1, H, T, D]
    qf, kf, vf, df = t(d.q), t(d.k), t(d.v), t(d.dout)

    def forward(q, k, v):
        return _FLEX["fn"](q, k, v, block_mask=block_mask)
    fwd, bwd = _autograd_pair(torch, forward, (qf, kf, vf), lambda o: df)
    with torch.no_grad():
        ref = forward(qf, kf, vf)[0].transpose(0, 1)                  # [T, H, D]
    return fwd, bwd, ref


# ---------------------------------------------------------------------------------------
# parity gate
# ---------------------------------------------------------------------------------------

def parity_small(lengths, causal, H, D, backend="cupy"):
    """cupy forward + backward on a cut-down copy against the float64 reference."""
    import cupy as cp
    import varlen
    from varlen import Mask
    from helpers import check_against_reference, make_batch
    keep = min(len(lengths), 3)
    lq = [min(n, 512) for n in lengths[:keep]]
    flags = np.asarray(causal[:keep], bool)
    rng = np.random.default_rng(1)
    b = make_batch(rng, lq, None, Hq=min(H, 4), Hk=min(H, 4), D=D, dtype="bfloat16",
                   mask=Mask.causal_where(flags))
    dev = lambda a: cp.asarray(a.view(np.uint16)).view(a.dtype)   # noqa: E731
    mask = Mask.causal_where(cp.asarray(flags))
    q, k, v, dout = (dev(x) for x in (b.q, b.k, b.v, b.dout))
    cu = cp.asarray(b.cu_q)
    out, lse = varlen.attention_forward(q, k, v, cu, cu, mask=mask, backend=backend)
    grads = varlen.attention_backward(dout, q, k, v, out, lse, cu, cu, mask=mask,
                                      backend=backend)

    def host(a):
        return cp.asnumpy(a.view(cp.uint16)).view(a.dtype) if a.dtype == b.q.dtype \
            else cp.asnumpy(a)
    check_against_reference(b, host(out), cp.asnumpy(lse), [host(g) for g in grads],
                            label="bench parity")


def parity_full(torch, ours, ref):
    if ref is None or ours is None:
        return None
    diff = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    if not diff <= FULL_SIZE_TOL * max(scale, 1e-6):
        raise AssertionError(f"cupy vs flex_attention: max |diff| {diff:.3e} > "
                             f"{FULL_SIZE_TOL} x {scale:.3e}")
    return diff


# ---------------------------------------------------------------------------------------

def machine(torch):
    import cupy as cp
    props = torch.cuda.get_device_properties(0)
    info = dict(gpu=props.name, cc=f"{props.major}.{props.minor}",
                cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                driver=cp.cuda.runtime.driverGetVersion(), torch=torch.__version__,
                torch_cuda=torch.version.cuda, cupy=cp.__version__, numpy=np.__version__,
                python=platform.python_version())
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        pass
    return info


class Progress:
    """One line per step on stderr: `[i/N elapsed] workload / step`."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.time()

    def __call__(self, label: str, step: str) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total} {time.time() - self.t0:6.0f}s] {label} / {step}",
              file=sys.stderr, flush=True)


def plot(results, peak, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot", file=sys.stderr)
        return
    labels = [w["workload"] for w in results]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 1.3 * len(labels)), 9), sharex=True)
    width = 0.8 / len(RUNNERS)
    for ax, phase in zip(axes, ("fwd", "fwd+bwd")):
        for j, r in enumerate(RUNNERS):
            ys = [w["runners"].get(r, {}).get(phase, {}).get("tflops") or 0 for w in results]
            ax.bar(np.arange(len(labels)) + j * width, ys, width, label=r)
        if peak:
            ax.axhline(peak, color="k", ls="--", lw=0.8, label="bf16 matmul peak")
        ax.set_ylabel(f"{phase} TFLOP/s (visible pairs)")
        ax.legend(fontsize=7, ncol=4)
    axes[1].set_xticks(np.arange(len(labels)) + 0.4, labels, rotation=30, ha="right",
                       fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------
# the run: arguments, one workload at a time, report
# ---------------------------------------------------------------------------------------

def parse_args(argv):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few workloads (for the GPU check)")
    ap.add_argument("--json", default=os.path.join(ROOT, "out", "bench", "bench.json"),
                    help="JSON report path, its folder created if missing "
                         "(default: out/bench/bench.json in the repository)")
    ap.add_argument("--png", default=None, help="plot path (default: beside the JSON)")
    ap.add_argument("--tokens", type=positive_int, default=None,
                    help="tokens per batch (default 32768; 16384 with --quick)")
    ap.add_argument("--heads", type=positive_int, default=16, help="heads (16)")
    ap.add_argument("--head-dim", type=positive_int, default=128, help="head dim D (128)")
    ap.add_argument("--iters", type=positive_int, default=None,
                    help="timed runs per figure (default 10; 5 with --quick)")
    ap.add_argument("--runners", type=name_list(RUNNERS), default=list(RUNNERS),
                    help=f"comma-separated runners (default: {','.join(RUNNERS)})")
    ap.add_argument("--cupy-backend", default="cupy", choices=("cupy", "cupy:mma", "cupy:sm90a"),
                    help="what the cupy runner names: the backend (its default "
                         "implementation) or one implementation (default: cupy)")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (16384 if args.quick else 32768)
    args.iters = args.iters or (5 if args.quick else 10)
    args.png = args.png or os.path.splitext(args.json)[0] + ".png"
    return args


def gpu_stack():
    """(torch, None) with a CUDA device and CuPy, else (None, why not)."""
    try:
        import torch
        import cupy  # noqa: F401
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except Exception as e:  # noqa: BLE001
        return None, str(e)
    return torch, None


class Bench:
    """What every step of a run shares: the GPU stack, the timer, the measured bf16 matmul
    peak (TFLOP/s), the heads and head dim, the backend the cupy runner names (`cupy`, or one
    implementation such as `cupy:sm90a`), and whether a cupy parity check failed (exit 2)."""

    def __init__(self, torch, timer: Timer, peak: float, H: int, D: int,
                 cupy_backend: str = "cupy"):
        self.torch, self.timer, self.peak, self.H, self.D = torch, timer, peak, H, D
        self.cupy_backend = cupy_backend
        self.failed = False


def start_workload(bench, label, lengths, causal):
    """The workload's report entry and its tensors."""
    entry = dict(workload=label, sequences=len(lengths), tokens=sum(lengths),
                 max_len=max(lengths), visible_pairs=visible_pairs(lengths, causal),
                 flops=flops(lengths, causal, bench.H, bench.D), runners={})
    data = Data(bench.torch, lengths, causal, bench.H, bench.D, bench.torch.bfloat16)
    return entry, data


def check_parity(bench, entry, lengths, causal) -> None:
    try:
        parity_small(lengths, causal, bench.H, bench.D, bench.cupy_backend)
        entry["parity"] = "ok"
    except Exception as e:  # noqa: BLE001
        entry["parity"] = f"FAILED: {e}"
        bench.failed = True


def compare_with_flex(bench, entry, ref) -> None:
    """The full-size outputs kept so far against flex_attention's; a mismatch drops the figure."""
    for name, out in entry.get("_out", {}).items():
        try:
            diff = parity_full(bench.torch, out, ref)
            entry.setdefault("full_size_max_diff_vs_flex", {})[name] = diff
        except AssertionError as e:
            entry["parity"] = f"FAILED: {name}: {e}"
            entry["runners"].pop(name, None)
            bench.failed = bench.failed or name == "cupy"


def prepare(bench, entry, data, runner):
    """(fwd, bwd) callables of one runner on one workload, behind its parity gate."""
    torch = bench.torch
    if runner == "cupy" and entry.get("parity") != "ok":
        raise RuntimeError("parity check failed: no figure reported")
    if runner in ("cupy", "numba"):
        backend = bench.cupy_backend if runner == "cupy" else runner
        fwd, bwd, out = run_cupy(torch, data, backend=backend)
        entry.setdefault("_out", {})[runner] = out
    elif runner.startswith("sdpa-"):
        fwd, bwd, _ = run_sdpa(torch, data, runner.split("-")[1])
    elif runner == "varlen":
        fwd, bwd, _ = run_varlen(torch, data)
    else:
        fwd, bwd, ref = run_flex(torch, data)
        compare_with_flex(bench, entry, ref)
    return fwd, bwd


def measure(bench, entry, runner, data) -> dict:
    """Seconds, TFLOP/s and % of peak per phase, or {"error": why} when the runner fails."""
    try:
        fwd, bwd = prepare(bench, entry, data, runner)
        t_f, t_b = bench.timer(fwd), bench.timer(bwd)
    except Exception as e:  # noqa: BLE001
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    rec = {}
    for phase, t in (("fwd", t_f), ("bwd", t_b), ("fwd+bwd", t_f + t_b)):
        tf = entry["flops"][phase] / t / 1e12
        rec[phase] = dict(seconds=t, tflops=tf, pct_of_peak=100.0 * tf / bench.peak)
    return rec


def run_workload(bench, workload, runners, tick) -> dict:
    """Parity first, then every runner in order; the workload's report entry."""
    label, lengths, causal = workload
    entry, data = start_workload(bench, label, lengths, causal)
    tick(label, "parity")
    check_parity(bench, entry, lengths, causal)
    for runner in runners:
        tick(label, runner)
        entry["runners"][runner] = measure(bench, entry, runner, data)
    entry.pop("_out", None)
    del data
    bench.torch.cuda.empty_cache()
    return entry


def summary_lines(results, runners) -> list:
    """The fwd+bwd TFLOP/s table, a row per workload ("-" where a runner gave no figure)."""
    lines = [f"{'workload':40} " + " ".join(f"{r:>11}" for r in runners)]
    for e in results:
        cells = []
        for r in runners:
            v = e["runners"].get(r, {}).get("fwd+bwd", {}).get("tflops")
            cells.append(f"{v:11.1f}" if v else f"{'-':>11}")
        lines.append(f"{e['workload']:40} " + " ".join(cells) + "   (fwd+bwd TFLOP/s)")
    return lines


def write_report(bench, results, args) -> None:
    method = __doc__.split("Method:")[1].split("\n\n")[0].strip()
    report = dict(machine=machine(bench.torch), method=method,
                  bf16_matmul_peak_tflops=bench.peak, heads=bench.H, head_dim=bench.D,
                  dtype="bfloat16", tokens_per_batch=args.tokens, parity_failed=bench.failed,
                  cupy_backend=bench.cupy_backend,
                  results=results)
    for path in (args.json, args.png):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    plot(results, bench.peak, args.png)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch, why = gpu_stack()
    if torch is None:
        print(f"bench: no usable GPU stack ({why}); nothing measured", file=sys.stderr)
        return 0
    timer = Timer(torch, args.iters)
    bench = Bench(torch, timer, matmul_peak(torch, timer), args.heads, args.head_dim,
                  args.cupy_backend)
    print(f"bf16 matmul peak: {bench.peak:.0f} TFLOP/s", file=sys.stderr)
    work = workloads(args.quick, args.tokens)
    tick = Progress(len(work) * (1 + len(args.runners)))
    results = [run_workload(bench, w, args.runners, tick) for w in work]
    write_report(bench, results, args)
    print("\n".join(summary_lines(results, args.runners)), file=sys.stderr)
    print(f"wrote {args.json} and {args.png}", file=sys.stderr)
    if bench.failed:
        print("bench: a parity check FAILED; the affected figures are not reported",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
