"""`python -m varlen.comm demo`: seeds/000's case under context parallelism.

One sequence of length 7 (q = k = v = 1 for positions 0-3 and 2 for 4-6, head dim 8) on
cp = 2, given as Transformer Engine expects it: padded to 8 rows with the pad row holding 100,
`cu_seqlens = [0, 7]`, `seq_offsets = [0, 8]`. Full attention gives 1.9269 (x4) and 1.9954 (x3);
every rank prints the tokens it holds, what happened to its pad row, and its error.

    mpiexec -n 2 python -m varlen.comm demo                      # MPI ranks on the CPU
    mpiexec -n 2 python -m varlen.comm demo --comm nccl          # one GPU per rank
    python -m varlen.comm demo --ranks 3 --method allgather      # in-process ranks
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

import numpy as np

from varlen._cli import ArgumentParser, positive_int


def _world_size() -> int:
    try:
        from mpi4py import MPI
    except ImportError:
        return 1
    return MPI.COMM_WORLD.Get_size()


def _inputs(heads: int):
    x = np.concatenate([np.full(4, 1.0), np.full(3, 2.0), [100.0]])
    x = np.ascontiguousarray(np.broadcast_to(x[:, None, None], (8, heads, 8)))
    return x, np.array([0, 7], np.int32), np.array([0, 8], np.int32)


def _rank_report(group, args) -> list:
    import varlen.comm as vc
    from varlen import reference

    heads = group.size if args.method == "ulysses" else 1
    x, cu, off = _inputs(heads)
    part = vc.partition(cu, group.size, seq_offsets=off)
    r = group.rank
    xr = part.shard(x, r)
    qkv = (xr, xr, xr)
    if args.comm == "nccl":
        import cupy
        qkv = tuple(cupy.asarray(a) for a in qkv)
    out, lse = vc.attention_forward(*qkv, part, group, method=args.method, backend=args.backend)
    out, lse = (a.get() if hasattr(a, "get") else np.asarray(a) for a in (out, lse))
    ref, _ = reference.attention_dense(x, x, x, cu, cu, seq_offsets_q=off, seq_offsets_k=off)
    want = part.shard(ref, r)
    pos = part.positions(r)
    valid = part.valid(r)
    rows = [int(off[0] + p) for p in pos[valid]]
    lines = [f"rank {r}: local rows {part.local_rows}; tokens at global positions "
             f"{pos[valid].tolist()} (global rows {rows}), values "
             f"{xr[valid, 0, 0].tolist()}"]
    for i in np.flatnonzero(~valid):
        lines.append(f"rank {r}:   local row {i} is padding (position >= global length 7; "
                     f"the input's pad row held 100): in no segment, so never a key; "
                     f"output {out[i, 0, 0]:g}, lse {lse[0, i]:g}")
    err = float(np.abs(out - want).max())
    lines.append(f"rank {r}:   out[:, 0, 0] = {np.round(out[:, 0, 0], 4).tolist()}  "
                 f"full attention = {np.round(want[:, 0, 0], 4).tolist()}  "
                 f"max |error| = {err:.1e}")
    return lines, err


def _nccl_unavailable() -> str | None:
    """Why `--comm nccl` cannot run here (None: CuPy sees a GPU)."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install -e \".[cuda13]\")"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as e:  # noqa: BLE001 - no driver or no device, as CuPy reports it
        return f"CuPy cannot reach a CUDA device ({type(e).__name__}: {e})".splitlines()[0]
    return None


def _check_environment(ap, args) -> None:
    """Refuse, with one line and exit status 2, what this machine cannot run."""
    if args.comm in ("mpi", "nccl") and importlib.util.find_spec("mpi4py") is None:
        ap.error(f"--comm {args.comm} needs mpi4py (pip install -e \".[mpi]\"), which is not "
                 f"installed")
    if args.comm == "nccl":
        why = _nccl_unavailable()
        if why:
            ap.error(f"--comm nccl needs a GPU through CuPy: {why}")
    if args.backend is not None:
        from varlen import backends
        x, _, _ = _inputs(1)
        D = x.shape[2]
        try:
            backends.select(args.backend, backends.Problem(x.dtype.name, D, D,
                                                           args.comm == "nccl"))
        except ValueError as e:
            ap.error(str(e))


def _add_demo_arguments(ap: argparse.ArgumentParser) -> None:
    from varlen.backends import names
    ap.add_argument("--method", default="ring", choices=("ring", "allgather", "ulysses"),
                    help="context-parallel method (default: ring)")
    ap.add_argument("--comm", default=None, choices=("mpi", "nccl", "local"),
                    help="communicator (default: mpi under mpiexec with >1 rank, else local)")
    ap.add_argument("--ranks", type=positive_int, default=2,
                    help="in-process ranks for --comm local (default 2)")
    ap.add_argument("--backend", default=None, choices=names(),
                    help="attention backend (default: automatic)")


def demo(args) -> int:
    """Run the demo on the ranks `args` asks for; 0 when every rank matches full attention."""
    import varlen.comm as vc
    if args.comm == "local":
        reports = vc.local_group(args.ranks).run(_rank_report, args)
    else:
        from mpi4py import MPI
        group = vc.init(MPI.COMM_WORLD, backend=args.comm)
        reports = group.allgather_object(_rank_report(group, args))
        if group.rank != 0:
            return 0 if max(e for _, e in reports) < 1e-6 else 1
    cp = len(reports)
    padded = -(-7 // (2 * cp)) * 2 * cp
    print(f"seeds/000: length 7 on cp={cp} ({args.method}, {args.comm}); zigzag: the "
          f"sequence is padded to {padded} (a multiple of 2*cp), rank r holds chunks r and "
          f"{2 * cp - 1}-r; pad rows are masked out")
    for lines, _ in reports:
        print("\n".join(lines))
    worst = max(e for _, e in reports)
    ok = worst < 1e-6
    print(f"{'OK' if ok else 'FAILED'}: max error against full attention {worst:.1e}")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m varlen.comm",
                                 description="varlen.comm: context-parallel attention")
    sub = ap.add_subparsers(dest="command", required=True)
    demo_ap = sub.add_parser("demo", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter,
                             help="seeds/000's length-7 case on cp ranks, against full attention")
    _add_demo_arguments(demo_ap)
    args = ap.parse_args(argv)
    if args.comm is None:
        args.comm = "mpi" if _world_size() > 1 else "local"
    _check_environment(demo_ap, args)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
