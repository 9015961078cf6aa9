"""The planner's feedback from measured use (issue 53, item 5): slices resized by what each
service's pods used of their shares (``core/resize.py``), the replay deciding whether a
smaller slice is proposed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.planner import Plan, PlannedGpu, Service, Slot
from gpuslice.core.profiles import ProfilePoint, ProfileSet
from gpuslice.core.replay import plan_diff, replan, replay_service
from gpuslice.core.resize import (
    ResizeRule,
    ServiceUsage,
    replan_by_usage,
    resize_by_usage,
)
from tests.planner.usage_helpers import GPU, plan_of, profiles

PROFS = profiles()
CLASSIFY = Service("classify", "resnet50", 600, 150)
DETECT = Service("detect", "densenet121", 500, 150)
# one A100: classify on a 3g.40gb at 0, detect on a 2g.20gb at 4 (the 1g at 6 is free)
PLAN = plan_of(PROFS, [(0, CLASSIFY, 3, 0), (0, DETECT, 2, 4)])


def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def slices(p: Plan, name: str) -> list[str]:
    return [f"{s.placement.profile.name}@{s.placement.start}" for _, s, _ in p.segments(name)]


def test_a_service_using_a_third_of_its_share_gets_a_smaller_slice_that_holds_its_slo() -> None:
    usage = {"classify": ServiceUsage("classify", 0.32, 0.25),
             "detect": ServiceUsage("detect", 0.5, 0.6)}
    out = resize_by_usage(PROFS, PLAN, [CLASSIFY, DETECT], usage, rng=rng())
    c, d = out.resizes
    # 32% of 40 GB is 12.9 GB: a 1g.10gb cannot hold it at 80%, a 2g.20gb can
    assert (c.action, c.before, c.after) == ("smaller", ("3g.40gb",), ("2g.20gb",))
    assert "replayed p99" in c.reason and "< 33%" in c.reason
    assert (d.action, d.after) == ("kept", ("2g.20gb",)) and "not under 33%" in d.reason
    assert slices(out.plan, "detect") == slices(PLAN, "detect")  # nothing else moved
    seg = out.plan.segments("classify")[0][2]
    assert seg.size == 2 and seg.throughput * 0.95 >= CLASSIFY.rate
    worst = max(replay_service(PROFS, out.plan, CLASSIFY, rng()).p99_ms for _ in range(2))
    assert worst <= 0.9 * CLASSIFY.slo_ms
    # the diff names the resized slice twice: the old profile out, the new one in
    assert {(ch.action, ch.profile) for ch in plan_diff(PLAN, out.plan)} == {
        ("remove", "3g.40gb"), ("add", "2g.20gb")}


def test_the_larger_of_memory_and_sms_bounds_the_smaller_slice() -> None:
    # memory would allow a 1g.10gb (10% of 40 GB), the SMs (30% of 3 slices = 0.9) need 2
    u = {"classify": ServiceUsage("classify", 0.1, 0.3), "detect": ServiceUsage("detect", 0.5)}
    out = resize_by_usage(PROFS, PLAN, [CLASSIFY, DETECT], u, rng=rng())
    assert out.resizes[0].after == ("2g.20gb",) and "(SMs)" in out.resizes[0].reason
    # no SM samples: memory alone, said so
    u = {"classify": ServiceUsage("classify", 0.1, None), "detect": ServiceUsage("detect", 0.5)}
    out = resize_by_usage(PROFS, PLAN, [Service("classify", "resnet50", 300, 150), DETECT], u,
                          rng=rng())
    assert out.resizes[0].after == ("1g.10gb",)
    assert "memory; no SM samples" in out.resizes[0].reason


def test_a_service_near_its_share_gets_the_next_larger_slice_where_its_gpu_has_room() -> None:
    usage = {"classify": ServiceUsage("classify", 0.5, 0.5),
             "detect": ServiceUsage("detect", 0.5, 0.95)}
    out = resize_by_usage(PROFS, PLAN, [CLASSIFY, DETECT], usage, rng=rng())
    d = out.resizes[1]
    # 95% of 2 slices is 1.9: at most 80% full takes 3 slices, and 4..7 is free
    assert (d.action, d.before, d.after) == ("larger", ("2g.20gb",), ("3g.40gb",))
    assert slices(out.plan, "detect") == ["3g.40gb@4"] and out.plan.n_gpus == 1
    assert out.grown == frozenset({"detect"})


def test_no_room_on_its_gpu_gives_more_slices_of_its_size() -> None:
    full = plan_of(PROFS, [(0, CLASSIFY, 4, 0), (0, DETECT, 3, 4)])
    usage = {"classify": ServiceUsage("classify", 0.5), "detect": ServiceUsage("detect", 0.97)}
    out = resize_by_usage(PROFS, full, [CLASSIFY, DETECT], usage, rng=rng())
    d = out.resizes[1]
    assert d.action == "more slices" and d.after == ("3g.40gb", "3g.40gb")
    assert "no larger slice holding the peak fits GPU 0" in d.reason
    assert "each pod still holds its own memory" in d.reason  # memory was the bound
    assert out.plan.n_gpus == 2  # GPU 0 is full: a new one


def test_a_smaller_slice_that_breaks_the_slo_in_the_replay_is_not_proposed() -> None:
    # a 1g slice of 100 req/s (batch 8 in 80 ms) is enough on paper for 80 req/s (84 with the
    # 95% rule) and meets the latency rule (80 ms <= 0.45 x 200), but queues past 0.9 x SLO
    profs = ProfileSet.of([ProfilePoint("m", GPU, "mig", 1, 8, 1, 100, 0.08),
                           ProfilePoint("m", GPU, "mig", 3, 8, 1, 400, 0.02)])
    p = plan_of(profs, [(0, Service("a", "m", 80, 200), 3, 0)])
    for rate, action in ((80, "kept"), (50, "smaller")):
        svc = Service("a", "m", rate, 200)
        out = resize_by_usage(profs, p, [svc], {"a": ServiceUsage("a", 0.1, 0.1)}, rng=rng())
        assert out.resizes[0].action == action, out.resizes[0].reason
    out = resize_by_usage(profs, p, [Service("a", "m", 80, 200)],
                          {"a": ServiceUsage("a", 0.1, 0.1)}, rng=rng())
    assert "no smaller slice passed the replay: 1g.10gb replayed p99" in out.resizes[0].reason
    assert out.plan == p
    # on paper too little: refused before any replay, saying so
    out = resize_by_usage(profs, p, [Service("a", "m", 99, 200)],
                          {"a": ServiceUsage("a", 0.1, 0.1)}, rng=rng())
    assert "serves 100 req/s, under the 104 needed" in out.resizes[0].reason


def test_shared_slices_the_smallest_slice_and_services_without_usage_are_kept() -> None:
    cfg_a = PLAN.segments("classify")[0][2]
    cfg_b = PLAN.segments("detect")[0][2]
    two = (replace(cfg_a, colocated=2), replace(cfg_b, colocated=2))
    mixed = Plan((PlannedGpu(0, GPU, (Slot(PLAN.gpus[0].slots[0].placement, two),)),),
                 "gpus", 1.0, 0.0, "test")
    low = {"classify": ServiceUsage("classify", 0.1), "detect": ServiceUsage("detect", 0.1)}
    out = resize_by_usage(PROFS, mixed, [CLASSIFY, DETECT], low, rng=rng())
    assert all(r.action == "kept" and "shares its slices" in r.reason for r in out.resizes)
    tiny = plan_of(PROFS, [(0, CLASSIFY, 1, 0)])
    out = resize_by_usage(PROFS, tiny, [CLASSIFY], low, rng=rng())
    assert "no smaller slice holds its peak at most 80% full" in out.resizes[0].reason
    out = resize_by_usage(PROFS, PLAN, [CLASSIFY, DETECT], {}, rng=rng())
    assert [r.reason for r in out.resizes] == ["no usage measured"] * 2 and out.plan == PLAN


def test_a_re_plan_by_rates_does_not_take_back_what_use_asked_for() -> None:
    """The usage re-plan runs the rate re-plan after it: a service whose pods are near their
    share keeps the slices its use asked for, though its profiles say fewer would do; the
    changes are against the plan in force."""
    slow = Service("detect", "densenet121", 100, 150)  # one 2g.20gb would do, on paper
    p = plan_of(PROFS, [(0, slow, 2, 0), (0, slow, 2, 2), (0, CLASSIFY, 3, 4)])
    usage = {"classify": ServiceUsage("classify", 0.32, 0.2),
             "detect": ServiceUsage("detect", 0.5, 0.95)}
    out = replan_by_usage(PROFS, p, [CLASSIFY, slow], usage, rng=rng())
    d = out.resizes[1]
    assert d.action == "more slices" and d.after == ("2g.20gb",) * 3
    # GPU 0 has no 2g position left (classify's 2g.20gb takes 4-5): the third on a new GPU
    assert len(slices(out.replanned.plan, "detect")) == 3
    assert slices(out.replanned.plan, "classify") == ["2g.20gb@4"]
    assert out.replanned.added_gpus == 1 and all(r.ok for r in out.replanned.replay)
    assert {(c.action, c.service) for c in out.replanned.changes} >= {
        ("remove", "classify"), ("add", "classify"), ("add", "detect")}
    assert not any(c.action == "remove" and c.service == "detect"
                   for c in out.replanned.changes)
    # without what use asked for kept, the rate re-plan would take the surplus back
    resized = resize_by_usage(PROFS, p, [CLASSIFY, slow], usage, rng=rng())
    again = replan(PROFS, resized.plan, [CLASSIFY, slow], rng=rng())
    assert len(slices(again.plan, "detect")) < 3


@pytest.mark.parametrize(("kw", "field"), [
    ({"shrink_below": 0.0}, "shrink_below"), ({"shrink_below": 0.95}, "grow_above"),
    ({"grow_above": 1.5}, "grow_above"), ({"fill": 0.0}, "fill"), ({"fill": 1.2}, "fill")])
def test_a_bad_rule_is_refused_naming_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        ResizeRule(**kw)
    assert e.value.field == field


@pytest.mark.parametrize("bad", [float("nan"), -0.1, float("inf")])
def test_a_bad_fraction_of_use_is_refused(bad: float) -> None:
    with pytest.raises(ValidationError, match="usage of a: memory"):
        ServiceUsage("a", bad)
    assert ServiceUsage("a", 0.2, 0.5).peak == 0.5 and ServiceUsage("a", 0.2).peak == 0.2
