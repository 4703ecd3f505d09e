"""The communicator interface and the in-process group.

A `Group` is one rank's view of a context-parallel group: `size`, `rank`, point-to-point
channels with an explicit post -> commit -> wait cycle (`p2p`), the collectives the attention
methods need (`allgather`, `alltoall`, `reduce_scatter`, `allgather_object`) and `abort`.
Arrays are working arrays (NumPy or CuPy); collectives return new arrays in the same module.
Every blocking wait of a group has a timeout (`DEFAULT_TIMEOUT`, 60 s, unless the group was
made with another): a peer that does not arrive in time is named in the error that aborts the
group, so no rank waits forever for a rank that failed, exited or went elsewhere.

`local_group(n)` makes `n` ranks inside one process, one thread each, exchanging copies through
a shared mailbox. The same rank code that runs under `mpiexec` runs there unchanged:

    groups = varlen.comm.local_group(2)
    outs = groups.run(lambda g: my_rank_code(g))   # one result per rank
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback

import numpy as np

from varlen._array import array_module

__all__ = ["Group", "P2P", "GroupAborted", "LocalGroup", "LocalGroups", "local_group",
           "DEFAULT_TIMEOUT"]

# Seconds a rank waits for a peer before it ends the group with an error naming that peer.
DEFAULT_TIMEOUT = 60.0


def check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer,
                                                             np.floating)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


class GroupAborted(RuntimeError):
    """Raised on every rank of a group after one of its ranks called `abort`."""


class P2P:
    """A point-to-point channel: post sends and receives, commit them as one batch, wait.

        ch = group.p2p(tag=0)
        ch.post_send(k, peer=next_rank)
        ch.post_recv(k_next, peer=prev_rank)      # a preallocated, contiguous buffer
        ch.commit()                               # transfers start
        ...                                       # compute while they run
        ch.wait()                                 # k_next now holds the data

    One batch is in flight at a time; posting or committing again before `wait`, committing
    nothing, or waiting without a commit raise `RuntimeError`. Sent arrays must not be
    modified until `wait` returns. Channels with different tags never match each other.
    """

    def __init__(self, group: "Group", tag: int):
        self._group = group
        self._tag = int(tag)
        self._posted = []
        self._inflight = None

    def _post(self, kind, x, peer):
        if self._inflight is not None:
            raise RuntimeError(f"post_{kind}() while a committed batch is in flight; call "
                               f"wait() first")
        g = self._group
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or \
                not 0 <= peer < g.size:
            raise ValueError(f"peer must be a rank in [0, {g.size}), got {peer!r}")
        self._posted.append((kind, x, int(peer)))

    def post_send(self, x, peer):
        """Queue sending `x` to rank `peer`."""
        self._post("send", x, peer)

    def post_recv(self, buf, peer):
        """Queue receiving into `buf` (same shape and dtype as what `peer` sends)."""
        if not _contiguous(buf):
            raise ValueError("post_recv needs a C-contiguous buffer")
        self._post("recv", buf, peer)

    def commit(self):
        """Start every posted transfer."""
        if self._inflight is not None:
            raise RuntimeError("commit() while a committed batch is in flight; call wait() "
                               "first")
        if not self._posted:
            raise RuntimeError("commit() with nothing posted")
        ops, self._posted = self._posted, []
        self._inflight = self._group._start(ops, self._tag)

    def wait(self):
        """Block until the committed batch has completed (device groups: order the current
        stream after it, without a host wait)."""
        if self._inflight is None:
            why = " (the posts were never committed)" if self._posted else ""
            raise RuntimeError(f"wait() without a committed batch{why}")
        handle, self._inflight = self._inflight, None
        self._group._finish(handle)

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None


def _contiguous(x) -> bool:
    flags = getattr(x, "flags", None)
    return bool(flags is not None and flags.c_contiguous)


class Group:
    """One rank's view of a group of `size` ranks (see the module docstring)."""

    size: int
    rank: int

    def p2p(self, tag: int = 0) -> P2P:
        """A new point-to-point channel; `tag` keeps concurrent channels apart."""
        return P2P(self, tag)

    # Subclasses implement these.
    def _start(self, ops, tag):
        raise NotImplementedError

    def _finish(self, handle):
        raise NotImplementedError

    def allgather(self, x):
        """`[size, *x.shape]`: every rank's `x`, by rank."""
        raise NotImplementedError

    def alltoall(self, x):
        """`x` is `[size, ...]`; returns `y` with `y[s]` = what rank s sent to this rank
        (its `x[self.rank]`)."""
        raise NotImplementedError

    def reduce_scatter(self, x):
        """`x` is `[size, ...]`; returns the sum over ranks of their `x[self.rank]`."""
        parts = self.alltoall(x)
        return parts.sum(axis=0)

    def allgather_object(self, obj) -> list:
        """Every rank's picklable `obj`, by rank (host data: checks and metadata)."""
        raise NotImplementedError

    def abort(self, error=None):
        """End the group on every rank with an error (never returns normally for MPI)."""
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


# --------------------------------------------------------------------------------------------
# In-process group: one thread per rank
# --------------------------------------------------------------------------------------------

class _World:
    """State shared by the ranks of one in-process group."""

    def __init__(self, n: int, timeout: float):
        self.n = n
        self.timeout = timeout
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n
        self.lock = threading.Lock()
        self.mailbox = {}
        self.aborted = None                                     # the error that aborted it
        self.entered = [0] * n                                  # collectives entered, by rank

    def channel(self, src, dst, tag) -> queue.Queue:
        with self.lock:
            return self.mailbox.setdefault((src, dst, tag), queue.Queue())


class LocalGroup(Group):
    """Rank `rank` of an in-process group (use `local_group(n)`)."""

    _POLL = 0.02    # seconds between abort checks while blocked

    def __init__(self, world: _World, rank: int):
        self._world = world
        self.size = world.n
        self.rank = rank

    def _check(self):
        if self._world.aborted is not None:
            raise GroupAborted(f"rank {self.rank}: the group was aborted "
                               f"({self._world.aborted!r})")

    def _start(self, ops, tag):
        self._check()
        w = self._world
        recvs = []
        for kind, x, peer in ops:
            if kind == "send":
                w.channel(self.rank, peer, tag).put(x.copy())     # the mailbox owns a copy
            else:
                recvs.append((x, peer))
        return tag, recvs

    def _finish(self, handle):
        tag, recvs = handle
        for buf, peer in recvs:
            data = self._get(self._world.channel(peer, self.rank, tag), peer)
            if data.shape != buf.shape or data.dtype != buf.dtype:
                raise ValueError(f"rank {self.rank} posted a receive of {buf.shape} "
                                 f"{buf.dtype} but rank {peer} sent {data.shape} {data.dtype}")
            buf[...] = data

    def _get(self, q: queue.Queue, peer):
        deadline = time.monotonic() + self._world.timeout
        while True:
            self._check()
            try:
                return q.get(timeout=self._POLL)
            except queue.Empty:
                if time.monotonic() > deadline:
                    err = TimeoutError(f"rank {self.rank} waited {self._world.timeout:g} s "
                                       f"for rank {peer}")
                    self.abort(err)
                    raise err from None

    def _exchange(self, value) -> list:
        """Every rank's `value`, by rank (two barriers: write, then read)."""
        w = self._world
        self._check()
        w.entered[self.rank] += 1
        w.slots[self.rank] = value
        self._barrier()
        values = list(w.slots)
        self._barrier()
        return values

    def _barrier(self):
        try:
            self._world.barrier.wait(timeout=self._world.timeout)
        except threading.BrokenBarrierError:
            self._check()
            w = self._world
            late = [r for r in range(w.n) if w.entered[r] < w.entered[self.rank]]
            who = f"rank {', '.join(map(str, late))}" if late else "a rank"
            err = TimeoutError(f"rank {self.rank} waited {w.timeout:g} s for {who} in a "
                               f"collective")
            self.abort(err)
            raise err from None

    def allgather(self, x):
        xp = array_module(x)
        return xp.stack([v.copy() for v in self._exchange(x)])

    def alltoall(self, x):
        if x.shape[0] != self.size:
            raise ValueError(f"alltoall needs [size={self.size}, ...], got {tuple(x.shape)}")
        xp = array_module(x)
        return xp.stack([v[self.rank].copy() for v in self._exchange(x)])

    def allgather_object(self, obj) -> list:
        return self._exchange(obj)

    def barrier(self):
        self._exchange(None)

    def abort(self, error=None):
        w = self._world
        if w.aborted is None:
            w.aborted = error if error is not None else RuntimeError("abort()")
        w.barrier.abort()


class LocalGroups:
    """The `n` ranks of an in-process group: index them, or `run` rank code on all of them."""

    def __init__(self, n: int, timeout: float):
        self._world = _World(n, timeout)
        self._ranks = [LocalGroup(self._world, r) for r in range(n)]

    def __len__(self):
        return len(self._ranks)

    @property
    def size(self) -> int:
        return len(self._ranks)

    def __getitem__(self, rank) -> LocalGroup:
        return self._ranks[rank]

    def __iter__(self):
        return iter(self._ranks)

    def run(self, fn, *args, **kwargs) -> list:
        """Call `fn(group, *args, **kwargs)` on every rank, one thread each; return the
        results by rank. If any rank raises, the group is aborted (so no rank hangs) and the
        first original error is raised here."""
        n = len(self._ranks)
        results, errors = [None] * n, [None] * n

        def body(r):
            try:
                results[r] = fn(self._ranks[r], *args, **kwargs)
            except BaseException as e:     # noqa: B902  (the thread reports every failure)
                errors[r] = e
                self._ranks[r].abort(e)

        threads = [threading.Thread(target=body, args=(r,), name=f"cp-rank-{r}", daemon=True)
                   for r in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self._world.timeout + 5.0
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        if any(t.is_alive() for t in threads):
            self._ranks[0].abort(TimeoutError("local group run timed out"))
            raise TimeoutError(f"in-process ranks still running after "
                               f"{self._world.timeout} s")
        failed = [e for e in errors if e is not None]
        if failed:
            primary = [e for e in failed if not isinstance(e, GroupAborted)]
            raise (primary or failed)[0]
        return results


def local_group(n: int, *, timeout: float = DEFAULT_TIMEOUT) -> LocalGroups:
    """`n` in-process ranks (threads sharing a mailbox) for tests and single-device runs.

    Rank code must run concurrently, one thread per rank: `local_group(n).run(fn)`, or your own
    threads with `groups[r]`. Calling the ranks one after another from one thread would leave
    rank 0 waiting for rank 1; `timeout` (seconds) bounds every blocking wait, and a rank stuck
    longer aborts the group with a TimeoutError.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an int >= 1 (the number of ranks), got {n!r}")
    return LocalGroups(int(n), check_timeout(timeout))


def report_abort(rank, error) -> None:
    """Write the error that aborts a group to stderr, with the rank, before the abort."""
    if error is None:
        return
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    sys.stderr.write(f"[varlen.comm rank {rank}] aborting the group after:\n{text}")
    sys.stderr.flush()
