"""``gpuslice dev-cluster up --real-node`` / ``down`` as a user runs them: a fractional pod on
the real node gets its MPS caps, and after ``down`` the host is as it was (processes, mounts,
cgroups, iptables, sysctls, the CNI bridge, files: :func:`gpuslice.devcluster.host.diff`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpuslice.devcluster import host
from gpuslice.devcluster.realnode import NODE_NAME, SOCKET, _pids_of
from tests.node.helpers import END, Report, busybox_pod

REPO = Path(__file__).resolve().parents[2]


def test_up_real_node_runs_a_fractional_pod_and_down_restores_the_host(
        node_bins: tuple[Path, Path], tmp_path: Path) -> None:
    bin_dir, node_dir = node_bins
    before = host.snapshot()
    folder = tmp_path / "dc"
    env = {**os.environ, "GPUSLICE_CLUSTER_BIN": str(bin_dir), "GPUSLICE_NODE_DIR": str(node_dir)}
    up = subprocess.run([sys.executable, "-m", "gpuslice.cli", "dev-cluster", "up", "--dir",
                         str(folder), "--real-node", "--nodes", "1", "--gpus", "2"],
                        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
                        check=False)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "real node" in up.stdout and "export KUBECONFIG=" in up.stdout
        state = json.loads((folder / "state.json").read_text())
        kubectl = [f"{bin_dir}/kubectl", f"--kubeconfig={state['kubeconfig']}"]
        pod = busybox_pod("cli-frac", milli=250, memory=8000)
        subprocess.run([*kubectl, "create", "-f", "-"], input=json.dumps(pod), text=True,
                       check=True, capture_output=True, timeout=60)
        subprocess.run([*kubectl, "wait", "--for=condition=Ready", "pod/cli-frac",
                        "--timeout=120s"], check=True, capture_output=True, timeout=150)
        logs = ""
        for _ in range(60):
            logs = subprocess.run([*kubectl, "logs", "cli-frac"], capture_output=True,
                                  text=True, timeout=30, check=False).stdout
            if END in logs:
                break
        r = Report(logs)
        assert r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", logs
        assert r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8000M"
        nodes = subprocess.run([*kubectl, "get", "nodes", "-o", "name"], capture_output=True,
                               text=True, check=True, timeout=30).stdout.split()
        assert f"node/{NODE_NAME}" in nodes and "node/gpu-node-0" in nodes
    finally:
        down = subprocess.run([sys.executable, "-m", "gpuslice.cli", "dev-cluster", "down",
                               "--dir", str(folder)], capture_output=True, text=True,
                              timeout=300, cwd=REPO, env=env, check=False)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "host restored" in down.stdout, down.stdout
    assert host.diff(before) == []
    assert not SOCKET.exists() and not folder.exists()
    assert _pids_of(f"{node_dir}/bin/containerd") == []
    assert _pids_of(f"{node_dir}/bin/kubelet") == []
