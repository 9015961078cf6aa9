"""Prometheus metrics and the structured access log of the router.

Counters and the latency histogram are updated per request; per-replica gauges (outstanding,
health, learned service time, weight) are read from the replica table at scrape time, so the
hot path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuslice.adapters.http.proxy import RequestRecord

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)
# time to first token and time per output token (vLLM's own histograms use buckets of this
# range: vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0)
TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class ReplicaGauge:
    service: str
    replica: str
    outstanding: int
    healthy: bool
    weight: float
    service_time_s: float
    samples: int


class _TableCollector(Collector):
    def __init__(self, snapshot: Callable[[], Iterable[ReplicaGauge]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["service", "replica"]
        out = GaugeMetricFamily("gpuslice_router_outstanding_requests",
                                "Requests in flight to the replica through this router",
                                labels=labels)
        up = GaugeMetricFamily("gpuslice_router_replica_healthy",
                               "1 when the replica takes traffic, 0 when taken out", labels=labels)
        wt = GaugeMetricFamily("gpuslice_router_replica_weight",
                               "Capability weight of the replica", labels=labels)
        st = GaugeMetricFamily("gpuslice_router_service_time_seconds",
                               "Learned service time of a size-1 request (EWMA)", labels=labels)
        n = GaugeMetricFamily("gpuslice_router_service_time_samples",
                              "Observations behind the learned service time", labels=labels)
        for g in self.snapshot():
            key = [g.service, g.replica]
            out.add_metric(key, g.outstanding)
            up.add_metric(key, 1.0 if g.healthy else 0.0)
            wt.add_metric(key, g.weight)
            st.add_metric(key, g.service_time_s)
            n.add_metric(key, g.samples)
        yield from (out, up, wt, st, n)


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], Iterable[ReplicaGauge]]) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("gpuslice_router_request_duration_seconds",
                                 "Latency seen by clients, by replica that answered",
                                 ["service", "replica"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.requests = Counter("gpuslice_router_requests", "Requests answered, by status code",
                                ["service", "replica", "code"], registry=self.registry)
        self.rejects = Counter("gpuslice_router_rejects",
                               "Requests refused by the router (429 admission, 503, 4xx)",
                               ["service", "reason"], registry=self.registry)
        self.retries = Counter("gpuslice_router_retries",
                               "Requests retried on another replica", ["service"],
                               registry=self.registry)
        self.ttft = Histogram("gpuslice_router_time_to_first_token_seconds",
                              "Generative streams: from the request sent to the replica to its "
                              "first token", ["service", "replica"], buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.tpot = Histogram("gpuslice_router_time_per_output_token_seconds",
                              "Generative streams: mean time between output tokens after the "
                              "first", ["service", "replica"], buckets=TPOT_BUCKETS,
                              registry=self.registry)
        self.registry.register(_TableCollector(snapshot))
        self._children: dict[tuple[str, str, int], tuple[Histogram, Counter]] = {}

    def observe(self, rec: RequestRecord) -> None:
        if rec.replica:
            key = (rec.service, rec.replica, rec.status)
            children = self._children.get(key)
            if children is None:
                children = self._children[key] = (
                    self.latency.labels(rec.service, rec.replica),
                    self.requests.labels(rec.service, rec.replica, str(rec.status)))
            children[0].observe(rec.latency_s)
            children[1].inc()
            if rec.ttft_s is not None:
                self.ttft.labels(rec.service, rec.replica).observe(rec.ttft_s)
            if rec.tpot_s is not None:
                self.tpot.labels(rec.service, rec.replica).observe(rec.tpot_s)
            if rec.attempts > 1:
                self.retries.labels(rec.service).inc()
        else:
            reason = "slo" if rec.status == 429 else str(rec.status)
            self.rejects.labels(rec.service or "-", reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class AccessLog:
    """One JSON object per request and line; the caller flushes now and then."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, rec: RequestRecord) -> None:
        line = {
            "ts": round(rec.ts, 6), "method": rec.method, "path": rec.path,
            "status": rec.status, "service": rec.service, "replica": rec.replica,
            "latency_ms": round(rec.latency_s * 1e3, 3),
            "upstream_ms": round(rec.upstream_s * 1e3, 3),
            "predicted_ms": round(rec.predicted_s * 1e3, 3), "size": rec.size,
            "attempts": rec.attempts, "request_id": rec.request_id, "client": rec.client,
        }
        if rec.tokens_in is not None:  # a generative request
            line["tokens_in"] = rec.tokens_in
            line["tokens_out"] = rec.tokens_out
            line["ttft_ms"] = None if rec.ttft_s is None else round(rec.ttft_s * 1e3, 3)
            line["tpot_ms"] = None if rec.tpot_s is None else round(rec.tpot_s * 1e3, 3)
        if rec.error:
            line["error"] = rec.error
        self.stream.write(orjson.dumps(line).decode() + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _counts(text: str, by: str, ok_only: bool) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "gpuslice_router_requests":
            for smp in fam.samples:
                if not smp.name.endswith("_total"):
                    continue
                if ok_only and not smp.labels.get("code", "").startswith("2"):
                    continue
                key = smp.labels.get(by, "")
                out[key] = out.get(key, 0.0) + smp.value
        elif fam.name == "gpuslice_router_rejects" and by == "service" and not ok_only:
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    key = smp.labels.get("service", "")
                    out[key] = out.get(key, 0.0) + smp.value
    return out


async def request_rates(admin_url: str, window_s: float, *, by: str = "replica",
                        ok_only: bool = True) -> dict[str, float]:
    """Requests/s per replica (or per service, answered and refused alike with ``ok_only``
    False: the offered load) over ``window_s``, from the router's Prometheus counters read at
    both ends of the window."""
    import asyncio
    import time

    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async def scrape() -> dict[str, float]:
            async with session.get(admin_url.rstrip("/") + "/metrics") as r:
                return _counts(await r.text(), by, ok_only)

        a = await scrape()
        t0 = time.monotonic()
        await asyncio.sleep(window_s)
        b = await scrape()
        dt = time.monotonic() - t0
    return {k: (b.get(k, 0.0) - a.get(k, 0.0)) / dt for k in set(a) | set(b)}
