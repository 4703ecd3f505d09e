"""The batches the host emulation runs the CuPy kernels on (`python -m
varlen.backends._cupy_emulation [--quick]`): each a dict of `run_case`'s arguments."""
from __future__ import annotations

import numpy as np


from ..masks import Mask


def cases(quick: bool):
    per_seq = Mask(window_left=np.array([-1, 3, -1, 0, 5, -1, 40], np.int32),
                   window_right=np.array([0, -1, -1, 0, 0, 2, -1], np.int32),
                   bottom_right=np.array([0, 0, 1, 1, 0, 1, 1], np.int32))
    small = dict(label="B3-gqa-perseq-gaps-fp16-D64", lengths_q=[0, 70, 5],
                 lengths_k=[3, 66, 9], Hq=2, Hk=1, D=64, dtype="float16",
                 mask=Mask(window_left=np.array([-1, 20, -1], np.int32),
                           window_right=np.array([0, -1, 0], np.int32),
                           bottom_right=np.array([0, 1, 1], np.int32)),
                 gaps=True, softcap=0.0, block_m=64)
    if quick:
        return [small]
    return [small,
            dict(label="B7-perseq-bf16-D128-BM128", lengths_q=[0, 9, 1, 200, 0, 97, 2],
                 lengths_k=[4, 9, 3, 129, 1, 0, 150], Hq=4, Hk=2, D=128, dtype="bfloat16",
                 mask=per_seq, gaps=True, softcap=0.0, block_m=128),
            dict(label="B2-softcap-bf16-D64-BM128", lengths_q=[40, 130], lengths_k=[140, 1],
                 Hq=2, Hk=2, D=64, dtype="bfloat16", mask="full", gaps=False, softcap=5.0,
                 block_m=128),
            dict(label="B3-mqa-causal_br-fp16-D128", lengths_q=[1, 97, 113],
                 lengths_k=[30, 3, 200], Hq=2, Hk=1, D=128, dtype="float16",
                 mask="causal_bottom_right", gaps=True, softcap=0.0, block_m=64)]
