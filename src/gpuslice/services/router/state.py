"""The router's state: :class:`Router` holds, per service, an immutable tuple of
:class:`ReplicaView` and the policy's state; for each request it asks the policy and admission
control (``core/routing.py``) and applies the answer. Around it: active health checks, passive
ejection of replicas that refuse connections, and reloads of the replica set that keep what was
learned. Generative services (OpenAI-style requests routed by the body's model, costed in
tokens, their replicas' own gauges scraped) are described in :mod:`.llm`; the process around
it (the proxy and admin ports, reloads, metrics, the access log) in :mod:`.app`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import aiohttp

from gpuslice.adapters.http.metrics import ReplicaGauge
from gpuslice.adapters.http.proxy import (
    Pick,
    Reject,
)
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing import (
    DEFAULT_PRIOR_S,
    ReplicaView,
    RoutingPolicy,
    ServiceModel,
    Ticket,
    admit,
    completed,
    dispatched,
    make_routing_policy,
    with_health,
)
from gpuslice.core.routing_config import RouterConfig, ServiceSpec
from gpuslice.core.routing_llm import TokenDemand, TokenOutcome, mean_output
from gpuslice.services.router.llm import (
    EngineGauges,
    describe_tokens,
    learned_speed,
    token_speed,
)

log = logging.getLogger("gpuslice.router")

__all__ = ["Router", "health_loop"]


@dataclass
class _Service:
    spec: ServiceSpec
    policy: RoutingPolicy
    views: list[ReplicaView]
    urls: dict[str, str]
    fails: dict[str, int] = field(default_factory=dict)
    oks: dict[str, int] = field(default_factory=dict)
    draining: frozenset[str] = frozenset()
    admitted_at: float = 0.0  # monotonic time of the last request admitted (for probes)
    mean_out: float = 256.0  # generative: learned mean output tokens

    def index(self, name: str) -> int | None:
        for i, v in enumerate(self.views):
            if v.name == name:
                return i
        return None


@dataclass(frozen=True, slots=True)
class _Ticket:
    name: str
    ticket: Ticket
    generation: int


def _prior(spec: ServiceSpec, weight: float, given: float | None) -> float:
    if given is not None:
        return given
    top = max((r.weight for r in spec.replicas), default=1.0)
    return DEFAULT_PRIOR_S * top / weight


class Router:
    """Balancer of the proxy: per-service replica views, policy state and admission control."""

    def __init__(self, config: RouterConfig, *, policy: str | None = None,
                 slo_ms: float | None = None, admission: bool = True, seed: int = 0) -> None:
        self.policy_override = policy
        if policy is not None:
            make_routing_policy(policy)
        self.slo_override = None if slo_ms is None else slo_ms / 1e3
        self.admission = admission
        self.rng = random.Random(seed)
        self.services: dict[str, _Service] = {}
        self.models: dict[str, str] = {}
        self.adapters: dict[str, str] = {}  # LoRA adapter -> its service's base model
        self.config = config
        self.generation = 0
        self.engines = EngineGauges()
        self.apply(config)

    # -- configuration -------------------------------------------------------------------------
    def apply(self, config: RouterConfig) -> None:
        """Install a new replica set; replicas that stay keep their load and learned model."""
        services: dict[str, _Service] = {}
        for spec in config.services:
            old = self.services.get(spec.name)
            name = self.policy_override or spec.policy or config.policy
            policy = make_routing_policy(name)
            if old is not None and old.policy.name == policy.name:
                policy = old.policy
            views: list[ReplicaView] = []
            urls: dict[str, str] = {}
            for r in spec.replicas:
                if r.url is None:
                    raise ValidationError(f"services[{spec.name}].replicas[{r.name}].url",
                                          "an http:// URL", None)
                urls[r.name] = r.url
                prev = None
                if old is not None:
                    i = old.index(r.name)
                    prev = None if i is None else old.views[i]
                speed = token_speed(spec, r)
                if prev is not None and old is not None and old.urls.get(r.name) == r.url:
                    speed = learned_speed(speed, prev.tokens)
                    views.append(replace(prev, weight=r.weight, concurrency=r.concurrency,
                                         tokens=speed))
                else:
                    views.append(ReplicaView(
                        r.name, r.weight, r.concurrency,
                        model=ServiceModel(prior_s=_prior(spec, r.weight, r.service_time_s)),
                        tokens=speed))
            draining = frozenset(r.name for r in spec.replicas if r.draining)
            services[spec.name] = _Service(
                spec, policy, views, urls, draining=draining,
                mean_out=old.mean_out if old is not None else float(spec.mean_output_tokens))
        models: dict[str, str] = {}
        adapters: dict[str, str] = {}
        for spec in config.services:
            for m in spec.models:
                models.setdefault(m, spec.name)
            for a in spec.adapters:
                if a not in models:
                    models[a] = spec.name
                    adapters[a] = spec.models[0] if spec.models else spec.name
        self.services, self.models, self.adapters = services, models, adapters
        self.config = config
        self.generation += 1

    def slo_s(self, spec: ServiceSpec) -> float | None:
        if not self.admission or not spec.admission:
            return None
        return self.slo_override if self.slo_override is not None else spec.slo_s

    # -- Balancer ------------------------------------------------------------------------------
    def service_for(self, model: str | None) -> str | Reject:
        """The service a request's model (from its path) goes to; a model no service names is
        refused with 404, even with one service. A service that names no model (EndpointSlices
        without --models) takes every model."""
        if model is not None:
            svc = self.models.get(model)
            if svc is not None:
                return svc
            open_ = [n for n, s in self.services.items() if not s.spec.models]
            if len(open_) == 1:
                return open_[0]
            return Reject(404, f"no service serves model {model!r}; known models: "
                          f"{sorted(self.models)}", reason="unknown-model")
        return next(iter(self.services))

    def wants_body_size(self, service: str) -> bool:
        return self.services[service].policy.name == "sed"

    def model_list(self) -> list[tuple[str, str | None]]:
        """Empty with no generative service: ``GET /v1/models`` is then KServe v1's, forwarded."""
        if not any(s.spec.generative for s in self.services.values()):
            return []
        return [(m, self.adapters.get(m)) for m in self.models]

    def token_demand(self, service: str, prompt_tokens: int, output_tokens: int | None,
                     embedding: bool) -> TokenDemand | None:
        svc = self.services.get(service)
        if svc is None or not svc.spec.generative:
            return None
        out = 0 if embedding else (output_tokens if output_tokens is not None
                                   else max(1, round(svc.mean_out)))
        return TokenDemand(prompt_tokens, out, embedding)

    def _views(self, service: str, svc: _Service, exclude: frozenset[str]
               ) -> list[ReplicaView]:
        """The replicas as routing sees them now: excluded and draining ones unhealthy, and
        each generative replica with its own gauges while they are fresh."""
        views = svc.views
        if exclude or svc.draining:
            out = exclude | svc.draining
            views = [with_health(v, False) if v.name in out else v for v in views]
        if svc.spec.generative and svc.spec.metrics_path is not None:
            now = time.monotonic()
            views = [replace(v, engine=self.engines.fresh(service, v.name, now)) for v in views]
        return views

    def pick(self, service: str, size: int, exclude: frozenset[str],
             first: bool, demand: TokenDemand | None = None) -> Pick | Reject:
        svc = self.services.get(service)
        if svc is None:
            return Reject(503, f"service {service!r} was removed", 1, "removed")
        views = self._views(service, svc, exclude)
        if first:
            now = time.monotonic()
            slo = self.slo_s(svc.spec) if demand is None else (
                svc.spec.slo_ttft_s if self.admission and svc.spec.admission else None)
            adm = admit(views, size, slo, self.config.min_samples,
                        since_admitted_s=now - svc.admitted_at, demand=demand)
            if adm.admitted:
                svc.admitted_at = now
            if not adm.admitted:
                if adm.predicted_s is None:
                    return Reject(503, f"service {service!r}: {adm.reason}", adm.retry_after_s,
                                  "no-replica")
                return Reject(429, f"service {service!r}: {adm.reason}", adm.retry_after_s,
                              "slo")
        choice = svc.policy.choose(views, size, self.rng.random(), demand)
        svc.policy = choice.policy
        if choice.index is None:
            return Reject(503, f"service {service!r}: {choice.reason}", 1, "no-replica")
        i = choice.index
        view, ticket = dispatched(replace(svc.views[i], engine=views[i].engine)
                                  if views[i].engine is not None else svc.views[i],
                                  size, demand)
        view = replace(view, engine=None) if view.engine is not None else view
        svc.views[i] = view
        return Pick(service, view.name, svc.urls[view.name],
                    _Ticket(view.name, ticket, self.generation), ticket.delay_s)

    def done(self, pick: Pick, latency_s: float | None, *, failed: bool = False,
             eject: bool = False, outcome: TokenOutcome | None = None) -> None:
        svc = self.services.get(pick.service)
        t = pick.ticket
        if svc is None or not isinstance(t, _Ticket):
            return
        i = svc.index(t.name)
        if i is None:
            return
        if outcome is not None and not failed:
            svc.mean_out = mean_output(svc.mean_out, outcome.output_tokens)
        view = completed(svc.views[i], t.ticket, None if failed else latency_s, outcome)
        if failed:
            n = svc.fails.get(t.name, 0) + 1
            svc.fails[t.name] = n
            svc.oks[t.name] = 0
            if eject or n >= self.config.health.unhealthy_after:
                view = with_health(view, False)
        else:
            svc.fails[t.name] = 0
        svc.views[i] = view

    # -- health --------------------------------------------------------------------------------
    def health_result(self, service: str, name: str, ok: bool) -> None:
        svc = self.services.get(service)
        if svc is None:
            return
        i = svc.index(name)
        if i is None:
            return
        h = self.config.health
        if ok:
            svc.fails[name] = 0
            svc.oks[name] = svc.oks.get(name, 0) + 1
            if svc.oks[name] >= h.healthy_after:
                svc.views[i] = with_health(svc.views[i], True)
        else:
            svc.oks[name] = 0
            svc.fails[name] = svc.fails.get(name, 0) + 1
            if svc.fails[name] >= h.unhealthy_after:
                svc.views[i] = with_health(svc.views[i], False)

    def targets(self) -> list[tuple[str, str, str]]:
        return [(s, name, url) for s, svc in self.services.items() for name, url in
                svc.urls.items()]

    def metrics_targets(self) -> list[tuple[str, str, str]]:
        """(service, replica, URL of its metrics) of every generative replica to scrape."""
        return [(s, name, url + path) for s, svc in self.services.items()
                if svc.spec.generative and (path := svc.spec.metrics_path) is not None
                for name, url in svc.urls.items()]

    # -- introspection -------------------------------------------------------------------------
    def gauges(self) -> Iterator[ReplicaGauge]:
        for s, svc in self.services.items():
            for v in svc.views:
                yield ReplicaGauge(s, v.name, v.outstanding, v.healthy, v.weight,
                                   v.model.predict(1), v.model.samples)

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {}
        now = time.monotonic()
        for s, svc in self.services.items():
            out[s] = {
                "policy": svc.policy.name,
                "slo_ms": None if (slo := self.slo_s(svc.spec)) is None else slo * 1e3,
                "replicas": [{
                    "name": v.name, "url": svc.urls[v.name], "healthy": v.healthy,
                    "draining": v.name in svc.draining,
                    "weight": v.weight, "concurrency": v.concurrency,
                    "outstanding": v.outstanding,
                    "service_time_ms": round(v.model.predict(1) * 1e3, 3),
                    "samples": v.model.samples,
                    **describe_tokens(v.tokens, self.engines.fresh(s, v.name, now)),
                } for v in svc.views],
            }
            if svc.spec.generative:
                out[s]["api"] = "openai"  # type: ignore[index]
                out[s]["mean_output_tokens"] = round(svc.mean_out, 1)  # type: ignore[index]
        return out


async def health_loop(router: Router, session: aiohttp.ClientSession) -> None:
    """Probe every replica every ``health.interval_s``; see :meth:`Router.health_result`."""

    async def probe(service: str, name: str, url: str) -> None:
        h = router.config.health
        try:
            async with session.get(url + h.path,
                                   timeout=aiohttp.ClientTimeout(total=h.timeout_s)) as resp:
                await resp.read()
                ok = 200 <= resp.status < 300
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            ok = False
        router.health_result(service, name, ok)

    while True:
        await asyncio.gather(*(probe(*t) for t in router.targets()))
        await asyncio.sleep(router.config.health.interval_s)
