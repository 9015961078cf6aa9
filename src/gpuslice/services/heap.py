"""A long-running controller's heap kept out of Python's full collections.

The DRA claim allocator holds every ResourceClaim, pod, node and ResourceSlice it watches and
its ledger: hundreds of thousands of objects that live as long as the process and hold no
reference cycles. Python's cyclic collector still scans them all in every full (generation
2) collection: 0.5-1.1 s at 1000 nodes with 5000 claims, with nothing collected, and the pass
under way waits (measured in ``cluster_scale.py --path dra``: the slowest claims of the run
were those whose pass a full collection stopped). The scheduler extender holds every node's
inventory, every pod and the ledger: its full collections took 0.1-0.4 s each in a 1000-node
run, each one a pause of every filter and bind under way.

After each pass (the allocator) or every second (the extender) :meth:`LongLivedHeap.settled`
collects the young generations, then moves what survived into the permanent generation
(:func:`gc.freeze`), so the collector scans only what was made since; objects with no cycle
are still freed by reference counting when dropped. A cycle made since the last settle is
collected with the young generations, not frozen; one that outlived a young collection and
was dropped later (rare: the extender made 45 such objects in a 1000-pod run) waits for the
next full collection, which runs every ``full_every_s`` (an hour by default) over everything.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

FULL_EVERY_S = 3600.0


class LongLivedHeap:
    def __init__(self, full_every_s: float = FULL_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if full_every_s <= 0:
            raise ValueError("full_every_s: expected a positive number of seconds")
        self.full_every_s, self.clock = full_every_s, clock
        self._full_at = clock()
        self.full_collections = 0

    def settled(self) -> None:
        """After a pass: the young generations collected, what survived frozen; once every
        ``full_every_s``, everything unfrozen and collected instead."""
        if self.clock() - self._full_at >= self.full_every_s:
            gc.unfreeze()
            gc.collect()
            self.full_collections += 1
            self._full_at = self.clock()
        else:  # a cycle dropped since the last settle is freed here, not frozen
            gc.collect(1)
        gc.freeze()
