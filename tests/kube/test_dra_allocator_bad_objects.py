"""One malformed object never stops the DRA claim allocator (found by an independent probe).

Before, a ResourceSlice naming one device twice failed every pass (``DraLedger`` refuses
duplicate device keys), so no claim anywhere was allocated while the allocator kept its Lease
(and its taint kept kube-scheduler off the devices); a field of the wrong type (a slice's
``pool.generation`` "x", a claim's result list as a dict, a pod's ``resourceClaims`` as a dict,
a node's allocatable "abc") raised ValueError, KeyError or AttributeError out of ``run()``.

Upstream's allocator (k8s.io/dynamic-resource-allocation structured ``GatherPools``) marks a
pool whose slices name a device twice invalid and allocates nothing from it; we leave such a
pool out, and a pool with a slice of the wrong shape too, and place from the others. Each
problem is noted once while it lasts, naming the field and what was expected.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube import dra_common
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.services.dra_allocator import DraAllocator, PassReport
from tests.kube.test_dra_allocator import claim, gpu, node, pod, rslice, share


@pytest.fixture(autouse=True)
def _fresh_memo() -> Iterator[None]:
    # the in-process fake names UIDs after the objects: parses kept for another test's
    # object of the same name and resourceVersion must not answer for this one
    dra_common._MEMO.clear()
    yield
    dra_common._MEMO.clear()


def whole_gpu(name: str) -> dict[str, Any]:
    d = gpu(name)
    d["allowMultipleAllocations"] = False
    d["attributes"]["type"] = {"string": "gpu"}
    return d


def whole_claim(name: str, ns: str = "ml") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.gpuslice.io", "count": 1}}]}}, "status": {}}


def env(slices: list[dict[str, Any]], nodes: tuple[str, ...] = ("n1", "n2")) -> \
        tuple[FakeApiServer, DraAllocator]:
    api = FakeApiServer()
    api.add_deviceclass({"metadata": {"name": "share.gpuslice.io"}, "spec": {}})
    api.add_deviceclass({"metadata": {"name": "gpu.gpuslice.io"}, "spec": {}})
    for n in nodes:
        api.add_node(node(n))
    for s in slices:
        api.add_resourceslice(s)
    ids = iter(f"00000000-0000-0000-0000-{i:012d}" for i in range(1, 10000))
    return api, DraAllocator(api, settle_s=0.0, new_share_id=lambda: next(ids))


def add(api: FakeApiServer, name: str, compute: int = 30) -> None:
    api.add_resourceclaim(claim(name, compute))
    api.add_pod(pod(f"p-{name}", name))


def results(api: FakeApiServer, name: str, ns: str = "ml") -> list[tuple[str, str]]:
    c = api.get_resource_claim(ns, name)
    alloc = (c.get("status") or {}).get("allocation") or {}
    return [(r["pool"], r["device"]) for r in alloc.get("devices", {}).get("results") or []]


def passes(alloc: DraAllocator, n: int = 3) -> list[PassReport]:
    """``n`` passes through :meth:`DraAllocator.run` (the loop itself, not ``run_once``): an
    exception that escapes it fails the test."""
    stop, reports = threading.Event(), []

    def seen(report: PassReport) -> None:
        reports.append(report)
        if len(reports) >= n:
            stop.set()

    alloc.run(stop, 0.0, seen)
    return reports


def problems_with(alloc: DraAllocator, *words: str) -> list[str]:
    return [p for p in alloc.problems if all(w in p for w in words)]


# -- a pool that names a device twice ----------------------------------------------------------


def test_a_pool_naming_a_device_twice_is_left_out_and_the_other_nodes_allocated() -> None:
    bad = rslice("n2")
    bad["spec"]["devices"][1]["name"] = "gpu-0"
    api, alloc = env([rslice("n1"), bad])
    add(api, "c1")
    reports = passes(alloc)
    assert reports[0].allocated == {"ml/c1": "n1: gpu-0"}, reports[0]
    assert reports[0].nodes == 1  # n2's only pool is out
    # noted once over three passes, naming the pool and the device
    assert problems_with(alloc, "pool n2", "duplicate device name 'gpu-0'") == \
        alloc.problems, alloc.problems
    assert len(alloc.problems) == 1


def _same_name_in_one_slice() -> list[dict[str, Any]]:
    s = rslice("n1", 0)
    s["spec"]["devices"] = [whole_gpu("gpu-0"), whole_gpu("gpu-0")]
    return [s]


def _same_name_in_two_slices_of_a_pool() -> list[dict[str, Any]]:
    a = rslice("n1", 0)
    a["spec"]["devices"] = [whole_gpu("gpu-0")]
    a["spec"]["pool"]["resourceSliceCount"] = 2
    b = copy.deepcopy(a)
    b["metadata"]["name"] = "n1-second"
    return [a, b]


def _one_pool_name_on_two_nodes() -> list[dict[str, Any]]:
    a = rslice("n1", 0)
    a["spec"]["devices"] = [whole_gpu("gpu-0")]
    a["spec"]["pool"]["name"] = "shared"
    b = rslice("n2", 0)
    b["spec"]["devices"] = [whole_gpu("gpu-0")]
    b["spec"]["pool"]["name"] = "shared"
    return [a, b]


@pytest.mark.parametrize("make", [_same_name_in_one_slice, _same_name_in_two_slices_of_a_pool,
                                  _one_pool_name_on_two_nodes])
def test_a_device_named_twice_is_never_given_and_never_given_twice(
        make: Callable[[], list[dict[str, Any]]]) -> None:
    good = rslice("n3", 0)
    good["spec"]["devices"] = [whole_gpu("gpu-0"), whole_gpu("gpu-1")]
    api, alloc = env([*make(), good], nodes=("n1", "n2", "n3"))
    for i in range(3):
        api.add_resourceclaim(whole_claim(f"w{i}"))
        api.add_pod(pod(f"p-w{i}", f"w{i}"))
    report = alloc.run_once()
    got = {f"w{i}": results(api, f"w{i}") for i in range(3)}
    taken = [d for r in got.values() for d in r]
    assert sorted(taken) == [("n3", "gpu-0"), ("n3", "gpu-1")], got  # the good pool only
    assert len(report.unplaced) == 1, report
    assert problems_with(alloc, "duplicate device name 'gpu-0'", "left out"), alloc.problems


# -- slices with a field of the wrong type -----------------------------------------------------


def _set(path: list[Any], value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        cur: Any = obj
        for k in path[:-1]:
            cur = cur[k]
        cur[path[-1]] = value
    return mutate


CAP = ["spec", "devices", 0, "capacity", "compute"]
SLICE_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "generation x": (_set(["spec", "pool", "generation"], "x"),
                     "spec.pool.generation: expected an integer >= 0, got 'x'"),
    "slice count a string": (_set(["spec", "pool", "resourceSliceCount"], "2"),
                             "spec.pool.resourceSliceCount: expected an integer >= 1"),
    "devices a dict": (_set(["spec", "devices"], {"a": 1}),
                       "spec.devices: expected a list, got 'dict'"),
    "a device without a name": (lambda s: s["spec"]["devices"][0].pop("name"),
                                "device[0] name is missing: expected a non-empty string"),
    "a device that is a string": (_set(["spec", "devices", 1], "gpu-1"),
                                  "device[1]: expected an object, got 'str'"),
    "taints holding a string": (_set(["spec", "devices", 0, "taints"], ["x"]),
                                "device[0] taints[0]: expected an object, got 'str'"),
    "capacity abc": (_set([*CAP, "value"], "abc"), "device[0] capacity compute: expected"),
    "validValues a string": (_set([*CAP, "requestPolicy"], {"validValues": "5"}),
                             "capacity compute.validValues: expected a list"),
    "capacity a list": (_set(CAP, [1]), "device[0] capacity compute: expected an object"),
    "allowMultipleAllocations a string": (
        _set(["spec", "devices", 0, "allowMultipleAllocations"], "false"),
        "device[0] allowMultipleAllocations: expected true or false"),
}


@pytest.mark.parametrize("case", sorted(SLICE_CASES))
def test_a_slice_field_of_the_wrong_type_leaves_its_pool_out(case: str) -> None:
    mutate, message = SLICE_CASES[case]
    bad = rslice("n2")
    mutate(bad)
    api, alloc = env([rslice("n1"), bad])
    add(api, "c1")
    add(api, "c2", 90)
    reports = passes(alloc)
    assert reports[0].nodes == 1, reports[0]  # n2's only pool is out
    assert {w.split(":")[0] for w in reports[0].allocated.values()} == {"n1"}, reports[0]
    assert len(reports[0].allocated) == 2
    found = problems_with(alloc, "resourceslice n2-gpu.gpuslice.io-abcde", message,
                          "pool n2 left out")
    assert found == alloc.problems and len(found) == 1, alloc.problems


def test_a_slice_whose_pool_is_not_an_object_is_left_out_alone() -> None:
    bad = rslice("n2")
    bad["spec"]["pool"] = "n2"
    api, alloc = env([rslice("n1"), bad])
    add(api, "c1")
    assert alloc.run_once().allocated == {"ml/c1": "n1: gpu-0"}
    assert alloc.problems == ["resourceslice n2-gpu.gpuslice.io-abcde spec.pool: expected an "
                              "object, got 'str': slice left out"]


def test_a_problem_is_noted_once_while_it_lasts_and_again_when_it_comes_back() -> None:
    bad = rslice("n2")
    bad["spec"]["pool"]["generation"] = "x"
    api, alloc = env([rslice("n1"), bad])
    for _ in range(3):
        alloc.run_once()
    assert len(alloc.problems) == 1, alloc.problems
    bad["spec"]["pool"]["generation"] = 2  # fixed: the pool is back
    api.add_resourceslice(bad)
    report = alloc.run_once()
    assert report.nodes == 2 and len(alloc.problems) == 1
    bad["spec"]["pool"]["generation"] = "y"  # broken again: noted again
    api.add_resourceslice(bad)
    alloc.run_once()
    alloc.run_once()
    assert len(alloc.problems) == 2 and "got 'y'" in alloc.problems[1], alloc.problems


# -- claims, pods, nodes, classes of the wrong shape -------------------------------------------


def test_an_allocated_result_of_unknown_consumption_takes_its_device_whole() -> None:
    """What the share consumed is not a quantity: the device counts as taken, so nothing
    else lands on it (a device is never given beyond its capacity)."""
    api, alloc = env([rslice("n1", 1)], nodes=("n1",))
    st = share("n1", "gpu-0", 10)
    st["allocation"]["devices"]["results"][0]["consumedCapacity"]["compute"] = "abc"
    api.add_resourceclaim(claim("old", 10, **st))
    api.add_pod(pod("p-old", "old", node_name="n1"))
    add(api, "c1")
    reports = passes(alloc)
    assert reports[0].allocated == {} and "ml/c1" in reports[0].unplaced, reports[0]
    assert problems_with(alloc, "claim ml/old: status.allocation.devices.results[0]"
                         ".consumedCapacity compute: expected",
                         "device n1/gpu-0 counted as taken whole"), alloc.problems
    assert len(alloc.problems) == 1


@pytest.mark.parametrize(("mutate", "message"), [
    (_set(["status", "allocation", "devices", "results"], {"a": 1}),
     "claim ml/old: status.allocation.devices.results: expected a list, got 'dict'"),
    (_set(["status", "allocation", "devices", "results", 0], "x"),
     "claim ml/old: status.allocation.devices.results[0]: expected an object"),
    (_set(["status", "allocation", "devices", "results", 0, "device"], 7),
     "results[0]: expected a pool and a device name (strings), got 'n1' and 7"),
    (_set(["status", "allocation", "nodeSelector", "nodeSelectorTerms"], ["x"]),
     "claim ml/old: status.allocation.nodeSelector.nodeSelectorTerms[0]: expected an object"),
])
def test_a_malformed_allocated_claim_is_noted_and_the_pass_goes_on(
        mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    api, alloc = env([rslice("n1")], nodes=("n1",))
    old = claim("old", 10, **share("n1", "gpu-3", 10))
    mutate(old)
    api.add_resourceclaim(old)
    add(api, "c1")
    reports = passes(alloc)
    assert list(reports[0].allocated) == ["ml/c1"], reports[0]
    assert problems_with(alloc, message), alloc.problems
    assert len(alloc.problems) == 1, alloc.problems


@pytest.mark.parametrize(("path", "value", "message"), [
    (["count"], "abc", "exactly.count: expected an integer >= 1, got 'abc'"),
    (["count"], [1], "exactly.count: expected an integer >= 1, got [1]"),
    (["count"], -3, "exactly.count: expected an integer >= 1, got -3"),
    (["capacity", "requests", "compute"], "abc", "capacity.requests compute: expected"),
    (["capacity"], "x", "exactly.capacity: expected an object"),
    ([], [1], "requests[0].exactly: expected an object, got 'list'"),
])
def test_a_pending_claim_of_the_wrong_shape_is_left_to_the_default_allocator(
        path: list[Any], value: object, message: str) -> None:
    api, alloc = env([rslice("n1")], nodes=("n1",))
    bad = claim("bad", 30)
    _set(["spec", "devices", "requests", 0, "exactly", *path], value)(bad)
    api.add_resourceclaim(bad)
    api.add_pod(pod("p-bad", "bad"))
    add(api, "ok")
    reports = passes(alloc)
    assert list(reports[0].allocated) == ["ml/ok"], reports[0]
    assert results(api, "bad") == []
    assert problems_with(alloc, "claim ml/bad: spec.devices.requests[0]", message,
                         "left to the default allocator") == alloc.problems, alloc.problems
    assert len(alloc.problems) == 1


@pytest.mark.parametrize(("value", "message"), [
    ({"a": 1}, "pod ml/p-bad: spec.resourceClaims: expected a list, got 'dict'"),
    (["x"], "pod ml/p-bad: spec.resourceClaims[0]: expected an object, got 'str'"),
    ([{"name": "gpu", "resourceClaimName": ["bad"]}],
     "pod ml/p-bad: resourceClaimName: expected a string, got ['bad']"),
])
def test_a_pods_resource_claims_of_the_wrong_shape_place_nothing_and_stop_nothing(
        value: object, message: str) -> None:
    api, alloc = env([rslice("n1")], nodes=("n1",))
    api.add_resourceclaim(claim("bad", 30))
    p = pod("p-bad", "bad")
    p["spec"]["resourceClaims"] = value
    api.add_pod(p)
    add(api, "ok")
    reports = passes(alloc)
    assert list(reports[0].allocated) == ["ml/ok"], reports[0]
    assert results(api, "bad") == []
    assert problems_with(alloc, message, "its claims are not placed") == alloc.problems
    assert len(alloc.problems) == 1


def test_a_pod_with_a_cpu_request_that_is_not_a_quantity_is_not_placed() -> None:
    api, alloc = env([rslice("n1")], nodes=("n1",))
    api.add_resourceclaim(claim("bad", 30))
    p = pod("p-bad", "bad")
    p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "abc"
    api.add_pod(p)
    add(api, "ok")
    reports = passes(alloc)
    assert list(reports[0].allocated) == ["ml/ok"], reports[0]
    assert results(api, "bad") == []
    assert problems_with(alloc, "pod ml/p-bad", "got 'abc'", "no CPU or memory"), \
        alloc.problems


def test_a_node_whose_allocatable_is_not_a_quantity_has_no_room() -> None:
    api, alloc = env([rslice("n1"), rslice("n2")], nodes=("n1",))
    api.add_node({**node("n2"), "status": {"allocatable": {"cpu": "abc"}}})
    for i in range(6):  # more than n1's four GPUs take (whole ones)
        add(api, f"c{i}", 100)
    reports = passes(alloc)
    assert {w.split(":")[0] for w in reports[0].allocated.values()} == {"n1"}, reports[0]
    assert len(reports[0].allocated) == 4 and len(reports[0].unplaced) == 2
    assert alloc.problems == ["node n2: allocatable cpu: expected a Kubernetes quantity such "
                              "as 16Gi or 25, got 'abc': node counted as having no room"]


def test_a_class_config_of_the_wrong_shape_refuses_its_claims_once_each() -> None:
    api, alloc = env([rslice("n1")], nodes=("n1",))
    api.add_deviceclass({"metadata": {"name": "share.gpuslice.io"},
                         "spec": {"config": ["x"]}})
    add(api, "c1")
    reports = passes(alloc)
    assert all(r.allocated == {} for r in reports)
    assert alloc.problems == ["claim ml/c1: not allocated: deviceclass share.gpuslice.io: "
                              "spec.config[0]: expected an object, got 'str'"]


# -- the loop's last guard ---------------------------------------------------------------------


def test_an_unforeseen_error_fails_one_pass_and_the_next_builds_the_ledger_again() -> None:
    api, alloc = env([rslice("n1")], nodes=("n1",))
    add(api, "c1")
    real, calls = alloc.book.pending, []

    def pending() -> list[kdra.PendingClaim]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real()

    alloc.book.pending = pending  # type: ignore[method-assign]
    reports = passes(alloc)
    assert reports[0].allocated == {} and reports[1].allocated == {"ml/c1": "n1: gpu-0"}
    assert alloc.problems == ["pass failed: RuntimeError: boom"]
    assert alloc.book.rebuilds == 2  # built again after the failed pass


def test_one_bad_slice_does_not_end_the_loop_or_starve_the_healthy_nodes() -> None:
    """The probe's own case: ``run()`` with n2's ``pool.generation`` "x"."""
    bad = rslice("n2")
    bad["spec"]["pool"]["generation"] = "x"
    api, alloc = env([rslice("n1"), bad])
    add(api, "c1")
    reports = passes(alloc, 5)
    assert len(reports) == 5 and reports[0].allocated == {"ml/c1": "n1: gpu-0"}
    assert len(alloc.problems) == 1, alloc.problems
