"""MaskMod and ScoreMod under context parallelism on real processes
(`tests/comm_workers/mods_cp.py`): every gallery case, method and scheme under `mpiexec -n 2`
and `-n 4` (MPI group, NumPy backend, float64), `varlen.torch.context_parallel_attention` with
learnable aux tensors under torchrun (gloo), and `varlen.jax.context_parallel_attention` inside
shard_map on 4 host devices. Each rank's shards match the single-process float64 reference;
the aux gradients, summed over the ranks, match the reference's."""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cases

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "comm_workers" / "mods_cp.py"
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def _run(args, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
@pytest.mark.parametrize("n", cases([2, 3, 4], [2, 4]))
def test_gallery_under_mpiexec(n):
    pytest.importorskip("mpi4py")
    run = _run([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(WORKER), "mpi"],
               timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert f"OK mods size={n}" in run.stdout, run.stdout + run.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_learnable_aux_under_torchrun():
    pytest.importorskip("torch")
    run = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                str(WORKER), "torch"], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for r in range(2):
        assert f"rank {r} ok" in run.stdout, run.stdout


def test_jax_learnable_aux_inside_shard_map():
    pytest.importorskip("jax")
    run = _run([sys.executable, str(WORKER), "jax"], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "OK jax checks=5" in run.stdout, run.stdout
