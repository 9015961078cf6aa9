"""SliceSchedule layouts no selected GPU can hold, and drain timeouts out of range, are refused
by parse_schedule with the field named (core.reconfig, pure)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.reconfig import MAX_DRAIN_S, parse_schedule


def obj(layout: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "s", "namespace": "ns"},
            "spec": {"layouts": {"x": {"mig": layout}}, "default": "x", **spec}}


def field_of(o: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ValidationError) as exc:
        parse_schedule(o)
    return exc.value.field, str(exc.value)


A100 = {"selector": {"gpuModels": ["A100-80GB"]}}


@pytest.mark.parametrize(("layout", "spec", "field", "text"), [
    ({"mig-devices": {"9g.999gb": 1}}, {}, "spec.layouts.x.mig.mig-devices.9g.999gb",
     "a MIG profile"),
    ({"mig-devices": {"9g.999gb": 1}}, A100, "spec.layouts.x.mig.mig-devices.9g.999gb",
     "(on the A100-80GB)"),
    ({"mig-devices": {"1g.10gb": 8}}, A100, "spec.layouts.x.mig.mig-devices.1g.10gb",
     "no more fits one GPU"),
    ({"mig-devices": {"1g.10gb": 8}}, {}, "spec.layouts.x.mig.mig-devices.1g.10gb",
     "no more fits one GPU"),
    ({"mig-devices": {"3g.40gb": 2, "1g.10gb": 1}}, A100, "spec.layouts.x.mig.mig-devices",
     "a combination that fits one GPU"),
    ({"mig-devices": {"1g.10gb": 10**400}}, A100, "spec.layouts.x.mig.mig-devices.1g.10gb",
     "a count over 10**9"),
    ({"mig-placements": ["4g.40gb@0", "3g.40gb@0"]}, {}, "spec.layouts.x.mig.mig-placements",
     "memory slice 0 is already used by 4g.40gb@0"),
    ({"mig-placements": ["3g.40gb@0", "3g.40gb@0"]}, A100, "spec.layouts.x.mig.mig-placements",
     "already used by 3g.40gb@0"),
    ({"mig-placements": ["9g.99gb@0"]}, A100, "spec.layouts.x.mig.mig-placements",
     "a MIG profile"),
    ({"mig-placements": ["3g.40gb"]}, A100, "spec.layouts.x.mig.mig-placements",
     "items like '3g.40gb@0'"),
    ({"mig-devices": {"1g.6gb": 4}}, A100, "spec.layouts.x.mig.mig-devices.1g.6gb",
     "(on the A100-80GB)"),  # an A30 profile on a schedule for A100s
    ({"mig-devices": {"7g.80gb": 1}}, {"selector": {"gpuModels": ["T4"]}},
     "spec.selector.gpuModels", "MIG-capable"),
])
def test_layouts_no_selected_gpu_holds_are_invalid(layout: dict[str, Any], spec: dict[str, Any],
                                                   field: str, text: str) -> None:
    got_field, message = field_of(obj(layout, **spec))
    assert got_field == field
    assert text in message


def test_layouts_that_fit_some_selected_model_parse() -> None:
    s = parse_schedule(obj({"mig-devices": {"1g.6gb": 4}}))  # the A30's, no gpuModels
    assert s.layouts["x"].for_model("A30")
    with pytest.raises(ValidationError) as exc:  # a selected A100 cannot hold it
        s.layouts["x"].for_model("A100-80GB")
    assert exc.value.field == "spec.layouts.x.mig.mig-devices.1g.6gb"
    assert "(on the A100-80GB)" in str(exc.value)
    ok = parse_schedule(obj({"mig-placements": ["4g.40gb@0", "3g.40gb@4"]}, **A100))
    assert [str(p) for p in ok.layouts["x"].for_model("A100-80GB")] == ["4g.40gb@0",
                                                                         "3g.40gb@4"]


@pytest.mark.parametrize("drain", [10**400, -10**400, MAX_DRAIN_S + 1, math.inf, math.nan,
                                   0, -1.5, "60", True])
def test_drain_timeouts_out_of_range_are_invalid(drain: object) -> None:
    o = obj({"mig-devices": {"7g.80gb": 1}}, drainTimeoutSeconds=drain)
    got_field, message = field_of(o)
    assert got_field == "spec.drainTimeoutSeconds" and f"at most {MAX_DRAIN_S}" in message
    ok = copy.deepcopy(o)
    ok["spec"]["drainTimeoutSeconds"] = MAX_DRAIN_S
    assert parse_schedule(ok).drain_timeout_s == MAX_DRAIN_S
