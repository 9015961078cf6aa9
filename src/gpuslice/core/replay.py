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
    PlannedGpu,
    PlanOptions,
    PlanTooLarge,
    Service,
    Slot,
    add_capacity,
    check_plan_size,
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
        raise ValidationError("profiles", f"a profile of {c.model} on {c.gpu} {c.profile} with "
                              f"{k} process(es), which the plan uses", "none there")
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
    # the size check on the rates as given, so that a refusal names them (plan() checks the
    # scaled ones again, to the same result)
    check_plan_size(profiles, services, fleet, o.latency_factor, 1.0 / utilisation)
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
            try:
                again = plan(profiles, scaled, fleet, replace(o, full_stage=False))
            except PlanTooLarge:  # the raised rates need more than MAX_PLAN_GPUS
                again = p
            if again.n_gpus < p.n_gpus:
                p = again
                stale = {s.name for s in services}
    assert result is not None
    return result


@dataclass(frozen=True, slots=True)
class SliceChange:
    """One step of a re-plan: a slice of ``service`` added to or removed from a GPU."""

    action: str  # "add" or "remove"
    gpu: int
    gpu_type: str
    profile: str
    start: int
    service: str
    throughput: float


@dataclass(frozen=True)
class Replanned:
    plan: Plan
    changes: tuple[SliceChange, ...]
    replay: tuple[ReplayResult, ...]
    freed_gpus: tuple[int, ...]
    added_gpus: int


def _slices(p: Plan) -> dict[tuple[int, int, str, str], tuple[str, float]]:
    """(GPU, start, profile, service) -> (GPU type, throughput). The profile is part of the
    key: a slice resized in place (same start, another profile) is a different slice, as it is
    a different Deployment (``planning/export.py`` names them by profile and start)."""
    return {(g.index, s.placement.start, s.placement.profile.name, c.service):
            (g.gpu, c.throughput) for g in p.gpus for s in g.slots for c in s.parts}


def plan_diff(old: Plan, new: Plan) -> list[SliceChange]:
    a, b = _slices(old), _slices(new)
    out = [SliceChange("remove", k[0], v[0], k[2], k[1], k[3], v[1])
           for k, v in sorted(a.items()) if k not in b]
    out += [SliceChange("add", k[0], v[0], k[2], k[1], k[3], v[1])
            for k, v in sorted(b.items()) if k not in a]
    return out


def _consolidate(gpus: dict[int, list[Slot]], types: dict[int, str]) -> None:
    """Empty whole GPUs by moving their slices into free MIG positions of the same profile on
    other GPUs of the same type, emptiest GPU first; a GPU is only emptied when all of its
    slices find a place (otherwise nothing of it moves)."""
    from gpuslice.core import catalog
    from gpuslice.core.mig import MigPlacement, fitting_placements

    while True:
        order = sorted((len(sl), gi) for gi, sl in gpus.items() if sl)
        moved = False
        for _, gi in order:
            model = catalog.lookup(types[gi])
            if model is None or model.mig is None:
                continue
            geo = model.mig
            trial = {h: list(sl) for h, sl in gpus.items() if h != gi and sl
                     and types[h] == types[gi]}
            ok = True
            for slot in sorted(gpus[gi], key=lambda x: -x.placement.profile.compute_slices):
                spot: tuple[int, MigPlacement] | None = None
                for h in sorted(trial, key=lambda h: -len(trial[h])):  # fullest GPU first
                    used = [x.placement for x in trial[h]]
                    fits = [pl for pl in fitting_placements(geo, used)
                            if pl.profile == slot.placement.profile]
                    if fits:
                        spot = (h, fits[0])
                        break
                if spot is None:
                    ok = False
                    break
                trial[spot[0]].append(Slot(spot[1], slot.parts))
            if ok:
                for h, sl in trial.items():
                    gpus[h] = sorted(sl, key=lambda x: x.placement.key)
                gpus[gi] = []
                moved = True
                break
        if not moved:
            return


def replan(profiles: ProfileSet, current: Plan, services: Sequence[Service],
           opts: PlanOptions | None = None, *, rng: np.random.Generator,
           fleet: Sequence[FleetType] = (),
           utilisation: float = 0.95, margin: float = 0.9, rounds: int = 6,
           requests: int = 30_000, keep: frozenset[str] = frozenset()) -> Replanned:
    """The smallest change to ``current`` that serves ``services`` at their new rates: slices
    of services with more capacity than they need (at ``utilisation``) are removed, those on
    the emptiest GPUs first so that whole GPUs are freed; services short of capacity get slices
    in free MIG positions first (:func:`add_capacity`, a new GPU only when none is left); then
    the plan is replayed at the new rates and repaired as :func:`plan_and_check` does. After
    the shrink, a GPU whose remaining slices all fit in free positions elsewhere is emptied
    (those slices move); no other slice moves. The services in ``keep`` lose no slice (their
    measured use asked for more than their profiles say they need: ``core/resize.py``)."""
    o = opts or PlanOptions()
    by_name = {s.name: s for s in services}
    need = {s.name: s.rate / utilisation for s in services}
    gpus = {g.index: list(g.slots) for g in current.gpus}
    types = {g.index: g.gpu for g in current.gpus}

    def capacity(name: str) -> float:
        return sum(c.throughput for sl in gpus.values() for s in sl for c in s.parts
                   if c.service == name)

    # shrink: single-service slots of over-provisioned services, emptiest GPU first
    while True:
        cands = []
        for gi, slots in gpus.items():
            for s in slots:
                if len(s.parts) != 1:
                    continue
                c = s.parts[0]
                if c.service in need and c.service not in keep and \
                        capacity(c.service) - c.throughput >= need[c.service]:
                    cands.append((len(slots), c.throughput, gi, s))
        if not cands:
            break
        _, _, gi, s = min(cands, key=lambda x: (x[0], x[1], x[2], x[3].placement.start))
        gpus[gi].remove(s)
    _consolidate(gpus, types)
    kept = tuple(PlannedGpu(i, types[i], tuple(sl)) for i, sl in sorted(gpus.items()) if sl)
    p = Plan(kept, current.objective, current.cost, current.lower_bound, current.solver)
    # grow: services short of capacity
    for svc in services:
        for _ in range(20):
            short = need[svc.name] - p.capacity(svc.name)
            if short <= 1e-9:
                break
            before = p
            p = add_capacity(p, profiles, svc, short, o.latency_factor)
            if p is before:
                break
    replayed: list[ReplayResult] = []
    for _ in range(rounds):
        replayed = replay_plan(profiles, p, list(services), rng, requests)
        bad = [r for r in replayed if r.p99_ms > margin * r.slo_ms]
        if not bad:
            break
        for r in bad:
            svc = by_name[r.service]
            grow = min(0.3, max(0.05, r.p99_ms / (margin * r.slo_ms) - 1.0))
            p = add_capacity(p, profiles, svc, p.capacity(svc.name) * grow, o.latency_factor)
    old_idx = {g.index for g in current.gpus}
    new_idx = {g.index for g in p.gpus}
    price = {ft.gpu: (ft.cost_per_hour if o.objective == "cost" else 1.0) for ft in fleet}
    p = Plan(p.gpus, p.objective, sum(price.get(g.gpu, 1.0) for g in p.gpus), p.lower_bound,
             f"{current.solver}+replan", p.problems)
    return Replanned(p, tuple(plan_diff(current, p)), tuple(replayed),
                     tuple(sorted(old_idx - new_idx)), len(new_idx - old_idx))
