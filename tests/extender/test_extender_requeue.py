"""A pod refused just before its room is freed is nudged to be tried again (finding 3 of the
chaos soak, docs/testing.md; services/extender/requeue.py).

kube-scheduler retries a pod an extender refused on any cluster event, an update of the pod
itself included: the pod carries the ``Extender`` pseudo-plugin in its UnschedulablePlugins
(``findNodesThatFitPod`` in pkg/scheduler/schedule_one.go), registered for every event of
every resource without a queueing hint (``defaultEnqueueExtension`` in
pkg/scheduler/framework/runtime/framework.go), so ``isPodWorthRequeuing`` and
``PriorityQueue.Update`` in pkg/scheduler/backend/queue/scheduling_queue.go move it on the
pod's own ``UnschedulablePod/Update``. When the holder's deletion reaches kube-scheduler before
the extender's watch applies it, the retry it triggers is refused, and nothing else moves the
pod for 5 minutes; the extender's leader then writes an annotation on the pod once its view
frees the room. These tests play the race in-process: the filter refuses, then the watch
applies the deletion."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from gpuslice.adapters.kube.fake import ApiConflict, FakeApiServer
from gpuslice.core.errors import GpusliceError
from gpuslice.core.model import SliceRequest
from gpuslice.services.extender import ExtenderState
from gpuslice.services.extender.requeue import (
    NUDGE_DELAY_S,
    NUDGE_EVERY_S,
    NUDGES_PER_NODE,
    REQUEUE_ANNOTATION,
    RequeueBook,
    nudge,
)
from gpuslice.services.leader import LeaderElector
from tests.extender.helpers import KEY, bound, clock, mig_node, node, pod, post, serving


def _annotations(api: FakeApiServer, name: str) -> dict[str, str]:
    return api.get_pod("default", name)["metadata"].get("annotations") or {}


def _one_gpu(waiters: int = 1, milli: int = 600) -> FakeApiServer:
    """Node ``a`` with one T4, ``holder`` asking for all of it, and pods waiting for it."""
    api = FakeApiServer()
    api.add_node(node("a", "T4", 1))
    api.add_node(node("b", "T4", 1))
    api.add_pod(pod("holder", 1000))
    api.add_pod(pod("other", 1000))  # holds b
    for k in range(waiters):
        api.add_pod(pod(f"waiter{k}", milli))
    return api


def _bind(state: ExtenderState, api: FakeApiServer, name: str, node_name: str) -> None:
    p = api.get_pod("default", name)
    assert state.bind("default", name, p["metadata"]["uid"], node_name) == ""


def _follow(state: ExtenderState, api: FakeApiServer, since: str) -> str:
    """The extender's watch catches up: every event after ``since`` applied."""
    events, since = api.watch(since, 0.0)
    state.apply_all(events)
    return since


def test_a_pod_refused_just_before_its_room_is_freed_is_nudged_and_then_fits() -> None:
    """Over HTTP: the filter refuses the waiter, the holder's deletion reaches the extender
    afterwards, and the leader writes the annotation on the waiter (an update kube-scheduler
    requeues it on), counted in /metrics; the filter that follows keeps the node. Without the
    nudge, nothing is written and the test fails."""
    api = _one_gpu()

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            for name, where in (("holder", "a"), ("other", "b")):
                await bound(s, url, api, api.get_pod("default", name), where)
            _, since = api.watch("", 0.0)
            _follow(state, api, "")
            api.delete_pod("default", "holder")  # kube-scheduler's informer sees it first
            waiter = api.get_pod("default", "waiter0")
            st, res = await post(s, url + "/filter", {"Pod": waiter, "NodeNames": ["a", "b"]})
            assert st == 200 and res["NodeNames"] == [], res  # the stale view refuses
            since = _follow(state, api, since)  # then the extender's watch applies it
            end = time.monotonic() + 60  # a bound on the wait, not a timing claim
            while REQUEUE_ANNOTATION not in _annotations(api, "waiter0"):
                assert time.monotonic() < end, "the waiter was never nudged"
                await asyncio.sleep(0.05)
            # kube-scheduler's informer gets an update of the pending pod: its requeue
            events, _ = api.watch(since, 0.0)
            assert [(e.type, e.obj["metadata"]["name"]) for e in events] == \
                [("MODIFIED", "waiter0")]
            assert not events[0].obj["spec"].get("nodeName")
            waiter = api.get_pod("default", "waiter0")
            st, res = await post(s, url + "/filter", {"Pod": waiter, "NodeNames": ["a", "b"]})
            assert res["NodeNames"] == ["a"], res
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            assert 'gpuslice_extender_requeue_nudges_total{result="sent"} 1.0' in text
            assert len(state.requeue) == 0  # kept a node: forgotten

    asyncio.run(serving(api, body))


def test_a_nudge_waits_for_a_filter_call_and_one_that_comes_spares_it() -> None:
    api = _one_gpu()
    state = ExtenderState(api, KEY, clock=clock)
    _bind(state, api, "holder", "a")
    _bind(state, api, "other", "b")
    _, since = api.watch("", 0.0)
    waiter = api.get_pod("default", "waiter0")
    state.requeue_note(waiter, ["a", "b"], kept=False)
    api.delete_pod("default", "holder")
    _follow(state, api, since)
    t = time.monotonic()
    assert state.requeue_due(t) == []  # a retry by kube-scheduler may still come
    (due,) = state.requeue_due(t + NUDGE_DELAY_S)
    assert (due.name, due.node) == ("waiter0", "a")
    assert state.requeue_due(t + NUDGE_DELAY_S + 1) == []  # once

    # the usual order: kube-scheduler retries the pod itself (refused: another pod took the
    # room meanwhile): no nudge
    api2 = _one_gpu()
    st2 = ExtenderState(api2, KEY, clock=clock)
    _bind(st2, api2, "holder", "a")
    _bind(st2, api2, "other", "b")
    _, since = api2.watch("", 0.0)
    st2.requeue_note(api2.get_pod("default", "waiter0"), ["a", "b"], kept=False)
    api2.delete_pod("default", "holder")
    _follow(st2, api2, since)
    t = time.monotonic()
    assert st2.requeue_due(t) == []
    st2.requeue_note(api2.get_pod("default", "waiter0"), ["a", "b"], kept=False)
    assert st2.requeue_due(t + NUDGE_DELAY_S) == []
    st2.requeue_note(api2.get_pod("default", "waiter0"), ["a"], kept=True)
    assert len(st2.requeue) == 0


def test_few_writes_per_freed_node_by_priority_and_one_per_pod_per_interval() -> None:
    api = _one_gpu(waiters=5)
    state = ExtenderState(api, KEY, clock=clock)
    _bind(state, api, "holder", "a")
    _bind(state, api, "other", "b")
    _, since = api.watch("", 0.0)
    for k in range(5):
        w = api.get_pod("default", f"waiter{k}")
        if k == 3:
            w["spec"]["priority"] = 1000
        state.requeue_note(w, ["a", "b"], kept=False)
    api.delete_pod("default", "holder")
    since = _follow(state, api, since)
    t = time.monotonic()
    state.requeue_due(t)
    due = state.requeue_due(t + NUDGE_DELAY_S)
    assert len(due) == NUDGES_PER_NODE
    assert {d.name for d in due} == {"waiter3", "waiter0"}  # priority, then the longest waiting
    # the other GPU freed right after: the next pods, not those nudged a moment ago
    api.delete_pod("default", "other")
    _follow(state, api, since)
    state.requeue_due(t + NUDGE_DELAY_S + 0.5)
    due2 = state.requeue_due(t + 2 * NUDGE_DELAY_S + 0.5)
    assert {d.name for d in due2} == {"waiter1", "waiter2"}
    # a re-read frees "every node": the first two are nudged again only after NUDGE_EVERY_S
    state.rebuild()
    state.requeue_due(t + 3)
    assert {d.name for d in state.requeue_due(t + 3 + NUDGE_DELAY_S)} == {"waiter4"}
    state.rebuild()
    later = t + NUDGE_DELAY_S + NUDGE_EVERY_S + 1
    state.requeue_due(later)
    assert {d.name for d in state.requeue_due(later + NUDGE_DELAY_S)} == \
        {"waiter3", "waiter0"}


def test_no_nudge_where_the_pod_was_not_refused_where_it_does_not_fit_or_once_gone() -> None:
    api = _one_gpu(waiters=3)
    state = ExtenderState(api, KEY, clock=clock)
    _bind(state, api, "holder", "a")
    _bind(state, api, "other", "b")
    _, since = api.watch("", 0.0)
    state.requeue_note(api.get_pod("default", "waiter0"), ["a"], kept=False)  # a only
    big = pod("huge", 1000, gpus=2)
    api.add_pod(big)
    state.requeue_note(api.get_pod("default", "huge"), ["a", "b"], kept=False)  # never fits
    state.requeue_note(api.get_pod("default", "waiter1"), ["a", "b"], kept=False)
    api.delete_pod("default", "other")  # room on b: waiter0 was not refused there
    api.delete_pod("default", "waiter1")  # gone: forgotten
    _follow(state, api, since)
    t = time.monotonic()
    state.requeue_due(t)
    assert state.requeue_due(t + NUDGE_DELAY_S) == []
    assert {r.name for r in state.requeue._refused.values()} == {"waiter0", "huge"}


def test_only_the_leader_nudges() -> None:
    api = _one_gpu()
    state = ExtenderState(api, KEY, clock=clock)
    _bind(state, api, "holder", "a")
    _bind(state, api, "other", "b")
    other = LeaderElector(api, "gpuslice-system", "ext", "other", lambda: 1000.0, 15)
    state.elector = LeaderElector(api, "gpuslice-system", "ext", "me", lambda: 1000.0, 15)
    assert other.step() is True and state.elector.step() is False
    _, since = api.watch("", 0.0)
    state.requeue_note(api.get_pod("default", "waiter0"), ["a", "b"], kept=False)
    api.delete_pod("default", "holder")
    _follow(state, api, since)
    t = time.monotonic()
    assert state.requeue_due(t) == [] and state.requeue_due(t + NUDGE_DELAY_S) == []


def test_a_mig_pod_is_nudged_when_its_instance_is_freed() -> None:
    api = FakeApiServer()
    api.add_node(mig_node("m", [("MIG-3g", "3g.40gb", 0, 40192)]))
    api.add_pod(pod("holder", 400, isolation="mig"))
    api.add_pod(pod("waiter", 400, isolation="mig"))
    state = ExtenderState(api, KEY, clock=clock)
    _bind(state, api, "holder", "m")
    _, since = api.watch("", 0.0)
    state.requeue_note(api.get_pod("default", "waiter"), ["m"], kept=False)
    api.delete_pod("default", "holder")
    _follow(state, api, since)
    t = time.monotonic()
    state.requeue_due(t)
    assert [d.name for d in state.requeue_due(t + NUDGE_DELAY_S)] == ["waiter"]


def test_the_book_is_bounded_and_forgets_old_refusals() -> None:
    book = RequeueBook(kept=3, ttl_s=60.0)
    req = SliceRequest(1, 500)
    for k in range(5):
        book.refused({"metadata": {"name": f"p{k}", "uid": f"u{k}"}}, req, None, float(k))
    assert [e.name for e in book._refused.values()] == ["p2", "p3", "p4"]
    book.schedule(lambda r, n: [], 63.5)  # p2 and p3 refused more than 60 s before
    assert [e.name for e in book._refused.values()] == ["p4"]
    book.refused({"metadata": {"name": "x"}}, req, None, 0.0)
    assert len(book) == 1  # no UID: not kept


class _Flaky:
    """The fake API server whose pod writes fail as ``failures`` says, in order."""

    def __init__(self, api: FakeApiServer, failures: list[GpusliceError]) -> None:
        self.api, self.failures = api, failures

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def patch_pod_annotations(self, *args: Any) -> dict[str, Any]:
        if self.failures:
            raise self.failures.pop(0)
        return self.api.patch_pod_annotations(*args)


@pytest.mark.parametrize(("failures", "change", "result"), [
    ([], None, "sent"),
    ([ApiConflict("changed")], None, "sent"),  # read again once
    ([ApiConflict("changed"), ApiConflict("changed")], None, "failed"),
    ([GpusliceError("connection refused")], None, "failed"),
    ([], lambda api: api.delete_pod("default", "waiter0"), "gone"),
    ([], lambda api: api.bind("default", "waiter0", "uid-default-waiter0", "a"), "gone"),
])
def test_a_nudge_writes_once_on_a_pending_pod_and_logs_what_fails(
        failures: list[GpusliceError], change: Callable[[FakeApiServer], None] | None,
        result: str, caplog: pytest.LogCaptureFixture) -> None:
    api = _one_gpu()
    state = ExtenderState(api, KEY, clock=clock)
    state.requeue_note(api.get_pod("default", "waiter0"), ["a"], kept=False)
    (r,) = state.requeue._refused.values()
    if change is not None:
        change(api)
    _, since = api.watch("", 0.0)
    with caplog.at_level(logging.INFO, logger="gpuslice.extender"):
        assert nudge(_Flaky(api, list(failures)), r, "2026-12-06T00:00:00.000001Z") == result
    events, _ = api.watch(since, 0.0)
    if result == "sent":  # one write: one update of the pending pod
        assert _annotations(api, "waiter0")[REQUEUE_ANNOTATION] == \
            "2026-12-06T00:00:00.000001Z"
        assert [(e.type, e.obj["metadata"]["name"]) for e in events] == \
            [("MODIFIED", "waiter0")]
    else:  # nothing written
        assert events == []
    if result == "failed":
        assert any("not nudged" in rec.getMessage() for rec in caplog.records)
