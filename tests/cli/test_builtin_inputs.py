"""Inputs that ship (issue 30): ``builtin:NAME`` for the planner's file options, ``--example``
for plan and replan, ``--variant embedded`` for simulate; unknown names are one line naming the
option and the names there are, exit code 2."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from gpuslice.adapters.profiles import builtin
from gpuslice.cli import main
from tests.cli.test_bad_input import run


@pytest.fixture(autouse=True)
def no_shared_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As after a pip install: no data folder, the working directory somewhere else."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    monkeypatch.setenv("GPUSLICE_DATA", str(empty))
    monkeypatch.chdir(tmp_path)


def test_the_shipped_names() -> None:
    assert builtin.names("profiles") == ["a100-80gb"]
    assert builtin.names("services") == ["example", "example-busier", "generative"]
    assert builtin.names("gen-profiles") == ["llm-a100-80gb"]
    assert builtin.names("fleet") == ["example"]
    assert builtin.names("plan") == ["example"]
    folder = builtin.resolve("profiles", "builtin:a100-80gb", "--profiles")
    assert len(list((folder / "prof_data").glob("*.csv"))) == 11
    assert (folder / "SLO" / "SLO_req_rate.csv").is_file()
    readme = (folder.parents[1] / "README.md").read_text()
    assert "MunQ-Lee/ParvaGPU_SC24" in readme and "MIT" in readme
    assert "Copyright (c) 2024 sslab6943" in (folder.parents[1] / "LICENSE-ParvaGPU").read_text()


@pytest.mark.parametrize(("argv", "option", "known"), [
    (["plan", "--profiles", "builtin:a100"], "--profiles", "builtin:a100-80gb"),
    (["plan", "--example", "--services", "builtin:nope"], "--services",
     "builtin:example, builtin:example-busier, builtin:generative"),
    (["plan", "--example", "--fleet", "builtin:"], "--fleet", "builtin:example"),
    (["replan", "--example", "--current", "builtin:plan"], "--current", "builtin:example"),
], ids=["plan-profiles", "plan-services", "plan-fleet", "replan-current"])
def test_unknown_builtin_names_list_the_known_ones(
        argv: list[str], option: str, known: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(argv, capsys)
    assert code == 2
    assert f"error: argument {option}: expected a path or one of {known} (shipped with " \
           f"gpuslice), got '{argv[-1]}'" in err


def test_help_lists_the_builtin_names(capsys: pytest.CaptureFixture[str]) -> None:
    helps = {}
    for name in ("plan", "replan", "simulate"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        helps[name] = " ".join(capsys.readouterr().out.split())
    for name in ("plan", "replan"):
        assert "builtin:a100-80gb" in helps[name] and "builtin:example-busier" in helps[name]
        assert "--example" in helps[name]
    assert "embedded (the generated scenario shipped with gpuslice" in helps["simulate"]


def test_missing_inputs_name_the_option_and_the_example(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["plan", "--scenario", "1"], capsys)
    assert code == 2 and "--profiles is missing: expected a profile folder or CSV, " \
        "builtin:a100-80gb" in err and "or --example" in err
    code, err = run(["replan", "--profiles", "builtin:a100-80gb"], capsys)
    assert code == 2 and "--current is missing: expected the plan in force" in err


def test_simulate_unknown_variant_without_data_names_embedded(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 54: without the trace, the error names its public source, the exact files, the
    terms, and a command that fetches them."""
    code, err = run(["simulate", "--variant", "default", "--no-plot"], capsys)
    assert code == 2
    assert err.startswith("gpuslice: error: --variant default: the Alibaba GPU-sharing trace")
    assert "https://github.com/alibaba/clusterdata/tree/HEAD/cluster-trace-gpu-v2023" in err
    assert "csv/openb_node_list_gpu_node.csv and csv/openb_pod_list_default.csv" in err
    assert "research and study use" in err and "curl -fsSLo" in err
    assert "export GPUSLICE_DATA=" in err and "--variant embedded" in err


def test_the_help_examples_compare_says_where_its_files_come_from(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["simulate", "--variant", "embedded", "--seeds", "42", "--policy", "fgd",
                     "--compare", "--no-plot"], capsys)
    assert code == 2
    assert "kubernetes-scheduler-simulator" in err and "analysis_allo_discrete.csv" in err
    assert "Apache-2.0" in err and "curl -fsSLo" in err


def test_simulate_variant_embedded_runs(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--variant", "embedded", "--policy", "ours", "--seeds", "42",
                 "--no-plot", "--out", str(tmp_path / "sim"), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scenario"] == "embedded-default" and doc["seeds"] == [42]


def test_plan_example_options_beside_it_win(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("- {name: mine, model: resnet50, rate: 100, slo_ms: 200}\n")
    assert main(["plan", "--example", "--services", str(mine), "--no-check",
                 "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in doc["services"]] == ["mine"]
    assert main(["plan", "--example", "--no-check", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {s["name"] for s in doc["services"]} == {
        "classify", "thumbnails", "search-embed", "detect", "style"}


def test_replan_example_starts_from_the_shipped_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replan", "--example", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpus_before"] == 1 and doc["rates"]["classify"] == 1000
    assert all(r["ok"] for r in doc["replay"])


def test_a_zipped_package_gets_a_copy_on_disk(tmp_path: Path) -> None:
    archive = tmp_path / "pkg.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data/profiles/x/prof_data/m.csv", "a,b\n1,2\n")
    entry = zipfile.Path(archive, "data/profiles/x/")
    path = builtin._as_path(entry)
    assert isinstance(path, Path) and path.name == "x"
    assert (path / "prof_data" / "m.csv").read_text() == "a,b\n1,2\n"
