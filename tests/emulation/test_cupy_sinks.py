"""Attention sinks on the CuPy kernels, on a CPU: the mma.sync forward and backward (both dQ
modes) and the sm_90a forward and backward run through the host emulation (each case in its
own process, as the emulation replaces `cupy`), the sinks joined and their gradient taken as
the public API does it (`varlen._sinks`), against the float64 reference with the STYLE.md
tolerances. The backward kernels get the lse with the sinks in: rows that see one key (a
window of 0) and rows that see none (Lq > Lk bottom-right, a sequence without keys) must come
out right, padding rows untouched.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from helpers import emulate_script, needs_cxx


def _case(impl, dtype, deterministic):
    import varlen
    import emulation.cupy as emu
    from varlen._sinks import add_sinks, sink_grads
    from varlen.backends.cupy import BACKEND
    from varlen.testing import check_against_reference, make_batch
    emu.install_fake_cupy(64, 64)
    if impl == "sm90a":
        import emulation.sm90
        emulation.sm90.install()
    backend = BACKEND.implementation(impl)
    mask = varlen.Mask(window_left=np.array([-1, 0, 3, -1], np.int32), window_right=0,
                       bottom_right=np.array([True, False, False, True]))
    b = make_batch(np.random.default_rng(6), [3, 1, 70, 20], [0, 1, 70, 9], Hq=4, Hk=2, D=64,
                   dtype=dtype, mask=mask, gaps=True)
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k, mask=mask,
                       num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0], block_m=64,
                       block_n=64)
    sinks = np.array([0.5, -np.inf, 7.0, -2.0], np.float32)
    kw = dict(softmax_scale=1.0 / math.sqrt(64), softcap=0.0)
    valid = plan.q.covered()
    out, lse = add_sinks(*backend.forward(plan, b.q, b.k, b.v, **kw), sinks, valid)
    flag = {"lse_has_sinks": True} if backend.one_key_shortcut else {}
    grads = backend.backward(plan, b.dout, b.q, b.k, b.v, out, lse,
                             deterministic=deterministic == "True", **kw, **flag)
    dsinks = sink_grads(b.dout, out, lse, sinks, valid)
    label = f"{impl} {dtype} deterministic={deterministic} (emulated)"
    check_against_reference(b, out, lse, tuple(grads) + (dsinks,), sinks=sinks, label=label)
    varlen.check_device_errors()
    print(f"ok {label}")


def _main(argv):
    _case(*argv)
    return 0


@pytest.mark.smoke
@needs_cxx
def test_mma_sinks():
    _emulate("mma", "float16", "False")


@needs_cxx
@pytest.mark.parametrize("impl, dtype, deterministic", [
    pytest.param("mma", "bfloat16", "True", id="mma-bf16-ordered"),
    pytest.param("sm90a", "bfloat16", "False", id="sm90a-bf16"),
])
def test_sinks(impl, dtype, deterministic):
    _emulate(impl, dtype, deterministic)


def _emulate(*case):
    emulate_script(__file__, *case, timeout=900)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
