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

OpenAI-style requests (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``)
name their model in the JSON body: the body is read once (bounded by ``max_body_bytes``),
parsed for the model, the prompt's tokens and the output asked for, and forwarded unchanged;
``GET /v1/models`` is answered by the router (every service's models and adapters); errors on
these paths are OpenAI-shaped (``adapters/http/openai.py``). A streamed answer (server-sent
events) is passed on chunk by chunk as it arrives while :class:`~gpuslice.adapters.http.sse.
SseMeter` times its tokens (TTFT, TPOT), which go back to the balancer and the metrics. When
the client goes away the request to the replica is cut (its connection closed), which is how a
model server learns to stop generating.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gpuslice.adapters.http import openai, upstream
from gpuslice.adapters.http.inference import body_size, header_size, model_from_path
from gpuslice.adapters.http.sse import SseMeter
from gpuslice.adapters.http.upstream import UpstreamError, UpstreamResponse, split_url
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing_config import is_idempotent
from gpuslice.core.routing_llm import TokenDemand, TokenOutcome

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
    # generative requests: prompt tokens (estimated), output tokens, TTFT and TPOT measured
    tokens_in: int | None = None
    tokens_out: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None


class Balancer(Protocol):
    def service_for(self, model: str | None) -> str | Reject: ...

    def wants_body_size(self, service: str) -> bool: ...

    def pick(self, service: str, size: int, exclude: frozenset[str],
             first: bool, demand: TokenDemand | None = None) -> Pick | Reject: ...

    def done(self, pick: Pick, latency_s: float | None, *, failed: bool = False,
             eject: bool = False, outcome: TokenOutcome | None = None) -> None: ...

    def model_list(self) -> list[tuple[str, str | None]]:
        """Every model (and adapter, with its base model) the services serve; empty when none
        is generative (``GET /v1/models`` is then forwarded as KServe v1's)."""
        ...

    def token_demand(self, service: str, prompt_tokens: int, output_tokens: int | None,
                     embedding: bool) -> TokenDemand | None:
        """A generative request's cost (None: the service is not costed in tokens)."""
        ...


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


def _oa_error(status: int, message: str, retry_after: int = 0,
              param: str | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.Response(status=status, body=openai.error_body(status, message, param),
                        content_type="application/json", headers=headers)


@dataclass(slots=True)
class _Call:
    """One request on its way: what every attempt needs."""

    request: web.BaseRequest
    rec: RequestRecord
    service: str
    size: int
    body: bytes
    headers: str
    idempotent: bool
    demand: TokenDemand | None = None
    openai: bool = False
    exclude: frozenset[str] = field(default_factory=frozenset)

    def error(self, status: int, message: str, retry_after: int = 0,
              **extra: str) -> web.Response:
        self.rec.status = status
        self.rec.error = self.rec.error or message
        if self.openai:
            return _oa_error(status, message, retry_after)
        return _error(status, message, retry_after, **extra)


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
        self.started = int(time.time())  # the "created" of the models /v1/models lists

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
        path = request.path
        if path.startswith("/v1/") and path.rstrip("/") == openai.MODELS_PATH \
                and request.method in ("GET", "HEAD") and (listed := self.balancer.model_list()):
            rec.status = 200
            return web.Response(body=openai.models_body(listed, self.started),
                                content_type="application/json")
        kind = openai.ENDPOINTS.get(path) if request.method == "POST" else None
        if kind is not None:
            return await self._openai(request, rec, kind, via)
        svc = self.balancer.service_for(model_from_path(path))
        if isinstance(svc, Reject):
            rec.status, rec.error = svc.status, svc.message
            return _error(svc.status, svc.message)
        rec.service = svc
        try:
            size = header_size(request.headers, self.settings.batch_header)
        except ValidationError as exc:
            rec.status, rec.error = 400, str(exc)
            return _error(400, str(exc), field=exc.field)
        body = await self._read(request, rec, False)
        if not isinstance(body, bytes):
            return body
        if size is None:
            size = (body_size(body, request.headers.get("Content-Type", ""))
                    if body and self.balancer.wants_body_size(svc) else 1)
        rec.size = size
        return await self._dispatch(self._call(request, rec, svc, size, body, via))

    def _call(self, request: web.BaseRequest, rec: RequestRecord, svc: str, size: int,
              body: bytes, via: str) -> _Call:
        idempotent = is_idempotent(request.method, "Idempotency-Key" in request.headers,
                                   self.settings.retry_post)
        headers = _forward_headers(request, rec.request_id, _via_add(via, self.via_name))
        return _Call(request, rec, svc, size, body, headers, idempotent)

    async def _read(self, request: web.BaseRequest, rec: RequestRecord,
                    oa: bool) -> bytes | web.Response:
        """The request body, read once and bounded; or the error answer."""
        fail = _oa_error if oa else _error
        limit = self.settings.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            rec.status = 413
            return fail(413, f"request body of {length} bytes exceeds the limit of {limit} "
                        "bytes")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            rec.status = 413
            return fail(413, f"request body exceeds the limit of {limit} bytes")
        except (aiohttp.ClientPayloadError, web.RequestPayloadError, ConnectionError) as exc:
            rec.status, rec.error = 400, f"unreadable request body: {exc}"
            return fail(400, rec.error)

    async def _openai(self, request: web.BaseRequest, rec: RequestRecord, kind: str,
                      via: str) -> web.StreamResponse:
        """An OpenAI-style request: the service from the body's model, the cost in tokens."""
        body = await self._read(request, rec, True)
        if not isinstance(body, bytes):
            return body
        try:
            req = openai.parse_request(kind, body)
        except openai.OpenAIError as exc:
            rec.status, rec.error = exc.status, str(exc)
            return _oa_error(exc.status, str(exc), param=exc.param)
        svc = self.balancer.service_for(req.model)
        if isinstance(svc, Reject):
            rec.status, rec.error = svc.status, svc.message
            if svc.status == 404:
                return _oa_error(404, f"The model `{req.model}` does not exist. "
                                 f"{svc.message}", param="model")
            return _oa_error(svc.status, svc.message, svc.retry_after_s)
        rec.service, rec.tokens_in = svc, req.prompt_tokens
        out = None if req.max_tokens is None else req.max_tokens * req.choices
        call = self._call(request, rec, svc, 1, body, via)
        call.openai = True
        call.demand = self.balancer.token_demand(svc, req.prompt_tokens, out,
                                                 kind == "embedding")
        return await self._dispatch(call)

    async def _dispatch(self, call: _Call) -> web.StreamResponse:
        """Pick a replica and forward; a failed idempotent request once more elsewhere."""
        rec = call.rec
        last: _Failed | None = None
        while True:
            first = rec.attempts == 0
            pick = self.balancer.pick(call.service, call.size, call.exclude, first) \
                if call.demand is None else \
                self.balancer.pick(call.service, call.size, call.exclude, first, call.demand)
            if isinstance(pick, Reject):
                if last is not None and pick.status == 503:
                    return call.error(last.status, str(last), replica=rec.replica)
                rec.error = ""
                return call.error(pick.status, pick.message, pick.retry_after_s,
                                  reason=pick.reason)
            rec.attempts += 1
            rec.replica, rec.predicted_s = pick.replica, pick.predicted_s
            try:
                return await self._forward(call, pick)
            except _Failed as exc:
                last = exc
                rec.error = str(exc)
                if not (call.idempotent and exc.retriable and rec.attempts < 2):
                    return call.error(exc.status, str(exc), replica=pick.replica)
                call.exclude = call.exclude | {pick.replica}
            except asyncio.CancelledError:
                # the client went away (aiohttp cancels the handler): the replica's connection
                # was closed by the upstream client, the request is not the replica's failure
                rec.status, rec.error = 499, "the client closed the connection"
                raise

    async def _forward(self, call: _Call, pick: Pick) -> web.StreamResponse:
        request, rec, body = call.request, call.rec, call.body
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
        head = (f"{method} {request.raw_path} HTTP/1.1\r\nHost: {hostport}\r\n{call.headers}"
                + (f"Content-Length: {len(body)}\r\n\r\n"
                   if body or method in _BODY_METHODS else "\r\n")
                ).encode("utf-8", "surrogateescape")
        try:
            resp = await upstream.request(
                self.pool, host, port, head, body, head_only=method == "HEAD",
                timeout_s=self.settings.request_timeout_s,
                connect_timeout_s=self.settings.connect_timeout_s)
        except UpstreamError as exc:
            raise self._upstream_failed(pick, exc) from exc
        except asyncio.CancelledError:
            self.balancer.done(pick, None)
            raise
        out_headers = _response_headers(resp.headers, pick.replica, self.via_name)
        if resp.streaming:
            return await self._stream(call, resp, out_headers, pick, t1)
        upstream_s = time.perf_counter() - t1
        rec.upstream_s, rec.status = upstream_s, resp.status
        outcome = None
        if call.demand is not None and resp.status < 400:
            rec.tokens_out = openai.completion_tokens(resp.body)
            outcome = TokenOutcome(output_tokens=rec.tokens_out, latency_s=upstream_s)
        self.balancer.done(pick, upstream_s if resp.status < 500 else None, outcome=outcome)
        return web.Response(status=resp.status, reason=resp.reason or None, body=resp.body,
                            headers=out_headers)

    def _upstream_failed(self, pick: Pick, exc: UpstreamError) -> _Failed:
        if exc.kind == "timeout":
            self.balancer.done(pick, None, failed=True)
            return _Failed(504, f"replica {pick.replica} did not answer within "
                           f"{self.settings.request_timeout_s:g} s", retriable=False,
                           eject=False)
        if exc.kind == "connect":
            self.balancer.done(pick, None, failed=True, eject=True)
            return _Failed(502, f"replica {pick.replica} refused the connection: {exc}",
                           retriable=True, eject=True)
        if exc.kind == "protocol":
            self.balancer.done(pick, None, failed=True)
            return _Failed(502, f"replica {pick.replica} answered with an invalid HTTP "
                           f"response: {exc}", retriable=True, eject=False)
        self.balancer.done(pick, None, failed=True, eject=True)
        return _Failed(502, f"replica {pick.replica} failed: {exc}", retriable=True,
                       eject=True)

    async def _stream(self, call: _Call, resp: UpstreamResponse,
                      out_headers: CIMultiDict[str], pick: Pick, t1: float
                      ) -> web.StreamResponse:
        request, rec = call.request, call.rec
        out = web.StreamResponse(status=resp.status, reason=resp.reason or None,
                                 headers=out_headers)
        rec.status = resp.status
        if self.closing:
            out.force_close()
        meter = SseMeter(t1) if call.demand is not None and resp.status < 400 and \
            "text/event-stream" in out_headers.get("Content-Type", "") else None
        clock = time.perf_counter
        try:
            await out.prepare(request)
            async for chunk in resp.chunks():
                await out.write(chunk)  # passed on as it came: no buffering, no coalescing
                if meter is not None:
                    meter.feed(chunk, clock())
            await out.write_eof()
        except (UpstreamError, ConnectionError) as exc:
            # Headers are gone already: the only honest signal left is to cut the connection.
            resp.abandon()
            self.balancer.done(pick, None, failed=isinstance(exc, UpstreamError))
            rec.error = f"stream from {pick.replica} broke: {exc}"
            if request.transport is not None:
                request.transport.abort()
            return out
        except asyncio.CancelledError:
            resp.abandon()  # the client went away: the replica stops generating
            self.balancer.done(pick, None)
            raise
        upstream_s = time.perf_counter() - t1
        rec.upstream_s = upstream_s
        outcome = None
        if meter is not None:
            rec.ttft_s, rec.tpot_s, rec.tokens_out = meter.outcome()
            outcome = TokenOutcome(rec.ttft_s, rec.tpot_s, rec.tokens_out, upstream_s)
        self.balancer.done(pick, upstream_s if resp.status < 500 else None, outcome=outcome)
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
