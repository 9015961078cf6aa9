"""The extender and the effective-request rule against kube-scheduler's rules.

Each test names the upstream file and function whose rule it checks. The extender is served
over real HTTP on loopback with scheduler-shaped JSON (tests/extender's helpers)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kube.objects import pod_request, selector_matches
from gpuslice.core.errors import ValidationError
from gpuslice.core.podrequest import ContainerKind, ContainerRequest, pod_requests
from gpuslice.services.extender import ExtenderState
from tests.conformance.helpers import container, gpus, make_pod, node_rig, serving
from tests.extender.helpers import node, post

APP, INIT, SIDE = ContainerKind.APP, ContainerKind.INIT, ContainerKind.SIDECAR


@pytest.mark.parametrize(("containers", "overhead", "want"), [
    # app containers add up
    ([(APP, 2), (APP, 3)], 0, 5),
    # a larger init container wins
    ([(INIT, 7), (APP, 2), (APP, 3)], 0, 7),
    # init containers are not added to each other
    ([(INIT, 4), (INIT, 3), (APP, 1)], 0, 4),
    # a sidecar runs with the app containers
    ([(SIDE, 2), (APP, 3)], 0, 5),
    # a regular init container after a sidecar runs beside it: 2 + 4
    ([(SIDE, 2), (INIT, 4), (APP, 1)], 0, 6),
    # ... but not beside a sidecar declared after it
    ([(INIT, 4), (SIDE, 2), (APP, 1)], 0, 4),
    # overhead is added on top
    ([(INIT, 7), (APP, 2)], 1, 8),
    # a pod whose only request is in an init container
    ([(INIT, 1), (APP, 0)], 0, 1),
])
def test_pod_requests(containers: list[tuple[ContainerKind, int]], overhead: int,
                      want: int) -> None:
    """k8s.io/component-helpers/resource/helpers.go PodRequests and
    aggregateContainerResourcesByFn (KEP-753 sidecar formula) plus pod overhead."""
    reqs = [ContainerRequest(f"c{i}", k, {"r": v}) for i, (k, v) in enumerate(containers)]
    assert pod_requests(reqs, {"r": overhead} if overhead else None)["r"] == want


def test_pod_request_reads_init_containers_sidecars_overhead_and_pod_level() -> None:
    """helpers.go PodRequests through pod_request, the one entry point of the extender,
    planner, simulator admission and router: requests default from limits, pod-level
    cpu/memory requests win, overhead is added."""
    pod = make_pod("p", [container("main", 1, 200, cpu="1")],
                   init=[container("side", 1, 100, sidecar=True, cpu="500m"),
                         container("prep", 1, 600, cpu="3")],
                   overhead={"cpu": "250m", "memory": "64Mi"})
    req = pod_request(pod)
    assert req is not None
    assert (req.gpus, req.milli) == (1, 700)  # max(100 + 600, 200 + 100)
    assert req.cpu_milli == 3500 + 250  # max(3 + 0.5, 1 + 0.5) + overhead
    assert req.memory_mib == 64
    pod["spec"]["resources"] = {"requests": {"cpu": "2"}}
    assert pod_request(pod).cpu_milli == 2250  # type: ignore[union-attr]
    # an init-only GPU pod is a gpuslice pod (IsInterested looks at init containers too)
    only_init = make_pod("i", [container("main")], init=[container("warm", 1, 1000)])
    assert pod_request(only_init) is not None
    with pytest.raises(ValidationError, match="at most 1000 milli"):
        pod_request(make_pod("x", [container("a", 1, 600), container("b", 1, 600)]))


def test_init_only_gpu_pod_is_filtered_bound_and_admitted() -> None:
    """extender.go IsInterested / hasManagedResources (init containers count) and
    manager.go Allocate for init containers: the pod is bound with an assignment for its
    init container, and the kubelet's Allocate for it is answered."""
    api = FakeApiServer()
    with node_rig(api, "n1", gpus("n1", 1)) as rig:

        async def body(url: str, state: ExtenderState) -> None:
            p = api.add_pod(make_pod("warm", [container("main")],
                                     init=[container("fetch", 1, 1000)]))
            async with aiohttp.ClientSession() as s:
                st, res = await post(s, url + "/filter", {"Pod": p, "NodeNames": ["n1"]})
                assert st == 200 and res["NodeNames"] == ["n1"], res
                st, res = await post(s, url + "/bind", {
                    "PodName": "warm", "PodNamespace": "ml", "PodUID": p["metadata"]["uid"],
                    "Node": "n1"})
                assert res == {"Error": ""}

        asyncio.run(serving(api, body))
        rig.dm.admit(api.get_pod("ml", "warm"))
        r = rig.dm.responses[("ml/warm", "fetch")]
        assert r.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-n1-0"
        assert r.annotations["gpuslice.io/mode"] == "exclusive"


def test_filter_answers_in_the_form_it_was_asked_and_splits_unresolvable() -> None:
    """extender.go Filter: with nodeCacheCapable the answer is NodeNames (a subset of the
    input), else Nodes; FailedAndUnresolvableNodes are nodes preemption cannot help
    (schedule_one.go findNodesThatPassExtenders); Error is empty on success."""
    api = FakeApiServer()
    api.add_node(node("t4", "T4", 1))
    api.add_node(node("a100", "A100-80GB", 1))
    api.add_node({"metadata": {"name": "cpu"}})
    busy = api.add_pod(make_pod("busy", [container("m", 1, 900)]))

    async def body(url: str, state: ExtenderState) -> None:
        assert state.bind("ml", "busy", busy["metadata"]["uid"], "a100") == ""
        p = make_pod("p", [container("m", 1, 500)],
                     annotations={"gpuslice.io/gpu-model": "A100-80GB"})
        async with aiohttp.ClientSession() as s:
            st, res = await post(s, url + "/filter", {"Pod": p,
                                                      "NodeNames": ["t4", "a100", "cpu", "zz"]})
            assert res["NodeNames"] == [] and res["Nodes"] is None and res["Error"] == ""
            assert set(res["FailedNodes"]) == {"a100"}  # preemption would make room
            assert set(res["FailedAndUnresolvableNodes"]) == {"t4", "cpu", "zz"}
            nodes = {"kind": "NodeList", "items": api.list_nodes()}
            st, res = await post(s, url + "/filter", {"Pod": make_pod("q", [container(
                "m", 1, 100)]), "Nodes": nodes})
            assert res["NodeNames"] is None
            assert sorted(n["metadata"]["name"] for n in res["Nodes"]["items"]) == [
                "a100", "t4"]
            st, res = await post(s, url + "/prioritize", {"Pod": make_pod("q", [container(
                "m", 1, 100)]), "NodeNames": ["t4", "a100", "cpu"]})
            assert st == 200 and all(0 <= h["Score"] <= 10 for h in res)  # MaxExtenderPriority
            st, res = await post(s, url + "/bind", {"PodName": "nope", "PodNamespace": "ml",
                                                    "PodUID": "u", "Node": "a100"})
            assert st == 200 and res["Error"]  # extender.go Bind: Error fails the bind

    asyncio.run(serving(api, body, narrow=False))  # every node that fits


def test_preemption_never_returns_a_kept_node_without_the_victims_it_needs() -> None:
    """preemption.go callExtenders: a node returned with no victims is an error ("expected at
    least one victim pod"); extender.go ProcessPreemption / convertPodUIDToPod: victims are
    pods on that node. Kept nodes keep every victim the scheduler chose; a node offered with
    too few (or none) gets lower-priority GPU holders added; a hopeless node is dropped."""
    api = FakeApiServer()
    api.add_node(node("a", "A100-80GB", 1))
    api.add_node(node("b", "A100-80GB", 1))
    api.add_node(node("c", "A100-80GB", 1))
    uid: dict[str, str] = {}
    for name, milli, prio in (("low", 600, 0), ("low2", 400, 0), ("b-low", 700, 0),
                              ("c-high", 900, 1000)):
        p = api.add_pod(make_pod(name, [container("m", 1, milli)], priority=prio))
        uid[name] = p["metadata"]["uid"]

    async def body(url: str, state: ExtenderState) -> None:
        for name, where in (("low", "a"), ("low2", "a"), ("b-low", "b"), ("c-high", "c")):
            assert state.bind("ml", name, uid[name], where) == ""
        urgent = make_pod("urgent", [container("m", 1, 500)], priority=100)
        async with aiohttp.ClientSession() as s:
            meta = {"a": {"Pods": [{"UID": uid["low"]}, {"UID": "cpu-pod"}],
                          "NumPDBViolations": 0},
                    "b": {"Pods": [], "NumPDBViolations": 0},
                    "c": {"Pods": [{"UID": "cpu-pod-2"}], "NumPDBViolations": 0}}
            st, res = await post(s, url + "/preempt", {"Pod": urgent,
                                                       "NodeNameToMetaVictims": meta})
            assert st == 200, res
            got = {n: [p["UID"] for p in v["Pods"]]
                   for n, v in res["NodeNameToMetaVictims"].items()}
            assert got == {"a": [uid["low"], "cpu-pod"],  # all kept: 600 freed is enough
                           "b": [uid["b-low"]]}  # added: lower priority, frees 700
            # c: its GPU holder outranks the preemptor, so no victim can make room
            assert all(v for v in got.values())

    asyncio.run(serving(api, body))


def test_a_pod_that_asks_nothing_of_gpuslice_is_not_refused() -> None:
    """extender.go IsInterested: pods without managed resources are not the extender's; if
    asked anyway, every node passes and preemption keeps the scheduler's choice."""
    api = FakeApiServer()
    api.add_node(node("a", "T4", 1))

    async def body(url: str, state: ExtenderState) -> None:
        plain: dict[str, Any] = make_pod("plain", [container("m")])
        async with aiohttp.ClientSession() as s:
            _, res = await post(s, url + "/filter", {"Pod": plain, "NodeNames": ["a", "x"]})
            assert res["NodeNames"] == ["a", "x"]
            _, res = await post(s, url + "/preempt", {"Pod": plain, "NodeNameToMetaVictims": {
                "a": {"Pods": [{"UID": "v"}], "NumPDBViolations": 0},
                "x": {"Pods": [], "NumPDBViolations": 0}}})
            assert set(res["NodeNameToMetaVictims"]) == {"a"}

    asyncio.run(serving(api, body))


@pytest.mark.parametrize(("selector", "labels", "want"), [
    (None, {"a": "1"}, False),  # a nil selector matches nothing (for a PDB)
    ({}, {"a": "1"}, False),  # ... and so does an empty one
    ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]},
     {"a": "2"}, True),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]},
     {"a": "1"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
    ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": ""}, False),
    ({"matchLabels": {"a": "1"},
      "matchExpressions": [{"key": "b", "operator": "Exists"}]}, {"a": "1"}, False),
    # invalid selectors (LabelSelectorAsSelector fails) match nothing
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": []}]}, {"a": "1"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["1"]}]},
     {"a": "1"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}, {"a": "2"}, False),
])
def test_disruption_budget_selectors_as_preemption_reads_them(
        selector: Any, labels: dict[str, str], want: bool) -> None:
    """filterPodsWithPDBViolation (kubernetes pkg/scheduler/framework/plugins/
    defaultpreemption/default_preemption.go) with LabelSelectorAsSelector (apimachinery
    pkg/apis/meta/v1/helpers.go): the extender counts the budgets of the victims it adds."""
    assert selector_matches(selector, labels) is want
