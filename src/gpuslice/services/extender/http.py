"""The extender over HTTP, as kube-scheduler calls it (``filterVerb``, ``prioritizeVerb``,
``bindVerb``, ``preemptVerb`` in deploy/'s scheduler configuration), with its metrics and
health, and the loop that follows the API server's watch into the state."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gpuslice.adapters.http.h2 import (
    AlpnSite,
    Dispatch,
)
from gpuslice.services.extender.flow import BINDS_IN_FLIGHT, FLOW_WAIT_S
from gpuslice.services.extender.loops import SETTLE_EVERY_S, Following, settle
from gpuslice.services.extender.metrics import ExtenderMetrics
from gpuslice.services.extender.requeue import nudging
from gpuslice.services.extender.state import ExtenderState
from gpuslice.services.extender.verbs import ExtenderVerbs
from gpuslice.services.heap import LongLivedHeap
from gpuslice.services.leader import LeaderLabel
from gpuslice.services.tls import (
    TLS_RELOAD_S,
    keep_renewed,
    verifies_clients,
)

MAX_BODY = 8 * 1024 * 1024
# the app's requests for a connection that chose HTTP/2 (serve's AlpnSite)
H2_DISPATCH = web.AppKey[Dispatch]("h2_dispatch")
# the label the leader puts on its own pod (value "leader"); deploy/'s Service selects it, so
# kube-scheduler's calls reach the replica that binds while both replicas are Ready
LEADER_LABEL = "gpuslice.io/extender-role"

log = logging.getLogger("gpuslice.extender")


def make_app(state: ExtenderState, metrics: ExtenderMetrics | None = None, *,
             client_auth: bool = False, binds_in_flight: int = BINDS_IN_FLIGHT,
             flow_wait_s: float = FLOW_WAIT_S) -> web.Application:
    """The extender's routes, handled by :class:`~.verbs.ExtenderVerbs` (see there for
    ``client_auth``, ``binds_in_flight`` and ``flow_wait_s``)."""
    verbs = ExtenderVerbs(state, metrics or ExtenderMetrics(state), client_auth=client_auth,
                          binds_in_flight=binds_in_flight, flow_wait_s=flow_wait_s)

    @web.middleware
    async def timed(request: web.Request, handler: Any) -> web.StreamResponse:
        return await verbs.timed(request, handler)

    app = web.Application(client_max_size=MAX_BODY, middlewares=[timed])
    for (method, path), handler in verbs.routes.items():
        app.router.add_route(method, path, handler)
    app[H2_DISPATCH] = verbs.over_h2
    app.on_cleanup.append(verbs.stop)
    app.cleanup_ctx.append(nudging(state, verbs.m.requeue_nudges))  # the leader's, serving
    return app


async def serve(state: ExtenderState, host: str, port: int, ssl_context: Any = None,
                resync_s: float = 300.0, ready: Callable[[int], None] | None = None,
                stop: asyncio.Event | None = None, tls_files: tuple[str, str] | None = None,
                tls_reload_s: float = TLS_RELOAD_S,
                leader_label: LeaderLabel | None = None,
                binds_in_flight: int | None = None,
                heap: LongLivedHeap | None = None,
                settle_every_s: float = SETTLE_EVERY_S) -> None:
    """Serve until ``stop`` is set (or until cancelled), following the API server's watch of
    pods and nodes, with a full re-read every ``resync_s`` as a safety net; with
    ``tls_files`` (the certificate and key ``ssl_context`` was made from), a renewed
    certificate is served from the next connection on (checked every ``tls_reload_s``). With
    ``leader_label`` (and an elector): the label follows leadership after each election
    step, on a task of its own (a slow or failing write holds up neither the election nor a
    call), so a label a previous container of the pod left is taken off after the first
    step unless that step won the Lease. With ``heap`` (the CLI's): every ``settle_every_s``
    what the process holds is moved out of Python's full collections
    (:class:`~gpuslice.services.heap.LongLivedHeap`), which otherwise stop every filter and
    bind under way while they scan the inventory and the ledger. On the way out: stop
    serving (binds under way finish), give the Lease up if we hold it, then take the label
    off."""
    app = make_app(state, client_auth=verifies_clients(ssl_context),
                   binds_in_flight=BINDS_IN_FLIGHT if binds_in_flight is None else
                   binds_in_flight)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    # over TLS, HTTP/2 for the clients that ask for it (kube-scheduler does: every call a
    # stream on one connection, no handshake per call), HTTP/1.1 for the others
    site: web.BaseSite = web.TCPSite(runner, host, port) if ssl_context is None else \
        AlpnSite(runner, host, port, ssl_context, app[H2_DISPATCH], MAX_BODY)
    await site.start()
    if ready is not None:
        addresses = runner.addresses
        ready(int(addresses[0][1]) if addresses else port)
    loops = Following(state, resync_s)

    async def stopped() -> None:
        await (stop or asyncio.Event()).wait()  # without a stop: until cancelled

    tasks = [asyncio.create_task(loops.follow()), asyncio.create_task(stopped())]
    if state.elector is not None:
        tasks.append(asyncio.create_task(loops.elect()))
        if leader_label is not None:
            tasks.append(asyncio.create_task(loops.mark(leader_label)))
    if ssl_context is not None and tls_files is not None:
        tasks.append(asyncio.create_task(keep_renewed(ssl_context, *tls_files, log,
                                                      tls_reload_s)))
    if heap is not None:
        tasks.append(asyncio.create_task(settle(heap, settle_every_s)))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()  # a loop that ended on an error: raise it
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()  # no new calls; binds under way finish their writes
        if state.elector is not None:
            state.elector.release()  # after the last bind: a standby takes over at once
            if leader_label is not None:  # the Service leaves us out (a sync under way first)
                leader_label.release()
        close = getattr(state.api, "close", None)  # the real client's background watches
        if callable(close):
            close()
