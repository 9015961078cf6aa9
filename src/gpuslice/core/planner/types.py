"""The planner's inputs and outputs (services, fleet types, slice configurations, plans,
options), and scipy's optimizer, imported when a plan is solved."""


from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpuslice.core.errors import MissingDependency, ValidationError
from gpuslice.core.mig import MigPlacement


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
    """A GPU type the plan may use: how many (None: unlimited) and the hourly cost;
    ``profiles_from``: a GPU type whose profiles stand in for this one's, rescaled by the speed
    model (``core.speedmodel.rescale``), where this one was never profiled."""

    gpu: str
    count: int | None = None
    cost_per_hour: float = 1.0
    profiles_from: str | None = None


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
