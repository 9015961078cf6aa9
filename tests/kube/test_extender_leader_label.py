"""Two `gpuslice extender --leader-elect` replicas as processes, as deploy/ runs them (their pod
named by the downward API's POD_NAME and POD_NAMESPACE, the extender's service account), against
kube-apiserver's REST API (tests/kube/rest_fake.py): both are Ready, the leader labels its own pod
with the label deploy/'s Service selects and the follower's pod carries none (a stale one from a
previous container is taken off); a leader stopped with SIGTERM takes its label off and the
follower labels its own pod, so the Service's one endpoint is always the replica that binds."""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.services.device_plugin import wait_for
from gpuslice.services.extender import LEADER_LABEL
from tests.cli.test_stop_signals import spawn, terminate, wait_for_line
from tests.extender.test_extender_cli import free_port
from tests.kube.helpers import EXTENDER
from tests.kube.rest_fake import DEPLOY, RestApiServer

NS = "gpuslice-system"
LEASE = "gpuslice-extender"


def service_selector() -> dict[str, str]:
    """The selector of deploy/base's extender Service."""
    docs = yaml.safe_load_all((DEPLOY / "extender.yaml").read_text())
    svc = next(d for d in docs if d and d["kind"] == "Service")
    return dict(svc["spec"]["selector"])


def endpoints(rest: RestApiServer) -> list[str]:
    """The pods the Service selects (the endpoints controller's choice, all pods Ready)."""
    sel = service_selector()
    return sorted(p["metadata"]["name"] for p in rest.list_pods()
                  if p["metadata"].get("namespace") == NS
                  and sel.items() <= (p["metadata"].get("labels") or {}).items())


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def holder(rest: RestApiServer) -> str | None:
    lease = rest.get_lease(NS, LEASE)
    return None if lease is None else str(lease["spec"].get("holderIdentity") or "")


@pytest.fixture
def replicas(rest: RestApiServer, tmp_path: Path
             ) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], Path, int]]]:
    rest.add_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    (tmp_path / "key").write_text("leader-label-key-0123456789")
    kubeconfig = rest.kubeconfig(tmp_path / "extender.kubeconfig", EXTENDER)
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, int]] = {}
    for name in ("ext-a", "ext-b"):
        # each pod still carries the label of a previous container's leadership
        rest.add_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": NS,
            "labels": {"app.kubernetes.io/name": "gpuslice-extender", LEADER_LABEL: "leader"}},
            "spec": {"containers": [{"name": "extender", "image": "gpuslice"}]}})
        port = free_port()
        proc, log = spawn(tmp_path, "extender", "--listen", f"127.0.0.1:{port}", "--key-file",
                          str(tmp_path / "key"), "--leader-elect", "--lease", f"{NS}/{LEASE}",
                          "--kubeconfig", str(kubeconfig), "--insecure-no-client-auth",
                          POD_NAME=name, POD_NAMESPACE=NS)
        procs[name] = (proc, log, port)
    try:
        for proc, log, _ in procs.values():
            wait_for_line(proc, log, "serving on")
        yield procs
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_the_leader_labels_its_pod_for_the_service_and_hands_the_label_over_on_sigterm(
        rest: RestApiServer, replicas: dict[str, tuple[subprocess.Popen[bytes], Path, int]]
        ) -> None:
    assert service_selector() == {"app.kubernetes.io/name": "gpuslice-extender",
                                  LEADER_LABEL: "leader"}
    assert wait_for(lambda: holder(rest) in replicas, 20)
    leader = str(holder(rest))
    (follower,) = set(replicas) - {leader}
    # the follower took its stale label off: the Service's one endpoint is the leader
    assert wait_for(lambda: endpoints(rest) == [leader], 10), endpoints(rest)
    # both Ready: readiness is health, not leadership (the Deployment shows 2/2)
    assert readyz(replicas[leader][2]) == (200, "ok: leader")
    status, text = readyz(replicas[follower][2])
    assert status == 200 and text.startswith("ok: follower"), text
    # the label is written as a JSON merge patch of the pod, on the extender's own account
    patches = [(who, ctype) for who, verb, path, ctype in rest.requests
               if verb == "PATCH" and path.startswith(f"/api/v1/namespaces/{NS}/pods/")]
    assert patches and set(patches) == {(EXTENDER, "application/strategic-merge-patch+json")}

    proc, log, _ = replicas[leader]
    text = terminate(proc, log)
    assert f"stopped on SIGTERM: released the Lease {NS}/{LEASE}" in text, text
    labels: dict[str, Any] = rest.get_pod(NS, leader)["metadata"].get("labels") or {}
    assert LEADER_LABEL not in labels, labels  # off before the process ended
    # the follower leads at its next step (5 s with deploy/'s 15 s Lease) and labels itself
    assert wait_for(lambda: holder(rest) == follower, 10)
    assert wait_for(lambda: endpoints(rest) == [follower], 10), endpoints(rest)
    assert readyz(replicas[follower][2]) == (200, "ok: leader")
    proc, log, _ = replicas[follower]
    terminate(proc, log)
    assert endpoints(rest) == []
    assert rest.denied == []
