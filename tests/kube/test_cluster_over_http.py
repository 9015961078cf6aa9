"""The cluster's components on the official Kubernetes client, each with its own service
account and the deployment's RBAC, against kube-apiserver's REST API over HTTP: node agents
publish inventory and answer Allocate, the extender follows the watch and binds through the
pods/binding subresource, the reconfiguration controller moves GPUs to another MIG layout."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube.client import KubeClient
from gpuslice.core.assignment import ANNOTATION
from gpuslice.services.reconfig import PLURAL, ReconfigController
from tests.kube.helpers import kube_client
from tests.kube.rest_fake import RestApiServer
from tests.reconfig.harness import BATCH, cluster, schedule
from tests.reconfig.test_reconfig import consistent, drive

pytestmark = pytest.mark.slow


def test_schedule_admit_and_reconfigure_through_the_kubernetes_client(
        rest: RestApiServer, tmp_path: Path) -> None:
    def client(component: str) -> KubeClient:
        return kube_client(rest, tmp_path, f"sa:gpuslice-system:gpuslice-{component}")

    with cluster(tmp_path / "c", nodes=2, gpus=2, replicas=4, api=rest, clients=client) as c:
        pods = rest.list_pods()
        assert len(pods) == 8 and all(p["spec"].get("nodeName") for p in pods)
        assert all(ANNOTATION in p["metadata"]["annotations"] for p in pods)
        who = {(w.split(":")[-1], verb, path.split("/")[-1]) for w, verb, path, _ in rest.requests}
        assert ("gpuslice-extender", "POST", "binding") in who  # pods/{name}/binding
        assert ("gpuslice-node-agent", "PATCH", "n0") in who  # inventory and labels
        assert ("gpuslice-node-agent", "PATCH", "status") in who  # the node's gpu-milli total
        assert ("gpuslice-node-agent", "GET", "pods") in who  # Allocate's lookup
        # the reconfiguration controller on its own account: 7 x 1g -> 1 x 7g on every GPU
        rest.replace_custom(PLURAL, schedule(override="batch"))
        ctl = ReconfigController(client("reconfig"))
        drive(ctl, c, lambda st: (st.get("summary") or {}).get("inTarget") == 4, timeout_s=90)
        consistent(c, BATCH, 4)
    assert rest.denied == []
    calls = {(w.split(":")[-1], verb, path.split("/")[-1]) for w, verb, path, _ in rest.requests}
    # replacements created (schema-checked), old pods evicted, status written, nodes cordoned
    assert {("gpuslice-reconfig", "POST", "pods"), ("gpuslice-reconfig", "POST", "eviction"),
            ("gpuslice-reconfig", "PUT", "status"), ("gpuslice-reconfig", "PATCH", "n0")} <= calls
