"""Generative models (LLMs) on slices: the memory fraction a vLLM replica is given on a slice,
and the planner's view of a generative service.

**vLLM's memory fraction.** vLLM sizes its KV cache from ``--gpu-memory-utilization``, a
fraction of the GPU's *total* memory as the process sees it (``torch.cuda.mem_get_info``, i.e.
``cudaMemGetInfo``): the KV cache is that fraction of the total minus the weights, the peak
activations and what else the process allocated while profiling (``vllm/v1/worker/
gpu_worker.py``, ``determine_available_memory``). On an MPS slice the process may allocate only
its ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (the slice's ``gpuslice.io/gpu-memory``), while the
total it is told is, as far as gpuslice knows, the whole GPU's; vLLM's default of 0.9 of the
whole GPU then asks for far more than the cap, and the KV cache's allocation fails past it. So
the fraction must be the slice's share of the GPU, less a reserve for what is allocated outside
vLLM's budget (the CUDA context, CUDA graphs): :func:`vllm_memory_fraction`. Rounded down, it
errs low: if a driver told the process the cap as its total instead, the budget would be that
fraction of the cap, smaller still, never past it.

**A generative service on a profile of token speeds.** A generative service has a request rate,
SLOs on the time to the first token (TTFT, p99) and per output token after it (TPOT, p99), and
a mean prompt and output length in tokens (:class:`GenerativeService`). A generative profile
row (:class:`GenerativePoint`) says what one replica on one slice does: prefill at
``prefill_tokens_per_s`` (prompt tokens per second of the replica), decode at
``decode_tokens_per_s`` (output tokens per second of the whole replica with ``max_seqs``
sequences running, vLLM's ``--max-num-seqs``). :func:`replica_capacity` turns the two into the
requests per second one replica takes with both SLOs held, by an approximation (not a
simulation) with these parts, for ``P`` prompt and ``O`` output tokens and a replica's rate
``r``:

- a prompt's prefill takes ``S = P / prefill_tokens_per_s`` of the replica; prefill takes the
  share ``rho = r S`` of its time (the engine prefills and decodes in the same steps, chunked
  prefill);
- a decode step of a full batch takes ``t = max_seqs / decode_tokens_per_s`` (a step of fewer
  sequences is taken to take no less: conservative), stretched by the prefill share:
  ``TPOT = t / (1 - rho)`` (the stretch the router's cost model uses, ``core/routing_llm.py``);
  it must be at most the TPOT SLO. This is the TPOT of a mean moment, used for the p99: a
  request's TPOT is the mean over its output tokens, which averages the stretch out;
- the sequences running at once (Little's law: ``r x O x TPOT``) must fit ``max_seqs``, which
  is ``r <= 1 / (O / decode_tokens_per_s + S)``;
- the first token waits for the prompts ahead, takes the prefill, and comes with the step that
  finishes it: ``TTFT p99 = W99 + S + t``, the prefill queue taken as M/M/1 at utilisation
  ``rho`` with mean service ``S``, whose waiting time has ``P(W > x) = rho exp(-(1 - rho) x /
  S)``, so ``W99 = S / (1 - rho) x ln(100 rho)`` (0 for ``rho <= 0.01``). Exponential service
  times are pessimistic for prompts of similar lengths and optimistic for a heavy tail of long
  ones; the planner's replay (of the prefill queue, see :func:`planner_inputs`) checks it.

The largest ``r`` meeting all three is the replica's capacity; a slice where the prefill of a
mean prompt takes more than ``latency_factor`` x the TTFT SLO (the planner's rule for every
service, ParvaGPU's 0.45) gets none.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpuslice.core.errors import ValidationError
from gpuslice.core.planner.types import Service
from gpuslice.core.profiles import ProfilePoint

# ---- vLLM's memory fraction on a slice -----------------------------------------------------

# MiB of a slice left out of vLLM's budget: allocated outside what --gpu-memory-utilization
# bounds (the CUDA context, CUDA graphs captured after the KV cache is sized; vLLM versions
# differ on what they count). An estimate, not a measurement: give your own where you measured.
VLLM_RESERVE_MIB = 1024


def vllm_memory_fraction(slice_mib: int, gpu_mib: int,
                         reserve_mib: int = VLLM_RESERVE_MIB) -> float:
    """``--gpu-memory-utilization`` for a vLLM replica capped at ``slice_mib`` MiB of a GPU of
    ``gpu_mib`` MiB: ``(slice_mib - reserve_mib) / gpu_mib``, rounded down to hundredths (see
    the module). ``gpu_mib`` is the GPU's memory as the process is told it; the catalogue's
    nominal figure (an L4's 24,576 MiB) is at least that, so using it errs low too."""
    for field, value in (("slice_mib", slice_mib), ("gpu_mib", gpu_mib),
                         ("reserve_mib", reserve_mib)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValidationError(field, "a whole number of MiB >= 0", value)
    if gpu_mib <= 0:
        raise ValidationError("gpu_mib", "a whole number of MiB > 0", gpu_mib)
    if slice_mib > gpu_mib:
        raise ValidationError("slice_mib", f"at most the GPU's {gpu_mib} MiB", slice_mib)
    if slice_mib - reserve_mib < gpu_mib // 100:
        raise ValidationError("slice_mib", f"more than the reserve of {reserve_mib} MiB by at "
                              f"least 1% of the GPU ({gpu_mib // 100} MiB)", slice_mib)
    return (slice_mib - reserve_mib) * 100 // gpu_mib / 100


# ---- generative services and their profiles ------------------------------------------------


def _positive(where: str, field: str, value: float, least: float = 0.0) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value > least
    if not ok:
        raise ValidationError(f"{where}: {field}", f"a finite number > {least:g}", value)


@dataclass(frozen=True, slots=True)
class GenerativeService:
    """A generative service to plan: requests/s, TTFT and TPOT SLOs (p99, ms), and the mean
    prompt and output length of its requests (tokens)."""

    name: str
    model: str
    rate: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    prompt_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        where = f"service {self.name!r}"
        for field in ("rate", "slo_ttft_ms", "slo_tpot_ms", "prompt_tokens"):
            _positive(where, field, getattr(self, field))
        _positive(where, "output_tokens", self.output_tokens, 1.0 - 1e-9)  # >= 1

    @property
    def planner_model(self) -> str:
        """The name of the profile the planner plans this service on: its own copy of its
        model's (the capacity depends on the service's SLOs and lengths)."""
        return f"{self.model}@{self.name}"


@dataclass(frozen=True, slots=True)
class GenerativePoint:
    """What one replica of ``model`` does on one slice (``slice_kind``/``slice_size`` as in
    :class:`~gpuslice.core.profiles.ProfilePoint`): prompt tokens/s prefilled, output tokens/s
    decoded with ``max_seqs`` sequences running."""

    model: str
    gpu: str
    slice_kind: str
    slice_size: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    max_seqs: int

    def __post_init__(self) -> None:
        where = f"profile {self.model}/{self.gpu}/{self.slice_kind}{self.slice_size}"
        _positive(where, "prefill_tokens_per_s", self.prefill_tokens_per_s)
        _positive(where, "decode_tokens_per_s", self.decode_tokens_per_s)
        if not isinstance(self.max_seqs, int) or isinstance(self.max_seqs, bool) \
                or self.max_seqs < 1:
            raise ValidationError(f"{where}: max_seqs", "a whole number >= 1", self.max_seqs)

    @property
    def where(self) -> str:
        return f"{self.gpu} {self.slice_kind} {self.slice_size}"

    @property
    def step_s(self) -> float:
        """A full batch's decode step, the TPOT without prefill: ``max_seqs / decode``."""
        return self.max_seqs / self.decode_tokens_per_s

    def prefill_s(self, prompt_tokens: float) -> float:
        return prompt_tokens / self.prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """One replica's capacity (requests/s with both SLOs held), the limit that sets it
    (``slo_ttft_ms``, ``slo_tpot_ms`` or ``max_seqs``) and the TTFT p99 and TPOT predicted
    there."""

    point: GenerativePoint
    rate_rps: float
    bound: str
    ttft_p99_ms: float
    tpot_ms: float


def _wait_p99(prefill_s: float, rho: float) -> float:
    """p99 of the M/M/1 waiting time at utilisation ``rho`` with mean service ``prefill_s``."""
    if rho <= 0.01:
        return 0.0
    if rho >= 1.0:
        return math.inf
    return prefill_s / (1.0 - rho) * math.log(100.0 * rho)


def predict(svc: GenerativeService, point: GenerativePoint, rate: float
            ) -> tuple[float, float]:
    """(TTFT p99, TPOT) in ms of one replica on ``point`` taking ``rate`` requests/s of
    ``svc`` (infinite past saturation), by the module's approximation."""
    s, t = point.prefill_s(svc.prompt_tokens), point.step_s
    rho = rate * s
    if rho >= 1.0:
        return math.inf, math.inf
    return (_wait_p99(s, rho) + s + t) * 1000.0, t / (1.0 - rho) * 1000.0


def _ttft_rho(prefill_s: float, budget_s: float) -> float:
    """The largest prefill utilisation whose p99 wait is within ``budget_s`` (> 0)."""
    lo, hi = 0.01, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _wait_p99(prefill_s, mid) <= budget_s:
            lo = mid
        else:
            hi = mid
    return lo


def replica_capacity(svc: GenerativeService, point: GenerativePoint,
                     latency_factor: float = 0.45) -> ReplicaCapacity:
    """The requests/s one replica on ``point`` takes with ``svc``'s SLOs held (0 where they
    cannot hold at any rate; ``bound`` then names the SLO that cannot)."""
    if not 0 < latency_factor <= 1:
        raise ValidationError("latency_factor", "a fraction in (0, 1]", latency_factor)
    s, t = point.prefill_s(svc.prompt_tokens), point.step_s
    ttft_s, tpot_s = svc.slo_ttft_ms / 1000.0, svc.slo_tpot_ms / 1000.0
    if t >= tpot_s:
        return ReplicaCapacity(point, 0.0, "slo_tpot_ms", *predict(svc, point, 0.0))
    budget = ttft_s - s - t
    if s > latency_factor * ttft_s or budget <= 0:
        return ReplicaCapacity(point, 0.0, "slo_ttft_ms", *predict(svc, point, 0.0))
    limits = {"slo_tpot_ms": (1.0 - t / tpot_s) / s,
              "max_seqs": 1.0 / (svc.output_tokens / point.decode_tokens_per_s + s),
              "slo_ttft_ms": _ttft_rho(s, budget) / s}
    bound = min(limits, key=lambda k: limits[k])
    rate = limits[bound]
    return ReplicaCapacity(point, rate, bound, *predict(svc, point, rate))


def _refusal(svc: GenerativeService, points: Sequence[GenerativePoint],
             latency_factor: float) -> ValidationError:
    """Why no profiled slice holds ``svc``'s SLOs: the field, and what the fastest slice
    gives."""
    where = f"service {svc.name!r}"
    fastest = min(points, key=lambda p: p.step_s)
    if fastest.step_s * 1000 >= svc.slo_tpot_ms:
        return ValidationError(
            f"{where}: slo_tpot_ms", f"a TPOT SLO some profiled slice of {svc.model} can hold: "
            f"the fastest, {fastest.where}, takes {fastest.step_s * 1000:.1f} ms per output "
            f"token with its {fastest.max_seqs} sequences (max_seqs / decode_tokens_per_s)",
            svc.slo_tpot_ms)
    tpot_ok = [p for p in points if p.step_s * 1000 < svc.slo_tpot_ms]
    best = min(tpot_ok, key=lambda p: p.prefill_s(svc.prompt_tokens) + p.step_s)
    s = best.prefill_s(svc.prompt_tokens)
    return ValidationError(
        f"{where}: slo_ttft_ms", f"a TTFT SLO some profiled slice of {svc.model} can hold: on "
        f"the fastest, {best.where}, the first token of a {svc.prompt_tokens:g}-token prompt "
        f"takes at least {(s + best.step_s) * 1000:.1f} ms (prefill {s * 1000:.1f} ms and a "
        f"decode step), and the prefill may take at most {latency_factor:g} x the SLO",
        svc.slo_ttft_ms)


def capacities(svc: GenerativeService, points: Sequence[GenerativePoint],
               latency_factor: float = 0.45) -> list[ReplicaCapacity]:
    """The capacity of a replica of ``svc`` on each profiled slice of its model that holds its
    SLOs; a :class:`ValidationError` naming the model, or the SLO no slice can hold."""
    mine = [p for p in points if p.model == svc.model]
    if not mine:
        known = sorted({p.model for p in points})
        raise ValidationError(f"service {svc.name!r}: model", "a model of the generative "
                              f"profiles ({', '.join(known) or 'none'})", svc.model)
    held = [c for p in mine if (c := replica_capacity(svc, p, latency_factor)).rate_rps > 0]
    if not held:
        raise _refusal(svc, mine, latency_factor)
    return held


def planner_inputs(services: Sequence[GenerativeService], points: Sequence[GenerativePoint],
                   latency_factor: float = 0.45) -> tuple[list[Service], list[ProfilePoint]]:
    """The planner's services and profile points for generative ``services``: each service
    plans on its own copy of its model's profile (:attr:`GenerativeService.planner_model`),
    one point per slice that holds its SLOs, with the replica's capacity as throughput. The
    point's batch latency is the prefill of a mean prompt and the service's ``slo_ms`` its
    TTFT SLO, so the planner's latency rule is the prefill's and its replay (one request at a
    time per replica, each for its prefill) replays the prefill queue, the TTFT less the
    decode step; the TPOT is held by the capacity alone."""
    out_services: list[Service] = []
    out_points: list[ProfilePoint] = []
    for svc in services:
        for c in capacities(svc, points, latency_factor):
            p = c.point
            out_points.append(ProfilePoint(
                svc.planner_model, p.gpu, p.slice_kind, p.slice_size, batch=1, procs=1,
                throughput=c.rate_rps, latency_s=p.prefill_s(svc.prompt_tokens)))
        out_services.append(Service(svc.name, svc.planner_model, svc.rate, svc.slo_ttft_ms))
    return out_services, out_points


# ---- a profile row from measurements -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LevelMeasure:
    """Streamed requests to one replica at one concurrency (``gpuslice profile openai:``):
    the mean prompt (tokens, as the server counted them), the median TTFT, the mean TPOT and
    the output tokens per second of all the streams together."""

    concurrency: int
    requests: int
    prompt_tokens: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_ms: float
    tpot_p99_ms: float
    output_tokens_per_s: float


def point_from_levels(model: str, gpu: str, slice_kind: str, slice_size: int,
                      levels: Sequence[LevelMeasure]) -> GenerativePoint:
    """The generative profile row of measurements at several concurrencies: the prefill speed
    from the lowest (a prompt's tokens over its TTFT less one decode step, the TTFT's other
    part), the decode from the one with the most output tokens/s, and ``max_seqs`` the
    sequences that were decoding there (Little's law: tokens/s x TPOT), so that the row's
    step (``max_seqs / decode_tokens_per_s``) is the TPOT measured there."""
    done = [lv for lv in levels if lv.requests > 0 and lv.output_tokens_per_s > 0
            and lv.tpot_ms > 0 and lv.ttft_p50_ms > 0]
    if not done:
        raise ValidationError("measurements", "at least one concurrency level with completed "
                              "streams of two or more output tokens", len(levels))
    low = min(done, key=lambda lv: lv.concurrency)
    prefill_ms = low.ttft_p50_ms - low.tpot_ms if low.ttft_p50_ms > 2 * low.tpot_ms \
        else low.ttft_p50_ms
    top = max(done, key=lambda lv: lv.output_tokens_per_s)
    seqs = max(1, min(top.concurrency, round(top.output_tokens_per_s * top.tpot_ms / 1000)))
    return GenerativePoint(model, gpu, slice_kind, slice_size,
                           round(low.prompt_tokens / (prefill_ms / 1000), 1),
                           round(seqs / (top.tpot_ms / 1000), 1), seqs)
