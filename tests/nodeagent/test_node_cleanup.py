"""What the node agent owns on its node and what an uninstall takes off it (issue 27), in
memory: the labels it records as its own, the cleanup plan, the uninstall verdict, the JSON
patch it sends, and the MPS folders it removes."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuslice.adapters.kube.fake import (
    ApiInvalid,
    FakeApiServer,
    apply_json_patch,
    json_pointer,
)
from gpuslice.adapters.mps.fake import write_fake_control
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.devices import GpuDevice
from gpuslice.services.device_plugin import PluginConfig
from gpuslice.services.node_agent import AGENT_LABELS, NodeAgent, labels_to_publish
from gpuslice.services.node_cleanup import (
    NodeCleanup,
    clean_node,
    cleanup_plan,
    uninstall_verdict,
)

KEY = b"node-cleanup-key-0123456789"
GPU = GpuDevice(0, "GPU-aaa", "NVIDIA A100-80GB", "A100-80GB", 81920,
                compute_capability=(8, 0))


@pytest.mark.parametrize(("wanted", "on_node", "recorded", "patch", "owned"), [
    # a fresh node: every label is the agent's
    ({"a": "1", "b": "2"}, {}, set(), {"a": "1", "b": "2"}, {"a", "b"}),
    # found with the same value (the DaemonSet's selector label) or another: someone else's
    ({"a": "1", "b": "2"}, {"a": "1", "b": "9"}, set(), {"a": "1", "b": "2"}, set()),
    # recorded: the agent's, whatever the node had
    ({"a": "1"}, {"a": "1"}, {"a"}, {"a": "1"}, {"a"}),
    # recorded and no longer wanted (a MIG profile gone): removed
    ({"a": "1"}, {}, {"a", "mig-1g.10gb.count"}, {"a": "1", "mig-1g.10gb.count": None}, {"a"}),
])
def test_the_labels_the_agent_owns(wanted: dict[str, str], on_node: dict[str, str],
                                   recorded: set[str], patch: dict[str, str | None],
                                   owned: set[str]) -> None:
    assert labels_to_publish(wanted, on_node, recorded) == (patch, owned)


def test_publish_records_its_labels_and_drops_those_it_no_longer_sets(tmp_path: Path) -> None:
    api = FakeApiServer()
    api.add_node({"metadata": {"name": "n1", "labels": {
        "nvidia.com/gpu.present": "true", "team": "ml"}}})
    agent = NodeAgent(PluginConfig("n1", tmp_path, KEY, replicas=2), FakeNvml([GPU]), api)
    assert agent.publish()
    meta = api.get_node("n1")["metadata"]
    owned = set(meta["annotations"][AGENT_LABELS].split(","))
    assert "nvidia.com/gpu.compute.major" in owned and "gpuslice.io/gpu-model" in owned
    assert "nvidia.com/gpu.present" not in owned and "team" not in owned
    # the next driver reports no compute capability: its labels go, the others stay
    agent.nvml = FakeNvml([GpuDevice(0, "GPU-aaa", "NVIDIA A100-80GB", "A100-80GB", 81920)])
    assert agent.publish()
    meta = api.get_node("n1")["metadata"]
    assert "nvidia.com/gpu.compute.major" not in meta["labels"]
    assert meta["labels"]["team"] == "ml" and meta["labels"]["nvidia.com/gpu.present"] == "true"
    assert "nvidia.com/gpu.compute.major" not in meta["annotations"][AGENT_LABELS]


def node(labels: dict[str, str], annotations: dict[str, str],
         resources: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "labels": labels, "annotations": annotations},
            "status": {"capacity": {"cpu": "8", **resources},
                       "allocatable": {"cpu": "8", **resources}}}


def test_the_cleanup_plan_is_what_gpuslice_put_there() -> None:
    plan = cleanup_plan(node(
        {"nvidia.com/gpu.product": "A100", "nvidia.com/gpu.present": "true", "team": "ml",
         "gpuslice.io/gpu-model": "A100-80GB", "gpuslice.io/fake-gpus": "true",
         "gpuslice.io/reconfig.GPU-aaa": "done"},
        {AGENT_LABELS: "nvidia.com/gpu.product,nvidia.com/gone", "gpuslice.io/inventory": "[]",
         "gpuslice.io/mig-desired": "{}", "other/x": "y"},
        {"gpuslice.io/gpu-milli": "1000", "gpuslice.io/gpu": "10"}))
    assert plan == NodeCleanup(
        "n1",
        ("gpuslice.io/gpu-model", "gpuslice.io/reconfig.GPU-aaa", "nvidia.com/gpu.product"),
        (AGENT_LABELS, "gpuslice.io/inventory", "gpuslice.io/mig-desired"),
        ("capacity/gpuslice.io/gpu-milli", "allocatable/gpuslice.io/gpu-milli"))
    assert plan.status_patch() == [
        {"op": "remove", "path": "/status/capacity/gpuslice.io~1gpu-milli"},
        {"op": "remove", "path": "/status/allocatable/gpuslice.io~1gpu-milli"}]
    empty = cleanup_plan(node({"team": "ml"}, {}, {}))
    assert not empty and empty.summary() == "nothing left to remove"


OWNED = {"metadata": {"name": "agent-x", "namespace": "gpuslice-system", "ownerReferences": [
    {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gpuslice-node-agent",
     "uid": "u1", "controller": True}]}}


def ds(uid: str = "u1", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "gpuslice-node-agent", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-27T00:00:00Z"
    return {"metadata": meta}


@pytest.mark.parametrize(("pod", "daemonset", "uninstalling", "why"), [
    (OWNED, ds(), False, "still there (a rolling update or a restart)"),
    (OWNED, None, True, "gpuslice-system/gpuslice-node-agent is gone"),
    (OWNED, ds(deleting=True), True, "is being deleted"),
    (OWNED, ds(uid="u2"), False, "replaced by a new one"),
    ({"metadata": {"name": "p", "namespace": "x"}}, None, False, "no DaemonSet controller"),
])
def test_the_uninstall_verdict(pod: dict[str, Any], daemonset: dict[str, Any] | None,
                               uninstalling: bool, why: str) -> None:
    verdict, said = uninstall_verdict(pod, daemonset)
    assert verdict is uninstalling and why in said, said


def test_json_patch_pointers_and_operations() -> None:
    assert json_pointer("status", "capacity", "gpuslice.io/gpu-milli") == \
        "/status/capacity/gpuslice.io~1gpu-milli"
    assert json_pointer("a~b") == "/a~0b"
    doc = {"status": {"capacity": {"a/b": "1", "c": "2"}}}
    out = apply_json_patch(doc, [{"op": "test", "path": "/status/capacity/c", "value": "2"},
                                 {"op": "remove", "path": "/status/capacity/a~1b"}])
    assert out == {"status": {"capacity": {"c": "2"}}} and "a/b" in doc["status"]["capacity"]
    with pytest.raises(ApiInvalid, match="nonexistent"):  # all or none, as the API server
        apply_json_patch(doc, [{"op": "remove", "path": "/status/capacity/c"},
                               {"op": "remove", "path": "/status/capacity/c"}])


def test_a_resource_removed_meanwhile_is_read_again() -> None:
    class Racing(FakeApiServer):
        raced = False

        def patch_node_status(self, name: str, ops: list[dict[str, Any]]) -> None:
            if not self.raced:  # someone else removes one between the read and the patch
                self.raced = True
                super().patch_node_status(name, [ops[0]])
            super().patch_node_status(name, ops)

    api = Racing()
    api.add_node(node({}, {}, {"gpuslice.io/gpu-milli": "1000",
                               "gpuslice.io/gpu-memory": "80"}))
    plan = clean_node(api, "n1")
    assert plan.resources == ("capacity/gpuslice.io/gpu-memory",
                              "allocatable/gpuslice.io/gpu-milli",
                              "allocatable/gpuslice.io/gpu-memory")
    assert api.get_node("n1")["status"] == {"capacity": {"cpu": "8"},
                                            "allocatable": {"cpu": "8"}}


def test_an_mps_daemon_that_does_not_quit_keeps_its_folders(tmp_path: Path) -> None:
    """Clients still attached: the daemon keeps answering after quit; its folders, and the
    shared memory folder, stay."""
    stuck = tmp_path / "stuck-control"
    stuck.write_text(f"#!{sys.executable}\nprint(100.0)\n")
    stuck.chmod(stuck.stat().st_mode | stat.S_IEXEC)
    fine = write_fake_control(tmp_path / "control")
    pipe, shm = tmp_path / "mps", tmp_path / "shm"
    for uuid in ("GPU-aaa", "GPU-bbb"):
        (pipe / f"{uuid}.log").mkdir(parents=True)
    import subprocess

    subprocess.run([str(fine), "-d"], check=True,
                   env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe / "GPU-bbb")})
    (pipe / "GPU-aaa").mkdir()
    shm.mkdir()
    (shm / "cuda.shm.1").write_text("x")
    gpus = [GPU, GpuDevice(1, "GPU-bbb", "NVIDIA A100-80GB", "A100-80GB", 81920)]
    cfg = PluginConfig("n1", tmp_path, KEY, replicas=2, mps_pipe_dir=str(pipe),
                       mps_shm_dir=str(shm))
    agent = NodeAgent(cfg, FakeNvml(gpus), FakeApiServer(), mps_binary=str(stuck))
    # GPU-aaa's daemon is the stuck one, GPU-bbb's quits
    from gpuslice.adapters.mps import MpsDaemon

    agent._mps["GPU-bbb"] = MpsDaemon("GPU-bbb", pipe / "GPU-bbb", pipe / "GPU-bbb.log",
                                      binary=str(fine))
    removed = agent.remove_mps_state(timeout_s=0.3)
    assert sorted(removed) == [str(pipe / "GPU-bbb"), str(pipe / "GPU-bbb.log")]
    assert (pipe / "GPU-aaa").is_dir() and (shm / "cuda.shm.1").exists()
    assert any("MPS daemon for GPU-aaa left running" in p for p in agent.problems)


def test_a_migration_between_installs_leaves_the_node_served(tmp_path: Path) -> None:
    """Moving from one install to another (kustomize to Helm): the old DaemonSet is deleted
    while the new one's agent already serves the node. The old agent does not take the
    node's labels, inventory and totals off (the new agent serves it), and an agent whose
    publication is gone anyway (an old version's cleanup) publishes it again."""
    from gpuslice.services.node_cleanup import check_uninstall, clean_node, other_agent

    api = FakeApiServer()
    api.add_node({"metadata": {"name": "n1"}})
    old = api.add_pod({"metadata": {
        "name": "agent-old", "namespace": "gpuslice-system",
        "labels": {"app.kubernetes.io/name": "gpuslice-node-agent"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                             "name": "gpuslice-node-agent", "uid": "u-old",
                             "controller": True}]}, "spec": {"nodeName": "n1"}})
    agent = NodeAgent(PluginConfig("n1", tmp_path, KEY, replicas=2), FakeNvml([GPU]), api)
    assert agent.publish()
    # alone on the node, its DaemonSet gone: an uninstall
    assert check_uninstall(api, "gpuslice-system", "agent-old")[0] is True
    api.add_pod({"metadata": {
        "name": "agent-new", "namespace": "gpuslice", "labels": {
            "app.kubernetes.io/name": "gpuslice-node-agent"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                             "name": "gpuslice-node-agent", "uid": "u-new",
                             "controller": True}]}, "spec": {"nodeName": "n1"},
        "status": {"phase": "Running"}})
    assert other_agent(old, api.list_pods(node="n1")) == "gpuslice/agent-new"
    verdict, why = check_uninstall(api, "gpuslice-system", "agent-old")
    assert verdict is False and "gpuslice/agent-new serves this node" in why
    # an old version's agent cleaned the node anyway: the serving agent publishes again
    clean_node(api, "n1")
    assert "gpuslice.io/inventory" not in (api.get_node("n1")["metadata"].get("annotations")
                                           or {})
    assert agent.check_published() is True and agent.check_published() is False
    node = api.get_node("n1")
    assert "gpuslice.io/inventory" in node["metadata"]["annotations"]
    assert node["status"]["capacity"]["gpuslice.io/gpu-milli"] == "1000"
