"""The kubelet's device manager, kubelet side, written from its behaviour (not its code).

Rules taken from kubernetes ``pkg/kubelet/cm/devicemanager/manager.go``:

- ``Allocate(pod, container)`` is called for every container, init containers first in their
  order, then the app containers. For an init container that is not restartable, its devices
  join the pod's ``devicesToReuse``; for a restartable one (a sidecar) they leave it; for an
  app container they leave it once it has them (``addContainerAllocatedResources`` /
  ``removeContainerAllocatedResources``).
- ``devicesToAllocate`` takes reusable devices first; when they are not enough it asks
  ``GetPreferredAllocation`` (only when the plugin advertised it) with the free healthy
  devices plus those already taken as ``available``, those already taken as
  ``must_include`` and the container's whole count as ``size``; it keeps the answer's devices
  that are free, then fills from the rest.
- ``allocateContainerResources`` calls the plugin's ``Allocate`` once per container and
  resource, with exactly one ContainerAllocateRequest, and reads ``ContainerResponses[0]``.

Registration (``pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go``): the version must be
a supported one and the resource an extended resource name; the kubelet then dials the plugin
back, asks GetDevicePluginOptions and follows ListAndWatch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.kubelet import deviceplugin_pb2_grpc as pbg
from gpuslice.core.resourcenames import extended_resource_name_problems
from tests.nodeagent.test_device_plugin import Kubelet


class CheckingKubelet(Kubelet):
    """The Registration server of :class:`tests.nodeagent.test_device_plugin.Kubelet`, with
    the kubelet's checks on a request: refused registrations are counted."""

    def __init__(self, sock_dir: Path) -> None:
        super().__init__(sock_dir)
        self.refused: list[str] = []
        self.options: pb.DevicePluginOptions | None = None

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        problems = extended_resource_name_problems(request.resource_name)
        if request.version != "v1beta1":
            problems.append(f"unsupported version {request.version!r}")
        if problems:
            self.refused.append(request.resource_name)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"invalid resource name {request.resource_name!r}: "
                          + "; ".join(problems))
        self.resources.append(request.resource_name)
        self.channel = grpc.insecure_channel(f"unix://{self.dir / request.endpoint}")
        stub = pbg.DevicePluginStub(self.channel)
        self.options = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)

        def follow() -> None:
            try:
                for resp in stub.ListAndWatch(pb.Empty()):
                    self.lists.append(list(resp.devices))
            except grpc.RpcError:
                pass

        threading.Thread(target=follow, daemon=True).start()
        self.registered.set()
        return pb.Empty()


@dataclass
class DeviceManager:
    """One resource's device manager on one node: admits pods container by container."""

    kubelet: CheckingKubelet
    resource: str
    allocated: dict[str, str] = field(default_factory=dict)  # device -> "ns/pod/container"
    responses: dict[tuple[str, str], pb.ContainerAllocateResponse] = \
        field(default_factory=dict)
    devices_of: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def healthy(self) -> list[str]:
        return [d.ID for d in (self.kubelet.lists[-1] if self.kubelet.lists else [])
                if d.health == "Healthy"]

    def admit(self, pod: dict[str, Any]) -> None:
        """Allocate every container of ``pod`` that asks for the resource, as the kubelet
        does at admission; raises grpc.RpcError (or RuntimeError) on a refusal."""
        meta = pod["metadata"]
        key = f"{meta.get('namespace', 'default')}/{meta['name']}"
        spec = pod.get("spec") or {}
        reuse: set[str] = set()
        stub = self.kubelet.stub()
        with self.lock:  # the kubelet admits one pod at a time
            for kind, containers in (("init", spec.get("initContainers") or []),
                                     ("app", spec.get("containers") or [])):
                for c in containers:
                    limits = (c.get("resources") or {}).get("limits") or {}
                    need = int(limits.get(self.resource, 0) or 0)
                    if need:
                        ids = self._devices_to_allocate(stub, need, reuse)
                        resp = stub.Allocate(pb.AllocateRequest(container_requests=[
                            pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=10)
                        if not resp.container_responses:
                            raise RuntimeError("no containers return in allocation response")
                        for d in ids:
                            self.allocated[d] = f"{key}/{c['name']}"
                        self.responses[(key, c["name"])] = resp.container_responses[0]
                        self.devices_of[(key, c["name"])] = ids
                    else:
                        ids = []
                    if kind == "init" and c.get("restartPolicy") != "Always":
                        reuse |= set(ids)
                    else:
                        reuse -= set(ids)

    def _devices_to_allocate(self, stub: pbg.DevicePluginStub, need: int,
                             reuse: set[str]) -> list[str]:
        chosen: list[str] = []
        for d in sorted(reuse):  # reusable devices first
            if len(chosen) == need:
                return chosen
            chosen.append(d)
        if len(chosen) == need:
            return chosen
        in_use = set(self.allocated) - reuse
        free = [d for d in self.healthy() if d not in in_use and d not in chosen]
        if len(free) < need - len(chosen):
            raise RuntimeError(f"requested number of devices unavailable for {self.resource}. "
                               f"Requested: {need}, Available: {len(free)}")
        opts = self.kubelet.options
        if opts is not None and opts.get_preferred_allocation_available:
            pref = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(
                container_requests=[pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=free + chosen, must_include_deviceIDs=chosen,
                    allocation_size=need)]), timeout=10)
            answer = list(pref.container_responses[0].deviceIDs) \
                if pref.container_responses else []
            for d in answer:
                if len(chosen) < need and d in free and d not in chosen:
                    chosen.append(d)
        for d in free:
            if len(chosen) < need and d not in chosen:
                chosen.append(d)
        return chosen

    def release(self, keys: Iterable[str]) -> None:
        """A pod ended: its devices are free again."""
        gone = set(keys)
        with self.lock:
            for d, owner in list(self.allocated.items()):
                if owner.rsplit("/", 1)[0] in gone:
                    del self.allocated[d]
