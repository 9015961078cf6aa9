"""The gRPC servicer the kubelet calls: options, ListAndWatch, GetPreferredAllocation,
Allocate, PreStartContainer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.kubelet import deviceplugin_pb2_grpc as pbg
from gpuslice.core.assignment import Mode
from gpuslice.core.errors import GpusliceError
from gpuslice.services.device_plugin.admission import Admissions
from gpuslice.services.device_plugin.responses import Responses


class DevicePlugin(Admissions, Responses, pbg.DevicePluginServicer):
    """The kubelet device plugin (see the package's docstring)."""

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
                              f"devices_ids: expected distinct device IDs, got {_some(ids)}")
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"unknown device IDs {_some(unknown)}; this plugin serves "
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
                try:  # the GPU's daemon, or the MIG instance's for a slice inside one,
                    # with a server-side ceiling the client cannot raise its own caps past
                    share = c.gpus[0]
                    self.ensure_mps(self._visible(share), self._thread_pct(share),
                                    adm.per_process(share.memory_mib) if share.memory_mib
                                    else None)
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

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: Any) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _some(ids: list[str], shown: int = 8) -> str:
    """``ids`` for an error message: the first few (each cut to 80 characters) and how many
    more, so that the message stays well under gRPC's 16 KiB of status details."""
    head = [i[:80] for i in ids[:shown]]
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"{head}{more}"
