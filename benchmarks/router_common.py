"""Shared pieces of the router benchmarks: backend and router processes on 127.0.0.1, and an
open-loop Poisson load generator (one asyncio process, schedule drawn up front)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from gpuslice.adapters.proc import wait_line

PY = sys.executable


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    port: int

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start_backend(name: str, service_ms: float, dist: str, concurrency: int, seed: int,
                  extra: Sequence[str] = ()) -> Proc:
    p = subprocess.Popen(
        [PY, "-m", "gpuslice.adapters.http.fake_replica", "--port", "0", "--name", name,
         "--service-ms", str(service_ms), "--dist", dist, "--concurrency", str(concurrency),
         "--seed", str(seed), "--uvloop", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = wait_line(p, "ready")
    return Proc(p, int(line.split()[1]))


def start_router(config: dict[str, object], policy: str | None = None,
                 extra: Sequence[str] = (), access_log: str = "off") -> Proc:
    fd, path = tempfile.mkstemp(prefix="gpuslice-router-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    args = [PY, "-m", "gpuslice.cli", "router", "--config", path, "--listen", "127.0.0.1:0",
            "--admin", "127.0.0.1:0", "--access-log", access_log, "--log-format", "json", *extra]
    if policy:
        args += ["--policy", policy]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    line = wait_line(p, "listening", stream="stderr")
    Path(path).unlink(missing_ok=True)
    return Proc(p, int(json.loads(line)["port"]))


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@dataclass
class LoadResult:
    offered_rps: float
    latency_s: np.ndarray  # per request, from its scheduled send time (NaN: failed)
    status: np.ndarray
    send_s: np.ndarray  # actual send time offsets
    elapsed_s: float
    warmup: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def window(self) -> slice:
        return slice(self.warmup, None)

    def ok(self) -> np.ndarray:
        lat = self.latency_s[self.window()]
        st = self.status[self.window()]
        return lat[(st == 200) & np.isfinite(lat)]

    def pct(self, q: float) -> float:
        ok = self.ok()
        return float(np.percentile(ok, q)) if len(ok) else float("nan")

    def rejects(self) -> int:
        return int(np.sum(self.status[self.window()] == 429))

    def errors(self) -> int:
        st = self.status[self.window()]
        return int(np.sum((st != 200) & (st != 429)))

    def throughput(self) -> float:
        return float(np.sum(self.status == 200)) / self.elapsed_s

    def overloaded(self) -> bool:
        """The replicas could not keep up: answers came at less than 95% of the offered rate
        (the backlog left at the end of the run takes longer to drain than the run itself
        lasted, at this margin)."""
        return self.throughput() < 0.95 * self.offered_rps


def _schedule(rate: float, duration_s: float,
              seed: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Open-loop Poisson send offsets for ``rate`` over ``duration_s``, and the empty per-request
    latency, status and send-time columns."""
    rng = np.random.default_rng(seed)
    n = max(1, int(rate * duration_s))
    offsets = np.cumsum(rng.exponential(1.0 / rate, n))
    return n, offsets, np.full(n, np.nan), np.zeros(n, dtype=np.int64), np.zeros(n)


async def drive(url: str, rate: float, duration_s: float, seed: int, *,
                body: bytes = b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32",'
                b'"data":[1.0]}]}', method: str = "POST", from_send: bool = False,
                timeout_s: float = 60.0, warmup_frac: float = 0.1,
                session: aiohttp.ClientSession | None = None,
                progress: object = None) -> LoadResult:
    """Open-loop Poisson arrivals at ``rate`` for ``duration_s``; returns per-request latencies
    measured from the scheduled send time (or the actual send time with ``from_send``)."""
    n, offsets, lat, status, sent = _schedule(rate, duration_s, seed)
    clock = time.perf_counter
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=timeout_s))
    headers = {"Content-Type": "application/json"}
    t0 = clock() + 0.05

    async def one(i: int, sched: float) -> None:
        start = clock()
        sent[i] = start - t0
        try:
            async with session.request(method, url, data=body, headers=headers) as r:
                await r.read()
                status[i] = r.status
        except (aiohttp.ClientError, TimeoutError):
            status[i] = -1
        lat[i] = clock() - (start if from_send else sched)

    tasks = []
    for i in range(n):
        target = t0 + float(offsets[i])
        delay = target - clock()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, target)))
        if progress is not None and i % 200 == 0:
            progress(i, n)  # type: ignore[operator]
    await asyncio.gather(*tasks)
    elapsed = clock() - t0
    if own:
        await session.close()
    return LoadResult(rate, lat, status, sent, elapsed, int(n * warmup_frac))


def run_loop(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class _RawConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 client connection that expects Content-Length answers."""

    def __init__(self, pool: list[_RawConn]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.waiter: asyncio.Future[int] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(-1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end]
        i = head.lower().find(b"content-length:")
        length = int(head[i + 15:].split(b"\r\n", 1)[0]) if i >= 0 else 0
        if len(self.buf) < end + 4 + length:
            return
        status = int(head[9:12])
        self.buf = self.buf[end + 4 + length:]
        waiter, self.waiter = self.waiter, None
        self.pool.append(self)
        if waiter is not None and not waiter.done():
            waiter.set_result(status)


async def drive_raw(host: str, port: int, path: str, rate: float, duration_s: float,
                    seed: int, body: bytes = b'{"inputs":[]}', warmup_frac: float = 0.05
                    ) -> LoadResult:
    """Like :func:`drive` with a minimal client (so the load generator leaves the CPU to the
    router): keep-alive connections, a new one whenever all are busy; latency from send."""
    n, offsets, lat, status, sent = _schedule(rate, duration_s, seed)
    loop = asyncio.get_running_loop()
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
               f"\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    pool: list[_RawConn] = []
    conns: list[_RawConn] = []
    clock = time.perf_counter

    async def one(i: int) -> None:
        conn = None
        while pool:
            c = pool.pop()
            if not c.closed:
                conn = c
                break
        start = clock()
        sent[i] = start
        if conn is None:
            _, conn = await loop.create_connection(lambda: _RawConn(pool), host, port)
            conns.append(conn)
        fut: asyncio.Future[int] = loop.create_future()
        conn.waiter = fut
        assert conn.transport is not None
        conn.transport.write(request)
        status[i] = await fut
        lat[i] = clock() - start

    t0 = clock() + 0.05
    tasks = []
    for i in range(n):
        delay = t0 + float(offsets[i]) - clock()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    elapsed = clock() - t0
    for c in conns:
        if c.transport is not None:
            c.transport.close()
    return LoadResult(rate, lat, status, sent, elapsed, int(n * warmup_frac))
