"""The node agent reads the layouts the reconfiguration controller asks of its GPUs from its
node's ``gpuslice.io/mig-desired`` annotation (GPU UUID -> layout text). An annotation that is
not that (anyone who can patch the node can write it) is noted once and changes nothing; the
agent's loop (health checks, publishing, metrics) goes on."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.devices import GpuDevice, MigInstance
from gpuslice.services.device_plugin import PluginConfig
from gpuslice.services.node_agent import NodeAgent
from gpuslice.services.node_layouts import MIG_DESIRED

KEY = b"node-agent-key-0123456789"
START = [("3g.40gb", 4), ("4g.40gb", 0)]


def agent(tmp: Path) -> tuple[FakeApiServer, NodeAgent]:
    api = FakeApiServer()
    api.add_node({"metadata": {"name": "n1"}})
    g = GpuDevice(0, "GPU-n1", "NVIDIA A100-80GB", "A100-80GB", 81920, mig_enabled=True,
                  mig=(MigInstance("MIG-0", "4g.40gb", 0, 40192),
                       MigInstance("MIG-4", "3g.40gb", 4, 40192)))
    a = NodeAgent(PluginConfig("n1", tmp, KEY), FakeNvml([g]), api)
    a.publish()
    return api, a


@pytest.mark.parametrize("text", [
    "[]", '"7g.80gb@0"', "3", "null", '{"GPU-n1": 7}', '{"GPU-n1": ["7g.80gb@0"]}',
    '{"GPU-n1": {"layout": "7g.80gb@0"}}', "{nope",
])
def test_an_annotation_that_is_not_uuid_to_layout_is_noted_once_and_changes_nothing(
        tmp_path: Path, text: str) -> None:
    api, a = agent(tmp_path)
    api.patch_node("n1", {}, {MIG_DESIRED: text})
    for _ in range(3):
        report = a.reconcile_layouts()
        assert report["GPU-n1"]["state"] == "success"
    assert sorted(a.nvml.mig_layout("GPU-n1")) == START
    noted = [p for p in a.problems if MIG_DESIRED in p]
    assert len(noted) == 1 and "expected a JSON object of GPU UUID to layout text" in noted[0]


def test_the_agents_loop_goes_on_past_whatever_a_layout_step_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, a = agent(tmp_path)
    calls: list[int] = []
    stop = threading.Event()

    def reconcile() -> dict[str, dict[str, str]]:
        calls.append(1)
        if len(calls) == 1:
            raise AttributeError("'list' object has no attribute 'get'")
        stop.set()
        return {}

    monkeypatch.setattr(a, "reconcile_layouts", reconcile)
    monkeypatch.setattr(a, "_stop", stop)
    a.poll_s = 0.01
    done = threading.Thread(target=a.run, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive() and len(calls) == 2
    assert any("MIG layouts: AttributeError" in p for p in a.problems)
    assert json.dumps(a.problems)  # plain strings


def test_a_pod_holding_an_assignment_on_the_gpu_holds_the_layout_back(tmp_path: Path) -> None:
    """The gate counts pods, not only processes: a pod bound to the GPU's 3g instance while
    the controller's cordon was reaching the extender, or one still loading its model, has
    no CUDA context yet; the new layout waits until it is gone, instead of taking its
    instance away (before, with no process on the GPU, the layout changed under it)."""
    from gpuslice.adapters.kube.annotation import encode
    from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign

    api, a = agent(tmp_path)
    p = api.add_pod({"metadata": {"name": "loading", "namespace": "ml"},
                     "spec": {"nodeName": "n1", "containers": [{"name": "main"}]}})
    held = Assignment("ml", "loading", p["metadata"]["uid"], "n1", (ContainerAssignment(
        "main", Mode.MIG, (GpuShare("GPU-n1", 428, 40192, "3g.40gb", 4),)),), "t1")
    api.patch_pod_annotations("ml", "loading", {"gpuslice.io/assignment": encode(
        sign(held, KEY))}, p["metadata"]["resourceVersion"])
    api.patch_node("n1", {}, {MIG_DESIRED: json.dumps({"GPU-n1": "7g.80gb@0"})})
    report = a.reconcile_layouts()["GPU-n1"]
    assert report["state"] == "pending" and "ml/loading" in report["message"]
    assert sorted(a.nvml.mig_layout("GPU-n1")) == START  # untouched
    api.set_pod_status("ml", "loading", {"phase": "Succeeded"})  # gone: the layout follows
    assert a.reconcile_layouts()["GPU-n1"]["state"] == "success"
    assert a.nvml.mig_layout("GPU-n1") == [("7g.80gb", 0)]
