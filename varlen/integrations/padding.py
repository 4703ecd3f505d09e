"""Between padded `[B, S, ...]` batches and packed `[T, ...]` rows, as FlashAttention's
`bert_padding` does it, and cumulative lengths of batches packed with position ids.

    x_packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, ...)
    out_padded = pad_input(out, indices, batch, seqlen)

Host synchronisation: `unpad_input` reads two numbers on the host (the packed row count, which
is the output's shape, and the longest sequence), in one read. `pad_input` and
`cu_seqlens_from_position_ids` read nothing: their output shapes follow from their input shapes.
"""
from __future__ import annotations

import torch

__all__ = ["unpad_input", "pad_input", "cu_seqlens_from_position_ids"]


def kept_first(keep: torch.Tensor):
    """`(order, dest)`: a stable partition of the last dim of bool `keep`, True entries first.

    `order[..., r]` is the position that lands in slot `r` (the kept positions in order, then
    the others in order) and `dest` its inverse, the slot of each position. Both int64, shaped
    like `keep`; computed with cumulative sums and one scatter, so nothing is read on the host.
    """
    n = keep.shape[-1]
    k = keep.to(torch.int64)
    kept_before = k.cumsum(-1) - k
    pos = torch.arange(n, device=keep.device).expand_as(k)
    dest = torch.where(keep, kept_before, k.sum(-1, keepdim=True) + pos - kept_before)
    order = torch.empty_like(dest).scatter_(-1, dest, pos)
    return order, dest


def _mask_2d(attention_mask, name: str, hidden_states=None) -> torch.Tensor:
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [batch, seqlen]; got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    if hidden_states is not None and tuple(hidden_states.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(f"{hidden_states.shape=} does not start with {name}'s shape "
                         f"{tuple(attention_mask.shape)} [batch, seqlen]")
    return attention_mask.bool()


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The rows of a padded batch that the mask keeps, packed (FlashAttention's `unpad_input`).

    Args:
        hidden_states: `[B, S, ...]`.
        attention_mask: bool or int `[B, S]`, 1 = a token, 0 = padding. The kept tokens of a
            row need not be contiguous (left and right padding both work).
        unused_mask: optional bool or int `[B, S]`, 1 = a row that is allocated but unused: it
            is packed too (counted in `cu_seqlens`), but not in `seqused`.

    Returns:
        unpadded: `[T, ...]`, the kept rows in order (T = number of kept tokens).
        indices: int64 `[T]`, their positions in the flattened `[B * S]` batch.
        cu_seqlens: int32 `[B+1]`, cumulative kept rows per sequence.
        max_seqlen: int, the most kept rows of any sequence.
        seqused: int32 `[B]`, the tokens of each sequence that `attention_mask` marks.

    One host read: T (the output's shape) and `max_seqlen`, together.
    """
    mask = _mask_2d(attention_mask, "attention_mask", hidden_states)
    keep = mask if unused_mask is None else mask | _mask_2d(unused_mask, "unused_mask",
                                                             hidden_states)
    B, S = keep.shape
    seqlens = keep.sum(-1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    total, max_seqlen = torch.stack((cu_seqlens[-1], seqlens.max())).tolist() if B else (0, 0)
    order, _ = kept_first(keep.reshape(-1))
    indices = order[:total]
    unpadded = hidden_states.reshape(B * S, *hidden_states.shape[2:]).index_select(0, indices)
    return unpadded, indices, cu_seqlens, max_seqlen, mask.sum(-1, dtype=torch.int32)


def pad_input(hidden_states, indices, batch: int, seqlen: int):
    """Packed rows back into a zero-padded `[batch, seqlen, ...]` batch (FlashAttention's
    `pad_input`); `indices` as `unpad_input` returns them: an integer `[rows]` tensor, one
    position in `[0, batch * seqlen)` per packed row. Differentiable; no host read (indices
    past the batch are refused when validation is on, as it is for CPU tensors)."""
    from .._validate import validation_enabled
    for name, n in (("batch", batch), ("seqlen", seqlen)):
        if not isinstance(n, (int, torch.SymInt)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"pad_input: {name} must be a non-negative int, got {n!r}")
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        raise TypeError(f"pad_input: hidden_states must be a [rows, ...] tensor, got "
                        f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    if (not isinstance(indices, torch.Tensor) or indices.dim() != 1
            or indices.dtype.is_floating_point or indices.dtype == torch.bool):
        raise TypeError(f"pad_input: indices must be a 1-D integer tensor (as unpad_input "
                        f"returns it), got "
                        f"{getattr(indices, 'dtype', type(indices).__name__)} "
                        f"{tuple(getattr(indices, 'shape', ()))}")
    if indices.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"pad_input: {indices.shape[0]} indices for {hidden_states.shape[0]} "
                         f"rows of hidden_states; expected one index per packed row")
    device = indices.device.type
    if (indices.numel() and device != "meta" and not torch.compiler.is_compiling()
            and validation_enabled(device != "cpu")):
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= batch * seqlen:
            raise ValueError(f"pad_input: indices span [{lo}, {hi}] but batch={batch} x "
                             f"seqlen={seqlen} holds positions [0, {batch * seqlen - 1}]")
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    return out.index_copy(0, indices, hidden_states).view(batch, seqlen, *hidden_states.shape[1:])


def cu_seqlens_from_position_ids(position_ids) -> torch.Tensor:
    """cu_seqlens of a batch packed the way transformers' `DataCollatorWithFlattening` packs it.

    A document starts at the beginning of every row and wherever the position id is 0, so
    `position_ids = [[0, 1, 2, 0, 1, 0, 1, 2, 3]]` holds documents of 3, 2 and 4 tokens. No
    document crosses a row.

    Args:
        position_ids: integer `[B, S]` or `[S]`.

    Returns:
        int32 `[B * S + 1]`: the document boundaries in the flattened `[B * S]` rows, followed
        by `B * S` repeated (zero-length sequences, which varlen and FlashAttention skip). Its
        size depends only on the shape, so nothing is read on the host; `S` bounds every
        document's length (pass it as `max_seqlen_*`). `cu[: n + 1]` with `n` documents is the
        compact form, if one is needed.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2):
        raise ValueError(f"position_ids must be a [batch, seqlen] or [seqlen] tensor; got "
                         f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must hold integers, got dtype {position_ids.dtype}")
    pos = position_ids if position_ids.dim() == 2 else position_ids[None]
    start = pos == 0
    if start.shape[1]:
        start[:, 0] = True
    order, _ = kept_first(start.reshape(-1))
    total = start.numel()
    rows = torch.arange(total, device=pos.device)
    cu = torch.where(rows < start.sum(), order, total)
    return torch.nn.functional.pad(cu, (0, 1), value=total).to(torch.int32)
