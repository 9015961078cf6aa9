"""The chaos soak's auditor (gpuslice.devcluster.audit, audit_dra) on hand-written pods, nodes,
claims and slices: each rule finds the violation it is there for, and says nothing of a
cluster that keeps the rules (so a soak's 0 means something)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuslice.adapters.kube.annotation import encode
from gpuslice.core.assignment import (
    ANNOTATION,
    Assignment,
    ContainerAssignment,
    GpuShare,
    Mode,
    sign,
)
from gpuslice.devcluster import audit as A
from gpuslice.devcluster import audit_dra as D

KEY = b"unit-test-assignment-key-0123456789"
NOW = 1_800_000_000.0


def _iso(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node(name: str = "n1", gpus: int = 2, mig: list[dict[str, Any]] | None = None,
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    inv = [{"uuid": f"GPU-{name}-{i}", "index": i, "model": "A100-80GB", "memoryMiB": 81920,
            **({"mig": mig} if mig and i == 0 else {})} for i in range(gpus)]
    return {"metadata": {"name": name, "labels": labels or {"pool": "dp"},
                         "annotations": {A.INVENTORY: json.dumps(inv)}}}


MIG = [{"uuid": "MIG-0", "profile": "3g.40gb", "start": 0, "memoryMiB": 40192},
       {"uuid": "MIG-4", "profile": "3g.40gb", "start": 4, "memoryMiB": 40192}]


def pod(name: str, shares: list[tuple[str, int, int]] | None = None, *,
        mode: Mode = Mode.MPS, node_name: str = "n1", key: bytes = KEY,
        mig: tuple[str, int] | None = None, milli: int = 500, memory: int = 8192,
        **meta: Any) -> dict[str, Any]:
    """A pod asking ``milli`` of one GPU; with ``shares`` (uuid, milli, MiB), bound to
    ``node_name`` with an assignment of them signed under ``key``."""
    p: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                     "creationTimestamp": _iso(NOW - 100), "annotations": {}, **meta},
        "spec": {"nodeSelector": {"pool": "dp"}, "containers": [{"name": "c0", "resources": {
            "limits": {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": str(milli),
                       "gpuslice.io/gpu-memory": str(memory)}}}]},
        "status": {"phase": "Pending"}}
    if shares is not None:
        p["spec"]["nodeName"] = node_name
        p["status"]["phase"] = "Running"
        gpus = tuple(GpuShare(u, m, mib, *(mig or ("", -1))) for u, m, mib in shares)
        a = sign(Assignment("ns", name, f"uid-{name}", node_name,
                            (ContainerAssignment("c0", mode, gpus),), "2026-01-01T00:00:00Z"),
                 key)
        p["metadata"]["annotations"][ANNOTATION] = encode(a)
    return p


def rules(vs: list[A.Violation]) -> list[str]:
    return sorted(v.rule for v in vs)


def test_a_cluster_that_keeps_the_rules_has_no_violation() -> None:
    pods = [pod("a", [("GPU-n1-0", 500, 40960)]), pod("b", [("GPU-n1-0", 500, 40960)]),
            pod("c", [("GPU-n1-1", 1000, 81920)], mode=Mode.EXCLUSIVE),
            pod("mig", [("GPU-n1-0", 428, 40192)], mode=Mode.MIG, mig=("3g.40gb", 0))]
    nodes = [node(mig=None), node("n2", mig=MIG)]
    pods[3]["spec"]["nodeName"] = "n2"
    pods[3] = pod("mig", [("GPU-n2-0", 428, 40192)], mode=Mode.MIG, mig=("3g.40gb", 0),
                  node_name="n2")
    assert A.audit_pods(pods, nodes, KEY) == []


@pytest.mark.parametrize(("shares", "what"), [
    ([("GPU-n1-0", 600, 8192), ("GPU-n1-0", 500, 8192)], "1100 milli of 1000"),
    ([("GPU-n1-0", 300, 50000), ("GPU-n1-0", 300, 40000)], "90000 MiB of 81920"),
])
def test_a_gpu_over_its_capacity_is_found(shares: list[tuple[str, int, int]],
                                          what: str) -> None:
    pods = [pod(f"p{i}", [s]) for i, s in enumerate(shares)]
    (v,) = A.audit_pods(pods, [node()], KEY)
    assert v.rule == "gpu-over-capacity" and what in v.detail
    assert v.subject == "n1/GPU-n1-0" and "ns/p0" in v.detail and "ns/p1" in v.detail


def test_a_whole_gpu_held_by_a_second_pod_is_double_booked() -> None:
    pods = [pod("whole", [("GPU-n1-0", 1000, 81920)], mode=Mode.EXCLUSIVE),
            pod("slice", [("GPU-n1-0", 100, 0)])]
    got = A.audit_pods(pods, [node()], KEY)
    assert "double-booked" in rules(got) and "gpu-over-capacity" in rules(got)


def test_a_mig_instance_held_by_two_pods_is_double_booked() -> None:
    pods = [pod(n, [("GPU-n1-0", 428, 40192)], mode=Mode.MIG, mig=("3g.40gb", 4))
            for n in ("m1", "m2")]
    got = A.audit_pods(pods, [node(mig=MIG)], KEY)
    assert rules(got) == ["double-booked"]  # 856 milli, 80384 MiB: the GPU has room
    assert "MIG instance held by ns/m1, ns/m2" in next(
        v.detail for v in got if v.rule == "double-booked")


def test_mps_slices_over_a_mig_instances_share_are_found() -> None:
    """A 3g of an A100's 7 slices stands for 428 milli: 300 + 200 of MPS slices exceed it,
    though the GPU's 1000 do not."""
    pods = [pod(n, [("GPU-n1-0", m, 1024)], mig=("3g.40gb", 0))
            for n, m in (("s1", 300), ("s2", 200))]
    (v,) = A.audit_pods(pods, [node(mig=MIG)], KEY)
    assert v.rule == "gpu-over-capacity" and "428 milli" in v.detail


@pytest.mark.parametrize(("make", "why"), [
    (lambda: pod("x", [("GPU-n1-0", 500, 8192)], key=b"another-key-of-32-bytes-length!!"),
     "does not verify"),
    (lambda: pod("x", [("GPU-n1-0", 500, 8192)], node_name="n1") | {
        "spec": {**pod("x")["spec"], "nodeName": "n2"}}, "bound to n2, the assignment names n1"),
    (lambda: {**(p := pod("x")), "spec": {**p["spec"], "nodeName": "n1"}},
     "without a gpuslice.io/assignment"),
    (lambda: pod("x", [("GPU-n1-0", 500, 8192)], uid="someone-else"), "pod UID"),
])
def test_a_bound_pod_without_a_verified_assignment_is_found(make: Any, why: str) -> None:
    p = make()
    got = A.audit_pods([p], [node(), node("n2")], KEY)
    assert [v.rule for v in got] == ["unverified-assignment"] and why in got[0].detail


def test_an_assignment_edited_after_signing_does_not_verify() -> None:
    p = pod("x", [("GPU-n1-0", 100, 8192)])
    doc = json.loads(p["metadata"]["annotations"][ANNOTATION])
    doc["containers"][0]["gpus"][0]["milli"] = 50  # a user lowers their share
    p["metadata"]["annotations"][ANNOTATION] = json.dumps(doc)
    (v,) = A.audit_pods([p], [node()], KEY)
    assert v.rule == "unverified-assignment" and "does not verify" in v.detail


def test_a_forged_assignment_holds_nothing_but_is_reported() -> None:
    forged = pod("f", [("GPU-n1-0", 900, 8192)], key=b"forged-key-forged-key-forged-key")
    ok = pod("g", [("GPU-n1-0", 900, 8192)])
    assert rules(A.audit_pods([forged, ok], [node()], KEY)) == ["unverified-assignment"]


def test_a_terminating_pod_still_holds_and_a_finished_one_does_not() -> None:
    leaving = pod("old", [("GPU-n1-0", 1000, 81920)], mode=Mode.EXCLUSIVE,
                  deletionTimestamp=_iso(NOW))
    new = pod("new", [("GPU-n1-0", 1000, 81920)], mode=Mode.EXCLUSIVE)
    got = A.audit_pods([leaving, new], [node()], KEY)
    assert "double-booked" in rules(got)
    assert "ns/old (terminating)" in next(v.detail for v in got if v.rule == "double-booked")
    leaving["status"]["phase"] = "Succeeded"
    assert A.audit_pods([leaving, new], [node()], KEY) == []


def test_an_assignment_naming_a_gpu_its_node_does_not_publish_is_found() -> None:
    got = A.audit_pods([pod("x", [("GPU-n9-0", 100, 1024)])], [node()], KEY)
    assert rules(got) == ["unknown-device"]
    whole_of_mig = pod("y", [("GPU-n1-0", 100, 1024)])
    assert "MIG-enabled" in A.audit_pods([whole_of_mig], [node(mig=MIG)], KEY)[0].detail


def test_a_malformed_inventory_is_a_violation() -> None:
    n = node()
    n["metadata"]["annotations"][A.INVENTORY] = "[{\"uuid\": 3}]"
    assert rules(A.audit_pods([], [n], KEY)) == ["bad-inventory"]


def _unschedulable(p: dict[str, Any], message: str = "0/3 nodes are available") -> None:
    p["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                  "reason": "Unschedulable", "message": message}]


def test_a_pending_pod_needs_a_current_reason_after_the_grace() -> None:
    def age(p: A.Obj) -> float:
        return NOW - (A.parse_time(A.meta_of(p)["creationTimestamp"]) or NOW)

    old, young, told, evented, stale = (pod(n) for n in ("old", "young", "told", "ev", "st"))
    young["metadata"]["creationTimestamp"] = _iso(NOW - 5)
    _unschedulable(told)
    events = A.failed_scheduling([
        {"reason": "FailedScheduling", "involvedObject": {"uid": "uid-ev"},
         "lastTimestamp": _iso(NOW - 10)},
        {"reason": "FailedScheduling", "involvedObject": {"uid": "uid-st"},
         "lastTimestamp": _iso(NOW - 900)},
        {"reason": "Scheduled", "involvedObject": {"uid": "uid-old"},
         "lastTimestamp": _iso(NOW - 1)}])
    got = A.audit_pending([old, young, told, evented, stale], age, 60.0, events, NOW - 300)
    assert sorted(v.subject for v in got) == ["pod ns/old", "pod ns/st"]
    assert all(v.rule == "pending-without-reason" for v in got)
    empty = pod("empty")
    _unschedulable(empty, message="  ")
    assert A.audit_pending([empty], age, 60.0, {}, NOW - 300)[0].rule == \
        "pending-without-reason"
    bound = pod("b", [("GPU-n1-0", 100, 1024)])
    assert A.audit_pending([bound], age, 60.0, {}, NOW - 300) == []


def test_the_auditors_fit_finds_room_and_only_room() -> None:
    nodes = [node(gpus=1)]
    inv, _ = A.inventories(nodes)
    held, _ = A.held_by_pods([pod("a", [("GPU-n1-0", 600, 8192)])], inv, KEY)
    assert A.fits_now(pod("small", milli=400, memory=8192), nodes, held, inv) == \
        "n1/GPU-n1-0"
    assert A.fits_now(pod("big", milli=500, memory=8192), nodes, held, inv) == ""
    other = pod("elsewhere", milli=100)
    other["spec"]["nodeSelector"] = {"pool": "dra"}
    assert A.fits_now(other, nodes, held, inv) == ""
    mig_nodes = [node(gpus=1, mig=MIG)]
    minv, _ = A.inventories(mig_nodes)
    mheld, _ = A.held_by_pods([pod("m", [("GPU-n1-0", 428, 40192)], mode=Mode.MIG,
                                   mig=("3g.40gb", 0))], minv, KEY)
    want = pod("w", milli=429, memory=0, annotations={"gpuslice.io/isolation": "mig"})
    assert A.fits_now(want, mig_nodes, mheld, minv) == "n1/GPU-n1-0 MIG 3g.40gb@4"


@pytest.mark.parametrize(("text", "value"), [
    ("25", 25), ("20Gi", 20 * 2**30), ("100m", 0.1), ("1.5", 1.5), ("1k", 1000),
    ("1e3", 1000), ("80Gi", 80 * 2**30)])
def test_quantities(text: str, value: float) -> None:
    assert float(A.quantity(text)) == pytest.approx(value)


# -- DRA ----------------------------------------------------------------------------------


def _slice(pool: str = "n1", generation: int = 1) -> dict[str, Any]:
    share = {"name": "gpu-0", "allowMultipleAllocations": True,
             "attributes": {"type": {"string": "share"}},
             "capacity": {"compute": {"value": "100", "requestPolicy": {
                 "default": "100", "validRange": {"min": "1", "step": "1"}}},
                 "memory": {"value": "80Gi"}}}
    whole = {"name": "gpu-1", "attributes": {"type": {"string": "gpu"}},
             "capacity": {"memory": {"value": "80Gi"}}}
    # MIG placements consume the memory slices they cover (one counter each): 3g at 0, 2
    # (overlapping both) and 4
    migs = [{"name": f"gpu-2-mig-3g-{s}", "attributes": {"type": {"string": "mig"}},
             "consumesCounters": [{"counterSet": "gpu-2", "counters": {
                 f"slice-{k}": {"value": "1"} for k in range(s, s + 3)}}]} for s in (0, 2, 4)]
    return {"spec": {"driver": D.DRIVER, "nodeName": pool,
                     "pool": {"name": pool, "generation": generation, "resourceSliceCount": 1},
                     "devices": [share, whole, *migs],
                     "sharedCounters": [{"name": "gpu-2", "counters": {
                         f"slice-{k}": {"value": "1"} for k in range(7)}}]}}


def claim(name: str, device: str, consumed: dict[str, str] | None = None,
          node_name: str = "n1", reserved: list[str] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"request": "gpu", "driver": D.DRIVER, "pool": "n1",
                           "device": device}
    if consumed:
        res["consumedCapacity"] = consumed
        res["shareID"] = f"share-{name}"
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"cuid-{name}"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "share.gpuslice.io",
                "capacity": {"requests": consumed or {}}}}]}},
            "status": {"allocation": {"devices": {"results": [res]}, "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name",
                                                        "operator": "In",
                                                        "values": [node_name]}]}]}},
                       "reservedFor": [{"resource": "pods", "name": r, "uid": f"uid-{r}"}
                                       for r in reserved or []]}}


def test_dra_claims_within_capacity_have_no_violation() -> None:
    claims = [claim("a", "gpu-0", {"compute": "60", "memory": "40Gi"}),
              claim("b", "gpu-0", {"compute": "40", "memory": "40Gi"}),
              claim("c", "gpu-1"), claim("d", "gpu-2-mig-3g-0"), claim("e", "gpu-2-mig-3g-4")]
    assert D.audit_claims(claims, [_slice()]) == []


def test_dra_a_whole_device_in_two_claims_is_double_allocated() -> None:
    (v,) = D.audit_claims([claim("a", "gpu-1"), claim("b", "gpu-1")], [_slice()])
    assert v.rule == "dra-double-allocated" and v.subject == "device n1/gpu-1"


def test_dra_shares_past_the_devices_capacity_are_found() -> None:
    claims = [claim("a", "gpu-0", {"compute": "60", "memory": "10Gi"}),
              claim("b", "gpu-0", {"compute": "50", "memory": "10Gi"})]
    (v,) = D.audit_claims(claims, [_slice()])
    assert v.rule == "dra-over-capacity" and "compute: 110 of 100" in v.detail


def test_dra_overlapping_mig_placements_exceed_the_counter_set() -> None:
    (v,) = D.audit_claims([claim("a", "gpu-2-mig-3g-0"), claim("b", "gpu-2-mig-3g-2")],
                          [_slice()])
    assert v.rule == "dra-over-capacity" and v.subject == "counter set n1/gpu-2"
    assert "slice-2: 2 of 1" in v.detail


def test_dra_only_the_newest_generation_of_a_pool_counts() -> None:
    old = _slice(generation=1)
    old["spec"]["devices"][0]["capacity"]["compute"]["value"] = "1000"
    claims = [claim("a", "gpu-0", {"compute": "60"}), claim("b", "gpu-0", {"compute": "60"})]
    assert [v.rule for v in D.audit_claims(claims, [old, _slice(generation=2)])] == \
        ["dra-over-capacity"]


def _dra_pod(name: str, node_name: str | None, claim_name: str) -> dict[str, Any]:
    p = pod(name)
    p["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    p["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": claim_name}]
    if node_name:
        p["spec"]["nodeName"] = node_name
    return p


def test_dra_a_bound_pod_must_be_where_its_claim_is_and_hold_it() -> None:
    ok = (_dra_pod("p", "n1", "c"), claim("c", "gpu-1", reserved=["p"]))
    assert D.audit_bound([ok[0]], [ok[1]]) == []
    elsewhere = (_dra_pod("q", "n2", "c"), claim("c", "gpu-1", reserved=["q"]))
    assert [v.rule for v in D.audit_bound([elsewhere[0]], [elsewhere[1]])] == \
        ["dra-node-mismatch"]
    unreserved = claim("c", "gpu-1", reserved=["someone"])
    assert "not reserved" in D.audit_bound([ok[0]], [unreserved])[0].detail
    missing = D.audit_bound([_dra_pod("r", "n1", "gone")], [])
    assert [v.rule for v in missing] == ["dra-unallocated-bound"]
    assert D.audit_bound([_dra_pod("s", None, "gone")], []) == []  # pending: not judged


def test_dra_the_auditors_fit_of_a_pending_claim() -> None:
    p = D.pools([_slice()])
    use = D.use_of([claim("a", "gpu-0", {"compute": "70", "memory": "10Gi"})], p)
    pending = claim("x", "gpu-0", {"compute": "25", "memory": "8Gi"})
    pending["status"] = {}
    assert D.claim_fits(pending, {"n1"}, p, use) == "n1/gpu-0"
    assert D.claim_fits(pending, {"n2"}, p, use) == ""
    too_big = claim("y", "gpu-0", {"compute": "40", "memory": "8Gi"})
    too_big["status"] = {}
    assert D.claim_fits(too_big, {"n1"}, p, use) == ""
