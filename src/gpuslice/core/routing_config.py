"""Router configuration as pure data, validated from plain mappings (JSON, TOML or the planner's
plan, read by ``adapters/http/config.py``). Every error names the field and what was expected.

Shape (the planner's JSON plan has the same ``services`` list; extra keys are ignored)::

    {"policy": "sed",
     "services": [{"name": "resnet50", "slo_ms": 100, "models": ["resnet50"],
                   "replicas": [{"name": "a100-0", "url": "http://10.0.0.7:8000",
                                 "gpu": "A100-80GB", "slice": "3g.40gb",
                                 "throughput_rps": 300, "concurrency": 2,
                                 "service_time_ms": 6.5}]}]}

A replica's weight is ``weight``, else ``throughput_rps`` / ``capacity_rps`` (capability from
the plan or profiles), else 1.

A generative service (``"api": "openai"``) is routed by the ``model`` of the request's JSON body
(its ``models`` and its LoRA ``adapters``), costed in tokens: each replica may give
``prefill_tokens_per_s``, ``decode_tokens_per_s`` (per sequence at light load: 1 / TPOT) and
``kv_cache_tokens`` (else priors scaled by its weight), ``max_num_seqs`` (its concurrency,
default 256 as vLLM's); the service ``slo_ttft_ms`` (admission by predicted time to first
token), ``slo_tpot_ms`` (validated and kept with the service; routing does not use it yet),
``mean_output_tokens`` (before one is learned) and ``metrics_path``
(the replicas' Prometheus metrics with vLLM's gauges, scraped at most every 200 ms; null: none).

The planner's own ``plan.json`` (``gpuslice plan``) is read too:
a service without ``replicas`` takes one replica per plan ``segment`` (a MIG slice), named as the
planner's Deployments (``SERVICE-gGPU-PROFILE-START``), weighted by the segment's
``throughput_rps``, with the GPU model from ``gpu_list``; such replicas have no URL, so they serve
mesh exports and EndpointSlice weights (pods are matched to them by name prefix).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuslice.core.errors import ValidationError
from gpuslice.core.routing import make_routing_policy

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    name: str
    url: str | None = None
    weight: float = 1.0
    concurrency: int = 1
    service_time_s: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    draining: bool = False  # takes no new request; in-flight ones finish
    # generative replicas: prompt tokens/s, output tokens/s per sequence, KV-cache tokens
    prefill_tps: float | None = None
    decode_tps: float | None = None
    kv_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    replicas: tuple[ReplicaSpec, ...]
    slo_s: float | None = None
    admission: bool = True
    policy: str | None = None
    models: tuple[str, ...] = ()
    host: str | None = None
    port: int = 80
    api: str = "kserve"  # or "openai": model from the body, costed in tokens
    adapters: tuple[str, ...] = ()  # LoRA adapter names its replicas serve
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    mean_output_tokens: int = 256
    metrics_path: str | None = None  # vLLM-style gauges on each replica (openai: /metrics)

    @property
    def generative(self) -> bool:
        return self.api == "openai"


@dataclass(frozen=True, slots=True)
class HealthSpec:
    path: str = "/v2/health/ready"
    interval_s: float = 2.0
    timeout_s: float = 1.0
    unhealthy_after: int = 2
    healthy_after: int = 1


@dataclass(frozen=True, slots=True)
class RouterConfig:
    services: tuple[ServiceSpec, ...]
    policy: str = "sed"
    batch_header: str = "X-Batch-Size"
    health: HealthSpec = field(default_factory=HealthSpec)
    retry_post: bool = False
    request_timeout_s: float = 60.0
    min_samples: int = 20
    max_body_bytes: int = 64 * 1024 * 1024

    def service(self, name: str) -> ServiceSpec:
        for s in self.services:
            if s.name == name:
                return s
        raise ValidationError("service", f"one of {[s.name for s in self.services]}", name)


def _num(where: str, value: object, *, positive: bool = True, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(where, "a number", value)
    x = float(value)
    if not math.isfinite(x) or (positive and (x < 0 or (x == 0 and not allow_zero))):
        raise ValidationError(where, "a positive number" + (" or 0" if allow_zero else ""),
                              value)
    return x


def _int(where: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValidationError(where, f"an integer >= {minimum}", value)
    return value


def _str(where: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(where, "a non-empty string", value)
    return value.strip()


def _bool(where: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(where, "true or false", value)
    return value


def _mapping(where: str, value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ValidationError(where, "an object (mapping)", value)
    return value


def _list(where: str, value: object) -> Sequence[object]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValidationError(where, "a list", value)
    return value


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?$")


def check_url(where: str, value: object) -> str:
    """A replica's URL: ``http://HOST[:PORT][/...]`` (the proxy speaks plain HTTP/1.1 to its
    replicas), the host a name, an IPv4 or a bracketed IPv6 address, the port 1..65535."""
    url = _str(where, value)
    scheme, sep, rest = url.partition("://")
    hostport = rest.split("/", 1)[0]
    m = _HOST.match(hostport) if sep and scheme == "http" else None
    port = int(m.group(2)[1:]) if m and m.group(2) else 80
    if m is None or not 1 <= port <= 65535:
        raise ValidationError(where, "an http:// URL with a host and a port of 1..65535 "
                              "(replicas are served plain HTTP)", value)
    return url.rstrip("/")


def _opt_num(where: str, m: Mapping[str, object], key: str) -> float | None:
    return None if m.get(key) is None else _num(f"{where}.{key}", m[key])


def parse_replica(where: str, raw: object, index: int, default_concurrency: int = 1
                  ) -> ReplicaSpec:
    m = _mapping(where, raw)
    name_raw = m.get("name", m.get("pod", m.get("id")))
    url_raw = m.get("url", m.get("endpoint", m.get("address")))
    url = None if url_raw is None else check_url(f"{where}.url", url_raw)
    name = _str(f"{where}.name", name_raw) if name_raw is not None else (
        url.partition("://")[2] if url else f"replica-{index}")
    weight = 1.0
    for key in ("weight", "throughput_rps", "capacity_rps"):
        if key in m:
            weight = _num(f"{where}.{key}", m[key])
            break
    conc_key = "concurrency" if "concurrency" in m or "max_num_seqs" not in m \
        else "max_num_seqs"
    conc = _int(f"{where}.{conc_key}", m.get(conc_key, default_concurrency), 1)
    st = m.get("service_time_ms", m.get("latency_ms"))
    service_s = None if st is None else _num(f"{where}.service_time_ms", st) / 1e3
    labels: dict[str, str] = {}
    for key in ("gpu", "slice", "node", "mode"):
        if key in m and m[key] is not None:
            labels[key] = str(m[key])
    extra = m.get("labels")
    if extra is not None:
        for k, v in _mapping(f"{where}.labels", extra).items():
            labels[str(k)] = str(v)
    draining = _bool(f"{where}.draining", m.get("draining", False))
    kv = _int(f"{where}.kv_cache_tokens", m.get("kv_cache_tokens", 0), 0)
    return ReplicaSpec(name, url, weight, conc, service_s, labels, draining,
                       _opt_num(where, m, "prefill_tokens_per_s"),
                       _opt_num(where, m, "decode_tokens_per_s"), kv)


def segment_replica_name(service: str, gpu: object, profile: object, start: object) -> str:
    """The replica (Deployment) name the planner's manifests give a plan segment."""
    return f"{service}-g{gpu}-{str(profile).replace('.', '-')}-{start}"


def _segments_as_replicas(where: str, name: str, segs: object,
                          gpu_models: Mapping[int, str]) -> list[object]:
    """The planner's ``segments`` (one MIG slice each) -> replica mappings."""
    out: list[object] = []
    for i, raw in enumerate(_list(f"{where}.segments", segs)):
        seg = _mapping(f"{where}.segments[{i}]", raw)
        gpu = seg.get("gpu")
        rep: dict[str, object] = {
            "name": segment_replica_name(name, gpu, seg.get("profile"), seg.get("start")),
            "slice": seg.get("profile"),
        }
        if "throughput_rps" in seg:
            rep["throughput_rps"] = seg["throughput_rps"]
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "kv_cache_tokens",
                    "max_num_seqs"):
            if key in seg:
                rep[key] = seg[key]
        if isinstance(gpu, int) and gpu in gpu_models:
            rep["gpu"] = gpu_models[gpu]
        if "url" in seg:
            rep["url"] = seg["url"]
        out.append(rep)
    return out


def parse_service(where: str, raw: object, *, need_urls: bool,
                  gpu_models: Mapping[int, str] | None = None) -> ServiceSpec:
    m = _mapping(where, raw)
    name = _str(f"{where}.name", m.get("name"))
    where = f"services[{name}]"
    if "replicas" not in m and "segments" in m:
        reps_in: object = _segments_as_replicas(where, name, m["segments"], gpu_models or {})
    else:
        reps_in = m.get("replicas")
    reps_raw = _list(f"{where}.replicas", reps_in)
    if not reps_raw and need_urls:
        raise ValidationError(f"{where}.replicas", "at least one replica", [])
    api = _str(f"{where}.api", m.get("api", "openai" if _looks_generative(m) else "kserve"))
    if api not in APIS:
        raise ValidationError(f"{where}.api", f"one of {', '.join(APIS)}", api)
    conc = DEFAULT_MAX_NUM_SEQS if api == "openai" else 1
    reps = tuple(parse_replica(f"{where}.replicas[{i}]", r, i, conc)
                 for i, r in enumerate(reps_raw))
    names = [r.name for r in reps]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValidationError(f"{where}.replicas", "distinct replica names", dup)
    if need_urls:
        for r in reps:
            if r.url is None:
                raise ValidationError(f"{where}.replicas[{r.name}].url",
                                      "an http:// URL to send requests to", None)
    slo_raw = m.get("slo_ms", m.get("slo_p99_ms"))
    slo = None if slo_raw is None else _num(f"{where}.slo_ms", slo_raw) / 1e3
    admission = _bool(f"{where}.admission", m.get("admission", True))
    policy = m.get("policy")
    if policy is not None:
        make_routing_policy(_str(f"{where}.policy", policy))
    # a planner's service also answers to its model's name
    default_models = [name] + ([str(m["model"])] if m.get("model") not in (None, name) else [])
    models_raw = m.get("models", default_models)
    models = tuple(_str(f"{where}.models[{i}]", x)
                   for i, x in enumerate(_list(f"{where}.models", models_raw)))
    host = m.get("host")
    port = _int(f"{where}.port", m.get("port", 80), 1)
    return ServiceSpec(name, reps, slo, admission, None if policy is None else str(policy),
                       models, None if host is None else _str(f"{where}.host", host), port,
                       *_generative(where, m, api))


APIS = ("kserve", "openai")
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default --max-num-seqs
_GENERATIVE_KEYS = ("slo_ttft_ms", "ttft_p99_ms", "slo_tpot_ms", "tpot_p99_ms", "adapters",
                    "lora_adapters", "mean_output_tokens")


def _looks_generative(m: Mapping[str, object]) -> bool:
    """A service that names a generative field (a TTFT SLO, adapters...) speaks OpenAI's API
    unless it says otherwise (the planner's plan of a generative service does)."""
    return any(k in m for k in _GENERATIVE_KEYS)


def _generative(where: str, m: Mapping[str, object], api: str
                ) -> tuple[str, tuple[str, ...], float | None, float | None, int, str | None]:
    """The generative fields of a service (see the module docstring), in ServiceSpec's
    order: api, adapters, slo_ttft_s, slo_tpot_s, mean_output_tokens, metrics_path."""
    def ms(*keys: str) -> float | None:
        for k in keys:
            if m.get(k) is not None:
                return _num(f"{where}.{k}", m[k]) / 1e3
        return None

    raw = m.get("adapters", m.get("lora_adapters", []))
    adapters = tuple(_str(f"{where}.adapters[{i}]", x)
                     for i, x in enumerate(_list(f"{where}.adapters", raw)))
    path_raw = m.get("metrics_path", "/metrics" if api == "openai" else None)
    path = None if path_raw in (None, False) else _str(f"{where}.metrics_path", path_raw)
    if path is not None and not path.startswith("/"):
        raise ValidationError(f"{where}.metrics_path", "a path starting with /, or null", path)
    return (api, adapters, ms("slo_ttft_ms", "ttft_p99_ms"), ms("slo_tpot_ms", "tpot_p99_ms"),
            _int(f"{where}.mean_output_tokens", m.get("mean_output_tokens", 256), 1), path)


def parse_router_config(raw: object, *, need_urls: bool = True) -> RouterConfig:
    """Validate a router config or plan read from a file."""
    m = _mapping("config", raw)
    svcs_raw = _list("services", m.get("services"))
    if not svcs_raw:
        raise ValidationError("services", "at least one service", [])
    gpu_models: dict[int, str] = {}
    gpu_list = m.get("gpu_list")
    for g in gpu_list if isinstance(gpu_list, list) else []:  # the planner's plan
        if isinstance(g, Mapping) and isinstance(g.get("index"), int) and g.get("gpu"):
            gpu_models[g["index"]] = str(g["gpu"])
    services = tuple(parse_service(f"services[{i}]", s, need_urls=need_urls,
                                   gpu_models=gpu_models)
                     for i, s in enumerate(svcs_raw))
    names = [s.name for s in services]
    if len(set(names)) != len(names):
        raise ValidationError("services", "distinct service names", names)
    policy = _str("policy", m.get("policy", "sed"))
    make_routing_policy(policy)
    h = _mapping("health", m.get("health", {}))
    health = HealthSpec(
        path=_str("health.path", h.get("path", "/v2/health/ready")),
        interval_s=_num("health.interval_s", h.get("interval_s", 2.0)),
        timeout_s=_num("health.timeout_s", h.get("timeout_s", 1.0)),
        unhealthy_after=_int("health.unhealthy_after", h.get("unhealthy_after", 2), 1),
        healthy_after=_int("health.healthy_after", h.get("healthy_after", 1), 1),
    )
    if not health.path.startswith("/"):
        raise ValidationError("health.path", "a path starting with /", health.path)
    return RouterConfig(
        services=services,
        policy=policy,
        batch_header=_str("batch_header", m.get("batch_header", "X-Batch-Size")),
        health=health,
        retry_post=_bool("retry_post", m.get("retry_post", False)),
        request_timeout_s=_num("request_timeout_s", m.get("request_timeout_s", 60.0)),
        min_samples=_int("min_samples", m.get("min_samples", 20), 0),
        max_body_bytes=_int("max_body_bytes", m.get("max_body_bytes", 64 * 1024 * 1024), 1),
    )


def is_idempotent(method: str, has_idempotency_key: bool, retry_post: bool) -> bool:
    """May a failed request be sent again? Idempotent methods always; POST (inference) when the
    client sent an ``Idempotency-Key`` or the config says inference POSTs are safe to repeat."""
    if method in IDEMPOTENT_METHODS:
        return True
    return method == "POST" and (has_idempotency_key or retry_post)
