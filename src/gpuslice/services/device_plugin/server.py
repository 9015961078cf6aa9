"""Serving the plugin on its socket and keeping it registered with the kubelet."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.kubelet import deviceplugin_pb2_grpc as pbg
from gpuslice.core.errors import GpusliceError, ValidationError, note_once
from gpuslice.core.resourcenames import check_extended_resource_name
from gpuslice.services.device_plugin.servicer import DevicePlugin
from gpuslice.services.grpc_limits import pool_size

log = logging.getLogger("gpuslice.device_plugin")

# how often the registration watch looks at kubelet.sock: a restarted kubelet is registered
# with again within this (NVIDIA's plugin watches the folder with inotify; two stats a
# second cost next to nothing, and the kubelet itself takes seconds to come back)
WATCH_S = 0.5


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

    def _watch(self, registered: bool, poll_s: float = WATCH_S) -> None:
        """Register again when the kubelet restarts (a new kubelet.sock) or our socket is
        gone, and retry a refused registration when its back-off ends: a look every
        ``poll_s``, sooner when a retry is due before."""
        seen = self._identity() if registered else None
        tried_on = self._identity()
        while not self._stop.wait(self._wait(poll_s)):
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

    def _wait(self, poll_s: float) -> float:
        due = self._next_try - time.monotonic()
        return poll_s if due <= 0 else max(0.01, min(poll_s, due))

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.stop(grace=None)
