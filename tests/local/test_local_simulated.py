"""Local mode on a laptop (issue 18, first contact): ``gpuslice up --fake-gpus N`` runs the
example services on N simulated GPUs, labelled as simulated in ``status`` and in the log, and
serves through the router; everything through the CLI as processes."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.cli import main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuslice.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, check=False)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"
    cli("down", "--state-dir", str(tmp_path / "state"))


def test_up_on_simulated_gpus_serves_and_says_so(state: Path) -> None:
    r = cli("up", "examples/local/tiny.yaml", "--fake-gpus", "2", "--port", "0",
            "--state-dir", str(state), "--detach", "--log-format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SIMULATED" in r.stdout
    st = json.loads((state / "state.json").read_text())
    assert st["simulated"] == 2 and st["mps"] == []  # no MPS daemon for a simulated GPU
    assert {x["gpu_uuid"] for x in st["replicas"]} <= {"GPU-simulated-00", "GPU-simulated-01"}
    for svc in ("classifier", "encoder"):
        req = urllib.request.Request(f"{st['router']['url']}/v2/models/{svc}/infer",
                                     data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
    table = cli("status", "--state-dir", str(state), "--window", "0.2")
    assert table.returncode == 0 and "SIMULATED GPUs (2)" in table.stdout
    assert "the GPUs are SIMULATED (--fake-gpus 2)" in table.stdout
    doc = json.loads(cli("status", "--state-dir", str(state), "-o", "json",
                         "--window", "0.2").stdout)
    assert doc["simulated"] == 2
    # the log (--log-format json): one object per line, the simulated GPUs named first
    lines = [json.loads(x) for x in (state / "up.log").read_text().splitlines()
             if x.startswith("{")]
    assert lines and all(x["component"] == "local" for x in lines)
    assert "SIMULATED GPU(s)" in lines[0]["msg"] and lines[0]["simulated_gpus"] == 2


@pytest.mark.parametrize(("value", "expect"), [
    ("0", "1 to 64 simulated GPUs"), ("65", "1 to 64"), ("nosuch.yaml", "a number of simulated"),
])
def test_bad_fake_gpus_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  value: str, expect: str) -> None:
    assert main(["up", "examples/local/tiny.yaml", "--fake-gpus", value,
                 "--state-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "--fake-gpus" in err and expect in err
    assert not (tmp_path / "s").exists()


def test_select_and_gpus_on_simulated_gpus(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    assert main(["select", "--fake-gpus", "3", "--memory", "8G", "--state-dir",
                 str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().startswith("GPU-simulated-")
    assert main(["gpus", "--local", "--fake-gpus", "1"]) == 0
    assert "simulated A100-80GB" in capsys.readouterr().out
