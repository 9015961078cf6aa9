"""Kubernetes objects as gpuslice sees them: what a pod asks for, what a node has.

A pod asks with container resources ``gpuslice.io/gpu`` (GPUs touched), ``gpuslice.io/gpu-milli``
(share of each, 1..1000) and ``gpuslice.io/gpu-memory`` (MiB per GPU), and may add the
annotations ``gpuslice.io/gpu-model`` (``"T4|V100M16"``) and ``gpuslice.io/isolation``. A node's
GPUs come from the node agent's ``gpuslice.io/inventory`` annotation (a JSON list of
``{uuid, index, model, memoryMiB}``). Every problem is a :class:`ValidationError` naming the
object and field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gpuslice.core.errors import ValidationError
from gpuslice.core.model import PRIORITIES, Isolation, SliceRequest

GPU = "gpuslice.io/gpu"
GPU_MILLI = "gpuslice.io/gpu-milli"
GPU_MEMORY = "gpuslice.io/gpu-memory"
MODEL_ANNOTATION = "gpuslice.io/gpu-model"
ISOLATION_ANNOTATION = "gpuslice.io/isolation"
# best-effort, latency-critical or normal (the default): see core.model.PRIORITIES
PRIORITY_ANNOTATION = "gpuslice.io/priority"
# the MIG profile a planned slice was sized for (the planner's manifests): on a MIG-enabled GPU
# the extender prefers an instance of that profile for the pod's MPS slice
MIG_PROFILE_ANNOTATION = "gpuslice.io/mig-profile"
INVENTORY_ANNOTATION = "gpuslice.io/inventory"
# GPUs (comma-separated UUIDs) the reconfiguration controller closed to new slices
CORDONED_ANNOTATION = "gpuslice.io/cordoned-gpus"
# a pod being replaced: routers stop sending it requests and let in-flight ones finish
DRAINING_ANNOTATION = "gpuslice.io/draining"

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_FACTOR = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 1024.0, "Mi": 1024.0**2, "Gi": 1024.0**3, "Ti": 1024.0**4}


def quantity(value: object, field: str) -> float:
    """A Kubernetes quantity (``"500m"``, ``"2"``, ``"4Gi"``, or a number) as a float."""
    if isinstance(value, bool):
        raise ValidationError(field, "a Kubernetes quantity", value)
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValidationError(field, "a Kubernetes quantity", value)
    m = _QUANTITY.match(value.strip())
    if not m:
        raise ValidationError(field, "a Kubernetes quantity such as 500m, 2 or 4Gi", value)
    return float(m.group(1)) * _FACTOR[m.group(2)]


def _dict(obj: object, field: str) -> dict[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise ValidationError(field, "an object", type(obj).__name__)
    return obj


def pod_key(pod: dict[str, Any]) -> tuple[str, str]:
    meta = _dict(pod.get("metadata"), "pod.metadata")
    return str(meta.get("namespace") or "default"), str(meta.get("name") or "")


def pod_request(pod: dict[str, Any]) -> SliceRequest | None:
    """What ``pod`` asks of gpuslice, or None when it asks for no gpuslice resource."""
    if not isinstance(pod, dict):
        raise ValidationError("pod", "a Pod object", type(pod).__name__)
    ns, name = pod_key(pod)
    where = f"pod {ns}/{name}"
    spec = _dict(pod.get("spec"), f"{where}: spec")
    containers = spec.get("containers") or []
    if not isinstance(containers, list):
        raise ValidationError(f"{where}: spec.containers", "a list", type(containers).__name__)
    gpus = milli = memory = 0
    cpu = mem = 0.0
    asked = False
    for i, raw in enumerate(containers):
        c = _dict(raw, f"{where}: containers[{i}]")
        res = _dict(c.get("resources"), f"{where}: containers[{i}].resources")
        lim = _dict(res.get("limits"), f"{where}: containers[{i}].resources.limits")
        req = _dict(res.get("requests"), f"{where}: containers[{i}].resources.requests")
        both = {**req, **lim}
        f = f"{where}: containers[{i}]"
        if GPU in both or GPU_MILLI in both or GPU_MEMORY in both:
            asked = True
            n = int(quantity(both.get(GPU, 1), f"{f} {GPU}"))
            share = int(quantity(both.get(GPU_MILLI, 1000), f"{f} {GPU_MILLI}"))
            gmem = int(quantity(both.get(GPU_MEMORY, 0), f"{f} {GPU_MEMORY}"))
            if n < 1:
                raise ValidationError(f"{f} {GPU}", "at least 1 GPU", n)
            if not 1 <= share <= 1000:
                raise ValidationError(f"{f} {GPU_MILLI}", "1..1000 milli-GPU", share)
            if gmem < 0:
                raise ValidationError(f"{f} {GPU_MEMORY}", "MiB >= 0", gmem)
            if gpus and (n, share) != (gpus, milli):
                raise ValidationError(f"{f} {GPU}",
                                      "the same GPU request in every GPU container of a pod",
                                      (n, share))
            gpus, milli, memory = n, share, max(memory, gmem)
        cpu += quantity(req.get("cpu", 0), f"{f} cpu") * 1000
        mem += quantity(req.get("memory", 0), f"{f} memory") / 1024**2
    if not asked:
        return None
    meta = _dict(pod.get("metadata"), f"{where}: metadata")
    ann = _dict(meta.get("annotations"), f"{where}: metadata.annotations")
    models = frozenset(m.strip() for m in str(ann.get(MODEL_ANNOTATION, "")).split("|")
                       if m.strip())
    iso_text = str(ann.get(ISOLATION_ANNOTATION, "any"))
    try:
        iso = Isolation(iso_text)
    except ValueError:
        raise ValidationError(f"{where}: {ISOLATION_ANNOTATION}",
                              f"one of {', '.join(i.value for i in Isolation)}", iso_text) from None
    if gpus > 1 and milli != 1000:
        raise ValidationError(f"{where}: {GPU_MILLI}", "1000 when more than one GPU is requested",
                              milli)
    priority = str(ann.get(PRIORITY_ANNOTATION, "normal"))
    if priority not in PRIORITIES:
        raise ValidationError(f"{where}: {PRIORITY_ANNOTATION}", f"one of {', '.join(PRIORITIES)}",
                              priority)
    # a pod that names no GPU memory takes milli/1000 of its GPU's (the contract's default)
    return SliceRequest(gpus=gpus, milli=milli, cpu_milli=int(cpu), memory_mib=int(mem),
                        gpu_memory_mib=memory, models=models, isolation=iso,
                        name=f"{ns}/{name}", memory_share=memory == 0)


@dataclass(frozen=True, slots=True)
class InventoryMig:
    uuid: str
    profile: str
    start: int
    memory_mib: int


@dataclass(frozen=True, slots=True)
class InventoryGpu:
    uuid: str
    index: int
    model: str
    memory_mib: int
    mig: tuple[InventoryMig, ...] = ()
    mig_enabled: bool = False  # then the GPU is usable only through its MIG instances


def node_inventory(node: dict[str, Any]) -> list[InventoryGpu]:
    """The GPUs the node agent published on ``node`` (empty when it published none)."""
    meta = _dict(node.get("metadata"), "node.metadata")
    name = meta.get("name", "?")
    raw = _dict(meta.get("annotations"), f"node {name}: annotations").get(INVENTORY_ANNOTATION)
    if raw is None:
        return []
    try:
        items = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        raise ValidationError(f"node {name}: {INVENTORY_ANNOTATION}", "a JSON list", raw) from None
    if not isinstance(items, list):
        raise ValidationError(f"node {name}: {INVENTORY_ANNOTATION}", "a JSON list", raw)
    out = []
    for i, item in enumerate(items):
        g = _dict(item, f"node {name}: inventory[{i}]")
        try:
            migs = tuple(InventoryMig(str(m["uuid"]), str(m["profile"]), int(m["start"]),
                                      int(m.get("memoryMiB", 0)))
                         for m in g.get("mig") or [])
            out.append(InventoryGpu(str(g["uuid"]), int(g["index"]), str(g["model"]),
                                    int(g.get("memoryMiB", 0)), migs, "mig" in g))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValidationError(f"node {name}: inventory[{i}]",
                                  "uuid, index, model and memoryMiB", str(exc)) from None
    return out
