"""A lean HTTP/1.1 client for the proxy's upstream side: keep-alive connection pools per
replica on asyncio protocols, a small response parser (Content-Length, chunked, until-close),
and typed failures the proxy turns into clear answers. It does a fraction of the work of a
general client per request, which is most of the router's overhead on a small machine.

Failures: :class:`UpstreamError` with ``kind`` ``connect`` (nothing was sent), ``protocol``
(the replica answered bytes that are not HTTP), ``disconnect`` (the connection broke before
the answer was complete) or ``timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gpuslice.core.errors import ValidationError

MAX_HEAD = 64 * 1024


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    streaming: bool = False
    _conn: _Conn | None = field(default=None, repr=False)
    # this answer's chunks: the connection may be back in the pool, serving another request
    # with a queue of its own, before the reader of this one has started or finished
    _queue: asyncio.Queue[bytes | UpstreamError | None] | None = field(default=None, repr=False)

    def abandon(self) -> None:
        """The reader gives up on a streamed body: the connection cannot be reused (unless
        the body was complete already: then it may be serving another request now)."""
        conn = self._conn
        if conn is not None and conn.response is self and conn.state != _IDLE:
            conn.keep_alive = False
            conn.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body of a streamed answer (chunked or until close), as it arrives."""
        queue = self._queue
        if queue is None:
            if self.body:
                yield self.body
            return
        while True:
            item = await queue.get()
            if isinstance(item, UpstreamError):
                raise item
            if item is None:
                return
            yield item


_HEAD, _FIXED, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE, _IDLE = range(8)


class _Conn(asyncio.Protocol):
    def __init__(self, pool: Pool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _IDLE
        self.waiter: asyncio.Future[UpstreamResponse] | None = None
        self.queue: asyncio.Queue[bytes | UpstreamError | None] = asyncio.Queue()
        self.response: UpstreamResponse | None = None
        self.remaining = 0
        self.body = bytearray()
        self.keep_alive = True
        self.head_only = False
        self.closed = False

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.state == _UNTIL_CLOSE:
            self._finish_stream()
            return
        if self.state != _IDLE:
            self._fail(UpstreamError("disconnect", "the replica closed the connection before "
                                     "the answer was complete"))

    def data_received(self, data: bytes) -> None:
        if self.state == _IDLE:
            self._fail(UpstreamError("protocol", "unsolicited bytes from the replica"))
            return
        self.buf += data
        try:
            self._parse()
        except UpstreamError as exc:
            self._fail(exc)

    # -- request -------------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes, head_only: bool) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.queue = asyncio.Queue()
        self.state = _HEAD
        self.head_only = head_only
        self.response = None
        self.body = bytearray()
        self.keep_alive = True
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return self.waiter

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self) -> None:
        while True:
            if self.state == _HEAD:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > MAX_HEAD:
                        raise UpstreamError("protocol", "response head too large")
                    if self.buf and not b"HTTP/1."[: len(self.buf)].startswith(
                            bytes(self.buf[:7])):
                        raise UpstreamError("protocol", "the answer does not start with "
                                            "HTTP/1.x")
                    return
                head = bytes(self.buf[:end])
                del self.buf[: end + 4]
                self._head(head)
                continue
            if self.state == _FIXED:
                take = min(self.remaining, len(self.buf))
                self.body += self.buf[:take]
                del self.buf[:take]
                self.remaining -= take
                if self.remaining == 0:
                    self._finish_fixed()
                return
            if self.state == _CHUNK_SIZE:
                end = self.buf.find(b"\r\n")
                if end < 0:
                    if len(self.buf) > 1024:
                        raise UpstreamError("protocol", "bad chunk size line")
                    return
                line = bytes(self.buf[:end]).split(b";", 1)[0].strip()
                del self.buf[: end + 2]
                try:
                    size = int(line, 16)
                except ValueError:
                    raise UpstreamError("protocol", f"bad chunk size {line[:20]!r}") from None
                if size == 0:
                    self.state = _TRAILERS
                else:
                    self.remaining = size
                    self.state = _CHUNK_DATA
                continue
            if self.state == _CHUNK_DATA:
                if not self.buf:
                    return
                take = min(self.remaining, len(self.buf))
                self.queue.put_nowait(bytes(self.buf[:take]))
                del self.buf[:take]
                self.remaining -= take
                if self.remaining == 0:
                    self.state = _CHUNK_CRLF
                continue
            if self.state == _CHUNK_CRLF:
                if len(self.buf) < 2:
                    return
                if self.buf[:2] != b"\r\n":
                    raise UpstreamError("protocol", "chunk not followed by CRLF")
                del self.buf[:2]
                self.state = _CHUNK_SIZE
                continue
            if self.state == _TRAILERS:
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                del self.buf[: end + 2]
                if end == 0:
                    self._finish_stream()
                    return
                continue
            if self.state == _UNTIL_CLOSE:
                if self.buf:
                    self.queue.put_nowait(bytes(self.buf))
                    self.buf.clear()
                return
            return

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status_line = lines[0]
        parts = status_line.split(b" ", 2)
        if not status_line.startswith(b"HTTP/1."):
            raise UpstreamError("protocol", "the answer does not start with HTTP/1.x: "
                                f"{status_line[:40]!r}")
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 \
                or not parts[1].isdigit():
            raise UpstreamError("protocol", f"bad status line {status_line[:40]!r}")
        status = int(parts[1])
        reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
        headers: list[tuple[str, str]] = []
        length: int | None = None
        chunked = False
        conn_hdr = ""
        for raw in lines[1:]:
            name, sep, value = raw.partition(b":")
            if not sep or not name or name != name.strip():
                raise UpstreamError("protocol", f"bad header line {raw[:40]!r}")
            k = name.decode("latin-1")
            v = value.strip().decode("utf-8", "surrogateescape")
            lk = k.lower()
            if lk == "content-length":
                if not v.isdigit():
                    raise UpstreamError("protocol", f"bad Content-Length {v[:20]!r}")
                length = int(v)
            elif lk == "transfer-encoding":
                chunked = "chunked" in v.lower()
            elif lk == "connection":
                conn_hdr = v.lower()
            headers.append((k, v))
        if 100 <= status < 200:
            return  # interim answer: the real one follows
        if "close" in conn_hdr or (parts[0] == b"HTTP/1.0" and "keep-alive" not in conn_hdr):
            self.keep_alive = False
        resp = UpstreamResponse(status, reason, headers)
        self.response = resp
        if self.head_only or status in (204, 304):
            self.state = _FIXED
            self.remaining = 0
            self._finish_fixed()
            return
        if chunked:
            resp.streaming, resp._conn, resp._queue = True, self, self.queue
            self.state = _CHUNK_SIZE
            self._resolve(resp)
        elif length is not None:
            self.state = _FIXED
            self.remaining = length
            if length == 0:
                self._finish_fixed()
        else:
            self.keep_alive = False
            resp.streaming, resp._conn, resp._queue = True, self, self.queue
            self.state = _UNTIL_CLOSE
            self._resolve(resp)

    # -- outcomes ------------------------------------------------------------------------------
    def _resolve(self, resp: UpstreamResponse) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(resp)

    def _finish_fixed(self) -> None:
        resp = self.response
        assert resp is not None
        resp.body = bytes(self.body)
        self.state = _IDLE
        self._release()
        self._resolve(resp)

    def _finish_stream(self) -> None:
        self.state = _IDLE
        self.queue.put_nowait(None)
        self._release()

    def _release(self) -> None:
        if self.keep_alive and not self.closed and not self.buf:
            self.pool.put(self)
        else:
            self.close()

    def _fail(self, exc: UpstreamError) -> None:
        streaming = self.response is not None and self.response.streaming
        self.state = _IDLE
        self.close()
        if streaming:
            self.queue.put_nowait(exc)
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class Pool:
    """Idle keep-alive connections per (host, port)."""

    def __init__(self, max_idle_per_host: int = 256) -> None:
        self.idle: dict[tuple[str, int], list[_Conn]] = {}
        self.max_idle = max_idle_per_host

    def put(self, conn: _Conn) -> None:
        lst = self.idle.setdefault(conn.key, [])
        if len(lst) < self.max_idle:
            lst.append(conn)
        else:
            conn.close()

    async def get(self, host: str, port: int, connect_timeout_s: float) -> _Conn:
        key = (host, port)
        lst = self.idle.get(key)
        while lst:
            conn = lst.pop()
            if not conn.closed and conn.transport is not None \
                    and not conn.transport.is_closing():
                return conn
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, proto = await loop.create_connection(lambda: _Conn(self, key), host, port)
        except TimeoutError:
            raise UpstreamError("connect", f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {host}:{port}: "
                                f"{exc.strerror or exc}") from None
        return proto

    def close(self) -> None:
        for lst in self.idle.values():
            for conn in lst:
                conn.close()
        self.idle.clear()


def host_port(url: str) -> tuple[str, str, int, str]:
    """``scheme://host:port/...`` -> (scheme, host, port, ``host:port`` as written); the port
    defaults to 443 for https and 80 otherwise; IPv6 hosts in brackets."""
    scheme, _, rest = url.partition("://")
    hostport = rest.split("/", 1)[0]
    if hostport.startswith("["):
        host, _, tail = hostport[1:].partition("]")
        port_s = tail.lstrip(":")
    else:
        host, _, port_s = hostport.partition(":")
    if not port_s:
        return scheme, host, 443 if scheme == "https" else 80, hostport
    try:
        return scheme, host, int(port_s), hostport
    except ValueError:
        raise ValidationError("url", "http://HOST:PORT", url) from None


def split_url(url: str) -> tuple[str, int, str]:
    """``http://host:port`` -> (host, port, Host header). Only plain http upstreams."""
    scheme, host, port, hostport = host_port(url)
    if scheme != "http":
        raise UpstreamError("connect", f"only http:// replicas are supported, got {url!r}")
    return host, port, hostport


async def request(pool: Pool, host: str, port: int, head: bytes, body: bytes, *,
                  head_only: bool, timeout_s: float, connect_timeout_s: float
                  ) -> UpstreamResponse:
    """Send one request (``head`` is the full request head, ending in a blank line)."""
    conn = await pool.get(host, port, connect_timeout_s)
    fut = conn.send(head, body, head_only)
    loop = asyncio.get_running_loop()
    timer = loop.call_later(timeout_s, _expire, conn, fut)
    try:
        return await fut
    except asyncio.CancelledError:
        # the client went away: closing the connection is how the replica learns of it (a
        # model server aborts the generation of a request whose connection closed)
        conn.keep_alive = False
        conn.close()
        raise
    finally:
        timer.cancel()


def _expire(conn: _Conn, fut: asyncio.Future[UpstreamResponse]) -> None:
    if not fut.done():
        fut.set_exception(UpstreamError("timeout", "the replica did not answer in time"))
        conn.state = _IDLE
        conn.close()
