"""The chaos soak (benchmarks/chaos.py) for two minutes on the real control plane: fractional,
MIG, whole-GPU and DRA pods created and deleted while the extender leader, the DRA claim
allocator, node agents and DRA drivers are SIGKILLed, kube-scheduler restarted, kube-apiserver
frozen, and a node's agent killed in the middle of a bind; the independent auditor must find
no violation, and every kind of fault must have happened.

The auditor itself is checked here too, on objects the real API server holds: pods bound
through ``pods/binding`` with a forged assignment and with two signed assignments that
over-book one GPU, and a pod left pending without a reason, are each found (its rules are
tested one by one on hand-written objects in tests/unit/test_chaos_audit.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuslice.adapters.kube.annotation import encode
from gpuslice.core.assignment import (
    ANNOTATION,
    Assignment,
    ContainerAssignment,
    GpuShare,
    Mode,
    sign,
)
from gpuslice.devcluster import DevCluster
from tests.cluster.helpers import ExtenderProcess, Kube, gpu_node, gpu_pod

REPO = Path(__file__).resolve().parents[2]
MINUTES = 2.0


@pytest.mark.timeout(1200)
def test_a_two_minute_chaos_soak_ends_without_a_violation(cluster_bin: Path,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--minutes", str(MINUTES),
         "--seed", "11", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1100, check=False,
        env={**os.environ, "GPUSLICE_CLUSTER_BIN": str(cluster_bin)})
    tail = (res.stdout[-6000:] + "\n--- stderr ---\n" + res.stderr[-4000:])
    lines = res.stdout.strip().splitlines()
    sys.stderr.write("\n[chaos soak, 2 min]\n" + "\n".join(lines[-5:]) + "\n")
    assert lines and re.fullmatch(r"faults (\d+), pods (\d+), violations (\d+)", lines[-1]), tail
    rec = json.loads(out.read_text())
    assert rec["violations"] == [], tail
    assert lines[-1].endswith("violations 0") and res.returncode == 0, tail
    missing = [k for k, n in rec["fault_counts"].items() if n == 0]
    assert not missing, f"faults that did not happen: {missing}\n{tail}"
    pods = rec["pods"]
    assert pods["created"] >= 40 and pods["bound"] >= 20, pods
    # every path was exercised: fractional, MIG, whole and DRA pods were bound
    bound = pods["bound_by_kind"]
    for kind in ("frac", "mig", "whole", "dra-share-25", "dra-whole"):
        assert bound.get(kind, 0) > 0, (kind, bound)
    assert rec["kubelet"]["prepared"] > 0 and rec["kubelet"]["unprepared"] > 0, rec["kubelet"]


def _bind(kube: Kube, ns: str, name: str, node: str, annotation: str | None) -> None:
    """Bind as kube-scheduler or the extender does: a Binding that carries the annotation."""
    meta: dict[str, Any] = {"name": name}
    if annotation is not None:
        meta["annotations"] = {ANNOTATION: annotation}
    kube.core.create_namespaced_binding(ns, {"apiVersion": "v1", "kind": "Binding",
                                             "metadata": meta,
                                             "target": {"kind": "Node", "name": node}},
                                        _preload_content=False)


def _signed(pod: dict[str, Any], node: str, uuid: str, milli: int, key: bytes) -> str:
    meta = pod["metadata"]
    a = Assignment(meta["namespace"], meta["name"], meta["uid"], node, (ContainerAssignment(
        "c0", Mode.MPS, (GpuShare(uuid, milli, 4096),)),), "2026-01-01T00:00:00Z")
    return encode(sign(a, key))


def test_the_auditor_finds_violations_in_what_the_api_server_holds(
        dev: DevCluster, kube: Kube) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from chaos_audit import Auditor
    from chaos_parts import Api

    ns, node, key = "t-chaos-audit", "t-chaos-audit-n0", b"chaos-audit-test-key-0123456789"
    kube.create_namespace(ns)
    try:
        kube.add_nodes([gpu_node(node, ns, "L4", count=1)])
        # pods no scheduler picks: bound below by hand, or left pending without a reason
        names = ("forged", "first", "second", "waiting")
        kube.create(gpu_pod(n, ns, milli=600, memory=4096, scheduler="nobody")
                    for n in names)
        pods = {p["metadata"]["name"]: p for p in kube.pods(ns)}
        uuid = f"GPU-{node}-00"
        _bind(kube, ns, "forged", node, _signed(pods["forged"], node, uuid, 600,
                                                b"someone-elses-key-0123456789abcd"))
        for n in ("first", "second"):  # 600 + 600 milli of one GPU
            _bind(kube, ns, n, node, _signed(pods[n], node, uuid, 600, key))
        auditor = Auditor(Api(dev.server, dev._ssl()), ns, key, dra=False, grace_s=0.0,
                          emit=lambda _: None)
        assert auditor.round() is not None
        found = {(v["rule"], v["object"]) for v in auditor.found.values()}
        assert ("unverified-assignment", f"pod {ns}/forged") in found, found
        assert ("gpu-over-capacity", f"{node}/{uuid}") in found, found
        assert ("pending-without-reason", f"pod {ns}/waiting") in found, found
        over = next(v for v in auditor.found.values() if v["rule"] == "gpu-over-capacity")
        assert "1200 milli of 1000" in over["detail"] and "forged" not in over["detail"]
    finally:
        kube.cleanup_group(ns)


def test_a_pod_waiting_for_a_gpu_is_bound_once_its_holder_is_deleted(
        kube: Kube, extender: ExtenderProcess, group: str) -> None:
    """Finding 3 of the chaos soak (docs/testing.md, "The chaos soak"): kube-scheduler retries
    the waiting pod on the holder's deletion (``AssignedPodDelete``) before the extender's
    watch has applied it, the extender refuses again, and nothing else requeues the pod
    until kube-scheduler's 5-minute flush (``flushUnschedulablePodsLeftover``). A pod an
    extender refused is requeued by any event, an update of the pod itself included
    (``isPodWorthRequeuing`` and ``PriorityQueue.Update`` in
    pkg/scheduler/backend/queue/scheduling_queue.go; the ``Extender`` pseudo-plugin of
    ``findNodesThatFitPod`` in pkg/scheduler/schedule_one.go): the extender's leader writes
    ``extender.gpuslice.io/requeue`` on the waiter once its view frees the GPU
    (services/extender/requeue.py). Without it the waiter is not bound before the flush
    (the bound below is far from both: a loaded machine takes seconds, the flush minutes)."""
    kube.add_nodes([gpu_node(f"{group}-n0", group, "L4", count=1)])
    kube.create([gpu_pod("holder", group)])
    kube.wait_bound(group, 1)
    kube.create([gpu_pod("waiter", group)])

    def refused(pods: list[dict[str, Any]]) -> bool:
        return any(p["metadata"]["name"] == "waiter" and any(
            c.get("type") == "PodScheduled" and c.get("status") == "False"
            for c in (p.get("status") or {}).get("conditions") or []) for p in pods)

    kube.wait_pods(group, "waiter refused (the GPU is held)", refused, 120)
    time.sleep(2.0)  # past the waiter's first backoff, as a pod waiting for a while is
    kube.core.delete_namespaced_pod("holder", group)
    kube.wait_pods(group, "waiter bound within 90 s of the holder's deletion (kube-scheduler "
                   "flushes its unschedulable pods after 5 min)", lambda ps: any(
        p["metadata"]["name"] == "waiter" and p["spec"].get("nodeName") for p in ps), 90)
