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

# (device id, message, error class) -> 0-d bool device array, or-ed into by every plan or
# kernel that can find the problem there
_FLAGS: dict = {}


def record(xp, flag, message: str, error=ValueError):
    """Raise `error(message)` if the 0-d bool `flag` is set (host), or remember it on the
    device. `error` is ValueError for invalid metadata, IndexError for an aux array read out of
    its range by a mask_mod or score_mod, OverflowError for a deterministic aux gradient out of
    the range of its fixed-point sums (`varlen.backends._aux_fixed`)."""
    if xp is np:
        if bool(flag):
            raise error(message)
        return
    acc = accumulator(xp, message, error)
    xp.logical_or(acc, flag, out=acc)


def accumulator(xp, message: str, error=ValueError):
    """The 0-d bool device array `record` ors `message`'s flags into on the current device
    (zero when first made). A kernel may set it to 1 itself: the same as `record` with a set
    flag, without a launch (the fused plan builder, `varlen.backends._cupy_plan`)."""
    key = (xp.cuda.Device().id, message, error)
    acc = _FLAGS.get(key)
    if acc is None:
        acc = _FLAGS[key] = xp.zeros((), dtype=bool)
    return acc


def check_device_errors():
    """Raise what device code recorded since the last check, every problem named: an
    IndexError if a mask_mod or score_mod read an aux array out of its range, else an
    OverflowError if a deterministic aux gradient left its fixed-point range, else a
    ValueError for invalid device metadata.

    Reads device memory (a synchronisation): call it after a step, or at the end of a run,
    when device calls run with validation off. Clears the flags.
    """
    found = [(err, msg) for (_, msg, err), acc in _FLAGS.items() if bool(acc.item())]
    for acc in _FLAGS.values():
        acc.fill(False)
    if not found:
        return
    messages = "; ".join(sorted(msg for _, msg in found))
    if any(err is IndexError for err, _ in found):
        raise IndexError(messages)
    if any(err is OverflowError for err, _ in found):
        raise OverflowError(messages)
    raise ValueError("device metadata was invalid: " + messages)
