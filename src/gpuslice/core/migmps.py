"""MPS slices inside MIG instances: the room a MIG instance has for them, the best instance for
a request, and the thread percentage a slice gets inside its instance.

On a MIG-enabled GPU there is no whole-GPU device: an MPS slice lives in a MIG instance, with
its own MPS daemon per instance. Shares stay in the contract's unit, milli of the *GPU*: an
instance of ``c`` of the GPU's ``C`` compute slices holds ``1000 * c // C`` milli, and a slice
of ``m`` milli in it gets ``m`` / that of the instance's threads. An instance is either held
whole by one MIG-isolated pod, or shared by MPS slices; never both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuslice.core.assignment import Assignment, Mode
from gpuslice.core.podrequest import ContainerRequest, pod_requests


@dataclass(frozen=True, slots=True)
class InstanceRoom:
    """One MIG instance and what live assignments hold of it."""

    gpu: str  # the GPU's UUID
    profile: str
    start: int
    capacity_milli: int
    memory_mib: int
    used_milli: int = 0
    used_mib: int = 0
    whole: bool = False  # held by a MIG-isolated pod

    @property
    def free_milli(self) -> int:
        return 0 if self.whole else self.capacity_milli - self.used_milli

    @property
    def free_mib(self) -> int:
        return 0 if self.whole else self.memory_mib - self.used_mib

    def __str__(self) -> str:
        held = "held whole" if self.whole else f"{self.free_milli} milli, {self.free_mib} MiB free"
        return f"{self.profile}@{self.start} ({held})"


def capacity_milli(compute_slices: int, gpu_compute_slices: int) -> int:
    """The GPU milli a MIG instance of ``compute_slices`` stands for (3 of 7: 428)."""
    return 1000 * compute_slices // gpu_compute_slices


def thread_pct(milli: int, compute_slices: int, gpu_compute_slices: int) -> int:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` inside the instance for a slice of ``milli`` of the
    GPU: 214 milli in a 3g of 7 is 50%."""
    cap = capacity_milli(compute_slices, gpu_compute_slices)
    return max(1, min(100, round(100 * milli / cap)))


def usage(assignments: Iterable[Assignment]) -> dict[tuple[str, int], tuple[int, int, bool]]:
    """(GPU UUID, start) -> (milli, MiB, held whole) that assignments take of MIG instances."""
    out: dict[tuple[str, int], tuple[int, int, bool]] = {}
    for a in assignments:
        # what the pod holds of each instance at its peak (init containers reuse; the app
        # containers and sidecars add up): the effective-request rule over its containers
        reqs = []
        whole: set[tuple[str, int]] = set()
        for c in a.containers:
            r: dict[tuple[str, int, str], int] = {}
            for g in c.gpus:
                if not g.mig_profile:
                    continue
                r[(g.uuid, g.mig_start, "milli")] = r.get((g.uuid, g.mig_start, "milli"), 0) \
                    + g.milli
                r[(g.uuid, g.mig_start, "mib")] = r.get((g.uuid, g.mig_start, "mib"), 0) \
                    + g.memory_mib
                if c.mode is Mode.MIG:
                    whole.add((g.uuid, g.mig_start))
            reqs.append(ContainerRequest(c.name, c.kind, r))
        eff = pod_requests(reqs)
        for (uuid, start, what), value in eff.items():
            milli, mib, held_whole = out.get((uuid, start), (0, 0, False))
            if what == "milli":
                milli += value
            else:
                mib += value
            out[(uuid, start)] = (milli, mib, held_whole or (uuid, start) in whole)
    return out


def memory_share(milli: int, room: InstanceRoom) -> int:
    """A slice's share of an instance's memory: its milli of the instance's milli."""
    return min(room.memory_mib, milli * room.memory_mib // room.capacity_milli)


def best_instance(rooms: Iterable[InstanceRoom], milli: int,
                  memory_mib: int | None) -> InstanceRoom | None:
    """The instance where a slice fits tightest (least compute, then memory, left over), so
    that big instances stay free for big slices; None when none has room. ``memory_mib`` None:
    the slice takes its share of the instance's memory (:func:`memory_share`)."""
    def need(r: InstanceRoom) -> int:
        return memory_share(milli, r) if memory_mib is None else memory_mib

    fits = [r for r in rooms if r.free_milli >= milli and r.free_mib >= need(r)]
    if not fits:
        return None
    return min(fits, key=lambda r: (r.free_milli - milli, r.free_mib - need(r), r.gpu,
                                    r.start))
