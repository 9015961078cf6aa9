"""``gpuslice demo --dra`` and the scenario demo's other flags: ``--short`` has nothing to
shorten there and is refused (one line naming it, exit 2, like ``--out`` and ``--seed``);
``--no-live`` holds as it is (the DRA demo prints its steps line by line); ``--no-local-gpus``
keeps this machine's MPS out (the stand-in even where ``nvidia-cuda-mps-control`` is on
PATH)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.adapters.mps.fake import write_fake_control
from gpuslice.cli import main
from tests.cli.test_bad_input import run


@pytest.fixture
def keep_sigterm() -> Iterator[None]:
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """run_dra_demo stood in for: the ``mps_binary`` of each call."""
    from gpuslice.demo import dra

    seen: list[object] = []

    def fake(say: object, mps_binary: str | None = None) -> dra.DraDemoResult:
        seen.append(mps_binary)
        return dra.DraDemoResult(mps="stand-in")

    monkeypatch.setattr(dra, "run_dra_demo", fake)
    return seen


def test_short_with_dra_is_refused_naming_it(
        calls: list[object], capsys: pytest.CaptureFixture[str], keep_sigterm: None) -> None:
    code, err = run(["demo", "--dra", "--short"], capsys)
    assert code == 2 and not calls
    assert err == ("gpuslice: error: --short: expected no --short with --dra: it shortens the "
                   "scenario demo (without --dra); the DRA demo has no scenario and runs in "
                   "about a second, got '--short'")


@pytest.mark.parametrize(("flags", "mps_binary"), [
    ([], None), (["--no-live"], None), (["--no-local-gpus"], ""),
    (["--no-live", "--no-local-gpus"], "")])
def test_no_live_and_no_local_gpus_are_honoured(
        flags: list[str], mps_binary: str | None, calls: list[object],
        capsys: pytest.CaptureFixture[str], keep_sigterm: None) -> None:
    assert main(["demo", "--dra", *flags]) == 0
    assert calls == [mps_binary]
    capsys.readouterr()


def test_no_local_gpus_uses_the_mps_stand_in_even_with_one_on_path(tmp_path: Path) -> None:
    """End to end: an ``nvidia-cuda-mps-control`` on PATH (the stand-in, so that either way
    works) is used without the flag, and left alone with it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    on_path = write_fake_control(bin_dir / "nvidia-cuda-mps-control")
    env = {**os.environ, "COLUMNS": "400",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = {}
    for flag in ("", "--no-local-gpus"):
        p = subprocess.run([sys.executable, "-m", "gpuslice.cli", "demo", "--dra",
                            *([flag] if flag else [])], capture_output=True, text=True,
                           timeout=120, check=False, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        out[flag] = p.stdout
    assert f"MPS control: {on_path} (real)" in out[""] and "MPS: real" in out[""]
    assert "(stand-in: this machine's unused)" in out["--no-local-gpus"]
    assert str(on_path) not in out["--no-local-gpus"]
    assert "MPS: stand-in" in out["--no-local-gpus"]
