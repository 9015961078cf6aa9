"""Contract tier: the proxy's upstream HTTP/1.1 client against scripted servers on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gpuslice.adapters.http import upstream
from gpuslice.adapters.http.upstream import UpstreamError, split_url
from tests.router.harness import run

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def answer(*chunks: bytes, close: bool = False, requests: int = 1) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(requests):
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if length:
                await reader.readexactly(length)
            for c in chunks:
                writer.write(c)
                await writer.drain()
        if close:
            writer.close()
        else:
            await reader.read()  # keep the connection until the client goes
    return script


async def call(script: Script, method: str = "GET", timeout_s: float = 10.0,
               times: int = 1) -> list[upstream.UpstreamResponse | UpstreamError]:
    server = await asyncio.start_server(script, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = upstream.Pool()
    out: list[upstream.UpstreamResponse | UpstreamError] = []
    try:
        for _ in range(times):
            head = f"{method} /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n".encode()
            try:
                resp = await upstream.request(pool, "127.0.0.1", port, head, b"{}",
                                              head_only=method == "HEAD", timeout_s=timeout_s,
                                              connect_timeout_s=5)
                if resp.streaming:
                    resp.body = b"".join([c async for c in resp.chunks()])
                out.append(resp)
            except UpstreamError as exc:
                out.append(exc)
    finally:
        pool.close()
        server.close()
    return out


def one(script: Script, **kw: object) -> upstream.UpstreamResponse | UpstreamError:
    return run(call(script, **kw))[0]  # type: ignore[arg-type]


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhello"


def test_fixed_length_answer_and_keep_alive_reuse() -> None:
    got = run(call(answer(OK, requests=3), times=3))
    assert [(r.status, r.body) for r in got] == [(200, b"hello")] * 3  # type: ignore[union-attr]
    assert ("X-A", "1") in got[0].headers  # type: ignore[union-attr]


def test_answer_split_over_many_packets() -> None:
    r = one(answer(*[OK[i:i + 3] for i in range(0, len(OK), 3)]))
    assert not isinstance(r, UpstreamError)
    assert r.body == b"hello"


def test_chunked_answer_is_streamed_and_decoded() -> None:
    body = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
    r = one(answer(body[:40], body[40:]))
    assert not isinstance(r, UpstreamError)
    assert (r.streaming, r.body) == (True, b"hello world")


def test_answer_until_close() -> None:
    r = one(answer(b"HTTP/1.0 200 OK\r\n\r\nall of it", close=True))
    assert not isinstance(r, UpstreamError)
    assert r.body == b"all of it"


def test_head_and_204_have_no_body() -> None:
    r = one(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"), method="HEAD")
    assert not isinstance(r, UpstreamError)
    assert (r.status, r.body) == (200, b"")
    r = one(answer(b"HTTP/1.1 204 No Content\r\n\r\n"))
    assert not isinstance(r, UpstreamError)
    assert r.status == 204


def test_interim_100_continue_is_skipped() -> None:
    r = one(answer(b"HTTP/1.1 100 Continue\r\n\r\n" + OK))
    assert not isinstance(r, UpstreamError)
    assert r.status == 200


@pytest.mark.parametrize(("raw", "kind", "words"), [
    (b"\x00\x01 not http at all\r\n\r\n", "protocol", "does not start with HTTP"),
    (b"HTTP/1.1 OK\r\n\r\n", "protocol", "bad status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "protocol", "bad header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "protocol", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "protocol",
     "bad chunk size"),
])
def test_garbage_is_a_protocol_error(raw: bytes, kind: str, words: str) -> None:
    r = one(answer(raw, close=True))
    if isinstance(r, upstream.UpstreamResponse):  # chunked: the error surfaces in the stream
        pytest.fail(f"expected an error, got {r}")
    assert r.kind == kind
    assert words in str(r)


def test_truncated_body_is_a_disconnect() -> None:
    r = one(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort", close=True))
    assert isinstance(r, UpstreamError)
    assert r.kind == "disconnect"


def test_silence_is_a_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    r = one(silent, timeout_s=0.2)
    assert isinstance(r, UpstreamError)
    assert r.kind == "timeout"


def test_refused_connection() -> None:
    async def go() -> UpstreamError:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        with pytest.raises(UpstreamError) as info:
            await upstream.request(upstream.Pool(), "127.0.0.1", port, b"GET / HTTP/1.1\r\n\r\n",
                                   b"", head_only=False, timeout_s=5, connect_timeout_s=5)
        return info.value
    assert run(go()).kind == "connect"


def test_split_url() -> None:
    assert split_url("http://10.0.0.1:8000") == ("10.0.0.1", 8000, "10.0.0.1:8000")
    assert split_url("http://svc") == ("svc", 80, "svc")
    assert split_url("http://[::1]:81") == ("::1", 81, "[::1]:81")
    with pytest.raises(UpstreamError, match="only http://"):
        split_url("https://x")
