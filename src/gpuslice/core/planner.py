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

import functools
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gpuslice.core import catalog
from gpuslice.core.catalog import MigGeometry, MigProfile
from gpuslice.core.errors import MissingDependency, ValidationError
from gpuslice.core.mig import MigPlacement, fitting_placements, is_valid_layout, maximal_layouts
from gpuslice.core.profiles import ProfilePoint, ProfileSet


def _scipy_optimize() -> Any:
    """``scipy.optimize`` (HiGHS), imported when a plan is solved: the components that only
    import the planner's types do not need scipy (the container image leaves it out)."""
    try:
        from scipy import optimize
    except ImportError:
        raise MissingDependency("scipy", "planner", "the planner's solver") from None
    return optimize


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    model: str
    rate: float  # requests per second
    slo_ms: float


@dataclass(frozen=True, slots=True)
class FleetType:
    """A GPU type the plan may use: how many (None: unlimited) and the hourly cost."""

    gpu: str
    count: int | None = None
    cost_per_hour: float = 1.0


@dataclass(frozen=True, slots=True)
class Config:
    """How one slice serves a model: the measured configuration chosen for it."""

    service: str
    model: str
    gpu: str
    size: int  # compute slices (MIG)
    profile: str  # MIG profile name
    batch: int
    procs: int  # processes of this service in the slice
    throughput: float  # requests/s of this service's processes in the slice
    latency_s: float  # per batch
    colocated: int = 0  # processes in the slice in all (0: only this service's)

    @property
    def thread_pct(self) -> int:
        """MPS thread cap per process: an equal share of the slice."""
        return 100 // max(self.colocated, self.procs)


@dataclass(frozen=True, slots=True)
class Slot:
    """One MIG instance of a planned GPU and the processes in it (empty: left unused)."""

    placement: MigPlacement
    parts: tuple[Config, ...] = ()

    @property
    def services(self) -> tuple[str, ...]:
        return tuple(c.service for c in self.parts)


def slice_share(slot: Slot, part: Config, compute_slices: int = 7) -> tuple[int, int]:
    """(milli-GPU, MiB) that one process group of a planned slot asks for as an MPS slice: its
    equal share of the MIG slice's compute (rounded down, so seven 1g slices fit one GPU's
    1000) and of its memory."""
    share = part.procs / max(part.colocated, part.procs)
    milli = max(1, math.floor(1000 * slot.placement.profile.compute_slices / compute_slices
                              * share))
    return milli, int(slot.placement.profile.memory_mib * share)


@dataclass(frozen=True, slots=True)
class PlannedGpu:
    index: int
    gpu: str
    slots: tuple[Slot, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    service: str
    reason: str


@dataclass(frozen=True)
class Plan:
    gpus: tuple[PlannedGpu, ...]
    objective: str
    cost: float
    lower_bound: float
    solver: str
    problems: tuple[Problem, ...] = ()

    @property
    def n_gpus(self) -> int:
        return len(self.gpus)

    def segments(self, service: str) -> list[tuple[PlannedGpu, Slot, Config]]:
        return [(g, s, c) for g in self.gpus for s in g.slots for c in s.parts
                if c.service == service]

    def capacity(self, service: str) -> float:
        return sum(c.throughput for _, _, c in self.segments(service))


@dataclass(frozen=True, slots=True)
class PlanOptions:
    latency_factor: float = 0.45
    objective: str = "gpus"  # or "cost"
    solver: str = "auto"  # "milp", "greedy" or "auto"
    exact_limit: int = 60  # services above which "auto" uses the heuristic
    time_limit_s: float = 1.0  # for the exact solver, shared by its stages
    mix: bool = True  # allow two services in one slice (MPS, equal thread caps)
    full_stage: bool = True  # also try mixing with every measured process count
    # second stage: among plans of the fewest GPUs (or least cost), the one whose slices take
    # the least compute, each service keeping min(its first-stage capacity, headroom x rate)
    headroom: float = 1.25

    def __post_init__(self) -> None:
        if not 0 < self.latency_factor <= 1:
            raise ValidationError("latency_factor", "a fraction in (0, 1]", self.latency_factor)
        if self.objective not in ("gpus", "cost"):
            raise ValidationError("objective", "gpus or cost", self.objective)
        if self.solver not in ("milp", "greedy", "auto"):
            raise ValidationError("solver", "milp, greedy or auto", self.solver)
        if not self.headroom >= 1:
            raise ValidationError("headroom", "a factor >= 1", self.headroom)


# ---- slices of a GPU type ------------------------------------------------------------------


def slice_profiles(geometry: MigGeometry) -> dict[int, MigProfile]:
    """Compute-slice count -> the plain MIG profile of that size with the least memory."""
    out: dict[int, MigProfile] = {}
    for p in geometry.profiles:
        if p.name.endswith("+me"):
            continue
        cur = out.get(p.compute_slices)
        if cur is None or p.memory_slices < cur.memory_slices:
            out[p.compute_slices] = p
    return out


def _geometry(gpu: str) -> MigGeometry:
    model = catalog.lookup(gpu)
    if model is None or model.mig is None:
        raise ValidationError("gpu", "a MIG-capable GPU model of the catalogue", gpu)
    return model.mig


@dataclass(frozen=True)
class Pattern:
    gpu: str
    layout: tuple[MigPlacement, ...]
    counts: Mapping[int, int]  # compute slices -> number of slots


def patterns(gpu: str, sizes: Sequence[int]) -> list[Pattern]:
    """The distinct maximal MIG layouts of ``gpu`` built from slices of ``sizes``."""
    return list(_patterns(gpu, tuple(sorted(set(sizes)))))


@functools.lru_cache(maxsize=64)
def _patterns(gpu: str, sizes: tuple[int, ...]) -> tuple[Pattern, ...]:
    geo = _geometry(gpu)
    by_size = slice_profiles(geo)
    allowed = [by_size[s] for s in sorted(set(sizes)) if s in by_size]
    seen: dict[tuple[tuple[int, int], ...], Pattern] = {}
    for lay in maximal_layouts(geo, profiles=allowed):
        counts = Counter(p.profile.compute_slices for p in lay)
        key = tuple(sorted(counts.items()))
        seen.setdefault(key, Pattern(gpu, lay, dict(counts)))
    return tuple(seen.values())


# ---- candidate configurations --------------------------------------------------------------


def _best_points(profiles: ProfileSet, model: str, gpu: str, sizes: Mapping[int, MigProfile],
                 limit_s: float) -> dict[tuple[int, int], ProfilePoint]:
    """Per (slice size, processes): the batch with the highest throughput per process whose
    latency is within ``limit_s`` (ties: lower latency)."""
    best: dict[tuple[int, int], ProfilePoint] = {}
    for p in profiles.points:
        if p.model != model or p.gpu != gpu or p.slice_kind != "mig" or not p.ran:
            continue
        if p.slice_size not in sizes or p.latency_s > limit_s:
            continue
        key = (p.slice_size, p.procs)
        cur = best.get(key)
        if cur is None or (p.throughput, -p.latency_s) > (cur.throughput, -cur.latency_s):
            best[key] = p
    return best


def _config(svc: Service, gpu: str, prof: MigProfile, p: ProfilePoint, procs: int,
            colocated: int) -> Config:
    return Config(svc.name, svc.model, gpu, prof.compute_slices, prof.name, p.batch, procs,
                  p.throughput * procs, p.latency_s, colocated)


def best_configs(profiles: ProfileSet, svc: Service, gpu: str,
                 latency_factor: float) -> dict[int, Config]:
    """Per slice size, the single-service configuration (batch, processes) with the highest
    throughput whose batch latency is at most ``latency_factor`` x SLO (ties: lower latency)."""
    names = slice_profiles(_geometry(gpu))
    pts = _best_points(profiles, svc.model, gpu, names, latency_factor * svc.slo_ms / 1000.0)
    out: dict[int, Config] = {}
    for (size, procs), p in pts.items():
        cfg = _config(svc, gpu, names[size], p, procs, procs)
        cur = out.get(size)
        if cur is None or (cfg.throughput, -cfg.latency_s) > (cur.throughput, -cur.latency_s):
            out[size] = cfg
    return out


@dataclass(frozen=True, slots=True)
class SlotOption:
    """One way to use a slice of ``size`` on ``gpu``: the processes of one or two services."""

    gpu: str
    size: int
    parts: tuple[Config, ...]


def slot_options(profiles: ProfileSet, services: Sequence[Service], gpu: str,
                 opts: PlanOptions, mix_procs: int | None = None) -> list[SlotOption]:
    """Single-service options (the best configuration per size) and, with ``opts.mix``, every
    pairing of two services in one slice: a processes of one and b of the other, each process
    performing as its model's profile with a + b processes measured, within its latency rule.
    ``mix_procs`` caps a + b (default: the most processes measured)."""
    names = slice_profiles(_geometry(gpu))
    pts = {s.name: _best_points(profiles, s.model, gpu, names,
                                opts.latency_factor * s.slo_ms / 1000.0) for s in services}
    out = [SlotOption(gpu, c.size, (c,)) for s in services
           for c in best_configs(profiles, s, gpu, opts.latency_factor).values()]
    if not opts.mix:
        return out
    out.extend(_pareto(_mixed(services, gpu, names, pts, mix_procs)))
    return out


def _mixed(services: Sequence[Service], gpu: str,
           names: Mapping[int, MigProfile],
           pts: Mapping[str, Mapping[tuple[int, int], ProfilePoint]],
           mix_procs: int | None) -> list[SlotOption]:
    out: list[SlotOption] = []
    max_k = max((k for p in pts.values() for (_, k) in p), default=1)
    if mix_procs is not None:
        max_k = min(max_k, mix_procs)
    for i, sa in enumerate(services):
        for sb in services[i + 1:]:
            for size, prof in names.items():
                for k in range(2, max_k + 1):
                    pa, pb = pts[sa.name].get((size, k)), pts[sb.name].get((size, k))
                    if pa is None or pb is None:
                        continue
                    for a in range(1, k):
                        out.append(SlotOption(gpu, size, (
                            _config(sa, gpu, prof, pa, a, k), _config(sb, gpu, prof, pb, k - a, k),
                        )))
    return out


def _pareto(options: list[SlotOption]) -> list[SlotOption]:
    """Drop every option another option of the same services beats: no larger slice and at
    least the throughput for each service (exact duplicates keep the first)."""
    groups: dict[tuple[str, ...], list[SlotOption]] = defaultdict(list)
    for o in options:
        groups[tuple(c.service for c in o.parts)].append(o)
    kept: list[SlotOption] = []
    for group in groups.values():
        vecs = [tuple(c.throughput for c in o.parts) for o in group]
        for i, o in enumerate(group):
            beaten = False
            for j, w in enumerate(group):
                if i == j or w.size > o.size or any(a < b for a, b in zip(vecs[j], vecs[i],
                                                                            strict=True)):
                    continue
                if w.size < o.size or vecs[j] != vecs[i] or j < i:
                    beaten = True
                    break
            if not beaten:
                kept.append(o)
    return kept


def _check_services(profiles: ProfileSet, services: Sequence[Service], gpus: Sequence[str],
                    opts: PlanOptions) -> tuple[list[Service], list[Problem]]:
    known = set(profiles.models())
    ok: list[Service] = []
    problems: list[Problem] = []
    names: set[str] = set()
    for svc in services:
        if svc.name in names:
            problems.append(Problem(svc.name, "service name appears twice; the second is left out"))
            continue
        names.add(svc.name)
        if not (svc.rate >= 0 and math.isfinite(svc.rate)):
            problems.append(Problem(svc.name, f"rate must be a number >= 0 req/s, got {svc.rate}"))
            continue
        if not (svc.slo_ms > 0 and math.isfinite(svc.slo_ms)):
            problems.append(Problem(svc.name, f"latency SLO must be > 0 ms, got {svc.slo_ms}"))
            continue
        if svc.model not in known:
            problems.append(Problem(svc.name, f"no profile for model {svc.model!r}"))
            continue
        if svc.rate == 0:
            continue
        if not any(best_configs(profiles, svc, g, opts.latency_factor) for g in gpus):
            fastest = min((p.latency_s for p in profiles.for_model(svc.model) if p.ran),
                          default=float("nan"))
            problems.append(Problem(
                svc.name,
                f"no configuration meets {opts.latency_factor:g} x SLO = "
                f"{opts.latency_factor * svc.slo_ms:.1f} ms (fastest measured batch: "
                f"{fastest * 1000:.1f} ms)",
            ))
            continue
        ok.append(svc)
    return ok, problems


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
        raise ValidationError("packing", f"a packing of {len(items)} slices on {gpu}", None)
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


# ---- entry point ---------------------------------------------------------------------------


def plan(profiles: ProfileSet, services: Sequence[Service], fleet: Sequence[FleetType] = (),
         opts: PlanOptions | None = None) -> Plan:
    """Plan ``services`` on ``fleet`` (default: unlimited GPUs of every profiled MIG type).

    Services that cannot be planned (no profile, no configuration fast enough, bad rate or SLO)
    are reported in ``problems`` and left out; the rest are planned.
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
