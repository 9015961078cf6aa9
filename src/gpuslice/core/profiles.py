"""Inference profiles: how a model performs on a GPU slice.

A :class:`ProfilePoint` is one measured configuration: a model on a GPU type, in a slice (a MIG
instance of ``slice_size`` compute slices, or ``"mps"`` with a thread percentage, or the whole
GPU), running ``procs`` processes side by side (MPS) with batch size ``batch``; the throughput of
*one* process in requests per second and its latency per batch (p50 and, where measured, p99).

Latencies between measured batch sizes are taken from the next larger measured batch (safe: a
smaller batch never takes longer), and never extrapolated past the largest measured one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuslice.core.errors import ValidationError


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    model: str
    gpu: str
    slice_kind: str  # "mig", "mps" or "whole"
    slice_size: int  # MIG compute slices; MPS thread %; whole GPU: the GPU's compute slices
    batch: int
    procs: int
    throughput: float  # requests/s of ONE process
    latency_s: float  # seconds per batch (p50 as measured)
    latency_p99_s: float | None = None

    def __post_init__(self) -> None:
        where = f"profile {self.model}/{self.gpu}/{self.slice_kind}{self.slice_size}"
        if self.batch < 1:
            raise ValidationError(f"{where}: batch", "a batch size >= 1", self.batch)
        if self.procs < 1:
            raise ValidationError(f"{where}: procs", "a process count >= 1", self.procs)
        if self.throughput < 0 or self.latency_s < 0:
            raise ValidationError(f"{where}: throughput/latency", "values >= 0",
                                  (self.throughput, self.latency_s))

    @property
    def ran(self) -> bool:
        """False for configurations that did not run (zero throughput, e.g. out of memory)."""
        return self.throughput > 0 and self.latency_s > 0

    @property
    def instance_throughput(self) -> float:
        """Requests/s of the whole slice: all its processes together."""
        return self.throughput * self.procs

    @property
    def tail_latency_s(self) -> float:
        return self.latency_p99_s if self.latency_p99_s is not None else self.latency_s


@dataclass(frozen=True)
class ProfileSet:
    points: tuple[ProfilePoint, ...]

    @classmethod
    def of(cls, points: Iterable[ProfilePoint]) -> ProfileSet:
        return cls(tuple(points))

    def models(self) -> list[str]:
        return sorted({p.model for p in self.points})

    def gpus(self) -> list[str]:
        return sorted({p.gpu for p in self.points})

    def for_model(self, model: str) -> list[ProfilePoint]:
        return [p for p in self.points if p.model == model]


def batch_latency(points: Sequence[ProfilePoint], batch: int) -> float:
    """Latency of a batch of ``batch`` on one configuration family (same model, GPU, slice,
    procs), from the smallest measured batch >= ``batch``. Raises past the largest one."""
    ran = sorted((p.batch, p.tail_latency_s) for p in points if p.ran)
    if not ran:
        raise ValidationError("profile", "at least one configuration that ran", 0)
    sizes = [b for b, _ in ran]
    i = bisect.bisect_left(sizes, batch)
    if i == len(sizes):
        raise ValidationError("batch", f"at most the largest measured batch {sizes[-1]}", batch)
    return ran[i][1]


def mps_as_mig(profiles: ProfileSet, compute_slices: int = 7,
               sizes: Sequence[int] = (1, 2, 3, 4, 7)) -> ProfileSet:
    """``profiles`` with MIG-sized stand-ins for models measured only under MPS caps, so the
    planner (which packs MIG slices) can plan with them: a slice of ``s`` compute slices takes
    the point measured at the smallest cap >= s/``compute_slices`` of the GPU (a conservative
    equivalence: the cap's SMs without MIG's memory isolation). Models that have MIG points
    of their own on a GPU are left as they are."""
    have_mig = {(p.model, p.gpu) for p in profiles.points if p.slice_kind == "mig"}
    extra: list[ProfilePoint] = []
    groups: dict[tuple[str, str, int, int], list[ProfilePoint]] = {}
    for pt in profiles.points:
        if pt.slice_kind == "mps" and (pt.model, pt.gpu) not in have_mig:
            groups.setdefault((pt.model, pt.gpu, pt.batch, pt.procs), []).append(pt)
    for (model, gpu, batch, procs), pts in groups.items():
        by_cap = sorted(pts, key=lambda q: q.slice_size)
        for s in sizes:
            want = 100.0 * s / compute_slices
            hit = next((q for q in by_cap if q.slice_size + 1e-9 >= want), None)
            if hit is not None:
                extra.append(ProfilePoint(model, gpu, "mig", s, batch, procs, hit.throughput,
                                          hit.latency_s, hit.latency_p99_s))
    return ProfileSet.of([*profiles.points, *extra])
