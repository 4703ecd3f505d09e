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
           "Traffic", "DEFAULT_TIMEOUT"]

# Seconds a rank waits for a peer before it ends the group with an error naming that peer.
DEFAULT_TIMEOUT = 60.0


def check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer,
                                                             np.floating)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


class Traffic:
    """Bytes a rank's group (and the subgroups split from it) sent and received, per level.

    A level is the name of the group that moved them: `"flat"` for a group made by `init` or
    `local_group`, `"intra"` and `"inter"` for the node and cross-node groups of `usp`
    (`Group.split(..., level=)`). Counted where the data enters a group, as the data this rank
    hands to others and gets from others, whatever the library does underneath:

    * point to point: `x.nbytes` sent per `post_send`, `buf.nbytes` received per `post_recv`;
    * `allgather(x)`: `(size - 1) * x.nbytes` sent and received (to and from each peer);
    * `alltoall(x)`, `reduce_scatter(x)` (`x` `[size, ...]`): `(size - 1) / size * x.nbytes`
      sent and received (every block but this rank's own).

    Host metadata (`allgather_object`: agreement checks) is not counted. `snapshot()` is a
    plain dict `{level: {"sent": bytes, "received": bytes}}`; `since(snapshot)` the bytes
    moved after it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes = {}

    def add(self, level: str, sent: int, received: int) -> None:
        with self._lock:
            d = self._bytes.setdefault(level, {"sent": 0, "received": 0})
            d["sent"] += int(sent)
            d["received"] += int(received)

    def snapshot(self) -> dict:
        with self._lock:
            return {lv: dict(d) for lv, d in self._bytes.items()}

    def since(self, before: dict) -> dict:
        """`{level: {"sent", "received"}}` moved since `before` (a `snapshot()`), levels that
        moved nothing left out."""
        now = self.snapshot()
        out = {}
        for lv, d in now.items():
            b = before.get(lv, {"sent": 0, "received": 0})
            delta = {k: d[k] - b[k] for k in ("sent", "received")}
            if delta["sent"] or delta["received"]:
                out[lv] = delta
        return out


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
        g._count(int(x.nbytes), 0) if kind == "send" else g._count(0, int(x.nbytes))

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
    level: str = "flat"         # what `traffic` files this group's bytes under

    @property
    def traffic(self) -> Traffic:
        """The bytes this rank moved through this group and the groups split from it, per
        level (`Traffic`)."""
        t = self.__dict__.get("_traffic")
        if t is None:
            t = self.__dict__.setdefault("_traffic", Traffic())
        return t

    def gpus_per_node(self) -> int:
        """How many of the group's ranks share this rank's node (what `method="auto"` takes
        as the node size; a collective where it needs one)."""
        return self.size

    def _count(self, sent: int, received: int) -> None:
        self.traffic.add(self.level, sent, received)

    def p2p(self, tag: int = 0) -> P2P:
        """A new point-to-point channel; `tag` keeps concurrent channels apart."""
        return P2P(self, tag)

    def allgather(self, x):
        """`[size, *x.shape]`: every rank's `x`, by rank."""
        self._count((self.size - 1) * x.nbytes, (self.size - 1) * x.nbytes)
        return self._allgather(x)

    def alltoall(self, x):
        """`x` is `[size, ...]`; returns `y` with `y[s]` = what rank s sent to this rank
        (its `x[self.rank]`)."""
        self._count_blocks(x)
        return self._alltoall(x)

    def reduce_scatter(self, x):
        """`x` is `[size, ...]`; returns the sum over ranks of their `x[self.rank]`."""
        self._count_blocks(x)
        return self._reduce_scatter(x)

    def _count_blocks(self, x):
        moved = (self.size - 1) * (x.nbytes // max(self.size, 1))
        self._count(moved, moved)

    def split(self, groups, *, level: str) -> "Group":
        """The subgroup of `groups` (a list of disjoint tuples of ranks that covers the group;
        the same list on every rank: a collective) that holds this rank, its ranks numbered in
        tuple order. Made once per `groups` and kept (no communicator is created per call);
        its bytes go to this group's `traffic` under `level`; aborting it aborts this group."""
        key = (tuple(tuple(int(r) for r in g) for g in groups), level)
        cache = self.__dict__.setdefault("_splits", {})
        if key in cache:
            return cache[key]
        flat = sorted(r for g in key[0] for r in g)
        bad = flat != list(range(self.size)) or any(not g for g in key[0])
        # every rank must split alike: one host exchange says whether they do, on every rank
        seen = self.allgather_object((key, bad))
        if bad:
            raise ValueError(f"groups must split ranks 0..{self.size - 1} into non-empty "
                             f"disjoint tuples, got {groups!r}")
        if any(k != key or b for k, b in seen):
            other = next(r for r, (k, b) in enumerate(seen) if k != key or b)
            raise ValueError(f"ranks split the group differently: rank {self.rank} asked for "
                             f"{key}, rank {other} for {seen[other][0]}")
        mine = next(i for i, g in enumerate(key[0]) if self.rank in g)
        sub = self._subgroup(key[0], mine)
        sub.level = level
        sub.__dict__["_traffic"] = self.traffic
        cache[key] = sub
        return sub

    # Subclasses implement these.
    def _start(self, ops, tag):
        raise NotImplementedError

    def _finish(self, handle):
        raise NotImplementedError

    def _allgather(self, x):
        raise NotImplementedError

    def _alltoall(self, x):
        raise NotImplementedError

    def _reduce_scatter(self, x):
        return self._alltoall(x).sum(axis=0)

    def _subgroup(self, groups: tuple, mine: int) -> "Group":
        """This rank's group among `groups` (every rank calls it with the same `groups`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be split")

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
        self.family = [self]        # worlds split from one another: aborted together

    def abort(self, error):
        for w in self.family:
            if w.aborted is None:
                w.aborted = error
            w.barrier.abort()

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

    def _allgather(self, x):
        xp = array_module(x)
        return xp.stack([v.copy() for v in self._exchange(x)])

    def _alltoall(self, x):
        if x.shape[0] != self.size:
            raise ValueError(f"alltoall needs [size={self.size}, ...], got {tuple(x.shape)}")
        xp = array_module(x)
        return xp.stack([v[self.rank].copy() for v in self._exchange(x)])

    def allgather_object(self, obj) -> list:
        return self._exchange(obj)

    def barrier(self):
        self._exchange(None)

    def abort(self, error=None):
        self._world.abort(error if error is not None else RuntimeError("abort()"))

    def _subgroup(self, groups, mine):
        worlds = None
        if self.rank == 0:                  # rank 0 makes every subgroup's world
            worlds = [_World(len(g), self._world.timeout) for g in groups]
            family = self._world.family
            family.extend(worlds)
            for w in worlds:
                w.family = family
        worlds = self._exchange(worlds)[0]
        return LocalGroup(worlds[mine], groups[mine].index(self.rank))


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
