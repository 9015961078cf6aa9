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

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.fake import KubePort
from gpuslice.adapters.kube.objects import PRIORITY_ANNOTATION
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.kubelet import deviceplugin_pb2_grpc as pbg
from gpuslice.adapters.nvml.port import NvmlPort
from gpuslice.core import catalog, migmps
from gpuslice.core.assignment import ANNOTATION, Assignment, GpuShare, Mode, verify
from gpuslice.core.errors import GpusliceError
from gpuslice.core.model import PRIORITIES

RESOURCE = "gpuslice.io/gpu"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
MPS_PIPE_IN_CONTAINER = "/run/gpuslice/mps"


@dataclass
class PluginConfig:
    node: str
    socket_dir: Path
    key: bytes
    replicas: int = 10  # virtual devices per GPU
    endpoint: str = "gpuslice-gpu.sock"
    mps_pipe_dir: str = "/run/gpuslice/mps"
    # "none": the extender names the GPU (or instance); "single": every MIG instance is one
    # gpuslice.io/gpu; "mixed": one resource per MIG profile (gpuslice.io/mig-1g.10gb, ...)
    mig_strategy: str = "none"
    mig_profile: str = ""  # with "mixed": the profile this plugin serves
    resource: str = RESOURCE
    # how long Allocate keeps asking an API server that does not answer before it fails the
    # admission (the kubelet sets no deadline on Allocate; a failed one fails the pod)
    api_retry_s: float = 10.0
    # the kubelet's PodResources socket: pods it has given this resource's devices to already
    # executed their assignment, even while still Pending (pulling an image); None: not asked
    pod_resources: Path | None = None


def note_once(problems: list[str], text: str, window: int = 10) -> None:
    """Add ``text`` to ``problems`` unless it is among the last ``window`` (a fault that recurs
    every pass, an outage above all, must not grow the list)."""
    if text not in problems[-window:]:
        problems.append(text)


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
        self._claimed_priority: dict[tuple[str, str], str] = {}  # read when claimed
        self.problems: list[str] = []

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

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False,
                                      get_preferred_allocation_available=True)

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        seen = -1
        while context.is_active():
            with self._cond:
                if seen == self._version:
                    self._cond.wait(0.5)
                    if seen == self._version:
                        continue
                seen = self._version
            yield pb.ListAndWatchResponse(devices=self.devices())

    def _pending(self) -> list[Assignment]:
        """Verified assignments for this node not executed yet, oldest first."""
        return self._pending_with_priority()[0]

    def _pods_here(self) -> list[dict[str, Any]]:
        """The pods bound to this node, asking again (up to ``api_retry_s``, backing off) while
        the API server does not answer: a brief outage must not fail admissions."""
        deadline = time.monotonic() + self.cfg.api_retry_s
        wait_s = 0.1
        while True:
            try:
                return self.api.list_pods(node=self.cfg.node)
            except GpusliceError as exc:
                if time.monotonic() + wait_s > deadline:
                    raise GpusliceError(f"the API server is not answering, so the pods waiting "
                                        f"for this node's GPUs cannot be read: {exc}") from None
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

    def _pending_with_priority(self) -> tuple[list[Assignment], dict[tuple[str, str], str]]:
        """:meth:`_pending`, and each one's pod's priority annotation (for Allocate)."""
        out = []
        priority: dict[tuple[str, str], str] = {}
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
            priority[(a.namespace, a.pod)] = str(
                (meta.get("annotations") or {}).get(PRIORITY_ANNOTATION, "normal"))
            out.append(a)
        return sorted(out, key=lambda a: (a.bind_time, a.namespace, a.pod)), priority

    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                               context: Any) -> pb.PreferredAllocationResponse:
        try:
            pending = self._pending()
        except GpusliceError:
            pending = []  # no steer: the kubelet's own choice, and Allocate says what failed
        out = []
        for creq in request.container_requests:
            available = list(creq.available_deviceIDs)
            chosen = list(creq.must_include_deviceIDs)
            for a in pending:
                uuids = sorted(a.gpu_uuids())
                if len(uuids) != creq.allocation_size:
                    continue
                pick = [next((d for d in available if d.split("::")[0] == u), "") for u in uuids]
                if all(pick):
                    chosen = pick
                    break
            if len(chosen) < creq.allocation_size:
                chosen += [d for d in available if d not in chosen][
                    : creq.allocation_size - len(chosen)]
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        known = {d.ID for d in self.devices()}
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            unknown = [d for d in ids if d not in known]
            if unknown:
                named = ("MIG instance UUIDs" if self.cfg.mig_strategy != "none"
                         else "<GPU UUID>::<n>")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"unknown device IDs {unknown}; this plugin serves "
                              f"{self.cfg.resource} devices named {named}")
            if self.cfg.mig_strategy != "none":
                # NVIDIA's single/mixed strategies: the kubelet's choice is the instance
                responses.append(pb.ContainerAllocateResponse(
                    envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)},
                    annotations={"gpuslice.io/mode": "mig"}))
                continue
            uuids = sorted({d.split("::")[0] for d in ids})
            try:
                a, stale = self._claim(uuids)
            except GpusliceError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            if a is not None and a.containers[0].mode is Mode.MPS and self.ensure_mps:
                try:  # the GPU's daemon, or the MIG instance's for a slice inside one
                    self.ensure_mps(self._visible(a.containers[0].gpus[0]))
                except GpusliceError as exc:
                    self._unclaim(a)
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"MPS for {a.namespace}/{a.pod}: {exc}")
            if a is None:
                why = (f"; passed over, as they can no longer be executed: {'; '.join(stale)}"
                       if stale else "")
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no verified gpuslice assignment for node {self.cfg.node} on "
                              f"GPUs {uuids} is waiting: was the pod scheduled by the gpuslice "
                              f"scheduler (schedulerName: gpuslice-scheduler)?{why}")
                raise AssertionError("abort raises")  # grpc's abort never returns
            try:
                responses.append(self._response(a))
            except GpusliceError as exc:
                self._unclaim(a)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{a.namespace}/{a.pod}: {exc}")
        return pb.AllocateResponse(container_responses=responses)

    def _claim(self, uuids: list[str]) -> tuple[Assignment | None, list[str]]:
        """The oldest waiting assignment on these GPUs that can be executed, taken; and why
        older ones were passed over (their MIG instance is gone: a layout changed after the
        bind). One that can never run must not hold up the pods behind it."""
        pending, priority = self._pending_with_priority()
        stale: list[str] = []
        for a in pending:
            if sorted(a.gpu_uuids()) != uuids:
                continue
            if any(g.mig_profile for g in a.containers[0].gpus):
                try:
                    for g in a.containers[0].gpus:
                        self._visible(g)
                except GpusliceError as exc:
                    stale.append(f"{a.namespace}/{a.pod}: {exc}")
                    continue
            with self._claim_lock:
                key = (a.namespace, a.pod)
                if key in self._claimed:
                    continue
                self._claimed.add(key)
                self._claimed_priority[key] = priority.get(key, "normal")
                self._executed.append(a)
            return a, stale
        return None, stale

    def _unclaim(self, a: Assignment) -> None:
        with self._claim_lock:
            self._claimed.discard((a.namespace, a.pod))
            self._claimed_priority.pop((a.namespace, a.pod), None)
            self._executed = [x for x in self._executed if (x.namespace, x.pod) !=
                              (a.namespace, a.pod)]

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

    def _response(self, a: Assignment) -> pb.ContainerAllocateResponse:
        c = a.containers[0]
        priority = self._claimed_priority.pop((a.namespace, a.pod), "normal")
        gpus = [self._visible(g) for g in c.gpus]
        envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(gpus),
                "GPUSLICE_ASSIGNMENT": f"{a.namespace}/{a.pod}"}
        mounts = []
        if c.mode is Mode.MPS:
            share = c.gpus[0]
            envs["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_IN_CONTAINER
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self._thread_pct(share))
            if share.memory_mib:
                envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
                    f"{i}={g.memory_mib}M" for i, g in enumerate(c.gpus))
            if priority not in PRIORITIES:
                raise GpusliceError(f"{PRIORITY_ANNOTATION}: expected one of "
                                    f"{', '.join(PRIORITIES)}, got {priority!r}")
            if PRIORITIES[priority] != "0":
                envs["CUDA_MPS_CLIENT_PRIORITY"] = PRIORITIES[priority]
            mounts.append(pb.Mount(container_path=MPS_PIPE_IN_CONTAINER,
                                   host_path=os.path.join(self.cfg.mps_pipe_dir, gpus[0]),
                                   read_only=False))
        return pb.ContainerAllocateResponse(
            envs=envs, mounts=mounts,
            annotations={"gpuslice.io/pod": f"{a.namespace}/{a.pod}",
                         "gpuslice.io/mode": c.mode.value})

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: Any) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class PluginServer:
    """Serves the plugin on its socket and keeps it registered with the kubelet."""

    def __init__(self, plugin: DevicePlugin, register_timeout_s: float = 5.0) -> None:
        self.plugin = plugin
        self.timeout = register_timeout_s
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.registrations = 0
        self.errors: list[str] = []

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
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pbg.add_DevicePluginServicer_to_server(self.plugin, server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def _register(self) -> None:
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as ch:
            grpc.channel_ready_future(ch).result(timeout=self.timeout)
            stub = pbg.RegistrationStub(ch)  # type: ignore[no-untyped-call]
            stub.Register(pb.RegisterRequest(
                version="v1beta1", endpoint=self.plugin.cfg.endpoint,
                resource_name=self.plugin.cfg.resource,
                options=pb.DevicePluginOptions(get_preferred_allocation_available=True)),
                timeout=self.timeout)
        self.registrations += 1

    def start(self) -> None:
        """Serve, register, and watch kubelet.sock to register again after a kubelet restart.
        A kubelet that does not answer yet is not fatal: registration happens when its socket
        (re)appears."""
        self._serve()
        try:
            self._register()
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            self.errors.append(f"the kubelet is not answering on {self.kubelet_socket} "
                               f"({type(exc).__name__}); registering when it does")
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _identity(self) -> tuple[int, int] | None:
        """kubelet.sock's identity (inode and change time: inodes are reused at once)."""
        try:
            st = self.kubelet_socket.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_ctime_ns)

    def _watch(self, poll_s: float = 0.2) -> None:
        seen = self._identity() if self.registrations else None
        while not self._stop.wait(poll_s):
            now = self._identity()
            if now is not None and (now != seen or not self.socket.exists()):
                try:
                    self._serve()  # the kubelet wiped the directory, our socket too
                    self._register()
                    seen = now
                except (grpc.RpcError, grpc.FutureTimeoutError, OSError, RuntimeError) as exc:
                    self.errors.append(f"re-register: {exc!r}")  # not answering yet: retry
            elif now is None:
                seen = None

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
    return [replace(base, mig_profile=p, resource=f"gpuslice.io/mig-{p}",
                    endpoint=f"gpuslice-mig-{p}.sock") for p in profiles]
