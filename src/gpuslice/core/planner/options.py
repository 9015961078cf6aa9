"""What one slice can serve: the MIG slice sizes of a GPU type and their layouts (patterns),
the best measured configuration per service and size, and the slot options (one service, or
two side by side) the planners choose from."""


from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuslice.core import catalog
from gpuslice.core.catalog import MigGeometry, MigProfile
from gpuslice.core.errors import ValidationError
from gpuslice.core.mig import MigPlacement, maximal_layouts
from gpuslice.core.planner.types import (
    Config,
    FleetType,
    PlanOptions,
    Problem,
    Service,
)
from gpuslice.core.profiles import ProfilePoint, ProfileSet

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


# The most GPUs a plan may take. Planning, replaying and exporting a plan take time and memory
# in proportion to its GPUs (every slot is an object: about a second per thousand GPUs to plan
# and check, several with --export), and a replica's Deployment name leaves room for a GPU
# number of four digits (planning/run.py, NAME_MAX). Rates that need more are refused before
# any solving, rather than planned for hours.
MAX_PLAN_GPUS = 10_000


class PlanTooLarge(ValidationError):
    """Rates that need more than :data:`MAX_PLAN_GPUS` GPUs (:func:`check_plan_size`)."""


def check_plan_size(profiles: ProfileSet, services: Sequence[Service],
                    fleet: Sequence[FleetType], latency_factor: float,
                    scale: float = 1.0) -> None:
    """Refuse services whose rates (x ``scale``) need more than :data:`MAX_PLAN_GPUS` GPUs
    of the MIG types of ``fleet`` (empty: every profiled one) even at their best: a
    :class:`PlanTooLarge` naming the service that needs the most, and its rate. A service's
    least GPUs is its rate over the most req/s one GPU could give it: the GPU's compute slices
    times the best throughput per compute slice of its configurations (a slot of any layout
    takes at least its configuration's slices, and mixing two services in a slice gives each
    no more than its own best configuration). Services that cannot be planned at all are left
    to the planner's problems."""
    gpus = [ft.gpu for ft in fleet] or profiles.gpus()
    least: dict[str, tuple[float, float, str, Service]] = {}
    for svc in services:
        if not (svc.rate > 0 and math.isfinite(svc.rate) and svc.slo_ms > 0):
            continue
        best = (0.0, "")
        for g in gpus:
            model = catalog.lookup(g)
            if model is None or model.mig is None:
                continue
            slices = model.mig.compute_slices
            for size, cfg in best_configs(profiles, svc, g, latency_factor).items():
                best = max(best, (cfg.throughput / size * slices, g))
        if best[0] > 0:
            least[svc.name] = (svc.rate * scale / best[0], best[0], best[1], svc)
    total = sum(v[0] for v in least.values())
    if total <= MAX_PLAN_GPUS:
        return
    need, per_gpu, gpu, svc = max(least.values(), key=lambda v: v[0])

    def count(x: float) -> str:
        return f"{x:.0f}" if x < 1e9 else f"{x:.3g}"

    more = f"; {count(total)} for all {len(least)} services" if len(least) > 1 else ""
    raise PlanTooLarge(
        f"service {svc.name!r}: rate",
        f"a request rate a plan of at most {MAX_PLAN_GPUS} GPUs can serve ({svc.model} within "
        f"its SLO: at most {per_gpu:.0f} req/s per {gpu} GPU, so at least {count(need)} "
        f"GPUs{'' if scale == 1 else f' for {scale:.3g} x the rate'}{more})", svc.rate)
