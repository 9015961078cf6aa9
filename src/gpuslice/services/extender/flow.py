"""Binds in flight, and a filter that waits while too many are.

kube-scheduler runs each pod's binding cycle on a goroutine of its own and schedules the next
pod at once, so in a burst its filters can outrun the Binding writes the API server takes: the
binds then pile up in the extender (each holding its share in the ledger, and waiting for one
of the connections to the API server), and a bind takes as long as the queue ahead of it. A
filter that answers only once fewer than ``limit`` binds are under way keeps that queue short:
the pods wait unscheduled in kube-scheduler's queue instead, holding nothing. It can cost
pods/s where the control plane is short of CPU (docs/extender.md, "Binds in flight"); 0 turns
it off. The wait is bounded (``wait_s``): a slow API server delays filters by at most
that, never stops them.
"""

from __future__ import annotations

import asyncio
import time

# binds under way past which a filter waits (0: never; the CLI's --binds-in-flight, whose help
# quotes these), and for how long at most. 8 on the 2-core benchmark machine, kube-scheduler's
# window of 100 nodes (docs/extender.md, "Binds in flight"): bind p99 95-98 ms at 1000 and 5000
# nodes against 561 and 2474 without a limit; pods/s 0.8x at 1000 nodes, 1.1x at 5000
BINDS_IN_FLIGHT = 8
FLOW_WAIT_S = 1.0


class BindFlow:
    """Binds under way (counted on the event loop) and the filter's wait for room.
    ``limit`` 0: no wait."""

    def __init__(self, limit: int, wait_s: float) -> None:
        if limit < 0:
            raise ValueError("limit: expected 0 (no limit) or more")
        self.limit, self.wait_s = limit, wait_s
        self.under_way = 0
        self._room: asyncio.Event | None = None

    def started(self) -> None:
        self.under_way += 1

    def finished(self) -> None:
        self.under_way -= 1
        if self._room is not None and self.under_way < self.limit:
            self._room.set()

    async def room(self) -> float:
        """Wait until fewer than ``limit`` binds are under way, at most ``wait_s``; the
        seconds waited."""
        if not self.limit or self.under_way < self.limit:
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + self.wait_s
        while self.under_way >= self.limit:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._room is None or self._room.is_set():
                self._room = asyncio.Event()
            try:
                await asyncio.wait_for(self._room.wait(), left)
            except TimeoutError:
                break
        return time.monotonic() - t0
