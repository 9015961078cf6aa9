"""The DRA driver's gRPC side: the DRA service (v1 and v1beta1) and the health stream on
``dra.sock``, registration on ``<driver>-reg.sock``; and :func:`run`, the DaemonSet's loop."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpuslice.adapters.kubelet import dra_health_v1alpha1_pb2 as hpb
from gpuslice.adapters.kubelet import dra_health_v1alpha1_pb2_grpc as hpbg
from gpuslice.adapters.kubelet import dra_v1_pb2 as v1
from gpuslice.adapters.kubelet import dra_v1_pb2_grpc as v1g
from gpuslice.adapters.kubelet import dra_v1beta1_pb2 as v1beta1
from gpuslice.adapters.kubelet import dra_v1beta1_pb2_grpc as v1beta1g
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2 as rpb
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2_grpc as rpbg
from gpuslice.core.errors import GpusliceError
from gpuslice.services.dra_driver.config import (
    KEEPALIVE_OPTIONS,
    PLUGIN_TYPE,
    SUPPORTED_VERSIONS,
    ClaimRef,
)
from gpuslice.services.dra_driver.driver import DraDriver
from gpuslice.services.grpc_limits import Slots, Streams, pool_size

log = logging.getLogger("gpuslice.dra")


def _refs(claims: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.uid, c.name) for c in claims]


class _DraServicer:
    """NodePrepareResources / NodeUnprepareResources of one API version (``pb``)."""

    def __init__(self, driver: DraDriver, pb: Any, share_ids: bool, slots: Slots) -> None:
        self.driver, self.pb, self.share_ids = driver, pb, share_ids
        self.slots = slots  # shared by both versions' prepares

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        rid = uuidlib.uuid4().hex[:8]
        log.info("[%s] NodePrepareResources %s", rid, [c.uid for c in request.claims])
        resp = self.pb.NodePrepareResourcesResponse()
        with self.slots.take() as free:
            if free:
                answers = self.driver.prepare(_refs(request.claims))
            else:  # every slot waits on the API server: answered now, retried by the kubelet
                busy = (f"{self.slots.limit} prepares are under way (waiting on the API "
                        "server?); the kubelet tries again")
                log.warning("[%s] %s", rid, busy)
                answers = {c.uid: f"claim {c.namespace}/{c.name}: {busy}"
                           for c in request.claims}
        for uid, res in answers.items():
            entry = resp.claims[uid]
            if isinstance(res, str):
                entry.error = res
                continue
            for d in res:
                dev = entry.devices.add(request_names=d["request_names"], pool_name=d["pool"],
                                        device_name=d["device"], cdi_device_ids=d["cdi"])
                if self.share_ids and d.get("share_id"):
                    dev.share_id = d["share_id"]
        return resp

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        rid = uuidlib.uuid4().hex[:8]
        log.info("[%s] NodeUnprepareResources %s", rid, [c.uid for c in request.claims])
        resp = self.pb.NodeUnprepareResourcesResponse()
        for uid, err in self.driver.unprepare(_refs(request.claims)).items():
            resp.claims[uid].error = err
        return resp


class DraV1(_DraServicer, v1g.DRAPluginServicer):
    def __init__(self, driver: DraDriver, slots: Slots) -> None:
        super().__init__(driver, v1, share_ids=True, slots=slots)


class DraV1beta1(_DraServicer, v1beta1g.DRAPluginServicer):
    def __init__(self, driver: DraDriver, slots: Slots) -> None:
        super().__init__(driver, v1beta1, share_ids=False, slots=slots)


class Health(hpbg.DRAResourceHealthServicer):
    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver
        self.streams = Streams(driver.cfg.health_streams)

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        with self.streams.open(context.is_active) as active:
            yield from self._watch(active)

    def _watch(self, active: Callable[[], bool]) -> Iterator[Any]:
        for devices in self.driver.watch_health(active):
            now = int(time.time())
            yield hpb.NodeWatchResourcesResponse(devices=[hpb.DeviceHealth(
                device=hpb.DeviceIdentifier(pool_name=pool, device_name=name),
                health=hpb.HEALTHY if ok else hpb.UNHEALTHY, last_updated_time=now,
                health_check_timeout_seconds=self.driver.cfg.health_timeout_s)
                for pool, name, ok in devices])


class Registration(rpbg.RegistrationServicer):
    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver

    def GetInfo(self, request: Any, context: Any) -> Any:
        cfg = self.driver.cfg
        return rpb.PluginInfo(type=PLUGIN_TYPE, name=cfg.driver,
                              endpoint=str(cfg.dra_socket.resolve()),
                              supported_versions=list(SUPPORTED_VERSIONS))

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.driver.registration.append((request.plugin_registered, request.error))
        if request.plugin_registered:
            log.info("registered with the kubelet")
        else:
            log.error("the kubelet refused the registration: %s", request.error)
            self.driver.problems.append(f"kubelet refused registration: {request.error}")
        return rpb.RegistrationStatusResponse()


class DraServer:
    """The two sockets: the DRA service (and health) first, then registration, so that the
    kubelet finds the service when it follows the registration.

    No call waits behind another (grpc_limits.py): the DRA socket's threads are enough for
    ``max_prepares`` prepares (those beyond are answered "busy" at once) and
    ``health_streams`` health streams (a new one ends the oldest), plus a reserve, so that an
    unprepare, which needs no API server, is served while prepares wait on a frozen one;
    registration has a server of its own."""

    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver
        cfg = driver.cfg
        self.workers = pool_size(cfg.max_prepares, cfg.health_streams)
        self.slots = Slots(cfg.max_prepares)
        self._servers: list[grpc.Server] = []

    def start(self) -> None:
        cfg = self.driver.cfg
        dra_server = self._serve(cfg.dra_socket, self.workers)
        v1g.add_DRAPluginServicer_to_server(DraV1(self.driver, self.slots), dra_server)  # type: ignore[no-untyped-call]
        v1beta1g.add_DRAPluginServicer_to_server(DraV1beta1(self.driver, self.slots), dra_server)  # type: ignore[no-untyped-call]
        hpbg.add_DRAResourceHealthServicer_to_server(Health(self.driver), dra_server)  # type: ignore[no-untyped-call]
        dra_server.start()
        reg = self._serve(cfg.registration_socket, 4)
        rpbg.add_RegistrationServicer_to_server(Registration(self.driver), reg)  # type: ignore[no-untyped-call]
        reg.start()
        self._servers = [dra_server, reg]

    def _serve(self, socket: Path, workers: int) -> grpc.Server:
        socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            socket.unlink()  # a previous run's
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                             options=list(KEEPALIVE_OPTIONS))
        if server.add_insecure_port(f"unix://{socket}") == 0:
            raise GpusliceError(f"cannot listen on {socket}")
        return server

    def stop(self) -> None:
        for s in reversed(self._servers):  # registration first: the kubelet stops calling
            s.stop(grace=1.0).wait()
        cfg = self.driver.cfg
        for sock in (cfg.registration_socket, cfg.dra_socket):
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()


def run(driver: DraDriver, stop: threading.Event, poll_s: float = 1.0) -> None:
    """Start, serve and follow health until ``stop`` is set."""
    driver.start()
    server = DraServer(driver)
    server.start()
    try:
        while not stop.is_set():
            driver.tick(poll_s)
    finally:
        server.stop()
        driver.close()
