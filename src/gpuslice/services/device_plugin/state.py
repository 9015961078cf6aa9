"""The device plugin's state: the devices it serves, their health, and what it has claimed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuslice.adapters.kube.fake import KubePort
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.nvml.port import NvmlPort
from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare
from gpuslice.core.devices import GpuDevice
from gpuslice.core.errors import GpusliceError
from gpuslice.services.device_plugin.config import HEALTHY, UNHEALTHY, PluginConfig
from gpuslice.services.grpc_limits import Slots, Streams


@dataclass(eq=False)
class _Admission:
    """A pod the kubelet is admitting: its assignment, the containers it will call Allocate
    for (in order), how many it has, its priority annotation and resourceVersion."""

    a: Assignment
    plan: tuple[ContainerAssignment, ...]
    priority: str = "normal"
    resource_version: int | None = None  # the pod's, as bound: the kubelet's order
    done: int = 0
    processes: object = "1"  # its gpuslice.io/processes annotation, as written

    def per_process(self, mib: int) -> int:
        """A share's memory divided among the CUDA processes the pod declares: MPS caps
        each client process, so each gets its part and the pod's total stays within its
        share (a ValidationError naming the annotation when it is not 1..48)."""
        from gpuslice.adapters.kube.objects import declared_processes

        n = declared_processes({"gpuslice.io/processes": self.processes},
                               f"pod {self.a.namespace}/{self.a.pod}")
        return max(1, mib // n)


class PluginState:
    """What the plugin holds: its devices and their health, and the assignments claimed."""

    def __init__(self, cfg: PluginConfig, nvml: NvmlPort, api: KubePort,
                 ensure_mps: Callable[[str, int, int | None], None] | None = None) -> None:
        self.cfg = cfg
        self.nvml = nvml
        self.api = api
        # called with a GPU UUID, thread percentage and memory cap (MiB) before an MPS slice on
        # it is handed out (starts its daemon, widens its server-side ceiling)
        self.ensure_mps = ensure_mps
        self._cond = threading.Condition()
        self._version = 0
        self._unhealthy: set[str] = set()
        # pods (by UID) whose assignment was executed, with the sequence number of the claim
        self._claimed: dict[str, int] = {}
        self._claim_seq = 0
        self._executed: list[Assignment] = []
        self._claim_lock = threading.Lock()
        self._admitting: list[_Admission] = []  # claimed, containers still to allocate
        self.problems: list[str] = []
        self._cdi_written: dict[str, Any] | None = None  # the CDI spec last written
        self._cdi_lock = threading.Lock()
        self.api_slots = Slots(cfg.api_calls)
        self.streams = Streams(cfg.streams)

    def executed(self) -> list[Assignment]:
        """The assignments Allocate has executed so far."""
        with self._claim_lock:
            return list(self._executed)

    # -- devices ---------------------------------------------------------------------------

    def _ids(self, g: GpuDevice) -> list[str]:
        """The device IDs GPU ``g`` is listed as: its MIG instances the strategy serves, or
        ``<UUID>::<k>`` for each of its virtual devices."""
        if self.cfg.mig_strategy != "none":
            return [m.uuid for m in g.mig
                    if self.cfg.mig_strategy == "single" or m.profile == self.cfg.mig_profile]
        return [f"{g.uuid}::{k}" for k in range(self.cfg.replicas)]

    def device_count(self) -> int:
        """How many devices :meth:`devices` lists (without making them)."""
        return sum(len(self._ids(g)) for g in self.nvml.devices())

    def devices(self) -> list[pb.Device]:
        out: list[pb.Device] = []
        for g in self.nvml.devices():
            health = HEALTHY if g.healthy and g.uuid not in self._unhealthy else UNHEALTHY
            out.extend(pb.Device(ID=i, health=health) for i in self._ids(g))
        return out

    def set_health(self, uuid: str, healthy: bool) -> None:
        """Mark a GPU (un)healthy; ListAndWatch streams the new list at once."""
        with self._cond:
            if healthy:
                self._unhealthy.discard(uuid)
            else:
                self._unhealthy.add(uuid)
            self._version += 1
            self._cond.notify_all()

    def changed(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    @staticmethod
    def _gpus_of(ids: list[str]) -> set[str]:
        return {d.split("::")[0] for d in ids}

    def _visible(self, share: GpuShare) -> str:
        """What the container sees of a share: the GPU, or the MIG instance the assignment
        names (by profile and start) on it."""
        if not share.mig_profile:
            return share.uuid
        for g in self.nvml.devices():
            if g.uuid == share.uuid:
                for m in g.mig:
                    if (m.profile, m.start) == (share.mig_profile, share.mig_start):
                        return m.uuid
        raise GpusliceError(f"GPU {share.uuid} has no MIG instance {share.mig_profile}@"
                            f"{share.mig_start} (the layout changed since the assignment?)")
