"""The install commands gpuslice prints (issue 18, first contact): gpuslice is not on a package
index, so a copy installed from a checkout names the checkout, never ``pip install
'gpuslice[...]'``, which could not work."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gpuslice.adapters.install import checkout, pip_install
from gpuslice.demo.runtime import EventLog
from gpuslice.demo.scenario import local_nvml

ROOT = Path(__file__).resolve().parents[2]


def _check_command(cmd: str, extra: str) -> None:
    """The command installs ``extra`` of this very checkout."""
    words = shlex.split(cmd)
    assert words[:2] == ["pip", "install"], cmd
    target = words[-1]
    folder, _, rest = target.partition("[")
    assert rest == f"{extra}]", cmd
    meta = tomllib.loads((Path(folder) / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "gpuslice"
    assert extra in meta["project"]["optional-dependencies"]
    assert Path(folder).resolve() == ROOT


def test_the_command_names_the_checkout() -> None:
    found = checkout()
    assert found is not None and found[0].resolve() == ROOT  # the test venv: pip install -e
    for extra in ("gpu", "kube"):
        cmd = pip_install(extra)
        assert "'gpuslice[" not in cmd
        _check_command(cmd, extra)


def test_the_demo_says_how_to_install_nvml_from_this_checkout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    log = EventLog()
    assert local_nvml(log) is None
    (event,) = log.events
    assert "nvidia-ml-py is not installed: pip install" in event.text
    cmd = event.text.split("is not installed: ")[1].split(")")[0]
    _check_command(cmd, "gpu")


def test_the_cli_says_it_too(tmp_path: Path) -> None:
    # a pynvml that is not there, for a child process
    (tmp_path / "pynvml.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    r = subprocess.run([sys.executable, "-m", "gpuslice.cli", "gpus", "--local"],
                       capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode == 1  # no GPU to list: a failure, not a usage error
    line = r.stderr.strip()  # one error line, as every command's "no GPU" (--fake-gpus named)
    assert line.startswith("gpuslice: error: no GPU: nvidia-ml-py is not installed: "
                           "pip install"), line
    assert "--fake-gpus" in line
    _check_command(line.split("is not installed: ")[1].split(";")[0], "gpu")
