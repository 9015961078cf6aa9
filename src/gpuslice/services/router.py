"""The router service (``gpuslice router``): wires the pure routing core to the HTTP proxy.

:class:`Router` holds, per service, an immutable tuple of :class:`ReplicaView` and the policy's
state; for each request it asks the policy and admission control (``core/routing.py``) and
applies the answer. Around it: active health checks, passive ejection of replicas that refuse
connections, hot reload of the replica set (config file change, SIGHUP, ``POST /reload`` on the
admin port, or a new EndpointSlice list) that keeps what was learned and never drops a
connection, Prometheus metrics and the JSON access log. Generative services (OpenAI-style
requests routed by the body's model, costed in tokens, their replicas' own gauges scraped) are
described in ``services/router_llm.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import aiohttp
from aiohttp import web

from gpuslice.adapters import eventloop
from gpuslice.adapters.http.metrics import CONTENT_TYPE, AccessLog, ReplicaGauge, RouterMetrics
from gpuslice.adapters.http.proxy import (
    Pick,
    ProxySettings,
    Reject,
    RequestRecord,
    ReverseProxy,
)
from gpuslice.adapters.signals import StopSignals
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing import (
    DEFAULT_PRIOR_S,
    ReplicaView,
    RoutingPolicy,
    ServiceModel,
    Ticket,
    admit,
    completed,
    dispatched,
    make_routing_policy,
    with_health,
)
from gpuslice.core.routing_config import RouterConfig, ServiceSpec
from gpuslice.core.routing_llm import TokenDemand, TokenOutcome, mean_output
from gpuslice.services.router_llm import (
    EngineGauges,
    describe_tokens,
    engine_loop,
    learned_speed,
    token_speed,
)
from gpuslice.services.router_sources import (  # re-exported: the router's options and sources
    ConfigLoader,
    ServeOptions,
    _service_of,
    make_loader,
)

log = logging.getLogger("gpuslice.router")

__all__ = ["ConfigLoader", "Router", "RouterApp", "ServeOptions", "_service_of", "make_loader",
           "run", "serve", "start_router"]


@dataclass
class _Service:
    spec: ServiceSpec
    policy: RoutingPolicy
    views: list[ReplicaView]
    urls: dict[str, str]
    fails: dict[str, int] = field(default_factory=dict)
    oks: dict[str, int] = field(default_factory=dict)
    draining: frozenset[str] = frozenset()
    admitted_at: float = 0.0  # monotonic time of the last request admitted (for probes)
    mean_out: float = 256.0  # generative: learned mean output tokens

    def index(self, name: str) -> int | None:
        for i, v in enumerate(self.views):
            if v.name == name:
                return i
        return None


@dataclass(frozen=True, slots=True)
class _Ticket:
    name: str
    ticket: Ticket
    generation: int


def _prior(spec: ServiceSpec, weight: float, given: float | None) -> float:
    if given is not None:
        return given
    top = max((r.weight for r in spec.replicas), default=1.0)
    return DEFAULT_PRIOR_S * top / weight


class Router:
    """Balancer of the proxy: per-service replica views, policy state and admission control."""

    def __init__(self, config: RouterConfig, *, policy: str | None = None,
                 slo_ms: float | None = None, admission: bool = True, seed: int = 0) -> None:
        self.policy_override = policy
        if policy is not None:
            make_routing_policy(policy)
        self.slo_override = None if slo_ms is None else slo_ms / 1e3
        self.admission = admission
        self.rng = random.Random(seed)
        self.services: dict[str, _Service] = {}
        self.models: dict[str, str] = {}
        self.adapters: dict[str, str] = {}  # LoRA adapter -> its service's base model
        self.config = config
        self.generation = 0
        self.engines = EngineGauges()
        self.apply(config)

    # -- configuration -------------------------------------------------------------------------
    def apply(self, config: RouterConfig) -> None:
        """Install a new replica set; replicas that stay keep their load and learned model."""
        services: dict[str, _Service] = {}
        for spec in config.services:
            old = self.services.get(spec.name)
            name = self.policy_override or spec.policy or config.policy
            policy = make_routing_policy(name)
            if old is not None and old.policy.name == policy.name:
                policy = old.policy
            views: list[ReplicaView] = []
            urls: dict[str, str] = {}
            for r in spec.replicas:
                if r.url is None:
                    raise ValidationError(f"services[{spec.name}].replicas[{r.name}].url",
                                          "an http:// URL", None)
                urls[r.name] = r.url
                prev = None
                if old is not None:
                    i = old.index(r.name)
                    prev = None if i is None else old.views[i]
                speed = token_speed(spec, r)
                if prev is not None and old is not None and old.urls.get(r.name) == r.url:
                    speed = learned_speed(speed, prev.tokens)
                    views.append(replace(prev, weight=r.weight, concurrency=r.concurrency,
                                         tokens=speed))
                else:
                    views.append(ReplicaView(
                        r.name, r.weight, r.concurrency,
                        model=ServiceModel(prior_s=_prior(spec, r.weight, r.service_time_s)),
                        tokens=speed))
            draining = frozenset(r.name for r in spec.replicas if r.draining)
            services[spec.name] = _Service(
                spec, policy, views, urls, draining=draining,
                mean_out=old.mean_out if old is not None else float(spec.mean_output_tokens))
        models: dict[str, str] = {}
        adapters: dict[str, str] = {}
        for spec in config.services:
            for m in spec.models:
                models.setdefault(m, spec.name)
            for a in spec.adapters:
                if a not in models:
                    models[a] = spec.name
                    adapters[a] = spec.models[0] if spec.models else spec.name
        self.services, self.models, self.adapters = services, models, adapters
        self.config = config
        self.generation += 1

    def slo_s(self, spec: ServiceSpec) -> float | None:
        if not self.admission or not spec.admission:
            return None
        return self.slo_override if self.slo_override is not None else spec.slo_s

    # -- Balancer ------------------------------------------------------------------------------
    def service_for(self, model: str | None) -> str | Reject:
        """The service a request's model (from its path) goes to; a model no service names is
        refused with 404, even with one service. A service that names no model (EndpointSlices
        without --models) takes every model."""
        if model is not None:
            svc = self.models.get(model)
            if svc is not None:
                return svc
            open_ = [n for n, s in self.services.items() if not s.spec.models]
            if len(open_) == 1:
                return open_[0]
            return Reject(404, f"no service serves model {model!r}; known models: "
                          f"{sorted(self.models)}", reason="unknown-model")
        return next(iter(self.services))

    def wants_body_size(self, service: str) -> bool:
        return self.services[service].policy.name == "sed"

    def model_list(self) -> list[tuple[str, str | None]]:
        """Empty with no generative service: ``GET /v1/models`` is then KServe v1's, forwarded."""
        if not any(s.spec.generative for s in self.services.values()):
            return []
        return [(m, self.adapters.get(m)) for m in self.models]

    def token_demand(self, service: str, prompt_tokens: int, output_tokens: int | None,
                     embedding: bool) -> TokenDemand | None:
        svc = self.services.get(service)
        if svc is None or not svc.spec.generative:
            return None
        out = 0 if embedding else (output_tokens if output_tokens is not None
                                   else max(1, round(svc.mean_out)))
        return TokenDemand(prompt_tokens, out, embedding)

    def _views(self, service: str, svc: _Service, exclude: frozenset[str]
               ) -> list[ReplicaView]:
        """The replicas as routing sees them now: excluded and draining ones unhealthy, and
        each generative replica with its own gauges while they are fresh."""
        views = svc.views
        if exclude or svc.draining:
            out = exclude | svc.draining
            views = [with_health(v, False) if v.name in out else v for v in views]
        if svc.spec.generative and svc.spec.metrics_path is not None:
            now = time.monotonic()
            views = [replace(v, engine=self.engines.fresh(service, v.name, now)) for v in views]
        return views

    def pick(self, service: str, size: int, exclude: frozenset[str],
             first: bool, demand: TokenDemand | None = None) -> Pick | Reject:
        svc = self.services.get(service)
        if svc is None:
            return Reject(503, f"service {service!r} was removed", 1, "removed")
        views = self._views(service, svc, exclude)
        if first:
            now = time.monotonic()
            slo = self.slo_s(svc.spec) if demand is None else (
                svc.spec.slo_ttft_s if self.admission and svc.spec.admission else None)
            adm = admit(views, size, slo, self.config.min_samples,
                        since_admitted_s=now - svc.admitted_at, demand=demand)
            if adm.admitted:
                svc.admitted_at = now
            if not adm.admitted:
                if adm.predicted_s is None:
                    return Reject(503, f"service {service!r}: {adm.reason}", adm.retry_after_s,
                                  "no-replica")
                return Reject(429, f"service {service!r}: {adm.reason}", adm.retry_after_s,
                              "slo")
        choice = svc.policy.choose(views, size, self.rng.random(), demand)
        svc.policy = choice.policy
        if choice.index is None:
            return Reject(503, f"service {service!r}: {choice.reason}", 1, "no-replica")
        i = choice.index
        view, ticket = dispatched(replace(svc.views[i], engine=views[i].engine)
                                  if views[i].engine is not None else svc.views[i],
                                  size, demand)
        view = replace(view, engine=None) if view.engine is not None else view
        svc.views[i] = view
        return Pick(service, view.name, svc.urls[view.name],
                    _Ticket(view.name, ticket, self.generation), ticket.delay_s)

    def done(self, pick: Pick, latency_s: float | None, *, failed: bool = False,
             eject: bool = False, outcome: TokenOutcome | None = None) -> None:
        svc = self.services.get(pick.service)
        t = pick.ticket
        if svc is None or not isinstance(t, _Ticket):
            return
        i = svc.index(t.name)
        if i is None:
            return
        if outcome is not None and not failed:
            svc.mean_out = mean_output(svc.mean_out, outcome.output_tokens)
        view = completed(svc.views[i], t.ticket, None if failed else latency_s, outcome)
        if failed:
            n = svc.fails.get(t.name, 0) + 1
            svc.fails[t.name] = n
            svc.oks[t.name] = 0
            if eject or n >= self.config.health.unhealthy_after:
                view = with_health(view, False)
        else:
            svc.fails[t.name] = 0
        svc.views[i] = view

    # -- health --------------------------------------------------------------------------------
    def health_result(self, service: str, name: str, ok: bool) -> None:
        svc = self.services.get(service)
        if svc is None:
            return
        i = svc.index(name)
        if i is None:
            return
        h = self.config.health
        if ok:
            svc.fails[name] = 0
            svc.oks[name] = svc.oks.get(name, 0) + 1
            if svc.oks[name] >= h.healthy_after:
                svc.views[i] = with_health(svc.views[i], True)
        else:
            svc.oks[name] = 0
            svc.fails[name] = svc.fails.get(name, 0) + 1
            if svc.fails[name] >= h.unhealthy_after:
                svc.views[i] = with_health(svc.views[i], False)

    def targets(self) -> list[tuple[str, str, str]]:
        return [(s, name, url) for s, svc in self.services.items() for name, url in
                svc.urls.items()]

    def metrics_targets(self) -> list[tuple[str, str, str]]:
        """(service, replica, URL of its metrics) of every generative replica to scrape."""
        return [(s, name, url + path) for s, svc in self.services.items()
                if svc.spec.generative and (path := svc.spec.metrics_path) is not None
                for name, url in svc.urls.items()]

    # -- introspection -------------------------------------------------------------------------
    def gauges(self) -> Iterator[ReplicaGauge]:
        for s, svc in self.services.items():
            for v in svc.views:
                yield ReplicaGauge(s, v.name, v.outstanding, v.healthy, v.weight,
                                   v.model.predict(1), v.model.samples)

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {}
        now = time.monotonic()
        for s, svc in self.services.items():
            out[s] = {
                "policy": svc.policy.name,
                "slo_ms": None if (slo := self.slo_s(svc.spec)) is None else slo * 1e3,
                "replicas": [{
                    "name": v.name, "url": svc.urls[v.name], "healthy": v.healthy,
                    "draining": v.name in svc.draining,
                    "weight": v.weight, "concurrency": v.concurrency,
                    "outstanding": v.outstanding,
                    "service_time_ms": round(v.model.predict(1) * 1e3, 3),
                    "samples": v.model.samples,
                    **describe_tokens(v.tokens, self.engines.fresh(s, v.name, now)),
                } for v in svc.views],
            }
            if svc.spec.generative:
                out[s]["api"] = "openai"  # type: ignore[index]
                out[s]["mean_output_tokens"] = round(svc.mean_out, 1)  # type: ignore[index]
        return out


async def health_loop(router: Router, session: aiohttp.ClientSession) -> None:
    """Probe every replica every ``health.interval_s``; see :meth:`Router.health_result`."""

    async def probe(service: str, name: str, url: str) -> None:
        h = router.config.health
        try:
            async with session.get(url + h.path,
                                   timeout=aiohttp.ClientTimeout(total=h.timeout_s)) as resp:
                await resp.read()
                ok = 200 <= resp.status < 300
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            ok = False
        router.health_result(service, name, ok)

    while True:
        await asyncio.gather(*(probe(*t) for t in router.targets()))
        await asyncio.sleep(router.config.health.interval_s)


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
