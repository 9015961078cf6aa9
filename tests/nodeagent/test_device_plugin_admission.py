"""Which pod an Allocate executes, when pods come and go: over real gRPC on a unix socket,
with the kubelet's side and the API server fake of test_device_plugin.py.

The kubelet admits one pod at a time and calls Allocate once per container that names the
resource, in the pod's container order (kubelet pkg/kubelet/cm/devicemanager manager.go
Allocate / allocateContainerResources, from the admit handler of HandlePodAdditions): a pod
whose admission stopped half way (deleted, or failed) never gets its other containers."""

from __future__ import annotations

import grpc
import pytest

from gpuslice.adapters.kube.annotation import encode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign
from tests.nodeagent.test_device_plugin import KEY, allocate, assign, env

__all__ = ["env"]  # the fixture, imported for these tests


def two_containers(api: FakeApiServer, pod: str, milli: int) -> None:
    """A pod of two app containers, each an MPS share of ``milli`` of GPU-aaa."""
    res = {"limits": {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": str(milli)}}
    p = api.add_pod({"metadata": {"name": pod, "namespace": "ml"},
                     "spec": {"nodeName": "node-1", "containers": [
                         {"name": "a", "image": "m", "resources": res},
                         {"name": "b", "image": "m", "resources": res}]}})
    a = Assignment("ml", pod, p["metadata"]["uid"], "node-1", tuple(
        ContainerAssignment(c, Mode.MPS, (GpuShare("GPU-aaa", milli, 1000),))
        for c in ("a", "b")), "t1")
    api.patch_pod_annotations("ml", pod, {"gpuslice.io/assignment": encode(sign(a, KEY))},
                              p["metadata"]["resourceVersion"])


def test_a_pod_deleted_half_admitted_does_not_hand_its_containers_to_the_next(env) -> None:  # type: ignore[no-untyped-def]
    kubelet, plugin, _, api, _ = env
    two_containers(api, "two", 200)
    r = allocate(kubelet.stub(), "GPU-aaa::0")
    assert (r.envs["GPUSLICE_ASSIGNMENT"], r.envs["GPUSLICE_CONTAINER"]) == ("ml/two", "a")
    api.delete_pod("ml", "two")  # its second container is never allocated
    assign(api, "next", ["GPU-aaa"], milli=500, mem=4000)
    r = allocate(kubelet.stub(), "GPU-aaa::1")
    assert r.envs["GPUSLICE_ASSIGNMENT"] == "ml/next"
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4000M"
    assert [a.pod for a in plugin.executed()] == ["next"]  # the deleted pod's claim forgotten


def test_a_pod_whose_admission_failed_half_way_gives_way_to_the_next(env) -> None:  # type: ignore[no-untyped-def]
    """The kubelet rejects a pod it cannot admit (UnexpectedAdmissionError: its status
    Failed) and goes on with the next pod on the same GPU."""
    kubelet, _, _, api, _ = env
    two_containers(api, "three", 100)
    assert allocate(kubelet.stub(), "GPU-aaa::0").envs["GPUSLICE_CONTAINER"] == "a"
    assign(api, "next", ["GPU-aaa"], milli=500, mem=4000)
    p = api.get_pod("ml", "three")
    p["status"] = {"phase": "Failed", "reason": "UnexpectedAdmissionError"}
    api.delete_pod("ml", "three")
    api.add_pod(p)
    r = allocate(kubelet.stub(), "GPU-aaa::1")
    assert r.envs["GPUSLICE_ASSIGNMENT"] == "ml/next", dict(r.envs)


def test_a_pod_admitted_next_takes_over_from_one_left_half_way(env) -> None:  # type: ignore[no-untyped-def]
    """The kubelet admits one pod at a time: once the next pod's first container is
    allocated, the pod left half way (its admission ended) gets nothing more, whatever the
    API server says of it yet."""
    kubelet, plugin, _, api, _ = env
    two_containers(api, "half", 100)
    assert allocate(kubelet.stub(), "GPU-aaa::0").envs["GPUSLICE_ASSIGNMENT"] == "ml/half"
    assign(api, "whole", ["GPU-bbb"], milli=1000)  # not on the half pod's GPU: no mistaking
    assert allocate(kubelet.stub(), "GPU-bbb::0").envs["GPUSLICE_ASSIGNMENT"] == "ml/whole"
    assign(api, "next", ["GPU-aaa"], milli=500, mem=4000)
    r = allocate(kubelet.stub(), "GPU-aaa::1")
    assert r.envs["GPUSLICE_ASSIGNMENT"] == "ml/next", dict(r.envs)
    assert [a.pod for a in plugin.executed()] == ["half", "whole", "next"]


def test_a_pod_made_again_under_the_same_name_is_another_pod(env) -> None:  # type: ignore[no-untyped-def]
    """A StatefulSet's pod deleted and made again: the same name, a new UID, a new signed
    assignment; it is executed like any other (a claim is the UID's, not the name's)."""
    kubelet, plugin, _, api, _ = env
    assign(api, "worker-0", ["GPU-aaa"], milli=1000)
    assert allocate(kubelet.stub(), "GPU-aaa::0").envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaa"
    api.delete_pod("ml", "worker-0")
    again = api.add_pod({"metadata": {"name": "worker-0", "namespace": "ml", "uid": "uid-2"},
                         "spec": {"nodeName": "node-1",
                                  "containers": [{"name": "main", "image": "m"}]}})
    a = Assignment("ml", "worker-0", "uid-2", "node-1", (ContainerAssignment(
        "main", Mode.EXCLUSIVE, (GpuShare("GPU-bbb", 1000, 0),)),), "t2")
    api.patch_pod_annotations("ml", "worker-0", {"gpuslice.io/assignment": encode(sign(a, KEY))},
                              again["metadata"]["resourceVersion"])
    r = allocate(kubelet.stub(), "GPU-bbb::0")
    assert (r.envs["GPUSLICE_ASSIGNMENT"], r.envs["NVIDIA_VISIBLE_DEVICES"]) == (
        "ml/worker-0", "GPU-bbb")
    assert len(plugin.executed()) == 1  # the first incarnation's claim was forgotten


def test_an_assignment_copied_onto_another_pod_is_not_executed(env) -> None:  # type: ignore[no-untyped-def]
    """A user who can create pods copies a running pod's signed annotation onto a pod bound
    to the node: the MAC verifies, but it names another pod (namespace, name, UID)."""
    kubelet, plugin, _, api, _ = env
    assign(api, "victim", ["GPU-aaa"], milli=1000)
    text = api.get_pod("ml", "victim")["metadata"]["annotations"]["gpuslice.io/assignment"]
    p = api.get_pod("ml", "victim")
    p["status"] = {"phase": "Running"}  # the victim runs: not waiting for devices
    api.delete_pod("ml", "victim")
    api.add_pod(p)
    intruder = api.add_pod({"metadata": {"name": "intruder", "namespace": "ml"},
                            "spec": {"nodeName": "node-1",
                                     "containers": [{"name": "main", "image": "m"}]}})
    api.patch_pod_annotations("ml", "intruder", {"gpuslice.io/assignment": text},
                              intruder["metadata"]["resourceVersion"])
    with pytest.raises(grpc.RpcError) as exc:
        allocate(kubelet.stub(), "GPU-aaa::0")
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert plugin.executed() == []
    assert any("intruder: carries the assignment of ml/victim" in p for p in plugin.problems)


@pytest.mark.parametrize("break_it", [
    lambda p: p["metadata"].__setitem__("annotations", ["x"]),
    lambda p: p.__setitem__("status", "Pending"),
    lambda p: p["spec"].__setitem__("containers", 3),
    lambda p: p["spec"]["containers"][0].__setitem__("resources", {"limits": 5}),
    lambda p: p["metadata"].__setitem__("resourceVersion", "9" * 5000),
], ids=["annotations-list", "status-string", "containers-int", "limits-int", "huge-rv"])
def test_a_malformed_pod_on_the_node_does_not_block_the_others(env, break_it) -> None:  # type: ignore[no-untyped-def]
    kubelet, plugin, _, api, _ = env
    assign(api, "bad", ["GPU-bbb"], milli=1000)
    p = api.get_pod("ml", "bad")
    break_it(p)
    api.delete_pod("ml", "bad")
    api.add_pod(p)
    assign(api, "good", ["GPU-aaa"], milli=1000)
    r = allocate(kubelet.stub(), "GPU-aaa::0")
    assert r.envs["GPUSLICE_ASSIGNMENT"] == "ml/good"
    if isinstance(p.get("status"), str):  # a status that is not an object: passed over, noted
        assert any("ml/bad: passed over" in x for x in plugin.problems), plugin.problems
