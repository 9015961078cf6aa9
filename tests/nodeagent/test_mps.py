"""The MPS manager against a stand-in for nvidia-cuda-mps-control that behaves as the real one
was measured to (shared/reference/protocols.md 3.1: exit status 0 even on errors), and against
the real one on a GPU machine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpuslice.adapters.mps import MpsDaemon, MpsError
from gpuslice.adapters.proc import running
from tests.fake_mps import write_fake_mps


@pytest.fixture
def daemon(tmp_path: Path) -> MpsDaemon:
    tool = write_fake_mps(tmp_path / "mps-control")
    return MpsDaemon("GPU-aaa", tmp_path / "pipe", tmp_path / "log", binary=str(tool))


def test_lifecycle_limits_and_quit(daemon: MpsDaemon) -> None:
    assert not daemon.healthy()
    daemon.start(timeout_s=5)
    assert daemon.healthy() and daemon.servers() == []
    daemon.set_default_limits(thread_pct=25, memory_mib=2048)
    assert daemon.command("get_default_active_thread_percentage") == "25.0"
    daemon.quit(timeout_s=5)
    assert not daemon.healthy()


def test_errors_are_read_from_the_output_not_the_exit_status(daemon: MpsDaemon) -> None:
    daemon.start(timeout_s=5)
    with pytest.raises(MpsError, match='Unknown command "bogus_cmd"'):
        daemon.command("bogus_cmd")
    with pytest.raises(MpsError, match=r"1\.\.100"):
        daemon.set_default_limits(thread_pct=0)
    daemon.quit()
    with pytest.raises(MpsError, match="Cannot find MPS control daemon"):
        daemon.command("get_server_list")


def test_missing_binary_is_explained(tmp_path: Path) -> None:
    d = MpsDaemon("GPU-x", tmp_path / "p", tmp_path / "l", binary=str(tmp_path / "nope"))
    with pytest.raises(MpsError, match="on PATH"):
        d.start(timeout_s=1)


@pytest.mark.gpu
def test_real_mps_daemon_with_private_directories(tmp_path: Path) -> None:
    if shutil.which("nvidia-cuda-mps-control") is None or shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA driver with MPS on this machine")
    pytest.importorskip("pynvml")
    from gpuslice.adapters.nvml.real import load

    gpus = load().devices()
    if not gpus:
        pytest.skip("no GPU")
    d = MpsDaemon(gpus[0].uuid, tmp_path / "pipe", tmp_path / "log")
    d.start()
    try:
        d.set_default_limits(thread_pct=25, memory_mib=2048)
        assert d.command("get_default_active_thread_percentage") == "25.0"
    finally:
        d.quit()


def test_a_pipe_directory_too_long_for_unix_sockets_is_refused(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    d = MpsDaemon("GPU-x", deep / "pipe", deep / "log", binary="true")
    with pytest.raises(MpsError, match="too long for its sockets"):
        d.start(timeout_s=1)
    assert not deep.exists()  # nothing made


def test_start_does_not_wait_on_a_daemon_that_keeps_its_output_open(tmp_path: Path) -> None:
    """The real tool forks a daemon; one that inherits the output pipes must not make start
    wait for it (it would until the timeout, then report a failed start)."""
    import time

    real = write_fake_mps(tmp_path / "real-control")
    tool = tmp_path / "mps-control"
    tool.write_text(f"""#!/bin/sh
if [ "$1" = "-d" ]; then
    (sleep 30) &
    exec {real} -d
fi
exec {real} "$@"
""")
    tool.chmod(0o755)
    d = MpsDaemon("GPU-x", tmp_path / "pipe", tmp_path / "log", binary=str(tool))
    t0 = time.monotonic()
    d.start(timeout_s=10)
    assert time.monotonic() - t0 < 5
    d.quit()


def test_a_daemon_that_dies_at_start_says_why(tmp_path: Path) -> None:
    tool = tmp_path / "mps-control"
    tool.write_text("#!/bin/sh\necho 'An instance of this daemon is already running' >&2\n")
    tool.chmod(0o755)
    d = MpsDaemon("GPU-x", tmp_path / "pipe", tmp_path / "log", binary=str(tool))
    with pytest.raises(MpsError, match="it said: An instance of this daemon is already running"):
        d.start(timeout_s=1)


def test_a_restarted_agent_adopts_the_mps_daemon_its_pods_still_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a cluster the daemons outlive the agent (running pods are their clients): stopping
    the agent leaves them, and the next agent adopts them instead of starting another."""
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.core.devices import GpuDevice
    from gpuslice.services.device_plugin import PluginConfig
    from gpuslice.services.node_agent import NodeAgent

    log = tmp_path / "mps.log"
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    tool = write_fake_mps(tmp_path / "mps-control")
    nvml = FakeNvml([GpuDevice(0, "GPU-a", "NVIDIA T4", "T4", 15360)])
    cfg = PluginConfig("n1", tmp_path, b"k" * 16, mps_pipe_dir=str(tmp_path / "mps"))

    def agent() -> NodeAgent:
        return NodeAgent(cfg, nvml, FakeApiServer(), mps=True, mps_binary=str(tool),
                         quit_mps_on_stop=False)

    first = agent()
    first.ensure_mps("GPU-a")
    first.stop()
    assert (tmp_path / "mps" / "GPU-a" / "control").exists()  # still serving its clients
    second = agent()
    second.ensure_mps("GPU-a")
    starts = [line for line in log.read_text().splitlines() if line.startswith("-d")]
    assert len(starts) == 1  # adopted, not started again
    second.quit_mps()
    assert not (tmp_path / "mps" / "GPU-a" / "control").exists()


def test_the_agent_holds_each_server_to_the_largest_share_handed_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's own CUDA_MPS_* variables only lower the server's limits, so the agent sets
    the server side to the largest share on the GPU: the defaults of the next server and the
    limits of the running ones, widened as bigger shares arrive, never narrowed under a
    share already handed out (also not by an agent that adopts the daemon)."""
    import json

    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.core.devices import GpuDevice
    from gpuslice.services.device_plugin import PluginConfig
    from gpuslice.services.node_agent import NodeAgent

    tool = write_fake_mps(tmp_path / "mps-control")
    nvml = FakeNvml([GpuDevice(0, "GPU-a", "NVIDIA T4", "T4", 15360)])
    cfg = PluginConfig("n1", tmp_path, b"k" * 16, mps_pipe_dir=str(tmp_path / "mps"))
    state_file = tmp_path / "mps" / "GPU-a" / "fake-state.json"

    def agent() -> NodeAgent:
        return NodeAgent(cfg, nvml, FakeApiServer(), mps=True, mps_binary=str(tool),
                         quit_mps_on_stop=False)

    def state() -> dict[str, object]:
        return dict(json.loads(state_file.read_text()))

    first = agent()
    first.ensure_mps("GPU-a", 25, 4096)
    assert state()["pct"] == 25.0 and state()["mem"] == "4096M"
    s = state()
    s["servers"] = ["4242"]  # a server is running now
    state_file.write_text(json.dumps(s))
    first.ensure_mps("GPU-a", 10, 1024)  # smaller: nothing changes
    assert "server_pct" not in state()
    first.ensure_mps("GPU-a", 50, 8192)
    assert state()["pct"] == 50.0 and state()["mem"] == "8192M"
    assert state()["server_pct"] == {"4242": 50.0} and state()["server_mem"] == {"4242": "8192M"}
    first.ensure_mps("GPU-a", 30, None)  # a share with no memory cap lifts the memory ceiling
    assert state()["server_mem"] == {"4242": "1048576M"} and state()["pct"] == 50.0
    first.stop()
    second = agent()  # adopts the daemon: a 20% share does not narrow it under 50%
    second.ensure_mps("GPU-a", 20, 2048)
    assert state()["pct"] == 50.0 and state()["server_pct"] == {"4242": 50.0}
    second.quit_mps()


def test_the_agent_restarts_a_daemon_that_stopped_answering_with_its_ceiling(
        tmp_path: Path) -> None:
    import json

    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.core.devices import GpuDevice
    from gpuslice.services.device_plugin import PluginConfig
    from gpuslice.services.node_agent import NodeAgent

    tool = write_fake_mps(tmp_path / "mps-control")
    nvml = FakeNvml([GpuDevice(0, "GPU-a", "NVIDIA T4", "T4", 15360)])
    cfg = PluginConfig("n1", tmp_path, b"k" * 16, mps_pipe_dir=str(tmp_path / "mps"))
    agent = NodeAgent(cfg, nvml, FakeApiServer(), mps=True, mps_binary=str(tool))
    agent.ensure_mps("GPU-a", 30, 2048)
    assert agent.watch_mps() == []  # answering: left alone
    (tmp_path / "mps" / "GPU-a" / "control").unlink()  # the daemon died
    assert agent.watch_mps() == ["GPU-a"] and agent.mps_restarts == 1
    state = json.loads((tmp_path / "mps" / "GPU-a" / "fake-state.json").read_text())
    assert state["pct"] == 30.0 and state["mem"] == "2048M"
    agent.quit_mps()


def test_quit_leaves_no_sockets_or_pid_file_and_start_passes_a_stale_pid_file(
        daemon: MpsDaemon) -> None:
    """What a killed daemon leaves (its PID file, sockets) does not stop the next start, and
    quit removes what the daemon left of them (seen left behind on an H200)."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    daemon.pipe_dir.mkdir(parents=True)
    (daemon.pipe_dir / "nvidia-cuda-mps-control.pid").write_text(f"{gone.pid}\n")
    daemon.start(timeout_s=5)
    # the stale file went; the one there now is the new daemon's own (as the real one writes)
    pid = int((daemon.pipe_dir / "nvidia-cuda-mps-control.pid").read_text())
    assert pid != gone.pid and running(pid)
    (daemon.pipe_dir / "control_privileged").touch()
    daemon.quit(timeout_s=5)
    assert not list(daemon.pipe_dir.glob("control*"))
