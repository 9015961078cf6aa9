"""Reading Prometheus' text exposition as the benchmarks scrape it (kube-apiserver's,
kube-scheduler's and the extender's ``/metrics``): histograms and their quantiles, counters,
and kube-apiserver's requests and watch events counted over a window."""

from __future__ import annotations

import re
from collections import defaultdict

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ([0-9.e+-]+|NaN|[+-]Inf)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def histogram(metrics: str, name: str, match: dict[str, str] | None = None,
              ) -> list[tuple[float, float]]:
    """Cumulative buckets (le, count) of one histogram series, summed over series that match."""
    acc: dict[float, float] = defaultdict(float)
    pat = re.compile(r"^" + re.escape(name) + r"_bucket\{(.*)\} ([0-9.e+-]+)$")
    for line in metrics.splitlines():
        m = pat.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(1)))
        if any(labels.get(k) != v for k, v in (match or {}).items()):
            continue
        le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
        acc[le] += float(m.group(2))
    return sorted(acc.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the rank."""
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-12))
        prev_le, prev_c = le, c
    return prev_le


def minus(after: list[tuple[float, float]], before: list[tuple[float, float]],
          ) -> list[tuple[float, float]]:
    """The buckets of a window: cumulative counts after minus before."""
    was = dict(before)
    return [(le, c - was.get(le, 0.0)) for le, c in after]


def counter(metrics: str, name: str, result: str) -> int:
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith(name + "{") and f'result="{result}"' in line))


def sums(metrics: str, name: str, key: tuple[str, ...],
         match: dict[str, str] | None = None) -> dict[tuple[str, ...], float]:
    """The samples of metric ``name`` summed by the values of the labels ``key`` (a label a
    sample lacks counts as empty), over the samples whose labels match ``match``."""
    acc: dict[tuple[str, ...], float] = defaultdict(float)
    for line in metrics.splitlines():
        if not line.startswith(name):
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        if any(labels.get(k) != v for k, v in (match or {}).items()):
            continue
        acc[tuple(labels.get(k, "") for k in key)] += float(m.group(3))
    return dict(acc)


def api_requests(metrics: str) -> dict[str, float]:
    """kube-apiserver's requests so far by kind, "VERB resource[/subresource]"
    (``apiserver_request_total``, every response code and client together)."""
    got = sums(metrics, "apiserver_request_total", ("verb", "resource", "subresource"))
    return {f"{v} {r}/{s}" if s else f"{v} {r}": n for (v, r, s), n in got.items()}


def pod_watch_events(metrics: str) -> tuple[float, float]:
    """Pod watch events kube-apiserver has sent to its watchers so far, and their bytes
    (``apiserver_watch_events_total`` and ``apiserver_watch_events_sizes``, resource pods:
    k8s.io/apiserver pkg/endpoints/metrics/metrics.go)."""
    core = {"group": "", "resource": "pods"}
    n = sums(metrics, "apiserver_watch_events_total", (), core)
    size = sums(metrics, "apiserver_watch_events_sizes_sum", (), core)
    return n.get((), 0.0), size.get((), 0.0)


def per_pod(after: dict[str, float], before: dict[str, float], pods: int,
            top: int = 6) -> dict[str, float]:
    """The ``top`` kinds that grew most over a window, as counts per pod."""
    grew = {k: (v - before.get(k, 0.0)) / pods for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in grew.items() if v > 0),
                       key=lambda kv: -kv[1])[:top])
