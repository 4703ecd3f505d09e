"""Per-rank attention work and communication of a context-parallel partition, on the CPU.

For a document-length distribution and a list of cp sizes, builds `varlen.comm.partition` for
the zigzag, contiguous and document schemes (the document scheme balancing the work of the
`--mask`) and reports, from the partition alone (no attention is run):

* visible query-key pairs per rank (the attention FLOPs are 4 * D * pairs per head), max and
  mean over ranks; max / mean is the load imbalance the slowest rank sets;
* pad rows added by the partition;
* bytes the busiest rank sends per layer (forward + backward) with ring, allgather and
  ulysses ("-" when Hq is not divisible by cp): what its group counts, from
  `varlen.comm.model.call_traffic` (the document ring moves only split documents' rows);
and writes, into the folder `--out` (default `out/cp_balance/` in the repository), one PNG of
per-rank work per cp size (`cp_balance-cp<N>.png`, matplotlib, Agg backend) and the numbers as
JSON (`cp_balance.json`, or where `--json` says).

    python scripts/cp_balance.py                                   # quick default, < 20 s
    python scripts/cp_balance.py --tokens 262144 --cp 2 4 8 16 --mask sliding:4096 \\
        --dist long-tail --out /tmp/cp_balance
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import varlen.comm as vc  # noqa: E402
from varlen.comm.model import call_traffic  # noqa: E402
from varlen._cli import ArgumentParser, positive_int  # noqa: E402

DISTS = ("uniform", "long-tail", "one-long")
SCHEMES = ("zigzag", "contiguous", "document")


def document_lengths(dist: str, tokens: int, mean: int, rng) -> np.ndarray:
    """Document lengths summing to `tokens` (the last one cut to fit)."""
    if dist == "one-long":
        long = tokens // 2
        rest = document_lengths("uniform", tokens - long, mean, rng)
        return np.concatenate([[long], rest]).astype(np.int64)
    out, total = [], 0
    while total < tokens:
        if dist == "uniform":
            n = rng.integers(1, 2 * mean)
        elif dist == "long-tail":
            # Pareto tail (alpha 1.2), most documents short, a few very long.
            n = int(min(mean * 0.2 * (1 + rng.pareto(1.2)), tokens))
        else:
            raise ValueError(f"unknown distribution {dist!r}; expected one of {DISTS}")
        n = int(max(1, min(n, tokens - total)))
        out.append(n)
        total += n
    return np.asarray(out, np.int64)


def parse_mask(text: str):
    """(left, right) window: full (-1, -1), causal (-1, 0), sliding:W (W, 0)."""
    if text == "full":
        return -1, -1
    if text == "causal":
        return -1, 0
    if text.startswith("sliding:") and text[len("sliding:"):].isdigit():
        return int(text[len("sliding:"):]), 0
    raise argparse.ArgumentTypeError(f"mask must be full, causal or sliding:W, got {text!r}")


def visible_pairs(part, rank: int, window) -> int:
    """Query-key pairs rank `rank`'s queries see (per head), from its segments' global
    positions (any scheme)."""
    left, right = window
    seg = part.segments(rank)
    length = seg.length.astype(np.int64).reshape(-1)
    pos0 = seg.pos.astype(np.int64).reshape(-1)
    L = np.repeat(part.seqlens.astype(np.int64), seg.length.shape[1])
    keep = length > 0
    pos = np.concatenate([p + np.arange(n) for p, n in zip(pos0[keep], length[keep])] or
                         [np.zeros(0, np.int64)])
    L = np.repeat(L[keep], length[keep])
    hi = L - 1 if right < 0 else np.minimum(L - 1, pos + right)
    lo = np.zeros_like(pos) if left < 0 else np.maximum(0, pos - left)
    return int(np.maximum(hi - lo + 1, 0).sum())


_DTYPE_OF = {2: "bfloat16", 4: "float32", 8: "float64"}


def bytes_per_rank(part, Hq, Hk, D, Dv, elem) -> dict:
    """Bytes the busiest rank sends per layer, forward + backward, for each method: what its
    group counts (`varlen.comm.model.call_traffic`), on zigzag and document partitions alike
    (the document ring moves only split documents' rows)."""
    out = {}
    for method in ("ring", "allgather", "ulysses"):
        if method == "ulysses" and Hq % part.cp_size:
            out[method] = None
            continue
        out[method] = max(
            sum(t["sent"] for backward in (False, True) for t in call_traffic(
                part, r, method, heads_q=Hq, heads_k=Hk, head_dim=D, head_dim_v=Dv,
                dtype=_DTYPE_OF[elem], backward=backward).values())
            for r in range(part.cp_size))
    return out


def analyse(lengths, cp, scheme, window, heads) -> dict:
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    part = vc.partition(cu, cp, scheme, mask=window_mask(window))
    work = np.array([visible_pairs(part, r, window) for r in range(cp)], dtype=np.int64)
    Hq, Hk, D, Dv, elem = heads
    sent = bytes_per_rank(part, Hq, Hk, D, Dv, elem)
    return {"cp": cp, "scheme": scheme, "tokens": int(cu[-1]), "documents": len(lengths),
            "local_rows": part.local_rows,
            "pad_rows": int(cp * part.local_rows - cu[-1]),
            "pairs_per_rank": work.tolist(), "pairs_max": int(work.max()),
            "pairs_mean": float(work.mean()),
            "imbalance": float(work.max() / work.mean()) if work.mean() > 0 else 1.0,
            "bytes_per_rank": sent}


def window_mask(window):
    """The `varlen.Mask` of a `(left, right)` window (the work the document scheme balances)."""
    import varlen
    return varlen.Mask(window_left=window[0], window_right=window[1])


def _mb(x):
    return "-" if x is None else f"{x / 2 ** 20:9.1f}"


def plot(results, cp, path):
    """Per-rank work at one cp size, one bar per scheme, a panel per distribution; the legend
    gives max/mean work and ring MiB per rank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = list(results)
    fig, axes = plt.subplots(1, len(dists), figsize=(5 * len(dists), 3.6), squeeze=False)
    for ax, dist in zip(axes[0], dists):
        rows = results[dist]
        width = 0.8 / len(SCHEMES)
        for i, scheme in enumerate(SCHEMES):
            r = next(x for x in rows if x["cp"] == cp and x["scheme"] == scheme)
            w = np.asarray(r["pairs_per_rank"], float) / max(r["pairs_mean"], 1.0)
            ring = r["bytes_per_rank"]["ring"] / 2 ** 20
            ax.bar(np.arange(cp) + (i - (len(SCHEMES) - 1) / 2) * width, w, width=width,
                   label=f"{scheme} (max/mean {r['imbalance']:.3f}, ring {ring:.0f} MiB)")
        ax.set_xticks(np.arange(cp))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{dist}, cp={cp}")
        ax.set_xlabel("rank")
        ax.set_ylabel("visible pairs / mean")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=positive_int, default=65536,
                    help="tokens per batch (65536)")
    ap.add_argument("--mean", type=positive_int, default=2048,
                    help="mean document length (2048)")
    ap.add_argument("--cp", type=positive_int, nargs="+", default=[2, 4, 8],
                    help="cp sizes, one plot each (2 4 8)")
    ap.add_argument("--dist", nargs="+", default=list(DISTS), choices=DISTS,
                    help="document-length distributions (all)")
    ap.add_argument("--mask", type=parse_mask, default=(-1, 0),
                    help="full | causal | sliding:W (causal)")
    ap.add_argument("--heads", type=positive_int, nargs=2, default=[32, 8],
                    metavar=("HQ", "HK"), help="query and key/value heads (32 8)")
    ap.add_argument("--head-dim", type=positive_int, default=128, help="D = Dv (128)")
    ap.add_argument("--elem-bytes", type=int, choices=sorted(_DTYPE_OF), default=2,
                    help="bytes per element (2: bf16, 4: float32, 8: float64)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the lengths (0)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "cp_balance",
                    help="folder for the plots and the JSON, created if missing "
                         "(out/cp_balance in the repository)")
    ap.add_argument("--json", type=Path, default=None,
                    help="JSON path (default: cp_balance.json in --out)")
    args = ap.parse_args(argv)
    if args.heads[0] % args.heads[1]:
        ap.error(f"--heads {args.heads[0]} {args.heads[1]}: HQ must be a multiple of HK")
    if args.out.suffix.lower() in (".png", ".json", ".svg", ".pdf") or args.out.is_file():
        ap.error(f"--out {args.out}: a folder for one plot per cp size and the JSON, not a file "
                 f"(e.g. --out {args.out.with_suffix('')})")
    args.cp = sorted(set(args.cp))
    return args


def print_table(args, heads):
    """Analyse every (distribution, cp, scheme), printing a row each; {dist: [rows]}."""
    rng = np.random.default_rng(args.seed)
    results = {}
    print(f"mask window (left, right) = {args.mask}; Hq={heads[0]} Hk={heads[1]} "
          f"D={heads[2]}, {heads[4]}-byte elements; pairs per head; MiB sent per rank per "
          f"layer (forward + backward)")
    print(f"{'dist':10} {'cp':>3} {'scheme':10} {'docs':>5} {'pad rows':>8} "
          f"{'pairs max':>12} {'pairs mean':>12} {'max/mean':>8} "
          f"{'ring MiB':>9} {'allg MiB':>9} {'ulys MiB':>9}", flush=True)
    for dist in args.dist:
        lengths = document_lengths(dist, args.tokens, args.mean, rng)
        rows = results[dist] = []
        for cp in args.cp:
            for scheme in SCHEMES:
                r = analyse(lengths, cp, scheme, args.mask, heads)
                rows.append(r)
                b = r["bytes_per_rank"]
                print(f"{dist:10} {cp:3d} {scheme:10} {r['documents']:5d} {r['pad_rows']:8d} "
                      f"{r['pairs_max']:12d} {r['pairs_mean']:12.0f} {r['imbalance']:8.3f} "
                      f"{_mb(b['ring'])} {_mb(b['allgather'])} {_mb(b['ulysses'])}",
                      flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    heads = (args.heads[0], args.heads[1], args.head_dim, args.head_dim, args.elem_bytes)
    results = print_table(args, heads)
    args.out.mkdir(parents=True, exist_ok=True)
    for cp in args.cp:
        png = args.out / f"cp_balance-cp{cp}.png"
        plot(results, cp, png)
        print(f"wrote {png}")
    js = args.json or args.out / "cp_balance.json"
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                       for k, v in vars(args).items()},
                              "results": results}, indent=1))
    print(f"wrote {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
