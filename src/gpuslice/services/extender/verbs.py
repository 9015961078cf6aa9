"""The extender's HTTP handlers: the verbs kube-scheduler calls (``filterVerb``,
``prioritizeVerb``, ``bindVerb``, ``preemptVerb``), timed and guarded by one middleware, with
health, readiness and metrics, answered alike over HTTP/1.1 and HTTP/2 (:mod:`.http` makes the
app of them and serves it)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gpuslice.adapters.http.h2 import H2Answer, H2Request, H2Server, aiohttp_answer, answer_error
from gpuslice.adapters.kube.ports import KubePort
from gpuslice.core.errors import GpusliceError
from gpuslice.services.extender.flow import BindFlow
from gpuslice.services.extender.metrics import ExtenderMetrics
from gpuslice.services.extender.placement import OUTSIDE
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

BIND_THREADS = 8  # binds writing to the API server at once
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


class ExtenderVerbs:
    """The handlers of one extender app, over ``state``. ``client_auth``: the scheduler's verbs
    answer only a client that presented a certificate the TLS layer verified; health,
    readiness and metrics stay open to the kubelet's probes, which present none. A filter
    waits (at most ``flow_wait_s``) while ``binds_in_flight`` binds are under way (0: never;
    :mod:`~gpuslice.services.extender.flow`)."""

    def __init__(self, state: ExtenderState, metrics: ExtenderMetrics, *, client_auth: bool,
                 binds_in_flight: int, flow_wait_s: float) -> None:
        self.state, self.m, self.client_auth = state, metrics, client_auth
        self.flow = BindFlow(binds_in_flight, flow_wait_s)
        self.binds = ThreadPoolExecutor(BIND_THREADS, thread_name_prefix="bind")
        # the Binding written from the event loop: the real client's aiohttp writer, else (an
        # in-process API) its own bind on the bind threads
        opener = getattr(state.api, "async_binder", None)
        self.writer: AsyncBindPort = opener() if callable(opener) else \
            OnThreads(state.api, self.binds)
        self.sent_away: set[asyncio.Task[None]] = set()
        self.routes: dict[tuple[str, str], Any] = {
            ("POST", "/filter"): self.filter_, ("POST", "/prioritize"): self.prioritize,
            ("POST", "/bind"): self.bind, ("POST", "/preempt"): self.preempt,
            ("GET", "/healthz"): self.healthz, ("GET", "/readyz"): self.readyz,
            ("GET", "/metrics"): self.metrics_}

    async def timed(self, request: web.Request, handler: Any) -> web.StreamResponse:
        verb = request.path.strip("/")
        if verb not in VERBS:
            return await handler(request)  # type: ignore[no-any-return]
        if self.client_auth and not _client_certified(request):
            self.m.unauthenticated.labels(verb).inc()
            return bad(f"{verb}: a client certificate signed by the extender's --client-ca "
                        "is required (kube-scheduler's tlsConfig certFile/keyFile)", 403)
        self.m.arrived_on(request.transport)
        t0 = time.perf_counter()
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except web.HTTPBadRequest:
            self.m.errors.labels(verb).inc()
            raise
        finally:
            self.m.seconds.labels(verb).observe(time.perf_counter() - t0)

    async def filter_(self, request: web.Request) -> web.Response:
        args = await read_json(request)
        waited = await self.flow.room()  # the answer is made from the ledger as it is after it
        if waited:
            self.m.filter_waits.inc()
            self.m.filter_wait_seconds.inc(waited)
        try:
            names, objects = node_names(args)
            pod = scheduled_pod(args)
            stale = self.state.stale_holders(pod, names)
            if stale:
                freed = await asyncio.get_running_loop().run_in_executor(
                    self.binds, self.state.verify_held, stale)
                self.m.stale_freed.inc(freed)
                if freed:  # victims the watch had not yet seen go (placement.stale_holders)
                    nominated = (pod.get("status") or {}).get("nominatedNodeName") or ""
                    log.info("filter: %d share(s) of deleted pods given back for %s "
                             "(nominated: %s)", freed, pod_name(pod), nominated or "not yet",
                             extra={"event": "stale_freed", "freed": freed,
                                    "nominated": nominated})
            keep, failed = self.state.filter(pod, names)
            self.state.remember(pod)
            self.state.requeue_note(pod, names, bool(keep))  # tried again once room is freed
            self.m.filtered(len(keep), failed)
            hopeless = self.state.unresolvable(pod, list(failed))
            if keep:
                self.state.window_hit(pod)
            elif failed and self.state.outside_window(pod, names):
                hopeless = set(failed)  # no eviction while another node has room
                failed = {n: f"{r}; {OUTSIDE}" for n, r in failed.items()}
        except GpusliceError as exc:
            self.m.errors.labels("filter").inc()
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

    async def prioritize(self, request: web.Request) -> web.Response:
        args = await read_json(request)
        try:
            names, _ = node_names(args)
            scores = self.state.prioritize(scheduled_pod(args), names)
        except GpusliceError as exc:
            self.m.errors.labels("prioritize").inc()
            return bad(str(exc))
        return answer([{"Host": h, "Score": s} for h, s in scores])

    async def bind(self, request: web.Request) -> web.Response:
        args = await read_json(request)
        fields = {}
        for key in ("PodName", "PodNamespace", "PodUID", "Node"):
            value = args.get(key)
            if not isinstance(value, str) or not value:
                self.m.errors.labels("bind").inc()
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
        held = self.state.hold(ns, name, uid, node)
        self.flow.started()
        try:
            w = self.state.start_held(ns, name, uid, node, held) if held is not None else None
            if w is not None:
                error = await self.write_held(w)
                if error is None:  # the filter's copy of the pod was stale: the whole bind
                    # on a thread, which reads the pod and places it as read
                    error = await loop.run_in_executor(self.binds, self.state.bind, ns, name,
                                                       uid, node)
            else:  # not that simple: the whole bind on a thread, with the pod the hold
                # placed when there is one, else read now
                read = self.state.held_pod(ns, name) if held is not None else None
                from_filter = read is not None
                if read is None:
                    read = await loop.run_in_executor(self.binds, self.state.read_pod, ns, name)
                error = await loop.run_in_executor(self.binds, self.state.bind, ns, name, uid, node,
                                                   held, read, from_filter)
        except GpusliceError as exc:
            error = f"pod {ns}/{name}: {exc}; retry"
        finally:
            self.flow.finished()
        self.m.binds.labels("refused" if error else "bound").inc()
        resp = answer({"Error": error})
        if self.state.elector is not None and not self.state.elector.leader:
            self.send_away(request, resp)
        return resp

    def send_away(self, request: web.Request, resp: web.Response) -> None:
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
            self.sent_away.add(task)
            task.add_done_callback(self.sent_away.discard)
            log.info("bind refused as a follower: the client is sent to connect again",
                     extra={"event": "sent-away"})

    async def write_held(self, w: BindWrite) -> str | None:
        t0 = time.perf_counter()
        failed: GpusliceError | None = None
        try:
            await self.writer.bind(w.namespace, w.name, w.uid, w.node, w.annotations(),
                              w.resource_version)
        except GpusliceError as exc:
            failed = exc
        except BaseException:  # cancelled (the server stopping): the outcome is unknown
            self.state.finish_held(w, GpusliceError("the Binding write was cancelled"))
            raise
        self.m.bind_write.observe(time.perf_counter() - t0)
        return self.state.finish_held(w, failed)

    async def preempt(self, request: web.Request) -> web.Response:
        args = await read_json(request)
        try:
            victims, pdb = victims_of(args)
            kept = await asyncio.get_running_loop().run_in_executor(
                self.binds, self.state.preempt, scheduled_pod(args), victims, pdb)
        except GpusliceError as exc:
            self.m.errors.labels("preempt").inc()
            return bad(str(exc))
        return answer({"NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": n}
            for node, (uids, n) in kept.items()}})

    async def healthz(self, _: web.Request) -> web.Response:  # liveness: every replica passes
        return web.Response(text="ok")

    async def readyz(self, _: web.Request) -> web.Response:
        # readiness is health, not leadership: every replica that serves from a full read of
        # the cluster is Ready (a Deployment shows 2/2, rollouts and `helm --wait` finish).
        # The Service reaches the leader alone through the label on the leader's pod
        # (services.leader.LeaderLabel); a follower that gets a call anyway answers filter
        # and prioritize and refuses binds
        if not self.state.synced:
            return web.Response(status=503, text="not ready: nodes and pods not read yet")
        el = self.state.elector
        if el is None:
            return web.Response(text="ok")
        return web.Response(text="ok: leader" if el.leader else
                            f"ok: follower (Lease {el.namespace}/{el.name}: the leader binds)")

    async def metrics_(self, _: web.Request) -> web.Response:
        return web.Response(body=self.m.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def over_h2(self, method: str, path: str, body: bytes, transport: Any) -> H2Answer:
        """A request that came over HTTP/2 (adapters.http.h2), through the same handlers
        and middleware as over HTTP/1.1."""
        handler = self.routes.get((method, path))
        if handler is None:
            known = any(p == path for _, p in self.routes)
            return H2Answer(405 if known else 404, "text/plain; charset=utf-8",
                            b"405: Method Not Allowed" if known else b"404: Not Found")
        try:
            resp = await self.timed(cast(web.Request, H2Request(method, path, body, transport)),
                               handler)
        except web.HTTPException as exc:
            return answer_error(exc)
        return aiohttp_answer(resp)

    async def stop(self, _: web.Application) -> None:
        self.binds.shutdown(wait=True)  # binds under way finish their writes
        await self.writer.close()
