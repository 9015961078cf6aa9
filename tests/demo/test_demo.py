"""``gpuslice demo`` end to end (shortened scenario) and its clean shutdown at any point."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuslice.adapters.proc import processes_of as _processes_of
from gpuslice.demo.runtime import OWNER_FILE, sweep_stale_workdirs

pytestmark = pytest.mark.slow


def _demo(out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gpuslice.cli", "demo", "--short",
                             "--no-live", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(p: subprocess.Popen[str], pattern: str, timeout_s: float) -> list[str]:
    assert p.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    lines: list[str] = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not sel.select(0.2):
            continue
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(lines)}")


def test_demo_runs_the_whole_scenario_and_writes_its_report(tmp_path: Path) -> None:
    p = _demo(tmp_path / "report")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out
    s = json.loads((tmp_path / "report" / "summary.json").read_text())
    html = (tmp_path / "report" / "index.html").read_text()
    placed = {x["pod"]: x for x in s["placements"]}
    # every planned replica and batch pod ran on a slice; the 2-GPU job went to the new node
    assert all(x["node"] for x in placed.values()), placed
    assert placed["demo/trainer"]["node"] == "h100-1"
    assert len(placed["demo/trainer"]["gpus"]) == 2
    assert s["gpus_used"] < s["gpus_exclusive"]
    # the killed replica was restarted by the kubelet, and no request failed
    assert s["killed"] and f"container of {s['killed']} exited" in out, out[-6000:]
    for name, st in s["latency_total"].items():
        assert st["failed"] == 0, (name, st)
        assert st["ok"] > 0.9 * st["sent"], (name, st)
        assert f"<td>{name}</td>" in html
    # the pending job's reasons were shown, node by node
    assert re.search(r"demo/trainer fits no node: \S+: \S", out), out[-6000:]
    # the H100 that held the replicas was re-sliced under load: they moved first
    assert s["reconfig"]["moves"] >= 6 and len(s["reconfig"]["seconds_per_gpu"]) == 2
    # on the MIG-enabled H100s the replicas are MPS slices inside MIG instances (after the
    # re-slicing: the 7g), never whole-GPU slices
    on_h100 = [x for x in placed.values() if x["node"] == "h100-0"]
    assert on_h100 and all(x["mode"] == "mps" and x["mig_instance"] == "7g.80gb@0"
                           for x in on_h100), on_h100
    assert "<td>7g.80gb@0</td>" in html
    assert f"GPUs in use: {s['gpus_used']}" in out


@pytest.mark.parametrize(("sig", "when"), [
    (signal.SIGINT, r"started demo/"),  # while the replicas start
    (signal.SIGINT, r"phase\s+serve"),
    (signal.SIGTERM, r"phase\s+scale-out"),
])
def test_interrupting_the_demo_leaves_nothing_behind(tmp_path: Path, sig: int,
                                                     when: str) -> None:
    p = _demo(tmp_path / "report")
    try:
        lines = _read_until(p, when, 120)
        run = next(re.search(r"run (\w+) in (\S+)", ln) for ln in lines if " run " in ln)
        assert run is not None
        run_id, root = run.group(1), Path(run.group(2))
        assert _processes_of(run_id)  # the demo's children are there...
        p.send_signal(sig)
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130
    deadline = time.monotonic() + 10
    while _processes_of(run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(run_id) == []  # ...and gone: no replica, no router
    assert not root.exists()  # nor the sockets of the device plugins and the kubelets


def test_a_killed_demo_takes_its_children_with_it(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    p = _demo(tmp_path / "report")
    lines = _read_until(p, r"phase\s+serve", 120)
    run = next(re.search(r"run (\w+) in (\S+)", ln) for ln in lines if " run " in ln)
    assert run is not None
    assert _processes_of(run.group(1))
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while _processes_of(run.group(1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(run.group(1)) == []
    # no finally ran: the work directory stays until the next demo sweeps it (its owner is
    # gone); the sweep the next demo starts with, run here, leaves nothing behind
    root = Path(run.group(2))
    assert root.exists() and (root / OWNER_FILE).read_text() == str(p.pid)
    assert root in sweep_stale_workdirs(root.parent)
    assert not root.exists()
