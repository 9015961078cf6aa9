"""The extender over HTTP, as kube-scheduler calls it (``filterVerb``, ``prioritizeVerb``,
``bindVerb``, ``preemptVerb`` in deploy/'s scheduler configuration), with its metrics and
health, and the loop that follows the API server's watch into the state."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gpuslice.adapters.http.h2 import (
    AlpnSite,
    Dispatch,
)
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.services.extender.flow import BINDS_IN_FLIGHT, FLOW_WAIT_S
from gpuslice.services.extender.metrics import ExtenderMetrics
from gpuslice.services.extender.requeue import nudging
from gpuslice.services.extender.state import ExtenderState
from gpuslice.services.extender.verbs import ExtenderVerbs
from gpuslice.services.heap import LongLivedHeap
from gpuslice.services.leader import LeaderLabel

MAX_BODY = 8 * 1024 * 1024
# the app's requests for a connection that chose HTTP/2 (serve's AlpnSite)
H2_DISPATCH = web.AppKey[Dispatch]("h2_dispatch")
BIND_THREADS = 8  # binds writing to the API server at once
SETTLE_EVERY_S = 1.0  # how often what survived is moved out of full collections (heap)
# the longest one watch call waits for events: it runs on a thread a stopping process joins,
# so this bounds how long a SIGTERM waits for it (each call only hands over what the
# watches queued meanwhile)
WATCH_WAIT_S = 1.0
# how often the serving certificate's files are read for a renewal (cert-manager renews into
# the Secret, the kubelet updates the mounted files; new connections get the new certificate)
TLS_RELOAD_S = 60.0
# the label the leader puts on its own pod (value "leader"); deploy/'s Service selects it, so
# kube-scheduler's calls reach the replica that binds while both replicas are Ready
LEADER_LABEL = "gpuslice.io/extender-role"
# a follower that refused a bind sends the client away from its connection (send_away): the
# answers under way on it get this long to finish before the GOAWAY
SEND_AWAY_S = 30.0

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


def tls_context(cert: str | None, key: str | None, client_ca: str | None) -> Any:
    """The server's TLS context (None for plain HTTP). With ``client_ca`` (mutual TLS): a
    client certificate that does not chain to it fails the handshake, and the scheduler's
    verbs answer 403 to a client that presented none (:func:`make_app`'s ``client_auth``;
    ``CERT_OPTIONAL`` rather than ``CERT_REQUIRED`` so that the kubelet's probes, which
    present none, still reach /healthz and /readyz). A client's certificate must allow client
    authentication (extendedKeyUsage clientAuth) when it names its uses."""
    import ssl

    if cert is None and key is None:
        if client_ca is not None:
            raise ValidationError("--client-ca", "--tls-cert and --tls-key as well", client_ca)
        return None
    if cert is None or key is None:
        given, other = ("--tls-cert", "--tls-key") if key is None else ("--tls-key",
                                                                        "--tls-cert")
        raise ValidationError(other, f"a PEM file to go with {given}", None)
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--client-ca", client_ca)):
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ValidationError(flag, "a readable PEM file", f"{path}: "
                                  f"{exc.strerror or exc}") from None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValidationError("--tls-cert/--tls-key", "a PEM certificate and its private key",
                              f"{cert}, {key}: {exc}") from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValidationError("--client-ca", "a PEM file of CA certificates",
                                  f"{client_ca}: {exc}") from None
        ctx.verify_mode = ssl.CERT_OPTIONAL
    if client_ca is not None and not ctx.get_ca_certs():
        raise ValidationError("--client-ca", "a PEM file holding at least one CA certificate",
                              client_ca)
    return ctx


def verifies_clients(ssl_context: Any) -> bool:
    """Whether a context from :func:`tls_context` checks client certificates."""
    import ssl

    return ssl_context is not None and ssl_context.verify_mode != ssl.CERT_NONE


def certificate_digest(cert: str, key: str) -> bytes:
    """What :func:`reload_certificate` compares: the certificate and key files' contents."""
    with open(cert, "rb") as c, open(key, "rb") as k:
        return hashlib.sha256(c.read() + b"\0" + k.read()).digest()


def reload_certificate(ssl_context: Any, cert: str, key: str, seen: bytes) -> bytes:
    """Load ``cert`` and ``key`` into ``ssl_context`` again when their contents differ from
    ``seen`` (a :func:`certificate_digest`); returns the digest now served. Connections made
    from then on get the new certificate, those open keep theirs. A pair that does not load
    (a half-written renewal) raises, and the old certificate stays."""
    import ssl

    now = certificate_digest(cert, key)
    if now != seen:
        # first on a context of its own: a failed load can leave a context holding the new
        # certificate without its key, and then no handshake would succeed
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        ssl_context.load_cert_chain(cert, key)
    return now


API_WAIT_LOG_S = 30.0  # how often an outage of the API server is logged while it lasts
STANDBY_S = 1.0  # how often a standby replica reads the Lease (one GET)


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
    loop = asyncio.get_running_loop()

    stepped = asyncio.Event()  # an election step ended: the label follows leadership

    async def elect() -> None:
        assert state.elector is not None
        while True:
            try:
                await loop.run_in_executor(None, state.elector.step)
            except GpusliceError as exc:
                state.elector.leader = False
                state.problems.append(f"leader election: {exc}")
            stepped.set()
            # the leader renews every third of the lease; a standby looks every STANDBY_S,
            # so that a Lease given up on SIGTERM (a rolling update) is taken within seconds
            await asyncio.sleep(state.elector.duration_s / 3 if state.elector.leader
                                else min(STANDBY_S, state.elector.duration_s / 3))

    async def mark(label: LeaderLabel) -> None:
        el = state.elector
        assert el is not None
        while True:  # after each step (a failed write is tried again after the next one);
            # the first comes at once: a stale label from a previous container of the pod
            # is taken off then, unless that step won the Lease
            await stepped.wait()
            stepped.clear()
            await loop.run_in_executor(None, label.sync, el.leader)

    def follow_once(since: str, stale: bool, last: float) -> tuple[str, bool]:
        """The next batch of watch events applied (a node change re-reads everything), after
        a re-read of everything when the watch broke or ``resync_s`` has passed since
        ``last``; whether it re-read. Blocking: on a thread."""
        events, since = state.api.watch(since, 0.0 if stale else WATCH_WAIT_S)
        reread = stale or time.monotonic() - last >= resync_s
        if reread:
            state.rebuild()
        if events:
            state.apply_all(events)
        return since, reread

    async def follow() -> None:
        since = ""
        stale = False  # events were missed (a broken watch): re-read before following again
        last = time.monotonic()
        backoff_s = 1.0
        failing: float | None = None  # since when the API server has not answered
        said = 0.0  # when that was last logged
        while True:
            # an outage of the API server leaves filter and prioritize answering from the
            # last view (binds fail on their own); the loop retries with backoff, never exits
            try:  # one hand-over to a thread per batch: the watch, a re-read, the events
                since, reread = await loop.run_in_executor(None, follow_once, since, stale,
                                                           last)
                if reread:
                    stale, last = False, time.monotonic()
                backoff_s = 1.0
                if failing is not None:
                    log.info("the API server answers again after %.0f s",
                             time.monotonic() - failing, extra={"event": "api-back"})
                    failing = None
            except GpusliceError as exc:  # start the watch again, then re-read everything
                state.problems.append(f"watch: {exc}")
                now = time.monotonic()
                if failing is None or now - said >= API_WAIT_LOG_S:
                    # said at once and every API_WAIT_LOG_S while it lasts: an extender that
                    # cannot reach the API server is not Ready, and its log says why
                    failing = now if failing is None else failing
                    said = now
                    log.warning("waiting for the API server (%.0f s so far; %s until it "
                                "answers): %s", now - failing, "not ready" if not
                                state.synced else "serving from the last view", exc,
                                extra={"event": "api-waiting"})
                since, stale = "", True
                await asyncio.sleep(backoff_s)
                backoff_s = min(30.0, 2 * backoff_s)

    async def renew(cert: str, key: str) -> None:
        import ssl

        try:
            seen = certificate_digest(cert, key)
        except OSError:  # loaded a moment ago: gone meanwhile, read again next time
            seen = b""
        while True:
            await asyncio.sleep(tls_reload_s)
            try:
                now = reload_certificate(ssl_context, cert, key, seen)
            except (OSError, ssl.SSLError) as exc:  # tried again next time
                log.warning("serving certificate %s not reloaded: %s", cert, exc,
                            extra={"event": "tls-reload-failed"})
                continue
            if now != seen:
                log.info("serving the renewed certificate %s", cert,
                         extra={"event": "tls-reloaded"})
            seen = now

    async def stopped() -> None:
        await (stop or asyncio.Event()).wait()  # without a stop: until cancelled

    async def settle(h: LongLivedHeap) -> None:
        while True:
            await asyncio.sleep(settle_every_s)
            h.settled()

    tasks = [asyncio.create_task(follow()), asyncio.create_task(stopped())]
    if state.elector is not None:
        tasks.append(asyncio.create_task(elect()))
        if leader_label is not None:
            tasks.append(asyncio.create_task(mark(leader_label)))
    if ssl_context is not None and tls_files is not None:
        tasks.append(asyncio.create_task(renew(*tls_files)))
    if heap is not None:
        tasks.append(asyncio.create_task(settle(heap)))
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
