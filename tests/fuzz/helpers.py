"""What the fuzz targets share: Hypothesis settings sized for CI (reproducible, no deadline),
a count of the inputs each target tried, a server loop on a thread of its own, and a plain
HTTP client with a timeout (the "no hang" property: every request answers within it)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import socket
import threading
from collections import Counter
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES_ENV = "GPUSLICE_FUZZ_EXAMPLES"
# a request (or gRPC call) that takes longer than this counts as a hang
ANSWER_TIMEOUT_S = 10.0

TRIED: Counter[str] = Counter()  # target -> inputs tried in this run (conftest prints it)

T = TypeVar("T")


def examples(default: int) -> int:
    """``default`` examples, or ``$GPUSLICE_FUZZ_EXAMPLES`` each (a longer, nightly run)."""
    raw = os.environ.get(EXAMPLES_ENV, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{EXAMPLES_ENV}: expected a number of examples, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{EXAMPLES_ENV}: expected at least 1, got {raw!r}")
    return n


def fuzz(default: int) -> settings:
    """Settings of one fuzz test: ``default`` examples (see :func:`examples`), derandomized so
    that CI runs the same inputs every time, no deadline (the machine is shared and loaded;
    hangs are caught by :data:`ANSWER_TIMEOUT_S` instead), no example database."""
    return settings(max_examples=examples(default), deadline=None, derandomize=True,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture])


def tried(target: str) -> None:
    TRIED[target] += 1


# -- inputs -----------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)

# bodies no JSON encoder makes: the byte-level corpus every JSON endpoint is sent
MALFORMED_JSON: tuple[bytes, ...] = (
    b"", b" ", b"null", b"true", b"0", b"-1", b'""', b"[]", b"[{}]", b"{", b"}", b"{]",
    b'{"Pod":', b'{"Pod": {}', b'{"a":1,}', b"{'Pod': {}}", b'{"Pod": NaN}',
    b'{"Pod": Infinity}', b'{"x": 1e999999}', b'{"x": -1e999999}', b"\xff\xfe{}",
    b'{"\xff": 1}', b'{"a": "\xc3\x28"}', b'{"a": "\\ud800"}', b'{"a": "\\u0000"}',
    b"\x00", b"{}\x00", b"{} {}", b'{"a":1}{"b":2}',
    b"[" * 100_000, b"{\"a\":" * 50_000, b'{"x": ' + b"9" * 10_000 + b"}",
    b'{"Pod": {"metadata": {"name": "' + b"n" * 300_000 + b'"}}}',
    b'{"NodeNames": ' + b"[" * 2_000 + b"]" * 2_000 + b"}",
    b'{"Pod": {}, "Pod": [], "Pod": null}',
)


# -- a server loop on a thread ----------------------------------------------------------------

class LoopThread:
    """An asyncio loop on a daemon thread, so that synchronous Hypothesis tests can talk to
    a real server running in it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop",
                                       daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def close(self) -> None:
        async def cancel_the_rest() -> None:  # connections the servers' cleanup left
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


# -- HTTP -------------------------------------------------------------------------------------

def request(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None,
         timeout_s: float = ANSWER_TIMEOUT_S) -> tuple[int, dict[str, str], bytes]:
    """One request on a new connection; (status, headers, body). A socket timeout (a hang)
    raises."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        # header values as UTF-8 bytes (http.client would insist on latin-1)
        conn.request(method, path, body=body,
                     headers={k: v.encode() for k, v in (headers or {}).items()})
        r = conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        conn.close()


def raw_http(port: int, data: bytes, timeout_s: float = ANSWER_TIMEOUT_S,
             patience_s: float = 1.0) -> bytes:
    """Send ``data`` as it is (a malformed request) and read what comes back until the server
    closes. A server still silent after ``patience_s`` is waiting for the rest of a request
    cut short: the client half-closes (it went away) and reads on. A server that neither
    answers nor closes within ``timeout_s`` more is a hang (raises)."""
    with socket.create_connection(("127.0.0.1", port), timeout=patience_s) as s:
        out = b""
        try:
            s.sendall(data)
            out = s.recv(65536)
        except TimeoutError:
            pass  # waiting for the rest of the request: the client gives up below
        except (BrokenPipeError, ConnectionResetError):
            return out  # the server refused the rest and closed
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_WR)  # no more requests on this connection
        s.settimeout(timeout_s)
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def status_of(answer: bytes) -> int | None:
    """The status code of a raw HTTP answer (None when nothing came back)."""
    if not answer.startswith(b"HTTP/1."):
        return None
    return int(answer.split(b" ", 2)[1])
