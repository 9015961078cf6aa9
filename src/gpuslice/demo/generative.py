"""The demo's generative service: a small chat model with TTFT and TPOT p99 SLOs, planned on the
shipped generative profile (``builtin:llm-a100-80gb``) with the functions ``gpuslice plan``
uses for generative entries, deployed as pods whose containers run ``fake_llm`` sized to their
slices, and routed by the router as an OpenAI service (its entry as a plan export writes it).

It is planned apart from the demo's other services, on the GPUs their plan leaves: planned
together, the planner's first solve puts every service on the two A100s (cheaper than an H100
and an A100) and its replay repairs that to another plan than the demo's scenario is written
for (re-slicing an H100 that holds the other services' replicas)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuslice.adapters.profiles.builtin import resolve
from gpuslice.adapters.profiles.files import read_generative_profiles
from gpuslice.core.errors import ValidationError
from gpuslice.core.generative import GenerativeService
from gpuslice.core.planner import FleetType, Plan, PlanOptions, slice_share
from gpuslice.core.profiles import ProfileSet
from gpuslice.core.replay import plan_and_check
from gpuslice.demo.cluster import API, gpu_pod
from gpuslice.demo.runtime import EventLog
from gpuslice.planning.run import GenerativePlan, generative_fields, plannable

GEN_PROFILES = "llm-a100-80gb"  # builtin: the token speeds of llama-3.2-3b on A100 slices
# rate req/s, TTFT p99 and TPOT p99 SLOs (ms), mean prompt and output tokens
GENERATIVE = (GenerativeService("chat", "llama-3.2-3b", 2.0, 500.0, 50.0, 256.0, 64.0),)
WHERE = Path("the demo's generative services (demo/generative.py)")  # in planning errors


@dataclass(frozen=True)
class GenerativeDemoPlan:
    plan: Plan
    sized: Mapping[str, GenerativePlan]  # how each service's replicas were sized
    seconds: float
    first_gpu: int  # the index its GPU 0 has beside the other services' plan


def left_over(fleet: Sequence[FleetType], used: Plan) -> list[FleetType]:
    """``fleet`` less the GPUs ``used`` takes (a type without a count stays unbounded)."""
    taken = Counter(g.gpu for g in used.gpus)
    out = []
    for f in fleet:
        count = None if f.count is None else f.count - taken[f.gpu]
        if count is None or count > 0:
            out.append(FleetType(f.gpu, count, f.cost_per_hour))
    return out


def plan_generative(fleet: Sequence[FleetType], seed: int, log: EventLog,
                    services: Sequence[GenerativeService] = GENERATIVE,
                    first_gpu: int = 0) -> GenerativeDemoPlan:
    """Plan ``services`` on ``fleet`` as ``gpuslice plan --gen-profiles`` does (each slice's
    capacity with both SLOs held, then the planner and its replay check); the plan goes to
    ``log``, its GPUs numbered from ``first_gpu``."""
    if not services:
        raise ValidationError("services", "at least one generative service", [])
    points = read_generative_profiles(resolve("gen-profiles", GEN_PROFILES, "gen-profiles"),
                                      catalogue_gpus=True)
    opts = PlanOptions(objective="cost")
    start = time.perf_counter()
    planned, extra, sized = plannable(WHERE, list(services), points, opts.latency_factor)
    checked = plan_and_check(ProfileSet.of(extra), planned, fleet, opts,
                             rng=np.random.default_rng(seed))
    out = GenerativeDemoPlan(checked.plan, sized, time.perf_counter() - start, first_gpu)
    by_name = {s.name: s for s in services}
    for g in out.plan.gpus:
        parts = ", ".join(
            f"{c.service} {s.placement.profile.name}, up to {_max_seqs(out, g.gpu, c)} "
            f"sequences ({c.throughput:.1f} req/s)" for s in g.slots for c in s.parts)
        log.add("plan", f"GPU {first_gpu + g.index} {g.gpu}: {parts}")
    for name, svc in by_name.items():
        log.add("plan", f"{name} ({svc.model}, generative: TTFT p99 {svc.slo_ttft_ms:g} ms, "
                f"TPOT p99 {svc.slo_tpot_ms:g} ms at {svc.rate:g} req/s of "
                f"{svc.prompt_tokens:g} + {svc.output_tokens:g} tokens): "
                f"{len(out.plan.segments(name))} slice(s), planned on {GEN_PROFILES} in "
                f"{out.seconds:.2f} s")
    return out


def _max_seqs(p: GenerativeDemoPlan, gpu: str, c: Any) -> int:
    point = p.sized[c.service].by_slice.get((gpu, c.size))
    if point is None:
        raise ValidationError(f"plan: {c.service} on {gpu} {c.profile}",
                              "a slice of the generative profile", None)
    return point.max_seqs


def generative_pods(p: GenerativeDemoPlan) -> list[dict[str, Any]]:
    """The plan's slices as pods, as :func:`~gpuslice.demo.scenario.plan_pods` makes them, each
    annotated as a generative replica with the sequences its profile row was measured with."""
    pods = []
    n: Counter[str] = Counter()
    for g in p.plan.gpus:
        for s in g.slots:
            for c in s.parts:
                svc = p.sized[c.service].service
                milli, mem = slice_share(s, c)
                name = f"{c.service}-{n[c.service]}"
                n[c.service] += 1
                pods.append(gpu_pod(
                    name, service=c.service, model=svc.model, milli=milli, memory_mib=mem,
                    gpu_models=g.gpu, batch=_max_seqs(p, g.gpu, c),
                    extra={API: "openai",
                           "demo.gpuslice.io/planned-rps": f"{c.throughput:.2f}",
                           "gpuslice.io/slo-ttft-p99-ms": f"{svc.slo_ttft_ms:g}",
                           "gpuslice.io/slo-tpot-p99-ms": f"{svc.slo_tpot_ms:g}"}))
    return pods


def router_services(p: GenerativeDemoPlan) -> list[dict[str, Any]]:
    """The router's entries of the generative services: ``api: openai``, the model clients
    name, the SLOs and lengths, as the plan export writes them."""
    return [{"name": name, **generative_fields(g)} for name, g in p.sized.items()]


def plan_slices(p: GenerativeDemoPlan) -> list[dict[str, Any]]:
    """The report's rows of the plan's slices (GPUs numbered after the other plan's)."""
    return [{"gpu": p.first_gpu + g.index, "model": g.gpu, "profile": s.placement.profile.name,
             "service": c.service, "batch": None, "max_seqs": _max_seqs(p, g.gpu, c),
             "throughput_rps": round(c.throughput, 2)}
            for g in p.plan.gpus for s in g.slots for c in s.parts]
