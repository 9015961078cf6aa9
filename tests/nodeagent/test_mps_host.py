"""MPS daemons that outlive the components that want them: the stand-in daemon lives as the
real one (a process; its clients fail when it goes), ``gpuslice mps-host`` starts and keeps
the daemons the node agent and the DRA driver ask for in their records, and a restarted
owner adopts them, ceilings included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.adapters.mps import Ceiling, MpsDaemon, MpsError
from gpuslice.adapters.mps.host import (
    HEARTBEAT,
    Want,
    parse_want,
    read_heartbeat,
    read_want,
    read_wants,
    write_want,
)
from gpuslice.adapters.mps.keeper import MpsDaemons
from gpuslice.adapters.proc import running
from gpuslice.services.mps_host import MpsHost
from tests.fake_mps import write_fake_mps


def _client(pipe: Path, env: dict[str, str] | None = None,
            processes: int = 1) -> subprocess.Popen[str]:
    from gpuslice.adapters.mps import standin

    return subprocess.Popen(
        [sys.executable, standin.__file__, "client", "--processes", str(processes)],
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _state(pipe: Path) -> dict[str, object]:
    return dict(json.loads((pipe / "fake-state.json").read_text()))


def _wait(what: str, cond: object, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def tool(tmp_path: Path) -> str:
    return str(write_fake_mps(tmp_path / "mps-control"))


def test_the_stand_in_daemon_is_a_process_its_clients_depend_on(tmp_path: Path,
                                                                 tool: str) -> None:
    """``-d`` leaves a daemon process (its PID file names it); a client is held to the lower
    of its own limits and the server's; when the daemon is killed, every client fails as a
    real one does (cudaErrorMpsRpcFailure, exit 1)."""
    d = MpsDaemon("GPU-a", tmp_path / "pipe", tmp_path / "log", binary=tool)
    d.start()
    pid = d.pid()
    assert pid is not None and running(pid)
    d.set_default_limits(25, 4096)
    c = _client(d.pipe_dir, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M",
                             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}, processes=2)
    _wait("two clients", lambda: len(_state(d.pipe_dir).get("clients") or []) == 2)
    clients = _state(d.pipe_dir)["clients"]
    assert isinstance(clients, list)
    assert {(x["pct"], x["mem_mib"]) for x in clients} == {(25.0, 2048)}
    assert d.servers() == [pid]
    os.kill(pid, signal.SIGKILL)
    out, err = c.communicate(timeout=10)
    assert c.returncode == 1 and err.count("cudaErrorMpsRpcFailure") == 2, (out, err)
    assert not d.healthy()


def test_quit_waits_for_the_clients_and_takes_no_new_one(tmp_path: Path, tool: str) -> None:
    d = MpsDaemon("GPU-a", tmp_path / "pipe", tmp_path / "log", binary=tool)
    d.start()
    pid = d.pid()
    assert pid is not None
    c = _client(d.pipe_dir)
    _wait("a client", lambda: _state(d.pipe_dir).get("clients"))
    with pytest.raises(MpsError, match="did not quit"):
        d.quit(timeout_s=1)  # a client is attached: the daemon stays for it
    assert running(pid) and not d.healthy()  # no new client or command meanwhile
    late = _client(d.pipe_dir)
    assert late.wait(timeout=10) == 1
    c.send_signal(signal.SIGTERM)
    c.wait(timeout=10)
    _wait("the daemon's exit", lambda: not running(pid))


def test_records_are_validated_and_written_whole(tmp_path: Path) -> None:
    write_want(tmp_path, Want("GPU-a", "node-agent", Ceiling(25, 4096)))
    assert read_want(tmp_path, "GPU-a") == Want("GPU-a", "node-agent", Ceiling(25, 4096))
    assert [p.name for p in tmp_path.iterdir()] == ["GPU-a.want"]  # no temporary left
    for text, field in (('{"target": "../x", "owner": "a", "thread_pct": 5}', "target"),
                        ('{"target": "GPU-a", "owner": "", "thread_pct": 5}', "owner"),
                        ('{"target": "GPU-a", "owner": "a", "thread_pct": 101}',
                         "thread_pct"),
                        ('{"target": "GPU-a", "owner": "a", "thread_pct": 5, '
                         '"memory_mib": -1}', "memory_mib"), ("[]", "object")):
        with pytest.raises(ValueError, match=field):
            parse_want(text)
    (tmp_path / "GPU-b.want").write_text("{not json")
    problems: list[str] = []
    assert [w.target for w in read_wants(tmp_path, problems)] == ["GPU-a"]
    assert "GPU-b.want" in problems[0]
    with pytest.raises(ValueError, match="target"):
        write_want(tmp_path, Want("../etc", "x", Ceiling()))


def test_the_host_starts_what_is_wanted_with_its_ceiling_and_restarts_it(
        tmp_path: Path, tool: str) -> None:
    root = tmp_path / "mps"
    host = MpsHost(root, tool, check_s=0.0)
    write_want(root, Want("GPU-a", "node-agent", Ceiling(30, 2048)))
    assert host.step() == ["GPU-a"]
    assert _state(root / "GPU-a") == {"pct": 30.0, "mem": "2048M"}
    beat = read_heartbeat(root)
    first = MpsDaemon("GPU-a", root / "GPU-a", root / "GPU-a.log", binary=tool).pid()
    assert beat is not None and beat.pid == os.getpid() and beat.started == {"GPU-a": first}
    assert host.step() == []  # answering: left alone
    assert first is not None
    os.kill(first, signal.SIGKILL)
    _wait("the daemon's death", lambda: not running(first))
    assert host.step() == ["GPU-a"] and host.restarts == {"GPU-a": 1}
    assert _state(root / "GPU-a") == {"pct": 30.0, "mem": "2048M"}  # its ceiling again
    (root / "GPU-a.want").unlink()
    MpsDaemon("GPU-a", root / "GPU-a", root / "GPU-a.log", binary=tool).quit()
    assert host.step() == [] and host.started == {}


@pytest.fixture
def host(tmp_path: Path, tool: str) -> Iterator[MpsHost]:
    h = MpsHost(tmp_path / "mps", tool, poll_s=0.05)
    t = threading.Thread(target=h.run, daemon=True)
    t.start()
    yield h
    h.stop()
    t.join(5)
    for want in read_wants(tmp_path / "mps"):
        d = h.daemon(want.target)
        if d.healthy():
            d.quit(timeout_s=5)


def test_an_owner_with_a_host_never_starts_a_daemon_itself_and_its_successor_adopts(
        tmp_path: Path, tool: str, host: MpsHost) -> None:
    """The node agent asks (a record), the host starts; the agent goes (killed: nothing
    quit), its client keeps its daemon, and the next agent adopts it with its ceiling:
    widened by a larger share, never narrowed by a smaller one; quitting the last takes the
    record first, so that the host does not start it again."""
    root = tmp_path / "mps"
    log = tmp_path / "calls.log"
    os.environ["FAKE_MPS_LOG"] = str(log)
    try:
        first = MpsDaemons(root, "node-agent", binary=tool, host=True)
        assert first.ensure("GPU-a", 25, 4096) is True
        d = first.daemon("GPU-a")
        pid = d.pid()
        c = _client(d.pipe_dir)
        _wait("a client", lambda: _state(d.pipe_dir).get("clients"))
        second = MpsDaemons(root, "node-agent", binary=tool, host=True)  # after a kill -9
        assert second.adopt() == ["GPU-a"]
        assert second.ceilings["GPU-a"] == Ceiling(25, 4096)
        assert second.ensure("GPU-a", 10, 1024) is False
        assert _state(d.pipe_dir)["pct"] == 25.0 and _state(d.pipe_dir)["mem"] == "4096M"
        assert second.ensure("GPU-a", 50, 8192) is False
        assert read_want(root, "GPU-a") == Want("GPU-a", "node-agent", Ceiling(50, 8192))
        assert d.pid() == pid and c.poll() is None  # the same daemon, its client alive
    finally:
        del os.environ["FAKE_MPS_LOG"]
    starts = [line for line in log.read_text().splitlines() if line.startswith("-d")]
    assert len(starts) == 1  # by the host, once
    c.send_signal(signal.SIGTERM)
    c.wait(timeout=10)
    assert second.quit("GPU-a") is True
    assert read_want(root, "GPU-a") is None
    time.sleep(0.3)  # a few host passes: not started again
    assert not d.healthy()


def test_without_a_host_the_owner_is_told_where_to_look(tmp_path: Path, tool: str) -> None:
    keeper = MpsDaemons(tmp_path / "mps", "node-agent", binary=tool, host=True,
                        start_timeout_s=0.3)
    with pytest.raises(MpsError, match="gpuslice-mps-host DaemonSet"):
        keeper.ensure("GPU-a", 25, 4096)
    stale = {"pid": 1, "time": time.time() - 60, "started": {}, "restarts": {}}
    (tmp_path / "mps" / HEARTBEAT).write_text(json.dumps(stale))
    with pytest.raises(MpsError, match=r"last wrote .* ago"):
        keeper.ensure("GPU-a", 25, 4096)


def test_another_owners_daemon_is_used_but_not_quit(tmp_path: Path, tool: str,
                                                    host: MpsHost) -> None:
    """The DRA driver sharing a GPU whose daemon the node agent keeps: it widens the ceiling
    but the record stays the agent's, and the driver does not quit it."""
    root = tmp_path / "mps"
    agent = MpsDaemons(root, "node-agent", binary=tool, host=True)
    agent.ensure("GPU-a", 25, 4096)
    driver = MpsDaemons(root, "dra-driver", binary=tool, host=True)
    assert driver.ensure("GPU-a", 50, 8192) is False
    assert read_want(root, "GPU-a") == Want("GPU-a", "node-agent", Ceiling(50, 8192))
    assert not driver.owns("GPU-a") and agent.owns("GPU-a")
    assert driver.adopt() == []


def test_the_agent_exports_the_hosts_health_and_adopts_at_start(tmp_path: Path, tool: str,
                                                               host: MpsHost) -> None:
    """A node agent with --mps-host: its daemons come from the host, a restarted agent
    adopts them before serving (the ceiling of its record), and its metrics say whether the
    host's heartbeat is fresh and how often the host restarted a daemon."""
    from prometheus_client import generate_latest

    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.services.device_plugin import PluginConfig
    from gpuslice.services.node_agent import NodeAgent

    nvml = FakeNvml.simulated(1)
    gpu = nvml.devices()[0].uuid
    cfg = PluginConfig("n1", tmp_path, b"k" * 16, mps_pipe_dir=str(tmp_path / "mps"))
    first = NodeAgent(cfg, nvml, FakeApiServer(), mps=True, mps_binary=tool,
                      quit_mps_on_stop=False, mps_host=True)
    first.ensure_mps(gpu, 40, 4096)
    pid = first.mps.daemon(gpu).pid()
    second = NodeAgent(cfg, nvml, FakeApiServer(), mps=True, mps_binary=tool,
                       quit_mps_on_stop=False, mps_host=True)
    assert second.adopt_mps() == [gpu] and second.mps.ceilings[gpu] == Ceiling(40, 4096)
    second.watch_mps()
    text = generate_latest(second.metrics.registry).decode()
    assert 'gpuslice_mps_host_up{node="n1"} 1.0' in text
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _wait("the host's restart", lambda: read_heartbeat(tmp_path / "mps") is not None
          and read_heartbeat(tmp_path / "mps").restarts.get(gpu) == 1)  # type: ignore[union-attr]
    second.watch_mps()
    text = generate_latest(second.metrics.registry).decode()
    assert f'gpuslice_mps_daemon_restarts{{gpu="{gpu}",node="n1"}} 1.0' in text
    host.stop()
    beat = json.loads((tmp_path / "mps" / HEARTBEAT).read_text())
    beat["time"] -= 60
    (tmp_path / "mps" / HEARTBEAT).write_text(json.dumps(beat))
    second.watch_mps()
    assert 'gpuslice_mps_host_up{node="n1"} 0.0' in generate_latest(
        second.metrics.registry).decode()
    assert any("last wrote" in p for p in second.problems)
