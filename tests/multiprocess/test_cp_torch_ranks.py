"""`varlen.torch.context_parallel_attention` on real processes: every spec of
`comm_workers/torch_cp.py` on gloo ranks (torch.multiprocessing over loopback), and the torchrun
training example, whose per-step losses match the CP=1 run."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("cp", [2, 4], ids=["cp2", "cp4"])
def test_gloo_ranks(cp):
    """Every spec of the worker, a sub-group, and the bad inputs, on `cp` gloo processes."""
    run = subprocess.run([sys.executable, str(ROOT / "tests/comm_workers/torch_cp.py"),
                          "spawn", str(cp)], env=_env(), capture_output=True, text=True,
                         timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for r in range(cp):
        assert f"rank {r} ok" in run.stdout, run.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_training_example_matches_cp1():
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-addr", "127.0.0.1", "--master-port",
                          str(_free_port()), str(ROOT / "docs/examples/train_cp_torch.py")],
                         env=_env(), capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 5, run.stdout
    for ln in lines:
        cp2, cp1 = float(ln.split()[4]), float(ln.split()[6])
        assert abs(cp2 - cp1) <= 1e-4 * abs(cp1), ln

