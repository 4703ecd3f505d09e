"""The Hugging Face transformers attention implementation "varlen".

    import varlen.integrations.transformers        # registers "varlen"; or, equivalently,
    varlen.torch.register_transformers()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="varlen")

Every attention layer then calls `varlen.torch.varlen_attention` (K/V heads as they are: GQA
needs no `repeat_kv`). The batch arrives in one of three forms:

* **Padded**, with a 2-D `attention_mask` `[B, past + S]` (left or right padding, holes too):
  each row's tokens are moved to the front of the row (a stable partition computed on the
  device), the rows are packed at fixed offsets `b * S` (`seq_offsets`), and the outputs are
  moved back; padding positions get output 0. Shapes never depend on the mask, so nothing is
  read on the host.
* **Packed**, without a mask: `DataCollatorWithFlattening`'s `cu_seq_lens_q/k` when it
  passes them (`return_flash_attn_kwargs=True`), else `position_ids` that restart at 0 for
  each document. Documents never see each other, with or without a cache (transformers' eager
  and sdpa paths detect packing only without one).
* **Plain** (neither): one sequence per row; queries aligned bottom-right against the keys, which
  is what decoding with a cache needs.

Causal layers are causal (bottom-right aligned) and a layer's `sliding_window` `W` lets a query
see itself and the `W - 1` keys before it, as transformers defines it; `softcap` and `scaling`
pass through, and so do a layer's attention sinks (`s_aux`, gpt-oss: learnable, their gradient
included). In training mode a layer's attention dropout runs as FlashAttention 2's (kept
probabilities scaled by `1 / (1 - p)`), with varlen's own keep bits (docs/semantics.md,
"Dropout") and a seed drawn from torch's default generator per layer call, so
`torch.manual_seed` makes a step repeatable; not the pairs eager's `nn.functional.dropout`
drops. `output_attentions` is not available (each layer returns no weights: with
`output_attentions=True` the model's `attentions` is an empty tuple, as with transformers'
sdpa implementation). Models that add their own mask functions on top of
causal/sliding (bidirectional image tokens, chunked attention) need another implementation.
"""
from __future__ import annotations

import torch
import transformers
from transformers import AttentionInterface

from .._torch_ops import varlen_attention as _varlen_attention
from .flash_attn import _batch_cu, _bound, fa_mask
from .padding import cu_seqlens_from_position_ids, kept_first

try:    # transformers >= 4.53 chooses the mask format per attention implementation
    from transformers.masking_utils import AttentionMaskInterface
except ImportError:   # pragma: no cover - older transformers
    AttentionMaskInterface = None

__all__ = ["NAME", "register", "varlen_attention_forward", "padding_mask_2d"]

NAME = "varlen"


def padding_mask_2d(*, attention_mask=None, kv_length=None, **kwargs):
    """The mask transformers hands to the "varlen" layers: the 2-D padding mask `[B, kv_length]`
    (bool, True = token) as given, or None. Causal, sliding and packed structure are applied by
    `varlen_attention_forward`, not materialised here."""
    if attention_mask is None or kv_length is None:
        return attention_mask
    return attention_mask[:, -kv_length:]


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x [B, S, ...]` flattened to `[B * S, ...]` and gathered row by row: row `r` of batch
    entry `b` comes from position `index[b, r]` of that entry."""
    B, S = index.shape
    flat = (index + torch.arange(B, device=index.device)[:, None] * S).reshape(-1)
    return x.reshape(B * S, *x.shape[2:]).index_select(0, flat)


def _cu_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


HOLES = ("a sliding window with a padding mask that has holes (a 0 between two 1s of a row): "
         "transformers counts the window in positions, and a row's kept tokens are packed "
         "together here; use left or right padding, or attn_implementation='sdpa' for such "
         "masks")


def _refuse_holes(keep: torch.Tensor) -> None:
    """Refuse rows whose kept tokens are not contiguous (a sliding window would count the
    packed tokens, not the positions transformers counts): at once for host tensors; for
    device tensors recorded on the device, raised by `varlen.check_device_errors()` (no
    synchronisation here). Not checked while torch.compile traces."""
    if torch.compiler.is_compiling():
        return
    S = keep.shape[1]
    idx = torch.arange(S, device=keep.device)
    n = keep.sum(1)
    first = torch.where(keep, idx, S).amin(1)
    last = torch.where(keep, idx, -1).amax(1)
    holes = ((n > 0) & (last - first + 1 != n)).any()
    if keep.device.type != "cuda":
        if bool(holes):
            raise ValueError(HOLES)
        return
    import cupy

    from .._device_errors import record
    with cupy.cuda.Device(keep.device.index or 0):
        record(cupy, cupy.from_dlpack(holes), HOLES)


def _padded(q, k, v, attention_mask, *, sliding=False, **kw):
    """Attention over a padded batch: each row's tokens first, packed at offsets `b * S`."""
    B, Sq = q.shape[:2]
    if attention_mask.dim() != 2:
        raise ValueError(f"the varlen attention implementation takes a 2-D padding mask "
                         f"[batch, kv_length]; got {tuple(attention_mask.shape)} (a custom 4-D "
                         f"mask needs attn_implementation='eager' or 'sdpa')")
    keep_k = attention_mask.bool()
    Sk = keep_k.shape[1]
    if k.shape[1] > Sk:      # a static cache longer than the tokens seen so far
        k, v = k[:, :Sk], v[:, :Sk]
    if k.shape[1] != Sk or Sq > Sk:
        raise ValueError(f"attention_mask covers {Sk} keys but the layer has {k.shape[1]} keys "
                         f"and {Sq} queries (the queries are the last keys)")
    keep_q = keep_k[:, Sk - Sq:]
    if sliding:
        _refuse_holes(keep_k)
    order_k, dest_k = kept_first(keep_k)
    order_q, dest_q = (order_k, dest_k) if Sq == Sk else kept_first(keep_q)
    out = _varlen_attention(
        _rows(q, order_q), _rows(k, order_k), _rows(v, order_k),
        _cu_from_lengths(keep_q.sum(1, dtype=torch.int32)),
        _cu_from_lengths(keep_k.sum(1, dtype=torch.int32)),
        seq_offsets_q=_batch_cu(B, Sq, q.device), seq_offsets_k=_batch_cu(B, Sk, q.device),
        max_seqlen_q=Sq, max_seqlen_k=Sk, **kw)
    return _rows(out.view(B, Sq, *out.shape[1:]), dest_q)


def _flat(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    """Attention over the rows of every batch entry taken as one packed sequence of rows."""
    B, Sq = q.shape[:2]
    out = _varlen_attention(q.reshape(B * Sq, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                            v.reshape(-1, *v.shape[2:]), cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **kw)
    return out.view(B, Sq, *out.shape[1:])


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                             scaling=None, sliding_window=None, softcap=None, is_causal=None,
                             **kwargs):
    """transformers' attention-function contract, computed by varlen.

    Args:
        module: the attention layer (`module.is_causal` when `is_causal` is None).
        query: `[B, Hq, Sq, D]`; key, value: `[B, Hk, Sk, D]` (after the cache update).
        attention_mask: None or the 2-D padding mask `[B, Sk]` from `padding_mask_2d`.
        dropout: the layer's attention dropout probability (transformers passes 0.0 outside
            training); applied only while `module.training`, as eager applies it: kept
            probabilities scaled by `1 / (1 - dropout)`, the seed drawn from torch's default
            generator (`varlen.torch.varlen_attention`'s `seed=None`).
        scaling: softmax scale (default `1/sqrt(D)`); sliding_window: int or None;
        softcap: float or None; is_causal: bool or None.
        kwargs: without a mask, `cu_seq_lens_q`, `cu_seq_lens_k` (and `max_length_q`,
            `max_length_k`) or else `position_ids` `[B or 1, Sq]` mark packed documents;
            `s_aux` `[Hq]`: the layer's attention sinks (gpt-oss), learnable.

    Returns:
        `(out [B, Sq, Hq, Dv], None)`.
    """
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    left = sliding_window - 1 if sliding_window else -1
    kw = dict(mask=fa_mask(bool(is_causal), (left, left)), softmax_scale=scaling,
              softcap=softcap or 0.0, sinks=kwargs.get("s_aux"),
              dropout_p=(dropout or 0.0) if getattr(module, "training", True) else 0.0)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    (B, Sq), Sk = q.shape[:2], k.shape[1]
    position_ids, cu_q, cu_k = (kwargs.get(n) for n in ("position_ids", "cu_seq_lens_q",
                                                         "cu_seq_lens_k"))
    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, sliding=bool(sliding_window), **kw)
    elif cu_q is not None and cu_k is not None:     # DataCollatorWithFlattening's kwargs
        out = _flat(q, k, v, cu_q, cu_k, _bound(kwargs.get("max_length_q")),
                    _bound(kwargs.get("max_length_k")), **kw)
    elif position_ids is not None and position_ids.dim() == 2 and Sq == Sk:
        cu = cu_seqlens_from_position_ids(position_ids.expand(B, Sq))
        out = _flat(q, k, v, cu, cu, Sq, Sk, **kw)
    else:       # one sequence per row; queries are the last keys (decoding with a cache)
        out = _flat(q, k, v, _batch_cu(B, Sq, q.device), _batch_cu(B, Sk, q.device), Sq, Sk,
                    **kw)
    return out, None


def register(name: str = NAME) -> None:
    """Register the attention function (and its mask format) under `name` in transformers."""
    if AttentionMaskInterface is None:
        raise ImportError(f"the varlen attention implementation needs transformers >= 4.53 "
                          f"(found {transformers.__version__})")
    AttentionInterface.register(name, varlen_attention_forward)
    AttentionMaskInterface.register(name, padding_mask_2d)


register()
