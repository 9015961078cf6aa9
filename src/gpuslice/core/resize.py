"""Slices resized from measured use: the planner's feedback from what each service's pods used
of their shares (``gpuslice replan --usage-from``).

A service's use is the peak, over the measured window, of the fraction of its share's memory
and of its share's SMs that its busiest pod used (:class:`ServiceUsage`); the larger of the two
bounds a resize (memory alone where the driver gave no SM samples).

- **Smaller.** Under ``shrink_below`` (1/3): each of the service's own slices (a slice it shares
  with another service is left as it is) takes the smallest MIG profile of the planner's sizes
  that holds the peak with headroom: the profile's memory x ``fill`` (0.8) >= the peak memory
  used, and its compute slices x ``fill`` >= the peak SMs used, counted in compute slices. Its
  configuration is the planner's for that size (the best batch and processes whose batch
  latency meets the latency rule). The resized plan must still give the service its rate /
  ``utilisation`` of capacity and hold ``margin`` x its SLO in ``repeats`` replays; where it
  does not, the next larger sizes are tried, up to the size it has (then nothing changes: the
  replay decided, and the reason says what it replayed).
- **Larger.** At or above ``grow_above`` (0.9): each own slice takes the smallest larger
  profile that holds the peak with the same headroom, where the slice's GPU has the room (its
  own position freed, the other slices where they are); a slice that cannot grow so stays,
  and the service gets more slices of its size instead, enough that the load spread over them
  brings the peak down to ``fill`` (at least one), in free MIG positions of planned GPUs first.

Pure: the replays take their random generator from the caller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpuslice.core import catalog
from gpuslice.core.catalog import MigGeometry, MigProfile
from gpuslice.core.errors import ValidationError
from gpuslice.core.mig import MigPlacement, fitting_placements
from gpuslice.core.planner import (
    Config,
    FleetType,
    Plan,
    PlannedGpu,
    PlanOptions,
    Service,
    Slot,
    best_configs,
)
from gpuslice.core.planner.options import slice_profiles
from gpuslice.core.profiles import ProfileSet
from gpuslice.core.replay import Replanned, plan_diff, replan, replay_service


@dataclass(frozen=True, slots=True)
class ServiceUsage:
    """What a service's pods used of their shares at their peak over the measured window,
    each pod against its own share and the highest pod taken: ``memory``, the fraction of its
    share's memory; ``sm``, of its share's SMs (None: the driver gave no SM samples)."""

    service: str
    memory: float
    sm: float | None = None

    def __post_init__(self) -> None:
        for name, x in (("memory", self.memory), ("sm", self.sm)):
            if x is not None and not (math.isfinite(x) and x >= 0):
                raise ValidationError(f"usage of {self.service}: {name}",
                                      "a fraction of the share >= 0", x)

    @property
    def peak(self) -> float:
        """The larger of the two fractions: what bounds a resize."""
        return max(self.memory, 0.0 if self.sm is None else self.sm)

    @property
    def memory_bound(self) -> bool:
        """Whether memory is the larger fraction (or the only one)."""
        return self.sm is None or self.memory >= self.sm

    @property
    def basis(self) -> str:
        """Which fraction :attr:`peak` is, in words."""
        if self.sm is None:
            return "memory; no SM samples"
        return "memory" if self.memory_bound else "SMs"


@dataclass(frozen=True, slots=True)
class ResizeRule:
    """When a service's slices are resized, and how full a resized slice may be at the peak."""

    shrink_below: float = 1 / 3
    grow_above: float = 0.9
    fill: float = 0.8

    def __post_init__(self) -> None:
        if not 0 < self.shrink_below < 1:
            raise ValidationError("shrink_below", "a fraction, more than 0 and below 1",
                                  self.shrink_below)
        if not self.shrink_below < self.grow_above <= 1:
            raise ValidationError("grow_above", f"a fraction above shrink_below "
                                  f"({self.shrink_below:g}) and at most 1", self.grow_above)
        if not 0 < self.fill <= 1:
            raise ValidationError("fill", "a fraction, more than 0 and at most 1", self.fill)


@dataclass(frozen=True, slots=True)
class Resize:
    """The decision for one service: ``action`` is ``smaller``, ``larger``, ``more slices``,
    ``larger, more slices`` or ``kept``; ``before``/``after`` its slices' MIG profiles."""

    service: str
    usage: ServiceUsage | None
    action: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Resized:
    plan: Plan
    resizes: tuple[Resize, ...]

    @property
    def grown(self) -> frozenset[str]:
        """The services given more (a re-plan by rates must not take it back)."""
        return frozenset(r.service for r in self.resizes
                         if r.action.startswith(("larger", "more")))


@dataclass(frozen=True, slots=True)
class _Check:
    """What a resized slice is checked against (the replay and the capacity rule)."""

    profiles: ProfileSet
    rng: np.random.Generator
    latency_factor: float
    utilisation: float
    margin: float
    repeats: int
    requests: int


def _geometry(gpu: str) -> MigGeometry:
    model = catalog.lookup(gpu)
    if model is None or model.mig is None:
        raise ValidationError("plan: gpu", "a MIG-capable GPU model of the catalogue", gpu)
    return model.mig


def _profiles_of(p: Plan, name: str) -> tuple[str, ...]:
    return tuple(s.placement.profile.name for _, s, _ in p.segments(name))


def _summary(profiles: tuple[str, ...]) -> str:
    """``2g.20gb x3``: slices, alike ones counted."""
    counts: dict[str, int] = {}
    for name in profiles:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counts.items())


def _own(p: Plan, name: str) -> list[tuple[int, Slot]]:
    """(GPU index, slot) of every slice that runs only ``name``'s processes."""
    return [(g.index, s) for g in p.gpus for s in g.slots
            if len(s.parts) == 1 and s.parts[0].service == name]


def _holds(prof: MigProfile, slot: Slot, u: ServiceUsage, fill: float) -> bool:
    """Whether ``prof`` holds the peak that ``slot``'s pod used, at most ``fill`` full."""
    part = slot.parts[0]
    share = part.procs / max(part.colocated, part.procs)
    old = slot.placement.profile
    if u.memory * old.memory_mib * share > fill * prof.memory_mib:
        return False
    return u.sm is None or u.sm * old.compute_slices * share <= fill * prof.compute_slices


def _best_spot(geo: MigGeometry, used: list[MigPlacement],
               prof: MigProfile) -> MigPlacement | None:
    """The legal position of ``prof`` next to ``used`` that leaves the most room."""
    fits = [pl for pl in fitting_placements(geo, used) if pl.profile == prof]
    if not fits:
        return None
    return max(fits, key=lambda pl: (len(fitting_placements(geo, [*used, pl])), -pl.start))


def _replace(p: Plan, gpu: int, old: Slot | None, new: Slot | None) -> Plan:
    """``p`` with ``old`` (None: nothing) taken from GPU ``gpu`` and ``new`` (None: nothing)
    put there."""
    gpus = []
    for g in p.gpus:
        if g.index != gpu:
            gpus.append(g)
            continue
        slots = [s for s in g.slots if s is not old] + ([new] if new is not None else [])
        gpus.append(PlannedGpu(g.index, g.gpu,
                               tuple(sorted(slots, key=lambda s: s.placement.key))))
    return Plan(tuple(gpus), p.objective, p.cost, p.lower_bound, p.solver, p.problems)


def _gpu_type(p: Plan, gpu: int) -> str:
    return next(g.gpu for g in p.gpus if g.index == gpu)


def _in_place(p: Plan, gpu: int, slot: Slot, prof: MigProfile, cfg: Config) -> Plan | None:
    """``p`` with ``slot`` on GPU ``gpu`` replaced by a slice of ``prof`` running ``cfg``, in
    a legal position of that GPU (its own freed, the others where they are); None where there
    is none."""
    g = next(x for x in p.gpus if x.index == gpu)
    spot = _best_spot(_geometry(g.gpu), [s.placement for s in g.slots if s is not slot], prof)
    return None if spot is None else _replace(p, gpu, slot, Slot(spot, (cfg,)))


def _add_slice(p: Plan, gpu_type: str, prof: MigProfile, cfg: Config) -> Plan:
    """``p`` with one more slice of ``prof`` running ``cfg``: in a free position of a planned
    GPU of ``gpu_type`` (the first that has one), else on a new GPU."""
    geo = _geometry(gpu_type)
    for g in p.gpus:
        spot = _best_spot(geo, [s.placement for s in g.slots], prof) if g.gpu == gpu_type \
            else None
        if spot is not None:
            return _replace(p, g.index, None, Slot(spot, (cfg,)))
    spot = _best_spot(geo, [], prof)
    assert spot is not None  # every profile fits an empty GPU
    index = max((g.index for g in p.gpus), default=-1) + 1
    cost = p.cost + p.cost / max(p.n_gpus, 1)
    return Plan((*p.gpus, PlannedGpu(index, gpu_type, (Slot(spot, (cfg,)),))), p.objective,
                cost, p.lower_bound, p.solver, p.problems)


def _sizes(p: Plan, gi: int, slot: Slot, svc: Service, u: ServiceUsage, fill: float,
           ck: _Check, larger: bool) -> list[tuple[MigProfile, Config]]:
    """The planner's slice sizes smaller (or ``larger``) than ``slot``'s that hold its peak at
    most ``fill`` full and can serve ``svc`` within the latency rule, smallest first, each
    with the planner's configuration for it."""
    gpu = _gpu_type(p, gi)
    names = slice_profiles(_geometry(gpu))
    cfgs = best_configs(ck.profiles, svc, gpu, ck.latency_factor)
    cur = slot.placement.profile.compute_slices
    return [(names[n], cfgs[n]) for n in sorted(cfgs)
            if (n > cur if larger else n < cur) and _holds(names[n], slot, u, fill)]


def _worst_p99(p: Plan, svc: Service, ck: _Check) -> float:
    """The highest replayed p99 of ``svc`` in ``ck.repeats`` replays (0: no requests)."""
    if svc.rate <= 0:
        return 0.0
    return max(replay_service(ck.profiles, p, svc, ck.rng, ck.requests).p99_ms
               for _ in range(ck.repeats))


def _shrink(p: Plan, svc: Service, u: ServiceUsage, rule: ResizeRule,
            ck: _Check) -> tuple[Plan, Resize]:
    before = _profiles_of(p, svc.name)
    why = f"peak {u.peak:.0%} of its share ({u.basis}) < {rule.shrink_below:.0%}"
    own = _own(p, svc.name)
    if not own:
        return p, Resize(svc.name, u, "kept", before, before,
                         f"{why}, but it shares its slices with other services")
    ladders = [_sizes(p, gi, slot, svc, u, rule.fill, ck, larger=False) for gi, slot in own]
    if not any(ladders):
        return p, Resize(svc.name, u, "kept", before, before, f"{why}, but no smaller slice "
                         f"holds its peak at most {rule.fill:.0%} full")
    need = svc.rate / ck.utilisation
    tried: list[str] = []
    # level k: each slice takes the k-th smallest size that holds its peak (its own size when
    # it has fewer), so each level tries larger slices than the one before
    for level in range(max(len(x) for x in ladders)):
        cand = p
        for (gi, slot), down in zip(own, ladders, strict=True):
            if level < len(down):
                cand = _in_place(cand, gi, slot, *down[level]) or cand
        after = _profiles_of(cand, svc.name)
        if after == before:
            continue
        cap = cand.capacity(svc.name)
        if cap < need - 1e-9:
            tried.append(f"{_summary(after)} serves {cap:.0f} req/s, under the {need:.0f} "
                         f"needed")
            continue
        worst = _worst_p99(cand, svc, ck)
        if worst > ck.margin * svc.slo_ms:
            tried.append(f"{_summary(after)} replayed p99 {worst:.1f} ms > {ck.margin:g} x "
                         f"SLO {svc.slo_ms:g} ms")
            continue
        replayed = f"replayed p99 {worst:.1f} ms <= {ck.margin:g} x SLO {svc.slo_ms:g} ms" \
            if svc.rate > 0 else "no requests at its rate to replay"
        done = f"{why}: {', '.join(sorted(set(after)))} holds the peak at most " \
            f"{rule.fill:.0%} full; {replayed}"
        return cand, Resize(svc.name, u, "smaller", before, after,
                            done + (f" (not {'; '.join(tried)})" if tried else ""))
    if not tried:
        return p, Resize(svc.name, u, "kept", before, before,
                         f"{why}, but no smaller slice fits on its GPU")
    return p, Resize(svc.name, u, "kept", before, before,
                     f"{why}, but no smaller slice passed the replay: {'; '.join(tried)}")


def _grow(p: Plan, svc: Service, u: ServiceUsage, rule: ResizeRule,
          ck: _Check) -> tuple[Plan, Resize]:
    before = _profiles_of(p, svc.name)
    why = f"peak {u.peak:.0%} of its share ({u.basis}) >= {rule.grow_above:.0%}"
    own = _own(p, svc.name)
    if not own:
        return p, Resize(svc.name, u, "kept", before, before,
                         f"{why}, but it shares its slices with other services")
    grown, stuck = 0, []
    for gi, slot in own:
        for prof, cfg in _sizes(p, gi, slot, svc, u, rule.fill, ck, larger=True):
            nxt = _in_place(p, gi, slot, prof, cfg)
            if nxt is not None:
                p, grown = nxt, grown + 1
                break
        else:
            stuck.append((gi, slot))
    said = [f"{grown} slice(s) to a larger profile on their GPU"] if grown else []
    if stuck:
        # the load spread over more slices of the size: enough to bring the peak to fill
        add = max(1, math.ceil(len(stuck) * u.peak / rule.fill) - len(stuck))
        for k in range(add):
            gi, slot = stuck[k % len(stuck)]
            p = _add_slice(p, _gpu_type(p, gi), slot.placement.profile, slot.parts[0])
        gpus = ", ".join(str(gi) for gi in sorted({gi for gi, _ in stuck}))
        said.append(f"no larger slice holding the peak fits GPU {gpus}: {add} more "
                    f"{stuck[0][1].placement.profile.name} slice(s)"
                    + (" (each pod still holds its own memory)" if u.memory_bound
                       else ""))
    action = ", ".join(a for a, on in (("larger", grown), ("more slices", stuck)) if on)
    return p, Resize(svc.name, u, action, before, _profiles_of(p, svc.name),
                     f"{why}: {'; '.join(said)}")


def resize_by_usage(profiles: ProfileSet, current: Plan, services: Sequence[Service],
                    usage: Mapping[str, ServiceUsage], rule: ResizeRule | None = None, *,
                    rng: np.random.Generator, latency_factor: float = 0.45,
                    utilisation: float = 0.95, margin: float = 0.9, repeats: int = 2,
                    requests: int = 30_000) -> Resized:
    """``current`` with each planned service's slices resized by its measured ``usage`` (see
    the module): the services to shrink first (what they free, the ones that grow may take),
    then those to grow. A planned service with no usage keeps its slices."""
    rule = rule or ResizeRule()
    ck = _Check(profiles, rng, latency_factor, utilisation, margin, repeats, requests)
    p = current
    done: dict[str, Resize] = {}
    for grow in (False, True):
        for svc in services:
            before = _profiles_of(p, svc.name)
            u = usage.get(svc.name)
            if not before or svc.name in done:
                continue
            if u is None:
                done[svc.name] = Resize(svc.name, None, "kept", before, before,
                                        "no usage measured")
            elif not grow and u.peak < rule.shrink_below:
                p, done[svc.name] = _shrink(p, svc, u, rule, ck)
            elif grow and u.peak >= rule.grow_above:
                p, done[svc.name] = _grow(p, svc, u, rule, ck)
            elif grow:
                done[svc.name] = Resize(
                    svc.name, u, "kept", before, before,
                    f"peak {u.peak:.0%} of its share ({u.basis}): not under "
                    f"{rule.shrink_below:.0%}, not at {rule.grow_above:.0%}")
    return Resized(p, tuple(done[s.name] for s in services if s.name in done))


@dataclass(frozen=True)
class UsageReplanned:
    """A re-plan by measured use and rates: the plan, its changes against the plan in force
    and its replay (:class:`Replanned`), and the decision per service (``resizes``)."""

    replanned: Replanned
    resizes: tuple[Resize, ...]


def replan_by_usage(profiles: ProfileSet, current: Plan, services: Sequence[Service],
                    usage: Mapping[str, ServiceUsage], rule: ResizeRule | None = None,
                    opts: PlanOptions | None = None, *, rng: np.random.Generator,
                    fleet: Sequence[FleetType] = (), utilisation: float = 0.95,
                    margin: float = 0.9) -> UsageReplanned:
    """:func:`resize_by_usage`, then :func:`~gpuslice.core.replay.replan` at the services'
    rates (slices added where capacity is short, removed where it is surplus, the whole plan
    replayed and repaired; the services given more by their use lose none of it)."""
    o = opts or PlanOptions()
    resized = resize_by_usage(profiles, current, services, usage, rule, rng=rng,
                              latency_factor=o.latency_factor, utilisation=utilisation,
                              margin=margin)
    inc = replan(profiles, resized.plan, services, o, rng=rng, fleet=fleet,
                 utilisation=utilisation, margin=margin, keep=resized.grown)
    old, new = {g.index for g in current.gpus}, {g.index for g in inc.plan.gpus}
    return UsageReplanned(Replanned(inc.plan, tuple(plan_diff(current, inc.plan)), inc.replay,
                                    tuple(sorted(old - new)), len(new - old)),
                          resized.resizes)
