"""The router's HTTP data plane: an asyncio reverse proxy (aiohttp server and client).

It knows nothing about policies: for every request it asks a :class:`Balancer` for a replica
(or a rejection), forwards the request, streams or relays the answer, reports the outcome back,
and retries a failed idempotent request once on another replica. Errors are answered as JSON
with a clear status: 400 malformed, 404 unknown model, 405 CONNECT (not a tunnel), 413 too
large, 429 over the SLO (with Retry-After), 502 the replica failed or answered garbage, 503 no
healthy replica, 504 timeout, 508 the request came back to this router (a replica URL that
points at a router).

Each router adds itself to ``Via`` (RFC 9110, section 7.6.3: a proxy appends its
protocol and a received-by pseudonym, in requests and responses); a request whose ``Via``
already names this router is refused instead of forwarded round again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gpuslice.adapters.http import upstream
from gpuslice.adapters.http.inference import body_size, header_size, model_from_path
from gpuslice.adapters.http.upstream import UpstreamError, UpstreamResponse, split_url
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing_config import is_idempotent

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "proxy-connection",
})
_SKIP_REQUEST = HOP_BY_HOP | {"host", "content-length", "expect", "via"}
_SKIP_RESPONSE = HOP_BY_HOP | {"content-length", "server", "date", "via"}
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(slots=True)
class Pick:
    """A replica chosen for one attempt; ``ticket`` is the balancer's own, handed back."""

    service: str
    replica: str
    url: str
    ticket: object
    predicted_s: float


@dataclass(frozen=True, slots=True)
class Reject:
    status: int
    message: str
    retry_after_s: int = 0
    reason: str = "reject"


@dataclass(slots=True)
class RequestRecord:
    """One request as the access log and metrics see it."""

    ts: float
    method: str
    path: str
    status: int
    service: str
    replica: str
    latency_s: float
    upstream_s: float
    predicted_s: float
    size: int
    attempts: int
    request_id: str
    client: str
    error: str = ""


class Balancer(Protocol):
    def service_for(self, model: str | None) -> str | Reject: ...

    def wants_body_size(self, service: str) -> bool: ...

    def pick(self, service: str, size: int, exclude: frozenset[str],
             first: bool) -> Pick | Reject: ...

    def done(self, pick: Pick, latency_s: float | None, *, failed: bool = False,
             eject: bool = False) -> None: ...


Observer = Callable[[RequestRecord], None]


@dataclass(frozen=True, slots=True)
class ProxySettings:
    batch_header: str = "X-Batch-Size"
    request_timeout_s: float = 60.0
    connect_timeout_s: float = 2.0
    retry_post: bool = False
    max_body_bytes: int = 64 * 1024 * 1024


def _error(status: int, message: str, retry_after: int = 0, **extra: str) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    body = json.dumps({"error": message, "code": status, **extra})
    return web.Response(status=status, text=body, content_type="application/json",
                        headers=headers)


class _Failed(Exception):
    def __init__(self, status: int, message: str, *, retriable: bool, eject: bool) -> None:
        super().__init__(message)
        self.status = status
        self.retriable = retriable
        self.eject = eject


class ReverseProxy:
    """The proxy; :meth:`handle` is an aiohttp low-level handler."""

    def __init__(self, balancer: Balancer, settings: ProxySettings,
                 observer: Observer | None = None) -> None:
        self.balancer = balancer
        self.settings = settings
        self.observer = observer
        self.session: aiohttp.ClientSession | None = None  # health checks, not forwarding
        self.pool = upstream.Pool()
        self._targets: dict[str, tuple[str, int, str]] = {}
        self._counter = 0
        self._prefix = f"{os.getpid():x}-{int(time.time()) & 0xFFFFFF:x}"
        # this router's received-by pseudonym in Via: unique per process, so that a loop is
        # told from a chain of several routers
        self.via_name = f"gpuslice-router-{self._prefix}-{id(self) & 0xFFFF:x}"
        # the router is stopping: every answer closes its connection, so a client on a
        # kept-alive one opens the next elsewhere (through kube-proxy, to another router)
        self.closing = False

    async def start(self) -> None:
        self.pool = upstream.Pool()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout_s),
        )

    async def close(self) -> None:
        self.pool.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _request_id(self, headers: CIMultiDictProxy[str]) -> str:
        rid = headers.get("X-Request-Id")
        if rid:
            return rid
        self._counter += 1
        return f"{self._prefix}-{self._counter}"

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.perf_counter()
        rec = RequestRecord(time.time(), request.method, request.path, 0, "", "", 0.0, 0.0, 0.0,
                            1, 0, self._request_id(request.headers), request.remote or "")
        try:
            resp = await self._handle(request, rec)
            if self.closing and not resp.prepared:
                resp.force_close()
            return resp
        finally:
            rec.latency_s = time.perf_counter() - t0
            if self.observer is not None:
                self.observer(rec)

    async def _handle(self, request: web.BaseRequest, rec: RequestRecord) -> web.StreamResponse:
        via = ", ".join(request.headers.getall("Via", []))
        if self.via_name in _via_names(via):
            rec.status = 508
            rec.error = (f"loop: this request already passed through this router (Via: {via}); "
                         "a replica's URL points back at a router")
            return _error(508, rec.error)
        if request.method == "CONNECT":  # a tunnel: answered 2xx, the connection never ends
            rec.status = 405
            rec.error = "CONNECT: this router is a reverse proxy for inference, not a tunnel"
            return _error(405, rec.error)
        svc = self.balancer.service_for(model_from_path(request.path))
        if isinstance(svc, Reject):
            rec.status, rec.error = svc.status, svc.message
            return _error(svc.status, svc.message)
        rec.service = svc
        try:
            size = header_size(request.headers, self.settings.batch_header)
        except ValidationError as exc:
            rec.status, rec.error = 400, str(exc)
            return _error(400, str(exc), field=exc.field)
        length = request.content_length
        if length is not None and length > self.settings.max_body_bytes:
            rec.status = 413
            return _error(413, f"request body of {length} bytes exceeds the limit of "
                          f"{self.settings.max_body_bytes} bytes")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            rec.status = 413
            return _error(413, f"request body exceeds the limit of "
                          f"{self.settings.max_body_bytes} bytes")
        except (aiohttp.ClientPayloadError, web.RequestPayloadError, ConnectionError) as exc:
            rec.status, rec.error = 400, f"unreadable request body: {exc}"
            return _error(400, rec.error)
        if size is None:
            size = (body_size(body, request.headers.get("Content-Type", ""))
                    if body and self.balancer.wants_body_size(svc) else 1)
        rec.size = size
        idempotent = is_idempotent(request.method, "Idempotency-Key" in request.headers,
                                 self.settings.retry_post)
        headers = _forward_headers(request, rec.request_id, _via_add(via, self.via_name))
        exclude: frozenset[str] = frozenset()
        last: _Failed | None = None
        while True:
            pick = self.balancer.pick(svc, size, exclude, rec.attempts == 0)
            if isinstance(pick, Reject):
                if last is not None and pick.status == 503:
                    rec.status, rec.error = last.status, str(last)
                    return _error(last.status, str(last), replica=rec.replica)
                rec.status, rec.error = pick.status, pick.message
                return _error(pick.status, pick.message, pick.retry_after_s, reason=pick.reason)
            rec.attempts += 1
            rec.replica, rec.predicted_s = pick.replica, pick.predicted_s
            try:
                return await self._forward(request, pick, headers, body, rec)
            except _Failed as exc:
                last = exc
                rec.error = str(exc)
                if not (idempotent and exc.retriable and rec.attempts < 2):
                    rec.status = exc.status
                    return _error(exc.status, str(exc), replica=pick.replica)
                exclude = exclude | {pick.replica}

    async def _forward(self, request: web.BaseRequest, pick: Pick, headers: str,
                       body: bytes, rec: RequestRecord) -> web.StreamResponse:
        t1 = time.perf_counter()
        target = self._targets.get(pick.url)
        if target is None:
            try:
                target = self._targets[pick.url] = split_url(pick.url)
            except (UpstreamError, ValueError) as exc:
                self.balancer.done(pick, None, failed=True, eject=True)
                raise _Failed(502, f"replica {pick.replica}: unusable URL {pick.url!r}: {exc}",
                              retriable=True, eject=True) from exc
        host, port, hostport = target
        method = request.method
        head = (f"{method} {request.raw_path} HTTP/1.1\r\nHost: {hostport}\r\n{headers}"
                + (f"Content-Length: {len(body)}\r\n\r\n"
                   if body or method in _BODY_METHODS else "\r\n")
                ).encode("utf-8", "surrogateescape")
        try:
            resp = await upstream.request(
                self.pool, host, port, head, body, head_only=method == "HEAD",
                timeout_s=self.settings.request_timeout_s,
                connect_timeout_s=self.settings.connect_timeout_s)
        except UpstreamError as exc:
            if exc.kind == "timeout":
                self.balancer.done(pick, None, failed=True)
                raise _Failed(504, f"replica {pick.replica} did not answer within "
                              f"{self.settings.request_timeout_s:g} s", retriable=False,
                              eject=False) from exc
            if exc.kind == "connect":
                self.balancer.done(pick, None, failed=True, eject=True)
                raise _Failed(502, f"replica {pick.replica} refused the connection: {exc}",
                              retriable=True, eject=True) from exc
            if exc.kind == "protocol":
                self.balancer.done(pick, None, failed=True)
                raise _Failed(502, f"replica {pick.replica} answered with an invalid HTTP "
                              f"response: {exc}", retriable=True, eject=False) from exc
            self.balancer.done(pick, None, failed=True, eject=True)
            raise _Failed(502, f"replica {pick.replica} failed: {exc}", retriable=True,
                          eject=True) from exc
        out_headers = _response_headers(resp.headers, pick.replica, self.via_name)
        if resp.streaming:
            return await self._stream(request, resp, out_headers, pick, rec, t1)
        upstream_s = time.perf_counter() - t1
        rec.upstream_s, rec.status = upstream_s, resp.status
        self.balancer.done(pick, upstream_s if resp.status < 500 else None)
        return web.Response(status=resp.status, reason=resp.reason or None, body=resp.body,
                            headers=out_headers)

    async def _stream(self, request: web.BaseRequest, resp: UpstreamResponse,
                      out_headers: CIMultiDict[str], pick: Pick, rec: RequestRecord,
                      t1: float) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, reason=resp.reason or None,
                                 headers=out_headers)
        rec.status = resp.status
        if self.closing:
            out.force_close()
        try:
            await out.prepare(request)
            async for chunk in resp.chunks():
                await out.write(chunk)
            await out.write_eof()
        except (UpstreamError, ConnectionError) as exc:
            # Headers are gone already: the only honest signal left is to cut the connection.
            resp.abandon()
            self.balancer.done(pick, None, failed=isinstance(exc, UpstreamError))
            rec.error = f"stream from {pick.replica} broke: {exc}"
            if request.transport is not None:
                request.transport.abort()
            return out
        upstream_s = time.perf_counter() - t1
        rec.upstream_s = upstream_s
        self.balancer.done(pick, upstream_s if resp.status < 500 else None)
        return out


def _via_names(via: str) -> list[str]:
    """The received-by parts of a ``Via`` value (``1.1 name, HTTP/1.0 other (comment)``)."""
    names = []
    for hop in via.split(","):
        parts = hop.split()
        if len(parts) >= 2:
            names.append(parts[1])
    return names


def _via_add(prior: str, name: str) -> str:
    return f"{prior}, 1.1 {name}" if prior.strip() else f"1.1 {name}"


def _forward_headers(request: web.BaseRequest, request_id: str, via: str) -> str:
    """The request's end-to-end headers as header lines, plus X-Forwarded-*, X-Request-Id and
    ``via`` (the incoming Via with this router added)."""
    out = []
    prior = ""
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in _SKIP_REQUEST:
            continue
        if lk == "x-forwarded-for":
            prior = v
            continue
        if lk == "x-request-id":
            continue
        out.append(f"{k}: {v}\r\n")
    peer = request.remote or ""
    out.append(f"X-Forwarded-For: {prior}, {peer}\r\n" if prior else
               f"X-Forwarded-For: {peer}\r\n")
    if request.host:
        out.append(f"X-Forwarded-Host: {request.host}\r\n")
    out.append(f"X-Request-Id: {request_id}\r\n")
    out.append(f"Via: {via}\r\n")
    return "".join(out)


def _response_headers(headers: list[tuple[str, str]], replica: str,
                      via_name: str) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    vias = []
    for k, v in headers:
        lk = k.lower()
        if lk == "via":
            vias.append(v)
        elif lk not in _SKIP_RESPONSE:
            out.add(k, v)
    out["X-Gpuslice-Replica"] = replica
    out["Via"] = _via_add(", ".join(vias), via_name)
    return out
