"""The interface every backend implements.

A backend answers the same questions the same way: can it run this call (`supports`), which
tiles its plans use (`default_blocks`, `make_plan`, `check_plan`), and the two computations
(`forward`, `backward`). Arguments reach a backend already checked and normalised by the setup
step (`varlen/_setup.py`): working arrays (NumPy on the host, CuPy on a device), a `Plan` that
describes them, and plain Python scalars. A backend re-checks none of it.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

from ..plan import Plan, Segments, build_plan, layout_segments

__all__ = ["Backend", "Problem"]


@dataclass(frozen=True)
class Problem:
    """What `supports` reads of a call: the setup record (`varlen._setup.Call`) has these
    attributes too, so either can be asked about."""

    dtype: str            # float16 | bfloat16 | float32 | float64
    head_dim: int         # D of q and k
    head_dim_v: int       # Dv of v
    on_device: bool       # the arrays live on a CUDA device
    mods: object = None   # varlen.mods.Mods: the call's mask_mod / score_mod, if any
    dropout: object = None  # varlen.dropout.Dropout: the call's dropout, if any


class Backend(abc.ABC):
    """One way to run packed variable-length attention.

    Attributes:
        name: the value of `backend=` that asks for it (`family:implementation` for one
            implementation of a backend that has several).
        default_eligible: whether `backend=None` may choose it (a backend whose numerics are
            not yet proven on real hardware runs only when asked for by name).
    """

    name: str = ""
    default_eligible: bool = True
    implementations: tuple = ()       # a family's members, in order of preference
    # What of a call's user functions it runs: "mask_mod", "score_mod", "aux_grads" (the
    # gradients of a score_mod's float aux arrays). `forward`/`backward` get `mods=` only when
    # the call has some.
    runs_mods: frozenset = frozenset()
    # Whether its backward takes a row that sees one key to have P = 1 exactly; such a backend
    # gets `lse_has_sinks=True` with a call's sinks (its lse then holds more than the keys).
    one_key_shortcut: bool = False
    # Whether it runs attention dropout (`varlen.dropout`); `forward`/`backward` get
    # `dropout=` only when the call has some.
    runs_dropout: bool = False

    @abc.abstractmethod
    def supports(self, call) -> str | None:
        """None when this backend can run `call` (a `Problem` or the setup record), else the
        reason it cannot, as a phrase that completes "backend X cannot run this call: ..."."""

    def supports_mods(self, call) -> str | None:
        """None when this backend runs the call's mask_mod / score_mod (`call.mods`), else why
        not. By default from `runs_mods`; a backend with finer limits overrides it."""
        mods = getattr(call, "mods", None)
        if not mods:
            return None
        wanted = (("mask_mod", mods.mask is not None), ("score_mod", mods.score is not None),
                  ("aux_grads", mods.aux_grads))
        missing = [n for n, on in wanted if on and n not in self.runs_mods]
        if missing:
            what = {"mask_mod": "a mask_mod", "score_mod": "a score_mod",
                    "aux_grads": "gradients of a score_mod's aux arrays"}
            return f"it does not run {' or '.join(what[n] for n in missing)}"
        return None

    def supports_dropout(self, call) -> str | None:
        """None when this backend runs the call's dropout (`call.dropout`), else why not."""
        if getattr(call, "dropout", None) is None or self.runs_dropout:
            return None
        return "it does not run attention dropout (dropout_p > 0)"

    def default_blocks(self, dtype: str, head_dim: int) -> tuple[int, int]:
        """`(block_m, block_n)` of the plans this backend builds for a call."""
        return 64, 64

    def can_plan(self, on_device: bool) -> str | None:
        """None when this backend builds plans of layout arrays that live on a device
        (`on_device`) or on the host, else why not (`varlen.plan(..., backend=...)`). By
        default: host arrays, by array code."""
        if on_device:
            return f"the {self.name} backend builds plans of host arrays; cu_seqlens live on a device"
        return None

    def make_plan(self, q: Segments, k: Segments, mask, *, block_m: int, block_n: int,
                  max_seqlen_q=None, max_seqlen_k=None) -> Plan:
        """A plan over these segments, built where the segments live (array code by default;
        a backend may build it with its own kernels)."""
        return build_plan(q, k, mask, block_m=block_m, block_n=block_n,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)

    def plan_from_cu_seqlens(self, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                             num_rows_q: int, num_rows_k: int, mask, *, block_m: int,
                             block_n: int, max_seqlen_q=None, max_seqlen_k=None) -> Plan:
        """A plan of a single-process layout: one segment per sequence of each side
        (`plan.layout_segments`), then `make_plan`. A backend may build both at once."""
        return self.make_plan(
            *layout_segments(cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k,
                             num_rows_q, num_rows_k), mask,
            block_m=block_m, block_n=block_n, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k)

    def check_plan(self, plan: Plan) -> str | None:
        """None when this backend can run `plan` (its tiles, where its arrays live)."""
        return None

    @abc.abstractmethod
    def forward(self, plan: Plan, q, k, v, *, softmax_scale: float, softcap: float):
        """`(out [Tq, Hq, Dv] in q's dtype, lse [Hq, Tq])`; pad rows 0 and -inf."""

    @abc.abstractmethod
    def backward(self, plan: Plan, dout, q, k, v, out, lse, *, softmax_scale: float,
                 softcap: float, deterministic: bool = False):
        """`(dq, dk, dv)` in the input dtype; pad rows and unseen keys 0."""

    def __repr__(self):
        return f"<varlen backend {self.name!r}>"
