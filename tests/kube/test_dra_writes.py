"""The claim allocator's writes (services.dra_writes, issue 58), over HTTP to the REST fake:
the pod reserved with the allocation, and the finalizer put on a new claim early, before its
pod is known, so that the pod waits for one write. kube-scheduler's and
kube-controller-manager's side of both is proven on the real control plane
(tests/cluster/test_dra_gate.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice.adapters.kube import dra as kdra
from tests.kube.rest_fake import DEPLOY, EXAMPLES, Rbac, RestApiServer
from tests.kube.test_dra_allocator import (
    ALLOCATOR,
    DRA_DEPLOY,
    allocator,
    claim,
    cluster,
    pod,
)

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims"
RBAC = (DEPLOY, EXAMPLES, DRA_DEPLOY)  # the allocator's own RBAC allows every write here


@pytest.fixture
def rest() -> Iterator[RestApiServer]:
    server = RestApiServer(rbac=Rbac(RBAC)).start()
    yield server
    server.stop()


def _puts(rest: RestApiServer, since: int = 0) -> list[str]:
    return [path for who, verb, path, _ in rest.requests[since:]
            if verb == "PUT" and who == ALLOCATOR and "/resourceclaims/" in path]


def _finalized(rest: RestApiServer, name: str, within_s: float = 5.0) -> bool:
    """Whether claim ``name`` carries the finalizer (waiting up to ``within_s`` for the early
    write, which runs on a writer beside the pass)."""
    deadline = time.monotonic() + within_s
    while True:
        got = rest.get_resource_claim("ml", name)
        if kdra.FINALIZER in (got["metadata"].get("finalizers") or []):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_a_new_claim_gets_the_finalizer_before_its_pod_comes(rest: RestApiServer,
                                                             tmp_path: Path) -> None:
    """A claim created before its pod: the pass that first sees it puts the finalizer on; the
    pass that sees the pod writes only the allocation, the pod reserved in it."""
    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    alloc = allocator(rest, tmp_path)
    try:
        assert alloc.run_once().allocated == {}
        assert _finalized(rest, "c1")
        assert not (rest.get_resource_claim("ml", "c1").get("status") or {}).get("allocation")
        assert _puts(rest) == [f"{CLAIMS}/c1"]
        since = len(rest.requests)
        rest.add_pod(pod("p1", "c1"))
        report = alloc.run_once()
        assert list(report.allocated) == ["ml/c1"], report
        assert _puts(rest, since) == [f"{CLAIMS}/c1/status"]  # one write, not two
        got = rest.get_resource_claim("ml", "c1")
        assert [r["name"] for r in got["status"]["reservedFor"]] == ["p1"]
        assert alloc.writes.early_written == 1
    finally:
        alloc.close()


def test_without_writers_beside_the_pass_nothing_is_written_early(rest: RestApiServer,
                                                                  tmp_path: Path) -> None:
    cluster(rest)
    rest.add_resourceclaim(claim("c1", 50))
    alloc = allocator(rest, tmp_path, writers=1)
    alloc.run_once()
    assert not _finalized(rest, "c1", within_s=0.2)
    rest.add_pod(pod("p1", "c1"))
    alloc.run_once()
    assert _puts(rest) == [f"{CLAIMS}/c1", f"{CLAIMS}/c1/status"]


def test_allocated_foreign_and_deleted_claims_get_no_early_write(rest: RestApiServer,
                                                                 tmp_path: Path) -> None:
    """Only claims of ours that nobody allocated and nobody is deleting are written early."""
    cluster(rest)
    rest.add_resourceclaim(claim("done", 50, allocation={"devices": {"results": [
        {"request": "gpu", "driver": kdra.DRIVER, "pool": "n1", "device": "gpu-0",
         "consumedCapacity": {"compute": "50"}}]}}))
    foreign = claim("foreign", 50)
    foreign["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
    rest.add_resourceclaim(foreign)
    going = claim("going", 50)
    going["metadata"].update(deletionTimestamp="2026-12-05T00:00:00Z",
                             finalizers=["example.com/keep"])
    rest.add_resourceclaim(going)
    alloc = allocator(rest, tmp_path)
    try:
        alloc.run_once()
        time.sleep(0.2)
        assert _puts(rest) == [] and alloc.writes.early_written == 0
    finally:
        alloc.close()


class RefusingServer(RestApiServer):
    """Someone else changes a claim just before the allocator's first update of it lands: the
    early finalizer's write meets a conflict."""

    raced = False

    def update_resource_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        if not self.raced:
            self.raced = True
            cur = self.get_resource_claim(claim["metadata"]["namespace"],
                                          claim["metadata"]["name"])
            cur["metadata"].setdefault("labels", {})["team"] = "a"
            super().update_resource_claim(cur)
        return super().update_resource_claim(claim)


def test_an_early_write_refused_leaves_the_finalizer_to_the_claims_own_write(
        tmp_path: Path) -> None:
    rest = RefusingServer(rbac=Rbac(RBAC)).start()
    try:
        cluster(rest)
        rest.add_resourceclaim(claim("c1", 50))
        alloc = allocator(rest, tmp_path)
        try:
            alloc.run_once()
            assert not _finalized(rest, "c1", within_s=0.3)
            rest.add_pod(pod("p1", "c1"))
            assert list(alloc.run_once().allocated) == ["ml/c1"]
            got = rest.get_resource_claim("ml", "c1")
            assert kdra.FINALIZER in got["metadata"]["finalizers"]
            assert got["metadata"]["labels"] == {"team": "a"} and got["status"]["allocation"]
            assert alloc.writes.early_written == 0
        finally:
            alloc.close()
    finally:
        rest.stop()
