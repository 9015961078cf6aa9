"""Errors, not tracebacks (issue 30): each bad input, given to the real CLI entry point, is
one line on stderr naming the input and what was expected, with exit code 2, and is found
before the work that would have been wasted on it."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.cli import main

ROOT = Path(__file__).resolve().parents[2]
FAKE_CLUSTER = str(ROOT / "examples" / "fake-cluster.yaml")
PROFILE = ("model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms\n"
           "m,A100-80GB,mig,1,4,1,200,20\nm,A100-80GB,mig,2,4,1,420,10\n"
           "m,A100-80GB,mig,7,4,1,1400,3\n")
BAD_YAML = "- gpu: A100-80GB\n  count: [1\n  cost_per_hour: 2\n"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``gpuslice ARGV``: the exit code and the error line (argparse's errors exit by
    SystemExit after a usage text; the error is its last line)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith("gpuslice ") and ": error: " in lines[-1], lines
        return code, lines[-1]
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("gpuslice: error: "), err
    return code, err.strip()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {"prof": tmp_path / "p.csv", "svc": tmp_path / "s.yaml", "bad": tmp_path / "bad.yaml",
           "empty": tmp_path / "empty.txt", "file": tmp_path / "a-file"}
    out["prof"].write_text(PROFILE)
    out["svc"].write_text("- {name: a, model: m, rate: 300, slo_ms: 100}\n")
    out["bad"].write_text(BAD_YAML)
    out["empty"].write_text("")
    out["file"].write_text("in the way of a folder\n")
    return out


@pytest.fixture
def current(files: dict[str, Path], tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    assert main(["plan", "--profiles", str(files["prof"]), "--services", str(files["svc"]),
                 "--write-json", str(path)]) == 0
    return path


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning, re-planning and the demo's scenario fail the test if they start."""
    import gpuslice.core.replay
    import gpuslice.core.resize  # binds the real replan before it is patched
    import gpuslice.demo.scenario
    import gpuslice.planning.run

    def started(*a: object, **k: object) -> None:
        raise AssertionError("the work started before the bad input was refused")

    monkeypatch.setattr(gpuslice.planning.run, "run_plan", started)
    monkeypatch.setattr(gpuslice.core.replay, "replan", started)
    monkeypatch.setattr(gpuslice.demo.scenario, "run_demo", started)


@pytest.fixture
def keep_sigterm() -> Iterator[None]:
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


@pytest.mark.parametrize("option", ["--fleet", "--services"])
def test_plan_malformed_yaml_names_the_file_and_line(
        files: dict[str, Path], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profiles", str(files["prof"]), "--services", str(files["svc"])]
    argv += [option, str(files["bad"])]
    code, err = run(argv, capsys)
    assert code == 2
    assert str(files["bad"]) in err and "expected valid YAML" in err and "line 3" in err
    assert "\\n" not in err


def test_plan_unwritable_export_is_refused_before_planning(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str], no_work: None) -> None:
    base = ["plan", "--profiles", str(files["prof"]), "--services", str(files["svc"])]
    code, err = run([*base, "--out", str(files["file"] / "x")], capsys)
    assert code == 2 and "--out: expected a folder that can be created and written" in err
    assert str(files["file"] / "x") in err
    code, err = run([*base, "--write-json", str(files["file"] / "plan.json")], capsys)
    assert code == 2 and "--write-json: expected a file that can be written" in err


def test_reconfig_plan_empty_or_malformed_schedule(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["reconfig", "plan", str(files["empty"]), "--fake-cluster", FAKE_CLUSTER],
                    capsys)
    assert code == 2 and str(files["empty"]) in err and "expected a SliceSchedule" in err
    assert "empty document" in err
    code, err = run(["reconfig", "plan", str(files["bad"]), "--fake-cluster", FAKE_CLUSTER],
                    capsys)
    assert code == 2 and "expected valid YAML" in err and "line 3" in err and "\\n" not in err


def test_replan_rates_from_nothing_listening(
        files: dict[str, Path], current: Path, capsys: pytest.CaptureFixture[str],
        no_work: None) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    base = ["replan", "--current", str(current), "--profiles", str(files["prof"]),
            "--services", str(files["svc"]), "--window", "0.1"]
    code, err = run([*base, "--rates-from", url], capsys)
    assert code == 2 and "--rates-from: expected a router admin URL that answers" in err
    assert url in err
    code, err = run([*base, "--rates-from", "localhost"], capsys)
    assert code == 2 and "--rates-from: expected the router's admin URL" in err


def test_demo_negative_seed_and_unwritable_out(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str], no_work: None,
        keep_sigterm: None) -> None:
    code, err = run(["demo", "--seed", "-1"], capsys)
    assert code == 2 and "argument --seed: expected a whole number >= 0, got '-1'" in err
    out = files["file"] / "report"
    code, err = run(["demo", "--out", str(out)], capsys)
    assert code == 2 and "--out: expected a folder that can be created and written" in err
    assert str(out) in err


@pytest.mark.parametrize(("option", "value"), [("--out", "report"), ("--seed", "7")])
def test_demo_dra_refuses_the_scenario_demos_out_and_seed(
        option: str, value: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, keep_sigterm: None) -> None:
    import gpuslice.demo.dra

    def started(*a: object, **k: object) -> None:
        raise AssertionError("the DRA demo started with an option it ignores")

    monkeypatch.setattr(gpuslice.demo.dra, "run_dra_demo", started)
    code, err = run(["demo", "--dra", option, value], capsys)
    assert code == 2 and err.startswith(f"gpuslice: error: {option}: expected no --out or "
                                        "--seed with --dra") and f"got '{value}'" in err


@pytest.mark.parametrize(("argv", "option", "value"), [
    (["plan", "--profiles", "p.csv", "--services", "s.yaml", "--time-limit", "-3"],
     "--time-limit", "-3"),
    (["replan", "--current", "c.json", "--profiles", "p.csv", "--services", "s.yaml",
      "--window", "-5"], "--window", "-5"),
    (["status", "--window", "0"], "--window", "0"),
    (["down", "--timeout", "-3"], "--timeout", "-3"),
    (["down", "--timeout", "nan"], "--timeout", "nan"),
], ids=["plan-time-limit", "replan-window", "status-window", "down-timeout", "down-nan"])
def test_non_positive_numbers_refused_at_parse_time(
        argv: list[str], option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(argv, capsys)
    assert code == 2
    assert err.endswith(f"error: argument {option}: expected a positive number, got '{value}'")


def test_profile_unknown_workload_lists_the_known_ones(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuslice.bench.profile

    def gpu(*a: object) -> None:
        raise AssertionError("looked for a GPU before checking the workload")

    monkeypatch.setattr(gpuslice.bench.profile, "_gpu", gpu)
    code, err = run(["profile", "nope"], capsys)
    assert code == 2 and "workload: expected one of resnet50" in err and "tiny" in err
    assert err.endswith("got 'nope'")


def test_extender_resync_and_simulate_compare_fail_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """extender --resync must be a positive number (parse time); simulate --compare with no
    data folder fails before replaying anything."""
    key = tmp_path / "key"
    key.write_text("k" * 32)
    code, err = run(["extender", "--key-file", str(key), "--resync", "-1"], capsys)
    assert code == 2 and "--resync" in err
    from gpuslice.sim import runner

    def no_replay(*_: object, **__: object) -> None:
        raise AssertionError("replayed before reading the published results")

    monkeypatch.setattr(runner, "run_experiment", no_replay)
    monkeypatch.setenv("GPUSLICE_DATA", str(tmp_path / "nowhere"))
    code, err = run(["simulate", "--compare", "--seeds", "42", "--out", str(tmp_path / "o"),
                     "--no-plot"], capsys)
    assert code == 2 and "nowhere" in err


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("--namespace", "ML_Team", "--namespace: expected a namespace name"),
    ("--port", "70000", "--port: expected a port 1..65535"),
    ("--image", " ", "--image: expected an image reference"),
])
def test_plan_export_options_are_refused_before_planning(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str], no_work: None,
        option: str, value: str, expected: str, tmp_path: Path) -> None:
    """``plan --out``'s manifests (issue 51): their namespace, port and image."""
    code, err = run(["plan", "--profiles", str(files["prof"]), "--services", str(files["svc"]),
                     "--out", str(tmp_path / "x"), option, value], capsys)
    assert code == 2 and expected in err, err

