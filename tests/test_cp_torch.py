"""`varlen.torch.context_parallel_attention`: outputs and gradients of every rank's shards
against the single-process `varlen.torch.varlen_attention` and the float64 reference, on
in-process ranks (gloo ranks and the torchrun training example:
tests/multiprocess/test_cp_torch_ranks.py)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import varlen  # noqa: E402
import varlen.comm as vc  # noqa: E402
import varlen.torch as vt  # noqa: E402

from comm_workers.torch_cp import Spec, check_bad_inputs, check_rank, resolved  # noqa: E402
from helpers import cases, covering  # noqa: E402

WINDOW = varlen.Mask(window_left=3, window_right=1)

SPECS = [
    Spec((7, 0, 13, 5), "ring", "causal"),
    Spec((7, 0, 13, 5), "ring", "full", Hk=1),
    Spec((11, 6), "ring", WINDOW, Hq=4, Hk=4),
    Spec((9, 4, 11, 1), "ring", None),
    Spec((7, 0, 13, 5), "allgather", "causal"),
    Spec((9, 4, 11, 1), "allgather", None, Hk=1),
    Spec((11, 6), "allgather", WINDOW),
    Spec((7, 0, 13, 5), "ulysses", "full"),
    Spec((9, 4, 11, 1), "ulysses", None, Hk=1),
    Spec((11, 6), "ulysses", WINDOW, Hq=8, Hk=2),
    Spec((5, 14, 3), "ring", "causal", dtype=torch.float64),
    Spec((5, 14, 3), "ulysses", None, dtype=torch.float64),
    # Document partitions: documents longer than 6 rows split, the others whole on one rank.
    Spec((5, 0, 13, 1, 8, 31, 3), "ring", "causal", max_doc_len=6),
    Spec((5, 0, 13, 1, 8, 31, 3), "ring", None, Hk=1, max_doc_len=6, slack=1.5),
    Spec((11, 6, 23, 2), "ring", WINDOW, Hq=4, Hk=4, max_doc_len=5),
    Spec((5, 0, 13, 1, 8, 31, 3), "allgather", None, max_doc_len=6),
    Spec((11, 6, 23, 2), "allgather", WINDOW, Hk=1, max_doc_len=5, slack=1.5),
    Spec((5, 0, 13, 1, 8, 31, 3), "ulysses", "full", Hk=1, max_doc_len=6, slack=1.5),
    Spec((11, 6, 23, 2), "ulysses", WINDOW, Hq=8, Hk=2, max_doc_len=5),
    Spec((5, 0, 13, 1, 8, 31, 3), "ring", None, dtype=torch.float64, max_doc_len=6),
]


def _id(spec, cp):
    m = {"causal": "causal", "full": "full"}.get(spec.mask) if isinstance(spec.mask, str) \
        else ("mixed" if spec.mask is None else "window")
    return (f"cp{cp}-T{sum(spec.lengths)}-B{len(spec.lengths)}-Hq{spec.Hq}-Hk{spec.Hk}-{m}-"
            f"{spec.method}-{str(spec.dtype)[6:]}-{spec.scheme}")


# every spec on 2 and 4 ranks; at the quick size every spec, and both sizes
COMBOS = cases([pytest.param(s, cp, id=_id(s, cp)) for s in SPECS for cp in (2, 4)
                if s.method != "ulysses" or s.Hq % cp == 0],
               covering(lambda p: SPECS.index(p.values[0]), lambda p: p.values[1]))


@pytest.fixture
def nan_fill():
    """Fresh buffers NaN-filled: a row no kernel writes fails the comparison."""
    before = varlen.set_nan_fill(True)
    yield
    varlen.set_nan_fill(before)


@pytest.mark.parametrize("spec, cp", COMBOS)
def test_matches_single_process(spec, cp, nan_fill):
    vc.local_group(cp).run(check_rank, resolved(spec))     # asserts on every rank


def test_gradient_flows_through_layers():
    """Two layers share the partition's cached step plans; the loss's gradient reaches the
    inputs of the first (the output is not detached)."""
    cu = np.array([0, 9, 13, 24], np.int32)

    def body(group):
        part = vc.partition(cu, group.size)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(24, 4, 8, dtype=torch.float64, generator=gen)
        x_r = part.shard(x, group.rank).requires_grad_()
        h = vt.context_parallel_attention(x_r, x_r[:, :2], x_r[:, 2:], part, group,
                                          mask="causal")
        y = vt.context_parallel_attention(h, h[:, :2], h[:, 2:], part, group, mask="causal")
        y.pow(2).sum().backward()
        return x_r.grad, part

    results = vc.local_group(2).run(body)
    x = torch.randn(24, 4, 8, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1)).requires_grad_()
    cu_t = torch.from_numpy(cu)
    h = vt.varlen_attention(x, x[:, :2], x[:, 2:], cu_t, cu_t, mask="causal")
    y = vt.varlen_attention(h, h[:, :2], h[:, 2:], cu_t, cu_t, mask="causal")
    y.pow(2).sum().backward()
    part = results[0][1]
    got = part.unshard([g for g, _ in results])
    assert torch.allclose(got, x.grad, rtol=1e-10, atol=1e-12), "two-layer gradient differs"


def test_lse_and_dtype():
    cu = np.array([0, 7, 13], np.int32)

    def body(group):
        part = vc.partition(cu, group.size)
        q = torch.randn(13, 4, 8, generator=torch.Generator().manual_seed(0))
        q_r = part.shard(q, group.rank).requires_grad_()
        out, lse = vt.context_parallel_attention(q_r, q_r, q_r, part, group,
                                                 mask="causal", return_lse=True)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        assert out.requires_grad and not lse.requires_grad
        return True
    assert vc.local_group(2).run(body) == [True, True]


def test_under_torch_compile():
    """A documented graph break: the function around the call compiles."""
    cu = np.array([0, 5, 12], np.int32)

    def body(group):
        part = vc.partition(cu, group.size)

        @torch.compile(backend="eager")
        def layer(q):
            return vt.context_parallel_attention(q * 2, q, q, part, group, mask="causal") + 1
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(12, 2, 8, dtype=torch.float64, generator=gen)
        q = part.shard(x, group.rank).requires_grad_()
        layer(q).sum().backward()
        want = x.clone().requires_grad_()
        cu_t = torch.from_numpy(cu)
        (vt.varlen_attention(want * 2, want, want, cu_t, cu_t, mask="causal") + 1) \
            .sum().backward()
        assert torch.allclose(q.grad, part.shard(want.grad, 0), rtol=1e-10, atol=1e-12)
    vc.local_group(1).run(body)


def test_bad_inputs_raise_on_every_rank():
    vc.local_group(2).run(check_bad_inputs)


def test_bad_group_type():
    part = vc.partition(np.array([0, 4], np.int32), 1)
    q = torch.zeros(4, 1, 8)
    with pytest.raises(TypeError, match="group must be"):
        vt.context_parallel_attention(q, q, q, part, group="world")


def test_without_torch_distributed_group():
    if torch.distributed.is_initialized():
        pytest.skip("a default process group exists in this process")
    part = vc.partition(np.array([0, 4], np.int32), 1)
    q = torch.zeros(4, 1, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        vt.context_parallel_attention(q, q, q, part)
