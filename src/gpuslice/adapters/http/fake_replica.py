"""A fake model replica behind a real HTTP port, for contract tests and benchmarks.

It serves the Open Inference Protocol v2 paths (``/v2/health/ready``, ``/v2/models/M/infer``)
and answers any other path as well. Service times follow a distribution (``det`` or ``exp``)
with a mean, times the batch size (``X-Batch-Size`` header) when ``--per-item`` is set, and at
most ``concurrency`` requests are served at once: the replica is an exact M/G/c queue in virtual
time (each request's finish time is computed on arrival, so timer granularity does not change
its capacity). ``/stream?n=N&every_ms=T`` answers N chunks T ms apart; ``--garbage`` answers
with bytes that are not HTTP.

    python -m gpuslice.adapters.http.fake_replica --port 0 --service-ms 20 --dist exp \
        --concurrency 2     # prints "ready PORT" once listening
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from aiohttp import web


class FakeReplica:
    def __init__(self, name: str, service_ms: float, dist: str = "det", concurrency: int = 1,
                 seed: int = 0, per_item: bool = False) -> None:
        if dist not in ("det", "exp"):
            raise ValueError(f"dist: expected det or exp, got {dist!r}")
        if concurrency < 1:
            raise ValueError(f"concurrency: expected >= 1, got {concurrency}")
        self.name = name
        self.mean_s = max(0.0, service_ms) / 1e3
        self.dist = dist
        self.per_item = per_item
        self.rng = random.Random(seed)
        self.free_at = [0.0] * concurrency
        self.served = 0

    def draw(self, size: int) -> float:
        s = self.mean_s if self.dist == "det" else self.rng.expovariate(1 / self.mean_s)
        return s * size if self.per_item else s

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path.endswith(("/health/ready", "/health/live")) or path == "/healthz":
            return web.Response(text='{"ready": true}', content_type="application/json")
        body = await request.read()
        if path == "/stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            every_s = float(request.query.get("every_ms", "1")) / 1e3  # a long stream: more
            for i in range(int(request.query.get("n", "5"))):
                await resp.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(every_s)
            await resp.write_eof()
            return resp
        if path == "/status":
            code = int(request.query.get("code", "500"))
            return web.Response(status=code, text=f"status {code} from {self.name}")
        size = 1
        raw = request.headers.get("X-Batch-Size")
        if raw is not None and raw.isdigit():
            size = max(1, int(raw))
        if self.mean_s > 0:
            loop = asyncio.get_running_loop()
            now = loop.time()
            start = max(now, self.free_at[0])
            finish = start + self.draw(size)
            heapq.heapreplace(self.free_at, finish)
            await asyncio.sleep(finish - now)
        self.served += 1
        out = {"model_name": self.name, "id": request.headers.get("X-Request-Id", ""),
               "outputs": [{"name": "out", "shape": [size], "datatype": "INT64",
                            "data": [len(body)] * size}]}
        return web.Response(text=json.dumps(out), content_type="application/json",
                            headers={"X-Replica": self.name})


async def _garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.read(65536)
        writer.write(b"\x00\x01 this is not HTTP \xff\r\n\r\n")
        await writer.drain()
    finally:
        writer.close()


class _RawNoop(asyncio.Protocol):
    """Minimal HTTP/1.1 keep-alive server answering every request at once with a fixed body:
    the cheapest possible backend, for measuring the router's own overhead."""

    RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                b"\r\n{}")

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buf[:end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                length = int(head[i + 15:].split(b"\r\n", 1)[0])
            if len(self.buf) < end + 4 + length:
                break
            self.buf = self.buf[end + 4 + length:]
            out.append(self.RESPONSE)
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.garbage:
        server = await asyncio.start_server(_garbage, args.host, args.port)
        port = server.sockets[0].getsockname()[1]
        print(f"ready {port}", flush=True)
        await stop.wait()
        server.close()
        return
    if args.raw_noop:
        raw = await loop.create_server(_RawNoop, args.host, args.port, backlog=1024)
        print(f"ready {raw.sockets[0].getsockname()[1]}", flush=True)
        await stop.wait()
        raw.close()
        return
    replica = FakeReplica(args.name, args.service_ms, args.dist, args.concurrency, args.seed,
                          args.per_item)
    runner = web.ServerRunner(web.Server(replica.handle, access_log=None))
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024)
    await site.start()
    port = runner.addresses[0][1]
    print(f"ready {port}", flush=True)
    await stop.wait()
    await runner.cleanup()


def hold_mps_client(name: str) -> None:
    """Be an MPS client of the daemon in ``CUDA_MPS_PIPE_DIRECTORY`` (the stand-in's,
    :mod:`gpuslice.adapters.mps.standin`) for the life of this process, and fail as a CUDA
    process does when the daemon goes: what makes a replica on an MPS slice depend on its
    daemon's lifetime (the node tier's upgrade test)."""
    import os
    import threading

    from gpuslice.adapters.mps.standin import RPC_FAILURE, Client

    try:
        client = Client(name)
    except ConnectionError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(f"mps client: {json.dumps(client.limits)}", flush=True)

    def watch() -> None:
        client.wait()
        print(RPC_FAILURE, file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fake model replica (tests and benchmarks)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--name", default="replica")
    ap.add_argument("--service-ms", type=float, default=0.0)
    ap.add_argument("--dist", choices=("det", "exp"), default="det")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-item", action="store_true", help="service time x batch size")
    ap.add_argument("--garbage", action="store_true", help="answer with bytes that are not HTTP")
    ap.add_argument("--raw-noop", action="store_true",
                    help="minimal keep-alive HTTP server answering {} at once (overhead runs)")
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--mps-client", action="store_true",
                    help="be a stand-in MPS client for the process's life; exit 1 (as CUDA "
                    "would fail) when the daemon goes")
    args = ap.parse_args(argv)
    if args.mps_client:
        hold_mps_client(args.name)
    run_serving(serve(args), args.uvloop)
    return 0


def run_serving(main: Coroutine[Any, Any, None], use_uvloop: bool) -> None:
    """Run a stand-in server's coroutine to its end, on uvloop when asked and installed."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is optional
            pass
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


if __name__ == "__main__":
    sys.exit(main())
