"""varlen: packed variable-length ("THD") attention.

    import varlen
    out, lse = varlen.attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, mask="causal")

Arrays come from and go back to NumPy, PyTorch, JAX or CuPy through DLPack. See
`docs/semantics.md` for the contract every backend meets.
"""
from ._api import attention, attention_backward, attention_forward, plan
from ._array import set_nan_fill
from ._device_errors import check_device_errors
from ._validate import set_validation
from .masks import Mask, dense_mask, padding_mask
from .mods import MaskMod, ScoreMod, exp, log, maximum, minimum, sqrt, tanh, where
from .plan import Plan, Segments
from . import backends, reference

__version__ = "0.1.0"

__all__ = ["attention_forward", "attention_backward", "attention", "Mask", "plan", "Plan",
           "Segments", "padding_mask", "dense_mask", "set_validation", "set_nan_fill",
           "reference", "check_device_errors", "backends", "__version__", "MaskMod", "ScoreMod",
           "where", "exp", "log", "tanh", "sqrt", "minimum", "maximum"]
