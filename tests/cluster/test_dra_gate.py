"""The claim allocator's scheduling gate on the real control plane (issue 58): kube-scheduler
v1.36, kube-controller-manager, two kwok nodes whose GPUs a ``gpuslice dra-driver --fake-gpus``
process each publishes (tainted for the allocator while its Lease is fresh), and
``gpuslice dra-allocator`` as a process; each component on its own ServiceAccount with
deploy/dra's and deploy/dra-allocator's RBAC.

kube-scheduler rules these tests rely on (kubernetes v1.36.3):

* pkg/scheduler/framework/plugins/schedulinggates/scheduling_gates.go, ``PreEnqueue``: a pod
  with a scheduling gate is not tried at all (no FailedScheduling while it is gated);
* pkg/scheduler/backend/queue/scheduling_queue.go, ``PriorityQueue.Update`` ->
  ``requeuePodWithQueueingStrategy``: the update that removes the last gate moves the pod to
  the active queue, and backoff_queue.go ``getBackoffTime`` gives a pod never tried
  (``UnschedulableCount`` 0) no backoff: it is scheduled at once, and once;
* pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go, ``PreFilter`` (an
  allocated claim's ``allocation.nodeSelector`` becomes the claim's ``availableOnNodes``) and
  ``Filter`` (a node it does not match is refused): the pod goes to the node of the claim the
  allocator allocated, and ``PreBind`` writes nothing to a claim the allocator reserved for
  the pod with its allocation (``resourceclaim.IsReservedForPod``);
* pkg/controller/resourceclaim/controller.go, ``podNeedsClaims`` / ``syncPod``: the claim of a
  pod's template is created for a gated pod too (gates do not matter to it), so the
  allocator can allocate it before the pod is ever tried;
* dynamic-resource-allocation structured allocator, ``taintPreventsAllocation``: kube-scheduler
  does not allocate a device with a NoSchedule taint the claim does not tolerate, so while
  the allocator is down (its Lease stale, the drivers' taint gone) kube-scheduler allocates
  the pods the drivers released from the gate.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import devcluster
from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube.cpu_pods import PINNED_TO
from gpuslice.core.dra_gate import ALLOCATOR_UNAVAILABLE, NOT_PLACED
from gpuslice.devcluster import DevCluster, wait_until
from tests.cluster.conftest import DEPLOY
from tests.cluster.helpers import GROUP, Kube, bound, describe
from tests.cluster.test_webhook import webhook  # noqa: F401 (the fixture, served here too)
from tests.fake_mps import write_fake_mps

NS = "t-dra-gate"
NODES = ("gate-a", "gate-b")
GATE = [{"name": kdra.ALLOCATOR_GATE}]
LEASE = ("gpuslice-system", "gpuslice-dra-allocator")


@dataclass
class GateCluster:
    dev: DevCluster
    kube: Kube
    allocator_kubeconfig: Path
    drivers: list[tuple[subprocess.Popen[bytes], Path, Path]] = field(default_factory=list)
    allocator: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def objects(self) -> Any:
        return self.kube.client.CustomObjectsApi(self.kube.api_client)

    def start_allocator(self) -> None:
        """``gpuslice dra-allocator`` as deploy/dra-allocator runs it (``--settle 1``): until
        it holds its Lease and its devices have settled."""
        self.starts += 1
        log = self.dev.dir / f"dra-allocator-gate-{self.starts}.log"
        with log.open("wb") as out:
            self.allocator = subprocess.Popen(
                [sys.executable, "-m", "gpuslice.cli", "dra-allocator", "--kubeconfig",
                 str(self.allocator_kubeconfig), "--settle", "1", "--identity",
                 f"gate-test-{self.starts}"], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until("the allocator holding its Lease", lambda: self._alive(log) and
                   b"holding the Lease" in log.read_bytes(), 120, every_s=0.2)
        # the drivers taint within their 2 s Lease poll; the allocator uses a device 1 s later
        wait_until("every GPU tainted for the allocator", self.all_tainted, 60, every_s=0.5)
        time.sleep(1.5)

    def _alive(self, log: Path) -> bool:
        assert self.allocator is not None
        if self.allocator.poll() is not None:
            raise AssertionError(f"dra-allocator exited:\n{log.read_text()[-3000:]}")
        return True

    def all_tainted(self) -> bool:
        devs = [d for s in self.objects.list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices")["items"]
            if s["spec"].get("nodeName") in NODES for d in s["spec"].get("devices") or []]
        return bool(devs) and all(any(t.get("key") == kdra.ALLOCATOR_TAINT
                                      for t in d.get("taints") or []) for d in devs)

    def claim(self, name: str, compute: int, memory: str = "8Gi") -> dict[str, Any]:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "share.gpuslice.io",
                    "capacity": {"requests": {"compute": str(compute), "memory": memory}}}}]}}}

    def create_claims(self, *claims: dict[str, Any]) -> None:
        for c in claims:
            self.objects.create_namespaced_custom_object("resource.k8s.io", "v1", NS,
                                                         "resourceclaims", c)

    def events(self, pod: str) -> list[tuple[str, str, str, str]]:
        items = self.kube.core.list_namespaced_event(
            NS, field_selector=f"involvedObject.name={pod}").items
        return [(e.reason, e.type, e.message or "", (e.source.component or "")
                 if e.source else "") for e in items]


def gated_pod(name: str, *, claim: str | None = None, template: str | None = None,
              annotations: dict[str, str] | None = None) -> dict[str, Any]:
    ref = {"name": "gpu", **({"resourceClaimName": claim} if claim else
                             {"resourceClaimTemplateName": template})}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "annotations": annotations or {}},
            "spec": {"schedulingGates": GATE, "schedulerName": "default-scheduler",
                     "nodeSelector": {GROUP: NS}, "tolerations": [{"operator": "Exists"}],
                     "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [ref],
                     "containers": [{"name": "server", "image": "registry.local/model:1",
                                     "resources": {"requests": {"cpu": "1"},
                                                   "claims": [{"name": "gpu"}]}}]}}


def _start_driver(dev: DevCluster, node: str, kubeconfig: Path,
                  ) -> tuple[subprocess.Popen[bytes], Path, Path]:
    root = Path(tempfile.mkdtemp(prefix="dra-gate-", dir="/tmp"))  # short socket paths
    inv = root / "gpus.yaml"
    inv.write_text(yaml.safe_dump({"driver": "580.95.05", "gpus": [{"model": "H100-SXM"},
                                                                   {"model": "H100-SXM"}]}))
    log = dev.dir / f"dra-driver-{node}.log"
    argv = [sys.executable, "-m", "gpuslice.cli", "dra-driver", "--node", node,
            "--fake-gpus", str(inv), "--kubeconfig", str(kubeconfig), "--mode", "share",
            "--kubelet-dir", str(root / "k"), "--cdi-dir", str(root / "cdi"),
            "--mps-pipe-dir", str(root / "mps"),
            "--mps-binary", str(write_fake_mps(root / "mps-control")), "--metrics", "off"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, root, log


@pytest.fixture(scope="module")
def gates(dev: DevCluster, kube: Kube) -> Iterator[GateCluster]:
    """deploy/dra (namespace, RBAC, DeviceClasses) and deploy/dra-allocator's RBAC applied
    server-side, two kwok nodes with a driver each (drivers' ServiceAccount), the allocator
    running (its ServiceAccount)."""
    for manifest in ("namespace.yaml", "rbac.yaml", "deviceclasses.yaml"):
        extra = ("-n", "gpuslice-system") if manifest == "rbac.yaml" else ()
        dev.apply(DEPLOY / "dra" / manifest, *extra)
    dev.apply(DEPLOY / "dra-allocator" / "rbac.yaml", "-n", "gpuslice-system")
    kube.create_namespace(NS)
    kube.add_nodes([devcluster.kwok_node(n, gpus=0, cpu="8", labels={GROUP: NS})
                    for n in NODES])
    c = GateCluster(dev, kube, dev.service_account_kubeconfig("gpuslice-system",
                                                              "gpuslice-dra-allocator"))
    sa = dev.service_account_kubeconfig("gpuslice-system", "gpuslice-dra-driver")
    try:
        c.drivers = [_start_driver(dev, n, sa) for n in NODES]
        wait_until("both drivers' slices", lambda: {
            s["spec"].get("nodeName") for s in c.objects.list_cluster_custom_object(
                "resource.k8s.io", "v1", "resourceslices")["items"]} >= set(NODES), 120,
            every_s=1.0)
        c.start_allocator()
        yield c
    finally:
        for p in [c.allocator, *(d[0] for d in c.drivers)]:
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        for _, root, _ in c.drivers:
            shutil.rmtree(root, ignore_errors=True)
        kube.cleanup_group(NS)


def _failed_scheduling(c: GateCluster, pod: str) -> list[str]:
    return [m for r, _, m, _ in c.events(pod) if r == "FailedScheduling"]


def _results(c: GateCluster, claim: str) -> list[dict[str, Any]]:
    got = c.objects.get_namespaced_custom_object("resource.k8s.io", "v1", NS,
                                                 "resourceclaims", claim)
    return list(((got.get("status") or {}).get("allocation") or {}).get("devices", {})
                .get("results") or [])


def test_a_gated_pod_is_scheduled_once_after_its_claim_is_allocated(gates: GateCluster,
                                                                     kube: Kube) -> None:
    """A pod of a claim template, created with the gate: kube-controller-manager makes its
    claim, the allocator allocates it and removes the gate, kube-scheduler binds the pod to
    that claim's node on its first and only attempt (no FailedScheduling Event). A claim no
    device can hold is released at once with a ClaimNotPlaced Event, and kube-scheduler
    then says why it cannot place it."""
    gates.objects.create_namespaced_custom_object(
        "resource.k8s.io", "v1", NS, "resourceclaimtemplates",
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
         "metadata": {"name": "quarter", "namespace": NS},
         "spec": {"spec": gates.claim("x", 25)["spec"]}})
    gates.create_claims(gates.claim("huge", 100, "4000Gi"))
    kube.create([gated_pod("one", template="quarter"), gated_pod("huge", claim="huge")])
    pods = kube.wait_pods(NS, "one bound, huge unschedulable", lambda ps: any(
        p["metadata"]["name"] == "one" and p["spec"].get("nodeName") for p in ps) and any(
        p["metadata"]["name"] == "huge" and any(
            c.get("reason") == "Unschedulable" for c in (p.get("status") or {}).get(
                "conditions") or []) for p in ps), 120)
    one = next(p for p in pods if p["metadata"]["name"] == "one")
    assert not one["spec"].get("schedulingGates")
    (st,) = one["status"]["resourceClaimStatuses"]
    (result,) = _results(gates, st["resourceClaimName"])
    assert result["pool"] == one["spec"]["nodeName"] and result.get("shareID"), result
    assert _failed_scheduling(gates, "one") == [], gates.events("one")
    # the allocator reserved the claim for the pod with its allocation: kube-scheduler's
    # PreBind (IsReservedForPod) wrote nothing to it
    got = gates.objects.get_namespaced_custom_object("resource.k8s.io", "v1", NS,
                                                     "resourceclaims", st["resourceClaimName"])
    assert [r["uid"] for r in got["status"]["reservedFor"]] == [one["metadata"]["uid"]]
    writers = {m.get("manager") for m in got["metadata"].get("managedFields") or []}
    assert "kube-scheduler" not in writers, got["metadata"]["managedFields"]
    # the claim that fits nowhere: released with the allocator's note, then kube-scheduler's
    huge = next(p for p in pods if p["metadata"]["name"] == "huge")
    assert not huge["spec"].get("schedulingGates")
    notes = [(t, m, src) for r, t, m, src in gates.events("huge") if r == NOT_PLACED]
    assert notes and notes[0][0] == "Warning" and "released to kube-scheduler" in notes[0][1]
    assert notes[0][2] == "gpuslice-dra-allocator", notes
    assert _results(gates, "huge") == []


def test_the_allocator_honours_a_selection_by_uuid(gates: GateCluster, kube: Kube) -> None:
    """Pin or avoid GPUs by UUID (core.gpuselect, the extender's rule): each claim is
    allocated a device of an allowed GPU, read from the ``uuid`` attribute the drivers
    publish (the fake GPUs' UUIDs are GPU-<node>-<index>)."""
    uuid_of = {(s["spec"]["pool"]["name"], d["name"]): d["attributes"]["uuid"]["string"]
               for s in gates.objects.list_cluster_custom_object(
                   "resource.k8s.io", "v1", "resourceslices")["items"]
               if s["spec"].get("nodeName") in NODES for d in s["spec"].get("devices") or []}
    asks = {"pin-b1": {"gpuslice.io/gpu-uuid": "GPU-gate-b-01"},
            "avoid": {"nvidia.com/nouse-gpuuuid": "GPU-gate-a-00,GPU-gate-a-01,GPU-gate-b-00"}}
    gates.create_claims(*(gates.claim(n, 25) for n in asks))
    kube.create([gated_pod(n, claim=n, annotations=ann) for n, ann in asks.items()])
    pods = kube.wait_pods(NS, "both bound", lambda ps: len(
        [p for p in bound(ps) if p["metadata"]["name"] in asks]) == len(asks), 120)
    for p in pods:
        name = p["metadata"]["name"]
        if name in asks:
            (r,) = _results(gates, name)
            assert uuid_of[(r["pool"], r["device"])] == "GPU-gate-b-01", (name, r)
            assert p["spec"]["nodeName"] == "gate-b", name
    for name in asks:  # their CPU back for the tests after (the nodes' 8 CPUs are counted)
        kube.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    kube.wait_pods(NS, "both gone", lambda ps: not any(p["metadata"]["name"] in asks
                                                       for p in ps), 60)


def test_a_burst_of_gated_pods_is_placed_each_scheduled_once(gates: GateCluster,
                                                             kube: Kube) -> None:
    """Twelve quarters of GPU at once on the four GPUs: each pod bound on its first attempt,
    to its claim's node, no device given more than its compute."""
    names = [f"burst-{i:02d}" for i in range(12)]
    gates.create_claims(*(gates.claim(n, 25) for n in names))
    kube.create([gated_pod(n, claim=n) for n in names])
    pods = kube.wait_pods(NS, "the burst bound", lambda ps: len(
        [p for p in bound(ps) if p["metadata"]["name"] in names]) == len(names), 120)
    used: dict[tuple[str, str], int] = {}
    for p in pods:
        name = p["metadata"]["name"]
        if name not in names:
            continue
        (r,) = _results(gates, name)
        assert r["pool"] == p["spec"]["nodeName"], describe([p])
        used[(r["pool"], r["device"])] = used.get((r["pool"], r["device"]), 0) + \
            int(r["consumedCapacity"]["compute"])
        assert _failed_scheduling(gates, name) == [], (name, gates.events(name))
    assert all(v <= 100 for v in used.values()), used


def test_pods_without_claims_are_pinned_and_bound_where_the_allocator_chose(
        gates: GateCluster, kube: Kube) -> None:
    """Pods that ask for CPU only, created behind the allocator's gate (as the webhook's
    ``--gate-cpu-only`` puts it on): the allocator places each by its policy and, in one
    patch, removes the gate and adds a preferred node-affinity term of weight 100 for that
    node and the pinned-to annotation. The real API server accepts that patch
    (``ValidatePodUpdate``: the pod as stored is gated, so ``validateNodeAffinityMutation``
    lets its node affinity change), and kube-scheduler binds each pod, on its first attempt,
    to the node it was pinned to (NodeAffinity's score, weight 2, normalized)."""
    names = [f"plain-{i}" for i in range(4)]
    kube.create([{"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": n, "namespace": NS},
                  "spec": {"schedulingGates": GATE, "terminationGracePeriodSeconds": 0,
                           "containers": [{"name": "web", "image": "registry.local/web:1",
                                           "resources": {"requests": {"cpu": "100m",
                                                                      "memory": "64Mi"}}}]}}
                 for n in names])
    try:
        pods = kube.wait_pods(NS, "the plain pods bound", lambda ps: len(
            [p for p in bound(ps) if p["metadata"]["name"] in names]) == len(names), 120)
        for p in pods:
            name = p["metadata"]["name"]
            if name not in names:
                continue
            pinned = (p["metadata"].get("annotations") or {}).get(PINNED_TO)
            assert pinned and p["spec"]["nodeName"] == pinned, describe([p])
            (term,) = p["spec"]["affinity"]["nodeAffinity"][
                "preferredDuringSchedulingIgnoredDuringExecution"]
            assert term["weight"] == 100 and term["preference"]["matchFields"] == [
                {"key": "metadata.name", "operator": "In", "values": [pinned]}], term
            assert not p["spec"].get("schedulingGates")
            assert _failed_scheduling(gates, name) == [], (name, gates.events(name))
    finally:
        for n in names:
            kube.core.delete_namespaced_pod(n, NS, grace_period_seconds=0)
        kube.wait_pods(NS, "the plain pods gone", lambda ps: not any(
            p["metadata"]["name"] in names for p in ps), 60)


@pytest.mark.usefixtures("webhook")
def test_the_webhook_gates_a_stock_dra_pod(gates: GateCluster, kube: Kube) -> None:
    """A pod as users write it for DRA (a claim template of share.gpuslice.io, no gate, no
    schedulerName) in a namespace that opted in to the admission webhook: the webhook puts
    the allocator's gate on at creation (services.webhook.gate), the allocator allocates the
    claim and lifts it, and kube-scheduler binds the pod on its first and only attempt."""
    gates.dev.kubectl("label", "namespace", NS, "gpuslice.io/webhook=enabled", "--overwrite")
    gates.objects.create_namespaced_custom_object(
        "resource.k8s.io", "v1", NS, "resourceclaimtemplates",
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
         "metadata": {"name": "stock-quarter", "namespace": NS},
         "spec": {"spec": gates.claim("x", 25)["spec"]}})
    pod = gated_pod("stock", template="stock-quarter")
    del pod["spec"]["schedulingGates"]
    try:
        kube.create([pod])
        pods = kube.wait_pods(NS, "stock bound", lambda ps: any(
            p["metadata"]["name"] == "stock" and p["spec"].get("nodeName") for p in ps), 120)
        stock = next(p for p in pods if p["metadata"]["name"] == "stock")
        changes = stock["metadata"]["annotations"].get("gpuslice.io/webhook-changes", "")
        assert f"spec.schedulingGates: {kdra.ALLOCATOR_GATE}" in changes, stock["metadata"]
        assert not stock["spec"].get("schedulingGates")
        (st,) = stock["status"]["resourceClaimStatuses"]
        (result,) = _results(gates, st["resourceClaimName"])
        assert result["pool"] == stock["spec"]["nodeName"]
        assert _failed_scheduling(gates, "stock") == [], gates.events("stock")
    finally:
        gates.dev.kubectl("label", "namespace", NS, "gpuslice.io/webhook-")
        kube.core.delete_namespaced_pod("stock", NS, grace_period_seconds=0)


def test_a_claim_gets_the_finalizer_before_its_pod_and_goes_when_deleted(
        gates: GateCluster) -> None:
    """A claim created with no pod yet: the allocator puts kube-scheduler's finalizer on it
    early (services.dra_writes), so a pod that comes waits for one write; deleted while
    unallocated, kube-controller-manager's resourceclaim controller (controller.go
    ``syncClaim``: being deleted, reserved for nobody) removes that finalizer, and the claim
    is gone."""
    from kubernetes.client.exceptions import ApiException

    def read() -> dict[str, Any] | None:
        try:
            return dict(gates.objects.get_namespaced_custom_object(
                "resource.k8s.io", "v1", NS, "resourceclaims", "early"))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    gates.create_claims(gates.claim("early", 25))
    wait_until("the allocator's early finalizer", lambda: kdra.FINALIZER in (
        (read() or {}).get("metadata", {}).get("finalizers") or []), 30, every_s=0.1)
    assert not ((read() or {}).get("status") or {}).get("allocation")
    gates.objects.delete_namespaced_custom_object("resource.k8s.io", "v1", NS,
                                                  "resourceclaims", "early")
    wait_until("the unallocated claim gone", lambda: read() is None, 60, every_s=0.2)


def test_an_allocator_gone_leaves_no_pod_behind_its_gate(gates: GateCluster,
                                                         kube: Kube) -> None:
    """The allocator killed (no Lease given up: a crash): a pod created with the gate is
    released by a DRA driver once the allocator's Lease has been stale for the drivers'
    grace (15 s lease + 5 s), with an AllocatorUnavailable Event saying so, and
    kube-scheduler allocates and binds it itself (the drivers dropped the taint)."""
    assert gates.allocator is not None
    os.killpg(gates.allocator.pid, signal.SIGKILL)
    gates.allocator.wait(20)
    gates.create_claims(gates.claim("orphan", 25))
    kube.create([gated_pod("orphan", claim="orphan")])
    pods = kube.wait_pods(NS, "orphan bound", lambda ps: any(
        p["metadata"]["name"] == "orphan" and p["spec"].get("nodeName") for p in ps), 120)
    orphan = next(p for p in pods if p["metadata"]["name"] == "orphan")
    notes = [(t, m, src) for r, t, m, src in gates.events("orphan")
             if r == ALLOCATOR_UNAVAILABLE]
    assert notes, gates.events("orphan")
    kind, message, source = notes[0]
    assert (kind, source) == ("Warning", "gpuslice-dra-driver")
    assert f"{'/'.join(LEASE)} is stale" in message and "kube-scheduler" in message
    (r,) = _results(gates, "orphan")
    assert r["pool"] == orphan["spec"]["nodeName"]
    keeper = kube.client.CoordinationV1Api(kube.api_client).read_namespaced_lease(
        "gpuslice-dra-gate-keeper", "gpuslice-system")
    assert keeper.spec.holder_identity in NODES  # one driver did it
