"""Each pod's CUDA processes on the node's MPS-shared GPUs, against what it declared.

MPS caps every client process on its own, so a pod's share holds only when the pod runs the
processes it declared (``gpuslice.io/processes``: the node divides the memory cap among them).
The node agent counts them: NVML's processes on each GPU or MIG instance with an MPS daemon
(MPS clients are processes of their own), each mapped to its pod through its cgroup
(:func:`gpuslice.adapters.proc.pods.pod_of`). A pod running more than it declared gets a
Warning event (once per count) and shows in the metrics; pods that are gone leave them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpuslice.adapters.kube.fake import KubePort
from gpuslice.adapters.kube.objects import PROCESSES_ANNOTATION, declared_processes
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.adapters.proc.pods import PodProcess, pod_of
from gpuslice.core.errors import GpusliceError, ValidationError, note_once

log = logging.getLogger(__name__)
OVER_DECLARED = "GpuProcessesOverDeclared"


class PodProcesses:
    """Counts, reports and exports each pod's CUDA processes."""

    def __init__(self, node: str, nvml: NvmlPort, api: KubePort, registry: Any,
                 proc: Path = Path("/proc"),
                 pod_of_pid: Callable[[int], PodProcess | None] | None = None) -> None:
        from prometheus_client import Gauge

        self.node, self.nvml, self.api = node, nvml, api
        self.pod_of = pod_of_pid or (lambda pid: pod_of(pid, proc))
        labels = ["namespace", "pod"]
        self.counted = Gauge("gpuslice_pod_gpu_processes",
                             "CUDA processes of the pod on its MPS-shared GPUs (NVML)", labels,
                             registry=registry)
        self.declared = Gauge("gpuslice_pod_gpu_processes_declared",
                              f"CUDA processes the pod declares ({PROCESSES_ANNOTATION})",
                              labels, registry=registry)
        self.over = Gauge("gpuslice_pod_gpu_processes_over_declared",
                          "1 while the pod runs more CUDA processes than it declares: each "
                          "gets the per-process memory cap, their total exceeds its share",
                          labels, registry=registry)
        self._series: set[tuple[str, str]] = set()
        self._reported: dict[str, int] = {}  # pod UID -> the count last reported
        self.problems: list[str] = []

    def _pids_by_pod(self, targets: Iterable[str]) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for target in targets:
            try:
                procs = self.nvml.processes(target)
            except (NvmlError, GpusliceError) as exc:
                note_once(self.problems, f"processes of {target}: {exc}")
                continue
            for p in procs:
                found = self.pod_of(p.pid)
                if found is not None:
                    out.setdefault(found.pod_uid, set()).add(p.pid)
        return out

    def step(self, targets: Iterable[str]) -> dict[str, tuple[int, int]]:
        """One count over the GPUs and MIG instances ``targets``: per pod (``ns/name``) its
        (processes, declared). Reads the API only when some process belongs to a pod."""
        pids = self._pids_by_pod(targets)
        out: dict[str, tuple[int, int]] = {}
        series: set[tuple[str, str]] = set()
        if pids:
            pods = {str((p.get("metadata") or {}).get("uid")): p
                    for p in self.api.list_pods(node=self.node)}
            for uid, mine in pids.items():
                pod = pods.get(uid)
                if pod is None:
                    continue  # a pod the API no longer lists (ending): not counted
                meta = pod.get("metadata") or {}
                ns, name = str(meta.get("namespace", "default")), str(meta.get("name"))
                try:
                    declared = declared_processes(meta.get("annotations") or {},
                                                  f"pod {ns}/{name}")
                except ValidationError as exc:
                    note_once(self.problems, str(exc))
                    declared = 1
                counted = len(mine)
                out[f"{ns}/{name}"] = (counted, declared)
                series.add((ns, name))
                self.counted.labels(ns, name).set(counted)
                self.declared.labels(ns, name).set(declared)
                self.over.labels(ns, name).set(1 if counted > declared else 0)
                if counted > declared and self._reported.get(uid) != counted:
                    self._reported[uid] = counted
                    self._warn(pod, counted, declared)
            self._reported = {u: n for u, n in self._reported.items() if u in pids}
        for ns, name in self._series - series:  # bounded: gone pods leave no series
            for g in (self.counted, self.declared, self.over):
                g.remove(ns, name)
        self._series = series
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
