"""The extender over real HTTP on loopback, with scheduler-shaped JSON and the API server fake:
its verbs, bad requests, a burst across a restart, its metrics and its heap."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

import aiohttp
import pytest

from gpuslice.adapters import eventloop
from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.assignment import ANNOTATION, verify
from gpuslice.services.extender import ExtenderState
from gpuslice.services.extender.metrics import OPEN_KEPT
from tests.extender.helpers import (
    KEY,
    MODELS,
    clock,
    node,
    pod,
    post,
    reasons,
    serving,
    small_cluster,
)


def test_filter_prioritize_bind_node_cache_capable() -> None:
    api = small_cluster()

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            p = api.get_pod("default", "big")
            st, res = await post(s, url + "/filter", {"Pod": p, "NodeNames": ["a", "b", "zz"],
                                                      "Nodes": None})
            assert st == 200 and res["Error"] == "" and res["NodeNames"] == ["a", "b"]
            assert "unknown" in reasons(res)["zz"]
            st, res = await post(s, url + "/bind", {"PodName": "big", "PodNamespace": "default",
                                                    "PodUID": p["metadata"]["uid"], "Node": "a"})
            assert st == 200 and res["Error"] == ""
            bound = api.get_pod("default", "big")
            assert bound["spec"]["nodeName"] == "a"
            a = decode(bound["metadata"]["annotations"][ANNOTATION])
            assert verify(a, KEY) and a.node == "a"
            assert [g.milli for c in a.containers for g in c.gpus] == [700]
            # a second 700 fits only on the other GPU of a, or on b
            api.add_pod(pod("big2", 700))
            api.add_pod(pod("big3", 700))
            p2 = api.get_pod("default", "big2")
            await post(s, url + "/bind", {"PodName": "big2", "PodNamespace": "default",
                                          "PodUID": p2["metadata"]["uid"], "Node": "a"})
            p3 = api.get_pod("default", "big3")
            st, res = await post(s, url + "/filter", {"Pod": p3, "NodeNames": ["a", "b"]})
            assert res["NodeNames"] == ["b"]
            assert "GPU 0 has 300 milli free, pod needs 700" in reasons(res)["a"]
            st, res = await post(s, url + "/prioritize", {"Pod": p3, "NodeNames": ["a", "b"]})
            assert st == 200 and {h["Host"] for h in res} == {"a", "b"}
            assert all(0 <= h["Score"] <= 10 for h in res)
            assert dict((h["Host"], h["Score"]) for h in res)["a"] == 0

    asyncio.run(serving(api, body))


def test_filter_with_node_objects_returns_node_list() -> None:
    api = small_cluster()

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            nodes = {"kind": "NodeList", "items": api.list_nodes()}
            st, res = await post(s, url + "/filter", {"Pod": pod("x", 300, model="A100-80GB"),
                                                      "Nodes": nodes})
            assert st == 200 and res["NodeNames"] is None
            assert [n["metadata"]["name"] for n in res["Nodes"]["items"]] == ["b"]
            assert "pod accepts A100-80GB" in reasons(res)["a"]
            # a pod that asks for no gpuslice resource is not filtered
            plain = {"metadata": {"name": "plain"}, "spec": {"containers": [{"name": "c"}]}}
            st, res = await post(s, url + "/filter", {"Pod": plain, "Nodes": nodes})
            assert len(res["Nodes"]["items"]) == 2

    asyncio.run(serving(api, body))


def test_hostile_requests_get_clear_errors_and_change_nothing() -> None:
    api = small_cluster()

    async def body(url: str, state: ExtenderState) -> None:
        before = dict(state.ledger.used_milli)
        async with aiohttp.ClientSession() as s:
            st, res = await post(s, url + "/filter", b"{not json")
            assert st == 400 and "not JSON" in res
            st, res = await post(s, url + "/filter", {"Pod": "x", "NodeNames": ["a"]})
            assert res["Error"].startswith("Pod: expected a Pod object")
            st, res = await post(s, url + "/filter", {"Pod": pod("x"), "NodeNames": [1, 2]})
            assert "NodeNames" in res["Error"]
            bad = pod("bad")
            bad["spec"]["containers"][0]["resources"]["limits"]["gpuslice.io/gpu-milli"] = "9000"
            st, res = await post(s, url + "/filter", {"Pod": bad, "NodeNames": ["a"]})
            assert "gpu-milli" in res["Error"]
            st, res = await post(s, url + "/bind", {"PodName": 3})
            assert "PodName: expected a non-empty string" in res["Error"]
            st, res = await post(s, url + "/filter", {"Pod": pod("x"), "Nodes": "x"})
            assert res["Error"].startswith("Nodes: expected a NodeList"), res
            st, res = await post(s, url + "/preempt", {"Pod": pod("x"), "NodeNameToVictims": {
                "a": {"Pods": [{"metadata": "x"}]}}})
            assert st == 400 and "NodeNameToVictims.a.Pods[]" in res["Error"], (st, res)
            huge = pod("huge")
            huge["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "1e300"
            for verb in ("filter", "prioritize"):
                st, res = await post(s, url + f"/{verb}", {"Pod": huge, "NodeNames": ["a"]})
                assert "containers[0] cpu: expected a quantity of at most 2^63-1" \
                    in res["Error"], res
            st, res = await post(s, url + "/bind", {"PodName": "nope", "PodNamespace": "default",
                                                    "PodUID": "u", "Node": "a"})
            assert "not found" in res["Error"]
            st, _ = await post(s, url + "/filter", b"x" * (9 * 1024 * 1024))
            assert st == 413
            # a pod carrying a hand-written assignment: not trusted, not counted
            p = api.add_pod(pod("forged", 1000))
            api.patch_pod_annotations("default", "forged", {ANNOTATION: '{"node": "a"}'},
                                      p["metadata"]["resourceVersion"])
            state.rebuild()
            assert any("forged" in pr for pr in state.problems)
            st, res = await post(s, url + "/filter", {"Pod": pod("y"), "NodeNames": ["a"]})
            assert res["NodeNames"] == ["a"]
        assert dict(state.ledger.used_milli) == before

    asyncio.run(serving(api, body))


def test_burst_with_restart_never_overallocates() -> None:
    """1,000 pods against 200 nodes (8 GPUs, mixed models) through filter, prioritize and bind
    with 16 concurrent clients; the extender is killed with requests in flight after 400 pods
    and a new one, rebuilt from the API server, takes the rest (and the interrupted ones)."""
    api = FakeApiServer()
    for i in range(200):
        api.add_node(node(f"n{i:03d}", MODELS[i % 4]))
    rnd = random.Random(5)
    shapes = [100, 250, 300, 470, 500, 810, 1000, 1000]
    for i in range(1000):
        milli = rnd.choice(shapes)
        gpus = rnd.choice([2, 4]) if milli == 1000 and rnd.random() < 0.1 else 1
        model = rnd.choice(MODELS) if rnd.random() < 0.2 else ""
        api.add_pod(pod(f"p{i:04d}", milli, gpus, model))
    outcome: dict[str, str] = {}
    all_nodes = [n["metadata"]["name"] for n in api.list_nodes()]

    async def schedule(url: str, queue: asyncio.Queue[str], retry: list[str]) -> None:
        async with aiohttp.ClientSession() as s:
            while not queue.empty():
                name = queue.get_nowait()
                try:
                    p = api.get_pod("default", name)
                    if p["spec"].get("nodeName"):
                        outcome[name] = "bound"
                        continue
                    _, f = await post(s, url + "/filter", {"Pod": p, "NodeNames": all_nodes})
                    if not f["NodeNames"]:
                        outcome[name] = "rejected: " + (next(iter(reasons(f).values()),
                                                             "") or "no node")
                        continue
                    _, scores = await post(s, url + "/prioritize",
                                           {"Pod": p, "NodeNames": f["NodeNames"]})
                    best = max(scores, key=lambda h: h["Score"])["Host"]
                    _, b = await post(s, url + "/bind", {
                        "PodName": name, "PodNamespace": "default",
                        "PodUID": p["metadata"]["uid"], "Node": best})
                    outcome[name] = "bound" if b["Error"] == "" else "bind error: " + b["Error"]
                except (aiohttp.ClientError, asyncio.CancelledError, ConnectionError):
                    retry.append(name)  # the extender died under this request
                    return

    async def phase(batch: list[str], kill_after: int | None) -> list[str]:
        retry: list[str] = []

        async def body(url: str, state: ExtenderState) -> None:
            queue: asyncio.Queue[str] = asyncio.Queue()
            for n in batch:
                queue.put_nowait(n)
            clients = [asyncio.create_task(schedule(url, queue, retry)) for _ in range(16)]
            if kill_after is None:
                await asyncio.gather(*clients)
                return
            while len(outcome) < kill_after:
                await asyncio.sleep(0.005)
            # kill: stop serving with requests in flight; what is left goes to the next one
            retry.extend(n for n in batch if n not in outcome)

        await serving(api, body)
        return retry

    names = [f"p{i:04d}" for i in range(1000)]
    left = asyncio.run(phase(names, kill_after=400))
    asyncio.run(phase(sorted(set(left) - set(outcome)) + sorted(
        n for n in set(left) if n in outcome and outcome[n] != "bound"), None))

    assert len(outcome) == 1000
    assert all(v == "bound" or v.startswith(("rejected: ", "bind error: "))
               for v in outcome.values())
    used: dict[str, int] = defaultdict(int)
    bound = 0
    for p in api.list_pods():
        ann = p["metadata"].get("annotations", {}).get(ANNOTATION)
        if not p.get("spec", {}).get("nodeName"):
            continue
        a = decode(ann)
        assert verify(a, KEY) and p["spec"]["nodeName"] == a.node
        bound += 1
        for c in a.containers:
            for g in c.gpus:
                assert g.uuid.startswith(f"GPU-{a.node}-")
                used[g.uuid] += g.milli
    assert bound == sum(v == "bound" for v in outcome.values()) > 500
    assert max(used.values()) <= 1000  # zero over-allocated GPUs
    restarted = ExtenderState(api, KEY, clock=clock)
    held = {k: v for k, v in restarted.ledger.used_milli.items() if v}
    assert held == dict(used)  # nothing lost, nothing doubled


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
def test_missing_pod_field(verb: str) -> None:
    api = small_cluster()

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            _, res = await post(s, f"{url}/{verb}", {"NodeNames": ["a"]})
            text = res["Error"] if isinstance(res, dict) else res
            assert "Pod" in text

    asyncio.run(serving(api, body))


def test_metrics_show_latency_rejections_by_kind_binds_and_the_ledger() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from gpuslice.services.extender.metrics import rejection_kind

    api = small_cluster()  # a: 2 x T4, b: 2 x A100-80GB; pod "big" asks 700 milli
    api.add_pod(pod("a100", 300, model="A100-80GB"))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            big = api.get_pod("default", "big")
            await post(s, url + "/filter", {"Pod": big, "NodeNames": ["a", "b", "zz"]})
            await post(s, url + "/bind", {"PodName": "big", "PodNamespace": "default",
                                          "PodUID": big["metadata"]["uid"], "Node": "b"})
            await post(s, url + "/bind", {"PodName": "big", "PodNamespace": "default",
                                          "PodUID": "wrong-uid", "Node": "b"})
            a100 = api.get_pod("default", "a100")
            await post(s, url + "/filter", {"Pod": a100, "NodeNames": ["a", "b"]})
            await post(s, url + "/prioritize", {"Pod": a100, "NodeNames": ["b"]})
            await post(s, url + "/filter", b"not json")
            async with s.get(url + "/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
        got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                got[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
        assert got[("gpuslice_extender_filter_nodes_total", (("result", "kept"),))] == 3
        assert got[("gpuslice_extender_filter_nodes_total", (("result", "rejected"),))] == 2
        assert got[("gpuslice_extender_rejections_total", (("kind", "no-inventory"),))] == 1
        assert got[("gpuslice_extender_rejections_total", (("kind", "gpu-model"),))] == 1
        assert got[("gpuslice_extender_binds_total", (("result", "bound"),))] == 1
        assert got[("gpuslice_extender_binds_total", (("result", "refused"),))] == 1
        assert got[("gpuslice_extender_bad_requests_total", (("verb", "filter"),))] == 1
        assert got[("gpuslice_extender_request_seconds_count", (("verb", "filter"),))] == 3
        assert got[("gpuslice_extender_request_seconds_count", (("verb", "prioritize"),))] == 1
        # the one bind whose filter was seen wrote from the loop, and its write was timed
        assert got[("gpuslice_extender_bind_write_seconds_count", ())] == 1
        assert got[("gpuslice_extender_node_allocated_milli", (("node", "b"),))] == 700
        assert got[("gpuslice_extender_node_capacity_milli", (("node", "a"),))] == 2000
        assert got[("gpuslice_extender_assignments", ())] == 1
        assert got[("gpuslice_extender_leader", ())] == 1

    asyncio.run(serving(api, body))
    for reason, kind in [("GPU 1 has 2048 MiB free, pod needs 4096", "memory"),
                         ("GPU 0 has 300 milli free, pod needs 700 (the most free GPU)",
                          "compute"),
                         ("1 of 2 GPUs free enough, pod needs 2", "gpu-count"),
                         ("node has no GPU", "no-gpu"),
                         ("no free MIG instance of >= 3g with 0 MiB (free: none)", "mig"),
                         ("something new", "other")]:
        assert rejection_kind(reason) == kind


@pytest.mark.parametrize("run", [asyncio.run, eventloop.run], ids=["asyncio", "uvloop"])
def test_connections_are_counted_once_each_so_a_client_that_drops_them_shows(
        run: Any) -> None:
    """kube-scheduler's extender client keeps at most two idle connections (Go's
    DefaultMaxIdleConnsPerHost: pkg/scheduler/extender.go makeTransport sets none), so
    concurrent binds open new ones, each a TLS handshake: the counter shows that rate. On
    asyncio's loop and on uvloop's (the command's), past the connections kept."""
    api = small_cluster()

    async def count(url: str) -> float:
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
        return float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("gpuslice_extender_connections_total ")))

    async def body(url: str, state: ExtenderState) -> None:
        big = api.get_pod("default", "big")
        async with aiohttp.ClientSession() as s:  # keep-alive: one connection
            for _ in range(3):
                await post(s, url + "/filter", {"Pod": big, "NodeNames": ["a", "b"]})
        assert await count(url) == 1  # /metrics is not a scheduler call: not counted
        for _ in range(OPEN_KEPT + 2):  # a connection per session
            async with aiohttp.ClientSession() as s:
                await post(s, url + "/filter", {"Pod": big, "NodeNames": ["a", "b"]})
        assert await count(url) == OPEN_KEPT + 3

    run(serving(api, body))


def test_serving_moves_the_heap_out_of_full_collections_on_schedule() -> None:
    """``serve`` with a heap (as ``gpuslice extender`` passes one) settles it every
    ``settle_every_s`` while it answers, and stops doing so when it stops."""
    from gpuslice.services.extender import serve
    from gpuslice.services.heap import LongLivedHeap

    class Counted(LongLivedHeap):
        def __init__(self) -> None:
            super().__init__()
            self.settles = 0

        def settled(self) -> None:  # counted, not frozen: the test process's heap is left
            self.settles += 1

    heap = Counted()
    api = small_cluster()

    async def main() -> None:
        state = ExtenderState(api, KEY, clock=clock, narrow=False)
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        server = asyncio.create_task(serve(state, "127.0.0.1", 0, ready=started.set_result,
                                           stop=stop, heap=heap, settle_every_s=0.02))
        url = f"http://127.0.0.1:{await asyncio.wait_for(started, 10)}"
        async with aiohttp.ClientSession() as s:
            for _ in range(50):
                if heap.settles >= 3:
                    break
                st, res = await post(s, url + "/filter", {"Pod": pod("p", 300),
                                                          "NodeNames": ["a", "b"]})
                assert st == 200 and sorted(res["NodeNames"]) == ["a", "b"]
                await asyncio.sleep(0.02)
        assert heap.settles >= 3
        stop.set()
        await asyncio.wait_for(server, 10)
        after = heap.settles
        await asyncio.sleep(0.1)
        assert heap.settles == after  # the settling task ended with the server

    eventloop.run(main())


def test_an_extender_that_cannot_reach_the_api_server_says_so_and_when_it_is_back(
        caplog: pytest.LogCaptureFixture) -> None:
    """Not Ready until it has read the cluster, and silent about why: an extender whose API
    server does not answer now logs that it waits, for what, and since when (at once and
    every 30 s), and when it answers again (issue 57: the log was empty until the liveness
    probe restarted it)."""
    import logging

    from gpuslice.core.errors import GpusliceError
    from gpuslice.services.extender.http import serve

    api = small_cluster()
    real_watch = api.watch
    down = {"on": True}

    def watch(since: str, timeout_s: float) -> Any:
        if down["on"]:
            raise GpusliceError("the API server at https://10.96.0.1:443 did not answer: "
                                "timed out")
        return real_watch(since, timeout_s)

    api.watch = watch  # type: ignore[method-assign]

    async def main() -> None:
        state = ExtenderState(api, KEY, clock=clock, narrow=False)
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        server = asyncio.create_task(serve(state, "127.0.0.1", 0, ready=started.set_result,
                                           stop=stop))
        await asyncio.wait_for(started, 10)
        for _ in range(100):
            if any("waiting for the API server" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        down["on"] = False
        for _ in range(100):
            if any("answers again" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(server, 10)

    with caplog.at_level(logging.INFO, logger="gpuslice.extender"):
        eventloop.run(main())
    said = [r.getMessage() for r in caplog.records]
    waiting = [m for m in said if "waiting for the API server" in m]
    assert waiting and "until it answers" in waiting[0]
    assert "10.96.0.1:443 did not answer" in waiting[0]
    assert any("the API server answers again" in m for m in said)
