"""What the extender does beside answering calls: follow the API server's watch into the state
(a full re-read when the watch broke or every ``resync_s``), take part in the leader election
and keep the leader's label on its own pod in step with it, and move what the process holds
out of Python's full collections."""

from __future__ import annotations

import asyncio
import logging
import time

from gpuslice.core.errors import GpusliceError
from gpuslice.services.extender.state import ExtenderState
from gpuslice.services.heap import LongLivedHeap
from gpuslice.services.leader import LeaderLabel

SETTLE_EVERY_S = 1.0  # how often what survived is moved out of full collections (heap)
# the longest one watch call waits for events: it runs on a thread a stopping process joins,
# so this bounds how long a SIGTERM waits for it (each call only hands over what the
# watches queued meanwhile)
WATCH_WAIT_S = 1.0
API_WAIT_LOG_S = 30.0  # how often an outage of the API server is logged while it lasts
STANDBY_S = 1.0  # how often a standby replica reads the Lease (one GET)

log = logging.getLogger("gpuslice.extender")


class Following:
    """The watch-following and leader-election loops over ``state``."""

    def __init__(self, state: ExtenderState, resync_s: float) -> None:
        self.state, self.resync_s = state, resync_s
        self.stepped = asyncio.Event()  # an election step ended: the label follows leadership

    async def elect(self) -> None:
        state = self.state
        assert state.elector is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(None, state.elector.step)
            except GpusliceError as exc:
                state.elector.leader = False
                state.problems.append(f"leader election: {exc}")
            self.stepped.set()
            # the leader renews every third of the lease; a standby looks every STANDBY_S,
            # so that a Lease given up on SIGTERM (a rolling update) is taken within seconds
            await asyncio.sleep(state.elector.duration_s / 3 if state.elector.leader
                                else min(STANDBY_S, state.elector.duration_s / 3))

    async def mark(self, label: LeaderLabel) -> None:
        el = self.state.elector
        assert el is not None
        loop = asyncio.get_running_loop()
        while True:  # after each step (a failed write is tried again after the next one);
            # the first comes at once: a stale label from a previous container of the pod
            # is taken off then, unless that step won the Lease
            await self.stepped.wait()
            self.stepped.clear()
            await loop.run_in_executor(None, label.sync, el.leader)

    def follow_once(self, since: str, stale: bool, last: float) -> tuple[str, bool]:
        """The next batch of watch events applied (a node change re-reads everything), after
        a re-read of everything when the watch broke or ``resync_s`` has passed since
        ``last``; whether it re-read. Blocking: on a thread."""
        events, since = self.state.api.watch(since, 0.0 if stale else WATCH_WAIT_S)
        reread = stale or time.monotonic() - last >= self.resync_s
        if reread:
            self.state.rebuild()
        if events:
            self.state.apply_all(events)
        return since, reread

    async def follow(self) -> None:
        """An outage of the API server leaves filter and prioritize answering from the last
        view (binds fail on their own); the loop retries with backoff, never exits."""
        loop = asyncio.get_running_loop()
        since = ""
        stale = False  # events were missed (a broken watch): re-read before following again
        last = time.monotonic()
        backoff_s = 1.0
        failing: float | None = None  # since when the API server has not answered
        said = 0.0  # when that was last logged
        while True:
            try:  # one hand-over to a thread per batch: the watch, a re-read, the events
                since, reread = await loop.run_in_executor(None, self.follow_once, since,
                                                           stale, last)
                if reread:
                    stale, last = False, time.monotonic()
                backoff_s = 1.0
                if failing is not None:
                    log.info("the API server answers again after %.0f s",
                             time.monotonic() - failing, extra={"event": "api-back"})
                    failing = None
            except GpusliceError as exc:  # start the watch again, then re-read everything
                self.state.problems.append(f"watch: {exc}")
                now = time.monotonic()
                if failing is None or now - said >= API_WAIT_LOG_S:
                    # said at once and every API_WAIT_LOG_S while it lasts: an extender that
                    # cannot reach the API server is not Ready, and its log says why
                    failing = now if failing is None else failing
                    said = now
                    log.warning("waiting for the API server (%.0f s so far; %s until it "
                                "answers): %s", now - failing, "not ready" if not
                                self.state.synced else "serving from the last view", exc,
                                extra={"event": "api-waiting"})
                since, stale = "", True
                await asyncio.sleep(backoff_s)
                backoff_s = min(30.0, 2 * backoff_s)


async def settle(heap: LongLivedHeap, every_s: float = SETTLE_EVERY_S) -> None:
    """Move what survived out of Python's full collections every ``every_s``."""
    while True:
        await asyncio.sleep(every_s)
        heap.settled()
