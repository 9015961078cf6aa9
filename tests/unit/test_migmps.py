"""MPS slices inside MIG instances: capacity, thread caps, use from assignments, best fit."""

from __future__ import annotations

import pytest

from gpuslice.core import migmps
from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode
from gpuslice.core.migmps import InstanceRoom


@pytest.mark.parametrize(("slices", "of", "milli"), [(1, 7, 142), (3, 7, 428), (7, 7, 1000),
                                                     (2, 4, 500), (4, 4, 1000)])
def test_capacity_is_the_instances_part_of_the_gpu(slices: int, of: int, milli: int) -> None:
    assert migmps.capacity_milli(slices, of) == milli


@pytest.mark.parametrize(("milli", "slices", "pct"), [(214, 3, 50), (142, 1, 100), (200, 3, 47),
                                                      (1, 7, 1), (600, 3, 100)])
def test_thread_cap_is_the_share_of_the_instance(milli: int, slices: int, pct: int) -> None:
    assert migmps.thread_pct(milli, slices, 7) == pct


def _a(pod: str, mode: Mode, *shares: GpuShare) -> Assignment:
    return Assignment("ns", pod, "uid", "n", (ContainerAssignment("main", mode, shares),), "t")


def test_usage_sums_mps_tenants_and_marks_instances_held_whole() -> None:
    use = migmps.usage([
        _a("p1", Mode.MPS, GpuShare("G", 100, 4000, "3g.40gb", 0)),
        _a("p2", Mode.MPS, GpuShare("G", 150, 2000, "3g.40gb", 0)),
        _a("p3", Mode.MIG, GpuShare("G", 285, 19968, "2g.20gb", 4)),
        _a("p4", Mode.MPS, GpuShare("H", 300, 1000)),  # a whole-GPU slice: not an instance
    ])
    assert use == {("G", 0): (250, 6000, False), ("G", 4): (285, 19968, True)}


def test_best_instance_is_the_tightest_that_fits() -> None:
    rooms = [InstanceRoom("G", "3g.40gb", 0, 428, 40192),
             InstanceRoom("G", "2g.20gb", 4, 285, 19968, used_milli=100),
             InstanceRoom("G", "1g.10gb", 6, 142, 9728, whole=True)]
    assert migmps.best_instance(rooms, 150, 1000) == rooms[1]  # 185 free: 35 left over
    assert migmps.best_instance(rooms, 200, 1000) == rooms[0]
    assert migmps.best_instance(rooms, 100, 30000) == rooms[0]  # memory decides
    assert migmps.best_instance(rooms, 500, 0) is None
    assert rooms[2].free_milli == 0 and "held whole" in str(rooms[2])
