"""Two-level context parallelism (`method="usp"`) on real processes
(`tests/comm_workers/usp_cp.py`): `mpiexec -n 4` (u = 1, 2, 4), `-n 6` (u = 1, 2, 3, 6: 2x3
and 3x2 among them), `-n 8` (u = 1, 2, 4: 2x4 and 4x2), oversubscribed on a CPU, MPI groups
split into node and ring groups, NumPy backend, float64; and
`varlen.torch.context_parallel_attention` under torchrun with 4 gloo ranks (2x2), and
`varlen.jax.context_parallel_attention` inside shard_map over 2-D meshes of host devices (2x2,
2x4, 2x3, 4x2), its `stats=` equal to the traffic model. Each rank's shards match the
single-process float64 reference."""
import sys

import pytest

from test_cp_workers import MPIEXEC, ROOT, _free_port, _run

from helpers import cases

WORKER = ROOT / "tests" / "comm_workers" / "usp_cp.py"


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
@pytest.mark.parametrize("n", cases([4, 6, 8], [4, 6]))
def test_usp_under_mpiexec(n):
    pytest.importorskip("mpi4py")
    run = _run([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(WORKER), "mpi"],
               timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert f"OK usp size={n}" in run.stdout, run.stdout + run.stderr


def test_usp_under_torchrun():
    pytest.importorskip("torch")
    run = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                str(WORKER), "torch"], timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for r in range(4):
        assert f"rank {r} ok" in run.stdout, run.stdout



def test_usp_jax_two_dimensional_mesh():
    pytest.importorskip("jax")
    run = _run([sys.executable, str(WORKER), "jax"], timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "OK jax checks=8" in run.stdout, run.stdout
