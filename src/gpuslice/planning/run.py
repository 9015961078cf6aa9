"""``gpuslice plan``: profiles + services -> a checked plan, as JSON, a report and exports."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gpuslice.adapters.profiles.files import (
    read_parva_deployment,
    read_profiles,
    read_scenario,
)
from gpuslice.adapters.traces.alibaba import InputError
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.generative import GenerativePoint, GenerativeService
from gpuslice.core.planner import (
    FleetType,
    Plan,
    PlanOptions,
    Service,
    exclusive_gpus,
    plan,
    validate,
)
from gpuslice.core.profiles import ProfilePoint, ProfileSet
from gpuslice.core.replay import ReplayResult, plan_and_check, replay_plan


@dataclass(frozen=True)
class PlanRun:
    plan: Plan
    services: list[Service]
    replay: list[ReplayResult]
    plan_seconds: float
    check_seconds: float
    rounds: int
    baselines: dict[str, int | None]
    errors: list[str]
    single_type_costs: dict[str, float]
    # the fleet's cost_per_hour by GPU type; None when the fleet gives no prices
    prices: dict[str, float] | None = None
    fleet: tuple[FleetType, ...] = ()  # what the plan was made on (replan reads it back)


def read_services(path: Path, *, positive_rate: bool = True,
                  models: Sequence[str] | None = None) -> list[Service]:
    """A services file (YAML or JSON): a list of ``{name, model, rate, slo_ms}``.

    ``rate`` must be > 0 req/s (>= 0 without ``positive_rate``: a re-plan may measure no
    traffic), ``slo_ms`` > 0, and ``model`` one of ``models`` when given (the profiled ones).
    A generative service (``slo_ttft_ms``...) is refused: :func:`read_plan_services` reads
    those."""
    out = read_plan_services(path, positive_rate=positive_rate, models=models)
    for row, svc in enumerate(out, start=1):
        if isinstance(svc, GenerativeService):
            raise InputError(path, row, "slo_ms", "missing: a generative service (slo_ttft_ms, "
                             "slo_tpot_ms) is planned by gpuslice plan with --gen-profiles")
    return [s for s in out if isinstance(s, Service)]


GENERATIVE_FIELDS = ("slo_ttft_ms", "slo_tpot_ms", "prompt_tokens", "output_tokens")


def read_plan_services(path: Path, *, positive_rate: bool = True,
                       models: Sequence[str] | None = None,
                       gen_models: Sequence[str] | None = None
                       ) -> list[Service | GenerativeService]:
    """The services of a services file in its order, as :func:`read_services`, and generative
    ones: ``{name, model, rate, slo_ttft_ms, slo_tpot_ms, prompt_tokens, output_tokens}`` in
    place of ``slo_ms`` (``model`` one of ``gen_models`` when given: the models of the
    generative profiles)."""
    data = _load(path)
    items = data.get("services") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise InputError(path, None, "services", "expected a non-empty list of services")
    out: list[Service | GenerativeService] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InputError(path, i + 1, None, "expected a mapping with model, rate, slo_ms")
        generative = any(k in item for k in GENERATIVE_FIELDS)
        required = ("model", "rate", *GENERATIVE_FIELDS) if generative else \
            ("model", "rate", "slo_ms")
        for key in required:
            if key not in item:
                raise InputError(path, i + 1, key, "missing" + (
                    " (a generative service gives slo_ttft_ms, slo_tpot_ms, prompt_tokens and "
                    "output_tokens)" if generative else ""))
        if generative and "slo_ms" in item:
            raise InputError(path, i + 1, "slo_ms", "expected slo_ms or the generative SLOs "
                             "(slo_ttft_ms, slo_tpot_ms), not both")
        rate = _number(path, i + 1, "rate", item["rate"])
        if not (rate > 0 or (rate == 0 and not positive_rate)):
            raise InputError(path, i + 1, "rate", f"expected a request rate "
                             f"{'>' if positive_rate else '>='} 0 req/s, got {item['rate']!r}")
        model = item["model"]
        if not isinstance(model, str) or not model.strip():
            raise InputError(path, i + 1, "model", f"expected a model name, got {model!r}")
        known = gen_models if generative else models
        if known is not None and model not in known:
            raise InputError(path, i + 1, "model", f"no {'generative ' if generative else ''}"
                             f"profile for model {model!r}; the profiles have "
                             f"{', '.join(sorted(known)) or 'no model'}")
        name = _name(path, i + 1, item.get("name", model), "name" in item)
        out.append(_generative(path, i + 1, item, name, rate) if generative else
                   Service(name, model, rate, _slo(path, i + 1, item)))
    return out


def _slo(path: Path, row: int, item: dict[str, Any]) -> float:
    slo = _number(path, row, "slo_ms", item["slo_ms"])
    if not slo > 0:
        raise InputError(path, row, "slo_ms",
                         f"expected a latency SLO > 0 ms, got {item['slo_ms']!r}")
    return slo


def _generative(path: Path, row: int, item: dict[str, Any], name: str,
                rate: float) -> GenerativeService:
    """A generative service of a services file; a value out of range names its field."""
    values = {k: _number(path, row, k, item[k]) for k in GENERATIVE_FIELDS}
    try:
        return GenerativeService(name, item["model"], rate, **values)
    except ValidationError as exc:
        raise InputError(path, row, exc.field.rpartition(": ")[2],
                         f"expected {exc.expected}, got {exc.got!r}") from None


@dataclass(frozen=True)
class GenerativePlan:
    """A generative service as planned: the service, and per (GPU, MIG compute slices) the
    profile row its replica there was sized from (for the plan document and the router)."""

    service: GenerativeService
    by_slice: dict[tuple[str, int], GenerativePoint]


def plannable(path: Path, services: Sequence[Service | GenerativeService],
              points: Sequence[GenerativePoint], latency_factor: float
              ) -> tuple[list[Service], list[ProfilePoint], dict[str, GenerativePlan]]:
    """The planner's services for ``services`` read from ``path``, the profile points of the
    generative ones (:func:`~gpuslice.core.generative.planner_inputs`, models measured only
    under MPS caps given MIG-sized stand-ins) and how each was sized; a generative service
    whose SLOs no profiled slice holds is refused naming its row and the SLO."""
    from gpuslice.core.generative import capacities, planner_inputs
    from gpuslice.core.profiles import mps_as_mig

    out: list[Service] = []
    points_out: list[ProfilePoint] = []
    sized: dict[str, GenerativePlan] = {}
    for row, svc in enumerate(services, start=1):
        if isinstance(svc, Service):
            out.append(svc)
            continue
        try:
            (planned,), pts = planner_inputs([svc], points, latency_factor)
        except ValidationError as exc:
            raise InputError(path, row, exc.field.rpartition(": ")[2],
                             f"expected {exc.expected}, got {exc.got!r}") from None
        out.append(planned)
        mig = mps_as_mig(ProfileSet.of(pts)).points
        points_out.extend(mig)
        caps = capacities(svc, points, latency_factor)
        # each MIG point is a row's own, or the stand-in of an MPS row (the same numbers)
        sized[svc.name] = GenerativePlan(svc, {
            (q.gpu, q.slice_size): c.point for q in mig if q.slice_kind == "mig"
            for c in caps if c.point.gpu == q.gpu and c.rate_rps == q.throughput and (
                c.point.slice_kind != "mig" or c.point.slice_size == q.slice_size)})
    return out, points_out, sized


def generative_fields(g: GenerativePlan) -> dict[str, Any]:
    """What a plan document says of a generative service beyond a batch one's: the API, the
    model clients name, its SLOs and lengths (the router reads ``api``, ``models``,
    ``slo_ttft_ms``, ``slo_tpot_ms`` and ``mean_output_tokens``)."""
    s = g.service
    return {"api": "openai", "models": [s.model], "slo_ttft_ms": s.slo_ttft_ms,
            "slo_tpot_ms": s.slo_tpot_ms, "prompt_tokens": s.prompt_tokens,
            "mean_output_tokens": max(1, round(s.output_tokens))}


def generative_segment(g: GenerativePlan, gpu: str, size: int) -> dict[str, Any]:
    """A planned replica's token speeds as the router takes them: prefill tokens/s, decode
    tokens/s of one sequence (1 / a full batch's step: conservative) and its sequences."""
    p = g.by_slice.get((gpu, size))
    if p is None:
        return {}
    return {"prefill_tokens_per_s": p.prefill_tokens_per_s,
            "decode_tokens_per_s": round(1.0 / p.step_s, 3), "max_num_seqs": p.max_seqs}


# a service's name names its Kubernetes objects (planning/export.py): the Deployment
# NAME-gGPU-PROFILE-START, which is also the value of the gpuslice.io/replica label, and the
# app.kubernetes.io/name and gpuslice.io/service labels. A label value has at most 63
# characters, and the suffix takes up to 23 (-g9999-7g-141gb-6 and room to spare), so the
# name is a DNS-1123 label of at most 40.
NAME_MAX = 40
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _load(path: Path) -> object:
    """The document of a YAML or JSON file; one line naming the file when it cannot be read."""
    if not path.is_file():
        raise InputError(path, None, None, "file not found")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(path, None, None, "not a UTF-8 text file (YAML or JSON)") from None
    except OSError as exc:
        raise InputError(path, None, None, f"cannot be read: {exc.strerror or exc}") from None
    except (yaml.YAMLError, ValueError) as exc:
        raise InputError(path, None, None, "not valid YAML/JSON: "
                         f"{' '.join(str(exc).split())}") from None


def _name(path: Path, row: int, value: object, given: bool) -> str:
    """A service name: a DNS-1123 label (lowercase letters, digits and '-', starting and ending
    with a letter or digit) of at most :data:`NAME_MAX` characters."""
    if isinstance(value, str) and len(value) <= NAME_MAX and _DNS_LABEL.fullmatch(value):
        return value
    hint = "" if given else " (the model's name, as the service has none: give it a name)"
    raise InputError(path, row, "name", f"expected a DNS-1123 label of at most {NAME_MAX} "
                     "characters (lowercase letters, digits and '-', starting and ending with "
                     f"a letter or digit: it names the service's Kubernetes objects), got "
                     f"{value!r}{hint}")


def _number(path: Path, row: int, field: str, value: object) -> float:
    """A finite number (an int or a float; YAML's true/false are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InputError(path, row, field, f"expected a number, got {value!r}")
    try:
        x = float(value)
    except ValueError:
        raise InputError(path, row, field, f"expected a number, got {value!r}") from None
    except OverflowError:  # an int of hundreds of digits
        x = math.inf
    if not math.isfinite(x):
        raise InputError(path, row, field, f"expected a finite number, got {_short(value)}")
    return x


def _short(value: object) -> str:
    """``value`` for a message: a 400-digit number cut to its first digits and its length."""
    text = repr(value) if not isinstance(value, int) else str(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def read_fleet(path: Path) -> list[FleetType]:
    """A fleet file: a list of ``{gpu, count (optional), cost_per_hour}``."""
    data = _load(path)
    items = data.get("fleet") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise InputError(path, None, "fleet", "expected a non-empty list of GPU types")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "gpu" not in item:
            raise InputError(path, i + 1, "gpu", "missing")
        count = item.get("count")
        if count is not None:
            count = _count(path, i + 1, count)
        source = item.get("profiles_from")
        if source is not None and not (isinstance(source, str) and source.strip()):
            raise InputError(path, i + 1, "profiles_from", "expected the GPU model whose "
                             f"profiles stand in for this one's, got {source!r}")
        out.append(FleetType(str(item["gpu"]), count,
                             _cost(path, i + 1, item.get("cost_per_hour", 1.0)),
                             source.strip() if source else None))
    return out


def with_derived(profiles: ProfileSet, fleet: Sequence[FleetType], path: Path) -> ProfileSet:
    """``profiles`` and, for each fleet type with ``profiles_from`` and no profile of its
    own, that GPU's profiles rescaled by the speed model (``core.speedmodel.rescale``); a
    source with no MIG profile is refused naming the fleet file, row and field."""
    from gpuslice.core import catalog
    from gpuslice.core.speedmodel import rescale

    have = set(profiles.gpus())
    extra: list[ProfilePoint] = []
    for row, ft in enumerate(fleet, start=1):
        if ft.profiles_from is None or ft.gpu in have:
            continue
        model = catalog.lookup(ft.profiles_from)
        name = model.name if model is not None else ft.profiles_from
        derived = rescale(profiles, name, ft.gpu).points if name in have else ()
        if not derived:
            raise InputError(path, row, "profiles_from", "expected a GPU model with MIG "
                             f"profiles in --profiles ({', '.join(sorted(have)) or 'none'}), "
                             f"got {ft.profiles_from!r}")
        extra.extend(derived)
    return ProfileSet.of([*profiles.points, *extra]) if extra else profiles


def _cost(path: Path, row: int, value: object) -> float:
    """A fleet ``cost_per_hour``: a finite number >= 0."""
    try:
        x = float(value) if not isinstance(value, bool) else math.nan  # type: ignore[arg-type]
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x) or x < 0:
        raise InputError(path, row, "cost_per_hour",
                         f"expected a finite number >= 0, got {value!r}")
    return x


def _count(path: Path, row: int, value: object) -> int:
    """A fleet ``count``: a whole number >= 0 (``2.0`` will do; ``1.5``, ``"abc"`` will not)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(path, row, "count", f"expected a whole number >= 0, got {value!r}")
    return value


def run_plan(profiles: ProfileSet, services: Sequence[Service], fleet: Sequence[FleetType],
             opts: PlanOptions, *, seed: int = 1, check: bool = True,
             baselines: dict[str, int | None] | None = None, priced: bool = False) -> PlanRun:
    """Plan, check by replay and compare; ``priced``: the fleet's cost_per_hour are prices
    (a fleet file's), so the report gives the plan's cost per hour."""
    svcs = list(services)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    if check:
        checked = plan_and_check(profiles, svcs, fleet, opts, rng=rng)
        p, rounds = checked.plan, checked.rounds
    else:
        p, rounds = plan(profiles, svcs, fleet, opts), 1
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    # the acceptance replay: real rates, a fresh seed, more requests than the check used
    replayed = replay_plan(profiles, p, svcs, np.random.default_rng(seed + 1000), 50_000)
    check_s = time.perf_counter() - start
    gpu_types = sorted({ft.gpu for ft in fleet} or set(profiles.gpus()))
    base = dict(baselines or {})
    base["exclusive"] = exclusive_gpus(profiles, svcs, gpu_types[0], opts.latency_factor)
    singles: dict[str, float] = {}
    if len(gpu_types) > 1 and opts.objective == "cost":
        for g in gpu_types:
            only = [ft for ft in fleet if ft.gpu == g] or [FleetType(g)]
            try:
                singles[g] = plan(profiles, svcs, only, opts).cost
            except GpusliceError:
                continue
    return PlanRun(p, svcs, replayed, plan_s, check_s, rounds, base,
                   validate(p, svcs, opts.latency_factor), singles,
                   {ft.gpu: ft.cost_per_hour for ft in fleet} if priced else None, tuple(fleet))


def parva_baseline(profiles_dir: Path, scenario: int) -> int | None:
    path = profiles_dir / "deployment" / f"SLO{scenario}_ParvaGPU_deploy.csv"
    return read_parva_deployment(path) if path.is_file() else None


def scenario_services(profiles_dir: Path, rate: Path | None, latency: Path | None,
                      scenario: int) -> list[Service]:
    rate = rate or profiles_dir / "SLO" / "SLO_req_rate.csv"
    latency = latency or profiles_dir / "SLO" / "SLO_latency.csv"
    return [Service(s.name, s.model, s.rate, s.slo_ms)
            for s in read_scenario(rate, latency, scenario)]


def load_profiles(path: Path) -> ProfileSet:
    """Profiles from a ParvaGPU folder or a gpuslice CSV; models measured only under MPS caps
    (``gpuslice profile`` on a GPU without MIG) get MIG-sized stand-ins the planner can pack.
    A GPU the catalogue does not know is refused, naming the file and row."""
    from gpuslice.core.profiles import mps_as_mig

    return mps_as_mig(read_profiles(path, catalogue_gpus=True))


def to_json(run: PlanRun, generative: Mapping[str, GenerativePlan] | None = None
            ) -> dict[str, Any]:
    """The plan document; ``generative``: how the generative services were sized
    (:func:`plannable`), whose fields their entries and segments then carry."""
    gen = generative or {}
    p = run.plan
    by_service = {r.service: r for r in run.replay}
    gpu_list = []
    for g in p.gpus:
        gpu_list.append({
            "index": g.index, "gpu": g.gpu,
            "mig_layout": [{
                "profile": s.placement.profile.name, "start": s.placement.start,
                "processes": [_part(c) for c in s.parts],
            } for s in g.slots],
        })
    services = []
    for svc in run.services:
        segs = p.segments(svc.name)
        r = by_service.get(svc.name)
        g_plan = gen.get(svc.name)
        services.append({
            "name": svc.name, "model": svc.model, "rate_rps": svc.rate, "slo_ms": svc.slo_ms,
            **({} if g_plan is None else generative_fields(g_plan)),
            "capacity_rps": round(p.capacity(svc.name), 3),
            "segments": [{"gpu": g.index, "profile": s.placement.profile.name,
                          "start": s.placement.start, **_part(c),
                          **({} if g_plan is None else generative_segment(g_plan, g.gpu,
                                                                          c.size))}
                         for g, s, c in segs],
            "replayed_p50_ms": None if r is None else round(r.p50_ms, 3),
            "replayed_p99_ms": None if r is None else round(r.p99_ms, 3),
            "within_slo_pct": None if r is None else round(r.within_slo_pct, 3),
            "slo_met": None if r is None else r.ok,
        })
    return {
        "gpus": p.n_gpus,
        "gpus_by_type": dict(Counter(g.gpu for g in p.gpus)),
        "objective": p.objective,
        "cost": p.cost,
        # what the plan's GPUs cost per hour at the fleet's prices (None: no prices given)
        "cost_per_hour": None if run.prices is None else
        round(sum(run.prices.get(g.gpu, 0.0) for g in p.gpus), 6),
        "lower_bound": p.lower_bound,
        # the bound is on what the objective minimises: GPUs, or cost per hour
        "lower_bound_unit": "cost_per_hour" if p.objective == "cost" else "gpus",
        "solver": p.solver,
        "seconds": {"plan": round(run.plan_seconds, 3), "replay": round(run.check_seconds, 3)},
        "replan_rounds": run.rounds,
        # the GPU types it was planned on (profiles_from: whose profiles stand in for one's)
        "fleet": [{"gpu": ft.gpu, "count": ft.count, "cost_per_hour": ft.cost_per_hour,
                   "profiles_from": ft.profiles_from} for ft in run.fleet],
        "baselines": run.baselines,
        "single_type_cost": run.single_type_costs,
        "valid": not run.errors,
        "errors": run.errors,
        "slo_violations": [r.service for r in run.replay if not r.ok],
        "problems": [{"service": pr.service, "reason": pr.reason} for pr in p.problems],
        "gpu_list": gpu_list,
        "services": services,
    }


def _part(c: Any) -> dict[str, Any]:
    return {"service": c.service, "model": c.model, "batch": c.batch, "procs": c.procs,
            "thread_pct": c.thread_pct, "colocated_procs": c.colocated,
            "throughput_rps": round(c.throughput, 3),
            "batch_latency_ms": round(c.latency_s * 1000, 3)}


def fleet_from_json(doc: Any) -> list[FleetType]:
    """The fleet a plan written by :func:`to_json` was made on (empty for a plan written
    before plans recorded it, or by hand); entries that are not well formed are left out."""
    items = doc.get("fleet") if isinstance(doc, dict) else None
    out = []
    for f in items if isinstance(items, list) else []:
        if not (isinstance(f, dict) and isinstance(f.get("gpu"), str)):
            continue
        count, cost, source = f.get("count"), f.get("cost_per_hour", 1.0), f.get("profiles_from")
        out.append(FleetType(f["gpu"], count if isinstance(count, int) else None,
                             float(cost) if isinstance(cost, int | float) else 1.0,
                             source if isinstance(source, str) else None))
    return out


def plan_from_json(doc: Any, where: str = "plan") -> Plan:
    """A plan written by :func:`to_json` (``gpuslice plan --json``), read back."""
    from gpuslice.core import catalog
    from gpuslice.core.mig import MigPlacement
    from gpuslice.core.planner import Config, PlannedGpu, Slot

    if not isinstance(doc, dict) or not isinstance(doc.get("gpu_list"), list):
        raise ValidationError(f"{where}: gpu_list", "a plan written by gpuslice plan --json",
                              type(doc).__name__)
    gpus = []
    for i, g in enumerate(doc["gpu_list"]):
        w = f"{where}: gpu_list[{i}]"
        try:
            model = catalog.lookup(str(g["gpu"]))
            if model is None or model.mig is None:
                raise ValidationError(f"{w}.gpu", "a MIG-capable GPU model", g["gpu"])
            slots = []
            for s in g["mig_layout"]:
                prof = model.mig.profile(str(s["profile"]))
                parts = tuple(Config(
                    str(c["service"]), str(c["model"]), model.name, prof.compute_slices,
                    prof.name, int(c["batch"]), int(c["procs"]), float(c["throughput_rps"]),
                    float(c["batch_latency_ms"]) / 1000, int(c.get("colocated_procs", 0)))
                    for c in s["processes"])
                slots.append(Slot(MigPlacement(int(s["start"]), prof), parts))
            gpus.append(PlannedGpu(int(g["index"]), model.name, tuple(slots)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValidationError(w, "index, gpu and mig_layout with processes",
                                  str(exc)) from None
    return Plan(tuple(gpus), str(doc.get("objective", "gpus")), float(doc.get("cost", 0)),
                float(doc.get("lower_bound", 0)), str(doc.get("solver", "file")))
