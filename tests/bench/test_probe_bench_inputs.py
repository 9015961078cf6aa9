"""``gpuslice bench sharing`` and ``gpuslice profile`` inputs and outputs the third CLI probe
found mishandled: options that divide by zero or never end, and output paths found unwritable
only after the measurements (or a file to resume that is no profile CSV)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.bench import profile as bench_profile
from gpuslice.bench import sharing
from gpuslice.cli import main
from gpuslice.core.errors import ValidationError

BENCH = ["bench", "sharing", "--fake-timer", "resnet50@A100-80GB", "--workload", "tiny",
         "--warmup-s", "0", "--window-s", "0.2"]
PROFILE = ["profile", "tiny", "--fake-timer", "resnet50@A100-80GB", "--caps", "50",
           "--batches", "1", "--procs", "1", "--warmup-s", "0", "--window-s", "0.2",
           "--no-mig"]


@pytest.fixture
def no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusals must come before any measurement: one would fail the test."""

    def ran(*_: object, **__: object) -> object:
        raise AssertionError("the measurements ran")

    monkeypatch.setattr(sharing, "run_sharing", ran)
    monkeypatch.setattr(bench_profile, "run_profile", ran)


@pytest.mark.usefixtures("no_runs")
@pytest.mark.parametrize(("args", "says"), [
    (["--parts", "noisy", "--be-replicas", "0"], "--be-replicas: expected 1 to 47"),
    (["--be-replicas", "48"], "--be-replicas: expected 1 to 47"),
    (["--window-s", "nan"], "--window-s: expected seconds, more than 0 and at most 3600"),
    (["--window-s", "-1"], "--window-s: expected seconds"),
    (["--window-s", "inf"], "--window-s: expected seconds"),
    (["--warmup-s", "nan"], "--warmup-s: expected seconds, 0 or more"),
    (["--parts", "memory", "--mem-cap-mib", "-1"], "--mem-cap-mib: expected a memory cap"),
    (["--noisy-splits", "0/30"], "--noisy-splits: expected LC/BE thread percentages of 1 "
     "to 100, got '0/30'"),
    (["--noisy-splits", "101/1"], "--noisy-splits"),
    (["--be-batch", "0"], "--be-batch: expected a batch size"),
])
def test_bench_options_are_refused_naming_the_flag(
        tmp_path: Path, args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BENCH, *args, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_the_documented_splits_still_pass() -> None:
    sharing.SharingOptions(noisy_splits=((50, 30), (60, 40), (50, 60)), be_replicas=1)


@pytest.mark.usefixtures("no_runs")
def test_bench_out_is_checked_before_the_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "f.yaml"
    file.write_text("x")
    assert main([*BENCH, "--parts", "throughput", "--out", str(file)]) == 2
    assert f"--out: expected a folder that can be created and written, got '{file}: not a " \
           "folder'" in capsys.readouterr().err
    assert main([*BENCH, "--parts", "throughput", "--out", str(file / "sub")]) == 2
    assert "--out: expected a folder" in capsys.readouterr().err
    (tmp_path / "b" / "sharing.png").mkdir(parents=True)
    assert main([*BENCH, "--parts", "throughput", "--out", str(tmp_path / "b")]) == 2
    assert "--out: expected a folder where sharing.png can be written" in \
        capsys.readouterr().err


def test_bench_report_files_are_written_all_or_none(tmp_path: Path) -> None:
    from gpuslice.adapters.outputs import write_files

    def broken_plot(path: Path) -> None:
        raise OSError(28, "No space left on device", str(path))

    with pytest.raises(ValidationError, match=r"--out: .*sharing.*No space left"):
        write_files({tmp_path / "sharing.json": lambda p: p.write_text("{}"),
                     tmp_path / "sharing.png": broken_plot}, "--out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_runs")
@pytest.mark.parametrize(("args", "says"), [
    (["--window-s", "nan"], "--window-s: expected seconds, more than 0"),
    (["--warmup-s", "-1"], "--warmup-s: expected seconds, 0 or more"),
    (["--out", "/proc/nope/x.csv"], "--out: expected a folder that can be created and "
     "written, got '/proc/nope"),
])
def test_profile_options_are_refused_before_measuring(
        args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PROFILE, *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(("content", "says"), [
    (b"\xb3\xff\xfe garbage\n", "not a UTF-8 text file"),
    (b"services:\n- {name: a}\n", "its header has no column 'model'"),
    (b"model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms,latency_p99_ms\n"
     b"resnet50,A100-80GB\n", "row 2"),
    (b"model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms,latency_p99_ms\n"
     b"resnet50,A100-80GB,mps,lots,1,1,70,13,13\n", "row 2"),
])
def test_profile_refuses_to_resume_a_file_that_is_no_profile_csv(
        tmp_path: Path, content: bytes, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.csv"
    out.write_bytes(content)
    assert main([*PROFILE, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out: expected a profile CSV written by gpuslice profile (to resume) or a new " \
           "file" in err and says in err and "Traceback" not in err
    assert out.read_bytes() == content


def test_profile_writes_then_resumes_its_csv(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "p.csv"
    assert main([*PROFILE, "--out", str(out)]) == 0
    assert main([*PROFILE, "--out", str(out)]) == 0
    assert "all were there already" in capsys.readouterr().out
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("model,gpu")
    assert (tmp_path / "new" / "p.png").stat().st_size > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["p.csv", "p.png"]
