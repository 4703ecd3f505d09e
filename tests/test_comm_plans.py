"""Step plans of context-parallel calls: built once per rank, partition, mask, method and
backend tiles, reused by forward, backward and every layer; `plan=` hands them to the user."""
import re
from types import SimpleNamespace

import numpy as np
import pytest

import varlen
import varlen.comm as vc
from varlen.backends.numpy_backend import NumpyBackend
from varlen.comm.plans import _cacheable, check_step_plans, mask_key

from comm_workers.cases import CASES, make_global

CASE = CASES[1]                          # mixed causal/full sequences, GQA, a zero length
PER_RANK = {"ring": lambda cp: cp, "allgather": lambda cp: 1, "ulysses": lambda cp: 1}


def _steps(part, rank, **kw):
    """`vc.plan` for CASE's data on the NumPy backend."""
    return vc.plan(part, rank, dtype="float64", head_dim=CASE.D, backend="numpy", **kw)


@pytest.fixture
def builds(monkeypatch):
    """The number of plans built so far (every rank, every thread)."""
    made = []
    make_plan = NumpyBackend.make_plan
    monkeypatch.setattr(NumpyBackend, "make_plan",
                        lambda *a, **kw: made.append(1) or make_plan(*a, **kw))
    return lambda: len(made)


def _layers(part, g, n_layers, **kw):
    """Forward and backward of `n_layers` layers on every rank; returns rank 0's grads."""
    kw.setdefault("backend", "numpy")

    def body(grp):
        q, k, v, do = (part.shard(g[x], grp.rank) for x in ("q", "k", "v", "dout"))
        for _ in range(n_layers):
            out, lse = vc.attention_forward(q, k, v, part, grp, **kw)
            grads = vc.attention_backward(do, q, k, v, out, lse, part, grp, **kw)
        return grads
    return vc.local_group(part.cp_size).run(body)[0]


@pytest.mark.parametrize("method", vc.METHODS)
def test_plans_are_built_once_per_rank_and_reused(builds, method):
    cp = 2
    g = make_global(CASE)
    part = vc.partition(g["cu_q"], cp)
    _layers(part, g, 2, mask=CASE.mask, method=method)         # forward + backward, 2 layers
    once = cp * PER_RANK[method](cp)
    assert builds() == once, f"{builds()} plans built; expected {once} (once per rank)"
    _layers(part, g, 1, mask="causal", method=method)         # another mask: new plans
    assert builds() == 2 * once
    _layers(part, g, 1, mask=CASE.mask, method=method)        # the first mask: still cached
    assert builds() == 2 * once
    _layers(vc.partition(g["cu_q"], cp), g, 1, mask=CASE.mask, method=method)
    assert builds() == 3 * once, "a new partition must get its own plans"


def test_plan_handle_is_used_as_given(builds):
    cp = 2
    g = make_global(CASE)
    part = vc.partition(g["cu_q"], cp)
    kw = dict(mask=CASE.mask, method="ring")
    steps = [_steps(part, r, **kw) for r in range(cp)]
    assert builds() == cp * cp
    assert all(isinstance(s, vc.StepPlans) and len(s.plans) == cp for s in steps)

    def body(grp):
        q, k, v, do = (part.shard(g[x], grp.rank) for x in ("q", "k", "v", "dout"))
        out, lse = vc.attention_forward(q, k, v, part, grp, plan=steps[grp.rank],
                                        backend="numpy", **kw)
        return vc.attention_backward(do, q, k, v, out, lse, part, grp, plan=steps[grp.rank],
                                     backend="numpy", **kw)
    with_plan = vc.local_group(cp).run(body)[0]
    assert builds() == cp * cp, "calls with plan= built plans of their own"
    fresh = _layers(vc.partition(g["cu_q"], cp), g, 1, **kw)
    for a, b in zip(with_plan, fresh):
        np.testing.assert_array_equal(a, b)


def _plan_errors(wrong_plan, **kw):
    """Forward on both ranks, rank 0 with `plan=wrong_plan(part, 0)`, rank 1 with its own
    plans; returns each rank's error."""
    g = make_global(CASE)
    part = vc.partition(g["cu_q"], 2)
    plans = [wrong_plan(part, 0), _steps(part, 1, mask=CASE.mask)]

    def body(grp):
        q, k, v = (part.shard(g[x], grp.rank) for x in ("q", "k", "v"))
        try:
            vc.attention_forward(q, k, v, part, grp, plan=plans[grp.rank], **kw)
        except (ValueError, TypeError) as e:
            return e
        return None
    return vc.local_group(2).run(body)


@pytest.mark.parametrize("wrong_plan, exc, match", [
    (lambda part, r: _steps(vc.partition(part.cu_seqlens, 2), r, mask=CASE.mask),
     ValueError, r"another Partition object"),
    (lambda part, r: _steps(part, r, mask="causal"), ValueError, r"mask \("),
    (lambda part, r: _steps(part, 1 - r, mask=CASE.mask), ValueError, r"rank \("),
    (lambda part, r: _steps(part, r, mask=CASE.mask, method="allgather"),
     ValueError, r"method \('allgather' in the plan, 'ring' in the call\)"),
    (lambda part, r: [], TypeError, r"plan must be this rank's step plans"),
], ids=["partition", "mask", "rank", "method", "type"])
def test_plan_for_another_call_is_refused_on_every_rank(wrong_plan, exc, match):
    errs = _plan_errors(wrong_plan, mask=CASE.mask, backend="numpy")
    assert isinstance(errs[0], exc) and re.search(match, str(errs[0])), errs[0]
    assert isinstance(errs[1], ValueError) and "rank 0 rejected its inputs" in str(errs[1])


def test_plan_arguments_are_checked():
    part = vc.partition(np.array([0, 5, 9], np.int32), 2)
    with pytest.raises(ValueError, match="method='tree'"):
        vc.plan(part, 0, dtype="float32", head_dim=8, method="tree")
    with pytest.raises(ValueError, match="rank must be"):
        vc.plan(part, 2, dtype="float32", head_dim=8)
    with pytest.raises(TypeError, match="dtype='int8'"):
        vc.plan(part, 0, dtype="int8", head_dim=8)
    with pytest.raises(ValueError, match="head_dim must be"):
        vc.plan(part, 0, dtype="float32", head_dim=0)
    with pytest.raises(TypeError, match="part must be"):
        vc.plan("zigzag", 0, dtype="float32", head_dim=8)


def test_host_plans_for_device_data_are_refused():
    part = vc.partition(np.array([0, 5, 9], np.int32), 2)
    steps = vc.plan(part, 0, dtype="float32", head_dim=8)
    device_part = SimpleNamespace(xp=object())          # only where its metadata lives is read
    with pytest.raises(ValueError, match="plan lives on the host but the data on a CUDA "
                                         "device.*on_device=True"):
        check_step_plans(steps, parts=(device_part, device_part), rank=0, method="ring",
                         backend=varlen.backends.get("numpy"), blocks=(64, 64),
                         mask=varlen.Mask(), validate=False)


def test_masks_with_device_arrays_are_not_cached():
    device_array = SimpleNamespace(shape=(3,))          # not NumPy: its values are not read
    key = mask_key(SimpleNamespace(fields=lambda: (-1, device_array, 0)), 3)  # a working mask
    assert key[1] == ("device", (3,)) and not _cacheable(key)
    host = mask_key(varlen.Mask(window_right=np.array([0, -1, 0], np.int32)), 3)
    assert isinstance(host[1], int) and _cacheable(host)
    # a policy written per sequence is the policy written once
    assert mask_key(varlen.Mask(window_right=np.zeros(3, np.int32)), 3) == \
        mask_key(varlen.Mask(window_right=0), 3)
