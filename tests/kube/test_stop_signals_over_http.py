"""SIGTERM to the leader-elected components on their own service accounts, against the REST
API: each exits 0 within a few seconds and its Lease is given up on the API server (the
holder cleared), so a standby leads at its next step instead of after the Lease lapses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.services.device_plugin import wait_for
from tests.cli.test_stop_signals import spawn, terminate, wait_for_line
from tests.extender.test_extender_cli import free_port
from tests.kube.rest_fake import DEPLOY, EXAMPLES, Rbac, RestApiServer
from tests.kube.test_dra_allocator import ALLOCATOR, DRA_DEPLOY, claim, cluster, pod

NS = "gpuslice-system"


@pytest.fixture
def rest() -> Iterator[RestApiServer]:
    server = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, DRA_DEPLOY))).start()
    yield server
    server.stop()


def holder(rest: RestApiServer, name: str) -> str | None:
    lease = rest.get_lease(NS, name)
    return None if lease is None else str(lease["spec"].get("holderIdentity") or "")


def test_dra_allocator_logs_what_it_watches_and_releases_its_lease_on_sigterm(
        rest: RestApiServer, tmp_path: Path) -> None:
    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    rest.add_pod(pod("p1", "c1"))
    kubeconfig = rest.kubeconfig(tmp_path / "allocator.kubeconfig", ALLOCATOR)
    proc, log = spawn(tmp_path, "dra-allocator", "--kubeconfig", str(kubeconfig),
                      "--settle=0", "--interval=0.2", POD_NAME="alloc-a")
    wait_for_line(proc, log, "allocated ml/c1 -> n1")
    assert holder(rest, "gpuslice-dra-allocator") == "alloc-a"
    text = terminate(proc, log)
    first = text.splitlines()[0]
    assert "watching ResourceClaims of unbound pods for driver gpu.gpuslice.io" in first, text
    assert "Lease gpuslice-system/gpuslice-dra-allocator as alloc-a" in first, text
    assert ("stopped on SIGTERM: released the Lease gpuslice-system/gpuslice-dra-allocator"
            in text.splitlines()[-1]), text
    assert holder(rest, "gpuslice-dra-allocator") == ""
    assert rest.denied == []


def test_leader_extender_releases_its_lease_on_sigterm(rest: RestApiServer,
                                                       tmp_path: Path) -> None:
    rest.add_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    (tmp_path / "key").write_text("stop-signals-key-0123456789")
    kubeconfig = rest.kubeconfig(tmp_path / "extender.kubeconfig",
                                 "sa:gpuslice-system:gpuslice-extender")
    proc, log = spawn(tmp_path, "extender", "--listen", f"127.0.0.1:{free_port()}",
                      "--key-file", str(tmp_path / "key"), "--leader-elect", "--kubeconfig",
                      str(kubeconfig), "--insecure-no-client-auth", POD_NAME="ext-a")
    wait_for_line(proc, log, "serving on")
    assert wait_for(lambda: holder(rest, "gpuslice-extender") == "ext-a", 20)
    text = terminate(proc, log)
    assert "stopped on SIGTERM: released the Lease gpuslice-system/gpuslice-extender" in text
    assert holder(rest, "gpuslice-extender") == ""
    assert rest.denied == []
