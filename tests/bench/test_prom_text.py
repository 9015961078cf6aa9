"""The benchmarks' reading of Prometheus text: kube-apiserver's requests by kind and its pod
watch events over a window, as cluster_scale.py prints them per pod bound."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from prom_text import api_requests, histogram, per_pod, pod_watch_events, quantile


def _req(code: str, group: str, resource: str, sub: str, verb: str, n: int) -> str:
    """A sample of apiserver_request_total, its labels in kube-apiserver v1.36's order."""
    return (f'apiserver_request_total{{code="{code}",component="apiserver",dry_run="",'
            f'group="{group}",resource="{resource}",scope="resource",subresource="{sub}",'
            f'verb="{verb}",version="v1"}} {n}')


# a metric whose name another's begins with must not be summed in
BEFORE = "\n".join([
    "# TYPE apiserver_request_total counter",
    _req("201", "", "pods", "binding", "POST", 10),
    _req("409", "", "pods", "binding", "POST", 2),
    _req("200", "", "pods", "status", "PATCH", 4),
    'apiserver_request_total_other{verb="POST"} 1000',
    'apiserver_watch_events_total{group="",resource="pods",version="v1"} 30',
    'apiserver_watch_events_total{group="",resource="nodes",version="v1"} 500',
    'apiserver_watch_events_sizes_sum{group="",resource="pods",version="v1"} 61440'])
AFTER = "\n".join([
    _req("201", "", "pods", "binding", "POST", 110),
    _req("409", "", "pods", "binding", "POST", 2),
    _req("200", "", "pods", "status", "PATCH", 154),
    _req("201", "events.k8s.io", "events", "", "POST", 100),
    'apiserver_request_total_other{verb="POST"} 9000',
    'apiserver_watch_events_total{group="",resource="pods",version="v1"} 430',
    'apiserver_watch_events_total{group="",resource="nodes",version="v1"} 900',
    'apiserver_watch_events_sizes_sum{group="",resource="pods",version="v1"} 881440'])


def test_requests_by_kind_over_a_window_per_pod() -> None:
    assert api_requests(BEFORE) == {"POST pods/binding": 12.0, "PATCH pods/status": 4.0}
    got = per_pod(api_requests(AFTER), api_requests(BEFORE), 100)
    assert got == {"PATCH pods/status": 1.5, "POST pods/binding": 1.0, "POST events": 1.0}
    assert list(got) == ["PATCH pods/status", "POST pods/binding", "POST events"]
    assert per_pod(api_requests(AFTER), api_requests(BEFORE), 100, top=1) == \
        {"PATCH pods/status": 1.5}


def test_pod_watch_events_leave_other_resources_out() -> None:
    assert pod_watch_events(BEFORE) == (30.0, 61440.0)
    assert pod_watch_events(AFTER) == (430.0, 881440.0)
    assert pod_watch_events("") == (0.0, 0.0)


def test_histogram_quantile_is_linear_inside_the_bucket() -> None:
    text = "\n".join([
        'x_seconds_bucket{verb="bind",le="0.1"} 50',
        'x_seconds_bucket{verb="bind",le="0.2"} 100',
        'x_seconds_bucket{verb="bind",le="+Inf"} 100',
        'x_seconds_bucket{verb="filter",le="0.1"} 7',
        'x_seconds_bucket{verb="filter",le="+Inf"} 7'])
    b = histogram(text, "x_seconds", {"verb": "bind"})
    assert b == [(0.1, 50.0), (0.2, 100.0), (float("inf"), 100.0)]
    assert abs(quantile(b, 0.75) - 0.15) < 1e-9
    assert quantile([], 0.5) != quantile([], 0.5)  # NaN when nothing was observed
