"""The extender over HTTP, as kube-scheduler calls it (``filterVerb``, ``prioritizeVerb``,
``bindVerb``, ``preemptVerb`` in deploy/'s scheduler configuration), with its metrics and
health, and the loop that follows the API server's watch into the state."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any, Protocol, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gpuslice.adapters.http.h2 import (
    AlpnSite,
    Dispatch,
    H2Answer,
    H2Request,
    H2Server,
    aiohttp_answer,
    answer_error,
)
from gpuslice.adapters.kube.ports import KubePort
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.services.extender.flow import BINDS_IN_FLIGHT, FLOW_WAIT_S, BindFlow
from gpuslice.services.extender.metrics import ExtenderMetrics
from gpuslice.services.extender.placement import OUTSIDE
from gpuslice.services.extender.requeue import nudging
from gpuslice.services.extender.state import BindWrite, ExtenderState
from gpuslice.services.extender.wire import (
    answer,
    bad,
    node_names,
    pod_name,
    read_json,
    scheduled_pod,
    victims_of,
)
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


class AsyncBindPort(Protocol):
    """The Binding write, awaited on the event loop (:class:`~gpuslice.adapters.kube.aio.
    AsyncBinder` for a real API server); the errors of ``KubePort.bind``."""

    async def bind(self, namespace: str, name: str, uid: str, node: str,
                   annotations: Mapping[str, str] | None = None,
                   resource_version: str | None = None) -> None: ...

    async def close(self) -> None: ...


class OnThreads:
    """An :class:`AsyncBindPort` over a synchronous API port: its bind on ``pool``."""

    def __init__(self, api: KubePort, pool: Executor) -> None:
        self.api, self.pool = api, pool

    async def bind(self, namespace: str, name: str, uid: str, node: str,
                   annotations: Mapping[str, str] | None = None,
                   resource_version: str | None = None) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self.pool, self.api.bind, namespace, name, uid, node, annotations,
            resource_version)

    async def close(self) -> None:
        return None


# -- HTTP ------------------------------------------------------------------------------------


# the scheduler's verbs: with client authentication, only a certified client may call them
VERBS = ("filter", "prioritize", "bind", "preempt")


def _client_certified(request: web.Request) -> bool:
    """Whether the connection's client presented a certificate the TLS layer verified (with
    ``CERT_OPTIONAL`` one that does not verify fails the handshake; none gives no peercert)."""
    transport = request.transport
    return transport is not None and bool(transport.get_extra_info("peercert"))


def make_app(state: ExtenderState, metrics: ExtenderMetrics | None = None, *,
             client_auth: bool = False, binds_in_flight: int = BINDS_IN_FLIGHT,
             flow_wait_s: float = FLOW_WAIT_S) -> web.Application:
    """The extender's routes. ``client_auth``: the scheduler's verbs answer only a client that
    presented a certificate the TLS layer verified (see :func:`tls_context`); health, readiness
    and metrics stay open to the kubelet's probes, which present none. A filter waits (at most
    ``flow_wait_s``) while ``binds_in_flight`` binds are under way (0: never;
    :mod:`~gpuslice.services.extender.flow`)."""
    from concurrent.futures import ThreadPoolExecutor

    m = metrics or ExtenderMetrics(state)
    flow = BindFlow(binds_in_flight, flow_wait_s)
    binds = ThreadPoolExecutor(BIND_THREADS, thread_name_prefix="bind")
    # the Binding written from the event loop: the real client's aiohttp writer, else (an
    # in-process API) its own bind on the bind threads
    opener = getattr(state.api, "async_binder", None)
    writer: AsyncBindPort = opener() if callable(opener) else OnThreads(state.api, binds)

    @web.middleware
    async def timed(request: web.Request, handler: Any) -> web.StreamResponse:
        verb = request.path.strip("/")
        if verb not in VERBS:
            return await handler(request)  # type: ignore[no-any-return]
        if client_auth and not _client_certified(request):
            m.unauthenticated.labels(verb).inc()
            return bad(f"{verb}: a client certificate signed by the extender's --client-ca "
                        "is required (kube-scheduler's tlsConfig certFile/keyFile)", 403)
        m.arrived_on(request.transport)
        t0 = time.perf_counter()
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except web.HTTPBadRequest:
            m.errors.labels(verb).inc()
            raise
        finally:
            m.seconds.labels(verb).observe(time.perf_counter() - t0)

    async def filter_(request: web.Request) -> web.Response:
        args = await read_json(request)
        waited = await flow.room()  # the answer is made from the ledger as it is after it
        if waited:
            m.filter_waits.inc()
            m.filter_wait_seconds.inc(waited)
        try:
            names, objects = node_names(args)
            pod = scheduled_pod(args)
            stale = state.stale_holders(pod, names)
            if stale:
                freed = await asyncio.get_running_loop().run_in_executor(
                    binds, state.verify_held, stale)
                m.stale_freed.inc(freed)
                if freed:  # victims the watch had not yet seen go (placement.stale_holders)
                    nominated = (pod.get("status") or {}).get("nominatedNodeName") or ""
                    log.info("filter: %d share(s) of deleted pods given back for %s "
                             "(nominated: %s)", freed, pod_name(pod), nominated or "not yet",
                             extra={"event": "stale_freed", "freed": freed,
                                    "nominated": nominated})
            keep, failed = state.filter(pod, names)
            state.remember(pod)
            state.requeue_note(pod, names, bool(keep))  # tried again once room is freed
            m.filtered(len(keep), failed)
            hopeless = state.unresolvable(pod, list(failed))
            if keep:
                state.window_hit(pod)
            elif failed and state.outside_window(pod, names):
                hopeless = set(failed)  # no eviction while another node has room
                failed = {n: f"{r}; {OUTSIDE}" for n, r in failed.items()}
        except GpusliceError as exc:
            m.errors.labels("filter").inc()
            return answer({"Nodes": None, "NodeNames": None, "FailedNodes": {},
                            "FailedAndUnresolvableNodes": {}, "Error": str(exc)})
        result: dict[str, Any] = {
            "FailedNodes": {n: r for n, r in failed.items() if n not in hopeless},
            "FailedAndUnresolvableNodes": {n: r for n, r in failed.items() if n in hopeless},
            "Error": ""}
        if objects is None:
            result.update(NodeNames=keep, Nodes=None)
        else:
            result.update(NodeNames=None,
                          Nodes={"apiVersion": "v1", "kind": "NodeList",
                                 "items": [objects[n] for n in keep]})
        return answer(result)

    async def prioritize(request: web.Request) -> web.Response:
        args = await read_json(request)
        try:
            names, _ = node_names(args)
            scores = state.prioritize(scheduled_pod(args), names)
        except GpusliceError as exc:
            m.errors.labels("prioritize").inc()
            return bad(str(exc))
        return answer([{"Host": h, "Score": s} for h, s in scores])

    async def bind(request: web.Request) -> web.Response:
        args = await read_json(request)
        fields = {}
        for key in ("PodName", "PodNamespace", "PodUID", "Node"):
            value = args.get(key)
            if not isinstance(value, str) or not value:
                m.errors.labels("bind").inc()
                return answer({"Error": f"{key}: expected a non-empty string, got "
                                         f"{value!r:.80}"})
            fields[key] = value
        ns, name, uid, node = (fields["PodNamespace"], fields["PodName"], fields["PodUID"],
                               fields["Node"])
        # reserve here, on the loop, before the scheduler's next filter, and write the
        # Binding (carrying the assignment) from the loop too. Binds to one node run
        # concurrently: the device plugin matches the kubelet's Allocate calls to waiting
        # assignments in the order the kubelet sees their pods bound (their resourceVersions),
        # whatever order the extender wrote them in
        loop = asyncio.get_running_loop()
        held = state.hold(ns, name, uid, node)
        flow.started()
        try:
            w = state.start_held(ns, name, uid, node, held) if held is not None else None
            if w is not None:
                error = await write_held(w)
                if error is None:  # the filter's copy of the pod was stale: the whole bind
                    # on a thread, which reads the pod and places it as read
                    error = await loop.run_in_executor(binds, state.bind, ns, name, uid, node)
            else:  # not that simple: the whole bind on a thread, with the pod the hold
                # placed when there is one, else read now
                read = state.held_pod(ns, name) if held is not None else None
                from_filter = read is not None
                if read is None:
                    read = await loop.run_in_executor(binds, state.read_pod, ns, name)
                error = await loop.run_in_executor(binds, state.bind, ns, name, uid, node,
                                                   held, read, from_filter)
        except GpusliceError as exc:
            error = f"pod {ns}/{name}: {exc}; retry"
        finally:
            flow.finished()
        m.binds.labels("refused" if error else "bound").inc()
        resp = answer({"Error": error})
        if state.elector is not None and not state.elector.leader:
            send_away(request, resp)
        return resp

    sent_away: set[asyncio.Task[None]] = set()

    def send_away(request: web.Request, resp: web.Response) -> None:
        """A follower has refused a bind: the client is told to connect again, so that its
        next calls go through the Service to the leader. Without it, kube-scheduler keeps
        its kept-alive connection (one HTTP/2 connection carries all its calls) on the replica
        the Service chose when it connected, kube-proxy keeps an established connection on
        its backend whatever the Service selects later, and every bind is refused for as
        long as the connection lives once leadership has moved (found by the chaos soak:
        benchmarks/chaos.py). HTTP/1.1: ``Connection: close`` on this answer; HTTP/2: new
        streams refused (the client retries them on a new connection), then a GOAWAY once
        the answers under way on the connection are sent."""
        resp.force_close()
        get_protocol = getattr(request.transport, "get_protocol", None)
        conn = get_protocol() if callable(get_protocol) else None
        if isinstance(conn, H2Server) and not conn.draining and not conn.closed:
            task = asyncio.get_running_loop().create_task(conn.shutdown(SEND_AWAY_S))
            sent_away.add(task)
            task.add_done_callback(sent_away.discard)
            log.info("bind refused as a follower: the client is sent to connect again",
                     extra={"event": "sent-away"})

    async def write_held(w: BindWrite) -> str | None:
        t0 = time.perf_counter()
        failed: GpusliceError | None = None
        try:
            await writer.bind(w.namespace, w.name, w.uid, w.node, w.annotations(),
                              w.resource_version)
        except GpusliceError as exc:
            failed = exc
        except BaseException:  # cancelled (the server stopping): the outcome is unknown
            state.finish_held(w, GpusliceError("the Binding write was cancelled"))
            raise
        m.bind_write.observe(time.perf_counter() - t0)
        return state.finish_held(w, failed)

    async def preempt(request: web.Request) -> web.Response:
        args = await read_json(request)
        try:
            victims, pdb = victims_of(args)
            kept = await asyncio.get_running_loop().run_in_executor(
                binds, state.preempt, scheduled_pod(args), victims, pdb)
        except GpusliceError as exc:
            m.errors.labels("preempt").inc()
            return bad(str(exc))
        return answer({"NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": n}
            for node, (uids, n) in kept.items()}})

    async def healthz(_: web.Request) -> web.Response:  # liveness: every replica passes
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        # readiness is health, not leadership: every replica that serves from a full read of
        # the cluster is Ready (a Deployment shows 2/2, rollouts and `helm --wait` finish).
        # The Service reaches the leader alone through the label on the leader's pod
        # (services.leader.LeaderLabel); a follower that gets a call anyway answers filter
        # and prioritize and refuses binds
        if not state.synced:
            return web.Response(status=503, text="not ready: nodes and pods not read yet")
        el = state.elector
        if el is None:
            return web.Response(text="ok")
        return web.Response(text="ok: leader" if el.leader else
                            f"ok: follower (Lease {el.namespace}/{el.name}: the leader binds)")

    async def metrics_(_: web.Request) -> web.Response:
        return web.Response(body=m.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=MAX_BODY, middlewares=[timed])
    routes: dict[tuple[str, str], Any] = {
        ("POST", "/filter"): filter_, ("POST", "/prioritize"): prioritize,
        ("POST", "/bind"): bind, ("POST", "/preempt"): preempt, ("GET", "/healthz"): healthz,
        ("GET", "/readyz"): readyz, ("GET", "/metrics"): metrics_}
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)

    async def over_h2(method: str, path: str, body: bytes, transport: Any) -> H2Answer:
        """A request that came over HTTP/2 (adapters.http.h2), through the same handlers
        and middleware as over HTTP/1.1."""
        handler = routes.get((method, path))
        if handler is None:
            known = any(p == path for _, p in routes)
            return H2Answer(405 if known else 404, "text/plain; charset=utf-8",
                            b"405: Method Not Allowed" if known else b"404: Not Found")
        try:
            resp = await timed(cast(web.Request, H2Request(method, path, body, transport)),
                               handler)
        except web.HTTPException as exc:
            return answer_error(exc)
        return aiohttp_answer(resp)

    app[H2_DISPATCH] = over_h2

    async def stop_binds(_: web.Application) -> None:
        binds.shutdown(wait=True)  # binds under way finish their writes
        await writer.close()

    app.on_cleanup.append(stop_binds)
    app.cleanup_ctx.append(nudging(state, m.requeue_nudges))  # the leader's, while serving
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
