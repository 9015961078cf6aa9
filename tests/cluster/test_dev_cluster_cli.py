"""``gpuslice dev-cluster up|status|down``: a second cluster, started detached, used with
kubectl, then stopped with nothing left running and its folder gone."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpuslice.cli import main
from tests.cluster.conftest import REPO


def _run(*argv: str) -> int:
    return main(["dev-cluster", *argv])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by this process) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_up_status_down(cluster_bin: Path, tmp_path: Path) -> None:
    folder = tmp_path / "dc"
    common = ["--dir", str(folder), "--bin-dir", str(cluster_bin), "--repo", str(REPO)]
    assert _run("up", *common, "--nodes", "1", "--gpus", "2") == 0
    try:
        state = json.loads((folder / "state.json").read_text())
        assert set(state["pids"]) >= {"etcd", "kube-apiserver", "kube-controller-manager",
                                      "kube-scheduler", "kwok", "gpuslice-extender"}
        assert _run("status", *common) == 0
        import subprocess

        nodes = subprocess.run([str(cluster_bin / "kubectl"), "--kubeconfig",
                                state["kubeconfig"], "get", "nodes", "-o", "name"],
                               capture_output=True, text=True, check=True, timeout=60).stdout
        assert nodes.split() == ["node/gpu-node-0"]
    finally:
        assert _run("down", *common) == 0
    assert not folder.exists()
    import time

    deadline = time.monotonic() + 30  # a loaded machine reaps the last children a bit later
    while any(_alive(int(p)) for p in state["pids"].values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [n for n, p in state["pids"].items() if _alive(int(p))]
