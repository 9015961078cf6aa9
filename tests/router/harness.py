"""Contract-test harness: fake replicas as real processes, the real router in the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp

from gpuslice.core.routing_config import RouterConfig, parse_router_config
from gpuslice.services.router import RouterApp, start_router


@contextlib.contextmanager
def backend(name: str = "r", service_ms: float = 0.0, concurrency: int = 4, garbage: bool = False,
            dist: str = "det") -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A fake replica process on 127.0.0.1; yields (port, process)."""
    args = [sys.executable, "-m", "gpuslice.adapters.http.fake_replica", "--port", "0",
            "--name", name, "--service-ms", str(service_ms), "--concurrency", str(concurrency),
            "--dist", dist]
    if garbage:
        args.append("--garbage")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()  # blocks until "ready PORT" (or EOF if it died)
        if not line.startswith("ready"):
            raise RuntimeError(f"fake replica did not start: {line!r}")
        yield int(line.split()[1]), p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


def config(replicas: list[dict[str, Any]], **top: Any) -> RouterConfig:
    svc = {"name": "m", "replicas": replicas}
    for key in ("slo_ms", "admission"):
        if key in top:
            svc[key] = top.pop(key)
    top.setdefault("health", {"interval_s": 0.1, "timeout_s": 1.0})
    return parse_router_config({"services": [svc], **top})


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def router(cfg: RouterConfig, **kw: Any) -> AsyncIterator[tuple[RouterApp,
                                                                         aiohttp.ClientSession]]:
    app = await start_router(cfg, **kw)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        yield app, session
    finally:
        await session.close()
        await app.close()


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 15.0
                     ) -> None:
    """Wait (bounded, generously) until ``check`` holds; not a timing assertion."""
    end = time.monotonic() + timeout_s
    while True:
        res = check()
        if not isinstance(res, bool):
            res = await res
        if res:
            return
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def body(data: bytes | str) -> dict[str, Any]:
    return json.loads(data)  # type: ignore[no-any-return]
