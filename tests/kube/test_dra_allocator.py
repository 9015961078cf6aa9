"""The DRA claim allocator over HTTP: the real Kubernetes client against the REST fake's
resource.k8s.io/v1, with the allocator's own ServiceAccount and RBAC (deploy/dra-allocator).

Upstream rules these tests hold the allocator to: the scheduler's PreBind (``bindClaim`` in
pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go) refuses a claim "allocated
elsewhere in the meantime" and adds the ``resource.kubernetes.io/delete-protection`` finalizer
before writing ``status.allocation``; ``foreachAllocatedDevice`` (allocateddevices.go) counts a
result with a shareID as a share and one without as the whole device.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube import dra as kdra
from gpuslice.services.dra_allocator import DraAllocator
from tests.kube.helpers import kube_client
from tests.kube.rest_fake import DEPLOY, EXAMPLES, Rbac, RestApiServer

ALLOCATOR = "sa:gpuslice-system:gpuslice-dra-allocator"
DRA_DEPLOY = DEPLOY.parent / "dra-allocator"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StepElector:
    """A LeaderElector that always wins, counting its steps (Lease reads and renewals)."""

    leader, steps = False, 0

    def step(self) -> bool:
        self.steps += 1
        self.leader = True
        return True


class Together:
    """``api`` with each call of ``method`` held until ``n`` are under way at once (a
    barrier): calls made one after the other break it (after 2 s with ``writers`` 1)."""

    def __init__(self, api: Any, method: str, n: int, writers: int) -> None:
        import threading

        self.api, self.method = api, method
        self.barrier = threading.Barrier(n, timeout=2.0 if writers == 1 else 20.0)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.api, name)
        if name != self.method:
            return fn

        def held(*args: Any) -> Any:
            self.barrier.wait()
            return fn(*args)
        return held


def pass_together(alloc: DraAllocator, writers: int) -> Any:
    """One pass over a :class:`Together` API: its report, or ``None`` once it is shown that
    one writer breaks the barrier."""
    import threading

    try:
        if writers == 1:
            with pytest.raises(threading.BrokenBarrierError):
                alloc.run_once()
            return None
        return alloc.run_once()
    finally:
        alloc.close()


def gpu(name: str, *, used_by_taint: bool = True, model: str = "NVIDIA A100-SXM4-80GB") -> \
        dict[str, Any]:
    dev: dict[str, Any] = {
        "name": name, "allowMultipleAllocations": True,
        "attributes": {"type": {"string": "share"}, "productName": {"string": model}},
        "capacity": {
            "compute": {"value": "100", "requestPolicy": {
                "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}},
            "memory": {"value": "80Gi", "requestPolicy": {
                "default": "0", "validRange": {"min": "0", "step": "1Mi"}}}}}
    if used_by_taint:
        dev["taints"] = [{"key": kdra.ALLOCATOR_TAINT, "value": "gpuslice",
                          "effect": "NoSchedule"}]
    return dev


def rslice(node: str, n: int = 4, **kw: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-gpu.gpuslice.io-abcde"},
            "spec": {"driver": kdra.DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [gpu(f"gpu-{i}", **kw) for i in range(n)]}}


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "status": {"allocatable": {"cpu": "64", "memory": "256Gi"}}}


def claim(name: str, compute: int, ns: str = "ml", **status: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "share.gpuslice.io",
                    "capacity": {"requests": {"compute": str(compute), "memory": "10Gi"}}}}],
                "config": [{"requests": ["gpu"], "opaque": {
                    "driver": kdra.DRIVER, "parameters": {
                        "apiVersion": "gpuslice.io/v1alpha1", "kind": "MpsConfig"}}}]}},
            "status": status}


def pod(name: str, claim_name: str, ns: str = "ml", node_name: str = "",
        **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns,
                         "creationTimestamp": f"2026-11-23T00:00:{len(name):02d}Z"},
            "spec": {"containers": [{"name": "main", "image": "registry.local/model:1",
                                     "resources": {"requests": {"cpu": "4", "memory": "8Gi"},
                                                   "claims": [{"name": "gpu"}]}}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
                     **({"nodeName": node_name} if node_name else {}), **spec},
            "status": {"phase": "Pending"}}


def share(node_name: str, device: str, compute: int) -> dict[str, Any]:
    """An allocation as kube-scheduler writes it for a share of ``device``."""
    return {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": kdra.DRIVER, "pool": node_name,
                                 "device": device, "shareID": f"share-{device}-{compute}",
                                 "consumedCapacity": {"compute": str(compute),
                                                      "memory": "10Gi"}}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node_name]}]}]}}}


@pytest.fixture
def rest() -> Any:
    server = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, DRA_DEPLOY))).start()
    yield server
    server.stop()


def cluster(rest: RestApiServer, nodes: tuple[str, ...] = ("n1",), **slice_kw: Any) -> None:
    rest.add_deviceclass({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                          "metadata": {"name": "share.gpuslice.io"},
                          "spec": {"config": [{"opaque": {"driver": kdra.DRIVER, "parameters": {
                              "apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuConfig"}}}]}})
    for n in nodes:
        rest.add_node(node(n))
        rest.add_resourceslice(rslice(n, **slice_kw))


def allocator(rest: RestApiServer, tmp_path: Path, clock: Clock | None = None,
              **kw: Any) -> DraAllocator:
    api = kube_client(rest, tmp_path, ALLOCATOR)
    ids = iter(f"00000000-0000-0000-0000-{i:012d}" for i in range(1, 1000))
    return DraAllocator(api, clock=clock or Clock(), settle_s=0.0,
                        new_share_id=lambda: next(ids), **kw)


def results(rest: RestApiServer, name: str, ns: str = "ml") -> list[dict[str, Any]]:
    c = rest.get_resource_claim(ns, name)
    return list(((c.get("status") or {}).get("allocation") or {}).get("devices", {})
                .get("results") or [])


def test_allocates_a_pending_claim_with_our_placement(rest: RestApiServer,
                                                      tmp_path: Path) -> None:
    cluster(rest)
    # gpu-2 already half used (by a scheduled pod): first fit would open gpu-0, ours fills
    # gpu-2
    rest.add_resourceclaim(claim("old", 50, **share("n1", "gpu-2", 50)))
    rest.add_pod(pod("old", "old", node_name="n1"))
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(pod("p1", "c1"))
    report = allocator(rest, tmp_path).run_once()
    assert report.allocated == {"ml/c1": "n1: gpu-2"}, report
    got = rest.get_resource_claim("ml", "c1")
    assert kdra.FINALIZER in got["metadata"]["finalizers"]
    alloc = got["status"]["allocation"]
    assert alloc["devices"]["results"] == [{
        "request": "gpu", "driver": kdra.DRIVER, "pool": "n1", "device": "gpu-2",
        "shareID": "00000000-0000-0000-0000-000000000001",
        "consumedCapacity": {"compute": "50", "memory": str(10 * 1024 ** 3)}}]
    assert [c["source"] for c in alloc["devices"]["config"]] == ["FromClass", "FromClaim"]
    assert alloc["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1"]
    # kube-scheduler 1.36's PreBind writes one when it is missing, and the API server refuses
    # that change of an allocation (seen on the dev cluster: tests/cluster, dra_placement)
    assert datetime.fromisoformat(alloc["allocationTimestamp"]).tzinfo is not None
    # reserved for its pod in the same write: kube-scheduler's PreBind then writes nothing
    uid = rest.get_pod("ml", "p1")["metadata"]["uid"]
    assert got["status"]["reservedFor"] == [{"resource": "pods", "name": "p1", "uid": uid}]
    # the writes: the finalizer (update), then the allocation (status), nothing else
    puts = [path for who, verb, path, _ in rest.requests if verb == "PUT" and who == ALLOCATOR]
    assert puts == ["/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c1",
                    "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c1/status"]
    assert not rest.denied


def test_respects_devices_others_allocated(rest: RestApiServer, tmp_path: Path) -> None:
    cluster(rest, n=2)
    whole = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": kdra.DRIVER, "pool": "n1", "device": "gpu-0"}]}}}
    rest.add_resourceclaim(claim("whole", 100, **whole))  # no shareID: the whole device
    rest.add_resourceclaim(claim("big", 80, **share("n1", "gpu-1", 80)))
    rest.add_resourceclaim(claim("c1", 30))
    rest.add_pod(pod("p1", "c1"))
    report = allocator(rest, tmp_path).run_once()
    assert report.allocated == {}
    assert "no device" in report.unplaced["ml/c1"]
    assert results(rest, "c1") == []
    rest.add_resourceclaim(claim("c2", 20))
    rest.add_pod(pod("p2", "c2"))
    report = allocator(rest, tmp_path).run_once()
    assert report.allocated == {"ml/c2": "n1: gpu-1"}  # 80 + 20 = 100, no more


def test_two_claims_in_one_pass_never_overlap(rest: RestApiServer, tmp_path: Path) -> None:
    cluster(rest, n=1)
    for i in range(3):
        rest.add_resourceclaim(claim(f"c{i}", 40))
        rest.add_pod(pod(f"p{i}", f"c{i}"))
    report = allocator(rest, tmp_path).run_once()
    assert sorted(report.allocated) == ["ml/c0", "ml/c1"]  # 40 + 40; 40 more would be 120
    assert "ml/c2" in report.unplaced


def test_the_lease_is_renewed_every_2_s_and_a_long_pass_writes_only_5_s_after_it(
        rest: RestApiServer, tmp_path: Path) -> None:
    """The Lease is stepped (read, renewed) at most every 2 s while we lead, not every pass;
    a pass whose writes run past 5 s after the last renewal leaves the rest to the next pass,
    which renews first: nothing is written after the 15 s lease could have lapsed (and our
    drivers dropped the taint that keeps kube-scheduler off our devices)."""
    cluster(rest, n=4)
    for i in range(4):
        rest.add_resourceclaim(claim(f"c{i}", 10))
        rest.add_pod(pod(f"p{i}", f"c{i}"))

    clock, elector = Clock(), StepElector()
    alloc = allocator(rest, tmp_path, clock, elector=elector, writers=1)
    write = alloc.writes.write

    def slow(*args: Any, **kw: Any) -> Any:  # each claim's writes take 2 s
        try:
            return write(*args, **kw)
        finally:
            clock.now += 2.0

    alloc.writes.write = slow  # type: ignore[method-assign]
    first = alloc.run_once()  # writes at 0, 2 and 4 s after the renewal; not at 6
    assert elector.steps == 1 and len(first.allocated) == 3, first
    second = alloc.run_once()  # 6 s after it: renewed (at 6), then the last claim (till 8)
    assert elector.steps == 2 and len(second.allocated) == 1, second
    alloc.run_once()  # 2 s after the renewal: renewed (at 8)
    assert elector.steps == 3
    clock.now += 1.0
    alloc.run_once()  # 1 s after it: no step
    assert elector.steps == 3
    clock.now += 1.0
    alloc.run_once()
    assert elector.steps == 4


def test_a_claim_waits_for_a_free_writer_and_then_for_the_lease_window(
        rest: RestApiServer, tmp_path: Path) -> None:
    """With two writers busy, the pass waits for one to be free before it decides the next
    claim, and checks the Lease's window then: a write never waits in a queue past the
    5 s after the renewal. Here both writes take 6 s of the clock: the three claims left are
    placed by the next pass, which renews the Lease first."""
    import threading

    cluster(rest, n=4)
    for i in range(5):
        rest.add_resourceclaim(claim(f"c{i}", 10))
        rest.add_pod(pod(f"p{i}", f"c{i}"))

    clock, elector = Clock(), StepElector()
    alloc = allocator(rest, tmp_path, clock, elector=elector, writers=2)
    api, go, started = alloc.writes.api, threading.Event(), threading.Semaphore(0)

    class Slow:  # the allocation writes wait for ``go``
        def __getattr__(self, name: str) -> Any:
            return getattr(api, name)

        def update_resource_claim_status(self, body: dict[str, Any]) -> dict[str, Any]:
            started.release()
            assert go.wait(20)
            return dict(api.update_resource_claim_status(body))

    def later() -> None:  # both writers busy: 6 s pass, then the writes land
        for _ in range(2):
            assert started.acquire(timeout=20)
        clock.now += 6.0
        go.set()

    alloc.writes.api = Slow()  # type: ignore[assignment]
    helper = threading.Thread(target=later, daemon=True)
    helper.start()
    try:
        first = alloc.run_once()
        assert sorted(first.allocated) == ["ml/c0", "ml/c1"], first
        second = alloc.run_once()  # renews, then places the other three
        assert elector.steps == 2 and sorted(second.allocated) == ["ml/c2", "ml/c3", "ml/c4"]
    finally:
        go.set()
        alloc.close()
    helper.join(5)


class RacingServer(RestApiServer):
    """Something else writes the claim between the allocator's read and its status write:
    once, just before the allocator's first status update lands."""

    def __init__(self, race: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.race = race

    def update_resource_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]:
        race, self.race = self.race, None
        if race is not None:
            race(self)
        return super().update_resource_claim_status(claim)


def racing(race: Any) -> RacingServer:
    return RacingServer(race, rbac=Rbac((DEPLOY, EXAMPLES, DRA_DEPLOY))).start()


def test_a_conflict_is_retried_from_a_fresh_read(tmp_path: Path) -> None:
    def touch(server: RestApiServer) -> None:  # e.g. a label added meanwhile
        cur = server.get_resource_claim("ml", "c1")
        cur["metadata"]["labels"] = {"team": "a"}
        server.update_resource_claim(cur)

    rest = racing(touch)
    try:
        cluster(rest)
        rest.add_resourceclaim(claim("c1", 50))
        rest.add_pod(pod("p1", "c1"))
        report = allocator(rest, tmp_path).run_once()
        assert report.conflicts == 1
        assert report.allocated == {"ml/c1": "n1: gpu-0"}
        got = rest.get_resource_claim("ml", "c1")
        assert got["metadata"]["labels"] == {"team": "a"}  # the other write is kept
        assert len(got["status"]["allocation"]["devices"]["results"]) == 1
    finally:
        rest.stop()


def test_the_scheduler_got_there_first(tmp_path: Path) -> None:
    def scheduler(server: RestApiServer) -> None:  # kube-scheduler's PreBind lands first
        cur = server.get_resource_claim("ml", "c1")
        cur["status"] = dict(share("n1", "gpu-3", 60),
                             reservedFor=[{"resource": "pods", "name": "p1", "uid": "u1"}])
        server.update_resource_claim_status(cur)

    rest = racing(scheduler)
    try:
        cluster(rest)
        rest.add_resourceclaim(claim("c1", 60))
        rest.add_pod(pod("p1", "c1"))
        rest.add_resourceclaim(claim("c2", 50))
        rest.add_pod(pod("p2", "c2"))
        alloc = allocator(rest, tmp_path)
        report = alloc.run_once()
        assert report.taken == ["ml/c1"]
        assert results(rest, "c1")[0]["device"] == "gpu-3"  # the scheduler's, untouched
        assert rest.get_resource_claim("ml", "c1")["status"]["reservedFor"][0]["name"] == "p1"
        # c2 went where the scheduler's share of gpu-3 leaves no overlap
        dev = results(rest, "c2")[0]["device"]
        assert dev != "gpu-3" or 60 + 50 <= 100
        assert report.allocated == {"ml/c2": f"n1: {dev}"}
        assert alloc.run_once().allocated == {}  # nothing left to do
    finally:
        rest.stop()


def test_only_devices_tainted_for_us_and_settled_are_used(rest: RestApiServer,
                                                         tmp_path: Path) -> None:
    cluster(rest, used_by_taint=False)  # the drivers do not taint: the scheduler allocates
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(pod("p1", "c1"))
    clock = Clock()
    alloc = allocator(rest, tmp_path, clock)
    assert alloc.run_once().allocated == {}
    assert results(rest, "c1") == []
    # the drivers taint (our lease is fresh): used only after the settle period
    rest.add_resourceslice(rslice("n1"))
    alloc.settle_s = 10.0
    assert alloc.run_once().allocated == {}
    clock.now += 10.0
    assert alloc.run_once().allocated == {"ml/c1": "n1: gpu-0"}
    # race mode (no taint required) is an explicit choice
    assert DraAllocator(alloc.api, require_taint=False).require_taint is False


def test_bound_gated_and_foreign_claims_are_left_alone(rest: RestApiServer,
                                                      tmp_path: Path) -> None:
    cluster(rest)
    rest.add_resourceclaim(claim("bound", 10))
    rest.add_pod(pod("bound", "bound", node_name="n1"))
    rest.add_resourceclaim(claim("gated", 10))
    rest.add_pod(pod("gated", "gated", schedulingGates=[{"name": "x.io/wait"}]))
    foreign = claim("foreign", 10)
    foreign["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
    rest.add_resourceclaim(foreign)
    rest.add_pod(pod("foreign", "foreign"))
    selected = claim("cel", 10)
    selected["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": "true"}}]
    rest.add_resourceclaim(selected)
    rest.add_pod(pod("cel", "cel"))
    report = allocator(rest, tmp_path).run_once()
    assert report.allocated == {} and report.unplaced == {}
    for name in ("bound", "gated", "foreign", "cel"):
        assert results(rest, name) == []


def test_a_claim_released_by_the_scheduler_is_placed_again_backing_off_never_given_up(
        rest: RestApiServer, tmp_path: Path) -> None:
    """While our taint is on, the default allocator cannot place the claim either: a claim the
    scheduler keeps releasing (PostFilter) is retried at once twice, then after 2 s, 4 s, ...
    (capped), and never left for good."""
    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(pod("p1", "c1"))
    clock = Clock()
    alloc = allocator(rest, tmp_path, clock, max_attempts=2, backoff_s=2.0, max_backoff_s=4.0)
    placed = {"ml/c1": "n1: gpu-0"}

    def release() -> None:
        cur = rest.get_resource_claim("ml", "c1")  # PostFilter: the node could not take it
        cur["status"] = {}
        rest.update_resource_claim_status(cur)

    for step_s, expected in ((0.0, placed), (0.0, placed), (0.0, {}), (1.9, {}), (0.2, placed),
                             (3.9, {}), (0.2, placed), (3.9, {}), (0.2, placed)):
        clock.now += step_s
        assert alloc.run_once().allocated == expected, (clock.now, expected)
        if expected:
            release()


def test_a_pod_whose_claim_is_allocated_counts_on_its_node_before_it_is_bound(
        rest: RestApiServer, tmp_path: Path) -> None:
    """Node n1 has 64 CPUs; a pod of 40 CPUs whose claim we allocated on n1 is not bound yet:
    a second 40-CPU pod's claim must go to n2, not to the CPU the first pod's bind takes."""
    cluster(rest, ("n1", "n2"))
    alloc = allocator(rest, tmp_path)
    placed: dict[str, str] = {}
    for name in ("a", "b"):  # one pass each: the second sees the first only as an allocation
        rest.add_resourceclaim(claim(f"c-{name}", 30))
        p = pod(f"p-{name}", f"c-{name}")
        p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "40"
        rest.add_pod(p)
        got = alloc.run_once().allocated
        assert list(got) == [f"ml/c-{name}"], got
        placed.update(got)
    assert {v.split(":")[0] for v in placed.values()} == {"n1", "n2"}, placed


def test_the_command_leads_through_its_lease_and_allocates(rest: RestApiServer, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    import argparse

    from rich.console import Console

    from gpuslice.cli import dra_allocator

    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(pod("p1", "c1"))
    ap = argparse.ArgumentParser()
    dra_allocator.register(ap.add_subparsers())
    path = rest.kubeconfig(tmp_path / "kubeconfig", ALLOCATOR)
    args = ap.parse_args(["dra-allocator", "--once", "--settle=0", "--identity=a",
                          "--kubeconfig", str(path)])
    assert args.handler(args, Console()) == 0
    err = capsys.readouterr().err  # the log, on stderr
    assert "watching ResourceClaims of unbound pods for driver gpu.gpuslice.io" in err
    assert "holding the Lease gpuslice-system/gpuslice-dra-allocator" in err
    assert "allocated ml/c1 -> n1: gpu-0" in err
    # it led, and gave the Lease up on the way out: the replicas need not wait for it to lapse
    assert "released the Lease gpuslice-system/gpuslice-dra-allocator" in err
    lease = rest.get_lease("gpuslice-system", "gpuslice-dra-allocator")
    assert lease is not None and lease["spec"]["holderIdentity"] == ""
    assert lease["spec"]["acquireTime"] and lease["spec"]["leaseDurationSeconds"] == 1
    assert not rest.denied


def test_kubernetes_1_36_asks_for_resourceclaims_binding(tmp_path: Path) -> None:
    """Kubernetes 1.36 refuses a status write that sets the allocation unless the writer may
    also update ``resourceclaims/binding`` (the message seen on a 1.36 kubelet node). The
    shipped role grants it; without that rule every claim is refused, each one a problem of
    its own, and the pass goes on to the next claim."""
    import shutil

    import yaml

    docs = list(yaml.safe_load_all((DRA_DEPLOY / "rbac.yaml").read_text()))
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    granted = {(g, r): set(rule["verbs"]) for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"update"} <= granted[("resource.k8s.io", "resourceclaims/binding")]
    assert {"update"} <= granted[("resource.k8s.io", "resourceclaims/status")]

    old = tmp_path / "old-rbac"
    shutil.copytree(DRA_DEPLOY, old)
    for rule in role["rules"]:
        rule["resources"] = [r for r in rule["resources"] if r != "resourceclaims/binding"]
    (old / "rbac.yaml").write_text(yaml.safe_dump_all(docs))
    server = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, old))).start()
    try:
        cluster(server)
        for name in ("c1", "c2"):
            server.add_resourceclaim(claim(name, 30))
            server.add_pod(pod(f"p-{name}", name))
        alloc = allocator(server, tmp_path)
        assert alloc.run_once().allocated == {}
        assert len(alloc.problems) == 2, alloc.problems
        for name, problem in zip(("c1", "c2"), sorted(alloc.problems), strict=True):
            assert problem.startswith(f"claim ml/{name}: not allocated: API server: 422")
            assert 'requires resource="resourceclaims/binding", verb="update"' in problem
        assert not (server.get_resource_claim("ml", "c1").get("status") or {}).get("allocation")
    finally:
        server.stop()


def test_over_watched_lists_it_places_as_with_full_lists_and_lists_once(
        rest: RestApiServer, tmp_path: Path) -> None:
    """``gpuslice dra-allocator`` reads slices, claims, pods and nodes from watches
    (adapters/kube/mirror.py): pass after pass, with claims arriving and pods bound between
    passes, it places every claim where the same allocator over full lists does, and lists
    each resource once."""
    import time

    from gpuslice.adapters.kube.mirror import MirroredLists

    other = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, DRA_DEPLOY))).start()
    try:
        servers = (rest, other)
        for s in servers:
            cluster(s, nodes=("n1", "n2", "n3"), n=4)
        plain = allocator(rest, tmp_path)
        (tmp_path / "other").mkdir()
        lists = MirroredLists(kube_client(other, tmp_path / "other", ALLOCATOR))
        other.on_stop.append(lists.close)
        ids = iter(f"00000000-0000-0000-0000-{i:012d}" for i in range(1, 1000))
        watched = DraAllocator(lists, clock=Clock(), settle_s=0.0,
                               new_share_id=lambda: next(ids))

        def caught_up(want_claims: int, bound: set[str]) -> None:
            t0 = time.monotonic()
            while True:
                claims = lists.list_resource_claims()
                on = {p["metadata"]["name"] for p in lists.list_pods()
                      if p["spec"].get("nodeName")}
                if len(claims) == want_claims and bound <= on:
                    return
                assert time.monotonic() - t0 < 10, "the watches did not follow"
                time.sleep(0.02)

        bound: set[str] = set()
        k = 0
        for step, compute in enumerate((30, 50, 20, 70, 40, 60)):
            for _ in range(3):
                for s in servers:
                    s.add_resourceclaim(claim(f"c{k}", compute))
                    s.add_pod(pod(f"p{k}", f"c{k}"))
                k += 1
            caught_up(k, bound)
            a, b = plain.run_once(), watched.run_once()
            assert a.allocated == b.allocated and a.unplaced == b.unplaced, (step, a, b)
            for name in a.allocated:  # the scheduler binds each pod where its claim went
                c = name.split("/")[1]
                for s in servers:
                    got = s.get_resource_claim("ml", c)
                    p = s.get_pod("ml", "p" + c[1:])
                    s.bind("ml", p["metadata"]["name"], p["metadata"]["uid"],
                           kdra.allocated_node(got) or "")
                bound.add("p" + c[1:])
        assert len(bound) > 6  # most were placed, some not (the room ran out)
        lists_made = [path for who, verb, path, _ in other.requests
                      if who == ALLOCATOR and verb == "GET" and path in (
                          "/api/v1/pods", "/api/v1/nodes",
                          "/apis/resource.k8s.io/v1/resourceclaims",
                          "/apis/resource.k8s.io/v1/resourceslices")]
        assert len(set(lists_made)) == 4  # each listed (and watched: the same paths)
        assert [m.lists for m in (lists.pods, lists.nodes, lists.claims, lists.slices)] == \
            [1, 1, 1, 1]
    finally:
        other.stop()


@pytest.mark.parametrize("writers", [4, 1])
def test_a_pass_writes_its_claims_side_by_side(rest: RestApiServer, tmp_path: Path,
                                               writers: int) -> None:
    """A pass decides its claims in turn but writes them ``writers`` at a time (in a burst the
    writes' round trips were the allocator's pace): four claims' writes are under way
    together, each lands, on distinct room; one writer at a time cannot get them there."""
    cluster(rest, nodes=("n1", "n2"), n=2)
    for i in range(4):
        rest.add_resourceclaim(claim(f"c{i}", 60))
        rest.add_pod(pod(f"p{i}", f"c{i}"))
    api = Together(kube_client(rest, tmp_path, ALLOCATOR), "update_resource_claim", 4,
                   writers)
    report = pass_together(DraAllocator(api, clock=Clock(), settle_s=0.0, writers=writers),
                           writers)
    if report is None:
        return
    assert sorted(report.allocated) == [f"ml/c{i}" for i in range(4)], report
    devices = {tuple(r["pool"] + "/" + r["device"] for r in results(rest, f"c{i}"))
               for i in range(4)}
    assert len(devices) == 4  # 60 + 60 would not fit one GPU: each on its own
    assert report.conflicts == 0


def test_writers_must_be_at_least_one(rest: RestApiServer, tmp_path: Path) -> None:
    from gpuslice.core.errors import ValidationError

    with pytest.raises(ValidationError, match="writers"):
        DraAllocator(kube_client(rest, tmp_path, ALLOCATOR), writers=0)
