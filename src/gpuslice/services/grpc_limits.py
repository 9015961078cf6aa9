"""Who may hold a worker thread of the node plugins' gRPC servers (the DRA driver and the
device plugin), so that no kind of call starves the others.

A synchronous gRPC server runs every call on a thread of its pool, a server stream for as long
as it is open, and queues the calls beyond the pool. Two kinds hold threads for long: the
kubelet's streams (device health, ListAndWatch), and calls that wait on the API server (DRA
prepare, Allocate), for their whole deadline when it is frozen. Each kind gets its own bound,
and the pool has room for both bounds plus a reserve, so that the quick calls (unprepare,
options, registration) never queue behind them:

- :class:`Slots`: at most ``limit`` calls of a kind at a time; one beyond is answered at once
  (the caller says how: an error the kubelet retries), never queued;
- :class:`Streams`: at most ``limit`` streams open; a new one ends the oldest (a kubelet that
  reconnected leaves its old stream behind; its newest is the live one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

RESERVE = 8  # worker threads kept for the quick calls


def pool_size(*bounds: int) -> int:
    """Worker threads for a server whose long-held calls have these bounds."""
    return sum(bounds) + RESERVE


class Slots:
    """At most ``limit`` calls of one kind at a time, the others refused at once."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: at least 1, got {limit}")
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    @contextmanager
    def take(self) -> Iterator[bool]:
        """Whether a slot was free (then held until the block ends)."""
        got = self._free.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._free.release()


class Streams:
    """At most ``limit`` streams open: opening one more ends the oldest."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: at least 1, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._open: list[threading.Event] = []  # oldest first; set: asked to end
        self.ended = 0  # streams ended to make room

    @contextmanager
    def open(self, active: Callable[[], bool]) -> Iterator[Callable[[], bool]]:
        """The stream's ``active``: the caller's (the client is still there) and not ended
        to make room for a newer stream."""
        ended = threading.Event()
        with self._lock:
            self._open.append(ended)
            while len(self._open) > self.limit:
                self._open.pop(0).set()
                self.ended += 1
        try:
            yield lambda: active() and not ended.is_set()
        finally:
            with self._lock:
                if ended in self._open:
                    self._open.remove(ended)
