"""The claim allocator's scheduling gate over HTTP (issue 58): the real Kubernetes client
against the REST fake, with the allocator's and the DRA driver's own ServiceAccounts and
RBAC (deploy/dra-allocator, deploy/dra), so every call the gate needs is one they grant.

Upstream rules held here (kubernetes v1.36.3):

* pkg/apis/core/validation/validation.go, ``ValidatePodUpdate`` and
  ``validateOnlyDeletedSchedulingGates``: a pod update may delete scheduling gates, never add
  one ("only deletion is allowed, but found new scheduling gate"): the fake refuses the same;
* pkg/scheduler/framework/plugins/schedulinggates/scheduling_gates.go, ``PreEnqueue``: a pod
  with any gate left is not tried, so a pod gated by another component as well is not ours
  to release, nor its claim ours to place (``adapters.kube.dra.pending_claims``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube.dra_gate import (
    ALLOCATOR_GATE,
    admission_patch,
    removal_patch,
)
from gpuslice.adapters.kube.fake import ApiInvalid, FakeApiServer, apply_json_patch
from gpuslice.adapters.kube.mirror import _ClaimWakes, _pod_wakes, _WakingQueue
from gpuslice.adapters.kube.ports import WatchEvent
from gpuslice.core.dra_gate import ALLOCATOR_UNAVAILABLE, LEFT_TO_SCHEDULER, NOT_PLACED
from gpuslice.core.errors import GpusliceError
from gpuslice.services.dra_allocator import DraAllocator
from gpuslice.services.dra_gate import KEEPER_LEASE, GateKeeper
from gpuslice.services.leader import LeaderElector
from tests.kube.helpers import kube_client
from tests.kube.rest_fake import DEPLOY, EXAMPLES, Rbac, RestApiServer
from tests.kube.test_dra_allocator import (
    ALLOCATOR,
    DRA_DEPLOY,
    Clock,
    Together,
    allocator,
    claim,
    cluster,
    pass_together,
    pod,
)

DRIVER_SA = "sa:gpuslice-system:gpuslice-dra-driver"


@pytest.fixture
def rest() -> Iterator[RestApiServer]:
    """The REST fake with deploy/'s RBAC, the DRA allocator's and driver's included."""
    server = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, DRA_DEPLOY))).start()
    yield server
    server.stop()
GATE = [{"name": ALLOCATOR_GATE}]


def gated(name: str, claim_name: str, *others: str, **kw: Any) -> dict[str, Any]:
    return pod(name, claim_name, schedulingGates=[*GATE, *({"name": o} for o in others)],
               **kw)


def gates_of(rest: RestApiServer, name: str, ns: str = "ml") -> list[str]:
    return [g["name"] for g in rest.get_pod(ns, name)["spec"].get("schedulingGates") or []]


def events(rest: RestApiServer, name: str) -> list[tuple[str, str, str]]:
    return [(e["reason"], e["type"], e["message"]) for e in rest.events
            if e["involvedObject"]["name"] == name]


# -- the allocator ------------------------------------------------------------------------


def test_a_gated_pod_is_released_right_after_its_claim_is_allocated(
        rest: RestApiServer, tmp_path: Path) -> None:
    """One pass: the allocation written (finalizer, status), then the gate removed (a JSON
    patch that tests the gate is where it was read); no Event on the normal path."""
    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(gated("p1", "c1"))
    report = allocator(rest, tmp_path).run_once()
    assert report.allocated == {"ml/c1": "n1: gpu-0"}
    assert report.released == {"ml/p1": "allocated"}
    assert gates_of(rest, "p1") == []
    assert events(rest, "p1") == []
    writes = [(verb, path) for who, verb, path, _ in rest.requests
              if who == ALLOCATOR and verb in ("PUT", "PATCH")]
    assert writes == [("PUT", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c1"),
                      ("PUT", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c1/status"),
                      ("PATCH", "/api/v1/namespaces/ml/pods/p1")]
    assert not rest.denied


@pytest.mark.parametrize("writers", [3, 1])
def test_a_bursts_gated_pods_are_released_side_by_side(rest: RestApiServer, tmp_path: Path,
                                                      writers: int) -> None:
    """The gates of the pods a pass releases are removed by the writers together (in a
    burst, removing them one after the other was the pace of the pods' binds): three
    patches under way at once; one writer cannot get them there."""
    cluster(rest, nodes=("n1", "n2", "n3"))
    for i in range(3):
        rest.add_resourceclaim(claim(f"c{i}", 60))
        rest.add_pod(gated(f"p{i}", f"c{i}"))
    api = Together(kube_client(rest, tmp_path, ALLOCATOR), "remove_pod_scheduling_gate", 3,
                   writers)
    report = pass_together(DraAllocator(api, clock=Clock(), settle_s=0.0, writers=writers),
                           writers)
    if report is None:
        return
    assert sorted(report.released) == ["ml/p0", "ml/p1", "ml/p2"], report
    assert all(gates_of(rest, f"p{i}") == [] for i in range(3))


def test_a_pass_places_at_most_its_share_and_the_rest_keep_their_gate(
        rest: RestApiServer, tmp_path: Path) -> None:
    """A pass writes at most ``max_writes_per_pass`` claims and releases their pods; the
    pods whose claims wait for the next pass keep the gate (no Event: they are not left to
    kube-scheduler, however long they wait), and that pass is due at once."""
    cluster(rest, nodes=("n1", "n2"))
    for i in range(5):
        rest.add_resourceclaim(claim(f"c{i}", 40))
        rest.add_pod(gated(f"p{i}", f"c{i}"))
    clock = Clock()
    alloc = allocator(rest, tmp_path, clock, max_writes_per_pass=2, max_hold_s=1.0)
    try:
        for want in (["ml/p0", "ml/p1"], ["ml/p2", "ml/p3"], ["ml/p4"]):
            clock.now += 5.0  # queued past the hold: still held, the allocator works
            report = alloc.run_once()
            assert sorted(report.released) == want, report
            assert len(report.allocated) == len(want)
            if want != ["ml/p4"]:
                assert report.next_due == clock.now
        assert all(gates_of(rest, f"p{i}") == [] for i in range(5))
        assert all(events(rest, f"p{i}") == [] for i in range(5))
    finally:
        alloc.close()


def test_a_gated_pod_the_allocator_will_not_place_goes_at_once_with_an_event(
        rest: RestApiServer, tmp_path: Path) -> None:
    """No room now: a Warning ClaimNotPlaced (kube-scheduler then reports it Unschedulable,
    and the allocator still places its claim when room frees: it stays pending). A claim of
    a shape the allocator leaves to kube-scheduler: a Normal ClaimLeftToScheduler."""
    cluster(rest, n=1)
    rest.add_resourceclaim(claim("big", 100))
    rest.add_pod(gated("too-big", "big", cpu="1"))
    rest.add_resourceclaim(claim("small", 10))
    other = claim("selected", 10)
    other["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": "true"}}]
    rest.add_resourceclaim(other)
    rest.add_pod(gated("selector", "selected"))
    rest.add_resourceclaim(claim("fill", 100, **{"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": kdra.DRIVER, "pool": "n1", "device": "gpu-0",
         "shareID": "s", "consumedCapacity": {"compute": "100", "memory": "0"}}]}}}))
    report = allocator(rest, tmp_path).run_once()
    assert "ml/big" in report.unplaced
    assert report.released == {"ml/too-big": NOT_PLACED, "ml/selector": LEFT_TO_SCHEDULER}
    ((reason, kind, message),) = events(rest, "too-big")
    assert (reason, kind) == (NOT_PLACED, "Warning") and "ml/big" in message
    ((reason, kind, message),) = events(rest, "selector")
    assert (reason, kind) == (LEFT_TO_SCHEDULER, "Normal") and "selectors" in message
    assert gates_of(rest, "too-big") == gates_of(rest, "selector") == []
    assert not rest.denied


def test_a_pod_gated_by_someone_else_too_is_neither_placed_nor_released(
        rest: RestApiServer, tmp_path: Path) -> None:
    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(gated("p1", "c1", "kueue.x-k8s.io/admission"))
    alloc = allocator(rest, tmp_path)
    report = alloc.run_once()
    assert report.allocated == {} and report.released == {}
    assert gates_of(rest, "p1") == [ALLOCATOR_GATE, "kueue.x-k8s.io/admission"]
    # the other gate goes: ours is the last, the claim is placed and the pod released
    p = rest.get_pod("ml", "p1")
    rest.remove_pod_scheduling_gate("ml", "p1", removal_patch(p, "kueue.x-k8s.io/admission"))
    report = alloc.run_once()
    assert report.allocated == {"ml/c1": "n1: gpu-0"} and gates_of(rest, "p1") == []


def test_a_pod_whose_claim_is_not_made_yet_is_held_then_released(
        rest: RestApiServer, tmp_path: Path) -> None:
    """A template's claim is made by kube-controller-manager after the pod: the pod waits for
    it, at most ``max_hold_s`` (then released with AllocatorUnavailable)."""
    cluster(rest)
    rest.add_pod(gated("p1", "not-yet"))
    clock = Clock()
    alloc = allocator(rest, tmp_path, clock, max_hold_s=30.0)
    report = alloc.run_once()
    assert report.released == {} and report.next_due == pytest.approx(clock.now + 30.0)
    clock.now += 29.0
    assert alloc.run_once().released == {}
    clock.now += 1.0
    assert alloc.run_once().released == {"ml/p1": ALLOCATOR_UNAVAILABLE}
    ((reason, kind, message),) = events(rest, "p1")
    assert (reason, kind) == (ALLOCATOR_UNAVAILABLE, "Warning")
    assert "claim not created yet" in message


def test_without_a_device_tainted_for_it_the_allocator_releases_what_it_holds(
        tmp_path: Path) -> None:
    """The drivers taint only while the allocator's Lease is fresh, and not where the API
    server drops device taints: without any, nothing would ever place the claim."""
    server = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, DRA_DEPLOY))).start()
    try:
        cluster(server, used_by_taint=False)
        server.add_resourceclaim(claim("c1", 50))
        server.add_pod(gated("p1", "c1"))
        report = allocator(server, tmp_path).run_once()
        assert report.allocated == {} and report.released == {"ml/p1": ALLOCATOR_UNAVAILABLE}
        assert "no device carries the allocator's taint" in events(server, "p1")[0][2]
        assert not server.denied
    finally:
        server.stop()


def test_devices_settling_hold_the_pod_and_the_pass_is_due_when_they_settle(
        rest: RestApiServer, tmp_path: Path) -> None:
    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(gated("p1", "c1"))
    clock = Clock()
    alloc = allocator(rest, tmp_path, clock)
    alloc.settle_s = 10.0
    report = alloc.run_once()
    assert report.nodes == 0 and report.released == {}
    assert report.next_due == pytest.approx(clock.now + 10.0)
    clock.now += 10.0
    report = alloc.run_once()
    assert report.allocated and report.released == {"ml/p1": "allocated"}


# -- the run loop wakes on watch events ------------------------------------------------------


def test_the_watches_wake_a_pass_for_what_may_give_it_work() -> None:
    """An unbound pod's event, a pod gone or finished; not a bound pod's status update."""
    unbound = {"metadata": {"name": "a"}, "spec": {}}
    bound = {"metadata": {"name": "b"}, "spec": {"nodeName": "n1"}, "status": {}}
    done = {**bound, "status": {"phase": "Succeeded"}}
    assert _pod_wakes(WatchEvent("ADDED", "Pod", unbound))
    assert not _pod_wakes(WatchEvent("MODIFIED", "Pod", bound))
    assert _pod_wakes(WatchEvent("MODIFIED", "Pod", done))
    assert _pod_wakes(WatchEvent("DELETED", "Pod", bound))
    wake = threading.Event()
    q = _WakingQueue(wake, _pod_wakes)
    q.put(WatchEvent("MODIFIED", "Pod", bound))
    assert not wake.is_set() and q.qsize() == 1
    q.put(GpusliceError("pod watch: 410 Gone"))  # a broken watch: the relist may bring work
    assert wake.is_set()


def test_a_claim_wakes_a_pass_when_its_allocation_or_deletion_changes() -> None:
    """A claim created, allocated, released or deleted wakes a pass; its finalizer added (the
    echo of our own first write) or kube-scheduler reserving it for its pod does not."""
    wakes = _ClaimWakes()
    meta = {"name": "c", "namespace": "ml"}
    plain = {"metadata": meta, "status": {}}
    final = {"metadata": {**meta, "finalizers": [kdra.FINALIZER]}, "status": {}}
    alloc = {"devices": {"results": []}}
    allocated = {**final, "status": {"allocation": alloc}}
    reserved = {**final, "status": {"allocation": alloc, "reservedFor": [{"name": "p"}]}}
    deleting = {**reserved, "metadata": {**final["metadata"], "deletionTimestamp": "now"}}
    steps = [("ADDED", plain, True), ("MODIFIED", final, False),
             ("MODIFIED", allocated, True), ("MODIFIED", reserved, False),
             ("MODIFIED", allocated, False), ("MODIFIED", final, True),
             ("MODIFIED", reserved, True), ("MODIFIED", deleting, True),
             ("DELETED", deleting, True), ("ADDED", plain, True)]
    for i, (kind, obj, want) in enumerate(steps):
        assert wakes(WatchEvent(kind, "ResourceClaim", obj)) is want, (i, kind, obj)
    # another claim is another history
    assert wakes(WatchEvent("MODIFIED", "ResourceClaim", {**final, "metadata": {
        **final["metadata"], "name": "d"}}))


def test_the_loop_runs_a_pass_on_a_wake_not_on_its_interval(
        rest: RestApiServer, tmp_path: Path) -> None:
    cluster(rest)
    alloc = allocator(rest, tmp_path)
    stop, wake, passes = threading.Event(), threading.Event(), []

    def seen(report: Any) -> None:
        passes.append(report)
        if len(passes) == 1:  # a pod arrives; its watch event wakes the loop
            rest.add_resourceclaim(claim("c1", 50))
            rest.add_pod(gated("p1", "c1"))
            wake.set()
        elif report.released:
            stop.set()

    t = threading.Thread(target=alloc.run, args=(stop, 3600.0, seen),
                         kwargs={"wake": wake, "coalesce_s": 0.0}, daemon=True)
    t.start()
    t.join(60)
    assert stop.is_set() and len(passes) == 2, passes  # not an hour later
    assert passes[1].released == {"ml/p1": "allocated"}


def test_over_watches_the_gate_comes_off_once_the_allocation_has_come_back(
        rest: RestApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the watched lists (``gpuslice dra-allocator``'s, adapters/kube/mirror.py): while
    the watch of claims has not brought the allocation written, the pod stays gated (another
    watcher, kube-scheduler, may not have it either: it would try the pod on a claim it sees
    unallocated and back off); the pass after the watch has brought it releases the pod."""
    import time

    from gpuslice.adapters.kube.mirror import MirroredLists

    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(gated("p1", "c1"))
    lists = MirroredLists(kube_client(rest, tmp_path, ALLOCATOR))
    rest.on_stop.append(lists.close)
    lists.start()
    alloc = DraAllocator(lists, clock=Clock(), settle_s=0.0)
    drain = lists.claims._drain
    monkeypatch.setattr(lists.claims, "_drain", lambda: None)  # the claims' watch lagging
    report = alloc.run_once()
    assert report.allocated == {"ml/c1": "n1: gpu-0"} and report.released == {}
    assert lists.claims_in_flight() == {("ml", "c1")} and gates_of(rest, "p1") == [ALLOCATOR_GATE]
    monkeypatch.setattr(lists.claims, "_drain", drain)
    t0 = time.monotonic()
    while lists.claims_in_flight():  # the watch brings the claim's new version
        assert time.monotonic() - t0 < 30, "the claims' watch did not follow"
        time.sleep(0.02)
    report = alloc.run_once()
    assert report.allocated == {} and report.released == {"ml/p1": "allocated"}
    assert gates_of(rest, "p1") == []


# -- the fallback: the drivers release what an allocator gone still holds ----------------


def stale_lease(rest: RestApiServer, seconds_ago: float, holder: str = "allocator-0") -> None:
    from datetime import UTC, datetime

    stamp = datetime.fromtimestamp(1_000_000.0 - seconds_ago, UTC).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")
    cur = rest.get_lease("gpuslice-system", "gpuslice-dra-allocator")
    rest.put_lease("gpuslice-system", "gpuslice-dra-allocator", {
        "holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": stamp},
        None if cur is None else cur["metadata"]["resourceVersion"])


def test_the_drivers_release_the_gated_pods_once_the_allocators_lease_is_stale(
        tmp_path: Path) -> None:
    """With the driver's own ServiceAccount (deploy/dra's RBAC): the allocator's Lease read,
    the keepers' Lease taken by one driver, the pods not bound yet listed, the gate removed
    and an Event recorded; a second driver, not elected, does nothing."""
    rest = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, DRA_DEPLOY,
                                    DEPLOY.parent / "dra"))).start()
    try:
        rest.add_resourceclaim(claim("c1", 50))
        rest.add_pod(gated("p1", "c1"))
        rest.add_pod(gated("p2", "c1", "other.example/gate"))  # ours goes, theirs stays
        rest.add_pod(pod("bound", "c1", node_name="n1"))
        api = kube_client(rest, tmp_path, DRIVER_SA)
        wall = lambda: 1_000_000.0  # noqa: E731

        def keeper(node: str) -> GateKeeper:
            return GateKeeper(api, ("gpuslice-system", "gpuslice-dra-allocator"),
                              "gpuslice-dra-driver", wall, 5.0,
                              LeaderElector(api, "gpuslice-system", KEEPER_LEASE, node, wall))

        a, b = keeper("node-a"), keeper("node-b")
        stale_lease(rest, 19.0)  # 15 s lease + 5 s grace not yet over
        lease = api.get_lease("gpuslice-system", "gpuslice-dra-allocator")
        assert a.step(lease) == 0 and rest.get_lease("gpuslice-system", KEEPER_LEASE) is None
        stale_lease(rest, 21.0)
        lease = api.get_lease("gpuslice-system", "gpuslice-dra-allocator")
        assert a.step(lease) == 2 and b.step(lease) == 0
        assert gates_of(rest, "p1") == [] and gates_of(rest, "p2") == ["other.example/gate"]
        ((reason, kind, message),) = events(rest, "p1")
        assert (reason, kind) == (ALLOCATOR_UNAVAILABLE, "Warning")
        assert "gpuslice-system/gpuslice-dra-allocator is stale" in message
        assert not rest.denied
    finally:
        rest.stop()


# -- who puts the gate on ---------------------------------------------------------------------


SHARE = {"devices": {"requests": [{"name": "gpu", "exactly": {
    "deviceClassName": "share.gpuslice.io",
    "capacity": {"requests": {"compute": "25"}}}}]}}


def test_admission_gates_a_share_pod_only_while_the_allocator_is_up() -> None:
    p = pod("p", "c")
    ok = admission_patch(p, [SHARE], lease_fresh=True)
    assert ok.ops == ({"op": "add", "path": "/spec/schedulingGates", "value": GATE},)
    assert apply_json_patch(p, list(ok.ops))["spec"]["schedulingGates"] == GATE
    # another gate already on: ours is appended
    two = admission_patch(pod("p", "c", schedulingGates=[{"name": "x/y"}]), [SHARE],
                          lease_fresh=True)
    assert two.ops[0]["path"] == "/spec/schedulingGates/-"
    # the allocator down: pods go straight to kube-scheduler's own allocation
    assert admission_patch(p, [SHARE], lease_fresh=False).ops == ()
    whole = {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.gpuslice.io"}}]}}
    for spec, why in (([whole], "shape"), ([None], "does not exist"),
                      ([SHARE, SHARE], "exactly one claim")):
        got = admission_patch(p, spec, lease_fresh=True)
        assert got.ops == () and why in got.why, got
    assert admission_patch(pod("p", "c", node_name="n1"), [SHARE], lease_fresh=True).ops == ()
    assert admission_patch(gated("p", "c"), [SHARE], lease_fresh=True).ops == ()


def test_a_gate_can_be_removed_but_never_added_after_creation() -> None:
    """The rule that makes admission (or the pod's template) the only place a gate is put
    on: ``validateOnlyDeletedSchedulingGates``; the fakes hold the allocator to it."""
    api = FakeApiServer()
    api.add_pod(gated("p1", "c1"))
    p = api.get_pod("ml", "p1")
    with pytest.raises(ApiInvalid, match="deletion"):
        api.remove_pod_scheduling_gate("ml", "p1", [
            {"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": "x/y"}}])
    moved = [{"op": "test", "path": "/spec/schedulingGates/0/name", "value": "x/y"},
             {"op": "remove", "path": "/spec/schedulingGates/0"}]
    with pytest.raises(ApiInvalid, match="test"):  # a gate not where it was read: refused
        api.remove_pod_scheduling_gate("ml", "p1", moved)
    out = api.remove_pod_scheduling_gate("ml", "p1", removal_patch(p))
    assert out["spec"]["schedulingGates"] == []
