"""Measured use per service, for ``gpuslice replan --usage-from``: from a Prometheus server
that scrapes the node agents, or from a file of their ``/metrics`` (``curl
http://NODE:9402/metrics``, one or more agents, one or more scrapes, concatenated).

The node agents export, per pod, container, GPU and service (the pod's ``gpuslice.io/service``
label, which the planner's Deployments set), the memory used and the memory of its share
(``gpuslice_pod_gpu_memory_used_bytes``, ``..._cap_bytes``) and the fraction of the GPU's SMs
kept busy and the fraction its share gives it (``gpuslice_pod_gpu_sm_utilization_ratio``,
``..._sm_share_ratio``). A service's use is, for each of the two, the highest ratio any of its
pods reached over the window: each pod against its own share, as each pod must fit the
slice it would be given (a sum over the pods would let an idle pod hide a full one).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from gpuslice.adapters.prometheus import Sample, instant_query, read_exposition
from gpuslice.core.errors import ValidationError
from gpuslice.core.resize import ServiceUsage

FIELD = "--usage-from"
USED, CAP = "gpuslice_pod_gpu_memory_used_bytes", "gpuslice_pod_gpu_memory_cap_bytes"
BUSY, SHARE = "gpuslice_pod_gpu_sm_utilization_ratio", "gpuslice_pod_gpu_sm_share_ratio"
# a Prometheus duration: 1d, 6h, 90m, 1h30m
_DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")


def check_window(text: str) -> str:
    """``--usage-window``: a Prometheus duration."""
    if not _DURATION.fullmatch(text):
        raise ValidationError("--usage-window", "a Prometheus duration like 1d, 6h or 90m",
                              text)
    return text


def queries(window: str) -> tuple[str, str]:
    """The PromQL of the peak memory and SM fractions per service over ``window``: the ratio
    per series (pod, container, GPU), its highest value over the window at a one-minute
    resolution, the highest series per service."""
    def peak(num: str, den: str) -> str:
        sel = '{service!=""}'
        return (f"max by (service) (max_over_time(({num}{sel} / {den}{sel})"
                f"[{window}:1m]))")

    return peak(USED, CAP), peak(BUSY, SHARE)


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def read_usage(source: str, window: str = "1d") -> dict[str, ServiceUsage]:
    """Per service, its peak use: from Prometheus where ``source`` is an http(s) URL (over
    ``window``), else from an exposition file (its samples, whatever their time)."""
    if is_url(source):
        mem_q, sm_q = queries(window)
        mem = _by_service(instant_query(source, mem_q, field=FIELD))
        sm = _by_service(instant_query(source, sm_q, field=FIELD))
        where = f"{source} over the last {window}"
    else:
        samples = read_exposition(Path(source), field=FIELD)
        mem, sm = _ratios(samples, USED, CAP), _ratios(samples, BUSY, SHARE)
        where = source
    if not mem:
        raise ValidationError(FIELD, f"{USED} and {CAP} series labelled with a service "
                              "(what the node agents export for the planner's pods)",
                              f"{where}: none")
    return {s: ServiceUsage(s, m, sm.get(s)) for s, m in sorted(mem.items())}


def _by_service(samples: Iterable[Sample]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        name = s.labels.get("service", "")
        if name:
            out[name] = max(out.get(name, 0.0), s.value)
    return out


def _ratios(samples: Iterable[Sample], num: str, den: str) -> dict[str, float]:
    """Per service, the highest ``num`` / ``den`` of its series (the same labels in both):
    the highest numerator of a series over the scrapes in the file against its lowest
    denominator (a pod's share does not change; the lower one is the safe side)."""
    high: dict[tuple[tuple[str, str], ...], float] = {}
    low: dict[tuple[tuple[str, str], ...], float] = {}
    for s in samples:
        if not s.labels.get("service") or s.name not in (num, den):
            continue
        key = tuple(sorted(s.labels.items()))
        if s.name == num:
            high[key] = max(high.get(key, 0.0), s.value)
        elif s.value > 0:
            low[key] = min(low.get(key, s.value), s.value)
    return _by_service(Sample(num, dict(k), high[k] / low[k]) for k in high if k in low)
