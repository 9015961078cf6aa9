"""``gpuslice dev-cluster up --real-node`` / ``down`` as a user runs them: a fractional pod on
the real node gets its MPS caps, and after ``down`` the host is as it was (processes, mounts,
cgroups, iptables, sysctls, the CNI bridge, files: :func:`gpuslice.devcluster.host.diff`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


GUIDE = REPO / "deploy" / "README.md"
FAKE_GPUS_JSON = '"gpus: [{model: L4}, {model: L4}]"'


def test_the_guides_try_it_on_this_machine_runs_the_example_to_its_caps(
        node_bins: tuple[Path, Path], image: dict[str, str], helm: str,
        tmp_path: Path) -> None:
    """deploy/README.md's "Try it on this machine", its commands as written: a bare dev
    cluster with a real node (pod networking, nothing of gpuslice), the image imported with
    ctr --address, the chart installed on two stand-in L4s, the local example running with
    its caps (env and what the stand-in MPS daemon holds it to), an upgrade that keeps the
    example's pods, an uninstall, and the host as it was after down."""
    bin_dir, node_dir = node_bins
    guide = GUIDE.read_text()
    for said in ("gpuslice dev-cluster up --bare --real-node --nodes 0",
                 "--address /run/gpuslice-node/containerd.sock",
                 "kubectl label node gpuslice-real-node nvidia.com/gpu.present=true",
                 "--set scheduler.image=localhost/kube-scheduler:v1.36.3",
                 f"--set-json nodeAgent.fakeGpus='{FAKE_GPUS_JSON}'",
                 "kubectl apply -f deploy/examples/try-locally.yaml",
                 "--reuse-values --wait", "helm uninstall gpuslice -n gpuslice-system --wait"):
        assert said in guide, said
    before = host.snapshot()
    folder = tmp_path / "dc"
    env = {**os.environ, "GPUSLICE_CLUSTER_BIN": str(bin_dir), "GPUSLICE_NODE_DIR": str(node_dir)}

    def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                             cwd=REPO, env=env, check=False)
        assert res.returncode == 0, f"{' '.join(argv)}:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
        return res

    up = run(sys.executable, "-m", "gpuslice.cli", "dev-cluster", "up", "--dir", str(folder),
             "--bare", "--real-node", "--nodes", "0", timeout=600)
    try:
        assert "bare: no gpuslice installed" in up.stdout, up.stdout
        [line] = [x for x in up.stdout.splitlines() if x.startswith("export KUBECONFIG=")]
        env["KUBECONFIG"] = line.split("=", 1)[1].strip()
        kubectl = f"{bin_dir}/kubectl"
        pods = json.loads(run(kubectl, "get", "pods", "-A", "-o", "json").stdout)["items"]
        assert not [p for p in pods if "gpuslice" in p["metadata"]["namespace"]]  # bare
        run(f"{node_dir}/bin/ctr", "--address", str(SOCKET), "-n", "k8s.io", "images",
            "import", image["archive"])
        run(kubectl, "label", "node", NODE_NAME, "nvidia.com/gpu.present=true")
        key = "0123456789abcdef" * 4
        run(helm, "install", "gpuslice", "deploy/helm/gpuslice", "-n", "gpuslice-system",
            "--create-namespace", "--wait", "--timeout", "5m", "--set", "image.digest=",
            "--set", "assignmentKey.create=true", "--set", f"assignmentKey.value={key}",
            "--set", "scheduler.image=localhost/kube-scheduler:v1.36.3",
            "--set-json", f"nodeAgent.fakeGpus={FAKE_GPUS_JSON}", timeout=400)
        run(kubectl, "apply", "-f", "deploy/examples/try-locally.yaml")
        run(kubectl, "rollout", "status", "deploy/try-fractional", "--timeout=180s",
            timeout=200)
        logs = ""
        for _ in range(60):
            logs = run(kubectl, "logs", "deploy/try-fractional").stdout
            if "mps client:" in logs:
                break
            time.sleep(1)
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in logs, logs
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M" in logs, logs
        held = json.loads(logs.split("mps client: ", 1)[1].splitlines()[0])
        assert (held["pct"], held["mem_mib"]) == (25.0, 8192), held  # the daemon's answer
        uids = run(kubectl, "get", "pods", "-l", "app=try-fractional", "-o",
                   "jsonpath={.items[*].metadata.uid}").stdout.split()
        run(helm, "upgrade", "gpuslice", "deploy/helm/gpuslice", "-n", "gpuslice-system",
            "--reuse-values", "--wait", "--timeout", "5m", timeout=400)
        after = json.loads(run(kubectl, "get", "pods", "-l", "app=try-fractional", "-o",
                               "json").stdout)["items"]
        assert sorted(p["metadata"]["uid"] for p in after) == sorted(uids)
        assert all(c.get("restartCount", 0) == 0 for p in after
                   for c in p["status"]["containerStatuses"])
        run(kubectl, "delete", "-f", "deploy/examples/try-locally.yaml", "--wait=true",
            timeout=150)
        run(helm, "uninstall", "gpuslice", "-n", "gpuslice-system", "--wait", "--timeout",
            "120s", timeout=200)
        node = json.loads(run(kubectl, "get", "node", NODE_NAME, "-o", "json").stdout)
        assert "gpuslice.io/inventory" not in (node["metadata"].get("annotations") or {})
        assert "gpuslice.io/gpu-milli" not in node["status"]["allocatable"]
    finally:
        down = subprocess.run([sys.executable, "-m", "gpuslice.cli", "dev-cluster", "down",
                               "--dir", str(folder)], capture_output=True, text=True,
                              timeout=300, cwd=REPO, env=env, check=False)
    assert down.returncode == 0, down.stdout + down.stderr
    assert host.diff(before) == []
