"""SLA planner: the fewest (or cheapest) GPU slices that serve every service within its SLO.

For each service and each slice size of each GPU type, the best measured configuration (batch
size and number of MPS processes) whose batch latency is at most ``latency_factor`` x SLO
(ParvaGPU's rule, 0.45 by default) gives the throughput one slice of that size can serve. GPUs
are filled with MIG layouts: every maximal layout of the GPU's geometry (core MIG geometry) is a
*pattern* with its slot counts per size.

A slot (MIG instance) runs MPS processes of one service, or of two services side by side (``mix``,
on by default): with k processes in an instance, each process is capped at 1/k of its threads
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) and its performance is taken from its own model's profile
measured with k processes co-located, so every latency and throughput used is a measured one.
Mixing lets two services with small leftover demand share one slice instead of taking two.

Exact planner (``solver="milp"``): an integer program over how many GPUs use each pattern and how
many slots each slot option (service(s), size, batch, processes) gets, such that slots used <=
slots available and each service's throughput >= its rate; minimise GPUs (or cost). Solved with
HiGHS through ``scipy.optimize.milp``, which also proves a lower bound; it runs in two stages
(mixing limited to two processes, then all), each with a share of the time limit, and keeps the
best plan found. Then a last solve keeps that many GPUs (or that cost) and minimises the
compute the slices take, then their size, each service keeping at least the smaller of its
first-stage capacity and ``headroom`` x its rate: the first solves are indifferent between a 1g
and a 7g slot on a GPU they pay for anyway, this one is not.

Heuristic (``solver="greedy"``, used above ``exact_limit`` services or as a fallback; no
mixing): solve the LP relaxation of the single-service model, round each service's slices up and
trim what it does not need, then pack the slices with a small integer program over MIG patterns;
its bound is that LP relaxation.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError
from gpuslice.core.mig import fitting_placements, is_valid_layout
from gpuslice.core.planner.options import (
    MAX_PLAN_GPUS,
    PlanTooLarge,
    _check_services,
    _geometry,
    best_configs,
    check_plan_size,
    slice_profiles,
)
from gpuslice.core.planner.solve import (
    _assemble,
    _build,
    _greedy,
    _Model,
    _shrink,
    _solve,
)
from gpuslice.core.planner.types import (
    Config,
    FleetType,
    Plan,
    PlannedGpu,
    PlanOptions,
    Problem,
    Service,
    Slot,
    _scipy_optimize,
    slice_share,
)
from gpuslice.core.profiles import ProfileSet

__all__ = ["MAX_PLAN_GPUS", "Config", "FleetType", "Plan", "PlanOptions", "PlanTooLarge",
           "PlannedGpu", "Problem", "Service", "Slot", "_scipy_optimize", "add_capacity",
           "best_configs", "check_plan_size", "exclusive_gpus", "plan", "slice_share",
           "validate"]

# ---- entry point ---------------------------------------------------------------------------


def plan(profiles: ProfileSet, services: Sequence[Service], fleet: Sequence[FleetType] = (),
         opts: PlanOptions | None = None) -> Plan:
    """Plan ``services`` on ``fleet`` (default: unlimited GPUs of every profiled MIG type).

    Services that cannot be planned (no profile, no configuration fast enough, bad rate or SLO)
    are reported in ``problems`` and left out; the rest are planned. Rates that need more than
    :data:`MAX_PLAN_GPUS` GPUs are refused (:func:`check_plan_size`, a ``ValidationError``).
    """
    opts = opts or PlanOptions()
    fl = list(fleet) or [FleetType(g) for g in profiles.gpus()
                         if (m := catalog.lookup(g)) is not None and m.mig is not None]
    for ft in fl:
        _geometry(ft.gpu)
        if ft.count is not None and ft.count < 0:
            raise ValidationError(f"fleet {ft.gpu}: count", ">= 0", ft.count)
    svcs, problems = _check_services(profiles, services, [ft.gpu for ft in fl], opts)
    if not svcs:
        return Plan((), opts.objective, 0.0, 0.0, "none", tuple(problems))
    check_plan_size(profiles, svcs, fl, opts.latency_factor)
    use_exact = opts.solver == "milp" or (opts.solver == "auto" and len(svcs) <= opts.exact_limit)
    gpus: list[PlannedGpu] = []
    solver = "greedy"
    bound = 0.0
    if use_exact:
        # the model whose LP relaxation (and, when solved, dual bound) is the reported bound
        full = _build(profiles, svcs, fl, opts, None if opts.full_stage else 2)
        _, lp, _ = _solve(full, opts.objective, False, opts.time_limit_s)
        bound = lp if math.isfinite(lp) else 0.0
        # Two stages: mixing limited to two processes per slice (a small model that solves in
        # a fraction of a second and gives a good plan early), then every measured process
        # count, which may improve it and proves the bound. Each stage gets a share of the time
        # limit and returns its best plan so far; the cheapest plan wins.
        best: tuple[float, _Model, np.ndarray] | None = None
        stages: list[int | None] = [None]
        shares = [1.0]
        if opts.mix and opts.full_stage:
            stages, shares = [2, None], [0.3, 0.7]
        elif opts.mix:
            stages, shares = [2], [1.0]
        for k, share in zip(stages, shares, strict=True):
            model = full if k is None or not opts.full_stage else _build(profiles, svcs, fl,
                                                                         opts, k)
            x, value, dual = _solve(model, opts.objective, True, opts.time_limit_s * share)
            if x is None:
                continue
            if k is None:
                bound = max(bound, dual)
            if best is None or value < best[0] - 1e-9:
                best = (value, model, x)
        if best is not None:
            m2, x2 = _shrink(best[1], best[2], opts.objective, opts.time_limit_s,
                             opts.headroom)
            gpus = _assemble(m2, x2)
            solver = "milp"
    if not gpus:
        gpus, lp = _greedy(profiles, svcs, fl, opts)
        if not use_exact:
            bound = lp
    if not gpus:
        # nothing fits the fleet's limits: plan without them so the report says how many
        # GPUs of each type it would take
        unlimited = [FleetType(ft.gpu, None, ft.cost_per_hour) for ft in fl]
        gpus, lp = _greedy(profiles, svcs, unlimited, opts)
        bound = lp
    cost_of = {ft.gpu: (ft.cost_per_hour if opts.objective == "cost" else 1.0) for ft in fl}
    total = float(sum(cost_of[g.gpu] for g in gpus))
    counts = Counter(g.gpu for g in gpus)
    for ft in fl:
        if ft.count is not None and counts[ft.gpu] > ft.count:
            problems.append(Problem("*", f"the plan needs {counts[ft.gpu]} {ft.gpu} GPUs, the "
                                    f"fleet has {ft.count}"))
    return Plan(tuple(gpus), opts.objective, total, bound, solver, tuple(problems))


def add_capacity(plan_: Plan, profiles: ProfileSet, svc: Service, extra: float,
                 latency_factor: float = 0.45) -> Plan:
    """``plan_`` with one more slice for ``svc`` giving at least ``extra`` req/s if one size
    can (else its most efficient slice), placed in a free legal position of a planned GPU of the
    same type when there is one, else on a new GPU. Used to repair a plan whose replay misses an
    SLO without solving it again."""
    gpus = list(plan_.gpus)
    types = [g.gpu for g in gpus if any(c.service == svc.name for s in g.slots for c in s.parts)]
    gpu_type = types[0] if types else (gpus[0].gpu if gpus else "")
    by_size = best_configs(profiles, svc, gpu_type, latency_factor)
    if not by_size:
        return plan_
    enough = [c for c in by_size.values() if c.throughput >= extra]
    cfg = min(enough, key=lambda c: (c.size, -c.throughput)) if enough else max(
        by_size.values(), key=lambda c: c.throughput / c.size)
    geo = _geometry(gpu_type)
    prof = slice_profiles(geo)[cfg.size]
    for i, g in enumerate(gpus):
        if g.gpu != gpu_type:
            continue
        used = [s.placement for s in g.slots]
        fits = [pl for pl in fitting_placements(geo, used) if pl.profile == prof]
        if fits:
            best = max(fits, key=lambda pl: len(fitting_placements(geo, [*used, pl])))
            slots = tuple(sorted([*g.slots, Slot(best, (cfg,))], key=lambda s: s.placement.key))
            gpus[i] = PlannedGpu(g.index, g.gpu, slots)
            break
    else:
        fresh = [pl for pl in fitting_placements(geo, []) if pl.profile == prof]
        start = max(fresh, key=lambda pl: len(fitting_placements(geo, [pl])))
        index = max((g.index for g in gpus), default=-1) + 1
        gpus.append(PlannedGpu(index, gpu_type, (Slot(start, (cfg,)),)))
    cost = plan_.cost + (0.0 if len(gpus) == len(plan_.gpus) else
                         plan_.cost / max(len(plan_.gpus), 1))
    return Plan(tuple(gpus), plan_.objective, cost, plan_.lower_bound, plan_.solver,
                plan_.problems)


def validate(plan_: Plan, services: Sequence[Service], latency_factor: float = 0.45) -> list[str]:
    """Every reason ``plan_`` is not a valid plan (empty when it is): MIG layouts legal,
    throughput >= rate, and the latency rule for every slice."""
    errors: list[str] = []
    for g in plan_.gpus:
        geo = _geometry(g.gpu)
        if not is_valid_layout(geo, [s.placement for s in g.slots]):
            errors.append(f"GPU {g.index}: illegal MIG layout "
                          f"{', '.join(str(s.placement) for s in g.slots)}")
    planned = {p.service for p in plan_.problems}
    for svc in services:
        if svc.name in planned or svc.rate <= 0:
            continue
        cap = plan_.capacity(svc.name)
        if cap + 1e-9 < svc.rate:
            errors.append(f"{svc.name}: capacity {cap:.1f} req/s < rate {svc.rate:.1f}")
        for _, _, c in plan_.segments(svc.name):
            if c.latency_s > latency_factor * svc.slo_ms / 1000 + 1e-12:
                errors.append(f"{svc.name}: {c.profile} batch {c.batch} latency "
                              f"{c.latency_s * 1000:.1f} ms > {latency_factor} x SLO")
    return errors


def exclusive_gpus(profiles: ProfileSet, services: Sequence[Service], gpu: str,
                   latency_factor: float = 0.45) -> int:
    """GPUs needed with one model per whole GPU (the largest slice), no sharing."""
    total = 0
    full = _geometry(gpu).compute_slices
    for svc in services:
        if svc.rate <= 0 or not svc.slo_ms > 0:
            continue
        cfg = best_configs(profiles, svc, gpu, latency_factor).get(full)
        if cfg is None:
            continue
        total += math.ceil(svc.rate / cfg.throughput)
    return total
