"""Uninstall leaves the node as it was (issue 27), over the real client and HTTP: the node
agent as a process on its own service account (deploy/base's RBAC), stopped with SIGTERM,
keeps what it published while its DaemonSet is there (a rolling update, a restart) and takes
exactly that off the node when the DaemonSet is gone or being deleted; ``gpuslice node-agent
--cleanup`` does the API side for nodes whose agent is gone, and with ``--stop-daemonset``
(the Helm chart's pre-delete hook, on the hook's own RBAC) lets the agents do it first."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.mps.fake import write_fake_control
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.cli import main
from gpuslice.services.device_plugin import PluginConfig, wait_for
from gpuslice.services.node_agent import AGENT_LABELS, NodeAgent
from tests.cli.test_stop_signals import spawn, terminate
from tests.kube.helpers import NODE_AGENT, kube_client
from tests.kube.rest_fake import RestApiServer
from tests.nodeagent.test_device_plugin import GPUS, KEY, Kubelet

NS = "gpuslice-system"
DS = "gpuslice-node-agent"
# what the node had before gpuslice: the DaemonSet's selector label (set by the admin or GPU
# feature discovery), an admin's gpuslice.io label, other owners' labels and annotations
BEFORE_LABELS = {"kubernetes.io/hostname": "n1", "team": "ml",
                 "nvidia.com/gpu.present": "true", "gpuslice.io/fake-gpus": "true"}
BEFORE_ANNOTATIONS = {"someone.else/note": "keep me"}
BEFORE_STATUS = {"cpu": "8", "memory": "32Gi", "gpuslice.io/gpu": "8"}  # the kubelet's


def bare_node(name: str = "n1", **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {**BEFORE_LABELS, **labels,
                                                  "kubernetes.io/hostname": name},
                         "annotations": dict(BEFORE_ANNOTATIONS)},
            "status": {"capacity": dict(BEFORE_STATUS), "allocatable": dict(BEFORE_STATUS)}}


def as_before(rest: RestApiServer, name: str = "n1") -> None:
    """The node is exactly as :func:`bare_node` made it."""
    node = rest.get_node(name)
    assert node["metadata"]["labels"] == {**BEFORE_LABELS, "kubernetes.io/hostname": name}
    assert node["metadata"]["annotations"] == BEFORE_ANNOTATIONS
    assert node["status"] == {"capacity": BEFORE_STATUS, "allocatable": BEFORE_STATUS}


def agent_pod(rest: RestApiServer, ds_uid: str) -> None:
    rest.add_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "gpuslice-node-agent-x7k2p", "namespace": NS, "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "DaemonSet", "name": DS, "uid": ds_uid,
            "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"nodeName": "n1", "containers": [{"name": "node-agent", "image": "gpuslice"}]}})


@pytest.fixture
def host(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A short folder (unix sockets) with the kubelet's plugin folder, the MPS pipe root with
    a running (stand-in) daemon for the agent's GPU, its shm folder, and a PATH whose
    nvidia-cuda-mps-control is the stand-in."""
    with tempfile.TemporaryDirectory(prefix="nc-") as d:
        root = Path(d)
        (root / "dp").mkdir()
        (root / "bin").mkdir()
        control = write_fake_control(root / "bin" / "nvidia-cuda-mps-control")
        pipe, shm = root / "mps", root / "mps-shm"
        (pipe / "GPU-nc-0.log").mkdir(parents=True)
        shm.mkdir()
        (shm / "cuda.shm.1234").write_text("x")
        log = root / "mps.log"
        subprocess.run([str(control), "-d"], check=True, env={
            **os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe / "GPU-nc-0")})
        assert (pipe / "GPU-nc-0" / "control").exists()
        (tmp_path / "inv.yaml").write_text("gpus:\n  - {model: T4, uuid: GPU-nc-0}\n")
        (tmp_path / "key").write_text(KEY.decode())
        yield {"root": root, "dp": root / "dp", "pipe": pipe, "shm": shm, "mps_log": log,
               "bin": root / "bin", "files": tmp_path}


def start_agent(rest: RestApiServer, host: dict[str, Path]) -> tuple[Any, Path, Kubelet]:
    files = host["files"]
    kubelet = Kubelet(host["dp"]).start()
    kubeconfig = rest.kubeconfig(files / "agent.kubeconfig", NODE_AGENT)
    proc, log = spawn(files, "node-agent", "--node", "n1", "--key-file", str(files / "key"),
                      "--fake-gpus", str(files / "inv.yaml"), "--socket-dir", str(host["dp"]),
                      "--metrics", "off", "--kubeconfig", str(kubeconfig),
                      "--mps-pipe-dir", str(host["pipe"]), "--mps-shm-dir", str(host["shm"]),
                      POD_NAME="gpuslice-node-agent-x7k2p", POD_NAMESPACE=NS,
                      PATH=f"{host['bin']}{os.pathsep}{os.environ.get('PATH', '')}",
                      FAKE_MPS_LOG=str(host["mps_log"]))
    assert kubelet.registered.wait(20), log.read_text()
    assert wait_for(lambda: "gpuslice.io/gpu-milli" in (
        rest.get_node("n1").get("status") or {}).get("allocatable", {}), 20), log.read_text()
    return proc, log, kubelet


def published(rest: RestApiServer) -> None:
    node = rest.get_node("n1")
    labels, ann = node["metadata"]["labels"], node["metadata"]["annotations"]
    assert labels["nvidia.com/gpu.count"] == "1" and labels["gpuslice.io/gpu-model"] == "T4"
    assert "gpuslice.io/inventory" in ann
    # the labels it added, not those it found with the same value (the DaemonSet's selector)
    owned = set(ann[AGENT_LABELS].split(","))
    assert "nvidia.com/gpu.product" in owned and "nvidia.com/gpu.present" not in owned
    assert node["status"]["capacity"]["gpuslice.io/gpu-milli"] == "1000"
    assert node["status"]["allocatable"]["gpuslice.io/gpu-memory"] == "15360"


def test_the_agent_stopped_while_its_daemonset_exists_keeps_everything(
        rest: RestApiServer, host: dict[str, Path]) -> None:
    """A rolling update or a restarted pod: SIGTERM with the DaemonSet in place."""
    rest.add_node(bare_node())
    ds = rest.add_daemonset({"metadata": {"name": DS, "namespace": NS}, "spec": {}})
    agent_pod(rest, ds["metadata"]["uid"])
    proc, log, kubelet = start_agent(rest, host)
    try:
        published(rest)
        before = rest.get_node("n1")
        text = terminate(proc, log)
    finally:
        kubelet.stop()
    assert f"DaemonSet {NS}/{DS} is still there (a rolling update or a restart): node n1 " \
        "keeps its labels and resources" in text, text
    after = rest.get_node("n1")
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    assert after["metadata"]["annotations"] == before["metadata"]["annotations"]
    assert after["status"] == before["status"]
    # the MPS daemon stays for the pods using it; a restarted agent adopts it
    assert (host["pipe"] / "GPU-nc-0" / "control").exists()
    assert (host["shm"] / "cuda.shm.1234").exists()
    assert not [r for r in rest.requests if r[1] == "PATCH" and r[2].endswith("/status")
                and "json-patch" in r[3]]
    assert rest.denied == []


@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_the_agent_stopped_after_its_daemonset_is_deleted_removes_exactly_its_own(
        rest: RestApiServer, host: dict[str, Path], propagation: str) -> None:
    """helm uninstall / kubectl delete (Background: the DaemonSet is gone when the pods get
    SIGTERM) and --cascade=foreground (it is still there, being deleted)."""
    rest.add_node(bare_node())
    ds = rest.add_daemonset({"metadata": {"name": DS, "namespace": NS}, "spec": {}})
    agent_pod(rest, ds["metadata"]["uid"])
    proc, log, kubelet = start_agent(rest, host)
    try:
        published(rest)
        # the reconfiguration controller's marks on the node go too
        rest.patch_node("n1", {"gpuslice.io/reconfig.GPU-nc-0": "done"},
                        {"gpuslice.io/mig-desired": "{}", "gpuslice.io/cordoned-gpus": ""})
        rest.delete_daemonset(NS, DS, propagation)
        text = terminate(proc, log)
    finally:
        kubelet.stop()
    why = "is gone" if propagation == "Background" else "is being deleted"
    assert f"DaemonSet {NS}/{DS} {why}: uninstalling, removing what gpuslice put on node n1" \
        in text, text
    as_before(rest)  # foreign labels and annotations, the kubelet's resources: untouched
    # the resources went with a JSON patch of the status subresource, as kubectl patch sends it
    [(who, _, path, ctype)] = [r for r in rest.requests if r[1] == "PATCH"
                               and r[2].endswith("/status") and "json-patch" in r[3]]
    assert (who, path, ctype) == (NODE_AGENT, "/api/v1/nodes/n1/status",
                                  "application/json-patch+json")
    # MPS: the daemon quit, its pipe and log folders and the shared memory files are gone
    # (the stand-in logs each call: the health query that found it, the quit, the check)
    assert len(host["mps_log"].read_text().splitlines()) >= 3
    assert not (host["pipe"] / "GPU-nc-0").exists()
    assert not (host["pipe"] / "GPU-nc-0.log").exists()
    assert not (host["pipe"]).exists() and not host["shm"].exists()
    assert "removed the MPS daemons' folders" in text
    assert rest.denied == []


def publish(rest: RestApiServer, folder: Path, name: str) -> None:
    """What an agent publishes on node ``name`` (then it is gone: no uninstall ran)."""
    rest.add_node(bare_node(name))
    with tempfile.TemporaryDirectory(prefix="pub-") as d:
        agent = NodeAgent(PluginConfig(name, Path(d), KEY, replicas=2), FakeNvml(list(GPUS)),
                          kube_client(rest, folder, NODE_AGENT))
        assert agent.publish(), agent.problems
    node = rest.get_node(name)
    assert node["metadata"]["labels"]["gpuslice.io/gpu-model"] == "A100-80GB"
    assert node["status"]["capacity"]["gpuslice.io/gpu-milli"] == "2000"


def test_cleanup_of_one_node_whose_agent_is_gone(
        rest: RestApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    publish(rest, tmp_path, "n1")
    publish(rest, tmp_path, "n2")
    kubeconfig = str(rest.kubeconfig(tmp_path / "admin.kubeconfig", "admin"))
    assert main(["node-agent", "--cleanup", "--node", "n1", "--kubeconfig", kubeconfig]) == 0
    out = capsys.readouterr().out
    assert "n1: removed labels " in out and "gpuslice.io/gpu-model" in out
    assert "; resources gpuslice.io/gpu-memory, gpuslice.io/gpu-milli\n" in out, out
    as_before(rest, "n1")
    assert "gpuslice.io/inventory" in rest.get_node("n2")["metadata"]["annotations"]
    # again: nothing left, and no status patch that would fail on a missing key
    assert main(["node-agent", "--cleanup", "--node", "n1", "--kubeconfig", kubeconfig]) == 0
    assert "n1: nothing left to remove" in capsys.readouterr().out


def test_cleanup_of_all_nodes_touches_only_those_with_an_inventory(
        rest: RestApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    publish(rest, tmp_path, "n1")
    publish(rest, tmp_path, "n2")
    # a GPU node gpuslice never ran on: GPU feature discovery's labels are not gpuslice's
    rest.add_node(bare_node("n3", **{"nvidia.com/gpu.product": "Tesla-T4"}))
    n3 = rest.get_node("n3")
    kubeconfig = str(rest.kubeconfig(tmp_path / "admin.kubeconfig", "admin"))
    assert main(["node-agent", "--cleanup", "--all-nodes", "--kubeconfig", kubeconfig]) == 0
    out = capsys.readouterr().out
    assert "n1: removed" in out and "n2: removed" in out and "n3" not in out, out
    as_before(rest, "n1")
    as_before(rest, "n2")
    assert rest.get_node("n3") == n3
    assert not [r for r in rest.requests if r[1] == "PATCH" and "/nodes/n3" in r[2]]


@pytest.mark.parametrize("argv", [
    ["--cleanup"],  # no node
    ["--cleanup", "--node", "n1", "--all-nodes"],
    ["--all-nodes", "--key-file", "k"],  # only with --cleanup
    ["--cleanup", "--all-nodes", "--stop-daemonset", "no-namespace"],
])
def test_cleanup_refuses_what_it_cannot_do(argv: list[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    (tmp_path / "c.yaml").write_text("nodes: [{metadata: {name: n1}}]\n")
    assert main(["node-agent", *argv, "--fake-cluster", str(tmp_path / "c.yaml")]) == 2


def test_the_helm_pre_delete_hook_lets_the_agents_clean_then_cleans_the_rest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The chart's hook Job's command, on the hook's own ServiceAccount and RBAC as the chart
    renders them: the DaemonSet deleted with foreground propagation (each agent cleans its
    node while its RBAC holds; here the garbage collector's part is played by a thread), then
    the nodes whose agent was not running."""
    from tests.deploy.test_helm_chart import rendered
    from tests.kube.rest_fake import Rbac

    docs = rendered()
    hooks = [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    [job] = [d for d in hooks if d["kind"] == "Job"]
    spec = job["spec"]["template"]["spec"]
    rbac = Rbac()
    for d in hooks:
        rbac.add(d, NS)
    rest = RestApiServer(rbac=rbac).start()
    try:
        publish(rest, tmp_path, "n1")
        rest.add_daemonset({"metadata": {"name": DS, "namespace": NS}, "spec": {}})

        def garbage_collector() -> None:  # the pods go, then the DaemonSet (foreground)
            assert wait_for(lambda: bool(rest.get_daemonset(NS, DS)["metadata"].get(
                "deletionTimestamp")), 20)
            time.sleep(0.3)
            rest.finish_daemonset_deletion(NS, DS)

        gc = threading.Thread(target=garbage_collector, daemon=True)
        gc.start()
        token = f"sa:{NS}:{spec['serviceAccountName']}"
        kubeconfig = str(rest.kubeconfig(tmp_path / "hook.kubeconfig", token))
        args = [a.replace("--stop-wait=150", "--stop-wait=20")
                for a in spec["containers"][0]["args"]]
        assert main([*args, "--kubeconfig", kubeconfig]) == 0
        gc.join(5)
        out = capsys.readouterr().out
        assert "n1: removed" in out, out
        with pytest.raises(Exception, match="not found"):
            rest.get_daemonset(NS, DS)
        as_before(rest, "n1")
        assert rest.denied == []
    finally:
        rest.stop()
