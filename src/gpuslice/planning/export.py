"""Exports of a plan: NVIDIA mig-parted configs, Kubernetes manifests, the JSON plan."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from gpuslice.core.planner import Plan, slice_share


def mig_parted(plan: Plan, gpus_per_node: int = 8) -> dict[str, Any]:
    """One mig-parted config per node (GPUs of the plan taken ``gpus_per_node`` at a time):
    ``mig-configs: {gpuslice-node-N: [{devices: [i], mig-enabled: true, mig-devices: ...}]}``.
    mig-parted applies counts per device; the plan's placements are in the JSON plan."""
    configs: dict[str, list[dict[str, Any]]] = {}
    for g in plan.gpus:
        node, dev = divmod(g.index, gpus_per_node)
        counts = Counter(s.placement.profile.name for s in g.slots)
        configs.setdefault(f"gpuslice-node-{node}", []).append({
            "devices": [dev], "mig-enabled": True, "mig-devices": dict(sorted(counts.items())),
        })
    return {"version": "v1", "mig-configs": configs}


def manifests(plan: Plan, namespace: str = "default",
              image: str = "REPLACE-WITH-YOUR-MODEL-SERVER-IMAGE") -> list[dict[str, Any]]:
    """A Deployment per (service, slice) with gpuslice resources and the slice's MIG profile and
    MPS caps as annotations, plus one ConfigMap of router weights (throughput per replica)."""
    docs: list[dict[str, Any]] = []
    weights: dict[str, list[dict[str, Any]]] = {}
    for g in plan.gpus:
        total = 7
        for s in g.slots:
            for c in s.parts:
                name = f"{c.service}-g{g.index}-{s.placement.profile.name.replace('.', '-')}" \
                    f"-{s.placement.start}"
                milli, mem = slice_share(s, c, total)
                labels = {"app.kubernetes.io/name": c.service, "gpuslice.io/service": c.service}
                docs.append({
                    "apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": name, "namespace": namespace, "labels": labels},
                    "spec": {
                        "replicas": 1,
                        "selector": {"matchLabels": {"gpuslice.io/replica": name}},
                        "template": {
                            "metadata": {
                                "labels": {**labels, "gpuslice.io/replica": name},
                                "annotations": {
                                    # the MIG slice's compute share and memory as
                                    # an MPS slice, on any GPU of the model; the
                                    # planned profile is kept for reference
                                    "gpuslice.io/isolation": "mps",
                                    "gpuslice.io/gpu-model": g.gpu,
                                    "gpuslice.io/mig-profile": s.placement.profile.name,
                                    "gpuslice.io/mig-start": str(s.placement.start),
                                    "gpuslice.io/mps-thread-percentage": str(c.thread_pct),
                                    "gpuslice.io/batch-size": str(c.batch),
                                    "gpuslice.io/processes": str(c.procs),
                                },
                            },
                            "spec": {"containers": [{
                                "name": "server", "image": image,
                                "env": [{"name": "GPUSLICE_BATCH_SIZE", "value": str(c.batch)},
                                        {"name": "GPUSLICE_PROCESSES", "value": str(c.procs)}],
                                "resources": {"limits": {
                                    "gpuslice.io/gpu": "1",
                                    "gpuslice.io/gpu-milli": str(milli),
                                    "gpuslice.io/gpu-memory": str(mem),
                                }},
                            }]},
                        },
                    },
                })
                weights.setdefault(c.service, []).append(
                    {"replica": name, "weight": round(c.throughput, 3)})
    docs.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "gpuslice-router-weights", "namespace": namespace},
        "data": {"weights.json": json.dumps(weights, sort_keys=True)},
    })
    return docs


def write_exports(out: Path, plan: Plan, plan_json: dict[str, Any],
                  gpus_per_node: int = 8) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "plan.json": json.dumps(plan_json, indent=2),
        "mig-parted.yaml": yaml.safe_dump(mig_parted(plan, gpus_per_node), sort_keys=False),
        "manifests.yaml": yaml.safe_dump_all(manifests(plan), sort_keys=False),
    }
    written = []
    for name, text in files.items():
        path = out / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        written.append(path)
    return written
