"""Routing maths for generative requests (OpenAI-style chat, completions, embeddings).

A generative request costs tokens, not a batch: its prompt is prefilled (compute bound, so in
proportion to the slice's compute) and its output decoded one token per engine step (memory
bound, and slower as more sequences share the step). What users feel is the time to the first
token (TTFT) and the time per output token after it (TPOT). This module predicts both for each
replica, from

- the request (:class:`TokenDemand`: prompt tokens counted cheaply from the body, output tokens
  from ``max_tokens`` or the service's learned mean),
- the replica's speed (:class:`TokenSpeed`: priors from its slice, corrected online by the ratio
  of measured to predicted TTFT and TPOT, an EWMA),
- its load: the requests in flight through this router and, where the replica exports vLLM's
  gauges and they are fresh, its own count of running and waiting requests and its KV-cache use
  (:class:`EngineLoad`): a replica whose KV cache is full queues new requests however many slots
  it has.

The wait before a request starts is the queued work ahead of it shared over the slots that can
run (the same shortest-expected-delay rule as ``core/routing.py`` for batch requests), the
slots being the fewer of the replica's concurrency and what its KV cache holds. Its decode is
stretched by the prefill of the prompts in flight (:func:`prefill_share`), and that stretch is
taken out of a measured TPOT before it is learned. Pure and
synchronous; freshness of scraped metrics is decided by the caller (it has the clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gpuslice.core.errors import ValidationError

DEFAULT_PREFILL_TPS = 8000.0
"""Prompt tokens/s of a replica with no other figure (a small model on a whole data-centre GPU)."""
DEFAULT_TPOT_S = 0.02
"""Seconds per output token of such a replica at light load."""
DEFAULT_OUTPUT_TOKENS = 256
"""A service's mean output length before it has learned one."""
KV_FULL = 0.95
"""KV-cache use from which a replica is taken as full: a new request waits for a finish."""
RATIO_BOUNDS = (0.05, 50.0)


@dataclass(frozen=True, slots=True)
class TokenDemand:
    """What a generative request asks: prompt tokens, output tokens (resolved: ``max_tokens``
    or the service's mean), and whether it is an embedding (prefill only)."""

    prompt_tokens: int
    output_tokens: int
    embedding: bool = False

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValidationError("tokens", "counts >= 0",
                                  (self.prompt_tokens, self.output_tokens))


@dataclass(frozen=True, slots=True)
class TokenSpeed:
    """One replica's generative speed: ``prefill_tps`` prompt tokens/s and ``tpot_s`` seconds
    per output token at light load (priors from its slice or profile), times the learned
    ratios of measured to predicted TTFT and TPOT; ``kv_tokens`` its KV-cache capacity in
    tokens (0: unknown)."""

    prefill_tps: float = DEFAULT_PREFILL_TPS
    tpot_s: float = DEFAULT_TPOT_S
    kv_tokens: int = 0
    ttft_ratio: float = 1.0
    tpot_ratio: float = 1.0
    alpha: float = 0.1
    samples: int = 0

    def __post_init__(self) -> None:
        if not (self.prefill_tps > 0 and math.isfinite(self.prefill_tps)):
            raise ValidationError("prefill_tokens_per_s", "a positive number", self.prefill_tps)
        if not (self.tpot_s > 0 and math.isfinite(self.tpot_s)):
            raise ValidationError("decode_tokens_per_s", "a positive number", 1 / self.tpot_s
                                  if self.tpot_s else self.tpot_s)
        if self.kv_tokens < 0:
            raise ValidationError("kv_cache_tokens", "an integer >= 0", self.kv_tokens)
        if not 0 < self.alpha <= 1:
            raise ValidationError("alpha", "an EWMA weight in (0, 1]", self.alpha)

    @property
    def tpot_now_s(self) -> float:
        return self.tpot_s * self.tpot_ratio

    def observe(self, ttft_ratio: float | None, tpot_s: float | None) -> TokenSpeed:
        """The speed after one observation: ``ttft_ratio`` measured TTFT / the prediction made
        without the learned ratio, ``tpot_s`` the measured time per output token (non-finite,
        zero or negative values ignored)."""
        tr, pr = self.ttft_ratio, self.tpot_ratio
        seen = False
        if ttft_ratio is not None and math.isfinite(ttft_ratio) and ttft_ratio > 0:
            tr = _ewma(tr, _clip(ttft_ratio), self.alpha, self.samples)
            seen = True
        if tpot_s is not None and math.isfinite(tpot_s) and tpot_s > 0:
            pr = _ewma(pr, _clip(tpot_s / self.tpot_s), self.alpha, self.samples)
            seen = True
        if not seen:
            return self
        return replace(self, ttft_ratio=tr, tpot_ratio=pr, samples=self.samples + 1)


def _clip(x: float) -> float:
    return min(RATIO_BOUNDS[1], max(RATIO_BOUNDS[0], x))


def _ewma(old: float, new: float, alpha: float, samples: int) -> float:
    # the first samples weigh more, so that a wrong prior is left behind quickly
    a = max(alpha, 1.0 / (samples + 1))
    return old + a * (new - old)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A replica's own gauges at the last scrape (vLLM: ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, summed or averaged over its
    engines). Only fresh ones are handed to routing."""

    running: float
    waiting: float
    kv_usage: float

    def __post_init__(self) -> None:
        for name, v in (("running", self.running), ("waiting", self.waiting),
                        ("kv_usage", self.kv_usage)):
            if not (v >= 0 and math.isfinite(v)):
                raise ValidationError(f"engine {name}", "a finite number >= 0", v)


@dataclass(frozen=True, slots=True)
class TokenLoad:
    """A replica's load as the router sees it: requests in flight through this router, their
    predicted service seconds and reserved tokens (prompt + output), its concurrency slots,
    and its own gauges when fresh."""

    outstanding: int
    work_s: float
    tokens: int
    concurrency: int
    engine: EngineLoad | None = None
    prompt_tokens: int = 0  # of the requests in flight through this router


@dataclass(frozen=True, slots=True)
class TokenPrediction:
    """Predicted for one request on one replica: the wait before it starts, its TTFT with and
    without the learned ratio, its TPOT, its own service seconds and its completion."""

    wait_s: float
    ttft_base_s: float
    ttft_s: float
    tpot_s: float
    service_s: float
    tpot_factor: float = 1.0  # the TPOT at light load x this: prefill of others interleaved


def service_time(speed: TokenSpeed, demand: TokenDemand, tpot_factor: float = 1.0) -> float:
    """Seconds the replica works on the request once it runs: prefill, then its output
    tokens at the current time per token, x ``tpot_factor`` (embeddings: prefill only)."""
    prefill = demand.prompt_tokens / speed.prefill_tps
    if demand.embedding:
        return prefill
    return prefill + demand.output_tokens * speed.tpot_now_s * tpot_factor


def prefill_share(speed: TokenSpeed, load: TokenLoad) -> float:
    """The share of the replica's engine time that goes to prefilling prompts while a request
    decodes: an engine that batches continuously (chunked prefill) stretches every decode step
    by the prompt tokens it prefills in it. By Little's law the prompt seconds in flight
    (``A``: prompt tokens / prefill speed) over the requests' mean time in the replica give
    the share; that time is their light-load service time (``L0``) stretched by the share
    itself, so the share is ``A / (L0 + A)`` (always below 1)."""
    if load.outstanding <= 0 or load.prompt_tokens <= 0 or load.work_s <= 0:
        return 0.0
    a = load.prompt_tokens / speed.prefill_tps
    return a / (load.work_s / load.outstanding + a)


def slots(load: TokenLoad, speed: TokenSpeed, demand: TokenDemand) -> float:
    """Sequences that can run at once: the concurrency, fewer where the KV cache holds fewer
    (from the replica's own KV gauge: running / use, or from its capacity in tokens over the
    mean reserved per request); a replica whose own queue is not empty runs all it can, so
    its running count is its slots."""
    c = float(load.concurrency)
    eng = load.engine
    if eng is not None and eng.waiting > 0 and eng.running >= 1:
        c = min(c, eng.running)
    elif eng is not None and eng.kv_usage > 0 and eng.running >= 1:
        c = min(c, max(1.0, eng.running / min(1.0, eng.kv_usage)))
    elif speed.kv_tokens > 0:
        per = (load.tokens + demand.prompt_tokens + demand.output_tokens) / (load.outstanding + 1)
        c = min(c, max(1.0, speed.kv_tokens / max(1.0, per)))
    return c


def predict(speed: TokenSpeed, load: TokenLoad, demand: TokenDemand) -> TokenPrediction:
    """TTFT, TPOT and completion of ``demand`` on one replica (see the module docstring)."""
    factor = 1.0 / (1.0 - prefill_share(speed, load))
    own = service_time(speed, demand, factor)
    k = float(load.outstanding)
    eng = load.engine
    if eng is not None:
        k = max(k, eng.running + eng.waiting)
    c = slots(load, speed, demand)
    ahead = k + 1 - c
    if eng is not None:
        if eng.waiting > 0:
            ahead = max(ahead, eng.waiting + 1)
        elif eng.kv_usage >= KV_FULL:
            ahead = max(ahead, 1.0)
    wait = 0.0
    if ahead > 0:
        mean = load.work_s / load.outstanding if load.outstanding > 0 else own
        wait = ahead * mean / c
    # the first token comes at the end of the engine step that finishes the prompt
    tpot = speed.tpot_now_s * factor
    base = wait + demand.prompt_tokens / speed.prefill_tps + tpot
    ttft = base * speed.ttft_ratio
    return TokenPrediction(wait, base, ttft, 0.0 if demand.embedding else tpot, own, factor)


def completion_s(p: TokenPrediction, demand: TokenDemand) -> float:
    """Predicted seconds until the last token: TTFT, then the remaining output tokens."""
    return p.ttft_s + max(0, demand.output_tokens - 1) * p.tpot_s


@dataclass(frozen=True, slots=True)
class TokenTicket:
    """What was predicted at dispatch, handed back at completion to learn from."""

    demand: TokenDemand
    own_s: float
    ttft_base_s: float
    ttft_s: float
    e2e_s: float
    tpot_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class TokenOutcome:
    """What the router measured of one generative answer: TTFT and TPOT of a stream (None
    when not measured), output tokens (from the usage chunk or counted events), and the whole
    latency."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int | None = None
    latency_s: float | None = None


def learn(speed: TokenSpeed, ticket: TokenTicket, outcome: TokenOutcome) -> TokenSpeed:
    """The speed after a completed request: TTFT against the prediction, TPOT against the
    prior with the load's stretch (``tpot_factor`` at dispatch) taken out, so that a busy
    replica is not learned as a slow one; a non-streamed answer (latency only) corrects both
    by its latency over the predicted completion."""
    if outcome.ttft_s is not None:
        ratio = outcome.ttft_s / ticket.ttft_base_s if ticket.ttft_base_s > 0 else None
        tpot = None if outcome.tpot_s is None else outcome.tpot_s / ticket.tpot_factor
        return speed.observe(ratio, tpot)
    if outcome.latency_s is not None and ticket.e2e_s > 0:
        r = outcome.latency_s / ticket.e2e_s
        return speed.observe(r * speed.ttft_ratio, speed.tpot_now_s * r
                             if not ticket.demand.embedding else None)
    return speed


def mean_output(old: float, observed: int | None, alpha: float = 0.05) -> float:
    """A service's learned mean output length after one answer of ``observed`` tokens."""
    if observed is None or observed < 0:
        return old
    return old + alpha * (observed - old)
