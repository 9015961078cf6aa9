"""Slice schedules and the room check (pure core)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.reconfig import (
    GpuRoom,
    PodNeed,
    layout_text,
    parse_schedule,
    room_for,
    target_layout,
)

OBJ: dict[str, Any] = {
    "metadata": {"name": "s", "namespace": "ns"},
    "spec": {"layouts": {"day": {"mig": {"mig-devices": {"1g.10gb": 7}}},
                         "night": {"mig": {"mig-placements": ["7g.80gb@0"]}}},
             "windows": [{"layout": "night", "start": "22:00", "end": "06:00"}],
             "default": "day"}}


def test_windows_wrap_past_midnight_and_the_override_wins() -> None:
    s = parse_schedule(OBJ)
    assert [target_layout(s, h * 60) for h in (21, 22, 3, 6, 12)] == \
        ["day", "night", "night", "day", "day"]
    o = copy.deepcopy(OBJ)
    o["spec"]["override"] = "night"
    assert target_layout(parse_schedule(o), 12 * 60) == "night"
    assert layout_text(s.layouts["day"].for_model("A100-80GB")).count("1g.10gb") == 7
    assert layout_text(s.layouts["night"].for_model("A100-80GB")) == "7g.80gb@0"


@pytest.mark.parametrize(("path", "value", "field"), [
    (("spec", "layouts"), {}, "spec.layouts"),
    (("spec", "windows"), [{"layout": "noon", "start": "1:00", "end": "2:00"}],
     "spec.windows[0].layout"),
    (("spec", "windows"), [{"layout": "day", "start": "25:00", "end": "2:00"}],
     "spec.windows[0].start"),
    (("spec", "default"), "dusk", "spec.default"),
    (("spec", "override"), "dusk", "spec.override"),
    (("spec", "drainTimeoutSeconds"), 0, "spec.drainTimeoutSeconds"),
])
def test_bad_schedules_name_the_field(path: tuple[str, ...], value: object, field: str) -> None:
    o = copy.deepcopy(OBJ)
    o[path[0]][path[1]] = value
    with pytest.raises(ValidationError) as exc:
        parse_schedule(o)
    assert exc.value.field == field


def test_selection_by_node_and_model() -> None:
    o = copy.deepcopy(OBJ)
    o["spec"]["selector"] = {"nodes": ["a"], "gpuModels": ["A100"]}
    # a layout the selected A100-40GB can hold (1g.10gb x 7 cannot: the schedule is invalid)
    o["spec"]["layouts"] = {"day": {"mig": {"mig-devices": {"7g.40gb": 1}}}}
    o["spec"]["windows"] = []
    s = parse_schedule(o)
    assert s.selects("a", "A100-40GB") and not s.selects("b", "A100-40GB")
    assert not s.selects("a", "T4")
    assert parse_schedule(OBJ).selects("x", "H100-SXM") and not parse_schedule(OBJ).selects(
        "x", "T4")  # by default every MIG-capable GPU


def test_room_for_is_first_fit_decreasing_with_model_constraints() -> None:
    rooms = [GpuRoom("g1", "n", "A100-80GB", 300, 20000), GpuRoom("g2", "n", "T4", 900, 15000)]
    assert room_for([PodNeed("a", 300, 1000), PodNeed("b", 800, 1000)], rooms) is None
    why = room_for([PodNeed("a", 400, 1000, frozenset({"A100-80GB"}))], rooms)
    assert why is not None and "no room elsewhere for a (400 milli" in why
    assert room_for([PodNeed("a", 500, 1000), PodNeed("b", 500, 1000)], rooms) is not None
