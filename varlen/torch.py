"""PyTorch adapter: `varlen_attention`, a differentiable `torch.library` custom op.

    import varlen.torch
    out = varlen.torch.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, mask="causal")
    out.sum().backward()

Two custom ops carry the work, `torch.ops.varlen.attention_forward` and
`torch.ops.varlen.attention_backward`; both call the validated public functions
(`varlen.attention_forward` / `varlen.attention_backward`), whose setup step checks the call, and
hold no attention math. The wrapper only turns its arguments into what the op schema takes
(tensors, the mask split into tensors and ints, plain scalars, a plan key, and a MaskMod or
ScoreMod as the text of its graph beside a list of its aux tensors, whose float ones get
gradients when they require grad); the fake
implementations run the setup step's data-free checks, so a bad call fails while
`torch.compile(fullgraph=True)` traces it, and give the output shapes and dtypes.

CPU tensors run on a host backend, `cpu` by default (`numpy` for float64 or without the `[cpu]`
extra), zero-copy through `Tensor.numpy()`; CUDA tensors on the
fastest GPU backend, on the tensor's device and PyTorch's current stream (which the core API
makes CuPy's current stream), so the call is ordered with the surrounding PyTorch work and never
synchronises the host. See `docs/frameworks.md`.
"""
from __future__ import annotations

from ._torch_ops import context_parallel_attention, draw_seed, varlen_attention
# Drop-in names: FlashAttention 2's functions and padding helpers, the transformers backend
# (varlen/integrations/, docs/dropin.md).
from .integrations import register_transformers
from .integrations.flash_attn import flash_attn_func, flash_attn_varlen_func
from .integrations.padding import cu_seqlens_from_position_ids, pad_input, unpad_input

__all__ = ["varlen_attention", "context_parallel_attention", "flash_attn_varlen_func",
           "flash_attn_func", "unpad_input", "pad_input", "cu_seqlens_from_position_ids",
           "register_transformers", "draw_seed"]
