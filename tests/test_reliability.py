"""Regression tests of the second reliability pass: each test names the defect it guards
against and fails without its fix."""
from __future__ import annotations

import numpy as np
import pytest

import varlen


def _batch(T=5, H=2, D=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((T, H, D)).astype(dtype) for _ in range(3))


# ---- silent wrong answers --------------------------------------------------------------------

@pytest.mark.parametrize("where", ["cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q",
                                   "mask.window_left"])
def test_torch_metadata_on_the_meta_device_is_refused(where):
    """Metadata on the meta device with CPU data made the custom op dispatch to its fake
    implementation: uninitialised memory came back with no error."""
    torch = pytest.importorskip("torch")
    import varlen.torch as vt
    q, k, v = (torch.from_numpy(x) for x in _batch())
    cu = torch.tensor([0, 5], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    if where.startswith("mask."):
        kw["mask"] = varlen.Mask(window_left=torch.tensor([2], dtype=torch.int32,
                                                          device="meta"))
    else:
        kw[where] = cu.to("meta")
    with pytest.raises(TypeError, match=rf"{where} is on device meta but q is on cpu"):
        vt.varlen_attention(q, k, v, **kw)
    if where.startswith("cu_seqlens"):
        with pytest.raises(TypeError, match=rf"{where} is on device meta"):
            vt.flash_attn_varlen_func(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], 5, 5)


def test_backward_refuses_dout_of_another_framework():
    """The forward refused torch k with NumPy q; the backward took a torch dout silently."""
    torch = pytest.importorskip("torch")
    q, k, v = _batch()
    cu = np.array([0, 5], np.int32)
    out, lse = varlen.attention_forward(q, k, v, cu, cu)
    with pytest.raises(TypeError, match=r"k is a torch array but q is a numpy array"):
        varlen.attention_forward(q, torch.from_numpy(k), v, cu, cu)
    for name, args in (("dout", (torch.from_numpy(np.ones_like(out)), q, k, v, out, lse)),
                       ("out", (np.ones_like(out), q, k, v, torch.from_numpy(out), lse)),
                       ("lse", (np.ones_like(out), q, k, v, out, torch.from_numpy(lse)))):
        with pytest.raises(TypeError, match=rf"{name} is a torch array but q is a numpy "
                                            r"array; pass the data arrays from one framework"):
            varlen.attention_backward(*args, cu, cu)
