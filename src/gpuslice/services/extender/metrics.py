"""Prometheus metrics of the scheduler extender (``GET /metrics`` on its port), so that the
control-plane path is not opaque: how long filter, prioritize and bind take, how many nodes
filter rejects and why, how binds end, and what the ledger holds per node (read at scrape time
from the extender's state, so nothing is counted twice)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class LedgerSource(Protocol):
    """What the metrics read from the extender at scrape time (the extender's state is one;
    this module needs nothing else of it, so it does not import the extender)."""

    @property
    def node_gpus(self) -> Sequence[tuple[str, Sequence[str]]]: ...  # (node, GPU UUIDs)
    @property
    def used_milli(self) -> Mapping[str, int]: ...  # GPU UUID -> milli held
    @property
    def assignments(self) -> int: ...
    @property
    def cordoned_gpus(self) -> int: ...
    @property
    def problem_count(self) -> int: ...
    @property
    def binds_here(self) -> bool: ...  # holds the lease, or runs alone


OPEN_KEPT = 64  # connections held before the closed ones are dropped
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def rejection_kind(reason: str) -> str:
    """A small, fixed set of label values for filter's per-node reasons (prefix checks: filter
    may reject thousands of nodes per call)."""
    if reason.startswith("GPU "):
        head = reason[:48]
        return "memory" if " MiB free" in head else "compute" if " milli free" in head \
            else "other"
    if reason.startswith("node "):
        if reason.startswith("node unknown to gpuslice"):
            return "no-inventory"
        if reason.startswith(("node has no MIG instance",)):
            return "mig"
        if reason.startswith("node has no GPU"):
            return "no-gpu"
        return "gpu-model" if " pod accepts " in reason else "other"
    if reason.startswith("no free MIG instance"):
        return "mig"
    if reason[:1].isdigit() and " GPUs free enough" in reason[:40]:
        return "gpu-count"
    return "other"


class _StateCollector(Collector):
    def __init__(self, source: LedgerSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        st = self.source
        nodes, used = st.node_gpus, st.used_milli  # immutable snapshots: read once
        allocated = GaugeMetricFamily("gpuslice_extender_node_allocated_milli",
                                      "GPU share held by assignments, per node (milli)",
                                      labels=["node"])
        capacity = GaugeMetricFamily("gpuslice_extender_node_capacity_milli",
                                     "GPU share of the node's published GPUs (milli)",
                                     labels=["node"])
        for name, uuids in nodes:
            allocated.add_metric([name], sum(used.get(u, 0) for u in uuids))
            capacity.add_metric([name], 1000 * len(uuids))
        yield allocated
        yield capacity
        yield GaugeMetricFamily("gpuslice_extender_assignments",
                                "Live assignments in the ledger", value=st.assignments)
        yield GaugeMetricFamily("gpuslice_extender_cordoned_gpus",
                                "GPUs cordoned for reconfiguration", value=st.cordoned_gpus)
        yield GaugeMetricFamily("gpuslice_extender_problems",
                                "Problems met since start (bad annotations, broken watches)",
                                value=st.problem_count)
        leader = 1 if st.binds_here else 0
        yield GaugeMetricFamily("gpuslice_extender_leader",
                                "1 when this replica binds (holds the lease, or runs alone)",
                                value=leader)


class ExtenderMetrics:
    def __init__(self, state: LedgerSource) -> None:
        self.registry = CollectorRegistry()
        self.seconds = Histogram("gpuslice_extender_request_seconds",
                                 "Time to answer a scheduler call", ["verb"],
                                 registry=self.registry, buckets=BUCKETS)
        self.bind_write = Histogram(
            "gpuslice_extender_bind_write_seconds",
            "The Binding write of a bind as the extender sees it: the API call, waiting for "
            "one of its connections to the API server included (the rest of a bind's time "
            "is its hold and the event loop)", registry=self.registry, buckets=BUCKETS)
        self.nodes = Counter("gpuslice_extender_filter_nodes",
                             "Nodes filter was asked about, by result", ["result"],
                             registry=self.registry)
        self.rejections = Counter("gpuslice_extender_rejections",
                                  "Nodes filter rejected, by kind of reason", ["kind"],
                                  registry=self.registry)
        self.binds = Counter("gpuslice_extender_binds", "Bind calls, by result", ["result"],
                             registry=self.registry)
        self.filter_waits = Counter(
            "gpuslice_extender_filter_waits",
            "Filter calls that waited for binds under way to go below --binds-in-flight",
            registry=self.registry)
        self.filter_wait_seconds = Counter(
            "gpuslice_extender_filter_wait_seconds",
            "Time filter calls waited for binds under way (seconds)", registry=self.registry)
        self.stale_freed = Counter("gpuslice_extender_stale_shares_freed",
                                   "Shares given back at filter time because their pod had "
                                   "gone before the watch said so", registry=self.registry)
        self.requeue_nudges = Counter(
            "gpuslice_extender_requeue_nudges",
            "Pods the filter had refused that were nudged to be tried again once room was "
            "freed for them (an annotation written on the pending pod, which kube-scheduler "
            "requeues on), by result: sent; gone (bound or deleted meanwhile: nothing "
            "written); failed (logged)", ["result"], registry=self.registry)
        self.errors = Counter("gpuslice_extender_bad_requests",
                              "Calls refused as malformed, by verb", ["verb"],
                              registry=self.registry)
        self.unauthenticated = Counter(
            "gpuslice_extender_unauthenticated_calls",
            "Calls refused (403) for want of a verified client certificate, by verb", ["verb"],
            registry=self.registry)
        self.connections = Counter(
            "gpuslice_extender_connections",
            "Connections the scheduler's calls arrived on (each new one costs a TLS handshake "
            "on both sides: a rate that follows the call rate means the client does not keep "
            "its connections)", registry=self.registry)
        # the connections seen and still open, by id (uvloop's transports take no weak
        # reference): held here, an open one's id is not reused; closed ones are dropped
        self._open: dict[int, Any] = {}
        self.registry.register(_StateCollector(state))

    def arrived_on(self, transport: Any) -> None:
        """Count ``transport`` the first time a call arrives on it."""
        if transport is None or self._open.get(id(transport)) is transport:
            return
        if len(self._open) >= OPEN_KEPT:
            self._open = {k: t for k, t in self._open.items() if not t.is_closing()}
        self._open[id(transport)] = transport
        self.connections.inc()

    def filtered(self, kept: int, failed: dict[str, str]) -> None:
        self.nodes.labels("kept").inc(kept)
        self.nodes.labels("rejected").inc(len(failed))
        for kind, n in Tally(map(rejection_kind, failed.values())).items():
            self.rejections.labels(kind).inc(n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
