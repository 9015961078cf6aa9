"""Routing maths: which replica of a service should answer a request, and should it be admitted.

Pure and synchronous, as the rest of the core: the router (``services/router/``) holds a tuple
of :class:`ReplicaView` per service, asks a :class:`RoutingPolicy` for a :class:`Choice`, applies
it, and reports the outcome back through :func:`dispatched` / :func:`completed`, which return new
views. Randomness comes in as a float ``u`` in [0, 1) drawn by the caller.

Policies (registry :data:`REGISTRY`, built by :func:`make_routing_policy`):

- ``round-robin``: the baseline; healthy replicas in turn.
- ``weighted-round-robin``: smooth weighted round-robin (as nginx) over capability weights
  (from the planner's plan, profiles or the config).
- ``least-outstanding``: fewest requests in flight per unit of weight.
- ``p2c``: power of two choices, least request (Envoy's ``LEAST_REQUEST``): two distinct random
  replicas, the one with the higher ``weight / (outstanding + 1)`` wins.
- ``sed``: shortest expected delay. Each replica's service time is learned online (an EWMA per
  request-size bucket, :class:`ServiceModel`); the expected delay of a new request is its own
  service time plus the queued work ahead of it shared over the replica's concurrency slots
  (:func:`predicted_delay`). Near optimal on heterogeneous servers. A generative request
  (a :class:`~gpuslice.core.routing_llm.TokenDemand`) is costed in tokens on each replica's
  slice speed instead, with its own queue and KV-cache gauges where fresh
  (``core/routing_llm.py``): its predicted completion is the expected delay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from gpuslice.core.errors import ValidationError
from gpuslice.core.routing_llm import (
    EngineLoad,
    TokenDemand,
    TokenLoad,
    TokenOutcome,
    TokenSpeed,
    TokenTicket,
    completion_s,
    learn,
    predict,
)

N_BUCKETS = 16
"""Request-size buckets of the service model: sizes 1, 2, 3-4, 5-8, ... up to 2**15 and more."""

DEFAULT_PRIOR_S = 0.01
DEFAULT_ALPHA = 0.1


def size_bucket(size: int) -> int:
    """Bucket of a request size (batch size): 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    if size <= 1:
        return 0
    return min(N_BUCKETS - 1, (size - 1).bit_length())


def _bucket_size(bucket: int) -> int:
    return 1 << bucket


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """Online estimate of one replica's service time (seconds) by request size.

    ``times[b]`` is an EWMA of the service time of requests in size bucket ``b`` (0.0: no data
    yet). A bucket without data is predicted from the nearest bucket with data, scaled linearly
    by size, and with no data at all from ``prior_s`` x size.
    """

    prior_s: float = DEFAULT_PRIOR_S
    alpha: float = DEFAULT_ALPHA
    times: tuple[float, ...] = ()
    samples: int = 0

    def __post_init__(self) -> None:
        if not (self.prior_s > 0 and math.isfinite(self.prior_s)):
            raise ValidationError("prior_s", "a positive number of seconds", self.prior_s)
        if not 0 < self.alpha <= 1:
            raise ValidationError("alpha", "an EWMA weight in (0, 1]", self.alpha)
        if self.times and len(self.times) != N_BUCKETS:
            raise ValidationError("times", f"{N_BUCKETS} buckets or none", len(self.times))

    def predict(self, size: int = 1) -> float:
        size = max(1, size)
        if not self.times:
            return self.prior_s * size
        b = size_bucket(size)
        if self.times[b] > 0:
            return self.times[b]
        for dist in range(1, N_BUCKETS):
            for nb in (b - dist, b + dist):
                if 0 <= nb < N_BUCKETS and self.times[nb] > 0:
                    return self.times[nb] * size / _bucket_size(nb)
        return self.prior_s * size  # pragma: no cover - times non-empty means one bucket is set

    def observe(self, size: int, seconds: float) -> ServiceModel:
        """The model after one observed service time (non-finite or negative values ignored)."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return self
        times = list(self.times) if self.times else [0.0] * N_BUCKETS
        b = size_bucket(size)
        old = times[b]
        times[b] = seconds if old <= 0 else old + self.alpha * (seconds - old)
        return ServiceModel(self.prior_s, self.alpha, tuple(times), self.samples + 1)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What routing knows about one replica: its capability and its load right now.

    ``weight`` is the relative capability (throughput) from the plan or config; ``concurrency``
    the requests it serves in parallel; ``outstanding`` the requests in flight through this
    router and ``work_s`` their predicted service seconds. A replica of a generative service
    has its token speed (``tokens``), the tokens its in-flight requests reserved
    (``token_count``) and, while fresh, its own gauges (``engine``).
    """

    name: str
    weight: float = 1.0
    concurrency: int = 1
    healthy: bool = True
    outstanding: int = 0
    work_s: float = 0.0
    model: ServiceModel = field(default_factory=ServiceModel)
    tokens: TokenSpeed | None = None
    token_count: int = 0
    engine: EngineLoad | None = None
    token_prompt: int = 0  # prompt tokens of the generative requests in flight

    def __post_init__(self) -> None:
        if not self.name:
            raise ValidationError("replica.name", "a non-empty name", self.name)
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValidationError(f"replica {self.name}: weight", "a positive number",
                                  self.weight)
        if self.concurrency < 1:
            raise ValidationError(f"replica {self.name}: concurrency", "an integer >= 1",
                                  self.concurrency)


@dataclass(frozen=True, slots=True)
class Ticket:
    """What :func:`dispatched` predicted for one request, handed back to :func:`completed`."""

    size: int
    own_s: float
    delay_s: float
    tokens: TokenTicket | None = None


def token_load(view: ReplicaView) -> TokenLoad:
    return TokenLoad(view.outstanding, view.work_s, view.token_count, view.concurrency,
                     view.engine, view.token_prompt)


def predicted_delay(view: ReplicaView, size: int = 1, demand: TokenDemand | None = None
                    ) -> float:
    """Expected seconds until ``view`` answers a new request of ``size``.

    Its own service time plus the share of in-flight work queued ahead of it, spread over the
    replica's concurrency slots: with ``k`` in flight and ``c`` slots, ``k + 1 - c`` of them
    must finish before it starts (0 when a slot is free). A generative request on a replica
    with a token speed: its predicted completion (``core/routing_llm.py``).
    """
    if demand is not None and view.tokens is not None:
        return completion_s(predict(view.tokens, token_load(view), demand), demand)
    own = view.model.predict(size)
    k, c = view.outstanding, view.concurrency
    if k < c:
        return own
    return own + view.work_s * (k + 1 - c) / (k * c)


def dispatched(view: ReplicaView, size: int = 1, demand: TokenDemand | None = None
               ) -> tuple[ReplicaView, Ticket]:
    """The view after sending it one request, and the ticket to close it with."""
    if demand is not None and view.tokens is not None:
        p = predict(view.tokens, token_load(view), demand)
        e2e = completion_s(p, demand)
        reserved = demand.prompt_tokens + demand.output_tokens
        new = replace(view, outstanding=view.outstanding + 1, work_s=view.work_s + p.service_s,
                      token_count=view.token_count + reserved,
                      token_prompt=view.token_prompt + demand.prompt_tokens)
        return new, Ticket(size, p.service_s, e2e, TokenTicket(
            demand, p.service_s, p.ttft_base_s, p.ttft_s, e2e, p.tpot_factor))
    own = view.model.predict(size)
    delay = predicted_delay(view, size)
    new = replace(view, outstanding=view.outstanding + 1, work_s=view.work_s + own)
    return new, Ticket(size, own, delay)


def completed(view: ReplicaView, ticket: Ticket, latency_s: float | None,
              outcome: TokenOutcome | None = None) -> ReplicaView:
    """The view after a request finished: ``latency_s`` seconds from dispatch to the last byte,
    or None when it failed (no learning then).

    The service-time sample corrects the prediction by the observed ratio: ``own x latency /
    predicted delay``, which is the latency itself when nothing was queued ahead. A generative
    request's ``outcome`` (TTFT, TPOT, tokens) corrects the replica's token speed instead.
    """
    outstanding = max(0, view.outstanding - 1)
    work = 0.0 if outstanding == 0 else max(0.0, view.work_s - ticket.own_s)
    tt = ticket.tokens
    if tt is not None:
        count = 0 if outstanding == 0 else max(
            0, view.token_count - tt.demand.prompt_tokens - tt.demand.output_tokens)
        prompt = 0 if outstanding == 0 else max(0, view.token_prompt - tt.demand.prompt_tokens)
        speed = view.tokens
        if latency_s is not None and speed is not None:
            speed = learn(speed, tt, outcome or TokenOutcome(latency_s=latency_s))
        return replace(view, outstanding=outstanding, work_s=work, token_count=count,
                       token_prompt=prompt, tokens=speed)
    model = view.model
    if latency_s is not None and ticket.delay_s > 0:
        model = model.observe(ticket.size, ticket.own_s * latency_s / ticket.delay_s)
    return replace(view, outstanding=outstanding, work_s=work, model=model)


def with_health(view: ReplicaView, healthy: bool) -> ReplicaView:
    return view if view.healthy == healthy else replace(view, healthy=healthy)


@dataclass(frozen=True, slots=True)
class Choice:
    """A routing decision: the index of the replica (None: no healthy replica), the reason,
    and the policy's next state (stateful policies such as round-robin)."""

    index: int | None
    reason: str
    policy: RoutingPolicy


class RoutingPolicy(Protocol):
    """One interface for every policy: a pure choice over an immutable list of replicas."""

    @property
    def name(self) -> str: ...

    def choose(self, replicas: Sequence[ReplicaView], size: int, u: float,
               demand: TokenDemand | None = None) -> Choice: ...


def _healthy(replicas: Sequence[ReplicaView]) -> list[int]:
    return [i for i, r in enumerate(replicas) if r.healthy]


def _none(policy: RoutingPolicy) -> Choice:
    return Choice(None, "no healthy replica", policy)


def _pick_tie(candidates: list[int], u: float) -> int:
    return candidates[min(len(candidates) - 1, int(u * len(candidates)))]


@dataclass(frozen=True, slots=True)
class RoundRobin:
    cursor: int = 0
    name: str = "round-robin"

    def choose(self, replicas: Sequence[ReplicaView], size: int, u: float,
               demand: TokenDemand | None = None) -> Choice:
        n = len(replicas)
        for step in range(n):
            i = (self.cursor + step) % n
            if replicas[i].healthy:
                return Choice(i, "next in turn", replace(self, cursor=(i + 1) % n))
        return _none(self)


@dataclass(frozen=True, slots=True)
class WeightedRoundRobin:
    """Smooth weighted round-robin: every replica gains its weight, the richest is chosen and
    pays the total; the sequence interleaves replicas in proportion to their weights."""

    current: tuple[float, ...] = ()
    name: str = "weighted-round-robin"

    def choose(self, replicas: Sequence[ReplicaView], size: int, u: float,
               demand: TokenDemand | None = None) -> Choice:
        healthy = _healthy(replicas)
        if not healthy:
            return _none(self)
        cur = list(self.current) if len(self.current) == len(replicas) else [0.0] * len(replicas)
        total = 0.0
        best = healthy[0]
        for i in healthy:
            cur[i] += replicas[i].weight
            total += replicas[i].weight
            if cur[i] > cur[best]:
                best = i
        cur[best] -= total
        return Choice(best, f"weight {replicas[best].weight:g} of {total:g}",
                      replace(self, current=tuple(cur)))


@dataclass(frozen=True, slots=True)
class LeastOutstanding:
    name: str = "least-outstanding"

    def choose(self, replicas: Sequence[ReplicaView], size: int, u: float,
               demand: TokenDemand | None = None) -> Choice:
        healthy = _healthy(replicas)
        if not healthy:
            return _none(self)
        loads = {i: (replicas[i].outstanding + 1) / replicas[i].weight for i in healthy}
        low = min(loads.values())
        best = _pick_tie([i for i in healthy if loads[i] == low], u)
        return Choice(best, f"{replicas[best].outstanding} in flight", self)


@dataclass(frozen=True, slots=True)
class PowerOfTwo:
    """Envoy's least request: two distinct replicas drawn from ``u``, fewer requests in flight
    per unit of weight wins (the first drawn on a tie)."""

    name: str = "p2c"

    def choose(self, replicas: Sequence[ReplicaView], size: int, u: float,
               demand: TokenDemand | None = None) -> Choice:
        healthy = _healthy(replicas)
        if not healthy:
            return _none(self)
        n = len(healthy)
        if n == 1:
            return Choice(healthy[0], "only healthy replica", self)
        x = u * n
        a = min(n - 1, int(x))
        b = min(n - 2, int((x - a) * (n - 1)))
        if b >= a:
            b += 1
        ia, ib = healthy[a], healthy[b]
        ra, rb = replicas[ia], replicas[ib]
        score_a = ra.weight / (ra.outstanding + 1)
        score_b = rb.weight / (rb.outstanding + 1)
        best = ib if score_b > score_a else ia
        return Choice(best, f"{replicas[best].outstanding} in flight, of "
                      f"{ra.name} and {rb.name}", self)


@dataclass(frozen=True, slots=True)
class ShortestExpectedDelay:
    name: str = "sed"

    def choose(self, replicas: Sequence[ReplicaView], size: int, u: float,
               demand: TokenDemand | None = None) -> Choice:
        healthy = _healthy(replicas)
        if not healthy:
            return _none(self)
        delays = {i: predicted_delay(replicas[i], size, demand) for i in healthy}
        low = min(delays.values())
        best = _pick_tie([i for i in healthy if delays[i] <= low * (1 + 1e-9)], u)
        return Choice(best, f"expected delay {low * 1e3:.2f} ms", self)


REGISTRY: Mapping[str, Callable[[], RoutingPolicy]] = {
    "round-robin": RoundRobin,
    "weighted-round-robin": WeightedRoundRobin,
    "least-outstanding": LeastOutstanding,
    "p2c": PowerOfTwo,
    "sed": ShortestExpectedDelay,
}

ALIASES: Mapping[str, str] = {
    "rr": "round-robin",
    "wrr": "weighted-round-robin",
    "lor": "least-outstanding",
    "least-request": "p2c",
    "shortest-expected-delay": "sed",
}


def routing_policy_names() -> list[str]:
    return list(REGISTRY)


def make_routing_policy(name: str) -> RoutingPolicy:
    key = ALIASES.get(name, name)
    factory = REGISTRY.get(key)
    if factory is None:
        known = ", ".join([*REGISTRY, *ALIASES])
        raise ValidationError("policy", f"a routing policy ({known})", name)
    return factory()


@dataclass(frozen=True, slots=True)
class Admission:
    """Admit, or reject with the seconds a client should wait (HTTP Retry-After)."""

    admitted: bool
    predicted_s: float | None
    retry_after_s: int = 0
    reason: str = ""


def predicted_ttft(view: ReplicaView, demand: TokenDemand) -> float:
    """Predicted time to the first token of ``demand`` on ``view`` (a replica without a token
    speed: its expected delay, the whole answer being its first byte)."""
    if view.tokens is None:
        return predicted_delay(view, 1)
    return predict(view.tokens, token_load(view), demand).ttft_s


def _samples(view: ReplicaView, demand: TokenDemand | None) -> int:
    if demand is not None and view.tokens is not None:
        return view.tokens.samples
    return view.model.samples


def admit(replicas: Sequence[ReplicaView], size: int, slo_s: float | None,
          min_samples: int = 20, since_admitted_s: float = 0.0,
          probe_after_s: float = 1.0, demand: TokenDemand | None = None) -> Admission:
    """Admission control: reject when even the best healthy replica is predicted to answer after
    ``slo_s``. Replicas whose model has fewer than ``min_samples`` observations count as fast
    (a cold router admits everything). When nothing was admitted for ``since_admitted_s`` >=
    ``probe_after_s`` seconds, a replica with nothing in flight is given one request (a probe),
    so that a learned service time over the SLO can be learned again. ``slo_s`` None: always
    admit. A generative request (``demand``) is judged by its predicted time to the first
    token against ``slo_s``, the service's TTFT SLO."""
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        return Admission(False, None, 1, "no healthy replica")
    if slo_s is None:
        return Admission(True, None)
    best = math.inf
    for r in healthy:
        if _samples(r, demand) < min_samples:
            return Admission(True, None, 0, f"{r.name} still learning")
        best = min(best, predicted_delay(r, size) if demand is None
                   else predicted_ttft(r, demand))
    what = "latency" if demand is None else "time to first token"
    if best <= slo_s:
        return Admission(True, best)
    idle = [r for r in healthy if r.outstanding == 0]
    if idle and since_admitted_s >= probe_after_s:
        # nothing queued, so the prediction is the learned service time alone; refusing
        # everything would never let it learn again (measured on an H200: a slice slow while
        # warming up stayed shut out for good), so a probe goes through now and then
        return Admission(True, best, 0, f"probe: {idle[0].name} is idle, predicted "
                                        f"{best * 1e3:.1f} ms over the SLO {slo_s * 1e3:.1f} ms")
    retry = max(1, math.ceil(best - slo_s))
    return Admission(False, best, retry,
                     f"predicted {what} {best * 1e3:.1f} ms exceeds the SLO "
                     f"{slo_s * 1e3:.1f} ms")


def normalised_weights(capacities: Sequence[float]) -> tuple[float, ...]:
    """Capacities (requests/s, or any positive capability measure) -> weights summing to 1."""
    for i, c in enumerate(capacities):
        if not (c > 0 and math.isfinite(c)):
            raise ValidationError(f"capacity[{i}]", "a positive number", c)
    total = sum(capacities)
    return tuple(c / total for c in capacities)


def integer_weights(capacities: Sequence[float], total: int = 100,
                    minimum: int = 1) -> tuple[int, ...]:
    """Integer weights proportional to ``capacities`` summing to ``total`` (largest remainder),
    each at least ``minimum`` (Istio wants percentages summing to 100, Envoy weights >= 1)."""
    if not capacities:
        return ()
    if total < minimum * len(capacities):
        raise ValidationError("total", f"at least {minimum} per replica "
                              f"({minimum * len(capacities)})", total)
    shares = normalised_weights(capacities)
    spare = total - minimum * len(shares)
    raw = [s * spare for s in shares]
    ints = [math.floor(x) for x in raw]
    left = spare - sum(ints)
    order = sorted(range(len(raw)), key=lambda i: (ints[i] - raw[i], i))
    for i in order[:left]:
        ints[i] += 1
    return tuple(minimum + x for x in ints)


def scaled_weights(capacities: Sequence[float], top: int = 128) -> tuple[int, ...]:
    """Integer weights with the largest equal to ``top`` and each at least 1 (Envoy endpoints)."""
    if not capacities:
        return ()
    shares = normalised_weights(capacities)
    big = max(shares)
    return tuple(max(1, round(top * s / big)) for s in shares)
