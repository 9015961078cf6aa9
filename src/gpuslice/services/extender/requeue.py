"""A pod the filter refused is tried again once room is freed for it, even when the event that
freed the room reached kube-scheduler before it reached the extender.

kube-scheduler parks a pod that no node could take in its unschedulable pods, and moves it back
on a cluster event that may help it. A pod an extender refused carries the ``Extender``
pseudo-plugin in its ``UnschedulablePlugins`` (``findNodesThatFitPod``,
pkg/scheduler/schedule_one.go; kubernetes#122019), which is registered for every event of
every resource (``defaultEnqueueExtension``, pkg/scheduler/framework/runtime/framework.go:
``UnrollWildCardResource``, no queueing hint, so ``Queue``); before that change such a pod had
no rejector at all, and ``isPodWorthRequeuing`` (pkg/scheduler/backend/queue/
scheduling_queue.go) requeues a pod without one on any event. Either way *any* event moves it,
an update of the pending pod itself included (``PriorityQueue.Update``: the update is a
``UnschedulablePod/Update`` event, ``Pod/All`` matches it). Otherwise it waits for
``flushUnschedulablePodsLeftover``: 5 minutes (``podMaxInUnschedulablePodsDuration``).

The race (finding 3 of the chaos soak, docs/testing.md): the holder of a GPU is deleted;
kube-scheduler's informer sees it first and retries the waiting pod at once
(``AssignedPodDelete``); the extender's watch has not applied the deletion yet, so its filter
refuses again; the pod goes back to the unschedulable pods and, in a quiet cluster, nothing
moves it until the flush. So the extender remembers the pods its filter refused
(:class:`RequeueBook`, bounded), and when its view frees room on a node where such a pod now
fits and no filter call for the pod came meanwhile, the leader writes an annotation on the
pod (:data:`REQUEUE_ANNOTATION`, the time): that update is the event that requeues it.
Few writes: at most :data:`NUDGES_PER_NODE` pods per node freed and :data:`NUDGES_PER_ROUND`
in all per round, one pod at most every :data:`NUDGE_EVERY_S`, one write at a time; a failed
write is logged and counted (``gpuslice_extender_requeue_nudges``), never raised."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import Counter

from gpuslice.adapters.kube.ports import ApiConflict, ApiNotFound, KubePort
from gpuslice.core.errors import GpusliceError
from gpuslice.core.model import SliceRequest

# the annotation whose update has kube-scheduler try the pod again (outside gpuslice.io/:
# the annotations there are part of what a pod asks for, state._container_requests)
REQUEUE_ANNOTATION = "extender.gpuslice.io/requeue"
REFUSED_KEPT = 512  # pods remembered at most (the oldest refusal forgotten first)
# a refusal older than this is forgotten: kube-scheduler retries every unschedulable pod at
# least every 5 minutes (its flush), and each retry that is refused again renews it
REFUSED_TTL_S = 600.0
# after the room is freed, a filter call for the pod within this long spares the nudge
# (kube-scheduler retried it with the room visible: the usual order of things)
NUDGE_DELAY_S = 1.0
# one nudge per pod at most this often: kube-scheduler's longest backoff
# (podMaxBackoffDuration, 10 s), within which a requeued pod waits in its backoff queue anyway
NUDGE_EVERY_S = 10.0
NUDGES_PER_NODE = 2  # pods nudged per node where room was freed, per round
NUDGES_PER_ROUND = 16  # and in all (a re-read of everything frees "every node")
NUDGE_TICK_S = 0.25  # how often freed room is matched with the refused pods

log = logging.getLogger("gpuslice.extender")

# what the book asks of the view: the nodes among ``names`` (None: every node) where
# ``request`` fits the GPUs now
Fits = Callable[[SliceRequest, list[str] | None], list[str]]


@dataclass
class Refused:
    """A pod the filter refused on every node it was asked about."""

    namespace: str
    name: str
    uid: str
    request: SliceRequest
    nodes: frozenset[str] | None  # the nodes asked about; None: a window of them (any node)
    priority: int
    at: float  # when (monotonic) it was last refused
    due: float | None = None  # when to nudge it (room was freed for it)
    nudged: float = -math.inf  # when it was last nudged
    node: str = ""  # where room was freed for it


class RequeueBook:
    """The pods the filter refused (by UID, oldest refusal first, at most ``kept``), the nodes
    where room was freed since the last round, and the nudges due. Thread-safe: filter and
    the nudges run on the event loop, the watch on a thread."""

    def __init__(self, kept: int = REFUSED_KEPT, ttl_s: float = REFUSED_TTL_S,
                 delay_s: float = NUDGE_DELAY_S, every_s: float = NUDGE_EVERY_S,
                 per_node: int = NUDGES_PER_NODE, per_round: int = NUDGES_PER_ROUND) -> None:
        self.kept, self.ttl_s, self.delay_s, self.every_s = kept, ttl_s, delay_s, every_s
        self.per_node, self.per_round = per_node, per_round
        self._lock = threading.Lock()
        self._refused: dict[str, Refused] = {}
        self._freed: set[str] | None = set()  # None: every node (the view was read again)

    def __len__(self) -> int:
        return len(self._refused)

    def refused(self, pod: dict[str, Any], request: SliceRequest,
                nodes: frozenset[str] | None, now: float) -> None:
        """The filter refused ``pod`` on ``nodes`` (None: on a window of the nodes): remember
        it, and cancel a nudge due (kube-scheduler tried it again: it saw the room)."""
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if not uid:
            return
        prio = (pod.get("spec") or {}).get("priority")
        entry = Refused(str(meta.get("namespace") or "default"), str(meta.get("name") or ""),
                        uid, request, nodes, prio if isinstance(prio, int) else 0, now)
        with self._lock:
            old = self._refused.pop(uid, None)
            if old is not None:
                entry.nudged = old.nudged
            self._refused[uid] = entry
            while len(self._refused) > self.kept:
                del self._refused[next(iter(self._refused))]

    def forget(self, uid: str) -> None:
        """The pod needs no nudge: a filter kept a node for it, or it is bound or gone."""
        if self._refused:
            with self._lock:
                self._refused.pop(uid, None)

    def seen(self, pod: dict[str, Any], deleted: bool) -> None:
        """A watch event of ``pod``: forgotten once it is bound, finished or deleted."""
        if not self._refused:
            return
        if deleted or (pod.get("spec") or {}).get("nodeName") or \
                (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            self.forget(str((pod.get("metadata") or {}).get("uid") or ""))

    def freed(self, node: str | None) -> None:
        """Room was freed on ``node`` (None: anywhere, the view was read again)."""
        if not self._refused:
            return
        with self._lock:
            if node is None:
                self._freed = None
            elif self._freed is not None:
                self._freed.add(node)

    def schedule(self, fits: Fits, now: float) -> None:
        """One round: the nodes freed since the last one matched with the pods refused
        (highest priority first, then the longest waiting), each pod that ``fits`` one of
        them (among the nodes it was refused on) made due after ``delay_s``, at most
        ``per_node`` per node and ``per_round`` in all; refusals older than ``ttl_s``
        forgotten. ``fits`` reads the view: the caller holds the view's lock."""
        with self._lock:
            freed, self._freed = self._freed, set()
            for uid in [u for u, e in self._refused.items() if now - e.at > self.ttl_s]:
                del self._refused[uid]
            if freed is not None and not freed:
                return
            waiting = sorted((e for e in self._refused.values()
                              if e.due is None and now - e.nudged >= self.every_s),
                             key=lambda e: (-e.priority, e.at))
        taken: dict[str, int] = {}
        answers: dict[tuple[SliceRequest, tuple[str, ...] | None], list[str]] = {}
        chosen: list[tuple[Refused, str]] = []
        for e in waiting:
            if len(chosen) >= self.per_round:
                break
            where = _where(e.nodes, freed)
            if where is not None and not where:
                continue
            key = (e.request, None if where is None else tuple(where))
            if key not in answers:
                answers[key] = fits(e.request, where)
            node = next((n for n in answers[key] if taken.get(n, 0) < self.per_node), None)
            if node is not None:
                taken[node] = taken.get(node, 0) + 1
                chosen.append((e, node))
        with self._lock:
            for e, node in chosen:
                if self._refused.get(e.uid) is e:  # not refused again meanwhile
                    e.due, e.node = now + self.delay_s, node

    def take_due(self, now: float) -> list[Refused]:
        """The pods whose nudge is due, marked nudged at ``now``."""
        with self._lock:
            due = [e for e in self._refused.values() if e.due is not None and e.due <= now]
            for e in due:
                e.due, e.nudged = None, now
        return due

    def stand_by(self) -> None:
        """Not the leader: nothing is due, and the room freed meanwhile is passed over."""
        with self._lock:
            self._freed = set()
            for e in self._refused.values():
                e.due = None


def _where(nodes: frozenset[str] | None, freed: set[str] | None) -> list[str] | None:
    """The nodes to try a refused pod on: those it was refused on (None: any) that were
    freed (None: every node); None for every node."""
    if freed is None:
        return None if nodes is None else sorted(nodes)
    return sorted(freed if nodes is None else freed & nodes)


def stamp() -> str:
    """The annotation's value: now, RFC 3339 with microseconds (each nudge changes it, or the
    patch would change nothing and make no event)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def nudge(api: KubePort, r: Refused, value: str) -> str:
    """Write :data:`REQUEUE_ANNOTATION` on the pending pod ``r`` (its resourceVersion as read
    just before as the precondition, read again once on a conflict): "sent", "gone" (bound,
    deleted or another pod under the name: nothing written) or "failed" (logged)."""
    for _ in range(2):
        try:
            pod = api.get_pod(r.namespace, r.name)
            meta = pod.get("metadata") or {}
            if meta.get("uid") != r.uid or (pod.get("spec") or {}).get("nodeName") or \
                    meta.get("deletionTimestamp"):
                return "gone"
            api.patch_pod_annotations(r.namespace, r.name, {REQUEUE_ANNOTATION: value},
                                      str(meta.get("resourceVersion") or ""))
        except ApiConflict:
            continue  # changed since read: read it again
        except ApiNotFound:
            return "gone"
        except GpusliceError as exc:
            log.warning("requeue: pod %s/%s not nudged: %s", r.namespace, r.name, exc,
                        extra={"event": "requeue-failed"})
            return "failed"
        log.info("requeue: pod %s/%s nudged to be tried again (room freed on %s after the "
                 "filter refused it)", r.namespace, r.name, r.node or "a node",
                 extra={"event": "requeue-nudge", "node": r.node})
        return "sent"
    log.warning("requeue: pod %s/%s not nudged: it changed twice while being written",
                r.namespace, r.name, extra={"event": "requeue-failed"})
    return "failed"


class RequeueSource(Protocol):
    """What the nudges need of the extender's state (:class:`~.state.ExtenderState`)."""

    @property
    def api(self) -> KubePort: ...

    def requeue_due(self, now: float) -> list[Refused]: ...


async def nudge_loop(state: RequeueSource, counter: Counter,
                     tick_s: float = NUDGE_TICK_S) -> None:
    """Every ``tick_s``: the nudges due (the leader's), written one at a time on a thread,
    each counted by its result."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(tick_s)
        try:
            due = state.requeue_due(time.monotonic())
            for r in due:
                result = await loop.run_in_executor(None, nudge, state.api, r, stamp())
                counter.labels(result).inc()
        except Exception:  # a bug here must not end the loop unseen: logged, next round
            log.exception("requeue: round failed", extra={"event": "requeue-failed"})


def nudging(state: RequeueSource, counter: Counter
            ) -> Callable[[web.Application], AsyncIterator[None]]:
    """:func:`nudge_loop` for as long as the app serves (an aiohttp cleanup context)."""

    async def run(_: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(nudge_loop(state, counter))
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    return run
