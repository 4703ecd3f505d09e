#!/usr/bin/env python
"""Short benchmark of the Numba backend (forward and backward) on a GPU.

    python scripts/bench_numba.py [--json results.json] [--quick]

Method: CuPy arrays, every call launched on one non-default stream, 2 warm-up runs, then the
median of 5 timed runs measured with CUDA events, the L2 cache flushed (a 256 MiB memset)
before each run. FLOPs count only visible query-key pairs (masked work is not credited):
forward 2 * pairs * (D + Dv) per head, backward 2 * pairs * (3 D + 2 Dv) per head (S
recomputed, dP, dV, dK, dQ). Before timing, each configuration's parity with the float64
reference is checked on its batch; a configuration that fails reports no figure.
Without a GPU it prints why and exits 0 (so `scripts/gpu_check.sh` can degrade).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import numpy as np  # noqa: E402

from varlen._cli import ArgumentParser  # noqa: E402

# Peak non-tensor FP32 throughput (TFLOP/s), the roof of a SIMT kernel, by device name.
FP32_PEAK_TFLOPS = {"H200": 67.0, "H100": 67.0, "A100": 19.5}
L2_FLUSH_BYTES = 256 << 20
WARMUP, ITERS = 2, 5

CONFIGS = [
    # (label, lengths_q, lengths_k, Hq, Hk, D, dtype, mask)
    ("B4-L2048-Hq16-Hk4-D64-fp16-causal", [2048] * 4, None, 16, 4, 64, "float16", "causal"),
    ("B8-varlen-Hq8-Hk8-D128-bf16-full", [512, 1, 1000, 3000, 77, 1024, 0, 2047], None, 8, 8,
     128, "bfloat16", "full"),
    ("B2-L4096-Hq8-Hk1-D64-fp32-sliding256", [4096, 4095], None, 8, 1, 64, "float32",
     "sliding"),
]


def _gpu():
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        return cp
    except Exception:  # noqa: BLE001
        return None


def machine(cp):
    import numba
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    peak = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in name), None)
    try:
        import numba_cuda
        nc = numba_cuda.__version__
    except Exception:  # noqa: BLE001
        nc = None
    return dict(gpu=name, cc=f"{props['major']}.{props['minor']}",
                cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                driver=cp.cuda.runtime.driverGetVersion(), cupy=cp.__version__,
                numba=numba.__version__, numba_cuda=nc, numpy=np.__version__,
                python=platform.python_version(), fp32_peak_tflops=peak)


def visible_pairs(batch):
    from varlen import reference
    return int(sum(m.sum() for m in reference.sequence_masks(batch.cu_q, batch.cu_k, batch.mask)))


def run_config(cp, label, lq, lk, Hq, Hk, D, dtype, mask, quick):
    import varlen
    from varlen import Mask
    from varlen.backends import numba_backend
    from helpers import check_against_reference, make_batch
    if mask == "sliding":
        mask = Mask(window_left=256, window_right=0)
    if quick:
        lq = [max(1, x // 4) if x else 0 for x in lq]
    rng = np.random.default_rng(0)
    batch = make_batch(rng, lq, lk, Hq=Hq, Hk=Hk, D=D, dtype=dtype, mask=mask)
    bits = (lambda a: cp.asarray(a.view(np.uint16)).view(a.dtype)) if dtype == "bfloat16" \
        else cp.asarray
    d = {n: bits(getattr(batch, n)) for n in ("q", "k", "v", "dout")}
    cu_q, cu_k = cp.asarray(batch.cu_q), cp.asarray(batch.cu_k)
    s = cp.cuda.Stream(non_blocking=True)
    kw = dict(mask=batch.mask, backend="numba")
    with s:
        # The device plan kernels, from device cu_seqlens.
        plan = numba_backend.plan_from_cu_seqlens(
            cu_q, cu_k, num_rows_q=batch.q.shape[0], num_rows_k=batch.k.shape[0],
            mask=batch.mask, dtype=dtype, head_dim=D)
        kw["plan"] = plan

        def fwd():
            return varlen.attention_forward(d["q"], d["k"], d["v"], cu_q, cu_k, **kw)
        out, lse = fwd()

        def bwd():
            return varlen.attention_backward(d["dout"], d["q"], d["k"], d["v"], out, lse,
                                             cu_q, cu_k, **kw)
        grads = bwd()
    s.synchronize()
    host = (lambda a: a.view(cp.uint16).get().view(a.dtype)) if dtype == "bfloat16" \
        else (lambda a: a.get())
    row = dict(label=label, dtype=dtype, D=D, Hq=Hq, Hk=Hk, tokens=int(batch.q.shape[0]),
               block_m=plan.block_m, block_n=plan.block_n)
    try:
        check_against_reference(batch, host(out), lse.get(), [host(g) for g in grads],
                                label=label)
    except AssertionError as e:
        row["parity"] = f"FAILED: {e}"
        return row
    row["parity"] = "ok"
    pairs = visible_pairs(batch)
    Dv = D
    flops = {"forward": 2.0 * pairs * (D + Dv) * Hq,
             "backward": 2.0 * pairs * (3 * D + 2 * Dv) * Hq}
    flush = cp.empty(L2_FLUSH_BYTES, dtype=cp.uint8)
    for name, fn in (("forward", fwd), ("backward", bwd)):
        times = []
        with s:
            for it in range(WARMUP + ITERS):
                flush.fill(it & 0xFF)
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(s)
                fn()
                e1.record(s)
                e1.synchronize()
                if it >= WARMUP:
                    times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
        t = float(np.median(times))
        tf = flops[name] / t / 1e12
        row[name] = dict(ms=round(t * 1e3, 3), tflops=round(tf, 3))
    row["visible_pairs"] = pairs
    return row


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    ap.add_argument("--quick", action="store_true", help="quarter-length sequences")
    args = ap.parse_args(argv)
    cp = _gpu()
    if cp is None:
        print("bench_numba: no CUDA GPU available; nothing measured")
        result = {"gpu": False, "results": []}
    else:
        info = machine(cp)
        print(json.dumps(info))
        rows = []
        for cfg in CONFIGS:
            t0 = time.time()
            try:
                row = run_config(cp, *cfg, quick=args.quick)
            except Exception as e:  # noqa: BLE001
                row = dict(label=cfg[0], error=f"{type(e).__name__}: {e}")
            row["wall_s"] = round(time.time() - t0, 1)
            peak = info["fp32_peak_tflops"]
            for name in ("forward", "backward"):
                if peak and name in row:
                    row[name]["pct_fp32_peak"] = round(100 * row[name]["tflops"] / peak, 2)
            print(json.dumps(row))
            rows.append(row)
        result = {"gpu": True, "machine": info, "method": __doc__.strip().splitlines()[4:10],
                  "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    bad = [r for r in result["results"] if r.get("parity", "ok") != "ok" or "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
