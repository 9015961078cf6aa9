"""``gpuslice plan`` / ``replan``: a GPU the planner cannot slice (one without MIG, or one the
catalogue does not know), from the profile CSV through the default fleet or from ``--fleet
FILE``, is refused in one line naming the file, the row and the field, and what would do (exit
2), not with the planner's error that names none of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.cli import main
from tests.cli.test_bad_input import run

HEADER = "model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms\n"
A100 = "m,A100-80GB,mig,1,4,1,200,20\nm,A100-80GB,mig,2,4,1,420,10\nm,A100-80GB,mig,7,4,1,1400,3\n"
MIG_GPUS = "(A30, A100-40GB, A100-80GB, H100-SXM, H100-PCIE, H200; gpuslice gpus lists them)"


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    out = {"a100": tmp_path / "a100.csv", "mixed": tmp_path / "mixed.csv",
           "svc": tmp_path / "s.yaml"}
    out["a100"].write_text(HEADER + A100)
    # row 2 an A100 point, row 3 one measured on a T4 (MPS caps: it has no MIG)
    out["mixed"].write_text(HEADER + A100.splitlines()[0] + "\nm,T4,mps,50,4,1,100,30\n"
                            + "\n".join(A100.splitlines()[1:]) + "\n")
    out["svc"].write_text("- {name: a, model: m, rate: 300, slo_ms: 100}\n")
    return out


def _plan(inputs: dict[str, Path], profiles: str, *extra: str) -> list[str]:
    return ["plan", "--profiles", str(inputs[profiles]), "--services", str(inputs["svc"]),
            "--no-check", "--solver", "greedy", *extra]


def test_a_profiled_gpu_without_mig_in_the_default_fleet_names_the_file_and_row(
        inputs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(_plan(inputs, "mixed"), capsys)
    assert code == 2
    assert err == (f"gpuslice: error: {inputs['mixed']}, row 3, field 'gpu': expected a "
                   "MIG-capable GPU (without --fleet the plan uses every GPU type profiled; "
                   "--fleet FILE names the ones to plan on), got 'T4' (a GPU without MIG)")


def test_the_same_profiles_plan_with_a_fleet_of_mig_gpus(
        inputs: dict[str, Path], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("- {gpu: A100-80GB, count: 2}\n")
    assert main(_plan(inputs, "mixed", "--fleet", str(fleet))) == 0


@pytest.mark.parametrize(("gpu", "why"), [("NoSuchGPU", "not in the catalogue"),
                                          ("T4", "a GPU without MIG")])
def test_a_fleet_gpu_the_planner_cannot_slice_names_the_file_and_entry(
        inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        gpu: str, why: str) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"- {{gpu: A100-80GB, count: 1}}\n- {{gpu: {gpu}, count: 1}}\n")
    expected = (f"gpuslice: error: {fleet}, row 2, field 'gpu': expected a MIG-capable GPU "
                f"model of the catalogue {MIG_GPUS}, got '{gpu}' ({why})")
    code, err = run(_plan(inputs, "a100", "--fleet", str(fleet)), capsys)
    assert (code, err) == (2, expected)
    current = tmp_path / "plan.json"
    assert main(_plan(inputs, "a100", "--write-json", str(current))) == 0
    capsys.readouterr()
    code, err = run(["replan", "--current", str(current), "--profiles", str(inputs["a100"]),
                     "--services", str(inputs["svc"]), "--fleet", str(fleet)], capsys)
    assert (code, err) == (2, expected)
