"""The extender over real HTTP on loopback, with scheduler-shaped JSON and the API server fake."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gpuslice.adapters import eventloop
from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer, WatchEvent
from gpuslice.core.assignment import ANNOTATION, verify
from gpuslice.services.extender import ExtenderState, make_app
from gpuslice.services.extender.metrics import OPEN_KEPT

KEY = b"test-key-0123456789abcdef"
MODELS = ["T4", "V100M32", "A100-80GB", "H100-SXM"]


def node(name: str, model: str, gpus: int = 8) -> dict[str, Any]:
    inv = [{"uuid": f"GPU-{name}-{i}", "index": i, "model": model, "memoryMiB": 16384}
           for i in range(gpus)]
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"gpuslice.io/inventory": json.dumps(inv)}}}


def mig_node(name: str, instances: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """A node with one MIG-enabled A100-80GB (GPU-m0) holding ``instances``: (UUID, profile,
    start, MiB)."""
    inv = [{"uuid": "GPU-m0", "index": 0, "model": "A100-80GB", "memoryMiB": 81920,
            "mig": [{"uuid": u, "profile": p, "start": st, "memoryMiB": mib}
                    for u, p, st, mib in instances]}]
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"gpuslice.io/inventory": json.dumps(inv)}}}


def pod(name: str, milli: int = 500, gpus: int = 1, model: str = "",
        ns: str = "default", isolation: str = "") -> dict[str, Any]:
    ann = {"gpuslice.io/gpu-model": model} if model else {}
    if isolation:
        ann["gpuslice.io/isolation"] = isolation
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": ann},
            "spec": {"containers": [{"name": "main", "resources": {
                "limits": {"gpuslice.io/gpu": str(gpus), "gpuslice.io/gpu-milli": str(milli)},
                "requests": {"cpu": "500m", "memory": "1Gi"}}}]}}


def reasons(res: dict[str, Any]) -> dict[str, str]:
    """Every node a filter answer refused and why, resolvable by preemption or not."""
    return {**res["FailedNodes"], **res["FailedAndUnresolvableNodes"]}


def clock() -> str:
    return "2026-11-22T18:00:00Z"


async def serving(api: FakeApiServer,
                  body: Callable[[str, ExtenderState], Awaitable[None]],
                  narrow: bool = False, client: Any = None) -> None:
    """The extender over HTTP on loopback while ``body`` runs; its filter keeps every node
    that fits unless ``narrow`` (the deployed default, tested on its own). ``client``: what
    the extender talks to ``api`` through (by default the fake itself, in-process)."""
    state = ExtenderState(client or api, KEY, clock=clock, narrow=narrow)
    runner = web.AppRunner(make_app(state))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await body(f"http://127.0.0.1:{port}", state)
    finally:
        await runner.cleanup()


async def post(session: aiohttp.ClientSession, url: str, doc: Any) -> tuple[int, Any]:
    async with session.post(url, data=json.dumps(doc) if not isinstance(doc, bytes) else doc,
                            headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def bound(session: aiohttp.ClientSession, url: str, api: FakeApiServer,
                pod_obj: dict[str, Any], node_name: str) -> Any:
    """Bind over HTTP (it must succeed); the assignment written on the pod."""
    meta = pod_obj["metadata"]
    st, res = await post(session, url + "/bind", {
        "PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
        "Node": node_name})
    assert st == 200 and res["Error"] == "", res
    return decode(api.get_pod(meta["namespace"], meta["name"])["metadata"]["annotations"]
                  [ANNOTATION])


def small_cluster() -> FakeApiServer:
    api = FakeApiServer()
    api.add_node(node("a", "T4", 2))
    api.add_node(node("b", "A100-80GB", 2))
    api.add_pod(pod("big", 700))
    return api


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
            assert "PodName: expected a string" in res["Error"]
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


def test_deleted_or_finished_pods_give_their_share_back_on_resync() -> None:
    api = small_cluster()
    api.add_pod(pod("done", 700))
    state = ExtenderState(api, KEY, clock=clock)
    for name in ("big", "done"):
        p = api.get_pod("default", name)
        assert state.bind("default", name, p["metadata"]["uid"], "a") == ""
    assert sum(state.ledger.used_milli.values()) == 1400
    api.delete_pod("default", "big")
    finished = api.get_pod("default", "done")
    finished["status"] = {"phase": "Succeeded"}
    api.delete_pod("default", "done")
    api.add_pod(finished)
    state.rebuild()
    assert sum(state.ledger.used_milli.values()) == 0


def test_watch_events_keep_the_ledger_current() -> None:
    api = small_cluster()
    state = ExtenderState(api, KEY, clock=clock)
    _, since = api.watch("", 0.0)
    p = api.get_pod("default", "big")
    assert state.bind("default", "big", p["metadata"]["uid"], "a") == ""
    # a second extender (restarted from the same API server) learns the bind from the watch
    other = ExtenderState(FakeApiServer(), KEY, clock=clock)
    other.api = api
    other.rebuild()
    assert sum(other.ledger.used_milli.values()) == 700
    api.delete_pod("default", "big")
    events, since = api.watch(since, 1.0)
    assert [e.type for e in events][-1] == "DELETED"
    for ev in events:
        state.apply(ev)
        other.apply(ev)
    assert sum(state.ledger.used_milli.values()) == 0
    assert sum(other.ledger.used_milli.values()) == 0
    none, same = api.watch(since, 0.05)  # nothing new: waits, then returns empty
    assert none == [] and same == since


def test_node_events_re_read_only_when_gpu_inventory_or_cordon_change() -> None:
    """The kubelet updates its node's status every few minutes, other controllers patch
    labels: thousands of nodes must not each trigger a full re-read; a node that joins, leaves
    or publishes a new inventory must, once per batch."""
    api = small_cluster()
    state = ExtenderState(api, KEY, clock=clock)
    reads = []
    real = api.list_nodes
    api.list_nodes = lambda: reads.append(1) or real()  # type: ignore[method-assign]
    _, since = api.watch("", 0.0)
    api.patch_node("a", {"topology.kubernetes.io/zone": "z1"}, {"kubelet/heartbeat": "1"})
    events, since = api.watch(since, 1.0)
    state.apply_all(events)
    assert reads == []
    api.add_node(node("c", "H100-SXM", 4))
    api.patch_node("b", {}, {"gpuslice.io/cordoned-gpus": "GPU-b-0"})
    events, since = api.watch(since, 1.0)
    assert [e.kind for e in events] == ["Node", "Node"]
    state.apply_all(events)
    assert len(reads) == 1
    assert "c" in state.inv.index and "GPU-b-0" in state.cordoned
    state.apply(WatchEvent("DELETED", "Node", api.get_node("c")))
    assert len(reads) == 2


def test_only_the_lease_holder_binds_and_a_standby_takes_over() -> None:
    from gpuslice.services.leader import LeaderElector

    api = small_cluster()
    api.add_pod(pod("second", 300))
    now = [1000.0]
    a = ExtenderState(api, KEY, clock=clock)
    b = ExtenderState(api, KEY, clock=clock)
    a.elector = LeaderElector(api, "gpuslice-system", "ext", "a", lambda: now[0], 15)
    b.elector = LeaderElector(api, "gpuslice-system", "ext", "b", lambda: now[0], 15)
    assert a.elector.step() is True
    assert b.elector.step() is False
    p = api.get_pod("default", "big")
    assert "not the leader" in b.bind("default", "big", p["metadata"]["uid"], "a")
    assert a.bind("default", "big", p["metadata"]["uid"], "a") == ""
    now[0] += 10
    assert a.elector.step() is True and b.elector.step() is False  # renewed in time
    now[0] += 20  # a stops renewing (it died)
    assert b.elector.step() is True
    lease = api.get_lease("gpuslice-system", "ext")
    assert lease is not None and lease["spec"]["holderIdentity"] == "b"
    assert lease["spec"]["leaseTransitions"] == 1
    b.rebuild()
    p2 = api.get_pod("default", "second")
    assert b.bind("default", "second", p2["metadata"]["uid"], "a") == ""
    assert b.ledger.free("GPU-a-0")[0] + b.ledger.free("GPU-a-1")[0] == 1000  # 700 + 300 taken


def test_every_replica_is_ready_the_leader_labels_its_pod_and_hands_over_at_once() -> None:
    """With two replicas behind one Service, kube-scheduler must reach the leader: both are
    Ready (``/readyz``: readiness is health, not leadership) and live, and the leader labels
    its own pod, which the Service selects. A leader told to stop gives its Lease up and takes
    its label off, and the follower leads and labels itself at its next step instead of after
    the Lease lapses."""
    import time

    from gpuslice.services.extender import LEADER_LABEL, serve
    from gpuslice.services.leader import LeaderElector, LeaderLabel

    ns = "gpuslice-system"
    api = small_cluster()
    states = {n: ExtenderState(api, KEY, clock=clock) for n in ("a", "b")}
    labels = {}
    for n, st in states.items():  # renewed every second, lapsing after 3 s
        st.elector = LeaderElector(api, ns, "ext", n, time.time, 3.0)
        # a restarted container: its pod still carries the label of its previous life
        api.add_pod({"metadata": {"name": f"ext-{n}", "namespace": ns,
                                  "labels": {"app.kubernetes.io/name": "gpuslice-extender",
                                             LEADER_LABEL: "leader"}},
                     "spec": {"containers": [{"name": "extender"}]}})
        labels[n] = LeaderLabel(api, ns, f"ext-{n}", LEADER_LABEL)

    def labelled() -> list[str]:
        return sorted(n for n in states if (api.get_pod(ns, f"ext-{n}")["metadata"]
                                            .get("labels") or {}).get(LEADER_LABEL) == "leader")

    async def main() -> None:
        ports: dict[str, int] = {}
        stops = {n: asyncio.Event() for n in states}
        tasks = {n: asyncio.create_task(serve(
            st, "127.0.0.1", 0, ready=lambda port, n=n: ports.__setitem__(n, port),  # type: ignore[misc]
            stop=stops[n], leader_label=labels[n])) for n, st in states.items()}

        async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
            end = time.monotonic() + timeout_s
            while not check():
                assert time.monotonic() < end, what
                await asyncio.sleep(0.05)

        def lead() -> list[str]:
            return [n for n, st in states.items() if st.elector and st.elector.leader]

        await until(lambda: len(ports) == 2 and len(lead()) == 1, "one leader")
        (leader,) = lead()
        follower = "b" if leader == "a" else "a"
        # the follower took the stale label off, the leader carries it
        await until(lambda: labelled() == [leader], "only the leader's pod labelled")
        async with aiohttp.ClientSession() as session:
            async def get(n: str, path: str) -> tuple[int, str]:
                async with session.get(f"http://127.0.0.1:{ports[n]}{path}") as r:
                    return r.status, await r.text()

            assert await get(leader, "/readyz") == (200, "ok: leader")
            status, text = await get(follower, "/readyz")
            assert status == 200 and text.startswith("ok: follower"), text
            assert [(await get(n, "/healthz"))[0] for n in states] == [200, 200]
            stops[leader].set()
            await asyncio.wait_for(tasks[leader], 5)
            el = states[leader].elector
            assert el is not None and el.released
            assert labels[leader].marked is False
            lease = api.get_lease(ns, "ext")
            assert lease is not None and lease["spec"]["holderIdentity"] in ("", follower)
            # the follower takes over at its next step (1 s), not after the lease's 3 s
            t0 = time.monotonic()
            await until(lambda: lead() == [follower], "the follower leads", 2.5)
            assert time.monotonic() - t0 < 2.5
            await until(lambda: labelled() == [follower], "the new leader's pod labelled", 2.0)
            assert await get(follower, "/readyz") == (200, "ok: leader")
        stops[follower].set()
        await asyncio.wait_for(tasks[follower], 5)
        assert labelled() == []

    asyncio.run(main())


def test_a_label_write_that_fails_is_tried_again_and_never_put_back_after_release() -> None:
    """The leader's label is best effort: a failed write is logged and tried again at the
    next call (the next election step); after :meth:`release`, no call puts it back."""
    from gpuslice.core.errors import GpusliceError
    from gpuslice.services.leader import LeaderLabel

    api = small_cluster()
    api.add_pod({"metadata": {"name": "ext-a", "namespace": "gpuslice-system"},
                 "spec": {"containers": [{"name": "extender"}]}})
    fail = [True]
    patch = api.patch_pod_labels

    def flaky(*args: Any, **kw: Any) -> dict[str, Any]:
        if fail[0]:
            raise GpusliceError("API server: 503 ServiceUnavailable")
        return patch(*args, **kw)

    api.patch_pod_labels = flaky  # type: ignore[method-assign]
    now = [0.0]
    label = LeaderLabel(api, "gpuslice-system", "ext-a", "gpuslice.io/extender-role",
                        refresh_s=60, clock=lambda: now[0])

    def carries() -> bool:
        return (api.get_pod("gpuslice-system", "ext-a")["metadata"].get("labels") or {}
                ).get("gpuslice.io/extender-role") == "leader"

    assert label.sync(True) is False and label.failures == 1 and not carries()
    assert label.sync(True) is False and label.failures == 2
    fail[0] = False
    assert label.sync(True) is True and label.failures == 0 and carries()
    # someone took it off: seen at the next read (every refresh_s), and put back
    api.patch_pod_labels("gpuslice-system", "ext-a", {"gpuslice.io/extender-role": None})
    assert label.sync(True) is True and not carries()  # the last write is trusted meanwhile
    now[0] += 61
    assert label.sync(True) is True and carries()
    assert label.release() is True and not carries()
    assert label.sync(True) is True and not carries()  # released: never labelled again


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


def test_mig_isolation_gets_a_named_instance_and_the_reasons_when_none_is_free() -> None:
    api = FakeApiServer()
    api.add_node(node("plain", "A100-80GB", 1))
    api.add_node(mig_node("mig", [("MIG-a", "3g.40gb", 4, 40192), ("MIG-b", "4g.40gb", 0, 40192)]))
    for n in ("m1", "m2", "m3"):
        api.add_pod(pod(n, 429, model="A100-80GB", isolation="mig"))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            starts = []
            for n in ("m1", "m2"):
                stored = api.get_pod("default", n)
                _st, res = await post(s, url + "/filter", {"Pod": stored,
                                                          "NodeNames": ["plain", "mig"]})
                assert res["NodeNames"] == ["mig"]
                assert "no MIG instance" in reasons(res)["plain"]
                a = await bound(s, url, api, stored, "mig")
                share = a.containers[0].gpus[0]
                assert a.containers[0].mode.value == "mig" and share.uuid == "GPU-m0"
                starts.append((share.mig_profile, share.mig_start))
            # the tightest instance first (3g for a 3g-sized request), then the 4g
            assert starts == [("3g.40gb", 4), ("4g.40gb", 0)]
            stored = api.get_pod("default", "m3")
            _, res = await post(s, url + "/filter", {"Pod": stored, "NodeNames": ["mig"]})
            assert res["NodeNames"] == []
            assert "no free MIG instance of >= 3g" in reasons(res)["mig"]

    asyncio.run(serving(api, body))


def test_mps_slices_go_inside_mig_instances_of_a_mig_enabled_gpu() -> None:
    """A MIG-enabled GPU has no whole-GPU device: MPS slices share its instances (best fit),
    an instance with MPS tenants is not given to a MIG-isolated pod, and nothing asks for the
    GPU whole."""
    api = FakeApiServer()
    api.add_node(mig_node("mig", [("MIG-3g", "3g.40gb", 0, 40192), ("MIG-2g", "2g.20gb", 4, 19968),
                                  ("MIG-1g", "1g.10gb", 6, 9728)]))
    api.add_node(node("plain", "T4", 1))
    for n in ("s1", "s2"):
        api.add_pod(pod(n, 200, model="A100-80GB"))
    api.add_pod(pod("whole", 1000, model="A100-80GB"))
    api.add_pod(pod("big", 600, model="A100-80GB"))
    api.add_pod(pod("mig3", 429, model="A100-80GB", isolation="mig"))
    planned = pod("planned", 100, model="A100-80GB")
    planned["metadata"]["annotations"]["gpuslice.io/mig-profile"] = "3g.40gb"
    api.add_pod(planned)
    api.add_pod(pod("unplanned", 130, model="A100-80GB"))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            placed = []
            for n in ("s1", "s2"):
                stored = api.get_pod("default", n)
                _st, res = await post(s, url + "/filter", {"Pod": stored, "NodeNames": ["mig"]})
                assert res["NodeNames"] == ["mig"], res
                _st, res = await post(s, url + "/prioritize", {"Pod": stored,
                                                              "NodeNames": ["mig"]})
                assert res[0]["Score"] > 0
                a = await bound(s, url, api, stored, "mig")
                share = a.containers[0].gpus[0]
                assert a.containers[0].mode.value == "mps" and share.milli == 200
                # no gpu-memory named: its share of the instance's memory (200 of 285 or 428)
                assert share.memory_mib in (200 * 19968 // 285, 200 * 40192 // 428)
                placed.append((share.uuid, share.mig_profile, share.mig_start))
            # 200 milli: the 2g (285) fits tightest; the second no longer fits there: the 3g
            assert placed == [("GPU-m0", "2g.20gb", 4), ("GPU-m0", "3g.40gb", 0)]
            for name, why in (("whole", "GPU 0 has 0 milli free, pod needs 1000 (the most free "
                                        "GPU of the node); 1 GPU(s) MIG-enabled: no whole-GPU "
                                        "exclusive slice there"),
                              ("big", "MPS inside MIG instances: none has 600 milli and its "
                                      "share of the memory free (3g.40gb@0 (228 milli, 21411 "
                                      "MiB free), 2g.20gb@4 (85 milli, 5956 MiB free), "
                                      "1g.10gb@6"),
                              ("mig3", "no free MIG instance of >= 3g")):
                stored = api.get_pod("default", name)
                _, res = await post(s, url + "/filter", {"Pod": stored, "NodeNames": ["mig"]})
                assert res["NodeNames"] == [] and why in reasons(res)["mig"], res
            # a slice the planner sized for a 3g goes to a 3g with room (best fit alone would
            # take the 1g); another to the tightest that fits
            for name, want in (("planned", ("3g.40gb", 0)), ("unplanned", ("1g.10gb", 6))):
                a = await bound(s, url, api, api.get_pod("default", name), "mig")
                share = a.containers[0].gpus[0]
                assert (share.mig_profile, share.mig_start) == want
        # a restarted extender derives the same instance use from the assignments
        again = ExtenderState(api, KEY, clock=clock)
        rooms = {(r.profile, r.start): r for r in again._mig_rooms(0, frozenset())}
        assert (rooms[("2g.20gb", 4)].used_milli, rooms[("3g.40gb", 0)].used_milli,
                rooms[("1g.10gb", 6)].used_milli) == (200, 300, 130)

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


def test_preempt_keeps_the_schedulers_victims_and_drops_nodes_that_cannot_fit() -> None:
    api = FakeApiServer()
    api.add_node(node("a", "A100-80GB", 2))
    api.add_node(node("b", "A100-80GB", 1))
    for name, milli in (("low1", 500), ("low2", 300), ("low3", 400), ("low4", 600),
                        ("low5", 1000)):
        api.add_pod(pod(name, milli))
    api.add_pod(pod("urgent", 600))

    async def body(url: str, state: ExtenderState) -> None:
        uid = {}
        async with aiohttp.ClientSession() as s:
            for name, where in (("low1", "a"), ("low2", "a"), ("low3", "a"), ("low4", "a"),
                                ("low5", "b")):
                a = await bound(s, url, api, api.get_pod("default", name), where)
                uid[name] = a.pod_uid
            urgent = api.get_pod("default", "urgent")
            meta = {"a": {"Pods": [{"UID": uid[n]} for n in ("low1", "low2", "low3", "low4")]
                          + [{"UID": "cpu-only-pod"}], "NumPDBViolations": 1},
                    "b": {"Pods": [], "NumPDBViolations": 0},
                    "zz": {"Pods": [{"UID": "x"}], "NumPDBViolations": 0}}
            st, res = await post(s, url + "/preempt", {"Pod": urgent,
                                                       "NodeNameToMetaVictims": meta})
            assert st == 200, res
            # on a the pod fits once the scheduler's victims go: every one of them stays
            # (it chose them for what it counts, and needs them all); b frees nothing without
            # victims and has none of lower priority to add; zz is unknown
            assert res == {"NodeNameToMetaVictims": {"a": {
                "Pods": [{"UID": uid[n]} for n in ("low1", "low2", "low3", "low4")]
                + [{"UID": "cpu-only-pod"}], "NumPDBViolations": 1}}}
            full = {"b": {"Pods": [api.get_pod("default", "low5")], "NumPDBViolations": 0}}
            st, res = await post(s, url + "/preempt", {"Pod": urgent, "NodeNameToVictims": full})
            assert res["NodeNameToMetaVictims"] == {
                "b": {"Pods": [{"UID": uid["low5"]}], "NumPDBViolations": 0}}
            st, res = await post(s, url + "/preempt", {"Pod": urgent,
                                                       "NodeNameToMetaVictims": ["a"]})
            assert st == 400 and "NodeNameToMetaVictims" in str(res)
            st, res = await post(s, url + "/preempt", {"Pod": urgent, "NodeNameToMetaVictims": {
                "a": {"Pods": [{"name": "no uid"}]}}})
            assert st == 400 and "pods with their UID" in str(res)
        assert sum(state.ledger.used_milli.values()) == 2800  # preempt changed nothing

    asyncio.run(serving(api, body))


def test_victims_the_extender_adds_count_their_disruption_budgets_and_spare_them_first(
        ) -> None:
    """kube-scheduler picks victims for what it counts (here one CPU-only pod per node; it
    counts GPU share and memory per node, not per GPU) and the extender adds those the GPUs
    need:
    pods whose PodDisruptionBudget allows no disruption are taken last and counted as
    violations (filterPodsWithPDBViolation, defaultpreemption/default_preemption.go), so that
    pickOneNodeForPreemption (preemption.go) prefers the node that violates none; the list
    stays highest priority first, as it reads Pods[0] as the highest."""
    api = FakeApiServer()
    for n in ("a", "b", "c"):
        api.add_node(node(n, "A100-80GB", 1))
    placed = {"a": [("guard-0", 1, "guarded"), ("guard-1", 1, "guarded")],
              "b": [("free-0", 1, "free"), ("free-1", 1, "free")],
              "c": [("guard-2", 1, "guarded"), ("loose", 5, "free")]}
    for where in placed.values():
        for name, prio, tier in where:
            p = pod(name, 500)
            p["metadata"]["labels"] = {"tier": tier}
            p["spec"]["priority"] = prio
            api.add_pod(p)
    api.add_pdb({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                 "metadata": {"name": "guard", "namespace": "default"},
                 "spec": {"minAvailable": 3,
                          "selector": {"matchExpressions": [
                              {"key": "tier", "operator": "In", "values": ["guarded"]}]}},
                 "status": {"disruptionsAllowed": 0, "currentHealthy": 3}})
    whole = pod("urgent", 1000)
    whole["spec"]["priority"] = 100
    half = pod("half", 500)
    half["spec"]["priority"] = 100
    api.add_pod(whole)
    api.add_pod(half)

    async def body(url: str, state: ExtenderState) -> None:
        uid = {}
        async with aiohttp.ClientSession() as s:
            for where, pods in placed.items():
                for name, _, _ in pods:
                    a = await bound(s, url, api, api.get_pod("default", name), where)
                    uid[name] = a.pod_uid
            none = {n: {"Pods": [{"UID": f"cpu-{n}"}], "NumPDBViolations": 0}
                    for n in ("a", "b", "c")}
            _, res = await post(s, url + "/preempt", {"Pod": api.get_pod("default", "urgent"),
                                                      "NodeNameToMetaVictims": none})
            got = {n: ([p["UID"] for p in v["Pods"]], v["NumPDBViolations"])
                   for n, v in res["NodeNameToMetaVictims"].items()}
            assert got["a"][1] == 2 and sorted(got["a"][0]) == sorted(
                ["cpu-a", uid["guard-0"], uid["guard-1"]])
            assert got["b"][1] == 0 and sorted(got["b"][0]) == sorted(
                ["cpu-b", uid["free-0"], uid["free-1"]])
            assert got["c"] == (["cpu-c", uid["loose"], uid["guard-2"]], 1)  # priority 5 first
            # half a GPU: on c the unguarded pod goes, though its priority is higher
            _, res = await post(s, url + "/preempt", {"Pod": api.get_pod("default", "half"),
                                                      "NodeNameToMetaVictims": none})
            assert res["NodeNameToMetaVictims"]["c"] == {
                "Pods": [{"UID": "cpu-c"}, {"UID": uid["loose"]}], "NumPDBViolations": 0}
            assert res["NodeNameToMetaVictims"]["a"]["NumPDBViolations"] == 1
            # the scheduler's own victims keep its count; the extender's come after them
            # in priority order
            sched = {"c": {"Pods": [{"UID": "cpu-only"}, {"UID": uid["guard-2"]}],
                           "NumPDBViolations": 1}}
            _, res = await post(s, url + "/preempt", {"Pod": api.get_pod("default", "urgent"),
                                                      "NodeNameToMetaVictims": sched})
            assert res["NodeNameToMetaVictims"]["c"] == {
                "Pods": [{"UID": "cpu-only"}, {"UID": uid["loose"]}, {"UID": uid["guard-2"]}],
                "NumPDBViolations": 1}

    asyncio.run(serving(api, body))


def test_a_nominated_pod_is_not_refused_for_victims_the_watch_has_not_seen_go() -> None:
    """kube-scheduler retries a preemptor as soon as its cache drops the victims; when the
    ledger has not yet followed their deletion, the nominated node is read back from the API
    server instead of refused (a refusal makes the scheduler preempt again elsewhere:
    PodEligibleToPreemptOthers, pkg/scheduler/framework/plugins/defaultpreemption/
    default_preemption.go). Shares of pods that still exist stay; other nodes are not read."""
    api = FakeApiServer()
    api.add_node(node("a", "A100-80GB", 1))
    api.add_node(node("b", "A100-80GB", 1))
    for name in ("victim", "keeper"):
        api.add_pod(pod(name, 1000))
    api.add_pod(pod("urgent", 1000))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            await bound(s, url, api, api.get_pod("default", "victim"), "b")
            await bound(s, url, api, api.get_pod("default", "keeper"), "a")
            api.delete_pod("default", "victim")  # the watch event is not applied
            urgent = api.get_pod("default", "urgent")
            _, res = await post(s, url + "/filter", {"Pod": urgent, "NodeNames": ["a", "b"]})
            assert res["NodeNames"] == [] and set(reasons(res)) == {"a", "b"}
            assert ("default", "victim") in state.ledger.owners  # not nominated: nothing read
            urgent["status"] = {"nominatedNodeName": "b"}
            _, res = await post(s, url + "/filter", {"Pod": urgent, "NodeNames": ["a", "b"]})
            assert res["NodeNames"] == ["b"] and set(reasons(res)) == {"a"}
            assert ("default", "victim") not in state.ledger.owners
            urgent["status"] = {"nominatedNodeName": "a"}  # its holder is still there
            _, res = await post(s, url + "/filter", {"Pod": urgent, "NodeNames": ["a"]})
            assert res["NodeNames"] == [] and ("default", "keeper") in state.ledger.owners
            async with s.get(url + "/metrics") as r:
                assert "gpuslice_extender_stale_shares_freed_total 1.0" in await r.text()

    asyncio.run(serving(api, body))


def test_victims_offered_by_preempt_are_read_back_before_the_nomination_is_seen() -> None:
    """The pod kube-scheduler retries after preempting need not carry its nomination yet
    (``handleSchedulingFailure``, pkg/scheduler/schedule_one.go, requeues the informer's copy
    before patching ``nominatedNodeName``): the victims this extender's preempt offered are
    read back as a nominated node's are, else the refusal makes the scheduler preempt again
    on the one node it still sees victims on, the one a PodDisruptionBudget protects
    (issue 29). The offered victims still alive stay."""
    api = FakeApiServer()
    api.add_node(node("a", "A100-80GB", 1))
    api.add_node(node("b", "A100-80GB", 1))
    for name in ("free", "protected"):
        api.add_pod(pod(name, 1000))
    api.add_pod(pod("urgent", 1000))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            await bound(s, url, api, api.get_pod("default", "free"), "b")
            await bound(s, url, api, api.get_pod("default", "protected"), "a")
            uid = {n: api.get_pod("default", n)["metadata"]["uid"]
                   for n in ("free", "protected")}
            urgent = api.get_pod("default", "urgent")
            offered = {"a": {"Pods": [{"UID": uid["protected"]}], "NumPDBViolations": 1},
                       "b": {"Pods": [{"UID": uid["free"]}], "NumPDBViolations": 0}}
            _, res = await post(s, url + "/preempt", {"Pod": urgent,
                                                      "NodeNameToMetaVictims": offered})
            assert set(res["NodeNameToMetaVictims"]) == {"a", "b"}
            api.delete_pod("default", "free")  # the scheduler chose b; no watch event applied
            assert not (urgent.get("status") or {}).get("nominatedNodeName")
            _, res = await post(s, url + "/filter", {"Pod": urgent, "NodeNames": ["a", "b"]})
            assert res["NodeNames"] == ["b"] and set(reasons(res)) == {"a"}
            assert ("default", "free") not in state.ledger.owners
            assert ("default", "protected") in state.ledger.owners
            other = api.get_pod("default", "urgent")
            other["metadata"]["uid"] = "another-pod"  # offers are the preemptor's own
            _, res = await post(s, url + "/filter", {"Pod": other, "NodeNames": ["a"]})
            assert res["NodeNames"] == []

    asyncio.run(serving(api, body))


def test_a_cordoned_gpu_takes_no_new_slice_and_the_reason_says_so() -> None:
    api = FakeApiServer()
    n = node("a", "T4", 1)
    n["metadata"]["annotations"]["gpuslice.io/cordoned-gpus"] = "GPU-a-0"
    api.add_node(n)
    api.add_pod(pod("p", 300))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            _, res = await post(s, url + "/filter", {"Pod": api.get_pod("default", "p"),
                                                     "NodeNames": ["a"]})
            assert res["NodeNames"] == []
            assert "1 GPU(s) cordoned for reconfiguration" in reasons(res)["a"]

    asyncio.run(serving(api, body))


def test_a_pod_naming_no_gpu_memory_takes_its_share_of_the_gpus() -> None:
    """The contract's default: milli/1000 of the GPU's memory, accounted in the ledger (so
    memory cannot be oversubscribed) and written in the assignment (the device plugin turns it
    into the MPS pinned-memory cap)."""
    api = FakeApiServer()
    api.add_node(node("a", "T4", 1))  # 16384 MiB
    big_mem = pod("big-mem", 200)
    big_mem["spec"]["containers"][0]["resources"]["limits"]["gpuslice.io/gpu-memory"] = "14000"
    api.add_pod(big_mem)
    api.add_pod(pod("plain", 250))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            a = await bound(s, url, api, api.get_pod("default", "big-mem"), "a")
            assert a.containers[0].gpus[0].memory_mib == 14000
            plain = api.get_pod("default", "plain")
            _, res = await post(s, url + "/filter", {"Pod": plain, "NodeNames": ["a"]})
            # 250 milli of 16384 MiB is 4096 MiB; 2384 are left
            assert res["NodeNames"] == [] and \
                "GPU 0 has 2384 MiB free, pod needs 4096" in reasons(res)["a"], res
        again = ExtenderState(api, KEY, clock=clock)
        assert again.ledger.free("GPU-a-0") == (800, 2384)

    asyncio.run(serving(api, body))
    api2 = FakeApiServer()
    api2.add_node(node("a", "T4", 1))
    api2.add_pod(pod("plain", 250))

    async def body2(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            a = await bound(s, url, api2, api2.get_pod("default", "plain"), "a")
            assert a.containers[0].gpus[0].memory_mib == 4096

    asyncio.run(serving(api2, body2))


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
