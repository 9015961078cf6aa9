"""A model server's own load, read from its Prometheus metrics: vLLM's gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``
(``vllm:gpu_cache_usage_perc`` before the V1 engine; both are read, the newer preferred). The
Gateway API Inference Extension's endpoint picker reads the same (its model server protocol:
waiting queue and KV-cache use). With several engines (data parallel, label ``engine``) the
counts are summed and the KV use averaged.

Only these lines are looked at (a line scan, not a full parser: a vLLM page has hundreds of
histogram lines), and a page over :data:`MAX_BYTES` is refused.
"""

from __future__ import annotations

import math

from gpuslice.core.routing_llm import EngineLoad

MAX_BYTES = 4 << 20
RUNNING = b"vllm:num_requests_running"
WAITING = b"vllm:num_requests_waiting"
KV = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")
_WANTED = (RUNNING, WAITING, *KV)


def parse_engine_metrics(text: bytes) -> EngineLoad | None:
    """The load in a metrics page, None when it lacks vLLM's gauges (a server of another
    make: the router then counts for itself)."""
    found: dict[bytes, list[float]] = {}
    for line in text.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        end = len(line)
        for sep in (b"{", b" "):
            j = line.find(sep)
            if 0 <= j < end:
                end = j
        name = line[:end]
        if name not in _WANTED:
            continue
        rest = line[line.rfind(b"}") + 1:] if b"}" in line else line[end:]
        try:  # NAME[{labels}] VALUE [TIMESTAMP]
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value) and value >= 0:
            found.setdefault(name, []).append(value)
    if RUNNING not in found or WAITING not in found:
        return None
    kv = next((found[k] for k in KV if k in found), [0.0])
    return EngineLoad(sum(found[RUNNING]), sum(found[WAITING]),
                      min(1.0, sum(kv) / len(kv)))
