"""Contract tier: a rollout of the router under load loses no request. Two ``gpuslice router``
processes in front of two replica processes (one slow), behind a stand-in of their Service:
the client sends each new request to a router of the current endpoint list, on kept-alive
connections, as a client of a Service does through kube-proxy. One router gets SIGTERM, and
its endpoint leaves the list half a second later (the EndpointSlice update reaching
kube-proxy); POSTs (never retried) and long streams run through it all."""

from __future__ import annotations

import asyncio
import json
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.router.harness import backend, url

DELAY_S = 1.5  # --shutdown-delay
REMOVED_AFTER_S = 0.5  # the endpoint leaves the Service's list this long after SIGTERM
STREAM_CHUNKS, STREAM_EVERY_MS = 20, 100  # a 2 s stream


def _start_router(cfg: Path, log: Path) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(
        [sys.executable, "-m", "gpuslice.cli", "router", "--config", str(cfg), "--listen",
         "127.0.0.1:0", "--admin", "127.0.0.1:0", "--access-log", str(log), "--log-format",
         "json", "--no-admission", "--shutdown-delay", str(DELAY_S), "--shutdown-grace", "10"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stderr, selectors.EVENT_READ)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if sel.select(timeout=0.2):
            line = p.stderr.readline()
            if '"listening"' in line:
                return p, int(json.loads(line)["port"])
            if not line:
                break
    p.kill()
    raise AssertionError("router did not start")


async def _load(endpoints: list[int], t0: float, until_s: float,
                out: list[tuple[str, int, float, int, str]]) -> None:
    """POSTs at 60/s and a 2-s stream every 0.25 s, each to the next router of
    ``endpoints`` (as it is when the request is sent); records (kind, router port, sent at,
    status, error)."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        turns = {"post": 0, "stream": 0}  # round robin per kind

        async def one(kind: str) -> None:
            port = endpoints[turns[kind] % len(endpoints)]
            turns[kind] += 1
            at = time.monotonic() - t0
            try:
                if kind == "post":
                    async with s.post(url(port) + "/v2/models/m/infer", data=b"{}") as r:
                        await r.read()
                        out.append((kind, port, at, r.status, ""))
                else:
                    async with s.get(url(port) + f"/stream?n={STREAM_CHUNKS}"
                                     f"&every_ms={STREAM_EVERY_MS}") as r:
                        text = (await r.read()).decode()
                        ok = text.count("data:") == STREAM_CHUNKS
                        out.append((kind, port, at, r.status if ok else -1,
                                    "" if ok else f"cut after {text.count('data:')} chunks"))
            except (aiohttp.ClientError, TimeoutError) as exc:
                out.append((kind, port, at, 0, f"{type(exc).__name__}: {exc}"))

        tasks = []
        n = 0
        while time.monotonic() - t0 < until_s:
            tasks.append(asyncio.create_task(one("post")))
            if n % 15 == 0:
                tasks.append(asyncio.create_task(one("stream")))
            n += 1
            await asyncio.sleep(1 / 60)
        await asyncio.gather(*tasks)


def test_a_router_rollout_under_load_fails_no_request(tmp_path: Path) -> None:
    with backend("fast", service_ms=20, concurrency=16) as (pf, _), \
            backend("slow", service_ms=400, concurrency=16) as (ps, _):
        cfg = tmp_path / "router.json"
        cfg.write_text(json.dumps({"policy": "round-robin", "services": [{
            "name": "m", "replicas": [{"name": "fast", "url": url(pf)},
                                      {"name": "slow", "url": url(ps)}]}]}))
        a, port_a = _start_router(cfg, tmp_path / "a.log")
        b, port_b = _start_router(cfg, tmp_path / "b.log")
        try:
            endpoints = [port_a, port_b]
            out: list[tuple[str, int, float, int, str]] = []

            async def go() -> None:
                t0 = time.monotonic()
                load = asyncio.create_task(_load(endpoints, t0, 5.0, out))
                await asyncio.sleep(1.5)
                a.send_signal(signal.SIGTERM)
                stopped_at = time.monotonic() - t0
                await asyncio.sleep(REMOVED_AFTER_S)
                endpoints.remove(port_a)  # the EndpointSlice update reaches the clients
                await load
                out.append(("sigterm", port_a, stopped_at, 0, ""))

            asyncio.run(go())
            assert a.wait(20) == 0  # delay + the last requests, well within the grace
            failed = [x for x in out if x[0] != "sigterm" and x[3] != 200]
            assert not failed, failed[:5]
            stopped_at = next(x[2] for x in out if x[0] == "sigterm")
            after = [x for x in out if x[1] == port_a and x[0] == "post"
                     and x[2] > stopped_at + 0.05]
            assert after  # requests sent to the stopping router meanwhile were answered
            streams = [x for x in out if x[0] == "stream" and x[1] == port_a
                       and stopped_at - 2.0 < x[2] < stopped_at]
            assert streams  # streams under way at SIGTERM ran to their end
        finally:
            for p in (a, b):
                if p.poll() is None:
                    p.kill()
                p.wait(10)
                if p.stderr is not None:
                    p.stderr.close()

