"""Arrays in from NumPy, PyTorch, JAX and CuPy; results back in the caller's type and device."""
import contextlib

import numpy as np
import pytest

import varlen

from helpers import check_against_reference, make_batch, np_dtype

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

DTYPES = ["float16", "bfloat16", "float32", "float64"]
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float64": torch.float64}


def _batch(dtype):
    rng = np.random.default_rng(11)
    mask = varlen.Mask.causal_where(np.array([True, False, True]))
    return make_batch(rng, [5, 0, 12], [7, 3, 12], Hq=4, Hk=2, D=8, dtype=dtype, mask=mask,
                      gaps=True)


def _to_torch(a):
    if a.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _from_torch(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np_dtype("bfloat16"))
    return t.numpy()


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cpu_round_trip(dtype):
    b = _batch(dtype)
    t = [_to_torch(x) for x in (b.q, b.k, b.v, b.dout)]
    meta = dict(seq_offsets_q=torch.from_numpy(b.off_q), seq_offsets_k=torch.from_numpy(b.off_k),
                mask=varlen.Mask.causal_where(torch.tensor([True, False, True])))
    cu_q, cu_k = torch.from_numpy(b.cu_q), torch.from_numpy(b.cu_k)
    out, lse = varlen.attention_forward(*t[:3], cu_q, cu_k, **meta)
    assert isinstance(out, torch.Tensor) and out.dtype == TORCH[dtype]
    assert out.device.type == "cpu" and tuple(out.shape) == b.q.shape[:2] + (b.v.shape[2],)
    assert lse.dtype == (torch.float64 if dtype == "float64" else torch.float32)
    grads = varlen.attention_backward(t[3], *t[:3], out, lse, cu_q, cu_k, **meta)
    assert all(isinstance(g, torch.Tensor) and g.dtype == TORCH[dtype] for g in grads)
    check_against_reference(b, _from_torch(out), lse.numpy(), [_from_torch(g) for g in grads],
                            label=f"torch/{dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_cpu_round_trip(dtype):
    # float64 arrays exist in JAX only with 64-bit types enabled
    with (jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()):
        _jax_round_trip(dtype)


def _jax_round_trip(dtype):
    b = _batch(dtype)
    arrays = [jnp.asarray(x) for x in (b.q, b.k, b.v, b.dout)]
    meta = dict(seq_offsets_q=jnp.asarray(b.off_q), seq_offsets_k=jnp.asarray(b.off_k),
                mask=varlen.Mask.causal_where(jnp.asarray([True, False, True])))
    out, lse = varlen.attention_forward(*arrays[:3], jnp.asarray(b.cu_q), jnp.asarray(b.cu_k),
                                        **meta)
    assert isinstance(out, jax.Array) and out.dtype == jnp.dtype(dtype)
    grads = varlen.attention_backward(arrays[3], *arrays[:3], out, lse, jnp.asarray(b.cu_q),
                                      jnp.asarray(b.cu_k), **meta)
    assert all(isinstance(g, jax.Array) for g in grads)
    check_against_reference(b, np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads],
                            label=f"jax/{dtype}")


def test_mixed_host_and_device_are_refused_by_name():
    class FakeCuda:
        """A DLPack producer that claims to live on CUDA device 0."""

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kw):
            raise AssertionError("must not be read")

    q = np.zeros((4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="k is on a CUDA device but q is on the host"):
        varlen.attention_forward(q, FakeCuda(), q, np.array([0, 4], np.int32),
                                 np.array([0, 4], np.int32))


def test_generic_dlpack_producer_on_host():
    class Wrapped:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    b = _batch("float32")
    out, lse = varlen.attention_forward(Wrapped(b.q), Wrapped(b.k), Wrapped(b.v), b.cu_q,
                                        b.cu_k, **b.layout)
    check_against_reference(b, out, lse, label="dlpack")


@pytest.mark.gpu
def test_cupy_and_torch_cuda_stay_on_device():
    cp = pytest.importorskip("cupy")
    b = _batch("float32")
    out, lse = varlen.attention_forward(*(cp.asarray(x) for x in (b.q, b.k, b.v)),
                                        cp.asarray(b.cu_q), cp.asarray(b.cu_k),
                                        seq_offsets_q=cp.asarray(b.off_q),
                                        seq_offsets_k=cp.asarray(b.off_k),
                                        mask=varlen.Mask.causal_where(cp.asarray([1, 0, 1])))
    assert isinstance(out, cp.ndarray)
    check_against_reference(b, out.get(), lse.get(), label="cupy")
    tq = [torch.from_numpy(x).cuda() for x in (b.q, b.k, b.v)]
    out_t, _ = varlen.attention_forward(*tq, torch.from_numpy(b.cu_q).cuda(),
                                        torch.from_numpy(b.cu_k).cuda(), **{
                                            **b.layout,
                                            "seq_offsets_q": torch.from_numpy(b.off_q).cuda(),
                                            "seq_offsets_k": torch.from_numpy(b.off_k).cuda(),
                                            "mask": varlen.Mask.causal_where(
                                                torch.tensor([1, 0, 1]).cuda())})
    assert out_t.is_cuda
