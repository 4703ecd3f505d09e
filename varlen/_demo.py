"""`python -m varlen demo`: the three problems varlen exists for, on the best backend here.

Each scenario runs forward and backward on the backend `backend=None` picks on this machine
(on a CUDA GPU when CuPy sees one, else on the CPU: the `cpu` backend where it is built, else
`numpy`) and compares with the dense float64 reference; the table names the backend.
"""
from __future__ import annotations

import time

import numpy as np

import varlen
from varlen import backends, reference
from varlen._array import bfloat16_dtype


def _device_module():
    """CuPy when it sees a GPU, else None (never raises on a CPU-only machine)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # no CuPy, no driver, no device
        return None
    return None


def _rel_err(got, want):
    got = np.asarray(got, dtype=np.float64)
    scale = float(np.abs(want).max()) if want.size else 0.0
    return float(np.abs(got - want).max()) / max(scale, 1e-30) if want.size else 0.0


def _run(name, q, k, v, cu_q, cu_k, dtype, xp, **kw):
    """Forward + backward on the best backend; errors against the float64 reference."""
    rng = np.random.default_rng(1)
    dout = rng.standard_normal((q.shape[0], q.shape[1], v.shape[2]))
    cast = (lambda a: a.astype(dtype)) if xp is np else (lambda a: xp.asarray(a.astype(dtype)))
    qd, kd, vd, dod = (cast(x) for x in (q, k, v, dout))
    meta = {key: (xp.asarray(val) if isinstance(val, np.ndarray) and xp is not np else val)
            for key, val in kw.items()}
    dev_cu_q, dev_cu_k = (xp.asarray(c) if xp is not np else c for c in (cu_q, cu_k))
    mod = backends.select(None, backends.Problem(
        np.dtype(dtype).name if dtype != bfloat16_dtype() else "bfloat16", q.shape[2],
        v.shape[2], xp is not np))
    t0 = time.perf_counter()
    out, lse = varlen.attention_forward(qd, kd, vd, dev_cu_q, dev_cu_k, **meta)
    grads = varlen.attention_backward(dod, qd, kd, vd, out, lse, dev_cu_q, dev_cu_k, **meta)
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    elapsed = time.perf_counter() - t0
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    # the reference sees the same rounded inputs the backend saw
    q64, k64, v64, do64 = (np.asarray(host(x), dtype=np.float64) for x in (qd, kd, vd, dod))
    host_kw = {key: (varlen.Mask(*(host(f) if not np.isscalar(f) else f for f in val.fields()))
                     if isinstance(val, varlen.Mask) else val) for key, val in kw.items()}
    ref_out, _ = reference.attention_dense(q64, k64, v64, cu_q, cu_k, **host_kw)
    ref_grads = reference.attention_dense_backward(do64, q64, k64, v64, cu_q, cu_k, **host_kw)
    out_h = host(out)
    return dict(scenario=name, backend=mod.name, dtype=np.dtype(dtype).name,
                tokens=int(q.shape[0]), out_err=_rel_err(out_h, ref_out),
                grad_err=max(_rel_err(host(g), r) for g, r in zip(grads, ref_grads)),
                ms=elapsed * 1e3, out=np.asarray(out_h, dtype=np.float64))


def scenario_seed_000(xp):
    """seeds/000: one length-7 sequence, values 1 x4 then 2 x3, D=8, full attention."""
    x = np.concatenate([np.full((4, 1, 8), 1.0), np.full((3, 1, 8), 2.0)])
    cu = np.array([0, 7], np.int32)
    r = _run("seeds/000: L=7 (1x4, 2x3), D=8, full", x, x, x, cu, cu, np.float32, xp)
    vals = np.round(r["out"][:, 0, 0], 4)
    r["note"] = f"out[:,0] = {vals.tolist()} (expect 1.9269 x4, 1.9954 x3)"
    return r


def scenario_seed_003(xp):
    """seeds/003: `111aaa222bb3344cccc`, numbered causal, lettered bidirectional, one call."""
    lengths = [3, 3, 3, 2, 2, 2, 4]
    causal = np.array([1, 0, 1, 0, 1, 1, 0], bool)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((19, 4, 64)) for _ in range(3))
    mask = varlen.Mask.causal_where(causal)
    r = _run("seeds/003: 111aaa222bb3344cccc, mixed", q, k, v, cu, cu, _bf16(), xp, mask=mask)
    r["note"] = "numbered causal + lettered bidirectional in one call"
    return r


def scenario_packed(xp, tokens=4096):
    """A realistic packed batch: GQA 8:2, causal / full / sliding / bottom-right, with gaps."""
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < tokens - 64:
        lengths.append(int(min(rng.lognormal(5.5, 1.0), tokens - sum(lengths))))
    lengths = np.array(lengths, np.int64)
    B = len(lengths)
    gaps = rng.integers(0, 8, size=B)
    off = np.concatenate([[0], np.cumsum(lengths + gaps)]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(off[-1])
    q = rng.standard_normal((T, 8, 64))
    k = rng.standard_normal((T, 2, 64))
    v = rng.standard_normal((T, 2, 64))
    kind = rng.integers(0, 4, size=B)                 # 0 causal, 1 full, 2 sliding, 3 causal-br
    mask = varlen.Mask(window_left=np.where(kind == 2, 256, -1).astype(np.int32),
                       window_right=np.where(kind == 1, -1, 0).astype(np.int32),
                       bottom_right=(kind == 3).astype(np.int32))
    r = _run(f"packed: B={B}, T={T}, GQA 8:2, 4 policies", q, k, v, cu, cu, _bf16(), xp,
             seq_offsets_q=off, seq_offsets_k=off, mask=mask)
    r["note"] = "causal, full, sliding(256), bottom-right; padding gaps between sequences"
    return r


def _bf16():
    bf = bfloat16_dtype()
    return bf if bf is not None else np.float16


def main(argv=None) -> int:
    xp = _device_module() or np
    where = "a CUDA GPU" if xp is not np else "the CPU"
    print(f"varlen {varlen.__version__} demo on {where} (backend=None: the default backend of "
          f"each call)")
    rows = [scenario_seed_000(xp), scenario_seed_003(xp), scenario_packed(xp)]
    head = f"{'scenario':<42} {'backend':<8} {'dtype':<9} {'out err':>9} {'grad err':>9} {'ms':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['scenario']:<42} {r['backend']:<8} {r['dtype']:<9} {r['out_err']:>9.2e} "
              f"{r['grad_err']:>9.2e} {r['ms']:>9.1f}")
    print()
    for r in rows:
        print(f"* {r['scenario']}: {r['note']}")
    print("\nErrors are max |backend - float64 reference| / max |reference| over out and over"
          " dq, dk, dv;\nms is forward + backward wall time.")
    return 0
