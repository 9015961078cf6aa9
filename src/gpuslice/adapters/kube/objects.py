"""Kubernetes objects as gpuslice sees them: what a pod asks for, what a node has.

A pod asks with container resources ``gpuslice.io/gpu`` (GPUs touched), ``gpuslice.io/gpu-milli``
(share of each, 1..1000) and ``gpuslice.io/gpu-memory`` (MiB per GPU), and may add the
annotations ``gpuslice.io/gpu-model`` (``"T4|V100M16"``; the GPU selection of
:mod:`gpuslice.core.gpuselect`, HAMi's spellings included) and ``gpuslice.io/isolation``. A node's
GPUs come from the node agent's ``gpuslice.io/inventory`` annotation (a JSON list of
``{uuid, index, model, memoryMiB}``). Every problem is a :class:`ValidationError` naming the
object and field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuslice.core.dra.quantity import parse_quantity
from gpuslice.core.errors import ValidationError
from gpuslice.core.gpuselect import accepted_models
from gpuslice.core.model import PRIORITIES, Isolation, SliceRequest
from gpuslice.core.podrequest import (
    ContainerKind,
    ContainerRequest,
    GpuWant,
    PodGpuShape,
    gpu_shape,
    pod_requests,
)

GPU = "gpuslice.io/gpu"
GPU_MILLI = "gpuslice.io/gpu-milli"
GPU_MEMORY = "gpuslice.io/gpu-memory"
MODEL_ANNOTATION = "gpuslice.io/gpu-model"
ISOLATION_ANNOTATION = "gpuslice.io/isolation"
# best-effort, latency-critical or normal (the default): see core.model.PRIORITIES
PRIORITY_ANNOTATION = "gpuslice.io/priority"
# CUDA processes a pod runs on its GPU share (vLLM's workers, Triton's Python stubs, torchrun):
# MPS caps each client process, so the node divides the pod's memory among them
PROCESSES_ANNOTATION = "gpuslice.io/processes"
MAX_MPS_CLIENTS = 48  # client CUDA contexts per device under Volta+ MPS (protocols.md 3.3)
# the MIG profile a planned slice was sized for (the planner's manifests): on a MIG-enabled GPU
# the extender prefers an instance of that profile for the pod's MPS slice
MIG_PROFILE_ANNOTATION = "gpuslice.io/mig-profile"
INVENTORY_ANNOTATION = "gpuslice.io/inventory"
# GPUs (comma-separated UUIDs) the reconfiguration controller closed to new slices
CORDONED_ANNOTATION = "gpuslice.io/cordoned-gpus"
# a pod being replaced: routers stop sending it requests and let in-flight ones finish. The
# controller writes it as an annotation and as a label of the same name and value "true" in one
# write; the label lets every router replica find the draining pods of a namespace with one
# selected list
DRAINING_ANNOTATION = "gpuslice.io/draining"
DRAINING_LABEL = DRAINING_ANNOTATION

# the largest quantity the API server holds (an int64), and the largest CPU (milli) and memory
# (MiB) gpuslice counts: int64 too, as its arrays hold them
INT64_MAX = 2**63 - 1


def quantity(value: object, field: str) -> float:
    """A Kubernetes quantity (``"500m"``, ``"2"``, ``"4Gi"``, ``"1e3"``, ``"1.5G"``, or a
    number) as a float: every form apimachinery's resource.Quantity reads (core.dra.quantity),
    not negative and at most an int64, as the API server holds it."""
    if isinstance(value, str) and value.isascii() and value.isdigit():  # "1", "8192": most
        n = int(value)
        if n <= INT64_MAX:
            return float(n)
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > INT64_MAX:
            raise ValidationError(field, "a Kubernetes quantity of at most 2^63-1", value)
        number = value
    else:
        number = float(parse_quantity(value, field))
    if number < 0:
        raise ValidationError(field, "a quantity >= 0", value)
    return number


def scaled(value: float, unit: float, field: str, what: str) -> int:
    """``value`` in ``unit`` (1000: milli-CPU), rounded up as apimachinery's ``MilliValue``
    does, and at most an int64 (``what`` names the unit in the error)."""
    n = math.ceil(value * unit)
    if n > INT64_MAX:
        raise ValidationError(field, f"at most 2^63-1 {what}", value)
    return n


def node_allocatable(node: Mapping[str, Any]) -> tuple[int, int]:
    """A node's allocatable CPU (milli, rounded up as kube-scheduler counts it) and memory
    (MiB, whole MiB); 0 for what it does not report. A :class:`ValidationError` names a
    quantity that is not one."""
    alloc = _dict(_dict(node.get("status"), "node status").get("allocatable"),
                  "node status.allocatable")
    name = _dict(node.get("metadata"), "node metadata").get("name")
    cpu = scaled(quantity(alloc.get("cpu", 0), f"node {name}: allocatable cpu"), 1000,
                 f"node {name}: allocatable cpu", "milli-CPU")
    mem = int(quantity(alloc.get("memory", 0), f"node {name}: allocatable memory") // 2**20)
    return cpu, mem


def _dict(obj: object, field: str) -> dict[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise ValidationError(field, "an object", type(obj).__name__)
    return obj


def pod_key(pod: dict[str, Any]) -> tuple[str, str]:
    meta = _dict(pod.get("metadata"), "pod.metadata")
    return str(meta.get("namespace") or "default"), str(meta.get("name") or "")


@dataclass(frozen=True, slots=True)
class PodContainer:
    """One container of a pod as the effective-request rule sees it: its kind and its
    requests (a request missing but a limit set takes the limit, as the API server defaults
    it), as floats in the resource's unit (cores, bytes, counts)."""

    name: str
    kind: ContainerKind
    requests: dict[str, float]
    limits: dict[str, float]
    index: int  # position in spec.initContainers or spec.containers


def _resources(c: dict[str, Any], f: str) -> tuple[dict[str, float], dict[str, float]]:
    res = _dict(c.get("resources"), f"{f}.resources")
    lim_raw = _dict(res.get("limits"), f"{f}.resources.limits")
    req_raw = _dict(res.get("requests"), f"{f}.resources.requests")
    limits = {k: quantity(v, f"{f} {k}") for k, v in lim_raw.items()}
    requests = {k: quantity(v, f"{f} {k}") for k, v in req_raw.items()}
    for k, v in limits.items():
        requests.setdefault(k, v)
    return requests, limits


def pod_finished(pod: Mapping[str, Any]) -> bool:
    """Whether the pod has ended (``status.phase`` Succeeded or Failed): its containers are
    gone, so it holds no GPU share, claim or CPU any more."""
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pod_containers(pod: dict[str, Any]) -> list[PodContainer]:
    """The pod's containers in pod order: init containers (regular, or sidecars with
    ``restartPolicy: Always``) in their declared order, then the app containers."""
    if not isinstance(pod, dict):
        raise ValidationError("pod", "a Pod object", type(pod).__name__)
    ns, name = pod_key(pod)
    where = f"pod {ns}/{name}"
    spec = _dict(pod.get("spec"), f"{where}: spec")
    out: list[PodContainer] = []
    for field_name in ("initContainers", "containers"):
        items = spec.get(field_name) or []
        if not isinstance(items, list):
            raise ValidationError(f"{where}: spec.{field_name}", "a list", type(items).__name__)
        for i, raw in enumerate(items):
            f = f"{where}: {field_name}[{i}]"
            c = _dict(raw, f)
            if field_name == "containers":
                kind = ContainerKind.APP
            else:
                policy = c.get("restartPolicy")
                if policy not in (None, "Always"):
                    raise ValidationError(f"{f}.restartPolicy",
                                          "Always (a sidecar) or unset for an init container",
                                          policy)
                kind = ContainerKind.SIDECAR if policy == "Always" else ContainerKind.INIT
            requests, limits = _resources(c, f)
            out.append(PodContainer(str(c.get("name") or f"{field_name}-{i}"), kind, requests,
                                    limits, i))
    return out


def _gpu_want(c: PodContainer, where: str) -> GpuWant | None:
    both = {**c.requests, **c.limits}
    if not (GPU in both or GPU_MILLI in both or GPU_MEMORY in both):
        return None
    f = f"{where}: {'containers' if c.kind is ContainerKind.APP else 'initContainers'}" \
        f"[{c.index}]"
    n = both.get(GPU, 1)
    share = both.get(GPU_MILLI, 1000)
    gmem = both.get(GPU_MEMORY, 0)
    for key, value in ((GPU, n), (GPU_MILLI, share), (GPU_MEMORY, gmem)):
        if value != int(value):
            raise ValidationError(f"{f} {key}", "a whole number", value)
    if int(n) < 1:
        raise ValidationError(f"{f} {GPU}", "at least 1 GPU", int(n))
    if not 1 <= int(share) <= 1000:
        raise ValidationError(f"{f} {GPU_MILLI}", "1..1000 milli-GPU", int(share))
    if int(gmem) < 0:
        raise ValidationError(f"{f} {GPU_MEMORY}", "MiB >= 0", int(gmem))
    if int(n) > 1 and int(share) != 1000:
        raise ValidationError(f"{f} {GPU_MILLI}", "1000 when more than one GPU is requested",
                              int(share))
    return GpuWant(c.name, c.kind, int(n), int(share), int(gmem))


def pod_gpu_shape(pod: dict[str, Any]) -> PodGpuShape | None:
    """The pod's GPU request by the effective-request rule (core.podrequest.gpu_shape), or
    None when no container (init containers included) asks for a gpuslice resource."""
    ns, name = pod_key(pod)
    where = f"pod {ns}/{name}"
    wants = [w for c in pod_containers(pod) if (w := _gpu_want(c, where)) is not None]
    return gpu_shape(wants, where)


def pod_cpu_memory(pod: dict[str, Any]) -> tuple[int, int]:
    """A pod's effective CPU (milli) and memory (MiB) requests, as kube-scheduler counts them
    against a node (core.podrequest's rule, with overhead and pod-level requests)."""
    ns, name = pod_key(pod)
    where = f"pod {ns}/{name}"
    return _cpu_memory(pod, pod_containers(pod), where)


def _cpu_memory(pod: dict[str, Any], containers: list[PodContainer],
                where: str) -> tuple[int, int]:
    spec = _dict(pod.get("spec"), f"{where}: spec")
    overhead = {k: quantity(v, f"{where}: spec.overhead {k}") for k, v in
                _dict(spec.get("overhead"), f"{where}: spec.overhead").items()}
    units = {"cpu": 1000.0, "memory": 1 / 1024**2}  # milli-CPU, MiB
    eff = pod_requests(
        [ContainerRequest(c.name, c.kind, {k: round(c.requests.get(k, 0) * u)
                                           for k, u in units.items()}) for c in containers],
        {k: round(overhead.get(k, 0) * u) for k, u in units.items()})
    pod_level = _dict(_dict(spec.get("resources"), f"{where}: spec.resources").get("requests"),
                      f"{where}: spec.resources.requests")
    for k, u in units.items():  # pod-level requests win over the containers' (PodRequests)
        if k in pod_level:
            eff[k] = round(quantity(pod_level[k], f"{where}: spec.resources.requests {k}") * u
                           + overhead.get(k, 0) * u)
    cpu, mem = int(eff.get("cpu", 0)), int(eff.get("memory", 0))
    for value, what in ((cpu, "cpu (milli-CPU)"), (mem, "memory (MiB)")):
        if value > INT64_MAX:
            raise ValidationError(f"{where}: {what}", "a request of at most 2^63-1", value)
    return cpu, mem


def pod_request(pod: dict[str, Any]) -> SliceRequest | None:
    """What ``pod`` asks of gpuslice, or None when no container of it (init containers
    included, as kube-scheduler's ``IsInterested``) asks for a gpuslice resource. GPUs,
    CPU and memory all follow the effective-request rule (core.podrequest), with the pod's
    overhead and pod-level CPU and memory requests."""
    ns, name = pod_key(pod)
    where = f"pod {ns}/{name}"
    containers = pod_containers(pod)
    shape = gpu_shape([w for c in containers if (w := _gpu_want(c, where)) is not None],
                      where)
    if shape is None:
        return None
    cpu_milli, memory_mib = _cpu_memory(pod, containers, where)
    meta = _dict(pod.get("metadata"), f"{where}: metadata")
    ann = _dict(meta.get("annotations"), f"{where}: metadata.annotations")
    # the GPU selection (core.gpuselect: gpuslice's and HAMi's annotations, one rule)
    models = accepted_models(ann, where)
    iso_text = str(ann.get(ISOLATION_ANNOTATION, "any"))
    try:
        iso = Isolation(iso_text)
    except ValueError:
        raise ValidationError(f"{where}: {ISOLATION_ANNOTATION}",
                              f"one of {', '.join(i.value for i in Isolation)}", iso_text) from None
    priority = str(ann.get(PRIORITY_ANNOTATION, "normal"))
    if priority not in PRIORITIES:
        raise ValidationError(f"{where}: {PRIORITY_ANNOTATION}", f"one of {', '.join(PRIORITIES)}",
                              priority)
    declared_processes(ann, where)
    # a pod that names no GPU memory takes milli/1000 of its GPU's (the contract's default)
    return SliceRequest(gpus=shape.gpus, milli=shape.milli, cpu_milli=cpu_milli,
                        memory_mib=memory_mib, gpu_memory_mib=shape.memory_mib,
                        models=models, isolation=iso, name=f"{ns}/{name}",
                        memory_share=shape.memory_mib == 0)


def declared_processes(annotations: Any, where: str = "pod") -> int:
    """The CUDA processes a pod declares (:data:`PROCESSES_ANNOTATION`, default 1); a
    ValidationError naming the annotation for anything but an integer 1..48."""
    raw = annotations.get(PROCESSES_ANNOTATION, "1") if isinstance(annotations, dict) else "1"
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_MPS_CLIENTS):
        raise ValidationError(f"{where}: {PROCESSES_ANNOTATION}",
                              f"an integer 1..{MAX_MPS_CLIENTS} (the CUDA processes the pod "
                              "runs on its GPU share)", raw)
    return int(text)


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

    def count(obj: dict[str, Any], key: str, at: str, default: int | None = None) -> int:
        # a whole number >= 0, named when it is not (NaN, 1e400: a float int() refuses)
        raw_n = obj[key] if default is None else obj.get(key, default)
        try:
            n = int(raw_n)
        except (TypeError, ValueError, OverflowError):
            n = -1
        if n < 0 or (isinstance(raw_n, float) and n != raw_n):
            raise ValidationError(f"{at}.{key}", "a whole number >= 0", str(raw_n)[:40])
        return n

    out = []
    for i, item in enumerate(items):
        at = f"node {name}: inventory[{i}]"
        g = _dict(item, at)
        try:
            migs = tuple(InventoryMig(str(m["uuid"]), str(m["profile"]),
                                      count(m, "start", f"{at}.mig[{j}]"),
                                      count(m, "memoryMiB", f"{at}.mig[{j}]", 0))
                         for j, m in enumerate(g.get("mig") or []))
            out.append(InventoryGpu(str(g["uuid"]), count(g, "index", at), str(g["model"]),
                                    count(g, "memoryMiB", at, 0), migs, "mig" in g))
        except ValidationError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ValidationError(at, "uuid, index, model and memoryMiB", str(exc)) from None
    return out


def selector_matches(selector: object, labels: dict[str, str]) -> bool:
    """Whether a metav1.LabelSelector (``matchLabels`` and ``matchExpressions`` with In,
    NotIn, Exists, DoesNotExist) selects ``labels``, as a PodDisruptionBudget's selector is
    read in preemption (``filterPodsWithPDBViolation`` in kubernetes
    pkg/scheduler/framework/plugins/defaultpreemption/default_preemption.go): a nil or empty
    selector matches nothing, an invalid one (``LabelSelectorAsSelector`` in apimachinery
    pkg/apis/meta/v1/helpers.go fails) matches nothing."""
    if not isinstance(selector, dict):
        return False
    match = selector.get("matchLabels") or {}
    exprs = selector.get("matchExpressions") or []
    if not isinstance(match, dict) or not isinstance(exprs, list) or not (match or exprs):
        return False
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for e in exprs:
        if not isinstance(e, dict) or not isinstance(e.get("key"), str):
            return False
        key, op, values = e["key"], e.get("operator"), e.get("values") or []
        if op in ("In", "NotIn"):
            if not values:
                return False
            if (op == "In") != (key in labels and labels[key] in values):
                return False
        elif op in ("Exists", "DoesNotExist"):
            if values:
                return False
            if (op == "Exists") != (key in labels):
                return False
        else:
            return False
    return True
