"""The per-test timeout of scripts/gpu_check.sh's pytest steps:
`pytest -p pytest_watchdog --watchdog-timeout=SECONDS` (this folder on PYTHONPATH).

A test still running after SECONDS (a kernel that never returns) ends the process with status 1
after the line "Timeout (H:MM:SS)!" and the stacks of every thread. It is the interpreter's
faulthandler timer, a C thread: it fires even while the test's thread waits inside a CUDA call
that holds the GIL, where a Python-level timer (pytest-timeout's thread or signal method) may
never run. With `-v` the log names the test before it starts."""
from __future__ import annotations

import faulthandler
import os

import pytest

# the process's stderr before pytest captures it (a test's captured output dies with it)
_ERR = os.fdopen(os.dup(2), "w")


def pytest_addoption(parser):
    parser.addoption("--watchdog-timeout", type=float, default=0.0,
                     help="seconds a test may run before the process is ended (0: off)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = item.config.getoption("--watchdog-timeout")
    if seconds <= 0:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True, file=_ERR)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
