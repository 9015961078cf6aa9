"""``gpuslice down`` / ``status`` and a state file they cannot trust: a pid the kernel has since
given to another process is left alone (the state records when its process started), and a
damaged state file is a one-line error naming the field, with no signal sent to anyone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from gpuslice.cli import main
from gpuslice.services.local import LocalRuntime
from gpuslice.services.local_config import LocalConfig
from gpuslice.services.local_state import process_start, up_running


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process that has nothing to do with gpuslice."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


def _write(state: Path, doc: object) -> None:
    state.mkdir(parents=True, exist_ok=True)
    (state / "state.json").write_text(json.dumps(doc))


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("gpuslice: error: "), err
    return err


@pytest.mark.parametrize("recorded", ["none", "other"])
def test_down_leaves_a_reused_pid_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        bystander: subprocess.Popen[bytes],
                                        recorded: str) -> None:
    start = process_start(bystander.pid)
    assert start is not None
    doc: dict[str, Any] = {"run_id": "deadbeef0000", "pid": bystander.pid,
                           "status": "running", "replicas": []}
    if recorded == "other":  # the state's process started at another time: not this one
        doc["pid_start"] = start + 1
    _write(tmp_path / "st", doc)
    assert main(["status", "--state-dir", str(tmp_path / "st")]) == 3
    assert "not running" in capsys.readouterr().out
    assert main(["down", "--state-dir", str(tmp_path / "st"), "--timeout", "1"]) == 0
    out = capsys.readouterr().out
    assert "left alone" in out and "stopped" not in out, out
    assert bystander.poll() is None  # still running
    assert not (tmp_path / "st" / "state.json").exists()  # the stale state is gone


def test_down_stops_the_process_the_state_names(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                bystander: subprocess.Popen[bytes]) -> None:
    _write(tmp_path / "st", {"run_id": "deadbeef0000", "pid": bystander.pid,
                             "pid_start": process_start(bystander.pid), "replicas": []})
    assert main(["down", "--state-dir", str(tmp_path / "st"), "--timeout", "5"]) == 0
    assert f"stopped gpuslice up (pid {bystander.pid})" in capsys.readouterr().out
    assert bystander.wait(5) == -signal.SIGTERM


def test_a_state_without_start_time_still_stops_a_gpuslice_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An older gpuslice's state file (no pid_start): its process is known by its command
    line."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "gpuslice"])
    try:
        _write(tmp_path / "st", {"run_id": "deadbeef0000", "pid": p.pid, "replicas": []})
        assert main(["down", "--state-dir", str(tmp_path / "st"), "--timeout", "5"]) == 0
        assert "stopped gpuslice up" in capsys.readouterr().out
        assert p.wait(5) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_up_is_not_refused_by_a_reused_pid(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           bystander: subprocess.Popen[bytes]) -> None:
    (tmp_path / "s.yaml").write_text("services: [{name: a, command: x}]\n")
    _write(tmp_path / "st", {"run_id": "deadbeef0000", "pid": bystander.pid,
                             "pid_start": 1, "replicas": []})
    assert main(["up", str(tmp_path / "s.yaml"), "--state-dir", str(tmp_path / "st"),
                 "--fake-gpus", str(tmp_path / "nosuch.yaml")]) == 2
    err = _one_error_line(capsys)
    assert "--fake-gpus" in err and "already running" not in err, err  # past the state check


@pytest.mark.parametrize(("doc", "field"), [
    ({"run_id": "x", "pid": "abc"}, "pid"),
    ({"run_id": "x", "pid": -1}, "pid"),
    ({"run_id": "x", "pid": 0}, "pid"),
    ({"run_id": "x", "pid": True}, "pid"),
    ({"run_id": "x", "pid": 12.5}, "pid"),
    ({"run_id": "x"}, "pid"),
    ({"run_id": "x", "pid": 1, "pid_start": "soon"}, "pid_start"),
    ({"run_id": "", "pid": 1}, "run_id"),
    ({"run_id": "x", "pid": 1, "replicas": "many"}, "replicas"),
    ({"run_id": "x", "pid": 1, "replicas": [{"name": "a"}]}, "replicas[0].service"),
    ({"run_id": "x", "pid": 1, "mps": [{"uuid": 5}]}, "mps[0].uuid"),
    ({"run_id": "x", "pid": 1, "router": {"url": "u"}}, "router"),
    ([1, 2], "state.json"),
])
@pytest.mark.parametrize("command", ["status", "down", "switch"])
def test_a_damaged_state_file_is_an_error_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        doc: object, field: str, command: str) -> None:
    def no_signal(*args: object) -> None:
        raise AssertionError(f"a signal was sent: {args}")

    monkeypatch.setattr(os, "kill", no_signal)
    monkeypatch.setattr(signal, "pidfd_send_signal", no_signal, raising=False)
    _write(tmp_path / "st", doc)
    argv = [command, "--state-dir", str(tmp_path / "st")] + (["--auto"] if command == "switch"
                                                             else [])
    assert main(argv) == 2
    err = _one_error_line(capsys)
    assert f"state.json: {field}: expected" in err or \
        f"state.json: {field} is missing: expected" in err or \
        (field == "state.json" and "state.json: expected" in err), err
    assert (tmp_path / "st" / "state.json").exists()  # not thrown away: the user decides


def test_the_state_records_when_its_process_started(tmp_path: Path) -> None:
    rt = LocalRuntime(LocalConfig(services=()), cast(Any, None), tmp_path)
    st = rt.state("running")
    assert st["pid"] == os.getpid() and st["pid_start"] == process_start(os.getpid())
    assert up_running(st)
    assert not up_running({**st, "pid_start": st["pid_start"] + 1})
