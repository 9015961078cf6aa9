"""Node objects for the dev cluster's kwok nodes: what the node agent would publish."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
INVENTORY_ANNOTATION = "gpuslice.io/inventory"  # adapters.kube.objects.INVENTORY_ANNOTATION


def kwok_node(name: str, *, gpus: int, replicas: int = 10, labels: dict[str, str] | None = None,
              annotations: dict[str, str] | None = None, cpu: str = "64",
              memory: str = "512Gi", pods: int = 250,
              gpu_memory_mib: int = 81920) -> dict[str, Any]:
    """A Node that kwok manages: ``gpus`` GPUs served as ``gpus * replicas`` gpuslice.io/gpu
    devices (as the device plugin advertises them), with the labels and annotations given (the
    node agent's: see :func:`gpuslice.core.devices.inventory` and ``node_labels``)."""
    alloc = {"cpu": cpu, "memory": memory, "pods": str(pods),
             "gpuslice.io/gpu": str(gpus * replicas),
             # the node agent's status patch: share and memory totals
             "gpuslice.io/gpu-milli": str(1000 * gpus),
             "gpuslice.io/gpu-memory": str(gpu_memory_mib * gpus)}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name,
                         "annotations": {KWOK_NODE_ANNOTATION: "fake", **(annotations or {})},
                         "labels": {"kubernetes.io/hostname": name, "type": "kwok",
                                    **(labels or {})}},
            "spec": {},
            "status": {"capacity": alloc, "allocatable": alloc}}


def gpu_node(name: str, model: str = "A100-80GB", count: int = 2, mig: str | None = None,
             replicas: int = 10, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A kwok node carrying what the node agent publishes for ``count`` GPUs of ``model``
    (the inventory annotation and GPU feature discovery labels, computed by the functions the
    agent uses, on its fake NVML) and the device plugin's gpuslice.io/gpu capacity."""
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.core.devices import inventory, node_labels

    lines = ["gpus:"]
    for _ in range(count):
        lines.append(f"  - model: {model}")
        if mig:
            lines.append(f'    mig: "{mig}"')
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:
        nv = FakeNvml.from_yaml(f.name, node=name)
    finally:
        os.unlink(f.name)
    devs = nv.devices()
    return kwok_node(name, gpus=count, replicas=replicas, gpu_memory_mib=devs[0].memory_mib,
                     labels={**node_labels(devs, nv.driver_version()), **(labels or {})},
                     annotations={INVENTORY_ANNOTATION: json.dumps(inventory(devs))})


