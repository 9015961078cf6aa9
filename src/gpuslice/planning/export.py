"""Exports of a plan: NVIDIA mig-parted configs, Kubernetes manifests, the JSON plan."""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from gpuslice.adapters import outputs
from gpuslice.core.errors import ValidationError
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


SCHEDULER_NAME = "gpuslice-scheduler"  # deploy/'s second scheduler profile
GPU_MODEL_LABEL = "gpuslice.io/gpu-model"  # what the router's Istio subsets select
SERVER_PORT = 8000  # the model server's port (vLLM's and Triton's HTTP default)
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def manifests(plan: Plan, namespace: str = "default",
              image: str = "REPLACE-WITH-YOUR-MODEL-SERVER-IMAGE",
              port: int = SERVER_PORT) -> list[dict[str, Any]]:
    """A Deployment per (service, slice) with gpuslice resources and the slice's MIG profile and
    MPS caps as annotations, a Service per service, and one ConfigMap of router weights
    (throughput per replica). They run as they are on an installed gpuslice: the pods name
    the gpuslice scheduler, carry the GPU model as a label (what ``gpuslice router --export
    istio`` subsets select) and their CUDA processes (``gpuslice.io/processes``), and each
    service's Service (its name, port 80 to the container's ``http`` port ``port``) is the
    host those subsets route to."""
    docs: list[dict[str, Any]] = []
    weights: dict[str, list[dict[str, Any]]] = {}
    services: list[str] = []
    for g in plan.gpus:
        total = 7
        for s in g.slots:
            for c in s.parts:
                name = f"{c.service}-g{g.index}-{s.placement.profile.name.replace('.', '-')}" \
                    f"-{s.placement.start}"
                milli, mem = slice_share(s, c, total)
                labels = {"app.kubernetes.io/name": c.service, "gpuslice.io/service": c.service}
                if c.service not in services:
                    services.append(c.service)
                pod_labels = {**labels, "gpuslice.io/replica": name}
                if _LABEL_VALUE.match(g.gpu):
                    pod_labels[GPU_MODEL_LABEL] = g.gpu
                docs.append({
                    "apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": name, "namespace": namespace, "labels": labels},
                    "spec": {
                        "replicas": 1,
                        "selector": {"matchLabels": {"gpuslice.io/replica": name}},
                        "template": {
                            "metadata": {
                                "labels": pod_labels,
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
                            "spec": {"schedulerName": SCHEDULER_NAME, "containers": [{
                                "name": "server", "image": image,
                                "ports": [{"name": "http", "containerPort": port}],
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
    docs += [_service(svc, namespace) for svc in services if _DNS_LABEL.match(svc)]
    docs.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "gpuslice-router-weights", "namespace": namespace},
        "data": {"weights.json": json.dumps(weights, sort_keys=True)},
    })
    return docs


def _service(name: str, namespace: str) -> dict[str, Any]:
    """The Service of a planned service: the host its router export routes to (a name that
    is no DNS label gets none: name one yourself and give the router's ``host``)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": name}},
            "spec": {"selector": {"gpuslice.io/service": name},
                     "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


EXPORT_FILES = ("plan.json", "mig-parted.yaml", "manifests.yaml")


def check_export_dir(out: Path, field: str = "--export") -> None:
    """Refuse, before any work, a folder where an export file's name is taken by something
    that is not a file (a folder, say): it could not be replaced."""
    for name in EXPORT_FILES:
        path = out / name
        if path.exists() and not path.is_file():
            raise ValidationError(field, f"a folder where {name} can be written",
                                  f"{path}: not a file")


def write_exports(out: Path, plan: Plan, plan_json: dict[str, Any],
                  gpus_per_node: int = 8, field: str = "--export", *,
                  namespace: str = "default",
                  image: str = "REPLACE-WITH-YOUR-MODEL-SERVER-IMAGE",
                  port: int = SERVER_PORT) -> list[Path]:
    """plan.json, mig-parted.yaml and manifests.yaml in ``out``: all three or none (see
    :func:`write_texts`); the manifests in ``namespace``, running ``image`` on ``port``."""
    texts = {
        "plan.json": json.dumps(plan_json, indent=2),
        "mig-parted.yaml": yaml.safe_dump(mig_parted(plan, gpus_per_node), sort_keys=False),
        "manifests.yaml": yaml.safe_dump_all(manifests(plan, namespace, image, port),
                                             sort_keys=False),
    }
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValidationError(field, "a folder that can be created and written",
                              f"{out}: {exc.strerror or exc}") from None
    check_export_dir(out, field)
    return write_texts({out / name: text for name, text in texts.items()}, field)


def write_texts(files: dict[Path, str], field: str) -> list[Path]:
    """Each text to its file, all or none (:func:`gpuslice.adapters.outputs.write_files`)."""
    return outputs.write_files(
        {path: partial(Path.write_text, data=text, encoding="utf-8")
         for path, text in files.items()}, field)


def write_json(path: Path, doc: object, field: str = "--write-json") -> Path:
    """``doc`` as indented JSON to ``path``, atomically (:func:`write_texts`); a path that is
    not a regular file (``/dev/stdout``, a pipe) is written in place, as renaming over it
    would replace it."""
    text = json.dumps(doc, indent=2)
    if path.exists() and not path.is_file() and not path.is_dir():
        try:
            with path.open("w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            raise ValidationError(field, "a file that can be written",
                                  f"{path}: {exc.strerror or exc}") from None
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValidationError(field, "a file in a folder that exists or can be created",
                              f"{path}: {exc.strerror or exc}") from None
    return write_texts({path: text}, field)[0]
