"""A per-test timeout for the pytest steps of scripts/gpu_check.sh where pytest-timeout is not
installed: `pytest -p pytest_watchdog --watchdog-timeout=SECONDS` (this folder on PYTHONPATH).

A test still running after SECONDS (a kernel that never returns) gets the line
"+++++ Timeout +++++" with its node id, the stacks of every thread, and the end of the process
with status 1, as pytest-timeout's thread method does, so the script sees the same mark."""
from __future__ import annotations

import faulthandler
import os
import threading

import pytest


def pytest_addoption(parser):
    parser.addoption("--watchdog-timeout", type=float, default=0.0,
                     help="seconds a test may run before the process is ended (0: off)")


# the process's stderr before pytest captures it (a test's output is lost with the process)
_ERR = os.fdopen(os.dup(2), "w")


def _fire(nodeid: str, seconds: float) -> None:
    _ERR.write(f"\n+++++ Timeout +++++ {nodeid} ran past {seconds:g} s\n")
    _ERR.flush()
    faulthandler.dump_traceback(file=_ERR, all_threads=True)
    _ERR.flush()
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = item.config.getoption("--watchdog-timeout")
    if seconds <= 0:
        yield
        return
    timer = threading.Timer(seconds, _fire, (item.nodeid, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
