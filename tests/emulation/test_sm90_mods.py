"""A mask_mod in the sm_90a backward (kernels_cuda/bwd_sm90.cuh), through the host emulation,
beside the cases `emulation.sm90_cases` checks against the float64 reference (a prefix-LM with a
per-sequence aux array, a chunked-causal mask_mod ANDed with a causal Mask, D = 256; run by
tests/emulation/test_sm90_kernels.py, which also shows that they fail with the mask_mod
ignored): an aux index out of range is flagged, and raised by `varlen.check_device_errors()`,
as by the other kernels; one in range is not."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from helpers import emulate_script, needs_cxx

pytestmark = needs_cxx


def _reads_table(b, q_idx, k_idx, table):
    return (k_idx <= q_idx) & (table[q_idx] >= 0)


def _case_index_error():
    """The backward with a mask_mod reading table[q_idx] for queries 0 .. 11: a table of 12
    entries flags nothing, one of 8 is flagged (the forward's results do not matter here)."""
    import varlen
    from emulation import sm90 as emulated_sm90
    from emulation.cupy import install_fake_cupy
    from varlen.backends.cupy import sm90
    from varlen.backends.cupy.mods import MOD_INDEX_ERROR
    from varlen.mods import Mods
    from varlen.testing import make_batch
    install_fake_cupy(64, 64)
    emulated_sm90.install()
    lengths = [1, 12]
    b = make_batch(np.random.default_rng(3), lengths, Hq=2, Hk=1, D=64, dtype="float16",
                   mask="causal")
    plan = varlen.plan(b.cu_q, b.cu_k, mask="causal", block_m=64, block_n=64)
    out = np.zeros_like(b.q)
    lse = np.zeros((2, b.q.shape[0]), np.float32)
    kw = dict(softmax_scale=0.125, softcap=0.0)
    varlen.check_device_errors()
    for size, flagged in ((12, False), (8, True)):
        mods = Mods(mask=varlen.MaskMod(_reads_table, np.zeros(size, np.int32)) & "causal")
        sm90.backward(plan, b.dout, b.q, b.k, b.v, out, lse, mods=mods, **kw)
        if flagged:
            with pytest.raises(IndexError, match=MOD_INDEX_ERROR.split(";")[0][:40]):
                varlen.check_device_errors()
        else:
            varlen.check_device_errors()
    print("ok sm90a index error")


def test_out_of_range_aux_index_is_flagged():
    out = emulate_script(__file__, "index-error")
    assert "ok sm90a index error" in out


if __name__ == "__main__":
    {"index-error": _case_index_error}[sys.argv[1]]()
