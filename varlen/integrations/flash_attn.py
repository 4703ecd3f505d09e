"""FlashAttention 2's Python contract on top of `varlen.torch.varlen_attention`.

    # from flash_attn import flash_attn_varlen_func
    from varlen.torch import flash_attn_varlen_func

    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, causal=True, window_size=(255, 0))

Same arguments, defaults, layouts and return values as `flash_attn.flash_attn_varlen_func` and
`flash_attn.flash_attn_func` (FlashAttention 2.6+): `causal` is aligned to the bottom-right
corner, `window_size=(left, right)` counts keys around that diagonal, K/V may have fewer heads
(GQA/MQA), `softmax_lse` is `[H, total_q]` (varlen) or `[B, H, S]` (padded) float32. The
difference: a query that sees no key gets lse `-inf` (FlashAttention 3's value; FlashAttention 2
writes `+inf`); its output is 0 in both. `alibi_slopes` runs as a ScoreMod
(`varlen.mods.alibi`) with FlashAttention 2's bias; `dropout_p` drops pairs as FlashAttention 2
does (kept probabilities scaled by `1 / (1 - dropout_p)`) with varlen's own Philox stream (so
not FlashAttention's pattern), on every backend; `return_attn_probs=True` with dropout raises
`NotImplementedError`. Besides float16/bfloat16 (FlashAttention's dtypes), float32 works
everywhere and float64 on the CPU. See `docs/dropin.md`.
"""
from __future__ import annotations

import operator

import numpy as np

import torch

from ..masks import Mask
from ..mods import alibi
from .._torch_ops import draw_seed as _draw_seed
from .._torch_ops import varlen_attention as _varlen_attention

__all__ = ["flash_attn_varlen_func", "flash_attn_func", "fa_mask"]


def fa_mask(causal=False, window_size=(-1, -1)) -> Mask:
    """The `varlen.Mask` of FlashAttention's `causal` and `window_size` arguments.

    FlashAttention aligns both to the bottom-right corner: query `i` of a sequence with `Lq`
    queries and `Lk` keys sees keys `[i + Lk - Lq - left, i + Lk - Lq + right]`, a negative
    side being unbounded; `causal=True` sets `right = 0` and keeps `left`.
    """
    if not isinstance(causal, (bool, int, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    causal = bool(causal)
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 = unbounded; "
                        f"got {window_size!r}") from None
    return Mask(window_left=left, window_right=0 if causal else right, bottom_right=True)


def _dropout(dropout_p, seed, return_attn_probs) -> dict:
    """The `varlen_attention` keywords of FlashAttention's `dropout_p` (and varlen's `seed`):
    a seed drawn from torch's default CPU generator when none is given, as FlashAttention
    draws its Philox state from torch's generator, `deterministic=True` or not."""
    from ..dropout import check_dropout
    p, seed, _ = check_dropout(dropout_p, seed)
    if p > 0 and return_attn_probs:
        raise NotImplementedError(
            f"return_attn_probs=True with dropout_p={dropout_p!r}: varlen does not return "
            f"FlashAttention's dropout pattern (varlen.reference.dropout_keep gives varlen's); "
            f"pass return_attn_probs=False, or dropout_p=0.0")
    if p > 0 and seed is None:
        seed = _draw_seed()
    return {"dropout_p": p, "seed": seed}


# ALiBi's functions traced once (slopes [H] or [B, H] float32, shifts int32): a call puts its
# tensors in with `with_aux`, which torch.compile traces (tracing a function it does not).
_ALIBI = {ndim: alibi(np.zeros((1,) * ndim, np.float32), np.zeros(1, np.int32))
          for ndim in (1, 2)}


def _alibi(alibi_slopes, q, batch: int, shift):
    """The ScoreMod of FlashAttention 2's `alibi_slopes` (None: none) for a batch of `batch`
    sequences whose key and query lengths differ by `shift` (`Lk - Lq`, int32 `[B]`). The
    slopes get no gradient, as in FlashAttention."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor, got "
                        f"{type(alibi_slopes).__name__}")
    H = q.shape[-2]
    if tuple(alibi_slopes.shape) not in ((H,), (batch, H)):
        raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected "
                         f"({H},) or ({batch}, {H}) (nheads of q, batch)")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32 (FlashAttention's dtype), got "
                        f"{alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    return _ALIBI[alibi_slopes.dim()].with_aux((alibi_slopes.detach(), shift))


def _bound(max_seqlen):
    """A `max_seqlen_*` for varlen: ints are bounds; a tensor (as some callers pass) is not
    read, since that would wait for the device, and varlen needs no bound."""
    return None if isinstance(max_seqlen, torch.Tensor) else max_seqlen


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, sinks=None,
                           seed=None):
    """FlashAttention 2's `flash_attn_varlen_func`, differentiable in q, k and v (and `sinks`).

    If `causal=True`, the causal mask is aligned to the bottom-right corner of each sequence's
    attention matrix (`x` = visible)::

        Lq=2, Lk=5:  x x x x .      Lq=5, Lk=2:  . .
                     x x x x x                   . .
                                                 . .
                                                 x .
                                                 x x

    A row that sees no key has output 0 and lse `-inf`. With `window_size=(left, right)`, query
    `i` sees keys `[i + Lk - Lq - left, i + Lk - Lq + right]` inclusive (-1: unbounded side).

    Args:
        q: `[total_q, Hq, D]` float16, bfloat16, float32 (float64 on the CPU).
        k: `[total_k, Hk, D]`, q's dtype and device, `Hq % Hk == 0`: query head h reads key
            head `h // (Hq // Hk)` (GQA/MQA).
        v: `[total_k, Hk, Dv]`.
        cu_seqlens_q, cu_seqlens_k: int32 `[B+1]` on q's device, cumulative sequence lengths
            starting at 0.
        max_seqlen_q, max_seqlen_k: int, the longest sequence (any upper bound works). A
            tensor is accepted and ignored (reading it would synchronise).
        dropout_p: float in [0, 1): attention dropout (FlashAttention 2's: each visible pair's
            probability dropped with probability `dropout_p`, kept ones scaled by
            `1 / (1 - dropout_p)`); set it to 0.0 for evaluation. The pairs come from varlen's
            Philox stream (`varlen.reference.dropout_keep`), not FlashAttention's. Tested
            on CPU tensors; CUDA tensors run the device backends (not yet run on a GPU).
        softmax_scale: float, scale of `q @ k^T`; default `1/sqrt(D)`.
        causal: bool, bottom-right aligned causal mask.
        window_size: `(left, right)` ints; `(-1, -1)` is no window.
        softcap: float; if > 0, scores become `softcap * tanh(scores / softcap)`.
        alibi_slopes: optional `[Hq]` or `[B, Hq]` float32 tensor on q's device: the score of
            query i and key j of sequence b at head h gets the bias
            `-alibi_slopes[(b,) h] * |i + Lk[b] - Lq[b] - j|` (after the softmax scale and the
            softcap), causal or not, as FlashAttention 2 documents it. No gradient flows into
            the slopes (as in FlashAttention; `varlen.torch.varlen_attention` with a
            `varlen.ScoreMod` learns them).
        deterministic: bool, bitwise-repeatable backward.
        return_attn_probs: also return `softmax_lse` and, in the place of FlashAttention's
            dropout pattern, None (with `dropout_p > 0`: NotImplementedError).
        sinks: optional float `[Hq]` tensor on q's device, learnable: attention sinks as in
            gpt-oss (one logit per query head in every row's softmax, with no value; not
            scaled, not soft-capped). A row that sees no key then has lse `sinks[h]`.
        seed: varlen's addition: the dropout seed, an int in [0, 2**64); None draws one from
            torch's default CPU generator (`torch.manual_seed` makes a run repeatable).

    Returns:
        out: `[total_q, Hq, Dv]` in q's dtype; or, with `return_attn_probs=True`,
        `(out, softmax_lse, None)` with `softmax_lse` `[Hq, total_q]` float32 (float64 for
        float64 inputs), natural log, no gradient.
    """
    drop = _dropout(dropout_p, seed, return_attn_probs)
    score_mod = None
    if alibi_slopes is not None:
        cu_q, cu_k = (torch.as_tensor(x, device=q.device) for x in (cu_seqlens_q, cu_seqlens_k))
        shift = ((cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])).to(torch.int32)
        score_mod = _alibi(alibi_slopes, q, cu_q.shape[0] - 1, shift)
    out, lse = _varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, mask=fa_mask(causal, window_size),
        softmax_scale=softmax_scale, softcap=softcap, max_seqlen_q=_bound(max_seqlen_q),
        max_seqlen_k=_bound(max_seqlen_k), deterministic=deterministic, return_lse=True,
        score_mod=score_mod, sinks=sinks, **drop)
    return (out, lse, None) if return_attn_probs else out


def _batch_cu(batch: int, seqlen: int, device) -> torch.Tensor:
    """cu_seqlens of `batch` sequences of `seqlen` rows each: `[0, S, 2S, ...]`, int32."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, sinks=None, seed=None):
    """FlashAttention 2's `flash_attn_func`: a batch of equal-length sequences.

    Args:
        q: `[B, Sq, Hq, D]`; k: `[B, Sk, Hk, D]`; v: `[B, Sk, Hk, Dv]`; one dtype and device.
        Every other argument as in `flash_attn_varlen_func` (causal aligned bottom-right when
        `Sq != Sk`); dropout positions are those of each batch entry.

    Returns:
        out: `[B, Sq, Hq, Dv]`; or `(out, softmax_lse, None)` with `softmax_lse` `[B, Hq, Sq]`
        float32, when `return_attn_probs=True`.
    """
    drop = _dropout(dropout_p, seed, return_attn_probs)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (FlashAttention's contract), got "
                            f"{type(x).__name__}; varlen.attention_forward takes any "
                            f"framework's arrays")
        if x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, seqlen, heads, head_dim]; "
                             f"got {tuple(x.shape)}")
    B, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    if k.shape[0] != B or v.shape[0] != B or v.shape[1] != Sk:
        raise ValueError(f"{q.shape=}, {k.shape=} and {v.shape=} disagree on batch or seqlen")
    score_mod = None if alibi_slopes is None else _alibi(
        alibi_slopes, q, B, torch.full((B,), Sk - Sq, dtype=torch.int32, device=q.device))
    out, lse = _varlen_attention(
        q.reshape(B * Sq, Hq, q.shape[3]), k.reshape(B * Sk, *k.shape[2:]),
        v.reshape(B * Sk, *v.shape[2:]), _batch_cu(B, Sq, q.device), _batch_cu(B, Sk, q.device),
        mask=fa_mask(causal, window_size), softmax_scale=softmax_scale, softcap=softcap,
        max_seqlen_q=Sq, max_seqlen_k=Sk, deterministic=deterministic, return_lse=True,
        score_mod=score_mod, sinks=sinks, **drop)
    out = out.view(B, Sq, Hq, out.shape[-1])
    if not return_attn_probs:
        return out
    return out, lse.view(Hq, B, Sq).transpose(0, 1).contiguous(), None
