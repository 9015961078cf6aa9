"""``gpuslice plan --fleet FILE``: a count or cost_per_hour that is not what the planner can use
is refused with one line naming the row and field (exit 2), never a traceback, a solver error or
a silently truncated number."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.adapters.traces.alibaba import InputError
from gpuslice.cli import main
from gpuslice.planning.run import read_fleet


@pytest.mark.parametrize(("item", "field", "what"), [
    ("count: abc", "count", "a whole number >= 0, got 'abc'"),
    ("count: [1]", "count", "a whole number >= 0, got [1]"),
    ("count: 1.5", "count", "a whole number >= 0, got 1.5"),
    ("count: -3", "count", "a whole number >= 0, got -3"),
    ("count: true", "count", "a whole number >= 0, got True"),
    ("cost_per_hour: abc", "cost_per_hour", "a finite number >= 0, got 'abc'"),
    ("cost_per_hour: .nan", "cost_per_hour", "a finite number >= 0, got nan"),
    ("cost_per_hour: .inf", "cost_per_hour", "a finite number >= 0, got inf"),
    ("cost_per_hour: -1", "cost_per_hour", "a finite number >= 0, got -1"),
    ("cost_per_hour: [2]", "cost_per_hour", "a finite number >= 0, got [2]"),
    ("cost_per_hour: true", "cost_per_hour", "a finite number >= 0, got True"),
])
@pytest.mark.parametrize("objective", ["gpus", "cost"])
def test_bad_fleet_fields_are_refused_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], item: str, field: str, what: str,
        objective: str) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text(f"- {{gpu: A100-80GB, {item}}}\n")
    assert main(["plan", "--example", "--no-check", "--time-limit", "0.2", "--objective",
                 objective, "--fleet", str(f)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert f"fleet.yaml, row 1, field '{field}': expected {what}" in err, err


def test_good_fleet_values_are_read_as_given(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("fleet:\n  - {gpu: A100-80GB, count: 4, cost_per_hour: 4.10}\n"
                 "  - {gpu: A30, count: 2.0, cost_per_hour: 0}\n  - {gpu: H100-80GB}\n")
    got = [(ft.gpu, ft.count, ft.cost_per_hour) for ft in read_fleet(f)]
    assert got == [("A100-80GB", 4, 4.1), ("A30", 2, 0.0), ("H100-80GB", None, 1.0)]
    assert isinstance(got[1][1], int)


def test_a_fleet_file_that_is_not_yaml_is_an_input_error(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text('"unterminated\n')
    with pytest.raises(InputError, match="not valid YAML"):
        read_fleet(f)
