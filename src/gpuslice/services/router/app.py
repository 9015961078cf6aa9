"""The router process (``gpuslice router``): the proxy port in front of :class:`~.state.Router`,
the admin port (``/metrics``, ``/healthz``, ``/replicas``, ``POST /reload``), hot reloads of
the replica set, the health and engine-metrics loops, and a stop that finishes the requests in
flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
from aiohttp import web

from gpuslice.adapters import eventloop
from gpuslice.adapters.http.metrics import CONTENT_TYPE, AccessLog, RouterMetrics
from gpuslice.adapters.http.proxy import (
    ProxySettings,
    RequestRecord,
    ReverseProxy,
)
from gpuslice.adapters.signals import StopSignals
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing_config import RouterConfig
from gpuslice.services.router.llm import (
    engine_loop,
)
from gpuslice.services.router.sources import ConfigLoader, ServeOptions, make_loader
from gpuslice.services.router.state import Router, health_loop

log = logging.getLogger("gpuslice.router")


@dataclass
class RouterApp:
    """A running router: the proxy site, the admin site and background tasks."""

    router: Router
    proxy: ReverseProxy
    metrics: RouterMetrics
    loader: ConfigLoader | None
    runners: list[web.BaseRunner] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    port: int = 0
    admin_port: int = 0
    log: AccessLog | None = None
    watch: Path | None = None
    reload_errors: list[str] = field(default_factory=list)
    stopping: bool = False  # SIGTERM came: /healthz says 503, every answer Connection: close
    closed: bool = False

    async def reload(self) -> dict[str, object]:
        if self.loader is None:
            return {"reloaded": False, "error": "no config source to reload from"}
        try:
            config = await self.loader()
            self.router.apply(config)
        except (TimeoutError, ValidationError, OSError, aiohttp.ClientError) as exc:
            return self._reload_failed(str(exc) or type(exc).__name__)
        except Exception as exc:  # a source's answer no rule above foresaw: the router goes
            # on with the replicas it has, and the next reload may do better
            log.exception("reload failed unexpectedly, keeping the old replica set",
                          extra={"event": "reload-failed"})
            return self._reload_failed(f"{type(exc).__name__}: {exc}")
        return {"reloaded": True, "generation": self.router.generation}

    def _reload_failed(self, error: str) -> dict[str, object]:
        self.reload_errors.append(error)
        log.warning("reload failed, keeping the old replica set: %s", error,
                    extra={"event": "reload-failed"})
        return {"reloaded": False, "error": error}

    async def shutdown(self, delay_s: float) -> None:
        """A rollout's stop: for ``delay_s`` keep accepting and serving as before, except
        that /healthz answers 503 and every answer says ``Connection: close`` (kube-proxy and
        the other routers' clients learn of the pod's removal meanwhile, and a client on a
        kept-alive connection opens its next one elsewhere); then :meth:`close`."""
        self.stopping = True
        self.proxy.closing = True
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        await self.close()

    async def close(self) -> None:
        """Stop accepting; answer the requests in flight, streams included, for at most the
        runners' grace period (idle kept-alive connections are closed at once); then the
        admin port (the reconfiguration controller asks it until the last request is done),
        the background tasks and the upstream connections."""
        if self.closed:
            return
        self.closed = self.stopping = True
        self.proxy.closing = True
        for r in self.runners:
            await r.cleanup()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            # a task that ended on an error must not keep the proxy open
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await t
        await self.proxy.close()
        if self.log is not None:
            self.log.flush()


async def start_router(config: RouterConfig, *, host: str = "127.0.0.1", port: int = 0,
                       admin_host: str | None = None, admin_port: int | None = 0,
                       policy: str | None = None, slo_ms: float | None = None,
                       admission: bool = True, access_log: IO[str] | None = None,
                       loader: ConfigLoader | None = None, watch: Path | None = None,
                       reload_every_s: float | None = None, health: bool = True,
                       seed: int = 0, grace_s: float = 30.0) -> RouterApp:
    """Start the proxy (and the admin port unless ``admin_port`` is None) in the running loop.
    ``grace_s``: how long :meth:`RouterApp.close` lets the requests in flight finish."""
    router = Router(config, policy=policy, slo_ms=slo_ms, admission=admission, seed=seed)
    log = AccessLog(access_log) if access_log is not None else None
    metrics = RouterMetrics(router.gauges)

    def observe(rec: RequestRecord) -> None:
        metrics.observe(rec)
        if log is not None:
            log.write(rec)

    settings = ProxySettings(batch_header=config.batch_header,
                             request_timeout_s=config.request_timeout_s,
                             retry_post=config.retry_post, max_body_bytes=config.max_body_bytes)
    proxy = ReverseProxy(router, settings, observe)
    await proxy.start()
    app = RouterApp(router, proxy, metrics, loader, log=log, watch=watch)
    max_body = config.max_body_bytes

    def request_factory(message: Any, payload: Any, protocol: Any, writer: Any,
                        task: Any) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task,
                               asyncio.get_running_loop(), client_max_size=max_body)

    # auto_decompress off: a request body is forwarded as the client encoded it (decoded, it
    # would reach the replica still labelled gzip; undecodable, it failed the request)
    # handler_cancellation: a client that goes away cancels its request, which closes the
    # connection to the replica (a model server then stops generating for it)
    server = web.Server(proxy.handle, access_log=None, request_factory=request_factory,
                        auto_decompress=False, handler_cancellation=True)
    try:
        await _listen(app, server, host, port, admin_host, admin_port, grace_s)
    except BaseException:  # a port taken: close what was opened (the proxy's client session)
        await app.close()
        raise
    assert proxy.session is not None
    if health:
        app.tasks.append(asyncio.create_task(health_loop(router, proxy.session)))
    if any(s.generative and s.metrics_path for s in config.services) or loader is not None:
        app.tasks.append(asyncio.create_task(engine_loop(
            router.engines, router.metrics_targets, proxy.session)))
    if log is not None:
        app.tasks.append(asyncio.create_task(_flush_loop(log)))
    if watch is not None or reload_every_s is not None:
        app.tasks.append(asyncio.create_task(_watch_loop(app, reload_every_s or 1.0)))
    return app


async def _listen(app: RouterApp, server: web.Server, host: str, port: int,
                  admin_host: str | None, admin_port: int | None, grace_s: float) -> None:
    """Bind the proxy's port and, unless ``admin_port`` is None, the admin port (closed
    after the proxy's, so it answers while the last requests finish)."""
    runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=grace_s)
    await runner.setup()
    app.runners.append(runner)
    await web.TCPSite(runner, host, port, backlog=4096).start()
    app.port = runner.addresses[0][1]
    if admin_port is not None:
        admin = web.Application()
        admin.router.add_get("/metrics", _metrics_handler(app.metrics))
        admin.router.add_get("/healthz", _healthz(app))
        admin.router.add_get("/replicas", _replicas_handler(app.router))
        admin.router.add_post("/reload", _reload_handler(app))
        arunner = web.AppRunner(admin, access_log=None, handle_signals=False)
        await arunner.setup()
        app.runners.append(arunner)
        await web.TCPSite(arunner, admin_host or host, admin_port).start()
        app.admin_port = arunner.addresses[0][1]


async def _flush_loop(log: AccessLog) -> None:
    while True:
        await asyncio.sleep(0.5)
        log.flush()


async def _watch_loop(app: RouterApp, every_s: float) -> None:
    """Reload when the watched file changes (or every ``every_s`` without one: EndpointSlices)."""
    last = app.watch.stat().st_mtime_ns if app.watch is not None else 0
    while True:
        await asyncio.sleep(every_s)
        if app.watch is None:
            await app.reload()
            continue
        try:
            now = app.watch.stat().st_mtime_ns
        except OSError:
            continue
        if now != last:
            last = now
            await app.reload()


def _metrics_handler(metrics: RouterMetrics) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})
    return handler


def _healthz(app: RouterApp) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        if app.stopping:  # not ready: a load balancer that probes takes us out
            return web.Response(status=503, text="stopping")
        return web.Response(text="ok")
    return handler


def _replicas_handler(router: Router) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(router.describe())
    return handler


def _reload_handler(app: RouterApp) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        result = await app.reload()
        return web.json_response(result, status=200 if result.get("reloaded") else 500)
    return handler


async def serve(opts: ServeOptions, ready: Callable[[RouterApp], None] | None = None) -> None:
    loader, watch = make_loader(opts)
    config = await loader()
    log_stream: IO[str] | None
    if opts.access_log == "off":
        log_stream = None
    elif opts.access_log == "-":
        log_stream = sys.stdout
    else:
        log_stream = open(opts.access_log, "a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
    app = await start_router(
        config, host=opts.listen[0], port=opts.listen[1],
        admin_host=opts.admin[0] if opts.admin else None,
        admin_port=opts.admin[1] if opts.admin else None,
        policy=opts.policy, slo_ms=opts.slo_ms, admission=opts.admission,
        access_log=log_stream, loader=loader, watch=watch,
        reload_every_s=opts.poll_s if opts.endpointslices else None,
        grace_s=opts.shutdown_grace_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = StopSignals(stop.set).install(loop)  # SIGTERM, Ctrl-C: stop, exit 0
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(app.reload()))
    log.info("listening on %s:%s (admin %s)", opts.listen[0], app.port,
             "off" if app.admin_port is None else app.admin_port,
             extra={"event": "listening", "port": app.port, "admin_port": app.admin_port,
                    "services": list(app.router.services)})
    if ready is not None:
        ready(app)
    try:
        await stop.wait()
        log.info("stopping: accepting for %g s more (Connection: close), then finishing the "
                 "requests in flight within %g s", opts.shutdown_delay_s, opts.shutdown_grace_s,
                 extra={"event": "stopping", "delay_s": opts.shutdown_delay_s,
                        "grace_s": opts.shutdown_grace_s})
        await app.shutdown(opts.shutdown_delay_s)
    finally:
        await app.close()  # no new requests; those under way are answered (idempotent)
        signals.restore()
        loop.remove_signal_handler(signal.SIGHUP)
        if log_stream is not None and log_stream is not sys.stdout:
            log_stream.close()
    log.info("%s", signals.stopped_line(), extra={"event": "stopped"})


def run(opts: ServeOptions) -> None:
    """Run until SIGTERM/SIGINT, on uvloop where it is installed."""
    eventloop.run(serve(opts))
