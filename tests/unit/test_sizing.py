"""Slice sizing for co-located replicas (pure core), on profiles drawn from a known shape."""

from __future__ import annotations

import pytest

from gpuslice.core.profiles import ProfilePoint, ProfileSet
from gpuslice.core.sizing import Tenant, Unsizable, size_slices
from gpuslice.core.speedmodel import service_time_s

CAPS = (10, 20, 30, 40, 50, 70, 100)


def mps_profiles(model: str = "resnet50", gpu: str = "H100-SXM") -> ProfileSet:
    pts = []
    for procs in (1, 2, 4, 8):
        slow = 1 + 0.05 * (procs - 1)  # co-runners cost a little
        for cap in CAPS:
            for b in (1, 2, 4, 8, 16):
                t = service_time_s(model, gpu, cap / 100, b) * slow
                pts.append(ProfilePoint(model, gpu, "mps", cap, b, procs, b / t, t, 1.2 * t))
    return ProfileSet.of(pts)


PROF = mps_profiles()


def test_the_critical_replica_gets_the_smallest_cap_that_holds_its_slo() -> None:
    out = size_slices([Tenant("lc", "resnet50", slo_ms=40.0)] +
                      [Tenant(f"be{i}", "resnet50") for i in range(3)], PROF, "H100-SXM")
    lc = out[0]
    assert lc.critical and lc.p99_ms <= 40.0
    smaller = [p for p in PROF.points if p.procs == 4 and p.slice_size < lc.thread_pct
               and p.tail_latency_s * 1000 <= 40.0]
    assert not smaller  # no smaller profiled cap would do
    be = out[1:]
    assert sum(s.thread_pct for s in out) <= 100
    assert {s.thread_pct for s in be} == {be[0].thread_pct}  # same model: an even split
    assert all(s.batch == 16 for s in be)  # best effort takes the most throughput
    assert lc.priority == "latency-critical" and {s.priority for s in be} == {"best-effort"}


def test_best_effort_replicas_share_what_is_left_by_throughput() -> None:
    out = size_slices([Tenant("a", "resnet50"), Tenant("b", "resnet50")], PROF, "H100-SXM")
    assert sum(s.thread_pct for s in out) == 100 and out[0].throughput > 0


@pytest.mark.parametrize(("tenants", "text"), [
    ([Tenant("lc", "resnet50", slo_ms=1.0)], "no profiled cap meets its 1 ms SLO"),
    ([Tenant(f"lc{i}", "resnet50", slo_ms=12.0) for i in range(4)], "need"),
    ([Tenant("x", "bert-base")], "no MPS profile of bert-base"),
])
def test_impossible_sizings_say_why(tenants: list[Tenant], text: str) -> None:
    with pytest.raises(Unsizable, match=text):
        size_slices(tenants, PROF, "H100-SXM")


def test_identical_replicas_on_a_straight_stretch_get_identical_caps() -> None:
    """Found on an H200 profile (issue 32): caps measured at sevenths make the interpolated
    throughput a straight line between them, where every split of the same total ties; the
    split must then be the most even one, not the first the knapsack met ([17, 27, 28, 28])."""
    pts = [ProfilePoint("m", "G", "mps", cap, 8, 1, 10.0 * cap, 0.005, 0.006)
           for cap in (14, 28, 43, 57, 100)]
    prof = ProfileSet.of(pts)
    for n, want in ((2, [50, 50]), (4, [25] * 4), (5, [20] * 5)):
        out = size_slices([Tenant(f"r{i}", "m", batches=(8,)) for i in range(n)], prof, "G",
                          step=1, min_pct=1)
        assert [s.thread_pct for s in out] == want
    seven = [s.thread_pct for s in size_slices([Tenant(f"r{i}", "m", batches=(8,))
                                                for i in range(7)], prof, "G", step=1,
                                               min_pct=1)]
    assert sum(seven) == 100 and max(seven) - min(seven) == 1
