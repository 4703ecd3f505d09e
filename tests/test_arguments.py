"""The data-free checks: one function for every framework, reading `.shape` and `.dtype` only
(NumPy, PyTorch real, fake and meta tensors, JAX arrays and tracers, lists), so the setup step
and both adapters raise the same errors."""
import numpy as np
import pytest

from varlen import Mask
from varlen._validate import Spec, check_qkv, check_specs, spec_of

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy


def test_spec_of_every_framework():
    want = Spec((4, 2, 8), "bfloat16", "f", "torch", "cpu")
    assert spec_of(torch.zeros(4, 2, 8, dtype=torch.bfloat16), "q") == want
    assert spec_of(torch.empty(4, 2, 8, dtype=torch.bfloat16, device="meta"), "q") == \
        Spec((4, 2, 8), "bfloat16", "f", "torch", "meta")
    assert spec_of(jnp.zeros((4, 2, 8), jnp.bfloat16), "q") == \
        Spec((4, 2, 8), "bfloat16", "f", "jax", None)
    assert spec_of(np.zeros(3, np.uint32), "cu") == Spec((3,), "uint32", "u", "numpy", "cpu")
    assert spec_of([0, 2, 5], "cu").kind == "i" and spec_of([0, 2, 5], "cu").framework == "numpy"
    assert spec_of(torch.zeros(3, dtype=torch.float8_e4m3fn), "q").dtype == "float8_e4m3fn"
    with pytest.raises(TypeError, match="cu must be an array"):
        spec_of("0, 2, 5", "cu")


def test_spec_of_fake_tensors_and_tracers_reads_no_data():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(5, 3, 16)
    assert spec_of(fake, "q") == Spec((5, 3, 16), "float32", "f", "torch", "cpu")
    seen = []
    jax.jit(lambda x: seen.append(spec_of(x, "q")) or x)(jnp.zeros((5, 3, 16)))
    assert seen == [Spec((5, 3, 16), "float32", "f", "jax", None)]


def _arrays(make, int32):
    return (make((6, 2, 8)), make((6, 1, 8)), make((6, 1, 8)), int32([0, 2, 6]))


FRAMEWORKS = {
    "numpy": lambda: _arrays(lambda s: np.zeros(s, np.float32),
                             lambda x: np.asarray(x, np.int32)),
    "torch": lambda: _arrays(torch.zeros, lambda x: torch.tensor(x, dtype=torch.int32)),
    "torch-meta": lambda: _arrays(lambda s: torch.empty(s, device="meta"),
                                  lambda x: torch.empty(len(x), dtype=torch.int32,
                                                        device="meta")),
    "jax": lambda: _arrays(jnp.zeros, lambda x: jnp.asarray(x, jnp.int32)),
}

BAD = {
    "q-2d": (lambda q, k, v, cu: ((q.reshape(6, 16), k, v, cu, cu), {}), ValueError,
             r"q must be 3-D \[T, H, D\] \(packed THD layout\), got shape \(6, 16\)"),
    "cu-k-length": (lambda q, k, v, cu: ((q, k, v, cu, cu[:2]), {}), ValueError,
                    r"cu_seqlens_q has 3 entries and cu_seqlens_k 2"),
    "offsets-length": (lambda q, k, v, cu: ((q, k, v, cu, cu), dict(seq_offsets_k=cu[:2])),
                       ValueError, r"seq_offsets_k has 2 entries; expected 3"),
    "mask-shape": (lambda q, k, v, cu: ((q, k, v, cu, cu), dict(mask=Mask(window_left=cu))),
                   ValueError, r"mask.window_left has shape \(3,\); expected a scalar or \[2\]"),
    "heads": (lambda q, k, v, cu: ((k, q, q, cu, cu), {}), ValueError,
              r"q has 1 heads and k has 2"),
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_check_specs_says_the_same_for_every_framework(framework, bad):
    change, exc, match = BAD[bad]
    args, kw = change(*FRAMEWORKS[framework]())
    with pytest.raises(exc, match=match):
        check_specs(*args, **kw)


def test_check_specs_returns_the_batch_size():
    q, k, v, cu = FRAMEWORKS["torch-meta"]()
    assert check_specs(q, k, v, cu, cu, mask=Mask(window_right=cu[:2])) == 2


def test_data_arrays_come_from_one_framework_and_device():
    q = torch.zeros(6, 2, 8)
    k = np.zeros((6, 1, 8), np.float32)
    with pytest.raises(TypeError, match="k is a numpy array but q is a torch array"):
        check_qkv(q, k, k)
    meta = torch.empty(6, 1, 8, device="meta")
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        check_qkv(q, meta, meta)
