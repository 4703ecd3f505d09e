"""Drop-in entry points for code written against other attention libraries (PyTorch only).

* `varlen.integrations.flash_attn`: FlashAttention 2's `flash_attn_varlen_func` and
  `flash_attn_func` contract.
* `varlen.integrations.padding`: `unpad_input` / `pad_input` as in FlashAttention's
  `bert_padding`, and `cu_seqlens_from_position_ids` for packed batches.
* `varlen.integrations.transformers`: the Hugging Face transformers attention implementation
  named "varlen" (importing the module registers it; so does `register_transformers()`).

`varlen.torch` re-exports the public names, so `from varlen.torch import flash_attn_varlen_func`
is the usual spelling. `import varlen` imports none of this. See `docs/dropin.md`.
"""
from __future__ import annotations

__all__ = ["register_transformers"]


def register_transformers(name: str = "varlen") -> None:
    """Register varlen as the transformers attention implementation `name`.

    Afterwards `AutoModelForCausalLM.from_config(config, attn_implementation="varlen")` (or
    `model.set_attn_implementation("varlen")`) runs every attention layer through
    `varlen.torch.varlen_attention`. Needs `transformers` (the `[hf]` extra); registering twice
    is harmless. See `varlen.integrations.transformers`.
    """
    # Imported here so that `varlen.torch`, which re-exports this function, loads without
    # transformers installed.
    from .transformers import register
    register(name)
