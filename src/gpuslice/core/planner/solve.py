"""The two planners: the exact integer program (HiGHS through scipy) and the heuristic (the
LP relaxation rounded, then the slices packed into MIG patterns)."""


from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from gpuslice.core.errors import ValidationError
from gpuslice.core.mig import MigPlacement
from gpuslice.core.planner.options import (
    Pattern,
    SlotOption,
    _geometry,
    patterns,
    slot_options,
)
from gpuslice.core.planner.types import (
    Config,
    FleetType,
    PlannedGpu,
    PlanOptions,
    Service,
    Slot,
    _scipy_optimize,
)
from gpuslice.core.profiles import ProfileSet

# ---- the exact planner ---------------------------------------------------------------------


@dataclass
class _Model:
    services: list[Service]
    fleet: list[FleetType]
    pats: list[Pattern]
    options: list[SlotOption]


def _build(profiles: ProfileSet, services: list[Service], fleet: Sequence[FleetType],
           opts: PlanOptions, mix_procs: int | None) -> _Model:
    o = replace(opts, mix=opts.mix and mix_procs != 1)
    options: list[SlotOption] = []
    pats: list[Pattern] = []
    for ft in fleet:
        mine = slot_options(profiles, services, ft.gpu, o, mix_procs)
        if mine:
            options.extend(mine)
            pats.extend(patterns(ft.gpu, sorted({x.size for x in mine})))
    return _Model(services, list(fleet), pats, options)


def _solve(m: _Model, objective: str, integral: bool, time_limit: float,
           shrink: tuple[float, Mapping[str, float]] | None = None,
           ) -> tuple[np.ndarray | None, float, float]:
    """Returns (solution or None, objective value, proven lower bound).

    ``shrink=(budget, floors)``: the second stage. The GPUs' cost may not exceed ``budget``
    (the first stage's), each service needs ``floors[name]`` req/s, and the objective is the
    compute the slices take (each slot used costs its share of its GPU's compute, weighted by
    the GPU's cost), then the size of the slices."""
    n_x, n_z = len(m.pats), len(m.options)
    cost = {ft.gpu: (ft.cost_per_hour if objective == "cost" else 1.0) for ft in m.fleet}
    rows: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []
    if shrink is None:
        c = np.concatenate([[cost[p.gpu] for p in m.pats], np.zeros(n_z)])
        need: Mapping[str, float] = {s.name: s.rate for s in m.services}
    else:
        budget, need = shrink
        share = {g: _geometry(g).compute_slices for g in cost}
        # compute first; among plans of equal compute, smaller slices (a tie-break worth less
        # than one compute slice for up to a thousand GPUs): they leave the layout freer
        c = np.concatenate([np.zeros(n_x), [
            cost[o.gpu] * (o.size / share[o.gpu] + 1e-4 * (o.size / share[o.gpu]) ** 2)
            for o in m.options]])
        rows.append(np.concatenate([[cost[p.gpu] for p in m.pats], np.zeros(n_z)]))
        lo.append(-np.inf)
        hi.append(budget + 1e-6)
    for g, size in sorted({(o.gpu, o.size) for o in m.options}):
        row = np.zeros(n_x + n_z)
        for i, p in enumerate(m.pats):
            if p.gpu == g:
                row[i] = -p.counts.get(size, 0)
        for j, o in enumerate(m.options):
            if (o.gpu, o.size) == (g, size):
                row[n_x + j] = 1.0
        rows.append(row)
        lo.append(-np.inf)
        hi.append(0.0)
    for s in m.services:
        row = np.zeros(n_x + n_z)
        for j, o in enumerate(m.options):
            row[n_x + j] = sum(c.throughput for c in o.parts if c.service == s.name)
        rows.append(row)
        lo.append(need[s.name])
        hi.append(np.inf)
    for ft in m.fleet:
        if ft.count is None:
            continue
        row = np.zeros(n_x + n_z)
        for i, p in enumerate(m.pats):
            if p.gpu == ft.gpu:
                row[i] = 1.0
        rows.append(row)
        lo.append(-np.inf)
        hi.append(float(ft.count))
    opt = _scipy_optimize()
    cons = opt.LinearConstraint(np.array(rows), np.array(lo), np.array(hi))
    integrality = np.ones(n_x + n_z) if integral else np.zeros(n_x + n_z)
    res = opt.milp(c, constraints=cons, integrality=integrality, bounds=opt.Bounds(0, np.inf),
                   options={"time_limit": time_limit, "disp": False,
                            **({} if shrink is None else {"mip_rel_gap": 1e-7})})
    if res.x is None:
        return None, math.inf, math.inf
    bound = getattr(res, "mip_dual_bound", None) if integral else res.fun
    if bound is None or not math.isfinite(float(bound)):
        bound = res.fun
    return np.asarray(res.x), float(res.fun), float(bound)


def _shrink(m: _Model, x: np.ndarray, objective: str, time_limit: float,
            headroom: float) -> tuple[_Model, np.ndarray]:
    """Second stage: with no more GPUs (or cost) than the first stage's plan ``x``, the plan
    whose slices take the least compute, each service keeping at least the smaller of its
    first-stage capacity and ``headroom`` x its rate (a small service gets a 1g slice, not a
    whole 7g, and no service loses the headroom the replay check counts on). Only the services
    and pairings the first stage used are offered, in every size, so the model stays small.
    Returns the first stage's plan when the solver finds nothing better in time."""
    n_x = len(m.pats)
    cost = {ft.gpu: (ft.cost_per_hour if objective == "cost" else 1.0) for ft in m.fleet}
    used = [o for j, o in enumerate(m.options) if round(x[n_x + j]) > 0]
    groups = {tuple(c.service for c in o.parts) for o in used}
    keep = [o for o in m.options if tuple(c.service for c in o.parts) in groups]
    m2 = _Model(m.services, m.fleet, m.pats, keep)
    x1 = np.concatenate([x[:n_x], [x[n_x + m.options.index(o)] for o in keep]])
    budget = float(sum(cost[p.gpu] * round(x[i]) for i, p in enumerate(m.pats)))
    floors: dict[str, float] = {}
    for s in m.services:
        cap = sum(c.throughput * round(x[n_x + j]) for j, o in enumerate(m.options)
                  for c in o.parts if c.service == s.name)
        floors[s.name] = min(cap, headroom * s.rate) * (1 - 1e-9)
    x2, _, _ = _solve(m2, objective, True, time_limit, shrink=(budget, floors))
    if x2 is None:
        return m2, x1
    share = {g: _geometry(g).compute_slices for g in cost}

    def compute(v: np.ndarray) -> float:
        return float(sum(cost[o.gpu] * (o.size / share[o.gpu] + 1e-4 * (o.size / share[o.gpu])
                                        ** 2) * round(v[n_x + j])
                         for j, o in enumerate(m2.options)))

    return (m2, x2) if compute(x2) < compute(x1) - 1e-9 else (m2, x1)


def _assemble(m: _Model, x: np.ndarray) -> list[PlannedGpu]:
    n_x = len(m.pats)
    want: dict[tuple[str, int], list[SlotOption]] = defaultdict(list)
    for j, o in enumerate(m.options):
        want[(o.gpu, o.size)].extend([o] * round(x[n_x + j]))
    gpus: list[PlannedGpu] = []
    for i, p in enumerate(m.pats):
        for _ in range(round(x[i])):
            slots = []
            for pl in p.layout:
                queue = want.get((p.gpu, pl.profile.compute_slices))
                slots.append(Slot(pl, queue.pop().parts) if queue else Slot(pl))
            if any(s.parts for s in slots):
                gpus.append(PlannedGpu(len(gpus), p.gpu, tuple(slots)))
    return gpus


# ---- the heuristic -------------------------------------------------------------------------


def _round_lp(model: _Model, x: np.ndarray) -> list[Config]:
    """Round an LP solution of the single-service model up to whole slices, then give back
    slices a service does not need (smallest first)."""
    n_x = len(model.pats)
    z = np.ceil(x[n_x:] - 1e-7).astype(np.int64)
    by_service: dict[str, list[int]] = defaultdict(list)
    for j, o in enumerate(model.options):
        by_service[o.parts[0].service].append(j)
    rate = {s.name: s.rate for s in model.services}
    for name, js in by_service.items():
        cap = sum(z[j] * model.options[j].parts[0].throughput for j in js)
        for j in sorted(js, key=lambda j: model.options[j].parts[0].throughput):
            t = model.options[j].parts[0].throughput
            while z[j] > 0 and cap - t >= rate[name] - 1e-9:
                z[j] -= 1
                cap -= t
    return [model.options[j].parts[0] for j in range(len(z)) for _ in range(int(z[j]))]


def _pack(gpu: str, items: Sequence[Config], cost: float = 1.0) -> list[PlannedGpu]:
    """Pack slices into the fewest GPUs of ``gpu``: an integer program over MIG patterns where
    a slice may go to a slot at least its size (more compute and memory never slow a model
    down), then the largest slices take the smallest slots that fit them."""
    sizes = sorted({c.size for c in items})
    pats = patterns(gpu, sizes)
    if not pats:
        return []
    thresholds = sorted({g for p in pats for g in p.counts} | set(sizes))
    rows, need = [], []
    for t in thresholds:
        rows.append([sum(n for g, n in p.counts.items() if g >= t) for p in pats])
        need.append(sum(1 for c in items if c.size >= t))
    opt = _scipy_optimize()
    res = opt.milp(np.full(len(pats), cost), integrality=np.ones(len(pats)),
                   constraints=opt.LinearConstraint(np.array(rows, dtype=float),
                                                    np.array(need, float), np.inf),
                   bounds=opt.Bounds(0, np.inf), options={"time_limit": 5.0, "disp": False})
    if res.x is None:
        raise ValidationError("packing", f"a packing of {len(items)} slices on {gpu}",
                              "none found")
    free: list[tuple[int, int, MigPlacement]] = []  # (slot size, gpu number, placement)
    n_gpu = 0
    for p, count in zip(pats, np.round(res.x).astype(int), strict=True):
        for _ in range(count):
            free.extend((pl.profile.compute_slices, n_gpu, pl) for pl in p.layout)
            n_gpu += 1
    free.sort(key=lambda t: (t[0], t[1]))
    taken: dict[int, list[Slot]] = defaultdict(list)
    for c in sorted(items, key=lambda c: -c.size):
        i = next(k for k, f in enumerate(free) if f[0] >= c.size)
        _, g, pl = free.pop(i)
        taken[g].append(Slot(pl, (c,)))
    return [PlannedGpu(0, gpu, tuple(sorted(slots, key=lambda s: s.placement.key)))
            for _, slots in sorted(taken.items())]


def _greedy(profiles: ProfileSet, services: list[Service], fleet: Sequence[FleetType],
            opts: PlanOptions) -> tuple[list[PlannedGpu], float]:
    """LP rounding: solve the relaxation of the single-service model, round slices up, trim,
    and pack per GPU type. Returns the GPUs and the LP bound."""
    model = _build(profiles, services, fleet, opts, 1)
    x, lp, _ = _solve(model, opts.objective, False, opts.time_limit_s)
    if x is None:
        return [], math.inf
    cost = {ft.gpu: (ft.cost_per_hour if opts.objective == "cost" else 1.0) for ft in fleet}
    per_gpu: dict[str, list[Config]] = defaultdict(list)
    for c in _round_lp(model, x):
        per_gpu[c.gpu].append(c)
    gpus: list[PlannedGpu] = []
    for g, items in per_gpu.items():
        for pg in _pack(g, items, cost[g]):
            gpus.append(PlannedGpu(len(gpus), g, pg.slots))
    return gpus, lp
