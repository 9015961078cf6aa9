"""What each pod uses of its GPU share, measured: memory in use, SM utilization and CUDA
processes per pod, container and GPU (or MIG instance), against the share it was given.

The node agent reads NVML's processes on every GPU and MIG instance of the node (compute
processes and MPS clients, each with its used memory and, where the driver samples it, its
SM utilization), maps each to its pod and container through its cgroup
(:func:`gpuslice.adapters.proc.pods.pod_of`: the one process-to-pod mapping of the node
side) and the pod's container statuses, and sets them beside the caps of the pod's signed
assignment. A process that belongs to no pod (a host process, the MPS server itself) is
counted per GPU, not dropped. Pods that are gone leave their series (bounded cardinality).

MPS caps each client process, so a pod's share holds only when the pod runs the processes
it declared (``gpuslice.io/processes``: the node divides the memory cap among them); a pod
running more on one GPU gets a Warning event (once per count) and shows in the metrics.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.objects import PROCESSES_ANNOTATION, declared_processes
from gpuslice.adapters.nvml.port import GpuProcess, NvmlError, NvmlPort
from gpuslice.adapters.proc.pods import PodProcess, pod_of
from gpuslice.core.assignment import ANNOTATION, Assignment, GpuShare, verify_any
from gpuslice.core.errors import GpusliceError, ValidationError, note_once

log = logging.getLogger(__name__)
OVER_DECLARED = "GpuProcessesOverDeclared"
MIB = 1 << 20
SERVICE_LABEL = "gpuslice.io/service"  # on the planner's exported Deployments' pods
PODS_REREAD_S = 60.0  # the node's pods read again at least this often (else only when new)


@dataclass(frozen=True)
class Device:
    """A GPU or MIG instance as the usage is measured on it: its GPU's UUID, for a MIG
    instance its profile and start, and its memory."""

    gpu: str
    profile: str = ""
    start: int = -1
    memory_mib: int = 0


# the share of a pod's container on a device (None: none that this node knows): from the
# signed assignment (the node agent, :class:`AssignmentShares`) or from the prepared
# ResourceClaims (the DRA driver, ``services.dra_driver.usage``)
ShareOf = Callable[[dict[str, Any], str, Device], GpuShare | None]


class PodsPort(Protocol):
    """What the usage reads of the API: the node's pods (and, where it can, writes Events)."""

    def list_pods(self, node: str | None = None,
                  timeout_s: float | None = None) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class UseKey:
    namespace: str
    pod: str
    container: str
    gpu: str  # the GPU's UUID, or the MIG instance's
    service: str = ""  # the pod's gpuslice.io/service label (the planner's Deployments')


@dataclass
class Use:
    """One container's use of one GPU or MIG instance, summed over its processes."""

    processes: int = 0
    used_mib: int = 0
    sm_pct: float | None = None  # None: no sample from the driver
    cap_mib: int | None = None  # its share's memory (None: no assignment names it)
    share_milli: int | None = None


class PodUsage:
    """Measures, reports and exports each pod's use of its GPU share (:meth:`step`)."""

    def __init__(self, node: str, nvml: NvmlPort, api: PodsPort, registry: Any,
                 keys: tuple[bytes, ...] = (), proc: Path = Path("/proc"),
                 pod_of_pid: Callable[[int], PodProcess | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 share_of: ShareOf | None = None) -> None:
        """``share_of``: where a container's share comes from (default: its signed
        assignment, verified with ``keys`` when given)."""
        self.node, self.nvml, self.api = node, nvml, api
        self.share_of: ShareOf = share_of or AssignmentShares(keys)
        self.pod_of = pod_of_pid or (lambda pid: pod_of(pid, proc))
        self.clock = clock
        self._gauges(registry)
        self._series: set[UseKey] = set()
        self._pod_series: set[tuple[str, str]] = set()
        self._free_series: set[str] = set()
        self._reported: dict[str, int] = {}  # pod UID -> the count last reported
        self._pods: dict[str, dict[str, Any]] = {}  # UID -> pod, as last read
        self._pods_at = float("-inf")
        self.problems: list[str] = []

    def _gauges(self, registry: Any) -> None:
        from prometheus_client import Gauge

        use = ["node", "namespace", "pod", "container", "gpu", "service"]
        pod = ["node", "namespace", "pod"]

        def gauge(name: str, text: str, labels: list[str]) -> Any:
            return Gauge(name, text, labels, registry=registry)

        self.used = gauge("gpuslice_pod_gpu_memory_used_bytes",
                          "device memory the container's processes use on the GPU (NVML)", use)
        self.cap = gauge("gpuslice_pod_gpu_memory_cap_bytes",
                         "the memory of the container's share of the GPU (its assignment)", use)
        self.headroom = gauge("gpuslice_pod_gpu_memory_headroom_bytes",
                              "its share's memory minus what it uses (negative: over it)", use)
        self.sm = gauge("gpuslice_pod_gpu_sm_utilization_ratio",
                        "fraction of the GPU's SMs the container's processes kept busy over "
                        "the last sample period (NVML's per-process samples)", use)
        self.share = gauge("gpuslice_pod_gpu_sm_share_ratio",
                           "the fraction of the GPU the container's share gives it (milli/1000)",
                           use)
        self.counted = gauge("gpuslice_pod_gpu_processes",
                             "CUDA processes of the container on the GPU (NVML)", use)
        self.declared = gauge("gpuslice_pod_gpu_processes_declared",
                              f"CUDA processes the pod declares per GPU ({PROCESSES_ANNOTATION})",
                              pod)
        self.over = gauge("gpuslice_pod_gpu_processes_over_declared",
                          "1 while the pod runs more CUDA processes on a GPU than it declares: "
                          "each gets the per-process memory cap, their total exceeds its "
                          "share", pod)
        self.free_procs = gauge("gpuslice_gpu_unattributed_processes",
                                "processes on the GPU that belong to no pod (host processes, "
                                "an MPS server)", ["node", "gpu"])
        self.free_mem = gauge("gpuslice_gpu_unattributed_memory_used_bytes",
                              "device memory those processes use", ["node", "gpu"])

    # -- measuring ------------------------------------------------------------------------

    def devices(self) -> dict[str, Device]:
        """Every GPU and MIG instance of the node by UUID."""
        out: dict[str, Device] = {}
        for g in self.nvml.devices():
            out[g.uuid] = Device(g.uuid, memory_mib=g.memory_mib)
            for m in g.mig:
                out[m.uuid] = Device(g.uuid, m.profile, m.start, m.memory_mib)
        return out

    def _processes(self, devices: Iterable[str]) -> dict[str, list[GpuProcess]]:
        out = {}
        for dev in devices:
            try:
                out[dev] = self.nvml.processes(dev)
            except (NvmlError, GpusliceError) as exc:
                note_once(self.problems, f"processes of {dev}: {exc}")
        return out

    def _pods_for(self, uids: set[str]) -> dict[str, dict[str, Any]]:
        """The node's pods by UID: read again when one of ``uids`` is unknown, or every
        :data:`PODS_REREAD_S` (a pod's container restarted: its container IDs changed)."""
        if not uids <= set(self._pods) or self.clock() - self._pods_at >= PODS_REREAD_S:
            self._pods = {str((p.get("metadata") or {}).get("uid")): p
                          for p in self.api.list_pods(node=self.node)}
            self._pods_at = self.clock()
        return self._pods

    def step(self, devices: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
        """One measurement over ``devices`` (default: every GPU and MIG instance): the
        metrics set, the over-declared pods warned. Returns, per pod (``ns/name``), (its
        most CUDA processes on one GPU, the count it declares). Reads the API only when some
        process belongs to a pod it does not know yet."""
        where = self.devices()
        procs = self._processes(where if devices is None else devices)
        owned: dict[tuple[str, str, str], list[GpuProcess]] = {}  # (uid, container, dev)
        free: dict[str, list[GpuProcess]] = {}
        for dev, found in procs.items():
            for p in found:
                hit = self.pod_of(p.pid)
                if hit is None:
                    free.setdefault(dev, []).append(p)
                else:
                    owned.setdefault((hit.pod_uid, hit.container_id, dev), []).append(p)
        self._set_free(free, procs)
        pods = self._pods_for({uid for uid, _, _ in owned}) if owned else {}
        uses: dict[UseKey, Use] = {}
        per_pod: dict[str, dict[str, int]] = {}  # uid -> device -> processes
        for (uid, cid, dev), found in owned.items():
            pod = pods.get(uid)
            if pod is None:
                continue  # a pod the API no longer lists (ending): not counted
            key, use = self._use(pod, cid, dev, found, where)
            uses[key] = use
            mine = per_pod.setdefault(uid, {})
            mine[dev] = mine.get(dev, 0) + use.processes
        self._set_uses(uses)
        return self._check_declared(per_pod, pods)

    def _use(self, pod: dict[str, Any], cid: str, dev: str, found: list[GpuProcess],
             where: dict[str, Device]) -> tuple[UseKey, Use]:
        meta = pod.get("metadata") or {}
        ns, name = str(meta.get("namespace", "default")), str(meta.get("name"))
        container = _container_of(pod, cid)
        samples = [p.sm_pct for p in found if p.sm_pct is not None]
        use = Use(len(found), sum(p.used_mib or 0 for p in found),
                  sum(samples) if samples else None)
        share = self.share_of(pod, container, where.get(dev, Device(dev)))
        if share is not None:
            use.cap_mib, use.share_milli = share.memory_mib or None, share.milli
        service = str((meta.get("labels") or {}).get(SERVICE_LABEL, ""))
        return UseKey(ns, name, container, dev, service), use

    # -- reporting ------------------------------------------------------------------------

    def _set_free(self, free: dict[str, list[GpuProcess]],
                  seen: dict[str, list[GpuProcess]]) -> None:
        for dev in seen:
            found = free.get(dev, [])
            self.free_procs.labels(self.node, dev).set(len(found))
            self.free_mem.labels(self.node, dev).set(sum(p.used_mib or 0 for p in found) * MIB)
        for dev in self._free_series - set(seen):
            for g in (self.free_procs, self.free_mem):
                g.remove(self.node, dev)
        self._free_series = set(seen)

    def _set_uses(self, uses: dict[UseKey, Use]) -> None:
        for k, u in uses.items():
            labels = (self.node, k.namespace, k.pod, k.container, k.gpu, k.service)
            self.used.labels(*labels).set(u.used_mib * MIB)
            self.counted.labels(*labels).set(u.processes)
            cap = None if u.cap_mib is None else u.cap_mib * MIB
            # a value gone since the last step (no sample, the share unprepared) leaves its
            # series rather than keeping a stale one
            for gauge, value in ((self.sm, None if u.sm_pct is None else u.sm_pct / 100),
                                 (self.cap, cap),
                                 (self.headroom, None if cap is None else
                                  cap - u.used_mib * MIB),
                                 (self.share, None if u.share_milli is None else
                                  u.share_milli / 1000)):
                if value is not None:
                    gauge.labels(*labels).set(value)
                else:
                    with contextlib.suppress(KeyError):
                        gauge.remove(*labels)
        for k in self._series - set(uses):  # bounded: what is gone leaves no series
            labels = (self.node, k.namespace, k.pod, k.container, k.gpu, k.service)
            for g in (self.used, self.counted, self.sm, self.cap, self.headroom, self.share):
                with contextlib.suppress(KeyError):  # one it never had (no sample, no share)
                    g.remove(*labels)
        self._series = set(uses)

    def _check_declared(self, per_pod: dict[str, dict[str, int]],
                        pods: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        series: set[tuple[str, str]] = set()
        for uid, by_dev in per_pod.items():
            pod = pods[uid]
            meta = pod.get("metadata") or {}
            ns, name = str(meta.get("namespace", "default")), str(meta.get("name"))
            try:
                declared = declared_processes(meta.get("annotations") or {},
                                              f"pod {ns}/{name}")
            except ValidationError as exc:
                note_once(self.problems, str(exc))
                declared = 1
            counted = max(by_dev.values())  # the count is per GPU the pod touches
            out[f"{ns}/{name}"] = (counted, declared)
            series.add((ns, name))
            self.declared.labels(self.node, ns, name).set(declared)
            self.over.labels(self.node, ns, name).set(1 if counted > declared else 0)
            if counted > declared and self._reported.get(uid) != counted:
                self._reported[uid] = counted
                self._warn(pod, counted, declared)
        self._reported = {u: n for u, n in self._reported.items() if u in per_pod}
        for ns, name in self._pod_series - series:
            for g in (self.declared, self.over):
                g.remove(self.node, ns, name)
        self._pod_series = series
        return out

    def _warn(self, pod: dict[str, Any], counted: int, declared: int) -> None:
        meta = pod.get("metadata") or {}
        ns, name = str(meta.get("namespace", "default")), str(meta.get("name"))
        message = (f"{counted} CUDA processes on its GPU share, {declared} declared "
                   f"({PROCESSES_ANNOTATION}): MPS caps each process at the pod's memory "
                   f"divided by {declared}, so together they can use {counted}/{declared} of "
                   f"its share; set {PROCESSES_ANNOTATION}: \"{counted}\" on the pod template")
        log.warning("pod %s/%s: %s", ns, name, message,
                    extra={"event": "processes-over-declared", "pod": f"{ns}/{name}"})
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{name}.gpuslice-processes-"},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ns,
                               "name": name, "uid": meta.get("uid")},
            "reason": OVER_DECLARED, "type": "Warning", "message": message[:1024],
            "source": {"component": "gpuslice-node-agent", "host": self.node},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        create = getattr(self.api, "create_event", None)
        if create is None:
            return
        try:
            create(ns, event)
        except GpusliceError as exc:
            note_once(self.problems, f"could not report {ns}/{name}'s processes: {exc}")


class AssignmentShares:
    """A container's share from the pod's signed assignment (the device-plugin path): the
    share that gave it the GPU, or the MIG instance at that profile and start. With
    ``keys``, an assignment that verifies with none of them gives no share."""

    def __init__(self, keys: tuple[bytes, ...] = ()) -> None:
        self.keys = keys

    def __call__(self, pod: dict[str, Any], container: str, dev: Device) -> GpuShare | None:
        text = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
        if not text:
            return None
        try:
            a: Assignment = decode(str(text))
        except AnnotationError:
            return None
        if self.keys and not verify_any(a, self.keys):
            return None
        for c in a.containers:
            if c.name != container:
                continue
            for s in c.gpus:
                if s.uuid == dev.gpu and (not dev.profile or (s.mig_profile, s.mig_start) ==
                                          (dev.profile, dev.start)):
                    return s
        return None


def _container_of(pod: dict[str, Any], container_id: str) -> str:
    """The name of the pod's container whose runtime ID is ``container_id`` (its status's
    ``containerID`` is ``<runtime>://<id>``); "" when none says so (not started yet)."""
    status = pod.get("status") or {}
    for key in ("containerStatuses", "initContainerStatuses"):
        for c in status.get(key) or []:
            if container_id and str(c.get("containerID", "")).endswith(container_id):
                return str(c.get("name", ""))
    return ""
