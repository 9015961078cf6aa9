"""Local mode end to end on fake GPUs: ``gpuslice up`` (detached and in the foreground),
``status``, ``select`` and ``down``, with the example server (tiny NumPy model) as replicas and a
stand-in for the MPS control tool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice.adapters.proc import processes_of
from tests.fake_mps import write_fake_mps

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "examples" / "local" / "server.py"
pytestmark = pytest.mark.slow


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuslice.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, check=False)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    (tmp_path / "gpus.yaml").write_text(
        "gpus:\n  - model: A100-80GB\n    used_mib: 1024\n  - model: T4\n")
    cmd = [sys.executable, str(SERVER), "--model", "tiny", "--port", "{port}"]
    (tmp_path / "services.yaml").write_text(json.dumps({"services": [
        {"name": "alpha", "model": "tiny", "rate": 50, "slo_ms": 500, "command": cmd,
         "replicas": 2, "compute": 40, "memory": "8G"},
        {"name": "beta", "model": "tiny", "rate": 20, "slo_ms": 500, "command": cmd,
         "compute": 30, "memory": "4G", "gpu": 1, "priority": "best-effort"},
    ]}))
    mps = write_fake_mps(tmp_path / "mps-control")
    state = tmp_path / "state"
    args = [str(tmp_path / "services.yaml"), "--fake-gpus", str(tmp_path / "gpus.yaml"),
            "--state-dir", str(state), "--port", "0", "--mps-binary", str(mps)]
    yield state, args
    cli("down", "--state-dir", str(state))


def _get(url: str, data: bytes | None = None) -> dict[str, object]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        doc: dict[str, object] = json.loads(r.read())
        return doc


def _state(state: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((state / "state.json").read_text())  # type: ignore[no-any-return]


def test_up_status_restart_select_and_down(setup: tuple[Path, list[str]]) -> None:
    state, args = setup
    r = cli("up", *args, "--detach")
    assert r.returncode == 0, r.stdout + r.stderr
    st = _state(state)
    run_id, router = st["run_id"], st["router"]["url"]
    reps = {x["name"]: x for x in st["replicas"]}
    assert set(reps) == {"alpha-0", "alpha-1", "beta-0"}
    assert reps["beta-0"]["gpu_index"] == 1  # pinned
    assert {reps["alpha-0"]["gpu_index"], reps["alpha-1"]["gpu_index"]} == {0}
    # each replica runs with the environment of its slice
    env = _get(f"http://127.0.0.1:{reps['alpha-1']['port']}/slice")
    assert env["CUDA_VISIBLE_DEVICES"] == reps["alpha-1"]["gpu_uuid"]
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert env["CUDA_MPS_CLIENT_PRIORITY"] is None  # normal: MPS's default
    beta = _get(f"http://127.0.0.1:{reps['beta-0']['port']}/slice")
    assert beta["CUDA_MPS_CLIENT_PRIORITY"] == "1"  # best-effort
    pipe = next(m["pipe_dir"] for m in st["mps"] if m["uuid"] == reps["alpha-1"]["gpu_uuid"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe and (Path(pipe) / "control").exists()
    # requests through the router, while status measures throughput per replica
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            for svc in ("alpha", "beta"):
                out = _get(f"{router}/v2/models/{svc}/infer", b"{}")
                assert out["model_name"] == "tiny"

    t = threading.Thread(target=load)
    t.start()
    try:
        r = cli("status", "--state-dir", str(state), "-o", "json", "--window", "1")
    finally:
        stop.set()
        t.join()
    assert r.returncode == 0, r.stderr
    measured = {x["name"]: x["throughput_rps"] for x in json.loads(r.stdout)["replicas"]}
    assert measured["beta-0"] > 0 and measured["alpha-0"] + measured["alpha-1"] > 0
    table = cli("status", "--state-dir", str(state), "--window", "0.2").stdout
    assert "40%" in table and "8192 MiB" in table
    # a crashed replica is restarted and serves again
    os.kill(reps["beta-0"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = {x["name"]: x for x in _state(state)["replicas"]}["beta-0"]
        if now["restarts"] >= 1 and now["status"] == "running":
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"beta-0 not restarted: {now}")
    assert _get(f"{router}/v2/models/beta/infer", b"{}")["model_name"] == "tiny"
    # select counts the slices handed out: GPU 0 has 20% left, GPU 1 (T4) 70%
    r = cli("select", "--memory", "2G", "--compute", "50", "--fake-gpus",
            args[args.index("--fake-gpus") + 1], "--state-dir", str(state))
    assert r.returncode == 0 and r.stdout.strip() == reps["beta-0"]["gpu_uuid"], r.stderr
    r = cli("select", "--compute", "80", "--fake-gpus", args[args.index("--fake-gpus") + 1],
            "--state-dir", str(state))
    assert r.returncode == 2 and "no GPU has 0 MiB and 80% free" in r.stderr
    # down: nothing left, MPS daemons quit
    r = cli("down", "--state-dir", str(state))
    assert r.returncode == 0 and "stopped gpuslice up" in r.stdout, r.stdout
    assert processes_of(run_id) == []
    assert not (Path(pipe) / "control").exists()
    assert not (state / "state.json").exists()
    assert "nothing running" in cli("status", "--state-dir", str(state)).stdout + \
        cli("down", "--state-dir", str(state)).stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_in_the_foreground_stops_everything(setup: tuple[Path, list[str]],
                                                   sig: int) -> None:
    state, args = setup
    p = subprocess.Popen([sys.executable, "-m", "gpuslice.cli", "up", *args], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (state / "state.json").exists() and _state(state)["status"] == "running":
                break
            time.sleep(0.1)
        st = _state(state)
        assert processes_of(st["run_id"])
        p.send_signal(sig)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    assert processes_of(st["run_id"]) == []
    assert all(not (Path(m["pipe_dir"]) / "control").exists() for m in st["mps"])
    assert not (state / "state.json").exists()


def test_ctrl_c_while_replicas_start_stops_everything(tmp_path: Path) -> None:
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "services.yaml").write_text(json.dumps({"services": [
        {"name": "slow", "command": [sys.executable, str(slow)], "replicas": 2}]}))
    (tmp_path / "gpus.yaml").write_text("gpus:\n  - model: T4\n")
    state = tmp_path / "state"
    p = subprocess.Popen([sys.executable, "-m", "gpuslice.cli", "up",
                          str(tmp_path / "services.yaml"), "--fake-gpus",
                          str(tmp_path / "gpus.yaml"), "--state-dir", str(state), "--no-mps"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (state / "state.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    run_id = _state(state)["run_id"]
    assert len(processes_of(run_id)) == 2
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    assert processes_of(run_id) == []


@pytest.mark.parametrize(("doc", "text"), [
    ({"services": [{"name": "a"}]}, "services[a].command"),
    ({"services": [{"name": "a", "command": "x", "compute": 150}]}, "services[a].compute"),
    ({"services": [{"name": "a", "command": "x", "memory": "lots"}]}, "services[a].memory"),
    ({"services": [{"name": "a", "command": "x", "replicas": 0}]}, "services[a].replicas"),
    ({"services": [{"name": "a", "command": "x", "priority": "vip"}]}, "services[a].priority"),
    ({"services": []}, "services"),
])
def test_bad_services_files_are_refused_with_the_field(tmp_path: Path, doc: object,
                                                       text: str) -> None:
    f = tmp_path / "s.yaml"
    f.write_text(json.dumps(doc))
    r = cli("up", str(f), "--state-dir", str(tmp_path / "st"), "--fake-gpus", "/nonexistent")
    assert r.returncode == 2 and text in r.stderr, r.stderr


def test_switching_slice_profiles_under_load_drops_no_request(tmp_path: Path) -> None:
    state = up_with_layouts(tmp_path, SERVER, {
        "day": {"alpha": {"compute": 40, "memory": "8G"}, "beta": {"compute": 20}},
        "night": {"alpha": {"compute": 20, "memory": "4G"}, "beta": {"compute": 60}},
        "huge": {"beta": {"compute": 90}, "alpha": {"compute": 40}}})
    try:
        st = _state(state)
        assert st["layout"]["active"] == "night"
        router = st["router"]["url"]
        codes: list[int] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                for svc in ("alpha", "beta"):
                    req = urllib.request.Request(f"{router}/v2/models/{svc}/infer",
                                                 data=b"{}", method="POST")
                    try:
                        with urllib.request.urlopen(req, timeout=10) as resp:
                            codes.append(resp.status)
                    except urllib.error.HTTPError as exc:
                        codes.append(exc.code)

        t = threading.Thread(target=load)
        t.start()
        try:
            time.sleep(0.5)
            assert cli("switch", "day", "--state-dir", str(state)).returncode == 0
            assert wait_state(state, lambda s: s["layout"]["active"] == "day", 60), \
                _state(state)["layout"]
            time.sleep(0.5)
        finally:
            stop.set()
            t.join()
        assert codes and set(codes) == {200}, sorted(set(codes))
        st = _state(state)
        caps = {x["name"]: x["compute_pct"] for x in st["replicas"]}
        assert caps == {"alpha-0": 40, "alpha-1": 40, "beta-0": 20}
        port = next(x["port"] for x in st["replicas"] if x["name"] == "alpha-0")
        env = _get(f"http://127.0.0.1:{port}/slice")
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
        assert len(processes_of(st["run_id"])) == 3  # the old replicas are gone
        # a layout that does not fit: reported, nothing changed
        assert cli("switch", "huge", "--state-dir", str(state)).returncode == 0
        assert wait_state(state, lambda s: "does not fit" in s["layout"]["status"], 20)
        assert _state(state)["layout"]["active"] == "day"
        assert cli("switch", "dusk", "--state-dir", str(state)).returncode == 2
        assert cli("switch", "--auto", "--state-dir", str(state)).returncode == 0
        assert wait_state(state, lambda s: s["layout"]["active"] == "night", 60)
    finally:
        cli("down", "--state-dir", str(state))


def up_with_layouts(tmp_path: Path, server: Path, layouts: dict[str, Any]) -> Path:
    """``gpuslice up --detach`` on one fake A100 with the MPS stand-in: services alpha (two
    replicas) and beta of ``server`` (tiny model), with ``layouts`` and night as the default;
    returns the state directory."""
    (tmp_path / "gpus.yaml").write_text("gpus:\n  - model: A100-80GB\n")
    cmd = [sys.executable, str(server), "--model", "tiny", "--port", "{port}"]
    (tmp_path / "services.yaml").write_text(json.dumps({
        "services": [{"name": "alpha", "command": cmd, "replicas": 2},
                     {"name": "beta", "command": cmd}],
        "layouts": layouts, "default": "night"}))
    state = tmp_path / "state"
    mps = write_fake_mps(tmp_path / "mps-control")
    r = cli("up", str(tmp_path / "services.yaml"), "--fake-gpus", str(tmp_path / "gpus.yaml"),
            "--state-dir", str(state), "--port", "0", "--mps-binary", str(mps), "--detach")
    assert r.returncode == 0, r.stdout + r.stderr
    return state


def wait_state(state: Path, pred: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if pred(_state(state)):
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    return False


def test_a_switch_whose_new_replica_fails_rolls_back_to_the_old_layout(tmp_path: Path) -> None:
    wrapper = tmp_path / "serve.py"
    wrapper.write_text(
        "import os, sys\n"
        "if os.environ.get('GPUSLICE_SERVICE') == 'beta' and "
        "os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE') == '15':\n"
        "    sys.exit('beta cannot run on 15%')\n"
        f"os.execv(sys.executable, [sys.executable, {str(SERVER)!r}, *sys.argv[1:]])\n")
    state = up_with_layouts(tmp_path, wrapper, {
        "night": {"alpha": {"compute": 20}, "beta": {"compute": 50}},
        "bad": {"alpha": {"compute": 30}, "beta": {"compute": 15}}})
    try:
        assert cli("switch", "bad", "--state-dir", str(state)).returncode == 0
        assert wait_state(state, lambda s: "rolled back" in s["layout"]["status"], 60), \
            _state(state)["layout"]
        st = _state(state)
        assert st["layout"]["active"] == "night"
        assert "2 of 2 moved replica(s) rolled back" in st["layout"]["status"]
        assert {x["name"]: x["compute_pct"] for x in st["replicas"]} == \
            {"alpha-0": 20, "alpha-1": 20, "beta-0": 50}
        assert all(x["status"] == "running" for x in st["replicas"])
        assert len(processes_of(st["run_id"])) == 3
    finally:
        cli("down", "--state-dir", str(state))
