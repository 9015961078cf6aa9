"""The demo's load: open-loop Poisson requests through the router, one generator per service
(KServe-style inference requests, or streamed chat completions for a generative service), and
the latency figures of what came back, against each service's SLOs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import numpy as np

from gpuslice.bench.stream import chat_body, stream_chat
from gpuslice.core.errors import ValidationError
from gpuslice.core.generative import GenerativeService
from gpuslice.core.planner import Service
from gpuslice.demo.runtime import EventLog


@dataclass
class Sample:
    service: str
    t: float  # send time, seconds since the demo started
    latency_s: float  # to the whole answer (a stream's end)
    status: int  # 0: connection error (or a stream that broke off)
    ttft_s: float | None = None  # a streamed answer's: to the first token
    tpot_s: float | None = None  # per output token after the first


class Driven(Protocol):
    """Where the load goes and what it records (the demo's state)."""

    samples: list[Sample]
    router_port: int

    @property
    def log(self) -> EventLog: ...


async def open_loop(rate: float, stop: asyncio.Event, rng: np.random.Generator,
                    send: Callable[[float, int], Coroutine[Any, Any, None]]) -> None:
    """Call ``send(send time, n)`` at Poisson arrivals of ``rate`` per second, each in its own
    task, until ``stop``; then wait up to 10 s for those still running."""
    if not rate > 0:
        raise ValidationError("rate", "a request rate > 0 per second", rate)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    next_at = loop.time()
    n = 0
    while not stop.is_set():
        next_at += float(rng.exponential(1.0 / rate))
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        n += 1
        t = asyncio.create_task(send(time.monotonic(), n))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=10)


async def load(state: Driven, session: aiohttp.ClientSession, svc: Service,
               stop: asyncio.Event, rng: np.random.Generator) -> None:
    """Inference requests (Open Inference Protocol v2) to ``svc`` at its rate."""
    url = f"http://127.0.0.1:{state.router_port}/v2/models/{svc.name}/infer"
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                   "data": [0.5]}]}).encode()

    async def one(t_send: float, n: int) -> None:
        status = 0
        try:
            async with session.post(url, data=body, headers={
                    "Content-Type": "application/json",
                    "Idempotency-Key": f"{svc.name}-{n}"}) as r:
                await r.read()
                status = r.status
        except (TimeoutError, aiohttp.ClientError):
            status = 0
        state.samples.append(Sample(svc.name, t_send - state.log.t0,
                                    time.monotonic() - t_send, status))

    await open_loop(svc.rate, stop, rng, one)


async def chat_load(state: Driven, session: aiohttp.ClientSession, svc: GenerativeService,
                    stop: asyncio.Event, rng: np.random.Generator) -> None:
    """Streamed chat completions to ``svc``'s model at its rate, each with its mean prompt and
    output length; the time to the first token and per output token measured here, at the
    client, from the send."""
    url = f"http://127.0.0.1:{state.router_port}/v1/chat/completions"
    body = chat_body(svc.model, max(1, round(svc.prompt_tokens)),
                     max(1, round(svc.output_tokens)))

    async def one(t_send: float, n: int) -> None:
        r = await stream_chat(session, url, body, t_send, time.monotonic)
        # a 200 whose stream broke off before its end failed, as a connection error did
        status = r.status if r.status > 0 and (r.status != 200 or r.done) else 0
        state.samples.append(Sample(svc.name, t_send - state.log.t0,
                                    time.monotonic() - t_send, status, r.ttft_s, r.tpot_s))

    await open_loop(svc.rate, stop, rng, one)


def _pct(ms: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(ms, q)), 2) if len(ms) else None


def _counts(samples: Sequence[Sample]) -> dict[str, int]:
    return {"sent": len(samples), "ok": sum(1 for s in samples if s.status == 200),
            "rejected": sum(1 for s in samples if s.status == 429),
            "failed": sum(1 for s in samples if s.status not in (200, 429))}


def stats(samples: list[Sample], slo_ms: float) -> dict[str, Any]:
    lat = [s.latency_s * 1000 for s in samples if s.status == 200]
    out: dict[str, Any] = {**_counts(samples), "p50_ms": _pct(lat, 50),
                           "p99_ms": _pct(lat, 99), "slo_ms": slo_ms}
    out["slo_met"] = out["p99_ms"] is not None and out["p99_ms"] <= slo_ms and not out["failed"]
    return out


def chat_stats(samples: list[Sample], svc: GenerativeService) -> dict[str, Any]:
    """A generative service's figures: the time to the first token and per output token
    (p50, p99 over the answered streams) against its TTFT and TPOT SLOs; its SLOs are met
    when both p99s are within them and no request failed."""
    ok = [s for s in samples if s.status == 200]
    ttft = [s.ttft_s * 1000 for s in ok if s.ttft_s is not None]
    tpot = [s.tpot_s * 1000 for s in ok if s.tpot_s is not None]
    out: dict[str, Any] = {
        "api": "openai", **_counts(samples),
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
        "slo_ttft_ms": svc.slo_ttft_ms,
        "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99),
        "slo_tpot_ms": svc.slo_tpot_ms}
    for key, slo in (("ttft", svc.slo_ttft_ms), ("tpot", svc.slo_tpot_ms)):
        p99 = out[f"{key}_p99_ms"]
        out[f"{key}_slo_met"] = p99 is not None and p99 <= slo
    out["slo_met"] = out["ttft_slo_met"] and out["tpot_slo_met"] and not out["failed"]
    return out
