"""Partitions of a packed batch over context-parallel ranks: zigzag (load-balanced), contiguous,
and document (whole documents per rank where balance allows: `DocumentPartition`).

`partition(...)` builds any scheme; the schemes live in their own modules and this one exports
their public names:

    chunked.py    `Partition`, the base of every scheme: zigzag and contiguous chunks
    document.py   `DocumentPartition`: whole documents per rank, split ones zigzag over a few
    plans.py      `StepPlans`, `plan`: what each kernel call of a context-parallel method
                  computes on a rank, cached by the partition

Imports run one way: this module imports `document` and `plans`, which import `chunked`
(`DocumentPartition` subclasses `Partition`); none of them imports this one.
"""
from __future__ import annotations

import numpy as np

from varlen._array import array_module, host_copy, to_working
from varlen._validate import as_index_array, check_layout_values, validation_enabled

from .chunked import CHUNK_SCHEMES, Partition, _int_arg, local_rows_bound
from .document import DocumentPartition, _document_partition, document_work
from .plans import StepPlans, check_step_plans, mask_key, plan, step_plans

__all__ = ["Partition", "DocumentPartition", "partition", "document_work", "local_rows_bound",
           "SCHEMES", "CHUNK_SCHEMES", "StepPlans", "plan", "step_plans", "check_step_plans",
           "mask_key"]

# Every scheme `partition` takes: the chunk schemes and the document scheme.
SCHEMES = CHUNK_SCHEMES + ("document",)


def partition(cu_seqlens, cp_size, scheme="zigzag", *, seq_offsets=None, num_rows=None,
              local_rows=None, mask="causal", max_doc_len=None, balance=1.05,
              like=None) -> "Partition":
    """Split a packed batch over `cp_size` context-parallel ranks.

    Args:
        cu_seqlens: int32 `[B+1]` cumulative global lengths (any framework); zero lengths are
            legal and lengths need not divide by anything.
        cp_size: number of ranks, >= 1.
        scheme: `"zigzag"` (rank r holds chunks r and 2*cp-1-r of every sequence: balanced
            causal work), `"contiguous"` (rank r holds chunk r of cp) or `"document"` (each
            document whole on one rank, or zigzag-split over the fewest ranks that balance
            it; see `DocumentPartition`).
        seq_offsets: optional int32 `[B+1]`: sequence b occupies global rows
            `[off[b], off[b] + L[b])` (Transformer Engine's `cu_seqlens_padded`).
        num_rows: rows `T` of the global packed arrays (default: the last entry of
            `seq_offsets` or `cu_seqlens`, a host read that device metadata must avoid).
        local_rows: rows of every rank's shard (default: exact for host metadata,
            `local_rows_bound(...)` for device metadata). Extra rows are trailing padding.
            For `"document"` it is the capacity the placement respects (default: the most
            rows the placement puts on a rank); a fixed value keeps shapes static.

    Document scheme only (the others ignore them):
        mask: the mask whose work (visible query-key pairs, `document_work`) is balanced:
            `"causal"` (default), `"full"`, or any mask the attention calls take.
        max_doc_len: documents longer than this are split (each over the fewest ranks that
            hold one rank's share of the work), the others stay whole. Default: the split
            threshold that moves the fewest rows at an estimated max/mean work <= `balance`.
        balance: the max/mean work the default threshold aims for (1.05).
        like: another document partition of the same batch whose placement to reuse (the
            key partition of cross attention takes the query partition's).
        The placement is computed on the host: device `cu_seqlens` are copied to the host
        once (a synchronising read), the metadata then goes back to the device on use.

    Returns a `Partition`. Its arrays live where `cu_seqlens` lives.
    """
    cp_size = _int_arg("cp_size", cp_size, 1)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not a known scheme; expected one of "
                         f"{', '.join(map(repr, SCHEMES))}")
    probe = to_working(cu_seqlens, "cu_seqlens")
    xp = array_module(probe)
    on_device = xp is not np
    cu = as_index_array(cu_seqlens, "cu_seqlens", xp)
    if cu.shape[0] == 0:
        raise ValueError("cu_seqlens is empty; expected [B+1] entries starting at 0")
    B = cu.shape[0] - 1
    off = None if seq_offsets is None else as_index_array(seq_offsets, "seq_offsets", xp,
                                                          length=B + 1)
    if num_rows is None:
        if on_device:
            raise ValueError("num_rows is required for device cu_seqlens: it sizes the "
                             "partition without reading device memory")
        num_rows = int(host_copy(off if off is not None else cu)[-1])
    num_rows = _int_arg("num_rows", num_rows, 0)
    if validation_enabled(on_device):
        check_layout_values(cu, off, num_rows, rows_name=f"num_rows={num_rows}")
    if scheme == "document":
        return _document_partition(cu, off, cp_size, num_rows, local_rows, mask=mask,
                                   max_doc_len=max_doc_len, balance=balance, like=like)
    return Partition(cu, off, cp_size, scheme, num_rows, local_rows)
