"""The context-parallel workers on real processes: MaskMod and ScoreMod
(`tests/comm_workers/mods_cp.py`), attention sinks (`sinks_cp.py`) and attention dropout
(`dropout_cp.py`: ring, allgather, ulysses, usp and auto, the same seed as the single-process
call). Every case, method and scheme under `mpiexec -n 2` and `-n 4` (`-n 3` too at full size;
MPI group, NumPy backend, float64), `varlen.torch.context_parallel_attention` under torchrun
(gloo, 2 ranks: learnable aux tensors and sinks; dropout with a seed drawn on ranks whose torch
generators differ), and `varlen.jax.context_parallel_attention` inside shard_map on 4 host
devices. Each rank's shards match the single-process float64 reference; the aux and sink
gradients, summed over the ranks, match the reference's."""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cases

ROOT = Path(__file__).resolve().parents[2]
# worker -> (script, what its MPI run prints, its JAX run's checks)
WORKERS = {"mods": (ROOT / "tests" / "comm_workers" / "mods_cp.py", "OK mods", 5),
           "sinks": (ROOT / "tests" / "comm_workers" / "sinks_cp.py", "OK sinks", 4),
           "dropout": (ROOT / "tests" / "comm_workers" / "dropout_cp.py", "OK dropout", 5)}
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def _run(args, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("n", cases([2, 3, 4], [2, 4]))
def test_worker_under_mpiexec(n, worker):
    pytest.importorskip("mpi4py")
    script, ok, _ = WORKERS[worker]
    run = _run([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(script), "mpi"],
               timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert f"{ok} size={n}" in run.stdout, run.stdout + run.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("worker", WORKERS)
def test_torch_worker_under_torchrun(worker):
    pytest.importorskip("torch")
    run = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                str(WORKERS[worker][0]), "torch"], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for r in range(2):
        assert f"rank {r} ok" in run.stdout, run.stdout


@pytest.mark.parametrize("worker", WORKERS)
def test_jax_worker_inside_shard_map(worker):
    pytest.importorskip("jax")
    script, _, checks = WORKERS[worker]
    run = _run([sys.executable, str(script), "jax"], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert f"OK jax checks={checks}" in run.stdout, run.stdout
