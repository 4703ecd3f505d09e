"""Array interop: DLPack in, DLPack out, for NumPy, PyTorch, JAX and CuPy.

Every public entry point turns its inputs into *working arrays* (NumPy on the host, CuPy on a
CUDA device) with `to_working`, and hands results back with `Origin.wrap`, which rebuilds the
caller's array type on the caller's device. bfloat16 travels as its 16-bit pattern where a
framework's DLPack cannot carry it (NumPy's), and becomes `ml_dtypes.bfloat16` on the host.

Heavy frameworks are imported lazily: only when an input comes from them.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["Origin", "to_working", "array_module", "alloc", "HostBlocks", "host_blocks", "digest",
           "set_nan_fill", "nan_fill_enabled", "bfloat16_dtype", "is_device_array"]

# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def bfloat16_dtype():
    """`ml_dtypes.bfloat16` as a NumPy dtype, or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _is_bf16(dtype) -> bool:
    bf = bfloat16_dtype()
    return bf is not None and np.dtype(dtype) == bf


# --------------------------------------------------------------------------------------------
# NaN-filled fresh buffers (test mode)
# --------------------------------------------------------------------------------------------

_NAN_FILL = os.environ.get("VARLEN_NAN_FILL", "0") not in ("", "0")


def set_nan_fill(enabled: bool) -> bool:
    """Fill every freshly allocated output buffer with NaN (test mode). Returns the old value.

    With this on, a kernel or backend that forgets to write a row (a pad row, a fully masked
    query) leaves NaN behind, and the tests see it.
    """
    global _NAN_FILL
    old, _NAN_FILL = _NAN_FILL, bool(enabled)
    return old


def digest(a, batch: int):
    """A cheap host fingerprint of per-sequence metadata: a scalar or host array is the crc32 of
    its int32 values broadcast to `[batch]` (so `0` and `zeros(B)` agree); a device array
    contributes `("device", shape)`, its values unread (no synchronisation)."""
    if isinstance(a, (bool, int, np.integer, np.bool_, np.ndarray)):
        v = np.asarray(a, np.int32)
        v = np.broadcast_to(v, (batch,)) if v.ndim == 0 else v
        return zlib.crc32(np.ascontiguousarray(v).tobytes())
    return ("device", tuple(a.shape))


def nan_fill_enabled() -> bool:
    return _NAN_FILL


def alloc(xp, shape, dtype, fill=None, *, cached: bool = False):
    """The one allocator of the library's buffers (NumPy or CuPy, outputs and workspaces).

    `fill=None` gives an uninitialised buffer, NaN-filled in test mode so that an unwritten
    element shows; otherwise every element is `fill`. float16/bfloat16 zeros are written as
    their (identical) all-zero bit pattern, so no fill kernel depends on the element type.
    `cached=True` (NumPy only) takes the memory from `host_blocks`: a block of an earlier
    array that is gone, its pages already mapped (see `HostBlocks`).
    """
    dtype = np.dtype(dtype)
    if cached and xp is np:
        out = host_blocks.empty(shape, dtype)
        if fill is None:
            if _NAN_FILL and (dtype.kind == "f" or _is_bf16(dtype)):
                out[...] = np.nan
        elif fill == 0 and dtype.itemsize == 2 and dtype.kind not in "iub":
            out.view(np.uint16)[...] = 0
        else:
            out[...] = fill
        return out
    if fill is None:
        if _NAN_FILL and (dtype.kind == "f" or _is_bf16(dtype)):
            return xp.full(shape, np.nan, dtype=dtype)
        return xp.empty(shape, dtype=dtype)
    if fill == 0 and dtype.itemsize == 2 and dtype.kind not in "iub":
        return xp.zeros(shape, dtype=np.uint16).view(dtype)
    return xp.full(shape, fill, dtype=dtype)


class _Anchor:
    """The owner a cached host array's memory is reached through: the base of the bytes the
    array views, reached from the array and every view of it, so it lives exactly as long as
    any of them."""

    __slots__ = ("__array_interface__", "block", "__weakref__")

    def __init__(self, block: np.ndarray):
        self.block = block
        self.__array_interface__ = {"shape": block.shape, "typestr": "|u1",
                                    "data": (block.ctypes.data, False), "version": 3}


class HostBlocks:
    """Host memory for arrays a call returns, reused once every array viewing it is gone.

    A fresh buffer of tens of MiB costs a page fault per page on its first write, every call,
    and faults taken by several threads of one process contend (they also scale worse than
    the arithmetic). Arrays of at least `min_bytes` are therefore views of a block whose
    `_Anchor` is their base: when the last array or view reaching it dies, the block (its
    pages still mapped) goes back to a free list of its size, for the next call that asks
    for that many bytes. At most `keep` free blocks per size and `limit` bytes in all are
    kept; `clear()` drops them. Blocks are never handed out while any array reaches them."""

    def __init__(self, min_bytes: int = 1 << 20, keep: int = 2, limit: int = 4 << 30):
        self.min_bytes, self.keep, self.limit = min_bytes, keep, limit
        self._free = {}
        self._free_bytes = 0
        # reentrant: a garbage collection inside a locked section may run a finalizer
        self._lock = threading.RLock()

    def empty(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(int(n) for n in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < self.min_bytes or dtype.hasobject:
            return np.empty(shape, dtype)
        with self._lock:
            blocks = self._free.get(nbytes)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._free_bytes -= nbytes
        if block is None:
            block = np.empty(nbytes, np.uint8)
        anchor = _Anchor(block)
        weakref.finalize(anchor, self._give_back, block).atexit = False
        return np.asarray(anchor).view(dtype).reshape(shape)

    def _give_back(self, block: np.ndarray):
        with self._lock:
            blocks = self._free.setdefault(block.nbytes, [])
            if len(blocks) < self.keep and self._free_bytes + block.nbytes <= self.limit:
                blocks.append(block)
                self._free_bytes += block.nbytes

    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes

    def clear(self):
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


host_blocks = HostBlocks()


# --------------------------------------------------------------------------------------------
# Framework detection and conversion
# --------------------------------------------------------------------------------------------

def _framework(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod in ("jax", "jaxlib"):
        return "jax"
    if mod == "cupy":
        return "cupy"
    if isinstance(x, np.generic):
        return "numpy"
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    return "python"


def is_device_array(x) -> bool:
    """True when `x` lives on a CUDA device (judged from its DLPack device, no data read)."""
    fw = _framework(x)
    if fw in ("numpy", "python"):
        return False
    if fw == "cupy":
        return True
    if fw == "torch":
        return x.device.type == "cuda"
    if fw == "jax":
        return any(d.platform == "gpu" for d in x.devices())
    return x.__dlpack_device__()[0] in (_DL_CUDA, _DL_CUDA_MANAGED)


def array_module(x):
    """NumPy or CuPy, whichever holds the working array `x`."""
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy


@dataclass(frozen=True)
class Origin:
    """Where a caller's arrays came from, so results can be handed back the same way."""

    framework: str                # numpy | torch | jax | cupy | dlpack | python
    on_device: bool = False       # lives on a CUDA device
    device: object = None         # framework device object (torch.device, jax Device)
    committed: bool = True        # JAX: placed on `device` explicitly (else JAX may move it)

    @staticmethod
    def of(x) -> "Origin":
        fw = _framework(x)
        if fw == "torch":
            return Origin("torch", x.device.type == "cuda", x.device)
        if fw == "jax":
            dev = next(iter(x.devices()))
            return Origin("jax", dev.platform == "gpu", dev, bool(getattr(x, "committed", True)))
        return Origin(fw, is_device_array(x))

    def stream_scope(self):
        """Make the caller's current CUDA stream CuPy's current stream for the call.

        PyTorch keeps its own current stream; kernels must run on it (no host sync, correct
        ordering with the caller's work). CuPy and JAX inputs need nothing: CuPy launches on its
        own current stream, and DLPack orders a JAX producer before it.
        """
        if self.framework != "torch" or not self.on_device:
            return contextlib.nullcontext()
        import cupy
        import torch
        ts = torch.cuda.current_stream(self.device)
        if hasattr(ts, "__cuda_stream__"):
            return cupy.cuda.Stream.from_external(ts)
        return cupy.cuda.ExternalStream(ts.cuda_stream, self.device.index or 0)

    def wrap(self, a):
        """Turn a working array (NumPy or CuPy) into the caller's array type and device."""
        if a is None:
            return None
        fw = self.framework
        if fw in ("numpy", "python", "dlpack"):
            return a
        if fw == "cupy":
            return a
        if fw == "torch":
            return _to_torch(a, self.device)
        if fw == "jax":
            return _to_jax(a, self.device, self.committed)
        raise AssertionError(fw)


def to_working(x, name: str):
    """Turn any supported array into a NumPy (host) or CuPy (device) working array.

    The result may share memory with `x`; callers never write into it.
    """
    fw = _framework(x)
    if fw == "numpy":
        return x if isinstance(x, np.ndarray) else np.asarray(x)
    if fw == "python":
        if isinstance(x, (list, tuple, int, float)):
            return np.asarray(x)
        raise TypeError(f"{name} must be an array (NumPy, PyTorch, JAX, CuPy or any DLPack "
                        f"producer), got {type(x).__name__}")
    if fw == "cupy":
        return x
    if fw == "torch":
        return _from_torch(x, name)
    if fw == "jax":
        return _from_jax(x, name)
    return _from_dlpack(x, name)


def _from_dlpack(x, name):
    dev = x.__dlpack_device__()[0]
    if dev in (_DL_CUDA, _DL_CUDA_MANAGED):
        import cupy
        return cupy.from_dlpack(x)
    if dev in (_DL_CPU, _DL_CUDA_HOST):
        return np.from_dlpack(x)
    raise TypeError(f"{name} lives on DLPack device type {dev}; expected CPU or CUDA")


def _from_torch(x, name):
    import torch
    if x.device.type == "cuda":
        import cupy
        if x.dtype == torch.bfloat16:
            _require_ml_dtypes(name)
        return cupy.from_dlpack(x.detach())
    if x.device.type != "cpu":
        raise TypeError(f"{name} is on torch device {x.device}; expected cpu or cuda")
    x = x.detach()
    if x.dtype == torch.bfloat16:
        # NumPy's DLPack cannot carry bfloat16: move the bit pattern, then reinterpret.
        bf16 = _require_ml_dtypes(name)
        return x.view(torch.int16).numpy().view(bf16)
    return x.numpy()


def _from_jax(x, name):
    dev = next(iter(x.devices()))
    if dev.platform == "gpu":
        import cupy
        return cupy.from_dlpack(x)
    # JAX keeps bfloat16 as ml_dtypes.bfloat16 on the host: np.asarray is zero-copy where it can be.
    return np.asarray(x)


def _require_ml_dtypes(name):
    bf = bfloat16_dtype()
    if bf is None:
        raise TypeError(f"{name} is bfloat16, which needs the ml_dtypes package on this path "
                        f"(pip install ml-dtypes)")
    return bf


def _to_torch(a, device):
    import torch
    if isinstance(a, np.ndarray):
        if _is_bf16(a.dtype):
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
        return t if device is None or device.type == "cpu" else t.to(device)
    return torch.from_dlpack(a)


def _to_jax(a, device, committed=True):
    """`a` as a JAX array on `device`, committed to it only if the caller's array was: an
    uncommitted result stays free to join a computation over other devices (`jax.shard_map`
    over a mesh), as the caller's own array was."""
    import jax
    if isinstance(a, np.ndarray):
        return jax.device_put(a, device if committed else None)
    return jax.dlpack.from_dlpack(a)


def common_origin(named_arrays) -> Origin:
    """The origin shared by the data arrays; mixing frameworks or host/device is an error."""
    origins = [(n, Origin.of(x)) for n, x in named_arrays if x is not None]
    first_name, first = origins[0]
    for n, o in origins[1:]:
        if o.on_device != first.on_device:
            where = lambda b: "a CUDA device" if b else "the host"  # noqa: E731
            raise ValueError(f"{n} is on {where(o.on_device)} but {first_name} is on "
                             f"{where(first.on_device)}; all arrays must live on one device")
    return first


def host_copy(x):
    """A NumPy copy of a working array (a device read: only for validation and tests)."""
    if isinstance(x, np.ndarray):
        return x
    return x.get()
