"""Pods scheduled by the real kube-scheduler (the gpuslice-scheduler profile from
deploy/base/scheduler-config.yaml) through the gpuslice extender over HTTPS, bound by the
extender through the pods/binding subresource of the real kube-apiserver, on kwok nodes that
carry what the node agent publishes. Each test checks the binding, the signed assignment, and
that no GPU is over-allocated (read back from the API server)."""

from __future__ import annotations

from gpuslice.core.assignment import Mode, verify
from tests.cluster.helpers import (
    EXTENDER_KEY,
    Kube,
    assignment,
    bound,
    gpu_node,
    gpu_pod,
    over_allocation,
)


def _nodes(kube: Kube, group: str) -> list[dict[str, object]]:
    raw = kube.core.list_node(label_selector=f"gpuslice.test/group={group}",
                              _preload_content=False)
    import json

    return list(json.loads(raw.data)["items"])


def test_whole_and_fractional_pods_bind_and_a_pod_that_fits_nowhere_waits_with_reasons(
        kube: Kube, group: str) -> None:
    kube.add_nodes([gpu_node(f"{group}-n{i}", group, "A100-80GB", count=2) for i in range(2)])
    pods = [gpu_pod(f"whole-{i}", group) for i in range(2)]
    pods += [gpu_pod(f"frac-{i}", group, milli=250, memory=8192) for i in range(4)]
    kube.create(pods)
    got = kube.wait_bound(group, 6)
    gpus_of_whole: list[str] = []
    for p in got:
        a = assignment(p)
        assert verify(a, EXTENDER_KEY.encode()), p["metadata"]["name"]
        assert a.node == p["spec"]["nodeName"]
        assert a.pod_uid == p["metadata"]["uid"]
        (c,) = a.containers
        if p["metadata"]["name"].startswith("whole"):
            assert c.mode is Mode.EXCLUSIVE and [g.milli for g in c.gpus] == [1000]
            gpus_of_whole += [g.uuid for g in c.gpus]
        else:
            assert c.mode is Mode.MPS and [(g.milli, g.memory_mib) for g in c.gpus] == \
                [(250, 8192)]
    assert len(set(gpus_of_whole)) == 2
    assert over_allocation(kube.pods(group), _nodes(kube, group)) == []
    # however the six were spread, no node has two whole GPUs free: the pod waits, and the
    # scheduler's event carries the extender's reason per node
    kube.create([gpu_pod("two-whole", group, gpus=2)])
    kube.wait_pods(group, "FailedScheduling for two-whole", lambda _: any(
        "two-whole: FailedScheduling" in e for e in kube.events(group)), 120)
    msg = next(e for e in kube.events(group) if "two-whole: FailedScheduling" in e)
    assert "0/" in msg, msg
    pods = kube.pods(group)
    assert not next(p for p in pods if p["metadata"]["name"] == "two-whole")["spec"].get(
        "nodeName")
    assert over_allocation(pods, _nodes(kube, group)) == []


def test_mig_pods_take_distinct_instances(kube: Kube, group: str) -> None:
    kube.add_nodes([gpu_node(f"{group}-mig", group, "A100-80GB", count=1,
                             mig="3g.40gb@0,3g.40gb@4")])
    kube.create([gpu_pod(f"mig-{i}", group, milli=429, isolation="mig") for i in range(2)])
    got = kube.wait_bound(group, 2)
    shares = [assignment(p).containers[0].gpus[0] for p in got]
    assert all(s.mig_profile == "3g.40gb" for s in shares)
    assert sorted(s.mig_start for s in shares) == [0, 4]
    assert over_allocation(kube.pods(group), _nodes(kube, group)) == []
    kube.create([gpu_pod("mig-2", group, milli=429, isolation="mig")])
    kube.wait_pods(group, "FailedScheduling for mig-2", lambda _: any(
        "mig-2: FailedScheduling" in e for e in kube.events(group)), 120)
    assert len(bound(kube.pods(group))) == 2


def test_a_multi_container_pod_gets_one_assignment_naming_each_gpu_container(
        kube: Kube, group: str) -> None:
    kube.add_nodes([gpu_node(f"{group}-n0", group, "L4", count=1)])
    kube.create([gpu_pod("two-containers", group, milli=300, memory=4096, containers=2)])
    (p,) = kube.wait_bound(group, 1)
    a = assignment(p)
    assert sorted(c.name for c in a.containers) == ["c0", "c1"]
    assert len({g.uuid for c in a.containers for g in c.gpus}) == 1  # one GPU, both on it
    assert over_allocation(kube.pods(group), _nodes(kube, group)) == []


def test_a_multi_container_pod_holds_the_sum_of_its_containers_shares(
        kube: Kube, group: str) -> None:
    """PodRequests sums app containers: 2 x 300 milli hold 600 of the GPU, so of three more
    300-milli pods one fits."""
    kube.add_nodes([gpu_node(f"{group}-n0", group, "L4", count=1)])
    kube.create([gpu_pod("two-containers", group, milli=300, memory=4096, containers=2)])
    kube.wait_bound(group, 1)
    kube.create([gpu_pod(f"more-{i}", group, milli=300, memory=4096) for i in range(3)])
    kube.wait_pods(group, "FailedScheduling for two of more-*", lambda _: sum(
        ": FailedScheduling" in e and "more-" in e for e in kube.events(group)) >= 2, 120)
    # the refusals can be seen before the one that fits is bound (two events may also be one
    # pod retried): wait for its bind, then exactly two are bound
    pods = kube.wait_bound(group, 2, timeout_s=120)
    assert len(bound(pods)) == 2
    held = sum(g.milli for p in bound(pods) for c in assignment(p).containers for g in c.gpus)
    assert held == 900


def test_an_init_container_only_gpu_pod_is_bound_with_its_assignment(
        kube: Kube, group: str) -> None:
    kube.add_nodes([gpu_node(f"{group}-n0", group, "L4", count=1)])
    kube.create([gpu_pod("init-only", group, milli=500, memory=8192, init_gpu=True)])
    (p,) = kube.wait_bound(group, 1, timeout_s=60)
    a = assignment(p)
    assert [c.name for c in a.containers] == ["warmup"]
    assert over_allocation(kube.pods(group), _nodes(kube, group)) == []


def test_a_sidecar_gpu_pod_is_bound_with_its_assignment(kube: Kube, group: str) -> None:
    kube.add_nodes([gpu_node(f"{group}-n0", group, "L4", count=1)])
    kube.create([gpu_pod("sidecar", group, milli=500, memory=8192, sidecar_gpu=True)])
    (p,) = kube.wait_bound(group, 1, timeout_s=60)
    a = assignment(p)
    assert [c.name for c in a.containers] == ["sidecar"]
    assert over_allocation(kube.pods(group), _nodes(kube, group)) == []
