"""The chaos soak's nodes and workload (benchmarks/chaos.py): kwok GPU nodes as the node agent
describes them, and a seeded stream of pod creations and deletions that keeps them about full.

Device-plugin nodes (``gpuslice-scheduler`` pods, the extender places them): A100-80GB nodes
of four GPUs, a node of two MIG-enabled A100s (two layouts: 3g+3g, 1g+1g+2g+3g) and a node of
two L4s. Pods: fractional MPS slices (gpu-milli and gpu-memory), fractional pods for the L4s
only (``gpuslice.io/gpu-model``), whole GPUs, two whole GPUs, MIG-isolated pods of 1g, 2g and
3g, and two-container pods. DRA nodes (``default-scheduler`` pods with a ResourceClaim from a
template: kube-scheduler, or the claim allocator while it leads, allocates): H100 shares and
an H100 of MIG partitions, A100 whole GPUs and an A100 share. Each pod lives 20-90 s (then it
is deleted, bound or not); the stream creates while a path has fewer live pods than its
target, set above what the nodes hold, so some always wait."""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from chaos_kubelet import FINALIZER
from chaos_parts import Api, ApiError

POOL = "chaos.gpuslice.io/pool"  # node label: dp or dra
KIND = "chaos.gpuslice.io/kind"  # pod label: the workload kind

# node -> its GPUs in the fake NVML inventory format (the node agent's --fake-gpus)
MIG_A = "3g.40gb@0,3g.40gb@4"
MIG_B = "1g.10gb@0,1g.10gb@1,2g.20gb@2,3g.40gb@4"


def dp_nodes(a100_nodes: int) -> dict[str, list[dict[str, Any]]]:
    nodes = {f"dp-a100-{i}": [{"model": "A100-80GB"}] * 4 for i in range(a100_nodes)}
    nodes["dp-mig-0"] = [{"model": "A100-80GB", "mig": MIG_A},
                         {"model": "A100-80GB", "mig": MIG_B}]
    nodes["dp-l4-0"] = [{"model": "L4"}] * 2
    return nodes


# node -> (GPUs, the driver's --gpu-mode flags)
DRA_NODES: dict[str, tuple[list[dict[str, Any]], list[str]]] = {
    "dra-0": ([{"model": "H100-SXM"}, {"model": "H100-SXM"},
               {"model": "H100-SXM", "mig_enabled": True}], ["0=share", "1=share", "2=mig"]),
    "dra-1": ([{"model": "A100-80GB"}] * 3, ["0=whole", "1=whole", "2=share"]),
}


def dra_nodes(count: int) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
    base = list(DRA_NODES.items())
    return {f"dra-{i}": base[i % len(base)][1] for i in range(count)}


def node_object(name: str, gpus: list[dict[str, Any]], pool: str) -> dict[str, Any]:
    """The kwok node as the node agent publishes it for ``gpus`` (devcluster.gpu_node's way,
    one layout per GPU): inventory annotation, GFD labels, the device plugin's capacity."""
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.core.devices import inventory, node_labels
    from gpuslice.devcluster import INVENTORY_ANNOTATION, kwok_node

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump({"gpus": gpus}, f)
    try:
        nv = FakeNvml.from_yaml(f.name, node=name)
    finally:
        os.unlink(f.name)
    devs = nv.devices()
    return kwok_node(name, gpus=len(gpus), gpu_memory_mib=devs[0].memory_mib,
                     labels={**node_labels(devs, nv.driver_version()), POOL: pool},
                     annotations={INVENTORY_ANNOTATION: json.dumps(inventory(devs))})


def dra_node_object(name: str) -> dict[str, Any]:
    from gpuslice.devcluster import kwok_node

    return kwok_node(name, gpus=0, labels={POOL: "dra"})


def templates(ns: str) -> list[dict[str, Any]]:
    """The ResourceClaimTemplates of the DRA pods (deploy/dra/examples' shapes)."""
    def t(name: str, cls: str, caps: dict[str, str] | None = None,
          cel: str | None = None) -> dict[str, Any]:
        exactly: dict[str, Any] = {"deviceClassName": cls}
        if caps:
            exactly["capacity"] = {"requests": caps}
        if cel:
            exactly["selectors"] = [{"cel": {"expression": cel}}]
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu",
                                                            "exactly": exactly}]}}}}

    return [t("share-10", "share.gpuslice.io", {"compute": "10", "memory": "4Gi"}),
            t("share-25", "share.gpuslice.io", {"compute": "25", "memory": "20Gi"}),
            t("share-50", "share.gpuslice.io", {"compute": "50", "memory": "10Gi"}),
            t("whole", "gpu.gpuslice.io"),
            t("mig-3g", "mig.gpuslice.io",
              cel="device.attributes['gpu.gpuslice.io'].migProfile.startsWith('3g.')")]


def _base(name: str, ns: str, kind: str, pool: str, scheduler: str,
          containers: list[dict[str, Any]], ann: dict[str, str] | None = None,
          ) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {KIND: kind},
                         "annotations": ann or {}, "finalizers": [FINALIZER]},
            "spec": {"schedulerName": scheduler, "nodeSelector": {POOL: pool},
                     "tolerations": [{"operator": "Exists"}],
                     "terminationGracePeriodSeconds": 0, "containers": containers}}


def dp_pod(name: str, ns: str, kind: str, rng: random.Random) -> dict[str, Any]:
    def c(i: int, gpus: int, milli: int, mib: int | None) -> dict[str, Any]:
        lim = {"gpuslice.io/gpu": str(gpus), "gpuslice.io/gpu-milli": str(milli)}
        if mib is not None:
            lim["gpuslice.io/gpu-memory"] = str(mib)
        return {"name": f"c{i}", "image": "registry.local/model:1",
                "resources": {"limits": lim}}

    ann: dict[str, str] = {}
    if kind == "frac":
        cs = [c(0, 1, rng.choice((100, 200, 250, 300, 500)),
                rng.choice((4096, 8192, 10240, 16384)))]
    elif kind == "frac-l4":
        cs = [c(0, 1, rng.choice((250, 500)), rng.choice((4096, 8192)))]
        ann["gpuslice.io/gpu-model"] = "L4"
    elif kind == "whole":
        cs = [c(0, 1, 1000, None)]
    elif kind == "multi":
        cs = [c(0, 2, 1000, None)]
    elif kind == "mig":
        cs = [c(0, 1, rng.choice((143, 286, 429)), None)]
        ann["gpuslice.io/isolation"] = "mig"
    elif kind == "two-containers":
        cs = [c(0, 1, 300, 4096), c(1, 1, 300, 4096)]
    else:
        raise ValueError(kind)
    return _base(name, ns, kind, "dp", "gpuslice-scheduler", cs, ann)


def dra_pod(name: str, ns: str, template: str) -> dict[str, Any]:
    pod = _base(name, ns, f"dra-{template}", "dra", "default-scheduler", [
        {"name": "server", "image": "registry.local/model:1",
         "resources": {"claims": [{"name": "gpu"}]}}])
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    return pod


DP_KINDS = {"frac": 5, "frac-l4": 1, "whole": 2, "multi": 1, "mig": 2, "two-containers": 1}
DRA_KINDS = {"share-25": 3, "share-50": 2, "share-10": 1, "whole": 2, "mig-3g": 1}


@dataclass
class Live:
    name: str
    path: str  # dp or dra
    dies_at: float


@dataclass
class Workload:
    """The seeded stream of creations and deletions."""

    api: Api
    ns: str
    rng: random.Random
    targets: dict[str, int]  # path -> live pods wanted (above what fits)
    clock: Callable[[], float] = time.monotonic
    live: dict[str, Live] = field(default_factory=dict)
    created: int = 0
    deleted: int = 0
    failed_calls: int = 0
    seq: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def _pick(self, kinds: dict[str, int]) -> str:
        return str(self.rng.choices(list(kinds), weights=list(kinds.values()))[0])

    def make(self, path: str, kind: str | None = None, node: str | None = None) -> str:
        """Create one pod of ``path`` (``kind``: else a random one; ``node``: pinned there
        by its hostname label). Returns its name ('' when the API server refused or was
        away)."""
        self.seq += 1
        if path == "dp":
            kind = kind or self._pick(DP_KINDS)
            pod = dp_pod(f"{kind}-{self.seq:05d}", self.ns, kind, self.rng)
        else:
            kind = kind or self._pick(DRA_KINDS)
            pod = dra_pod(f"dra-{kind}-{self.seq:05d}", self.ns, kind)
        if node is not None:
            pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] = node
        name = str(pod["metadata"]["name"])
        try:
            self.api.call("POST", f"/api/v1/namespaces/{self.ns}/pods", pod)
        except (ApiError, OSError):
            self.failed_calls += 1  # the API server away: the stream goes on
            return ""
        self.created += 1
        label = str(pod["metadata"]["labels"][KIND])
        self.by_kind[label] = self.by_kind.get(label, 0) + 1
        self.live[name] = Live(name, path, self.clock() + self.rng.uniform(20.0, 90.0))
        return name

    def delete(self, name: str) -> bool:
        try:
            self.api.call("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}")
        except ApiError as exc:
            if exc.status != 404:
                self.failed_calls += 1
                return False
        except OSError:
            self.failed_calls += 1
            return False
        self.deleted += 1
        self.live.pop(name, None)
        return True

    def step(self) -> None:
        """Delete the pods whose time is up, then create where a path is below its target."""
        now = self.clock()
        for lv in [lv for lv in self.live.values() if lv.dies_at <= now]:
            self.delete(lv.name)
        for path, want in self.targets.items():
            if sum(1 for lv in self.live.values() if lv.path == path) < want:
                self.make(path)
