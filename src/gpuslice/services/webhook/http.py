"""The webhook over HTTPS, as kube-apiserver calls it (``POST /mutate``, the path of the
MutatingWebhookConfiguration's clientConfig), with health, readiness and metrics, and the
loop that reads the nodes' GPUs again every ``resync_s``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from gpuslice.core.admission import Options
from gpuslice.services.tls import TLS_RELOAD_S, keep_renewed
from gpuslice.services.webhook.fleet import FleetView
from gpuslice.services.webhook.review import Gate, review_of

# the API server sends the whole pod; a pod object is at most 1.5 MiB in etcd, with headroom
MAX_BODY = 4 * 1024 * 1024
RESULTS = ("mutated", "unchanged", "refused", "bad-review", "error")
EMPTY_REREAD_S = 1.0  # a review finding no GPUs reads the nodes again, at most this often

log = logging.getLogger("gpuslice.webhook")


class WebhookMetrics:
    """``gpuslice_webhook_reviews_total{result}`` and the GPUs of the last node read."""

    def __init__(self, view: FleetView) -> None:
        self.registry = CollectorRegistry()
        self.reviews = Counter("gpuslice_webhook_reviews", "Admission reviews answered, by "
                               "result: mutated, unchanged, refused, bad-review (a body that "
                               "is not an AdmissionReview v1), error (answered 500: the API "
                               "server applies the failurePolicy)", ["result"],
                               registry=self.registry)
        for r in RESULTS:
            self.reviews.labels(r)
        gpus = Gauge("gpuslice_webhook_fleet_gpus", "GPUs of the cluster the webhook judges "
                     "pods against (the last read of the nodes' inventories), by model",
                     ["model"], registry=self.registry)
        failed = Gauge("gpuslice_webhook_node_reads_failed", "Node reads that failed since "
                       "the start (the webhook answers from the last read)",
                       registry=self.registry)
        failed.set_function(lambda: view.failures)
        self._gpus, self._view = gpus, view

    def render(self) -> bytes:
        self._gpus.clear()
        for m in self._view.fleet.models:
            self._gpus.labels(m.name).set(m.gpus)
        return bytes(generate_latest(self.registry))


def make_app(view: FleetView, opts: Options,
             metrics: WebhookMetrics | None = None, gate: Gate | None = None,
             ) -> web.Application:
    m = metrics or WebhookMetrics(view)
    reading = asyncio.Lock()

    async def fresh() -> None:
        """Read the nodes first when the fleet is empty (at most one read a second, shared
        by the reviews that wait for it)."""
        if not view.due(EMPTY_REREAD_S):
            return
        async with reading:
            if view.due(EMPTY_REREAD_S):
                await asyncio.get_running_loop().run_in_executor(None, view.refresh)

    async def mutate(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except (web.HTTPRequestEntityTooLarge, web.RequestPayloadError, ConnectionError) as exc:
            m.reviews.labels("bad-review").inc()
            return web.Response(status=400, text=f"request body unreadable: {exc}")
        await fresh()
        try:
            if gate is None:
                doc, result = review_of(body, view.fleet, opts)
            else:  # the gate reads the API server: off the event loop
                doc, result = await asyncio.get_running_loop().run_in_executor(
                    None, review_of, body, view.fleet, opts, gate)
        except Exception:  # a fault of ours: 500, and the API server applies failurePolicy
            m.reviews.labels("error").inc()
            log.exception("review failed", extra={"event": "review-error"})
            return web.Response(status=500, text="gpuslice webhook: internal error (logged)")
        m.reviews.labels(result).inc()
        if result in ("refused", "bad-review"):
            resp = doc["response"]
            log.info("%s: %s", result, resp["status"]["message"],
                     extra={"event": result, "uid": resp["uid"]})
        return web.json_response(doc)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        if view.ready:
            return web.Response(text="ok")
        return web.Response(status=503, text="not ready: the nodes have not been read yet"
                            + (f" ({view.last_error})" if view.last_error else ""))

    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(body=m.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/mutate", mutate)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)
    return app


async def serve(view: FleetView, opts: Options, host: str, port: int, ssl_context: Any,
                *, resync_s: float = 30.0, ready: Callable[[int], None] | None = None,
                stop: asyncio.Event | None = None, tls_files: tuple[str, str] | None = None,
                tls_reload_s: float = TLS_RELOAD_S, gate: Gate | None = None) -> None:
    """Serve until ``stop`` is set (or cancelled), reading the nodes every ``resync_s``; a
    renewed certificate (``tls_files``) is served from the next connection on."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, view.refresh)  # ready at once when the API answers
    runner = web.AppRunner(make_app(view, opts, gate=gate), access_log=None,
                           handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    if ready is not None:
        addresses = runner.addresses
        ready(int(addresses[0][1]) if addresses else port)

    async def follow() -> None:
        while True:
            await asyncio.sleep(resync_s if view.fleet.models else min(resync_s, 2.0))
            await loop.run_in_executor(None, view.refresh)

    tasks = [asyncio.create_task(follow()),
             asyncio.create_task((stop or asyncio.Event()).wait())]
    if ssl_context is not None and tls_files is not None:
        tasks.append(asyncio.create_task(keep_renewed(ssl_context, *tls_files, log,
                                                      tls_reload_s)))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()
