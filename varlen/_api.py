"""The validated public functions: arrays in from any framework, a backend call, arrays out."""
from __future__ import annotations

from ._array import Origin
from ._setup import make_plan, setup
from .plan import Plan

__all__ = ["attention_forward", "attention_backward", "attention", "plan"]


def plan(cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None, seq_offsets_k=None, mask="full",
         num_rows_q=None, num_rows_k=None, max_seqlen_q=None, max_seqlen_k=None,
         block_m: int = 64, block_n: int = 64, backend=None) -> Plan:
    """Build the reusable device metadata of a packed batch (see `docs/plan.md`).

    Args:
        cu_seqlens_q, cu_seqlens_k: int32 `[B+1]` cumulative lengths (any framework).
        seq_offsets_q, seq_offsets_k: optional int32 `[B+1]` first row of each sequence.
        mask: a mask name, a `varlen.Mask` (per-sequence arrays on the data's device), a
            `varlen.MaskMod` or `Mask & MaskMod` (aux arrays where `cu_seqlens_q` lives).
        num_rows_q, num_rows_k: rows `T` of the packed arrays (default: the last cu_seqlens /
            offsets entry, which needs a host read and is refused for device arrays).
        max_seqlen_q, max_seqlen_k: optional bounds that tighten the tile-table size.
        block_m, block_n: tile sizes; a backend refuses a plan whose tiles it cannot run.
        backend: whose plan builder builds it (a name of `varlen.backends.names()`); None: the
            first that builds where `cu_seqlens_q` lives (`varlen.backends.select_planner`):
            CuPy's two fused kernels, else Numba's kernels, on a device; array code on the
            host. Every builder writes the same arrays, so any backend runs the plan.

    Returns a `Plan` whose arrays live where `cu_seqlens_q` lives. No host synchronisation
    when `num_rows_*` are given.
    """
    return make_plan(cu_seqlens_q, cu_seqlens_k, seq_offsets_q=seq_offsets_q,
                     seq_offsets_k=seq_offsets_k, mask=mask, num_rows_q=num_rows_q,
                     num_rows_k=num_rows_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, block_m=block_m, block_n=block_n,
                     backend=backend)


def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seq_offsets_q=None,
                      seq_offsets_k=None, mask="full", softmax_scale=None, softcap=0.0,
                      max_seqlen_q=None, max_seqlen_k=None, backend=None, plan=None,
                      score_mod=None, sinks=None, dropout_p=0.0, seed=None, offset=0):
    """Attention over a packed variable-length batch. Returns `(out, lse)`.

    Args:
        q: `[Tq, Hq, D]` float16, bfloat16, float32 (or float64 on the host backends).
        k: `[Tk, Hk, D]`, same dtype; `Hq % Hk == 0` (query head h reads key head
            `h // (Hq // Hk)`: GQA/MQA).
        v: `[Tk, Hk, Dv]`, same dtype.
        cu_seqlens_q, cu_seqlens_k: int32 `[B+1]`, start at 0, non-decreasing; sequence b has
            `Lq[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]` queries (`Lk[b]` keys). Zero lengths
            are legal.
        seq_offsets_q, seq_offsets_k: optional int32 `[B+1]`; sequence b occupies rows
            `[off[b], off[b] + L[b])` (Transformer Engine's `cu_seqlens_*_padded`). Rows not
            covered by a sequence are padding: their output is 0 and they are never keys.
        mask: `"full"`, `"causal"`, `"causal_bottom_right"` or a `varlen.Mask` whose fields are
            scalars or per-sequence `[B]` arrays. Query i sees key j iff
            `(left < 0 or j >= i + s - left) and (right < 0 or j <= i + s + right)` with
            `s = Lk - Lq` when bottom_right else 0. For Lq=2, Lk=5, causal::

                top-left (s=0)     bottom-right (s=3)
                x . . . .          x x x x .
                x x . . .          x x x x x

            A `varlen.MaskMod(fn, *aux)` masks by a function `fn(b, q_idx, k_idx, *aux)`
            (positions from the sequence's first row); `Mask(...) & MaskMod(...)` keeps a pair
            both allow (docs/mods.md).
        softmax_scale: scale of `q @ k^T`, default `1/sqrt(D)`.
        softcap: if > 0, scores become `softcap * tanh(scores / softcap)`.
        max_seqlen_q, max_seqlen_k: optional upper bounds on the lengths (host ints); they
            shrink the tile table and are checked when validation is on.
        score_mod: a `varlen.ScoreMod(fn, *aux)`: each visible pair's scaled (and softcapped)
            score becomes `fn(score, b, h, q_idx, k_idx, *aux)` before the softmax; -inf hides
            the pair.
        sinks: optional float `[Hq]` (q's framework and device): attention sinks as in
            gpt-oss, one logit per query head that joins every row's softmax and contributes
            no value (not scaled, not soft-capped): `lse = log(exp(lse_keys) + exp(sinks[h]))`
            and the output scaled by `exp(lse_keys - lse)`; a row with no visible key gets
            output 0 and lse `sinks[h]` (docs/semantics.md).
        backend: `"numpy"`, `"cpu"`, `"numba"`, `"cupy"` or None (the fastest that supports the
            call: `"cpu"` for host float16/bfloat16/float32 data when its BLAS tile products are
            usable, else `"numpy"`; docs/api.md).
        plan: a `varlen.plan(...)` for this layout and mask, reused across calls and layers.
        dropout_p: float in [0, 1): attention dropout as in FlashAttention 2: each visible
            pair's probability is dropped with probability `dropout_p` and the kept ones are
            scaled by `1 / (1 - dropout_p)`; `lse` is that of the softmax without dropout.
            0.0 is exactly the path without dropout. Backends `numpy`, `cpu`, `numba` and
            `backend="cupy"` (`cupy:mma`; `cupy:sm90a` refuses it).
        seed: int in [0, 2**64), required when `dropout_p > 0`: with `offset` it fixes which
            pairs are dropped (a Philox 4x32-10 draw per sequence, query head, query and key
            position; `varlen.reference.dropout_keep`, docs/semantics.md "Dropout"). The same
            seed gives bitwise the same result on every backend that runs dropout.
        offset: int in [0, 2**32): a second stream index beside `seed` (advance it per call
            to draw new pairs under one seed).

    Returns:
        out: `[Tq, Hq, Dv]` in q's dtype, in the caller's framework and device.
        lse: `[Hq, Tq]` natural-log sum of exp of the scores, float32 (float64 for float64
            inputs); `-inf` for padding rows and for queries with no visible key (whose output
            is 0, never NaN; with sinks their lse is `sinks[h]`).
    """
    with Origin.of(q).stream_scope():
        call = setup(q, k, v, cu_seqlens_q, cu_seqlens_k, seq_offsets_q=seq_offsets_q,
                     seq_offsets_k=seq_offsets_k, mask=mask, softmax_scale=softmax_scale,
                     softcap=softcap, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                     backend=backend, plan=plan, score_mod=score_mod, sinks=sinks,
                     dropout_p=dropout_p, seed=seed, offset=offset)
        out, lse = call.backend.forward(call.plan, call.q, call.k, call.v,
                                        softmax_scale=call.softmax_scale, softcap=call.softcap,
                                        **call.backend_mods, **call.backend_dropout)
        if call.sinks is not None:
            out, lse = call.with_sinks(out, lse, call.plan.q.covered())
        return call.origin.wrap(out), call.origin.wrap(lse)


def attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                       seq_offsets_q=None, seq_offsets_k=None, mask="full", softmax_scale=None,
                       softcap=0.0, max_seqlen_q=None, max_seqlen_k=None, backend=None,
                       plan=None, deterministic=False, score_mod=None, aux_grads=False,
                       sinks=None, dropout_p=0.0, seed=None, offset=0):
    """Gradients of `sum(out * dout)` with respect to q, k, v. Returns `(dq, dk, dv)`, then
    with `sinks` their gradient `dsinks` (`[Hq]`, float32; float64 for float64 inputs), then
    with `aux_grads` the aux gradients.

    Args:
        dout: `[Tq, Hq, Dv]`, the gradient of the output, q's dtype.
        out, lse: what `attention_forward` returned for these inputs.
        deterministic: bitwise-repeatable accumulation of dQ and of the aux gradients
            (device backends use float32 atomics otherwise; aux gradients then go through
            64-bit fixed point, docs/mods.md; the host backends are always deterministic).
        aux_grads: also return the gradients of `score_mod`'s float aux arrays: a last
            result, a tuple with one float32 array (the aux's shape) or None per aux array.
        sinks: the forward's sinks; `out` and `lse` must be the forward's with them.
        dropout_p, seed, offset: the forward's: the backward draws the same keep set again
            (nothing of size rows x keys is stored).
        The other arguments are those of `attention_forward`, with the same values.

    Padding rows get zero gradients; so do queries with no visible key, and keys no query sees.
    """
    with Origin.of(q).stream_scope():
        call = setup(q, k, v, cu_seqlens_q, cu_seqlens_k, seq_offsets_q=seq_offsets_q,
                     seq_offsets_k=seq_offsets_k, mask=mask, softmax_scale=softmax_scale,
                     softcap=softcap, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                     backend=backend, plan=plan, deterministic=deterministic,
                     grads=(dout, out, lse), score_mod=score_mod, aux_grads=aux_grads,
                     sinks=sinks, dropout_p=dropout_p, seed=seed, offset=offset)
        grads = call.backend.backward(call.plan, *call.grads[:1], call.q, call.k, call.v,
                                      *call.grads[1:], softmax_scale=call.softmax_scale,
                                      softcap=call.softcap, deterministic=call.deterministic,
                                      **call.backend_mods, **call.backend_dropout,
                                      **call.sinks_flag(call.backend))
        dsinks = None if call.sinks is None else call.sink_grads(call.plan.q.covered())
        return call.backward_results(grads, aux_grads, dsinks)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """`attention_forward(...)[0]`: the output alone."""
    return attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)[0]
