"""HTTP/2 beside aiohttp's HTTP/1.1 on one TLS port, chosen by ALPN.

kube-scheduler's extender client negotiates HTTP/2 when the server offers it (its transport
comes from ``utilnet.SetTransportDefaults``, k8s.io/apimachinery pkg/util/net/http.go, which
configures HTTP/2 unless ``NextProtos`` excludes it; pkg/scheduler/extender.go
``makeTransport``). Over HTTP/1.1 it keeps at most two idle connections (Go's
``DefaultMaxIdleConnsPerHost``): with binds in flight a burst opens new connections all the
time, and each new one is a TLS handshake with a client certificate to verify, measured at
1.5 ms of the extender's CPU against 0.1 ms for a request on a kept-alive connection
(docs/scale.md). Over HTTP/2 every call is a stream on one connection.

:class:`AlpnSite` is an aiohttp site: a connection whose TLS handshake chose ``h2`` is served
by :class:`H2Server` (the ``h2`` library's protocol state machine; requests handed whole to
``dispatch``), any other by the application's HTTP/1.1 handler, as a ``TCPSite`` would."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from aiohttp import web

log = logging.getLogger("gpuslice.http2")

MAX_STREAMS = 256  # requests in flight on one connection (SETTINGS_MAX_CONCURRENT_STREAMS)
WINDOW = 1 << 20  # flow-control window granted to a client's request bodies, per stream


@dataclass
class H2Answer:
    status: int
    content_type: str
    body: bytes


# (method, path, body, transport) -> the answer
Dispatch = Callable[[str, str, bytes, asyncio.Transport], Awaitable[H2Answer]]


@dataclass
class _Stream:
    method: str
    path: str
    body: bytearray = field(default_factory=bytearray)
    too_big: bool = False


def alpn_context(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """``ctx`` offering HTTP/2 and HTTP/1.1 (in that order of preference) by ALPN."""
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


class H2Server(asyncio.Protocol):
    """One HTTP/2 connection: streams collected whole (a body above ``max_body`` is answered
    413 without being kept), each handed to ``dispatch`` on a task of its own, the answers
    sent as the client's flow-control windows allow. A protocol error ends the connection
    (GOAWAY); a stream the client resets is forgotten, its task left to finish (a bind
    under way completes its write)."""

    def __init__(self, dispatch: Dispatch, max_body: int,
                 live: set[H2Server] | None = None, max_buffered: int | None = None) -> None:
        self.dispatch = dispatch
        self.max_body = max_body
        # bodies being received on one connection, all streams together: past this the
        # client is sent away (GOAWAY ENHANCE_YOUR_CALM), as it could otherwise hold
        # MAX_STREAMS bodies of max_body each
        self.max_buffered = 4 * max_body if max_buffered is None else max_buffered
        self.buffered = 0
        self.live = live if live is not None else set()
        # the answers' headers are this module's own (:status, content-type from the
        # handlers' constants, content-length): not checked or normalised again per answer
        # (the library's pure-Python pass, ~8 us of a ~110 us request); a client's headers
        # still are
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_outbound_headers=False,
            normalize_outbound_headers=False))
        self.transport: Any = None  # asyncio's or uvloop's TLS transport
        self.streams: dict[int, _Stream] = {}
        self.waiting: dict[int, memoryview] = {}  # answers held back by flow control
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self.draining = False  # shutting down: new streams are refused (safe to retry)

    # -- the transport's callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.live.add(self)
        self.conn.initiate_connection()
        self.conn.update_settings({
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        self.conn.increment_flow_control_window(WINDOW)  # the connection's, beside streams'
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.info("HTTP/2 protocol error from a client: %s", exc,
                     extra={"event": "http2-protocol-error"})
            self._flush()  # the GOAWAY the library queued
            self._close()
            return
        for ev in events:
            if self.closed:
                return
            if isinstance(ev, h2.events.RequestReceived):
                self._request(ev)
            elif isinstance(ev, h2.events.DataReceived):
                self._data(ev)
            elif isinstance(ev, h2.events.StreamEnded):
                self._ended(ev.stream_id)
            elif isinstance(ev, h2.events.StreamReset):
                self._forget(ev.stream_id)
                self.waiting.pop(ev.stream_id, None)
            elif isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self._send_waiting()
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self._flush()
                self._close()
                return
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.live.discard(self)
        self.streams.clear()
        self.waiting.clear()

    # -- streams --------------------------------------------------------------------------

    def _request(self, ev: h2.events.RequestReceived) -> None:
        headers = dict(ev.headers or [])
        sid = ev.stream_id
        if self.draining:  # REFUSED_STREAM: not processed, a client may retry it elsewhere
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        # the request is served at its StreamEnded event (with the HEADERS for a GET)
        self.streams[sid] = _Stream(headers.get(b":method", b"").decode("latin-1"),
                                    headers.get(b":path", b"").decode("latin-1")
                                    .split("?", 1)[0])

    def _data(self, ev: h2.events.DataReceived) -> None:
        # the window is given back at once: a body is kept whole until it ends
        self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        st = self.streams.get(ev.stream_id)
        if st is None or st.too_big:
            return
        data = ev.data or b""
        if len(st.body) + len(data) > self.max_body:
            self.buffered -= len(st.body)
            st.too_big, st.body = True, bytearray()
            return
        self.buffered += len(data)
        if self.buffered > self.max_buffered:
            log.info("HTTP/2 client sent %d bytes of bodies at once (limit %d): closed",
                     self.buffered, self.max_buffered, extra={"event": "http2-too-much"})
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
            self._flush()
            self._close()
            return
        st.body += data

    def _forget(self, sid: int) -> _Stream | None:
        st = self.streams.pop(sid, None)
        if st is not None:
            self.buffered -= len(st.body)
        return st

    def _ended(self, sid: int) -> None:
        st = self._forget(sid)
        if st is None:
            return
        if st.too_big:
            self._answer(sid, H2Answer(413, "text/plain; charset=utf-8",
                                       f"request body over {self.max_body} bytes".encode()))
            return
        task = asyncio.ensure_future(self._serve(sid, st))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve(self, sid: int, st: _Stream) -> None:
        assert self.transport is not None
        try:
            answer = await self.dispatch(st.method, st.path, bytes(st.body), self.transport)
        except Exception:  # a handler's bug: the stream gets a 500, the server goes on
            log.exception("HTTP/2 %s %s failed", st.method, st.path,
                          extra={"event": "http2-handler-failed"})
            answer = H2Answer(500, "text/plain; charset=utf-8", b"internal error")
        self._answer(sid, answer)
        self._flush()

    def _answer(self, sid: int, a: H2Answer) -> None:
        if self.closed:
            return
        try:
            self.conn.send_headers(sid, [(b":status", str(a.status).encode()),
                                         (b"content-type", a.content_type.encode()),
                                         (b"content-length", str(len(a.body)).encode())],
                                   end_stream=not a.body)
        except h2.exceptions.StreamClosedError:  # the client reset it meanwhile
            return
        except h2.exceptions.ProtocolError:  # the connection is closing
            return
        if a.body:
            self.waiting[sid] = memoryview(a.body)
            self._send_waiting()

    def _send_waiting(self) -> None:
        for sid in list(self.waiting):
            data = self.waiting[sid]
            try:
                while data:
                    n = min(self.conn.local_flow_control_window(sid),
                            self.conn.max_outbound_frame_size, len(data))
                    if n <= 0:
                        break
                    self.conn.send_data(sid, data[:n].tobytes(), end_stream=n == len(data))
                    data = data[n:]
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                data = memoryview(b"")
            if data:
                self.waiting[sid] = data
            else:
                del self.waiting[sid]

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out and self.transport is not None and not self.closed:
            self.transport.write(out)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout_s: float) -> None:
        """New streams refused (REFUSED_STREAM: a client retries them on a new connection),
        the answers under way finished (within ``timeout_s``), then a GOAWAY naming the last
        stream served and the connection closed. (The GOAWAY comes last: some clients fail
        every stream still open when one arrives, whatever its last stream.)"""
        if self.closed:
            return
        self.draining = True
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.close_connection()
        self._flush()
        self._close()


class _Alpn(asyncio.Protocol):
    """Chooses the protocol once the TLS handshake is done (asyncio and uvloop call
    ``connection_made`` after it) and hands the transport over to it."""

    def __init__(self, h1: Callable[[], asyncio.Protocol], h2_made: Callable[[], H2Server],
                 ) -> None:
        self.h1, self.h2_made = h1, h2_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tls = transport.get_extra_info("ssl_object")
        chosen = tls.selected_alpn_protocol() if tls is not None else None
        inner: asyncio.Protocol = self.h2_made() if chosen == "h2" else self.h1()
        transport.set_protocol(inner)
        inner.connection_made(transport)


class AlpnSite(web.BaseSite):
    """An HTTPS site of ``runner`` that serves HTTP/2 to clients that ask for it by ALPN
    (``dispatch`` answers their requests) and the application's HTTP/1.1 to the others. On
    stop, HTTP/2 connections get a GOAWAY and their answers under way
    ``shutdown_timeout`` seconds to finish."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 ssl_context: ssl.SSLContext, dispatch: Dispatch, max_body: int,
                 shutdown_timeout: float = 60.0) -> None:
        super().__init__(runner, ssl_context=alpn_context(ssl_context))
        self._host, self._port = host, port
        self._dispatch, self._max_body = dispatch, max_body
        self._h2: set[H2Server] = set()
        self._timeout = shutdown_timeout

    @property
    def name(self) -> str:
        return f"https://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        def made() -> asyncio.Protocol:
            return _Alpn(server, lambda: H2Server(self._dispatch, self._max_body, self._h2))

        self._server = await loop.create_server(made, self._host, self._port,
                                                ssl=self._ssl_context, reuse_address=True)

    async def stop(self) -> None:
        await super().stop()  # no new connections
        await asyncio.gather(*(c.shutdown(self._timeout) for c in list(self._h2)))


def aiohttp_answer(resp: web.StreamResponse) -> H2Answer:
    """An aiohttp handler's :class:`web.Response` as an :class:`H2Answer`."""
    body = resp.body if isinstance(resp, web.Response) else None
    raw = body if isinstance(body, bytes) else b""
    return H2Answer(resp.status, resp.headers.get("Content-Type", "application/octet-stream"),
                    raw)


def answer_error(exc: web.HTTPException) -> H2Answer:
    return H2Answer(exc.status, exc.headers.get("Content-Type", "text/plain; charset=utf-8"),
                    exc.body if isinstance(exc.body, bytes) else (exc.text or "").encode())


class H2Request:
    """What the extender's aiohttp handlers read of a request (``read()``, ``path``,
    ``method``, ``transport``), for a request that came over HTTP/2."""

    __slots__ = ("_body", "method", "path", "transport")

    def __init__(self, method: str, path: str, body: bytes, transport: Any) -> None:
        self.method, self.path, self.transport, self._body = method, path, transport, body

    async def read(self) -> bytes:
        return self._body
