"""``plan --objective cost`` (issue 54): the report prints the plan's cost per hour with its
unit and the bound in the objective's unit, and the shipped example fleet is mixed, so the two
objectives give two different plans; a fleet type nobody profiled borrows another's profiles
through the speed model (``profiles_from``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.cli import main
from gpuslice.core.profiles import ProfilePoint, ProfileSet
from gpuslice.core.speedmodel import gpu_speed, rescale
from tests.cli.test_bad_input import run

FAST = ["--time-limit", "0.3", "--no-check"]


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["plan", "--example", *FAST, *argv])
    return code, capsys.readouterr().out


def test_cost_objective_prints_the_cost_in_dollars_per_hour_and_its_bound(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _plan(["--objective", "cost"], capsys)
    assert code == 0
    title = out.splitlines()[0]
    # the bound is a cost, so it is printed as one; no bare "lower bound 2.40" beside GPUs
    assert "lower bound $" in title and "/h" in title, title
    assert "cost: $" in out and "/h at the fleet's prices" in out


def test_the_example_fleet_is_mixed_so_cost_changes_the_plan(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--example", *FAST, "-o", "json"]) == 0
    fewest = json.loads(capsys.readouterr().out)
    assert main(["plan", "--example", *FAST, "--objective", "cost", "-o", "json"]) == 0
    cheapest = json.loads(capsys.readouterr().out)
    assert fewest["gpus_by_type"] == {"A100-80GB": 1} and fewest["lower_bound_unit"] == "gpus"
    assert set(cheapest["gpus_by_type"]) == {"A30"}
    assert cheapest["lower_bound_unit"] == "cost_per_hour"
    assert cheapest["cost_per_hour"] < fewest["cost_per_hour"] == pytest.approx(4.10)
    assert cheapest["lower_bound"] <= cheapest["cost_per_hour"] + 1e-6


def test_gpus_objective_states_the_bound_in_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _plan([], capsys)
    assert code == 0
    assert "lower bound 1.00 GPUs" in out.splitlines()[0]
    assert "$4.10/h" in out


def test_no_fleet_file_means_no_prices(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       ) -> None:
    assert main(["plan", "--profiles", "builtin:a100-80gb", "--services", "builtin:example",
                 *FAST, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost_per_hour"] is None


def test_rescale_draws_a30_points_from_a100_ones() -> None:
    a100 = ProfileSet.of([ProfilePoint("m", "A100-80GB", "mig", s, 4, 1, 100.0 * s, 0.04 / s)
                          for s in (1, 2, 3, 4, 7)])
    a30 = rescale(a100, "A100-80GB", "A30")
    assert sorted(p.slice_size for p in a30.points) == [1, 2, 4]  # the A30's MIG sizes
    one = next(p for p in a30.points if p.slice_size == 1)
    f = gpu_speed("A30") * (1 / 4) ** 0.8 / (gpu_speed("A100-80GB") * (1 / 7) ** 0.8)
    assert one.gpu == "A30" and one.throughput == pytest.approx(100.0 * f)
    assert one.latency_s == pytest.approx(0.04 / f)


def test_profiles_from_a_gpu_without_profiles_is_refused_naming_the_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("- {gpu: A100-80GB, cost_per_hour: 4}\n"
                     "- {gpu: A30, cost_per_hour: 1, profiles_from: H100-SXM}\n")
    code, err = run(["plan", "--example", "--fleet", str(fleet), *FAST], capsys)
    assert code == 2
    assert f"{fleet}, row 2, field 'profiles_from'" in err and "H100-SXM" in err, err


def test_replan_reads_the_fleet_a_plan_was_made_on(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The pieces connect: a plan on the example's A30s (profiles drawn from the A100's) is
    re-planned from its plan.json with the A100 profiles alone, as the docs' example does."""
    plan = tmp_path / "plan.json"
    assert main(["plan", "--example", *FAST, "--objective", "cost", "--write-json",
                 str(plan)]) == 0
    doc = json.loads(plan.read_text())
    assert {"gpu": "A30", "count": 8, "cost_per_hour": 1.2, "profiles_from": "A100-80GB"} in \
        doc["fleet"]
    capsys.readouterr()
    assert main(["replan", "--current", str(plan), "--profiles", "builtin:a100-80gb",
                 "--services", "builtin:example-busier", "-o", "json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)
