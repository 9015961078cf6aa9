"""``gpuslice plan`` / ``replan`` inputs and outputs the third CLI probe found mishandled: a
negative seed, numbers that overflow or are not numbers, service names that cannot name
Kubernetes objects, broken profile and SLO CSVs, and output files left half-written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuslice.adapters.profiles.files import read_own_profiles, read_scenario
from gpuslice.adapters.traces.alibaba import InputError
from gpuslice.cli import main
from gpuslice.core.errors import ValidationError
from gpuslice.planning.run import read_services

HEADER = "model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms,latency_p99_ms\n"
PLAN = ["plan", "--profiles", "builtin:a100-80gb", "--no-check", "--solver", "greedy"]


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("command", [["plan", "--example"], ["replan", "--example"]])
def test_a_negative_seed_is_refused_at_parse_time(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--seed", "-1"])
    assert exc.value.code == 2
    assert "--seed: expected a whole number >= 0, got '-1'" in _error(capsys)


def _svc(tmp_path: Path, item: str) -> Path:
    path = tmp_path / "services.yaml"
    path.write_text(f"services:\n- {item}\n")
    return path


@pytest.mark.parametrize(("item", "field", "says"), [
    (f"{{name: a, model: resnet50, rate: {'9' * 400}, slo_ms: 150}}", "'rate'",
     "expected a finite number, got 99999999999999999999... (400 characters)"),
    (f"{{name: a, model: resnet50, rate: 5, slo_ms: {'9' * 400}}}", "'slo_ms'",
     "expected a finite number"),
    ("{name: a, model: resnet50, rate: true, slo_ms: 150}", "'rate'",
     "expected a number, got True"),
    ("{name: a, model: resnet50, rate: 5, slo_ms: false}", "'slo_ms'",
     "expected a number, got False"),
    ("{name: a, model: [resnet50], rate: 5, slo_ms: 150}", "'model'", "a model name"),
])
def test_a_number_that_is_not_one_is_refused_naming_the_field(
        tmp_path: Path, item: str, field: str, says: str) -> None:
    with pytest.raises(InputError) as exc:
        read_services(_svc(tmp_path, item))
    assert f"row 1, field {field}" in str(exc.value) and says in str(exc.value)


@pytest.mark.parametrize("name", ['"A B/../x"', '""', "[a]", "Classify", "a_b", "-a", "a-",
                                  "7", "x" * 41])
def test_a_service_name_must_be_a_dns_label_that_fits_its_deployments(
        tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    svc = _svc(tmp_path, f"{{name: {name}, model: resnet50, rate: 5, slo_ms: 150}}")
    assert main([*PLAN, "--services", str(svc), "--out", str(tmp_path / "out")]) == 2
    assert "field 'name': expected a DNS-1123 label of at most 40 characters" in \
        _error(capsys)
    assert not (tmp_path / "out" / "manifests.yaml").exists()


def test_good_names_pass_and_name_the_deployments(tmp_path: Path) -> None:
    longest = "a" + "-b" * 19 + "c"  # 40 characters
    svc = tmp_path / "s.yaml"
    svc.write_text(f"- {{name: {longest}, model: resnet50, rate: 5, slo_ms: 150}}\n"
                   "- {model: vgg19, rate: 5, slo_ms: 300}\n")  # no name: the model's
    assert [s.name for s in read_services(svc)] == [longest, "vgg19"]
    assert main([*PLAN, "--services", str(svc), "--out", str(tmp_path / "out")]) == 0
    names = [line.split()[-1] for line in
             (tmp_path / "out" / "manifests.yaml").read_text().splitlines()
             if line.startswith("  name: ")]
    assert names and all(len(n) <= 63 for n in names)


def _prof(tmp_path: Path, row: str) -> Path:
    path = tmp_path / "p.csv"
    path.write_text(HEADER + row + "\n")
    return path


@pytest.mark.parametrize(("row", "says"), [
    ("resnet50,A100-80GB", "row 2: has 2 values for the 9 columns"),
    ("resnet50,A100-80GB,mig,3,8,1,nan,20,", "field 'throughput_rps': expected a finite"),
    ("resnet50,A100-80GB,mig,3,8,1,inf,20,", "field 'throughput_rps': expected a finite"),
    ("resnet50,A100-80GB,mig,3,8,1,500,nan,", "field 'latency_ms': expected a finite"),
    ("resnet50,A100-80GB,mig,3,8,1,500,20,-inf", "field 'latency_p99_ms': expected a finite"),
    ("resnet50,A100-80GB,mps,101,8,1,500,20,", "field 'slice_size': expected an MPS thread % "
     "of 1 to 100"),
    ("resnet50,A100-80GB,mps,0,8,1,500,20,", "field 'slice_size'"),
    ("resnet50,A100-80GB,mig,99,8,1,500,20,", "field 'slice_size': expected MIG compute"),
    (",A100-80GB,mig,3,8,1,500,20,", "field 'model': expected a model name"),
    ("resnet50,A100-80GB,mig,3,8,1,500,20,,7", "has 10 values for the 9 columns"),
])
def test_a_bad_profile_row_is_refused_naming_the_file_and_row(
        tmp_path: Path, row: str, says: str) -> None:
    path = _prof(tmp_path, row)
    with pytest.raises(InputError) as exc:
        read_own_profiles(path)
    assert str(exc.value).startswith(f"{path}, row 2") and says in str(exc.value)


def test_a_short_row_and_a_binary_profile_file_are_one_line_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svc = _svc(tmp_path, "{name: a, model: resnet50, rate: 5, slo_ms: 150}")
    short = _prof(tmp_path, "resnet50,A100-80GB")
    assert main(["plan", "--services", str(svc), "--no-check", "--profiles", str(short)]) == 2
    assert "row 2: has 2 values" in _error(capsys)
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xb3\xff\xfe garbage\n")
    assert main(["plan", "--services", str(svc), "--no-check", "--profiles", str(binary)]) == 2
    assert "bin.csv: not a UTF-8 text CSV file" in _error(capsys)
    # a trailing comma past the header's columns is no error
    read_own_profiles(_prof(tmp_path, "resnet50,A100-80GB,mig,3,8,1,500,20,22,"))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_an_slo_rate_that_is_not_finite_is_refused_at_read_time(
        tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    rate, lat = tmp_path / "rate.csv", tmp_path / "lat.csv"
    rate.write_text(f"resnet50\n{value}\n")
    lat.write_text("resnet50\n150\n")
    with pytest.raises(InputError, match=r"rate.csv, row 2, field 'resnet50': expected a "
                       "finite number or N/A"):
        read_scenario(rate, lat, 1)
    assert main([*PLAN, "--scenario", "1", "--slo-rate", str(rate), "--slo-latency",
                 str(lat)]) == 2
    assert "expected a finite number or N/A" in _error(capsys)
    rate.write_bytes(b"\xb3\xff\n")
    assert main([*PLAN, "--scenario", "1", "--slo-rate", str(rate), "--slo-latency",
                 str(lat)]) == 2
    assert "not a UTF-8 text CSV file" in _error(capsys)


@pytest.mark.parametrize("command", [["plan", "--example", "--no-check"],
                                     ["replan", "--example"]])
def test_an_export_that_cannot_be_written_writes_nothing(
        tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exp"
    (out / "manifests.yaml").mkdir(parents=True)
    assert main([*command, "--out", str(out)]) == 2
    err = _error(capsys)
    assert "--out: expected a folder where manifests.yaml can be written" in err
    assert sorted(p.name for p in out.iterdir()) == ["manifests.yaml"]


def test_export_files_are_all_written_or_none(tmp_path: Path) -> None:
    """The second file cannot be written (its folder is a file): the first is not renamed into
    place and no temporary is left."""
    from gpuslice.planning.export import write_texts

    (tmp_path / "blocker").write_text("x")
    with pytest.raises(ValidationError, match=r"--export: expected a file that can be "
                       r"written, got '.*blocker"):
        write_texts({tmp_path / "a.json": "{}", tmp_path / "blocker" / "b.yaml": "b"},
                    "--export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]


@pytest.mark.parametrize("command", [["plan", "--example", "--no-check"],
                                     ["replan", "--example"]])
def test_write_json_is_written_atomically(
        tmp_path: Path, command: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.json"
    target.write_text('{"old": true}')
    real_replace = os.replace

    def failing_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(os, "replace", failing_replace)
    assert main([*command, "--write-json", str(target)]) == 2
    assert "--write-json: expected a file that can be written" in _error(capsys)
    assert json.loads(target.read_text()) == {"old": True}  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    monkeypatch.setattr(os, "replace", real_replace)
    assert main([*command, "--write-json", str(target)]) in (0, 1)
    assert "gpu_list" in json.loads(target.read_text())


def test_write_json_to_a_device_that_fails_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    assert main(["plan", "--example", "--no-check", "--write-json", "/dev/full"]) == 2
    err = _error(capsys)  # no space on /dev/full, or (not root) no file can be made in /dev
    assert err.startswith("gpuslice: error: --write-json: expected") and "/dev" in err
    assert Path("/dev/full").is_char_device()


@pytest.fixture
def no_solving(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's solvers fail the test if they start (a refused rate is refused first)."""
    import gpuslice.core.planner

    def started(*a: object, **k: object) -> None:
        raise AssertionError("the solver started before the rate was refused")

    monkeypatch.setattr(gpuslice.core.planner, "_build", started)
    monkeypatch.setattr(gpuslice.core.planner, "_greedy", started)


@pytest.mark.parametrize("rate", ["1e9", "1e300"])
@pytest.mark.parametrize("command", ["plan", "replan"])
def test_a_rate_that_needs_more_gpus_than_a_plan_may_take_is_refused_before_solving(
        tmp_path: Path, rate: str, command: str, no_solving: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    svc = _svc(tmp_path, f"{{name: classify, model: resnet50, rate: {rate}, slo_ms: 150}}")
    argv = ([*PLAN, "--services", str(svc)] if command == "plan" else
            ["replan", "--example", "--services", str(svc)])
    assert main(argv) == 2
    err = _error(capsys)
    assert err.count("\n") == 1 and err.startswith(
        "gpuslice: error: service 'classify': rate: expected a request rate a plan of at most "
        "10000 GPUs can serve (resnet50 within its SLO: at most "), err
    assert f"got {float(rate)!r}" in err


def test_the_gpu_bound_is_the_sum_of_each_services_least_gpus() -> None:
    from gpuslice.cli.common import builtin_path
    from gpuslice.core.planner import (
        MAX_PLAN_GPUS,
        PlanTooLarge,
        Service,
        best_configs,
        check_plan_size,
    )
    from gpuslice.planning.run import load_profiles

    profiles = load_profiles(builtin_path("profiles", "a100-80gb"))
    per_gpu = {}
    for model in ("resnet50", "vgg19"):
        by_size = best_configs(profiles, Service(model, model, 1.0, 300), "A100-80GB", 0.45)
        per_gpu[model] = max(c.throughput / c.size for c in by_size.values()) * 7

    def services(resnet50: float, vgg19: float) -> list[Service]:
        share = {"resnet50": resnet50, "vgg19": vgg19}
        return [Service(m, m, share[m] * MAX_PLAN_GPUS * per_gpu[m], 300) for m in per_gpu]

    check_plan_size(profiles, services(0.7, 0.299), [], 0.45)  # just within: no error
    # just past: the service that needs the most is named, with its rate
    over = services(0.7, 0.301)
    with pytest.raises(PlanTooLarge, match=r"service 'resnet50': rate: .*so at least 7000 "
                       r"GPUs; 10010 for all 2 services\)") as exc:
        check_plan_size(profiles, over, [], 0.45)
    assert exc.value.got == over[0].rate
    # the planner's headroom counts: within the bound at the rate, not at rate / 0.95
    with pytest.raises(ValidationError, match=r"for 1.05 x the rate"):
        check_plan_size(profiles, services(0.7, 0.28), [], 0.45, 1 / 0.95)


@pytest.mark.parametrize("argv", [
    ["plan", "--example", "--latency-factor", "nan"],
    ["plan", "--example", "--latency-factor", "inf"],
    ["plan", "--example", "--latency-factor", "0"],
    ["plan", "--example", "--latency-factor", "1.5"],
    ["replan", "--example", "--drain-s", "nan"],
    ["replan", "--example", "--drain-s", "inf"],
    ["replan", "--example", "--drain-s", "-1"],
], ids=" ".join)
def test_latency_factor_and_drain_s_must_be_finite_and_in_range(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    option, value = argv[-2:]
    expected = {"--latency-factor": "a fraction, more than 0 and at most 1",
                "--drain-s": "a number >= 0"}[option]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"argument {option}: expected {expected}, got {value!r}" in _error(capsys)


def test_a_profile_naming_an_unknown_gpu_names_the_file_row_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svc = _svc(tmp_path, "{name: a, model: resnet50, rate: 5, slo_ms: 150}")
    prof = _prof(tmp_path, "resnet50,Z9000,mig,3,8,1,500,20,")
    assert main(["plan", "--services", str(svc), "--no-check", "--profiles", str(prof)]) == 2
    err = _error(capsys)
    assert err.startswith(f"gpuslice: error: {prof}, row 2, field 'gpu': expected a GPU model "
                          "of the catalogue (") and err.rstrip().endswith("got 'Z9000'"), err
    # the reader itself still takes any GPU (gpuslice profile writes the one it measured on)
    assert read_own_profiles(prof).gpus() == ["Z9000"]
