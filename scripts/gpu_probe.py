#!/usr/bin/env python
"""The first step of scripts/gpu_check.sh: the versions of what the GPU steps use, and the
three calls most likely to fail first on a new machine, each answered in a line of its own
(and one JSON line in --json's file, written as it is known):

    python scripts/gpu_probe.py [--json results.jsonl] [--require-sm90]

  versions      python, numpy, CuPy, torch, cuda-bindings, ml_dtypes, NVRTC, the driver
  device        the GPU's name, compute capability and SMs (--require-sm90: anything but
                9.0 prints "not an sm_90 GPU" and exits 2)
  dlpack_bf16   a torch bfloat16 tensor into CuPy through DLPack (the dtype CuPy sees)
  tensor_map    the driver's cuTensorMapEncodeTiled through cuda-bindings, by varlen's own
                encode (`sm90.Runtime.tensor_map`), on [T, H, 128] arrays (float16 made by
                CuPy, bf16 from torch through DLPack) with boxes (64, 1, 128) and (64, 4, 32):
                the first opaque words of each, or which failed and why

Exit status 0 when every probe answered, 1 when one failed (each failure is printed).
Needs no installed varlen (it runs before the install step): the checkout is put on the path,
with its top-level comm/ and kernels_cuda/ under varlen as setup.cfg maps them.
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from gpu_timing import Results  # noqa: E402
from varlen._cli import ArgumentParser  # noqa: E402


def checkout_importable() -> None:
    """varlen.comm and varlen.kernels_cuda from this checkout's top-level folders when varlen
    is not installed (setup.cfg's package_dir mapping, by hand)."""
    import varlen
    for name in ("comm", "kernels_cuda"):
        try:
            importlib.import_module(f"varlen.{name}")
        except ImportError:
            module = importlib.import_module(name)
            sys.modules[f"varlen.{name}"] = module
            setattr(varlen, name, module)


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in ("numpy", "cupy", "torch", "ml_dtypes", "cuda.bindings"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001
            found[name] = f"unavailable: {type(e).__name__}: {e}"
    try:
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
        found["nvrtc"] = f"{major}.{minor}"
    except Exception as e:  # noqa: BLE001
        found["nvrtc"] = f"unavailable: {type(e).__name__}"
    try:
        from cuda.bindings import driver
        driver.cuInit(0)
        err, v = driver.cuDriverGetVersion()
        found["driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception as e:  # noqa: BLE001
        found["driver_api"] = f"unavailable: {type(e).__name__}"
    return found


def device() -> dict:
    import cupy
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    return {"name": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": dev.compute_capability,
            "sms": int(dev.attributes["MultiProcessorCount"])}


def dlpack_bf16() -> dict:
    import cupy
    import torch
    t = torch.arange(8, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    a = cupy.from_dlpack(t)
    back = torch.from_dlpack(a).float().cpu().tolist()
    if back != list(range(8)):
        raise AssertionError(f"the values came back as {back}")
    return {"cupy_dtype": str(a.dtype), "itemsize": int(a.dtype.itemsize)}


def tensor_map() -> dict:
    """Both boxes on a float16 CuPy array, then on a bf16 one from torch (so that a failure of
    the bf16 DLPack path alone still shows whether the encode itself works)."""
    import cupy
    import torch
    from varlen.backends.cupy import sm90
    rt = sm90.Runtime()
    words, errors = {}, []
    arrays = (("float16", lambda: cupy.zeros((300, 8, 128), cupy.float16)),
              ("bfloat16", lambda: cupy.from_dlpack(
                  torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16))))
    for dtype, make in arrays:
        try:
            a = make()
            for rows, heads in ((128, 1), (32, 4)):
                m = rt.tensor_map(a, rows, heads)
                words[f"{dtype}_box_64x{heads}x{rows}"] = [hex(int(w)) for w in m["opaque"][:4]]
        except Exception as e:  # noqa: BLE001
            errors.append(f"{dtype}: {type(e).__name__}: {e}")
    if errors:
        raise RuntimeError("; ".join(errors) + (f" (encoded: {sorted(words)})" if words else ""))
    return words


PROBES = (("device", device), ("dlpack_bf16", dlpack_bf16), ("tensor_map", tensor_map))


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="append one JSON line per probe to this file")
    ap.add_argument("--require-sm90", action="store_true",
                    help="exit 2 unless the GPU has compute capability 9.0")
    args = ap.parse_args(argv)
    checkout_importable()
    out = Results(args.json)
    found = versions()
    for k, v in found.items():
        print(f"version {k}: {v}", flush=True)
    out.write(kind="probe", probe="versions", ok=True, **found)
    failed = 0
    for name, fn in PROBES:
        try:
            answer = fn()
        except Exception as e:  # noqa: BLE001
            failed += 1
            traceback.print_exc()
            print(f"probe {name}: FAILED: {type(e).__name__}: {e}", flush=True)
            out.write(kind="probe", probe=name, ok=False, error=f"{type(e).__name__}: {e}")
            continue
        print(f"probe {name}: ok {answer}", flush=True)
        out.write(kind="probe", probe=name, ok=True, **answer)
        if name == "device" and args.require_sm90 and answer["compute_capability"] != "90":
            print(f"not an sm_90 GPU: compute capability {answer['compute_capability']}; the "
                  "sm_90a kernels need 9.0", flush=True)
            return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
