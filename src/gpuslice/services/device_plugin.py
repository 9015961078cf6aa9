"""The kubelet device plugin of the node agent (API v1beta1, gRPC over unix sockets).

It serves ``gpuslice.io/gpu`` as ``replicas`` virtual devices per healthy GPU (IDs
``<GPU UUID>::<k>``). The scheduler extender has already decided which GPU a pod gets and
written it as a signed assignment on the pod; the plugin steers the kubelet to that GPU in
GetPreferredAllocation and, in Allocate, finds the assignment it is executing: a verified
assignment for this node, on the GPUs of the devices the kubelet chose, not yet executed (the
oldest first). Claiming it is one set insertion under a small lock, never a node-wide lock, and
every failure is a gRPC error with a reason that changes no state.

Start order follows the kubelet: serve the plugin socket first, then Register with
``kubelet.sock``; when ``kubelet.sock`` is recreated (a kubelet restart) register again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpuslice.adapters.dra.cdi import device_node
from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.fake import KubePort
from gpuslice.adapters.kube.objects import PRIORITY_ANNOTATION
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.kubelet import deviceplugin_pb2_grpc as pbg
from gpuslice.adapters.mps import (
    PIPE_DIR,
    PIPE_IN_CONTAINER,
    SHM_DIR,
    ensure_client_mounts,
    pinned_mem_limit,
)
from gpuslice.adapters.nvml.port import NvmlPort
from gpuslice.core import catalog, migmps
from gpuslice.core.assignment import (
    ANNOTATION,
    Assignment,
    ContainerAssignment,
    GpuShare,
    Mode,
    verify,
)
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.model import PRIORITIES
from gpuslice.core.resourcenames import check_extended_resource_name
from gpuslice.services.grpc_limits import Slots, Streams, pool_size

log = logging.getLogger("gpuslice.device_plugin")

RESOURCE = "gpuslice.io/gpu"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


@dataclass
class PluginConfig:
    node: str
    socket_dir: Path
    key: bytes
    replicas: int = 10  # virtual devices per GPU
    endpoint: str = "gpuslice-gpu.sock"
    mps_pipe_dir: str = PIPE_DIR
    # host directory mounted at /dev/shm in MPS clients: the daemons' /dev/shm ("" for none)
    mps_shm_dir: str = SHM_DIR
    # "none": the extender names the GPU (or instance); "single": every MIG instance is one
    # gpuslice.io/gpu; "mixed": one resource per MIG profile (gpuslice.io/mig-1g.10gb, ...)
    mig_strategy: str = "none"
    mig_profile: str = ""  # with "mixed": the profile this plugin serves
    resource: str = RESOURCE
    # how long Allocate keeps asking an API server that does not answer before it fails the
    # admission (the kubelet sets no deadline on Allocate; a failed one fails the pod): the
    # whole of it, a frozen server's unanswered connections included
    api_retry_s: float = 10.0
    # calls waiting on the API server at a time (Allocate, GetPreferredAllocation); one more
    # is answered at once, and ListAndWatch streams (at most ``streams``, a new one ends the
    # oldest) have threads of their own (grpc_limits.py)
    api_calls: int = 8
    streams: int = 4
    # the kubelet's PodResources socket: pods it has given this resource's devices to already
    # executed their assignment, even while still Pending (pulling an image); None: not asked
    pod_resources: Path | None = None
    # how Allocate names the devices to the container runtime (NVIDIA's device plugin's
    # names): "envvar" (NVIDIA_VISIBLE_DEVICES), "volume-mounts" (one /dev/null mount per
    # device under /var/run/nvidia-container-devices), "cdi-annotations" (the cdi.k8s.io/
    # annotation), "cdi-cri" (the CRI's CDI devices field); several may be combined
    device_list_strategy: tuple[str, ...] = ("envvar",)
    cdi_root: Path = Path("/var/run/cdi")  # where the CDI spec is written (cdi-* strategies)
    # where the NVIDIA device nodes are on the host (the CDI spec's hostPath; they keep their
    # /dev names in the container): another folder for fake GPUs with stand-in nodes
    dev_dir: Path = Path("/dev")


def note_once(problems: list[str], text: str, window: int = 10) -> None:
    """Add ``text`` to ``problems`` unless it is among the last ``window`` (a fault that recurs
    every pass, an outage above all, must not grow the list)."""
    if text not in problems[-window:]:
        problems.append(text)


@dataclass(eq=False)
class _Admission:
    """A pod the kubelet is admitting: its assignment, the containers it will call Allocate
    for (in order), how many it has, and its priority annotation."""

    a: Assignment
    plan: tuple[ContainerAssignment, ...]
    priority: str = "normal"
    done: int = 0


DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
CDI_KIND = "gpuslice.io/gpu"
CDI_VERSION = "1.0.0"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"


def device_list_strategy(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The strategies named (comma-separated or a list), checked: NVIDIA's names only."""
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value)
             if v.strip()]
    bad = [n for n in names if n not in DEVICE_LIST_STRATEGIES]
    if bad or not names:
        raise ValidationError("--device-list-strategy",
                              f"one or more of {', '.join(DEVICE_LIST_STRATEGIES)}",
                              value)
    return tuple(dict.fromkeys(names))


def mig_resource_suffix(profile: str) -> str:
    """A MIG profile as it appears in a resource name: NVIDIA's spelling, ``1g.10gb+me`` ->
    ``1g.10gb.me`` (``+`` is not allowed in a qualified name)."""
    return profile.replace("+", ".")


def cdi_device_name(device: str) -> str:
    """The CDI device name of a GPU or MIG UUID (CDI names: letters, digits, ``_.:-``)."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", device)


class DevicePlugin(pbg.DevicePluginServicer):
    def __init__(self, cfg: PluginConfig, nvml: NvmlPort, api: KubePort,
                 ensure_mps: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.nvml = nvml
        self.api = api
        # called with a GPU UUID before an MPS slice on it is handed out (starts its daemon)
        self.ensure_mps = ensure_mps
        self._cond = threading.Condition()
        self._version = 0
        self._unhealthy: set[str] = set()
        self._claimed: set[tuple[str, str]] = set()  # (namespace, pod) already executed
        self._executed: list[Assignment] = []
        self._claim_lock = threading.Lock()
        self._admitting: list[_Admission] = []  # claimed, containers still to allocate
        self.problems: list[str] = []
        self.api_slots = Slots(cfg.api_calls)
        self.streams = Streams(cfg.streams)

    def executed(self) -> list[Assignment]:
        """The assignments Allocate has executed so far."""
        with self._claim_lock:
            return list(self._executed)

    # -- devices ---------------------------------------------------------------------------

    def devices(self) -> list[pb.Device]:
        out: list[pb.Device] = []
        if self.cfg.mig_strategy != "none":
            for g in self.nvml.devices():
                health = HEALTHY if g.healthy and g.uuid not in self._unhealthy else UNHEALTHY
                out.extend(pb.Device(ID=m.uuid, health=health) for m in g.mig
                           if self.cfg.mig_strategy == "single"
                           or m.profile == self.cfg.mig_profile)
            return out
        for g in self.nvml.devices():
            health = HEALTHY if g.healthy and g.uuid not in self._unhealthy else UNHEALTHY
            out.extend(pb.Device(ID=f"{g.uuid}::{k}", health=health)
                       for k in range(self.cfg.replicas))
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

    # -- the gRPC API ----------------------------------------------------------------------

    def options(self) -> pb.DevicePluginOptions:
        """The options registered and answered: no PreStartContainer; GetPreferredAllocation
        steers the kubelet to the assigned GPUs (with a MIG strategy the kubelet's choice is
        as good as any, so it is not offered)."""
        return pb.DevicePluginOptions(
            pre_start_required=False,
            get_preferred_allocation_available=self.cfg.mig_strategy == "none")

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return self.options()

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        with self.streams.open(context.is_active) as active:
            yield from self._list_and_watch(active)

    def _list_and_watch(self, active: Callable[[], bool]) -> Iterator[pb.ListAndWatchResponse]:
        seen = -1
        while active():
            with self._cond:
                if seen == self._version:
                    self._cond.wait(0.5)
                    if seen == self._version:
                        continue
                seen = self._version
            yield pb.ListAndWatchResponse(devices=self.devices())

    def _pending(self) -> list[Assignment]:
        """Verified assignments for this node not executed yet, oldest first."""
        return [w.a for w in self._waiting()]

    def _pods_here(self) -> list[dict[str, Any]]:
        """The pods bound to this node, asking again (up to ``api_retry_s``, backing off) while
        the API server does not answer: a brief outage must not fail admissions."""
        deadline = time.monotonic() + self.cfg.api_retry_s
        wait_s = 0.1
        with self.api_slots.take() as free:
            if not free:
                raise GpusliceError(f"{self.api_slots.limit} calls are waiting on the API "
                                    "server already; try again")
            while True:
                try:
                    left = max(0.01, deadline - time.monotonic())
                    return self.api.list_pods(node=self.cfg.node, timeout_s=left)
                except GpusliceError as exc:
                    if time.monotonic() + wait_s > deadline:
                        raise GpusliceError(f"the API server is not answering, so the pods "
                                            f"waiting for this node's GPUs cannot be read: "
                                            f"{exc}") from None
                    time.sleep(wait_s)
                    wait_s = min(2.0, 2 * wait_s)

    def _held_by_kubelet(self) -> set[tuple[str, str]]:
        """Pods holding this resource's devices, as the kubelet's PodResources API says; empty
        (and noted once) when it is not configured or does not answer."""
        if self.cfg.pod_resources is None:
            return set()
        from gpuslice.adapters.kubelet.podresources import pods_holding

        try:
            return set(pods_holding(self.cfg.resource, self.cfg.pod_resources))
        except GpusliceError as exc:
            note_once(self.problems, str(exc))
            return set()

    def _plan(self, pod: dict[str, Any], a: Assignment) -> tuple[ContainerAssignment, ...]:
        """The containers of ``a`` the kubelet will call Allocate for, in its order: the
        init containers in declared order, then the app containers, each only when its
        limits name this plugin's resource (the device manager allocates nothing else)."""
        spec = pod.get("spec") or {}
        order: dict[str, int] = {}
        asks: set[str] = set()
        for field_name in ("initContainers", "containers"):
            for c in spec.get(field_name) or []:
                if not isinstance(c, dict):
                    continue
                name = str(c.get("name") or "")
                order.setdefault(name, len(order))
                res = c.get("resources") or {}
                if any(self.cfg.resource in (res.get(k) or {}) for k in ("limits", "requests")):
                    asks.add(name)
        ordered = sorted(a.containers, key=lambda c: order.get(c.name, len(order)))
        plan = tuple(c for c in ordered if c.name not in order or c.name in asks)
        return plan or tuple(ordered)

    def _waiting(self) -> list[_Admission]:
        """Verified assignments for this node not claimed yet, oldest first, each with the
        containers the kubelet will allocate and its pod's priority annotation."""
        out = []
        held = self._held_by_kubelet()
        for p in self._pods_here():
            meta = p.get("metadata") or {}
            text = (meta.get("annotations") or {}).get(ANNOTATION)
            if not text:
                continue
            # the kubelet allocates devices while admitting a pod, never for one already
            # running or finished: after an agent restart those are not waiting for Allocate
            if (p.get("status") or {}).get("phase") not in (None, "", "Pending"):
                continue
            if (meta.get("namespace", "default"), meta.get("name")) in held:
                continue  # the kubelet gave it devices already: executed before a restart
            try:
                a = decode(text)
            except AnnotationError:
                continue
            if a.node != self.cfg.node or not verify(a, self.cfg.key):
                continue
            if (a.namespace, a.pod) in self._claimed:
                continue
            priority = str((meta.get("annotations") or {}).get(PRIORITY_ANNOTATION, "normal"))
            out.append(_Admission(a, self._plan(p, a), priority))
        return sorted(out, key=lambda w: (w.a.bind_time, w.a.namespace, w.a.pod))

    @staticmethod
    def _gpus_of(ids: list[str]) -> set[str]:
        return {d.split("::")[0] for d in ids}

    def _fits_next(self, adm: _Admission, ids: list[str]) -> bool:
        """Whether the devices the kubelet chose can be ``adm``'s next container's: as many
        as it has GPUs, on its GPUs; for whole GPUs any of the pod's own GPUs (the kubelet
        reuses an init container's devices for the app containers in an order of its own)."""
        if adm.done >= len(adm.plan):
            return False
        c = adm.plan[adm.done]
        gpus = self._gpus_of(ids)
        if len(ids) != len(c.gpus):
            return False
        if gpus == {g.uuid for g in c.gpus}:
            return True
        whole = all(g.milli == 1000 and not g.mig_profile for g in c.gpus)
        return adm.done > 0 and whole and len(gpus) == len(ids) and gpus <= adm.a.gpu_uuids()

    def _claim_for(self, ids: list[str]) -> tuple[_Admission | None, list[str]]:
        """The admission these devices belong to, its next container taken: the pod the
        kubelet is admitting (its containers come one Allocate at a time), else the oldest
        waiting assignment whose first container is on these GPUs and can be executed; and
        why older ones were passed over (their MIG instance is gone: a layout changed after
        the bind). One that can never run must not hold up the pods behind it."""
        with self._claim_lock:
            for adm in self._admitting:
                if self._fits_next(adm, ids):
                    adm.done += 1
                    if adm.done >= len(adm.plan):
                        self._admitting.remove(adm)
                    return adm, []
        stale: list[str] = []
        for w in self._waiting():
            if not self._fits_next(w, ids):
                continue
            mig = [g for c in w.a.containers for g in c.gpus if g.mig_profile]
            try:
                for g in mig:
                    self._visible(g)
            except GpusliceError as exc:
                stale.append(f"{w.a.namespace}/{w.a.pod}: {exc}")
                continue
            with self._claim_lock:
                key = (w.a.namespace, w.a.pod)
                if key in self._claimed:
                    continue
                self._claimed.add(key)
                self._executed.append(w.a)
                w.done = 1
                if len(w.plan) > 1:
                    self._admitting.append(w)
            return w, stale
        return None, stale

    def _undo(self, adm: _Admission) -> None:
        """Give back the container just taken (and the pod, when it was its first)."""
        with self._claim_lock:
            adm.done -= 1
            if adm.done == 0:
                self._claimed.discard((adm.a.namespace, adm.a.pod))
                self._executed = [x for x in self._executed
                                  if (x.namespace, x.pod) != (adm.a.namespace, adm.a.pod)]
                if adm in self._admitting:
                    self._admitting.remove(adm)
            elif adm not in self._admitting:
                self._admitting.append(adm)

    def _target(self, size: int) -> list[str]:
        """The GPUs the next Allocate of ``size`` devices should be on: the next container
        of the pod being admitted, else the first of the oldest waiting assignment."""
        with self._claim_lock:
            for adm in self._admitting:
                c = adm.plan[min(adm.done, len(adm.plan) - 1)]
                if len(c.gpus) == size:
                    return [g.uuid for g in c.gpus]
        try:
            waiting = self._waiting()
        except GpusliceError:
            return []  # no steer: the kubelet's own choice, and Allocate says what failed
        for w in waiting:
            if len(w.plan[0].gpus) == size:
                return [g.uuid for g in w.plan[0].gpus]
        return []

    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                               context: Any) -> pb.PreferredAllocationResponse:
        """Per container request: every must-include device first (api.proto: the answer
        must contain them), then a device on each GPU the assignment names, then any
        available device, up to ``allocation_size`` (fewer only when fewer are offered)."""
        out = []
        for creq in request.container_requests:
            size = int(creq.allocation_size)
            available = list(dict.fromkeys(creq.available_deviceIDs))
            chosen = list(dict.fromkeys(creq.must_include_deviceIDs))
            covered = self._gpus_of(chosen)
            if self.cfg.mig_strategy == "none":
                for uuid in self._target(size):
                    if len(chosen) >= size or uuid in covered:
                        continue
                    pick = next((d for d in available if d.split("::")[0] == uuid
                                 and d not in chosen), None)
                    if pick is not None:
                        chosen.append(pick)
                        covered.add(uuid)
            for d in available:
                if len(chosen) >= size:
                    break
                if d not in chosen:
                    chosen.append(d)
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        known = {d.ID for d in self.devices()}
        if not request.container_requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "container_requests: expected one request per container, got none")
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            unknown = [d for d in ids if d not in known]
            named = ("MIG instance UUIDs" if self.cfg.mig_strategy != "none"
                     else "<GPU UUID>::<n>")
            if not ids or len(set(ids)) != len(ids):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"devices_ids: expected distinct device IDs, got {ids}")
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"unknown device IDs {unknown}; this plugin serves "
                              f"{self.cfg.resource} devices named {named}")
            if self.cfg.mig_strategy != "none":
                # NVIDIA's single/mixed strategies: the kubelet's choice is the instance
                responses.append(self._runtime_response(ids, {}, [], {"gpuslice.io/mode": "mig"}))
                continue
            try:
                adm, stale = self._claim_for(ids)
            except GpusliceError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            if adm is None:
                why = (f"; passed over, as they can no longer be executed: {'; '.join(stale)}"
                       if stale else "")
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no verified gpuslice assignment for node {self.cfg.node} on "
                              f"GPUs {sorted(self._gpus_of(ids))} is waiting: was the pod "
                              f"scheduled by the gpuslice scheduler (schedulerName: "
                              f"gpuslice-scheduler)?{why}")
                raise AssertionError("abort raises")  # grpc's abort never returns
            c = adm.plan[adm.done - 1]
            if c.mode is Mode.MPS and self.ensure_mps:
                try:  # the GPU's daemon, or the MIG instance's for a slice inside one
                    self.ensure_mps(self._visible(c.gpus[0]))
                except GpusliceError as exc:
                    self._undo(adm)
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"MPS for {adm.a.namespace}/{adm.a.pod}: {exc}")
            try:
                responses.append(self._response(adm, c, ids))
            except GpusliceError as exc:
                self._undo(adm)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{adm.a.namespace}/{adm.a.pod}: {exc}")
        return pb.AllocateResponse(container_responses=responses)

    def _unclaim(self, a: Assignment) -> None:
        with self._claim_lock:
            self._claimed.discard((a.namespace, a.pod))
            self._executed = [x for x in self._executed if (x.namespace, x.pod) !=
                              (a.namespace, a.pod)]
            self._admitting = [w for w in self._admitting if w.a is not a]

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

    def _thread_pct(self, share: GpuShare) -> int:
        """The MPS thread cap: milli/10 of the GPU, or inside a MIG instance that share of the
        instance (214 milli of the GPU in a 3g of 7 is half the instance)."""
        if not share.mig_profile:
            return max(1, share.milli // 10)
        model = next((catalog.lookup(g.model) for g in self.nvml.devices()
                      if g.uuid == share.uuid), None)
        if model is None or model.mig is None:
            raise GpusliceError(f"GPU {share.uuid}: no MIG geometry for its model")
        return migmps.thread_pct(share.milli, model.mig.profile(share.mig_profile).compute_slices,
                                 model.mig.compute_slices)

    def _runtime_response(self, devices: list[str], envs: dict[str, str],
                          mounts: list[pb.Mount],
                          annotations: dict[str, str]) -> pb.ContainerAllocateResponse:
        """How the container runtime learns the devices (``devices``: GPU or MIG UUIDs), by
        the configured device list strategies (NVIDIA's device plugin's names)."""
        envs, mounts, annotations = dict(envs), list(mounts), dict(annotations)
        cdi: list[pb.CDIDevice] = []
        names = [f"{CDI_KIND}={cdi_device_name(d)}" for d in devices]
        for strategy in self.cfg.device_list_strategy:
            if strategy == "envvar":
                envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(devices)
            elif strategy == "volume-mounts":
                envs["NVIDIA_VISIBLE_DEVICES"] = VOLUME_MOUNTS_ROOT
                mounts.extend(pb.Mount(container_path=f"{VOLUME_MOUNTS_ROOT}/{d}",
                                       host_path="/dev/null", read_only=True) for d in devices)
            elif strategy == "cdi-annotations":
                import hashlib

                tag = hashlib.sha256(",".join(devices).encode()).hexdigest()[:16]
                annotations[f"{CDI_ANNOTATION_PREFIX}gpuslice_{tag}"] = ",".join(names)
            elif strategy == "cdi-cri":
                cdi.extend(pb.CDIDevice(name=n) for n in names)
        return pb.ContainerAllocateResponse(envs=envs, mounts=mounts, annotations=annotations,
                                            cdi_devices=cdi)

    def _response(self, adm: _Admission, c: ContainerAssignment,
                  ids: list[str]) -> pb.ContainerAllocateResponse:
        a = adm.a
        priority = adm.priority
        shares = list(c.gpus)
        if sorted(g.uuid for g in shares) != sorted(self._gpus_of(ids)):
            # whole GPUs the kubelet reused from an init container: the ones it gave
            shares = [GpuShare(u, 1000, shares[0].memory_mib)
                      for u in sorted(self._gpus_of(ids))]
        gpus = [self._visible(g) for g in shares]
        envs = {"GPUSLICE_ASSIGNMENT": f"{a.namespace}/{a.pod}",
                "GPUSLICE_CONTAINER": c.name}
        mounts = []
        if c.mode is Mode.MPS:
            share = shares[0]
            envs["CUDA_MPS_PIPE_DIRECTORY"] = PIPE_IN_CONTAINER
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self._thread_pct(share))
            if share.memory_mib:
                envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = pinned_mem_limit(
                    *(g.memory_mib for g in shares))
            if priority not in PRIORITIES:
                raise GpusliceError(f"{PRIORITY_ANNOTATION}: expected one of "
                                    f"{', '.join(PRIORITIES)}, got {priority!r}")
            if PRIORITIES[priority] != "0":
                envs["CUDA_MPS_CLIENT_PRIORITY"] = PRIORITIES[priority]
            mounts += [pb.Mount(container_path=c, host_path=h, read_only=False) for h, c in
                       ensure_client_mounts(self.cfg.mps_pipe_dir, gpus[0],
                                            self.cfg.mps_shm_dir)]
        return self._runtime_response(
            gpus, envs, mounts, {"gpuslice.io/pod": f"{a.namespace}/{a.pod}",
                                 "gpuslice.io/container": c.name,
                                 "gpuslice.io/mode": c.mode.value})

    def cdi_spec(self) -> dict[str, Any]:
        """The CDI spec of the devices this plugin hands out (kind gpuslice.io/gpu): one
        CDI device per GPU and per MIG instance, with its device node and the driver's
        control nodes."""
        def node(name: str) -> dict[str, str]:
            return device_node(str(Path(self.cfg.dev_dir) / name), str(self.cfg.dev_dir))

        control = [node(n) for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")]
        devices = []
        for g in self.nvml.devices():
            gpu = node(f"nvidia{self.nvml.minor_number(g.uuid)}")
            devices.append({"name": cdi_device_name(g.uuid),
                            "containerEdits": {"deviceNodes": [gpu, *control]}})
            devices.extend({"name": cdi_device_name(m.uuid),
                            "containerEdits": {"deviceNodes": [gpu, *control]}}
                           for m in g.mig)
        return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}

    def write_cdi_spec(self) -> Path | None:
        """Write :meth:`cdi_spec` under ``cdi_root`` atomically (a temporary file renamed
        over the old one: a runtime never reads half a spec); None when no CDI strategy is
        configured."""
        if not any(st.startswith("cdi-") for st in self.cfg.device_list_strategy):
            return None
        root = Path(self.cfg.cdi_root)
        root.mkdir(parents=True, exist_ok=True)
        target = root / f"{CDI_KIND.replace('/', '-')}.json"
        tmp = root / f".{target.name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(self.cdi_spec(), indent=2, sort_keys=True))
        os.replace(tmp, target)
        return target

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: Any) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class RegistrationRefused(GpusliceError):
    """The kubelet (or our own check) refused the registration; the message says why."""


class PluginServer:
    """Serves the plugin on its socket and keeps it registered with the kubelet.

    The resource name is checked as the kubelet checks it before anything is sent (a bad one
    is refused with a logged error and never registered). A registration the kubelet refuses
    or does not answer is tried again with exponential backoff (``backoff_s`` doubling up to
    ``max_backoff_s``), each failure reported through ``on_failure(resource, message)`` (the
    node agent makes it a Kubernetes Event and a metric): never a tight loop. A new
    ``kubelet.sock`` (a restarted kubelet) is tried at once."""

    def __init__(self, plugin: DevicePlugin, register_timeout_s: float = 5.0, *,
                 backoff_s: float = 0.5, max_backoff_s: float = 60.0,
                 on_failure: Callable[[str, str], None] | None = None) -> None:
        self.plugin = plugin
        self.timeout = register_timeout_s
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.registrations = 0
        self.attempts = 0
        self.errors: list[str] = []
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._delay = 0.0
        self._next_try = 0.0
        self.on_failure = on_failure
        self.invalid: str = ""  # why the resource name can never be registered

    @property
    def socket(self) -> Path:
        return self.plugin.cfg.socket_dir / self.plugin.cfg.endpoint

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin.cfg.socket_dir / "kubelet.sock"

    def _serve(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
        self.socket.unlink(missing_ok=True)
        cfg = self.plugin.cfg  # no call waits behind another (grpc_limits.py)
        server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=pool_size(cfg.api_calls, cfg.streams)))
        pbg.add_DevicePluginServicer_to_server(self.plugin, server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def _register(self) -> None:
        self.attempts += 1
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as ch:
            grpc.channel_ready_future(ch).result(timeout=self.timeout)
            stub = pbg.RegistrationStub(ch)  # type: ignore[no-untyped-call]
            try:
                stub.Register(pb.RegisterRequest(
                    version="v1beta1", endpoint=self.plugin.cfg.endpoint,
                    resource_name=self.plugin.cfg.resource,
                    options=self.plugin.options()), timeout=self.timeout)
            except grpc.RpcError as exc:
                raise RegistrationRefused(
                    f"the kubelet refused to register {self.plugin.cfg.resource}: "
                    f"{exc.details() if hasattr(exc, 'details') else exc}") from None
        self.registrations += 1
        log.info("registered %s with the kubelet (%s, endpoint %s)", self.plugin.cfg.resource,
                 self.kubelet_socket, self.plugin.cfg.endpoint)

    def _failed(self, exc: BaseException) -> None:
        """One failed registration: note it, report it, and back off."""
        if isinstance(exc, RegistrationRefused):
            text = str(exc)
        elif isinstance(exc, grpc.FutureTimeoutError):
            text = (f"the kubelet is not answering on {self.kubelet_socket}; registering "
                    f"{self.plugin.cfg.resource} when it does")
        else:
            text = f"registering {self.plugin.cfg.resource}: {exc!r}"
        self._delay = min(self.max_backoff_s, max(self.backoff_s, 2 * self._delay))
        self._next_try = time.monotonic() + self._delay
        note_once(self.errors, text)
        log.warning("%s (next try in %.1f s)", text, self._delay)
        if self.on_failure is not None:
            self.on_failure(self.plugin.cfg.resource, text)

    def _attempt(self) -> bool:
        try:
            self._serve()  # the kubelet wipes the directory on restart, our socket too
            self._register()
        except (RegistrationRefused, grpc.RpcError, grpc.FutureTimeoutError, OSError,
                RuntimeError) as exc:
            self._failed(exc)
            return False
        self._delay = 0.0
        return True

    def start(self) -> None:
        """Serve, register, and watch kubelet.sock to register again after a kubelet restart.
        A kubelet that does not answer yet is not fatal: registration is retried (backing
        off) and happens at once when its socket is recreated. A resource name the kubelet
        would refuse is never sent."""
        try:
            check_extended_resource_name(self.plugin.cfg.resource, "device plugin resource")
        except ValidationError as exc:
            self.invalid = str(exc)
            self.errors.append(f"not registering: {exc}")
            log.error("not registering: %s", exc)
            if self.on_failure is not None:
                self.on_failure(self.plugin.cfg.resource, str(exc))
            return
        self.plugin.write_cdi_spec()
        registered = self._attempt()
        self._watcher = threading.Thread(target=self._watch, args=(registered,), daemon=True)
        self._watcher.start()

    def _identity(self) -> tuple[int, int] | None:
        """kubelet.sock's identity (inode and change time: inodes are reused at once)."""
        try:
            st = self.kubelet_socket.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_ctime_ns)

    def _watch(self, registered: bool, poll_s: float = 0.2) -> None:
        seen = self._identity() if registered else None
        tried_on = self._identity()
        while not self._stop.wait(poll_s):
            now = self._identity()
            if now is None:
                seen = None
                continue
            if now == seen and self.socket.exists():
                continue
            if now != tried_on:  # a new kubelet: try at once
                tried_on, self._next_try = now, 0.0
            if time.monotonic() < self._next_try:
                continue
            if self._attempt():
                seen = now

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.stop(grace=None)


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def plugin_configs(base: PluginConfig, nvml: NvmlPort) -> list[PluginConfig]:
    """The plugins a node runs: one for ``none`` and ``single``; for ``mixed`` one per MIG
    profile present, serving ``gpuslice.io/mig-<profile>`` on its own socket."""
    from dataclasses import replace

    if base.mig_strategy not in ("none", "single", "mixed"):
        from gpuslice.core.errors import ValidationError

        raise ValidationError("mig strategy", "none, single or mixed", base.mig_strategy)
    if base.mig_strategy != "mixed":
        return [base]
    profiles = sorted({m.profile for g in nvml.devices() for m in g.mig})
    return [replace(base, mig_profile=p, resource=f"gpuslice.io/mig-{mig_resource_suffix(p)}",
                    endpoint=f"gpuslice-mig-{mig_resource_suffix(p)}.sock") for p in profiles]
