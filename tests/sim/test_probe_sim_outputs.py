"""``gpuslice simulate`` inputs and outputs the third CLI probe found mishandled: an --out that
cannot be written found only after every replay ran, unbounded --tune and --seeds, and result
files written one by one."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.cli import main
from gpuslice.core.errors import ValidationError
from gpuslice.sim import runner
from gpuslice.sim.default import default_nodes, default_tasks
from gpuslice.sim.runner import Job, run_job, scenario_of, write_results

SIM = ["simulate", "--variant", "embedded", "--policy", "fgd", "--no-plot", "--workers", "1"]


@pytest.fixture
def no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusals must come before any replay: one would fail the test."""

    def ran(*_: object, **__: object) -> object:
        raise AssertionError("the replays ran")

    monkeypatch.setattr(runner, "run_experiment", ran)


@pytest.mark.usefixtures("no_replay")
def test_an_out_that_cannot_be_a_folder_is_refused_before_the_replays(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "results.txt"
    file.write_text("mine")
    assert main([*SIM, "--seeds", "42", "--out", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"--out: expected a folder that can be created and written, got '{file}: not a " \
           "folder'" in err and "Traceback" not in err
    assert file.read_text() == "mine"
    under = file / "sub"  # a folder under a file cannot be made
    assert main([*SIM, "--seeds", "42", "--out", str(under)]) == 2
    assert "--out: expected a folder that can be created and written" in \
        capsys.readouterr().err
    taken = tmp_path / "out"
    (taken / "summary.json").mkdir(parents=True)
    assert main([*SIM, "--seeds", "42", "--out", str(taken)]) == 2
    assert "--out: expected a folder where summary.json can be written" in \
        capsys.readouterr().err


@pytest.mark.usefixtures("no_replay")
@pytest.mark.parametrize("tune", ["1e9", "inf", "nan", "0", "-1", "10.5"])
def test_tune_is_a_finite_ratio_up_to_ten(
        tmp_path: Path, tune: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIM, "--seeds", "42", "--tune", tune, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--tune: expected a multiple of GPU capacity more than 0 and at most 10, got " \
        f"{float(tune)!r}" in err and "Traceback" not in err


@pytest.mark.usefixtures("no_replay")
@pytest.mark.parametrize("seeds", ["0-1000", "1-600,1000-1600"])
def test_at_most_a_thousand_seeds(
        tmp_path: Path, seeds: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIM, "--seeds", seeds, "--out", str(tmp_path)]) == 2
    assert f"--seeds: expected at most 1000 seeds, like 42-51, got '{seeds}'" in \
        capsys.readouterr().err


def test_seeds_are_counted_before_the_list_is_made() -> None:
    """``1-999999999`` is refused at once, not after a list of a billion seeds filled the
    memory."""
    from gpuslice.cli.simulate import seeds_of

    with pytest.raises(ValidationError, match="at most 1000 seeds"):
        seeds_of("1-999999999")
    assert seeds_of("42-44,7") == [42, 43, 44, 7]
    with pytest.raises(ValidationError, match="--seeds: expected seeds like"):
        seeds_of("9-1")


def test_result_files_are_written_all_or_none(tmp_path: Path) -> None:
    scenario = scenario_of("t", default_nodes(), default_tasks())
    results = [run_job(scenario, Job("bestfit", 42, 0.5))]

    def broken_plot(path: Path) -> None:
        path.write_bytes(b"half a png")
        raise OSError(28, "No space left on device", str(path))

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValidationError, match=r"--out: .*unallocated.*No space left"):
        write_results(out, "t", results, {"unallocated.png": broken_plot})
    assert list(out.iterdir()) == []
    written = write_results(out, "t", results, {"unallocated.png": lambda p: p.write_bytes(b"x")})
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written) == [
        "allocation.csv", "frag.csv", "frag_ratio.csv", "summary.json", "unallocated.png"]
