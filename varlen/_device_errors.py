"""Errors found by device code without a host read: recorded on the device, raised on request.

Metadata that was not validated (device inputs with validation off) can be wrong in ways only a
host read would show — a sequence longer than the `max_seqlen_*` bound the tile table was sized
for, a sequence that runs past its buffer. The plan builder detects both with array code and
records a flag beside the data; `varlen.check_device_errors()` reads the flags (one
synchronisation) and raises what they record. On the host the check costs nothing, so host
plans raise at once.
"""
from __future__ import annotations

import numpy as np

__all__ = ["record", "accumulator", "check_device_errors"]

# (device id, message) -> 0-d bool device array, or-ed into by every plan built there
_FLAGS: dict = {}


def record(xp, flag, message: str):
    """Raise `message` if the 0-d bool `flag` is set (host), or remember it on the device."""
    if xp is np:
        if bool(flag):
            raise ValueError(message)
        return
    acc = accumulator(xp, message)
    xp.logical_or(acc, flag, out=acc)


def accumulator(xp, message: str):
    """The 0-d bool device array `record` ors `message`'s flags into on the current device
    (zero when first made). A kernel may set it to 1 itself: the same as `record` with a set
    flag, without a launch (the fused plan builder, `varlen.backends._cupy_plan`)."""
    key = (xp.cuda.Device().id, message)
    acc = _FLAGS.get(key)
    if acc is None:
        acc = _FLAGS[key] = xp.zeros((), dtype=bool)
    return acc


def check_device_errors():
    """Raise a ValueError naming every problem device code recorded since the last check.

    Reads device memory (a synchronisation): call it after a step, or at the end of a run,
    when device calls run with validation off. Clears the flags.
    """
    found = [msg for (_, msg), acc in _FLAGS.items() if bool(acc.item())]
    for acc in _FLAGS.values():
        acc.fill(False)
    if found:
        raise ValueError("device metadata was invalid: " + "; ".join(sorted(found)))
