"""Preemption by the real kube-scheduler (its extender preempt call to gpuslice, then victims
chosen against PodDisruptionBudgets), and bursts of 300 pods while the extender or the
kube-apiserver is restarted: every pod that fits is eventually bound, no GPU is ever
over-allocated."""

from __future__ import annotations

import json
import threading
from typing import Any

from gpuslice.devcluster import DevCluster, wait_until
from tests.cluster.helpers import (
    ExtenderProcess,
    Kube,
    bound,
    gpu_node,
    gpu_pod,
    over_allocation,
)


def _nodes(kube: Kube, group: str) -> list[dict[str, Any]]:
    raw = kube.core.list_node(label_selector=f"gpuslice.test/group={group}",
                              _preload_content=False)
    return list(json.loads(raw.data)["items"])


def _events(kube: Kube, group: str) -> str:
    """The namespace's events (Preempted, FailedScheduling, Scheduled), oldest first."""
    raw = kube.core.list_namespaced_event(group, _preload_content=False)
    items = json.loads(raw.data)["items"]
    items.sort(key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return "\n".join(f"{e.get('lastTimestamp') or e.get('eventTime')} "
                     f"{e['involvedObject'].get('name')} {e.get('reason')}: {e.get('message')}"
                     for e in items)


def _priority_classes(dev: DevCluster, group: str) -> None:
    """PriorityClasses ``<group>-high`` (1000) and ``<group>-low`` (10)."""
    dev.apply(f"""
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {{name: {group}-high}}
value: 1000
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {{name: {group}-low}}
value: 10
""")


def test_preemption_takes_victims_where_no_pod_disruption_budget_forbids_it(
        dev: DevCluster, kube: Kube, group: str) -> None:
    _priority_classes(dev, group)
    dev.apply(f"""
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {{name: protected, namespace: {group}}}
spec:
  minAvailable: 2
  selector: {{matchLabels: {{tier: protected}}}}
""")
    kube.add_nodes([gpu_node(f"{group}-a", group, "L4", count=1),
                    gpu_node(f"{group}-b", group, "L4", count=1)])
    low = []
    for node, tier in (("a", "protected"), ("b", "free")):
        for i in range(2):
            p = gpu_pod(f"{tier}-{i}", group, milli=500, memory=8192,
                        priority=f"{group}-low", labels={"tier": tier})
            p["spec"]["nodeSelector"]["kubernetes.io/hostname"] = f"{group}-{node}"
            low.append(p)
    kube.create(low)
    kube.wait_bound(group, 4)
    # the PDB controller has counted the protected pods: no disruption allowed there
    from kubernetes import client as k8s

    policy = k8s.PolicyV1Api(kube.api_client)
    wait_until("PDB status observed", lambda: policy.read_namespaced_pod_disruption_budget(
        "protected", group).status.current_healthy == 2, 120)
    kube.create([gpu_pod("urgent", group, milli=1000, priority=f"{group}-high")])

    def urgent_bound(pods: list[dict[str, Any]]) -> bool:
        return any(p["metadata"]["name"] == "urgent" and p["spec"].get("nodeName")
                   for p in pods)

    pods = kube.wait_pods(group, "urgent bound after preemption", urgent_bound, 150)
    urgent = next(p for p in pods if p["metadata"]["name"] == "urgent")
    live = {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}
    why = _events(kube, group)  # which preemption went where, should one go wrong
    assert urgent["spec"]["nodeName"] == f"{group}-b", why
    assert {"protected-0", "protected-1"} <= live, why
    assert not {"free-0", "free-1"} & live, why
    assert over_allocation(pods, _nodes(kube, group)) == []


def test_a_pod_short_only_of_gpu_memory_preempts_through_the_real_scheduler(
        dev: DevCluster, kube: Kube, group: str) -> None:
    """GPU share is free but GPU memory is not: kube-scheduler counts gpu-memory against the
    node's total (deploy/'s managedResources), so its dry run (SelectVictimsOnNode,
    defaultpreemption/default_preemption.go) finds a victim and offers the node to the
    extender's preempt; with the memory ignored by the scheduler the node would have no
    victim and no candidate ("expected at least one victim pod", preemption.go)."""
    _priority_classes(dev, group)
    kube.add_nodes([gpu_node(f"{group}-a", group, "L4", count=1)])  # 24576 MiB
    kube.create([gpu_pod(f"low-{i}", group, milli=200, memory=10240,
                         priority=f"{group}-low") for i in range(2)])
    kube.wait_bound(group, 2)
    kube.create([gpu_pod("urgent", group, milli=200, memory=10240, priority=f"{group}-high")])

    def urgent_bound(pods: list[dict[str, Any]]) -> bool:
        return any(p["metadata"]["name"] == "urgent" and p["spec"].get("nodeName")
                   for p in pods)

    pods = kube.wait_pods(group, "urgent bound after preemption", urgent_bound, 150)
    live = {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}
    assert len(live & {"low-0", "low-1"}) == 1  # one victim is enough, and only one is taken
    assert over_allocation(pods, _nodes(kube, group)) == []


def _burst(kube: Kube, group: str, count: int, during: Any) -> list[dict[str, Any]]:
    """``count`` half-GPU pods on 20 x 8 GPUs (room for all but a few): ``during()`` runs once a
    third are bound; then every pod that fits must get bound."""
    kube.add_nodes([gpu_node(f"{group}-n{i:02d}", group, "L4", count=8) for i in range(20)])
    pods = [gpu_pod(f"p{i:03d}", group, milli=500, memory=4096) for i in range(count)]
    creator = threading.Thread(target=kube.create, args=(pods,))
    creator.start()
    kube.wait_pods(group, f"{count // 3} bound", lambda ps: len(bound(ps)) >= count // 3, 300)
    during()
    creator.join(300)
    fits = min(count, 20 * 8 * 2)
    got = kube.wait_bound(group, fits, timeout_s=420)
    assert over_allocation(got, _nodes(kube, group)) == []
    return got


def test_extender_killed_in_a_300_pod_burst_loses_and_doubles_nothing(
        kube: Kube, extender: ExtenderProcess, group: str) -> None:
    def restart() -> None:
        extender.kill()
        extender.start()

    got = _burst(kube, group, 300, restart)
    assert len(bound(got)) == 300
    assert extender.starts >= 2


def test_apiserver_restarted_in_a_300_pod_burst_loses_and_doubles_nothing(
        dev: DevCluster, kube: Kube, extender: ExtenderProcess, group: str) -> None:
    got = _burst(kube, group, 300, dev.restart_apiserver)
    assert len(bound(got)) == 300
    assert extender.proc is not None and extender.proc.poll() is None  # it rode it out
