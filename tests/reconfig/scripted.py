"""A scripted cluster for the reconfiguration controller's day-two cases: the in-memory API
server, a fake clock, and the other actors as plain functions the test calls between the
controller's passes (a scheduler and kubelet that place and start pending pods, a node agent
that applies the layouts asked, a ReplicaSet controller that adopts and removes pods as the
real one does, routers whose requests in flight the test sets)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpuslice.adapters.kube.annotation import encode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kube.objects import CORDONED_ANNOTATION, DRAINING_ANNOTATION
from gpuslice.core.assignment import ANNOTATION, Assignment, ContainerAssignment, GpuShare, Mode
from gpuslice.devcluster import gpu_node
from gpuslice.services.node_layouts import MIG_DESIRED, MIG_LAYOUTS
from gpuslice.services.reconfig import PLURAL, ReconfigController

INFERENCE = ",".join(f"1g.10gb@{i}" for i in range(7))
BATCH = "7g.80gb@0"
NS = "ml"


def schedule(name: str = "nightly", **spec: object) -> dict[str, Any]:
    """A schedule that wants node ``src`` in the batch layout now."""
    return {"apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceSchedule",
            "metadata": {"name": name, "namespace": "gpuslice-system"},
            "spec": {"selector": {"nodes": ["src"], "gpuModels": ["A100-80GB"]},
                     "layouts": {"inference": {"mig": {"mig-devices": {"1g.10gb": 7}}},
                                 "batch": {"mig": {"mig-devices": {"7g.80gb": 1}}}},
                     "default": "inference", "override": "batch",
                     "drainTimeoutSeconds": 600, **spec}}


@dataclass
class FakeRouters:
    """What every router replica reports: a pod marked draining (on the API server) is
    draining there; ``in_flight`` its requests still under way."""

    api: FakeApiServer
    in_flight: dict[str, int] = field(default_factory=dict)
    asked: list[list[str]] = field(default_factory=list)
    unknown: set[str] = field(default_factory=set)  # pods no router has (yet)

    def serving(self, keep: list[str], leaving: list[str]) -> bool | None:
        return not (set(keep) & self.unknown)

    def outstanding(self, replicas: list[str]) -> int | None:
        self.asked.append(list(replicas))
        pods = {p["metadata"]["name"]: p for p in self.api.list_pods()}
        for r in replicas:
            p = pods.get(r)
            if p is not None and (p["metadata"].get("annotations") or {}).get(
                    DRAINING_ANNOTATION) != "true":
                return None
        return sum(self.in_flight.get(r, 0) for r in replicas)


class Scripted:
    def __init__(self) -> None:
        self.api = FakeApiServer()
        self.now = 1_000_000.0
        self.routers = FakeRouters(self.api)
        self.ready_at: dict[str, float] = {}  # pod name prefix -> when such pods get ready
        self.uids = 0
        self.src = self.node("src", 1)
        self.dst = self.node("dst", 2)
        self.placed = 0

    def clock(self) -> float:
        return self.now

    def controller(self, api: Any = None) -> ReconfigController:
        return ReconfigController(api or self.api, router=self.routers, clock=self.clock)

    def node(self, name: str, gpus: int) -> list[str]:
        n = gpu_node(name, "A100-80GB", gpus, mig=INFERENCE)
        ann = n["metadata"]["annotations"]
        uuids = [g["uuid"] for g in json.loads(ann["gpuslice.io/inventory"])]
        ann[MIG_LAYOUTS] = json.dumps({u: {"layout": INFERENCE, "state": "success",
                                           "message": ""} for u in uuids})
        self.api.add_node(n)
        return uuids

    def pod(self, name: str, *, node: str | None = None, gpu: str | None = None,
            start: int = 0, labels: dict[str, str] | None = None,
            owner: str | None = None) -> dict[str, Any]:
        p: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": "model",
                                                                    **(labels or {})},
                         "annotations": {"gpuslice.io/gpu-model": "A100-80GB"}},
            "spec": {"schedulerName": "gpuslice-scheduler", "containers": [{
                "name": "server", "image": "model:1", "resources": {"limits": {
                    "gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "100",
                    "gpuslice.io/gpu-memory": "4000"}}}]}}
        if owner is not None:
            p["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                                 "name": owner, "uid": f"uid-{owner}",
                                                 "controller": True}]
        self.api.add_pod(p)
        if node is not None and gpu is not None:
            self._bind(name, node, gpu, start)
        return self.api.get_pod(NS, name)

    def _bind(self, name: str, node: str, gpu: str, start: int) -> None:
        p = self.api.get_pod(NS, name)
        a = Assignment(NS, name, p["metadata"]["uid"], node, (ContainerAssignment(
            "server", Mode.MPS, (GpuShare(gpu, 100, 4000, "1g.10gb", start),)),),
            "2026-12-01T00:00:00Z")
        self.api.bind(NS, name, p["metadata"]["uid"], node, {ANNOTATION: encode(a)})

    def kubelet(self) -> None:
        """The scheduler places each pending pod on the next free instance of ``dst``; the
        kubelet starts it, Ready unless :attr:`ready_at` holds it back."""
        for p in self.api.list_pods():
            name = p["metadata"]["name"]
            if not (p.get("spec") or {}).get("nodeName"):
                gpu = self.dst[self.placed // 7 % len(self.dst)]
                self._bind(name, "dst", gpu, self.placed % 7)
                self.placed += 1
            at = next((t for k, t in self.ready_at.items() if name.startswith(k)), None)
            ready = at is None or self.now >= at
            if (self.api.get_pod(NS, name).get("status") or {}).get("ready") != ready:
                self.api.set_pod_status(NS, name, {"phase": "Running", "ready": ready,
                                                   "conditions": [{"type": "Ready", "status":
                                                                   str(ready)}]})

    def agent(self) -> None:
        """The node agents: a layout asked is applied (the GPUs are idle here)."""
        for n in self.api.list_nodes():
            ann = n["metadata"].get("annotations") or {}
            want = json.loads(ann.get(MIG_DESIRED) or "{}")
            have = json.loads(ann.get(MIG_LAYOUTS) or "{}")
            new = {**have, **{u: {"layout": lay, "state": "success", "message": ""}
                              for u, lay in want.items()}}
            if new != have:
                self.api.patch_node(n["metadata"]["name"], {}, {MIG_LAYOUTS: json.dumps(new)})

    def replicaset(self, name: str, replicas: int, template_hash: str = "abc") -> None:
        """The ReplicaSet controller, as far as these tests need it: adopts an ownerless pod
        that carries its labels (app=model and its pod-template-hash), removes surplus pods
        (a not-ready one first, as the real one ranks them) and creates missing ones."""
        sel = {"app": "model", "pod-template-hash": template_hash}
        pods = self.api.list_pods()
        for p in pods:
            meta = p["metadata"]
            if not meta.get("ownerReferences") and all(
                    (meta.get("labels") or {}).get(k) == v for k, v in sel.items()):
                meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                            "name": name, "uid": f"uid-{name}",
                                            "controller": True}]
                self.api.add_pod(p)  # the adoption: an update of the pod's ownerReferences
        mine = [p for p in self.api.list_pods() if any(
            r.get("uid") == f"uid-{name}" for r in p["metadata"].get("ownerReferences") or [])]
        mine.sort(key=lambda p: ((p.get("status") or {}).get("ready") is True,
                                 p["metadata"]["name"]))
        for p in mine[:max(0, len(mine) - replicas)]:
            self.api.delete_pod(NS, p["metadata"]["name"])
        for _ in range(replicas - len(mine)):
            self.uids += 1
            self.pod(f"{name}-new{self.uids}", labels={"pod-template-hash": template_hash},
                     owner=name)

    def status(self, name: str = "nightly") -> dict[str, Any]:
        return self.api.get_custom(PLURAL, "gpuslice-system", name).get("status") or {}

    def gpu_status(self, name: str = "nightly") -> dict[str, Any]:
        return dict((self.status(name).get("gpus") or {}).get(self.src[0]) or {})

    def cordoned(self) -> list[str]:
        n = self.api.get_node("src")
        return [u for u in ((n["metadata"].get("annotations") or {}).get(
            CORDONED_ANNOTATION) or "").split(",") if u]

    def desired(self) -> dict[str, str]:
        n = self.api.get_node("src")
        return dict(json.loads((n["metadata"].get("annotations") or {}).get(MIG_DESIRED)
                               or "{}"))

    def layout(self) -> str:
        n = self.api.get_node("src")
        return str(json.loads(n["metadata"]["annotations"][MIG_LAYOUTS])[self.src[0]]["layout"])
