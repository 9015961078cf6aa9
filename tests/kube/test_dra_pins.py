"""Pods that ask for no device, placed by the claim allocator and pinned softly to their node
(the webhook's ``--gate-cpu-only``; adapters/kube/cpu_pods.py, services/dra_pins.py), over
HTTP: the real Kubernetes client against the REST fake with the allocator's own
ServiceAccount and RBAC (deploy/dra-allocator), so the pin is a write it is granted.

Upstream rules held here (kubernetes v1.36.3):

* pkg/apis/core/validation/validation.go, ``ValidatePodUpdate`` / ``validateNodeAffinityMutation``:
  while the pod as stored is gated, its preferred node-affinity terms may change (the fake
  allows that and nothing else of the spec besides deleting gates);
* k8s.io/api core/v1/toleration.go, ``(*Toleration).ToleratesTaint``, and
  pkg/scheduler/framework/plugins/tainttoleration/taint_toleration.go, ``Filter`` (taints of
  effect NoSchedule and NoExecute) and ``Score`` (PreferNoSchedule, weight 3: a pin, weight
  2, would lose to it), nodeunschedulable/node_unschedulable.go, ``Filter``
  (``spec.unschedulable`` unless the pod tolerates node.kubernetes.io/unschedulable:NoSchedule):
  the nodes a pod may be pinned to (:func:`gpuslice.adapters.kube.cpu_pods.admits`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube.cpu_pods import (
    PINNED_TO,
    admits,
    cpu_only_admission,
    pin_patch,
    pinned_node,
    tolerates,
    why_not_pinned,
)
from gpuslice.adapters.kube.dra_gate import ALLOCATOR_GATE
from gpuslice.adapters.kube.fake import ApiInvalid, FakeApiServer, apply_json_patch
from gpuslice.core.dra_gate import LEFT_TO_SCHEDULER
from gpuslice.services.webhook.gate import DraGate
from tests.kube.rest_fake import DEPLOY, EXAMPLES, Rbac, RestApiServer
from tests.kube.test_dra_allocator import ALLOCATOR, DRA_DEPLOY, allocator, cluster, node

GATE = [{"name": ALLOCATOR_GATE}]


@pytest.fixture
def rest() -> Iterator[RestApiServer]:
    server = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, DRA_DEPLOY))).start()
    yield server
    server.stop()


def cpu_pod(name: str, cpu: str = "4", gated: bool = True, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml",
                         "creationTimestamp": f"2026-12-06T00:00:{len(name):02d}Z"},
            "spec": {"containers": [{"name": "main", "image": "registry.local/app:1",
                                     "resources": {"requests": {"cpu": cpu,
                                                                "memory": "1Gi"}}}],
                     **({"schedulingGates": list(GATE)} if gated else {}), **spec},
            "status": {"phase": "Pending"}}


def pin_of(p: dict[str, Any]) -> str | None:
    """The node of the pod's preferred term of weight 100 on metadata.name, if any."""
    terms = (((p["spec"].get("affinity") or {}).get("nodeAffinity") or {})
             .get("preferredDuringSchedulingIgnoredDuringExecution") or [])
    for t in terms:
        for f in t["preference"].get("matchFields") or []:
            if t["weight"] == 100 and f["key"] == "metadata.name" and f["operator"] == "In":
                return str(f["values"][0])
    return None


def cpu_node(rest: RestApiServer, name: str, **spec: Any) -> None:
    """A node with no device of ours (no ResourceSlice)."""
    rest.add_node({**node(name), "spec": spec})


# -- the allocator ------------------------------------------------------------------------


def test_a_held_pod_without_claims_is_pinned_where_it_strands_no_gpu(
        rest: RestApiServer, tmp_path: Path) -> None:
    """One pass: the policy puts a pod that would take most of a GPU node's CPU on the node
    without GPUs; one PATCH removes the gate and pins it (affinity term, annotation); no
    Event on the normal path."""
    cluster(rest)  # n1: 4 GPUs, 64 CPUs
    cpu_node(rest, "cpu1")  # 64 CPUs, no GPU
    rest.add_pod(cpu_pod("web", cpu="60"))
    report = allocator(rest, tmp_path).run_once()
    assert report.pinned == {"ml/web": "cpu1"}, report
    got = rest.get_pod("ml", "web")
    assert got["spec"]["schedulingGates"] == []
    assert pin_of(got) == "cpu1" and pinned_node(got) == "cpu1"
    writes = [(verb, path) for who, verb, path, _ in rest.requests
              if who == ALLOCATOR and verb in ("PUT", "PATCH", "POST")]
    assert writes == [("PATCH", "/api/v1/namespaces/ml/pods/web")]
    assert not rest.denied and not report.released


def test_a_pinned_pod_counts_on_its_node_until_bound(rest: RestApiServer,
                                                     tmp_path: Path) -> None:
    """Within a pass (the ledger) and across passes (the book reads the pin back from the
    pod): a second pod that would not fit beside the first goes elsewhere."""
    cluster(rest)
    cpu_node(rest, "cpu1")
    rest.add_pod(cpu_pod("a", cpu="40"))
    rest.add_pod(cpu_pod("bb", cpu="40"))
    alloc = allocator(rest, tmp_path)
    assert alloc.run_once().pinned == {"ml/a": "cpu1", "ml/bb": "n1"}
    rest.add_pod(cpu_pod("ccc", cpu="30"))  # neither has 30 CPUs left until they are bound
    report = alloc.run_once()
    assert report.pinned == {}, report
    assert report.released == {"ml/ccc": LEFT_TO_SCHEDULER}
    assert pin_of(rest.get_pod("ml", "ccc")) is None


def test_the_pin_respects_taints_and_cordons(rest: RestApiServer, tmp_path: Path) -> None:
    """A node kube-scheduler's filters would refuse the pod is not one it is pinned to."""
    cluster(rest)
    cpu_node(rest, "cpu1", taints=[{"key": "dedicated", "value": "db", "effect": "NoSchedule"}])
    cpu_node(rest, "cpu2", unschedulable=True)
    rest.add_pod(cpu_pod("plain", cpu="60"))
    rest.add_pod(cpu_pod("tol", cpu="60", tolerations=[
        {"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoSchedule"}]))
    report = allocator(rest, tmp_path).run_once()
    assert report.pinned == {"ml/plain": "n1", "ml/tol": "cpu1"}, report


def test_a_pod_that_fits_nowhere_goes_to_kube_scheduler_with_an_event(
        rest: RestApiServer, tmp_path: Path) -> None:
    cluster(rest)
    rest.add_pod(cpu_pod("huge", cpu="100"))
    report = allocator(rest, tmp_path).run_once()
    assert report.released == {"ml/huge": LEFT_TO_SCHEDULER} and not report.pinned
    got = rest.get_pod("ml", "huge")
    assert got["spec"]["schedulingGates"] == [] and pin_of(got) is None
    ((reason, kind, message),) = [(e["reason"], e["type"], e["message"]) for e in rest.events]
    assert (reason, kind) == (LEFT_TO_SCHEDULER, "Normal") and "room" in message


def test_a_pass_pins_at_most_its_share_and_the_rest_keep_their_gate(
        rest: RestApiServer, tmp_path: Path) -> None:
    cluster(rest)
    for i in range(3):
        rest.add_pod(cpu_pod(f"p{i}"))
    alloc = allocator(rest, tmp_path, max_writes_per_pass=2)
    first = alloc.run_once()
    assert sorted(first.pinned) == ["ml/p0", "ml/p1"] and not first.released
    assert rest.get_pod("ml", "p2")["spec"]["schedulingGates"] == GATE
    assert first.next_due is not None  # the rest at once
    assert sorted(alloc.run_once().pinned) == ["ml/p2"]


def test_pods_to_leave_alone_are_not_pinned(rest: RestApiServer, tmp_path: Path) -> None:
    """A pod with its own placement wishes, or held by someone else too, keeps them: the
    allocator releases ours (a Normal Event) or leaves it be."""
    cluster(rest)
    rest.add_pod(cpu_pod("sel", nodeSelector={"zone": "a"}))
    rest.add_pod(cpu_pod("other", schedulingGates=[*GATE, {"name": "x/y"}]))
    report = allocator(rest, tmp_path).run_once()
    assert report.pinned == {}
    assert report.released == {"ml/sel": LEFT_TO_SCHEDULER}
    assert [g["name"] for g in rest.get_pod("ml", "other")["spec"]["schedulingGates"]] == \
        [ALLOCATOR_GATE, "x/y"]


# -- the objects ---------------------------------------------------------------------------


def test_the_pin_patch_keeps_what_the_pod_had() -> None:
    p = cpu_pod("p", affinity={}, tolerations=[{"operator": "Exists"}])
    p["metadata"]["annotations"] = {"team": "web"}
    out = apply_json_patch(p, pin_patch(p, "n7"))
    assert out["spec"]["schedulingGates"] == [] and pin_of(out) == "n7"
    assert out["metadata"]["annotations"] == {"team": "web", PINNED_TO: "n7"}
    assert out["spec"]["tolerations"] == [{"operator": "Exists"}]
    bare = apply_json_patch(cpu_pod("q"), pin_patch(cpu_pod("q"), "n1"))
    assert bare["metadata"]["annotations"] == {PINNED_TO: "n1"} and pin_of(bare) == "n1"


def test_the_fake_api_server_allows_the_pin_only_while_the_pod_is_gated() -> None:
    """``validateNodeAffinityMutation``: preferred terms change freely on a gated pod; the
    required ones are not loosened (this fake refuses any change to them), and an ungated
    pod's affinity is immutable."""
    api = FakeApiServer()
    api.add_pod(cpu_pod("p"))
    p = api.get_pod("ml", "p")
    required = [{"op": "add", "path": "/spec/affinity", "value": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In",
                              "values": ["n1"]}]}]}}}}]
    with pytest.raises(ApiInvalid):
        api.remove_pod_scheduling_gate("ml", "p", required)
    out = api.remove_pod_scheduling_gate("ml", "p", pin_patch(p, "n1"))
    assert pin_of(out) == "n1" and pinned_node(out) == "n1"
    again = [{"op": "replace", "path": "/spec/affinity/nodeAffinity/preferredDuringScheduling"
              "IgnoredDuringExecution/0/weight", "value": 1}]
    with pytest.raises(ApiInvalid):  # no gate left: the spec is immutable
        api.remove_pod_scheduling_gate("ml", "p", again)


def test_which_pods_are_pinned() -> None:
    assert why_not_pinned(cpu_pod("p")) is None
    assert why_not_pinned(cpu_pod("p", schedulerName="default-scheduler")) is None
    for spec, words in (
            ({"resourceClaims": [{"name": "g", "resourceClaimName": "c"}]}, "ResourceClaim"),
            ({"nodeName": "n1"}, "names its node"),
            ({"schedulerName": "gpuslice-scheduler"}, "scheduler"),
            ({"nodeSelector": {"a": "b"}}, "node selector"),
            ({"affinity": {"podAntiAffinity": {"x": 1}}}, "affinity"),
            ({"affinity": {"nodeAffinity": {"x": 1}}}, "affinity"),
            ({"topologySpreadConstraints": [{"maxSkew": 1}]}, "spread"),
            ({"schedulingGates": [{"name": "x/y"}]}, "another scheduling gate")):
        why = why_not_pinned(cpu_pod("p", gated=False, **spec))
        assert why is not None and words in why, (spec, why)


def test_admission_gates_a_pod_without_claims_only_when_asked_and_the_allocator_is_up() -> None:
    p = cpu_pod("p", gated=False)
    ok = cpu_only_admission(p, lease_fresh=True)
    assert ok.ops == ({"op": "add", "path": "/spec/schedulingGates", "value": GATE},)
    assert cpu_only_admission(p, lease_fresh=False).ops == ()
    assert cpu_only_admission(cpu_pod("p"), lease_fresh=True).ops == ()  # gated already
    assert cpu_only_admission(cpu_pod("p", gated=False, nodeSelector={"a": "b"}),
                              lease_fresh=True).ops == ()

    lease = {"spec": {"holderIdentity": "a-0", "renewTime": "2026-12-06T00:00:00Z",
                      "leaseDurationSeconds": 15}}

    class Reads:
        def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
            return lease

        def get_resource_claim(self, *a: Any, **k: Any) -> dict[str, Any]:
            raise AssertionError("no claim to read")

        get_resource_claim_template = get_resource_claim

    at = 1_796_515_205.0  # 5 s after the renewal
    off = DraGate(Reads(), wall=lambda: at)(p, "ml")
    assert off.ops == () and "no claim" in off.why
    on = DraGate(Reads(), wall=lambda: at, cpu_only=True)(p, "ml")
    assert on.ops == ok.ops, on.why
    stale = DraGate(Reads(), wall=lambda: at + 60, cpu_only=True)(p, "ml")
    assert stale.ops == () and "stale" in stale.why


# -- kube-scheduler's filters, from the source ---------------------------------------------------


@pytest.mark.parametrize(("toleration", "taint", "want"), [
    # (1) an empty effect matches every effect, else the effects must be equal
    ({"key": "k", "operator": "Exists"}, {"key": "k", "effect": "NoExecute"}, True),
    ({"key": "k", "operator": "Exists", "effect": "NoSchedule"},
     {"key": "k", "effect": "NoExecute"}, False),
    # (2) Exists matches every value
    ({"key": "k", "operator": "Exists"}, {"key": "k", "value": "v", "effect": "NoSchedule"},
     True),
    # (3) an empty key with Exists matches every key
    ({"operator": "Exists"}, {"key": "any", "value": "v", "effect": "NoSchedule"}, True),
    # an empty operator is Equal: the values must be equal
    ({"key": "k", "value": "v"}, {"key": "k", "value": "v", "effect": "NoSchedule"}, True),
    ({"key": "k", "value": "v"}, {"key": "k", "value": "w", "effect": "NoSchedule"}, False),
    ({"key": "k", "operator": "Equal"}, {"key": "k", "effect": "NoSchedule"}, True),
    ({"key": "j", "operator": "Exists"}, {"key": "k", "effect": "NoSchedule"}, False),
    # the numeric operators (feature-gated): not matched here
    ({"key": "k", "operator": "Gt", "value": "1"}, {"key": "k", "value": "5",
                                                    "effect": "NoSchedule"}, False),
])
def test_tolerates_as_toleration_go_says(toleration: dict[str, str], taint: dict[str, str],
                                         want: bool) -> None:
    """k8s.io/api core/v1/toleration.go ``(*Toleration).ToleratesTaint``."""
    assert tolerates(toleration, taint) is want


def test_admits_as_the_taint_and_unschedulable_filters_do() -> None:
    """TaintToleration's ``Filter`` looks at NoSchedule and NoExecute taints, its ``Score``
    (weight 3, above the pin's 2) at PreferNoSchedule ones: no pin to a node with a taint of
    the three not tolerated; NodeUnschedulable's ``Filter`` at ``spec.unschedulable`` and the
    unschedulable taint's toleration."""
    soft = {"spec": {"taints": [{"key": "k", "effect": "PreferNoSchedule"}]}}
    hard = {"spec": {"taints": [{"key": "k", "effect": "NoExecute"}]}}
    cordoned = {"spec": {"unschedulable": True}}
    assert admits([], {}) and not admits([], soft)
    assert admits([{"key": "k", "operator": "Exists", "effect": "PreferNoSchedule"}], soft)
    assert not admits([], hard) and admits([{"key": "k", "operator": "Exists"}], hard)
    assert not admits([], cordoned)
    assert admits([{"key": "node.kubernetes.io/unschedulable", "operator": "Exists",
                    "effect": "NoSchedule"}], cordoned)
    assert not admits([], {"spec": {"taints": "k=v"}})  # a field of the wrong type
