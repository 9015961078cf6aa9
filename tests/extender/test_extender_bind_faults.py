"""The extender's bind when things go wrong: a bind killed or refused mid-way, a write whose
outcome is unknown, slow reads, a pod stale or changed between filter and bind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.assignment import ANNOTATION, verify
from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import (
    KEY,
    clock,
    node,
    pod,
    post,
    reasons,
    serving,
    small_cluster,
)


def test_a_bind_killed_before_its_write_leaves_nothing_and_binds_elsewhere() -> None:
    """The assignment and the node are one write (the Binding carries the annotation): an
    extender killed before it leaves the pod untouched and no share taken."""
    api = small_cluster()
    state = ExtenderState(api, KEY, clock=clock)
    p = api.get_pod("default", "big")
    real_bind = api.bind

    def dies(*_: object, **__: object) -> None:
        raise SystemExit("extender killed before its Binding")

    api.bind = dies  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        state.bind("default", "big", p["metadata"]["uid"], "a")
    api.bind = real_bind  # type: ignore[method-assign]
    assert ANNOTATION not in (api.get_pod("default", "big")["metadata"].get("annotations") or {})
    restarted = ExtenderState(api, KEY, clock=clock)
    assert sum(restarted.ledger.used_milli.values()) == 0
    assert restarted.bind("default", "big", p["metadata"]["uid"], "b") == ""
    assert sum(restarted.ledger.used_milli.values()) == 700
    bound = api.get_pod("default", "big")
    assert bound["spec"]["nodeName"] == "b" and verify(
        decode(bound["metadata"]["annotations"][ANNOTATION]), KEY)


def test_an_assignment_left_without_its_binding_can_be_retried_elsewhere() -> None:
    """A pod annotated but never bound (gpuslice 0.1.0 wrote the two separately and
    could die in between): the share is counted, and a bind to another node moves it."""
    api = small_cluster()
    state = ExtenderState(api, KEY, clock=clock)
    p = api.get_pod("default", "big")
    real_bind = api.bind

    def annotate_then_die(namespace: str, name: str, uid: str, node: str,
                          annotations: Any = None, resource_version: Any = None) -> None:
        api.patch_pod_annotations(namespace, name, dict(annotations or {}),
                                  str(resource_version))
        raise SystemExit("extender killed between the annotation and the Binding")

    api.bind = annotate_then_die  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        state.bind("default", "big", p["metadata"]["uid"], "a")
    api.bind = real_bind  # type: ignore[method-assign]
    restarted = ExtenderState(api, KEY, clock=clock)
    assert sum(restarted.ledger.used_milli.values()) == 700  # the annotation is counted ...
    assert restarted.bind("default", "big", p["metadata"]["uid"], "b") == ""  # ... and moved
    assert sum(restarted.ledger.used_milli.values()) == 700
    assert all(u.startswith("GPU-b-") for u, m in restarted.ledger.used_milli.items() if m)
    assert api.get_pod("default", "big")["spec"]["nodeName"] == "b"


def test_a_bind_completed_while_a_re_read_lists_pods_keeps_its_share() -> None:
    """The re-read's pod list was taken before the bind wrote its annotation: the new ledger
    must still hold it (found on the real control plane: an API server restart in a burst
    re-reads while binds complete, and their shares were handed out twice)."""
    api = small_cluster()
    api.add_pod(pod("late", 700))
    state = ExtenderState(api, KEY, clock=clock)
    late = api.get_pod("default", "late")
    real_list = api.list_pods

    def list_then_bind(node: str | None = None) -> list[dict[str, Any]]:
        pods = real_list(node)  # the snapshot the re-read works from
        assert state.bind("default", "late", late["metadata"]["uid"], "b") == ""
        return pods

    api.list_pods = list_then_bind  # type: ignore[method-assign]
    state.rebuild()
    api.list_pods = real_list  # type: ignore[method-assign]
    assert ("default", "late") in state.ledger.owners
    assert sum(state.ledger.used_milli.values()) == 700
    big = api.get_pod("default", "big")
    # the other 700 milli pod no longer fits a GPU of b that "late" holds
    assert state.bind("default", "big", big["metadata"]["uid"], "b") == ""
    used = state.ledger.used_milli
    assert all(m <= 1000 for m in used.values()) and sum(used.values()) == 1400
    state.rebuild()  # a later re-read sees the annotation itself and forgets the note
    assert not state._recent and sum(state.ledger.used_milli.values()) == 1400


def test_a_bind_whose_write_outcome_is_unknown_keeps_its_share_until_retried() -> None:
    from gpuslice.core.errors import GpusliceError

    api = small_cluster()
    state = ExtenderState(api, KEY, clock=clock)
    p = api.get_pod("default", "big")
    real_bind = api.bind

    def down(*_: object, **__: object) -> None:
        raise GpusliceError("connection refused (API server restarting)")

    api.bind = down  # type: ignore[method-assign]
    error = state.bind("default", "big", p["metadata"]["uid"], "b")
    assert "retry" in error
    assert sum(state.ledger.used_milli.values()) == 700  # held: it may have been written
    state.rebuild()
    assert sum(state.ledger.used_milli.values()) == 700  # a re-read keeps it in flight
    api.bind = real_bind  # type: ignore[method-assign]
    # the scheduler retries (elsewhere, here): the stale share is given back, not doubled
    assert state.bind("default", "big", p["metadata"]["uid"], "a") == ""
    assert sum(state.ledger.used_milli.values()) == 700
    assert all(u.startswith("GPU-a-") for u, m in state.ledger.used_milli.items() if m)


def test_bind_times_order_a_burst_within_one_second() -> None:
    """The device plugin executes a node's waiting assignments in bind order: the extender's
    clock must tell apart binds within one second, and sort as it runs."""
    from gpuslice.services.extender import bind_clock

    stamps = [bind_clock() for _ in range(200)]
    assert stamps == sorted(stamps)
    assert len(set(stamps)) > 100  # microseconds, not seconds
    assert all(s.endswith("Z") and "." in s for s in stamps)


class SlowReads(FakeApiServer):
    """The API server fake whose pod reads wait until ``release`` is set (an API server slow
    to answer the bind's first call)."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.release = threading.Event()
        self.waiting = threading.Event()

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        self.waiting.set()
        assert self.release.wait(10), "bind's pod read was never released"
        return super().get_pod(namespace, name)


def test_a_bind_reserves_before_its_api_calls_so_the_next_filter_sees_it() -> None:
    """kube-scheduler sends a pod's bind from its binding goroutine and goes on filtering the
    next pod. The bind's API calls run off the event loop; its share is reserved as the bind
    arrives, so the next filter (answered while the bind still waits on the API server)
    refuses the GPU the bind is taking."""
    api = SlowReads()
    api.add_node(node("a", "T4", 1))
    api.add_pod(pod("first", 700))
    api.add_pod(pod("second", 700))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            first = FakeApiServer.get_pod(api, "default", "first")
            second = FakeApiServer.get_pod(api, "default", "second")
            st, res = await post(s, url + "/filter", {"Pod": first, "NodeNames": ["a"]})
            assert res["NodeNames"] == ["a"]
            binding = asyncio.ensure_future(post(s, url + "/bind", {
                "PodName": "first", "PodNamespace": "default",
                "PodUID": first["metadata"]["uid"], "Node": "a"}))
            await asyncio.get_running_loop().run_in_executor(None, api.waiting.wait, 10)
            st, res = await post(s, url + "/filter", {"Pod": second, "NodeNames": ["a"]})
            assert res["NodeNames"] == [] and "300 milli free" in reasons(res)["a"], res
            api.release.set()
            st, res = await binding
            assert st == 200 and res["Error"] == "", res
            a = decode(FakeApiServer.get_pod(api, "default", "first")["metadata"][
                "annotations"][ANNOTATION])
            assert a.node == "a" and a.containers[0].gpus[0].milli == 700

    asyncio.run(serving(api, body))


class ReadBeforeWrite(FakeApiServer):
    """The API server fake where a pod read is answered with the pod as it was before the
    Binding write that ended meanwhile (a read and a write of one pod crossing)."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.read_taken = threading.Event()
        self.written = threading.Event()

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = super().get_pod(namespace, name)
        if not self.read_taken.is_set():
            self.read_taken.set()
            assert self.written.wait(10), "the other bind never wrote"
            import time

            time.sleep(0.2)  # that bind done, its pod no longer busy
        return pod

    def bind(self, namespace: str, name: str, uid: str, node: str,
             annotations: Any = None, resource_version: str | None = None) -> None:
        assert self.read_taken.wait(10), "the other bind never read the pod"
        super().bind(namespace, name, uid, node, annotations, resource_version)
        self.written.set()


def test_a_bind_sent_twice_at_once_keeps_the_share_the_first_one_wrote() -> None:
    """kube-scheduler's bind retried while the first is still writing: the second reads the
    pod before the first's Binding lands and decides after it. It must not take that read
    (no assignment yet) for a write whose outcome is unknown and give the written share back:
    the GPU would then take a second whole-GPU pod."""
    api = ReadBeforeWrite()
    api.add_node(node("a", "T4", 1))
    api.add_pod(pod("first", 1000))
    api.add_pod(pod("second", 1000))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            first = FakeApiServer.get_pod(api, "default", "first")
            _, res = await post(s, url + "/filter", {"Pod": first, "NodeNames": ["a"]})
            assert res["NodeNames"] == ["a"], res
            args = {"PodName": "first", "PodNamespace": "default",
                    "PodUID": first["metadata"]["uid"], "Node": "a"}
            answers = await asyncio.gather(post(s, url + "/bind", args),
                                           post(s, url + "/bind", args))
            assert [a[1]["Error"] for a in answers] == ["", ""], answers
            assert ("default", "first") in state.ledger.owners
            second = FakeApiServer.get_pod(api, "default", "second")
            _, res = await post(s, url + "/filter", {"Pod": second, "NodeNames": ["a"]})
            assert res["NodeNames"] == [] and "0 milli free" in reasons(res)["a"], res

    asyncio.run(serving(api, body))


@contextlib.contextmanager
def over(how: str) -> Iterator[tuple[FakeApiServer, Any]]:
    """The API server a test's extender talks to: the fake in-process (its binds written on
    the bind threads), or the REST fake through the Kubernetes client (the Binding written
    from the event loop by aiohttp, reads on threads)."""
    if how == "in-process":
        yield FakeApiServer(), None
        return
    pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube])")
    import tempfile

    from gpuslice.adapters.kube.client import KubeClient
    from tests.kube.helpers import EXTENDER
    from tests.kube.rest_fake import RestApiServer

    rest = RestApiServer().start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            client = KubeClient(str(rest.kubeconfig(Path(tmp) / "kubeconfig", EXTENDER)))
            yield rest, client
            client.close()
    finally:
        rest.stop()


@pytest.mark.parametrize("how", ["in-process", "rest"])
def test_a_bind_whose_filter_copy_is_stale_reads_the_pod_and_binds(how: str) -> None:
    """kube-scheduler requeues its copy of a pod, then writes the pod's status: the next
    filter can carry a resourceVersion older than the API server's. The Binding's precondition
    refuses it; the bind then reads the pod and binds it in the same call (refusing it would
    make every retry carry a stale copy again: measured in the cluster tier, a burst barely
    moved)."""
    with over(how) as (api, client):
        api.add_node(node("a", "T4", 1))
        api.add_pod(pod("p", 300))
        stale_copy_rebound(api, client)


def stale_copy_rebound(api: FakeApiServer, client: Any) -> None:

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            old = api.get_pod("default", "p")
            await post(s, url + "/filter", {"Pod": old, "NodeNames": ["a"]})
            api.patch_pod_annotations("default", "p", {"example.com/seen": "1"},
                                      old["metadata"]["resourceVersion"])
            _, res = await post(s, url + "/bind", {
                "PodName": "p", "PodNamespace": "default", "PodUID": old["metadata"]["uid"],
                "Node": "a"})
            assert res["Error"] == "", res
            got = api.get_pod("default", "p")
            assert got["spec"]["nodeName"] == "a"
            assert decode(got["metadata"]["annotations"][ANNOTATION]).containers[0].gpus[0] \
                .milli == 300
            assert dict(state.used_milli) == {"GPU-a-0": 300}

    asyncio.run(serving(api, body, client=client))


@pytest.mark.parametrize("how", ["in-process", "rest"])
def test_a_pod_changed_between_filter_and_bind_is_placed_from_what_bind_reads(
        how: str) -> None:
    """The share reserved on the loop comes from the pod the filter carried, and the bind
    writes it without reading the pod, its resourceVersion a precondition. A pod re-created
    under the same name with another request fails that write: the bind then reads the pod
    and places it as read, and the early reservation is given back (nothing held twice)."""
    with over(how) as (api, client):
        api.add_node(node("a", "T4", 1))
        api.add_pod(pod("p", 300))
        changed_pod_rebound(api, client)


def changed_pod_rebound(api: FakeApiServer, client: Any) -> None:

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            old = api.get_pod("default", "p")
            await post(s, url + "/filter", {"Pod": old, "NodeNames": ["a"]})
            api.delete_pod("default", "p")
            api.add_pod(pod("p", 600))  # the same UID (the fake's), another request
            fresh = api.get_pod("default", "p")
            assert fresh["metadata"]["uid"] == old["metadata"]["uid"]
            _, res = await post(s, url + "/bind", {
                "PodName": "p", "PodNamespace": "default", "PodUID": fresh["metadata"]["uid"],
                "Node": "a"})
            assert res["Error"] == "", res
            a = decode(api.get_pod("default", "p")["metadata"]["annotations"][ANNOTATION])
            assert a.containers[0].gpus[0].milli == 600
            assert dict(state.used_milli) == {"GPU-a-0": 600}

    asyncio.run(serving(api, body, client=client))
