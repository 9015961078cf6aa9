"""SIGTERM as the kubelet sends it when a pod is deleted: each long-running component, as a
real process, stops serving, gives up what it holds and exits 0 within a few seconds (not at
the end of the 30 s grace period), its last log line saying so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.extender.test_extender_cli import FAKE, free_port

STOP_WITHIN_S = 5.0  # the components take about 1 s; the margin is for a loaded machine


def spawn(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``gpuslice ARGS`` as a process, its stdout and stderr in a file (no pipe to fill)."""
    log = tmp_path / f"{args[0]}-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpuslice.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})
    return proc, log


def wait_for_line(proc: subprocess.Popen[bytes], log: Path, text: str,
                  timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > end:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            raise AssertionError(f"no {text!r} in the log:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)


def terminate(proc: subprocess.Popen[bytes], log: Path) -> str:
    """SIGTERM; the process must exit 0 within :data:`STOP_WITHIN_S`. Returns its log."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"still running {STOP_WITHIN_S} s after SIGTERM:\n"
                             f"{log.read_text(errors='replace')}") from None
    text = log.read_text(errors="replace")
    assert code == 0, (code, time.monotonic() - t0, text)
    assert "Traceback" not in text, text
    return text


def read(url: str) -> tuple[int, str]:
    """The status and body of a GET (an HTTP error status too)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "fake.yaml").write_text(FAKE)
    (tmp_path / "key").write_text("test-key-0123456789abcdef")
    return tmp_path


def test_extender_stops_on_sigterm_and_gives_its_lease_up(files: Path) -> None:
    port = free_port()
    proc, log = spawn(files, "extender", "--listen", f"127.0.0.1:{port}", "--key-file",
                      str(files / "key"), "--fake-cluster", str(files / "fake.yaml"),
                      "--leader-elect", "--insecure-no-client-auth", POD_NAME="ext-a")
    wait_for_line(proc, log, "serving on http://127.0.0.1")
    end = time.monotonic() + 20
    # Ready from the start (leader or not); alone, it leads at its first step
    while read(f"http://127.0.0.1:{port}/readyz") != (200, "ok: leader"):
        assert time.monotonic() < end and proc.poll() is None, log.read_text()
        time.sleep(0.1)
    text = terminate(proc, log)
    assert ("stopped on SIGTERM: released the Lease gpuslice-system/gpuslice-extender"
            in text), text


def test_reconfig_controller_stops_on_sigterm(files: Path) -> None:
    proc, log = spawn(files, "reconfig", "run", "--fake-cluster", str(files / "fake.yaml"),
                      "--every", "0.5")
    wait_for_line(proc, log, "following SliceSchedules every 0.5 s")
    assert "stopped on SIGTERM" in terminate(proc, log)


def test_router_stops_on_sigterm(files: Path) -> None:
    (files / "router.toml").write_text(
        '[[services]]\nname = "m"\n[[services.replicas]]\nname = "a"\n'
        'url = "http://127.0.0.1:9"\n')
    proc, log = spawn(files, "router", "--config", str(files / "router.toml"), "--listen",
                      "127.0.0.1:0", "--admin", "off", "--access-log", "off")
    wait_for_line(proc, log, "listening on 127.0.0.1")
    assert "stopped on SIGTERM" in terminate(proc, log)


def test_node_agent_stops_on_sigterm(files: Path) -> None:
    """The node agent (which already stopped on SIGTERM) through the same helper."""
    import tempfile

    from tests.nodeagent.test_device_plugin import Kubelet

    (files / "inv.yaml").write_text("gpus:\n  - model: T4\n")
    (files / "cluster.yaml").write_text("nodes:\n  - metadata: {name: n1}\n")
    with tempfile.TemporaryDirectory(prefix="ns-") as d:  # a short path for the sockets
        kubelet = Kubelet(Path(d)).start()
        try:
            proc, log = spawn(files, "node-agent", "--node", "n1", "--key-file",
                              str(files / "key"), "--fake-gpus", str(files / "inv.yaml"),
                              "--socket-dir", d, "--fake-cluster", str(files / "cluster.yaml"),
                              "--metrics", "off")
            assert kubelet.registered.wait(15), log.read_text()
            assert "stopped on SIGTERM" in terminate(proc, log)
        finally:
            kubelet.stop()
