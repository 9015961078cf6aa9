"""The router's generative side (issue 52): each replica's token speed from its slice, the
service's learned output length, and the scrape of the replicas' own load (vLLM's gauges).

Priors. A replica of a generative service (``"api": "openai"``) starts from its configured
``prefill_tokens_per_s`` / ``decode_tokens_per_s`` (the planner's generative profile of its
slice), else from defaults scaled by its weight against the service's strongest replica (a
slice with a third of the throughput prefills and decodes three times slower); the router then
corrects both online from the TTFT and TPOT it measures (``core/routing_llm.py``).

Scrape. Every replica of a service with a ``metrics_path`` is read at most every
``every_s`` (200 ms), each read bounded in time (``timeout_s``) and size
(``adapters/http/engine_metrics.MAX_BYTES``). A replica whose last good read is older than
``stale_after_s`` (1 s) is routed on the router's own count alone; one whose page has no vLLM
gauges (a server of another make) is read again only every ``unsupported_every_s`` (30 s).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp

from gpuslice.adapters.http.engine_metrics import MAX_BYTES, parse_engine_metrics
from gpuslice.core.routing_config import ReplicaSpec, ServiceSpec
from gpuslice.core.routing_llm import (
    DEFAULT_PREFILL_TPS,
    DEFAULT_TPOT_S,
    EngineLoad,
    TokenSpeed,
)

log = logging.getLogger("gpuslice.router")


def token_speed(spec: ServiceSpec, r: ReplicaSpec) -> TokenSpeed | None:
    """The prior token speed of replica ``r`` of ``spec`` (None: not a generative service)."""
    if not spec.generative:
        return None
    top = max((x.weight for x in spec.replicas), default=1.0)
    rel = r.weight / top
    prefill = r.prefill_tps if r.prefill_tps is not None else DEFAULT_PREFILL_TPS * rel
    tpot = 1.0 / r.decode_tps if r.decode_tps is not None else DEFAULT_TPOT_S / rel
    return TokenSpeed(prefill_tps=prefill, tpot_s=tpot, kv_tokens=r.kv_tokens)


def learned_speed(speed: TokenSpeed | None, prev: TokenSpeed | None) -> TokenSpeed | None:
    """A reloaded replica's new prior ``speed`` with what was learned of it (``prev``) kept."""
    if speed is None or prev is None:
        return speed
    return replace(speed, ttft_ratio=prev.ttft_ratio, tpot_ratio=prev.tpot_ratio,
                   samples=prev.samples)


def describe_tokens(t: TokenSpeed | None, eng: EngineLoad | None) -> dict[str, object]:
    """A generative replica's speed as learned, and its gauges when fresh (``describe``)."""
    if t is None:
        return {}
    return {"prefill_tokens_per_s": round(t.prefill_tps / t.ttft_ratio, 1),
            "tpot_ms": round(t.tpot_now_s * 1e3, 3), "token_samples": t.samples,
            "engine": None if eng is None else {
                "running": eng.running, "waiting": eng.waiting, "kv_cache_usage": eng.kv_usage}}


@dataclass
class EngineGauges:
    """The last good read of each replica's gauges, and when; replicas found without them."""

    stale_after_s: float = 1.0
    loads: dict[tuple[str, str], tuple[EngineLoad, float]] = field(default_factory=dict)
    unsupported: dict[tuple[str, str], float] = field(default_factory=dict)

    def fresh(self, service: str, replica: str, now: float) -> EngineLoad | None:
        got = self.loads.get((service, replica))
        if got is None or now - got[1] > self.stale_after_s:
            return None
        return got[0]

    def put(self, service: str, replica: str, load: EngineLoad | None, now: float) -> None:
        key = (service, replica)
        if load is None:
            self.unsupported[key] = now
            self.loads.pop(key, None)
        else:
            self.unsupported.pop(key, None)
            self.loads[key] = (load, now)

    def keep(self, keys: set[tuple[str, str]]) -> None:
        """Forget replicas that left the replica set."""
        for d in (self.loads, self.unsupported):
            for k in [k for k in d if k not in keys]:
                del d[k]


Targets = Callable[[], list[tuple[str, str, str]]]  # (service, replica, metrics URL)


async def scrape_once(session: aiohttp.ClientSession, url: str, timeout_s: float
                      ) -> EngineLoad | BaseException | None:
    """One bounded read: the load, None (no vLLM gauges there), or the error."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None if resp.status == 404 else OSError(f"HTTP {resp.status}")
            if (resp.content_length or 0) > MAX_BYTES:
                return OSError(f"metrics page over {MAX_BYTES} bytes")
            body = await resp.content.read(MAX_BYTES + 1)
            if len(body) > MAX_BYTES:
                return OSError(f"metrics page over {MAX_BYTES} bytes")
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        return exc
    return parse_engine_metrics(body)


async def engine_loop(gauges: EngineGauges, targets: Targets, session: aiohttp.ClientSession,
                      every_s: float = 0.2, timeout_s: float = 0.5,
                      unsupported_every_s: float = 30.0) -> None:
    """Read every target's gauges, then wait so that no target is read more often than every
    ``every_s`` (a slow replica delays its own next read, never the others' by more than the
    timeout)."""
    every_s = max(0.2, every_s)
    warned: set[tuple[str, str]] = set()
    while True:
        start = time.monotonic()
        batch = []
        for service, replica, url in targets():
            key = (service, replica)
            since = gauges.unsupported.get(key)
            if since is not None and start - since < unsupported_every_s:
                continue
            batch.append((key, url))
        results = await asyncio.gather(*(scrape_once(session, url, timeout_s)
                                         for _, url in batch))
        now = time.monotonic()
        for (key, url), res in zip(batch, results, strict=True):
            if isinstance(res, BaseException):
                if key not in warned:
                    warned.add(key)
                    log.info("cannot read %s (%s): routing %s/%s on the router's own count",
                             url, res, *key, extra={"event": "engine-metrics-unreadable"})
                continue
            warned.discard(key)
            gauges.put(*key, res, now)
        gauges.keep({k for k, _ in [((s, r), u) for s, r, u in targets()]})
        await asyncio.sleep(max(0.0, every_s - (time.monotonic() - start)))
