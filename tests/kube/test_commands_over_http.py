"""`gpuslice node-agent` and two `gpuslice extender --leader-elect` replicas as processes, as
deploy/ runs them, on their own service accounts' kubeconfigs against kube-apiserver's REST
API over HTTP (tests/kube/rest_fake.py), with a kubelet-side gRPC driver and scheduler-shaped
HTTP calls."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube.annotation import decode
from gpuslice.core.assignment import ANNOTATION
from gpuslice.services.device_plugin import wait_for
from tests.extender.test_extender_cli import free_port
from tests.kube.helpers import post_json as post
from tests.kube.rest_fake import RestApiServer
from tests.nodeagent.test_device_plugin import Kubelet, allocate

pytestmark = pytest.mark.slow
KEY = "commands-over-http-key-0123456789"
LEASE = "gpuslice-system/gpuslice-extender"


def test_node_agent_and_leader_elected_extenders_as_deployed(rest: RestApiServer,
                                                            tmp_path: Path) -> None:
    rest.add_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    pod = rest.add_pod({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p1", "namespace": "ml"},
        "spec": {"schedulerName": "gpuslice-scheduler", "containers": [{
            "name": "server", "image": "registry.local/model:1", "resources": {"limits": {
                "gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "400",
                "gpuslice.io/gpu-memory": "6000"}}}]}})
    (tmp_path / "key").write_text(KEY)
    (tmp_path / "inv.yaml").write_text("gpus:\n  - model: T4\n  - model: T4\n")
    procs: list[subprocess.Popen[bytes]] = []

    def run(*args: str, token: str, **env: str) -> None:
        account = token.rsplit(":", maxsplit=1)[-1]
        kubeconfig = rest.kubeconfig(tmp_path / f"{account}.kubeconfig", token)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", *args, "--kubeconfig", str(kubeconfig)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **env}))

    ports = [free_port(), free_port()]
    with tempfile.TemporaryDirectory(prefix="cmd-") as d:
        kubelet = Kubelet(Path(d)).start()
        try:
            # the extenders start first: the node's GPUs reach them through the node watch
            for name, port in zip(("ext-a", "ext-b"), ports, strict=True):
                run("extender", "--listen", f"127.0.0.1:{port}", "--key-file",
                    str(tmp_path / "key"), "--leader-elect", "--lease", LEASE,
                    "--insecure-no-client-auth",
                    token="sa:gpuslice-system:gpuslice-extender", POD_NAME=name)
            assert wait_for(lambda: rest.get_lease(*LEASE.split("/")) is not None, 30)
            time.sleep(1.0)
            run("node-agent", "--node", "n1", "--key-file", str(tmp_path / "key"), "--fake-gpus",
                str(tmp_path / "inv.yaml"), "--socket-dir", d, "--replicas", "4",
                "--metrics", "off", "--no-mps", "--pod-resources-socket", "off",
                token="sa:gpuslice-system:gpuslice-node-agent")  # no kubelet's PodResources here
            assert kubelet.registered.wait(30)
            labels = rest.get_node("n1")["metadata"].get("labels") or {}
            assert wait_for(lambda: (rest.get_node("n1")["metadata"].get("labels") or {})
                            .get("nvidia.com/gpu.count") == "2", 10), labels
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            for url in urls:  # both replicas answer filter, from their own watch
                assert wait_for(lambda u=url: post(u + "/filter", {  # type: ignore[misc]
                    "Pod": rest.get_pod("ml", "p1"), "NodeNames": ["n1"]})["NodeNames"]
                    == ["n1"], 20)
            lease = rest.get_lease(*LEASE.split("/"))
            assert lease is not None
            holder = lease["spec"]["holderIdentity"]
            leader, standby = (urls if holder == "ext-a" else urls[::-1])
            bind = {"PodName": "p1", "PodNamespace": "ml", "PodUID": pod["metadata"]["uid"],
                    "Node": "n1"}
            assert "not the leader" in post(standby + "/bind", bind)["Error"]
            assert post(leader + "/bind", bind)["Error"] == ""
            bound = rest.get_pod("ml", "p1")
            assert bound["spec"]["nodeName"] == "n1"
            a = decode(bound["metadata"]["annotations"][ANNOTATION])
            [share] = a.containers[0].gpus
            assert (share.milli, share.memory_mib) == (400, 6000)
            # the kubelet admits it: Allocate finds the assignment through the API server
            resp = allocate(kubelet.stub(), f"{share.uuid}::0")
            assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == share.uuid
        finally:
            for p in procs:
                p.terminate()
            outs = []
            for p in procs:
                try:
                    out, _ = p.communicate(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, _ = p.communicate()
                outs.append(out.decode(errors="replace"))
            kubelet.stop()
    assert rest.denied == [], outs


def test_mig_apply_reports_progress_as_node_labels_through_the_client(
        rest: RestApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from gpuslice.cli import main
    from tests.nodeagent.test_mig_executor import CONFIG

    rest.add_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    (tmp_path / "inv.yaml").write_text('gpus:\n  - model: H100-SXM\n    mig: "7g.80gb@0"\n')
    (tmp_path / "mp.yaml").write_text(yaml.safe_dump(CONFIG))
    kubeconfig = rest.kubeconfig(tmp_path / "agent.kubeconfig",
                                 "sa:gpuslice-system:gpuslice-node-agent")
    assert main(["mig-apply", str(tmp_path / "mp.yaml"), "--config", "all-1g.10gb", "--fake-gpus",
                 str(tmp_path / "inv.yaml"), "--node", "n1", "--kubeconfig",
                 str(kubeconfig)]) == 0
    assert "state: success" in capsys.readouterr().out
    labels = rest.get_node("n1")["metadata"]["labels"]
    assert labels["nvidia.com/mig.config"] == "all-1g.10gb"
    assert labels["nvidia.com/mig.config.state"] == "success"
    assert rest.denied == []
