"""Replay check of a plan: Poisson arrivals through the planned processes, batched as planned.

Each service is replayed on its own (its processes serve only it). Requests arrive as a Poisson
process at the service's rate and wait in the service's queue at the router, which hands a free
process what is queued, up to the process's planned batch size (dynamic batching with the queue
held in front of the replicas, as queue-depth routers do). The process holds the batch for the
measured latency of a batch that size (the next measured batch size at or above it: never faster
than measured). Latency of a request = departure - arrival. The first 5% of requests are a
warm-up and not counted.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from gpuslice.core.errors import ValidationError
from gpuslice.core.planner import (
    Config,
    FleetType,
    Plan,
    PlanOptions,
    Service,
    add_capacity,
    plan,
)
from gpuslice.core.profiles import ProfilePoint, ProfileSet, batch_latency


@dataclass(frozen=True, slots=True)
class ReplayResult:
    service: str
    requests: int
    p50_ms: float
    p99_ms: float
    within_slo_pct: float
    slo_ms: float

    @property
    def ok(self) -> bool:
        return self.p99_ms <= self.slo_ms


def _family(profiles: ProfileSet, c: Config) -> list[ProfilePoint]:
    k = c.colocated or c.procs
    fam = [p for p in profiles.points
           if p.model == c.model and p.gpu == c.gpu and p.slice_kind == "mig"
           and p.slice_size == c.size and p.procs == k and p.ran and p.batch <= c.batch]
    if not fam:
        raise ValidationError("replay", f"profiles for {c.model} on {c.profile} with {k} procs",
                              None)
    return fam


def replay_service(profiles: ProfileSet, plan: Plan, svc: Service, rng: np.random.Generator,
                   requests: int = 20_000) -> ReplayResult:
    """Replay ``requests`` Poisson arrivals of ``svc`` at its rate through its planned
    processes."""
    procs: list[tuple[int, list[ProfilePoint]]] = []
    for _, _, c in plan.segments(svc.name):
        procs.extend([(c.batch, _family(profiles, c))] * c.procs)
    if not procs or svc.rate <= 0:
        return ReplayResult(svc.name, 0, float("nan"), float("nan"), float("nan"), svc.slo_ms)
    arr = np.cumsum(rng.exponential(1.0 / svc.rate, size=requests)).tolist()
    lat = np.full(requests, np.nan)
    queue: deque[int] = deque()
    idle = list(range(len(procs)))
    events: list[tuple[float, int, list[int]]] = []  # (done at, process, request ids)
    cache: dict[tuple[int, int], float] = {}

    def start(i: int, now: float) -> None:
        batch, fam = procs[i]
        n = min(batch, len(queue))
        ids = [queue.popleft() for _ in range(n)]
        if (i, n) not in cache:
            cache[(i, n)] = batch_latency(fam, n)
        heapq.heappush(events, (now + cache[(i, n)], i, ids))

    def finish() -> None:
        done, i, ids = heapq.heappop(events)
        for r in ids:
            lat[r] = done - arr[r]
        if queue:
            start(i, done)
        else:
            idle.append(i)

    for rid, t in enumerate(arr):
        while events and events[0][0] <= t:
            finish()
        queue.append(rid)
        if idle:
            start(idle.pop(), t)
    while events:
        finish()
    kept = lat[requests // 20:] * 1000.0
    return ReplayResult(
        svc.name, len(kept), float(np.percentile(kept, 50)), float(np.percentile(kept, 99)),
        float((kept <= svc.slo_ms).mean() * 100.0), svc.slo_ms,
    )


def replay_plan(profiles: ProfileSet, plan: Plan, services: Sequence[Service],
                rng: np.random.Generator, requests: int = 20_000,
                load: float = 1.0) -> list[ReplayResult]:
    """Replay every planned service at ``load`` x its rate."""
    out: list[ReplayResult] = []
    planned = {name for g in plan.gpus for s in g.slots for name in s.services}
    for svc in services:
        if svc.name in planned:
            scaled = Service(svc.name, svc.model, svc.rate * load, svc.slo_ms)
            out.append(replay_service(profiles, plan, scaled, rng, requests))
    return out


@dataclass(frozen=True)
class CheckedPlan:
    plan: Plan
    replay: tuple[ReplayResult, ...]
    rounds: int
    headroom: dict[str, float]

    @property
    def violations(self) -> list[ReplayResult]:
        return [r for r in self.replay if not r.ok]


def plan_and_check(
    profiles: ProfileSet, services: Sequence[Service], fleet: Sequence[FleetType] = (),
    opts: PlanOptions | None = None, *, rng: np.random.Generator, utilisation: float = 0.95,
    rounds: int = 6, requests: int = 30_000, margin: float = 0.9, repeats: int = 2,
) -> CheckedPlan:
    """Plan with capacity >= rate / ``utilisation`` per service, replay the plan at the real
    rates, and add a slice (:func:`~gpuslice.core.planner.add_capacity`) to every service
    whose replayed p99 is above
    ``margin`` x its SLO in any of ``repeats`` independent replays (margin and repeats absorb
    the sampling noise of a finite replay near saturation), until none is (or ``rounds`` runs
    out; the shortfalls are then in the result)."""
    if not 0 < utilisation <= 1:
        raise ValidationError("utilisation", "a fraction in (0, 1]", utilisation)
    o = opts or PlanOptions()
    factor = {s.name: 1.0 / utilisation for s in services}
    by_name = {s.name: s for s in services}
    scaled = [Service(s.name, s.model, s.rate * factor[s.name], s.slo_ms) for s in services]
    p = plan(profiles, scaled, fleet, o)
    result: CheckedPlan | None = None
    known: dict[str, ReplayResult] = {}
    stale = {s.name for s in services}
    for n in range(1, rounds + 1):
        todo = [s for s in services if s.name in stale]
        runs = [replay_plan(profiles, p, todo, rng, requests) for _ in range(repeats)]
        for rs in zip(*runs, strict=True):
            worst = max(rs, key=lambda r: r.p99_ms)
            known[worst.service] = worst
        replayed = tuple(known[s.name] for s in services if s.name in known)
        result = CheckedPlan(p, replayed, n, dict(factor))
        bad = [r for r in replayed if r.p99_ms > margin * r.slo_ms]
        if not bad:
            return result
        # repair in place: one more slice for each service that misses, sized by how much it
        # misses; free MIG positions on planned GPUs first (no new solve). Only when that needs
        # a new GPU, solve again with the raised headroom and keep whichever plan is smaller.
        before = p.n_gpus
        stale = {r.service for r in bad}
        for r in bad:
            grow = min(0.3, max(0.05, r.p99_ms / (margin * r.slo_ms) - 1.0))
            factor[r.service] *= 1.0 + grow
            svc = by_name[r.service]
            p = add_capacity(p, profiles, svc, p.capacity(svc.name) * grow, o.latency_factor)
        if p.n_gpus > before:
            scaled = [Service(s.name, s.model, s.rate * factor[s.name], s.slo_ms)
                      for s in services]
            # the two-process mixing model solves to optimality in well under a second:
            # give it the whole time limit, so the result does not hang on the machine's speed
            again = plan(profiles, scaled, fleet, replace(o, full_stage=False))
            if again.n_gpus < p.n_gpus:
                p = again
                stale = {s.name for s in services}
    assert result is not None
    return result
