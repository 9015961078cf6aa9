"""One bad SliceSchedule never stops the controller: a layout no selected GPU can hold, a drain
timeout out of range or an unexpected error is said on that schedule (Invalid / Error, naming
the field), nothing of it is touched, and the other schedules are reconciled as before. Fast:
the fake API server and the real node agent on fake NVML, no pods."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kube.objects import CORDONED_ANNOTATION
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.devices import GpuDevice, MigInstance
from gpuslice.services.device_plugin import PluginConfig
from gpuslice.services.node_agent import NodeAgent
from gpuslice.services.node_layouts import MIG_DESIRED
from gpuslice.services.reconfig import PLURAL, ReconfigController

KEY = b"node-agent-key-0123456789"
START = [("4g.40gb", 0), ("3g.40gb", 4)]


def gpu(node: str, model: str = "A100-80GB") -> GpuDevice:
    if model == "A30":
        return GpuDevice(0, f"GPU-{node}", "NVIDIA A30", "A30", 24576, mig_enabled=True,
                         mig=(MigInstance(f"MIG-{node}-0", "4g.24gb", 0, 24064),))
    return GpuDevice(0, f"GPU-{node}", "NVIDIA A100-80GB", "A100-80GB", 81920,
                     mig_enabled=True,
                     mig=(MigInstance(f"MIG-{node}-0", "4g.40gb", 0, 40192),
                          MigInstance(f"MIG-{node}-4", "3g.40gb", 4, 40192)))


class World:
    def __init__(self, tmp: Path, nodes: dict[str, str]) -> None:
        self.api = FakeApiServer()
        self.agents: dict[str, NodeAgent] = {}
        for n, model in nodes.items():
            self.api.add_node({"metadata": {"name": n}})
            d = tmp / n
            d.mkdir()
            a = NodeAgent(PluginConfig(n, d, KEY), FakeNvml([gpu(n, model)]), self.api)
            a.publish()
            a.reconcile_layouts()
            self.agents[n] = a
        self.ctl = ReconfigController(self.api, minute_of_day=lambda: 600)

    def add(self, name: str, layout: dict[str, Any], nodes: list[str] | None = None,
            **spec: Any) -> None:
        self.api.replace_custom(PLURAL, {
            "apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceSchedule",
            "metadata": {"name": name, "namespace": "gpuslice"},
            "spec": {"selector": {"nodes": nodes} if nodes else {},
                     "layouts": {"x": {"mig": layout}}, "default": "x",
                     "drainTimeoutSeconds": 0.01, **spec}})

    def passes(self, n: int) -> None:
        for _ in range(n):
            self.ctl.step()  # never raises, whatever one schedule holds
            for a in self.agents.values():
                a.reconcile_layouts()

    def ready(self, name: str) -> dict[str, Any]:
        st = self.api.get_custom(PLURAL, "gpuslice", name).get("status") or {}
        return next(c for c in st.get("conditions", []) if c["type"] == "Ready")

    def layout(self, node: str) -> list[tuple[str, int]]:
        return sorted(self.agents[node].nvml.mig_layout(f"GPU-{node}"), key=lambda t: t[1])

    def untouched(self, node: str) -> None:
        ann = self.api.get_node(node)["metadata"].get("annotations") or {}
        assert not ann.get(CORDONED_ANNOTATION) and MIG_DESIRED not in ann
        assert self.layout(node) == START


@pytest.mark.parametrize(("layout", "spec", "field"), [
    ({"mig-devices": {"9g.999gb": 1}}, {}, "spec.layouts.x.mig.mig-devices.9g.999gb"),
    ({"mig-devices": {"1g.10gb": 8}}, {}, "spec.layouts.x.mig.mig-devices.1g.10gb"),
    ({"mig-placements": ["4g.40gb@0", "3g.40gb@0"]}, {}, "spec.layouts.x.mig.mig-placements"),
    ({"mig-placements": ["3g.40gb@0", "3g.40gb@0"]}, {}, "spec.layouts.x.mig.mig-placements"),
    ({"mig-devices": {"7g.80gb": 1}}, {"drainTimeoutSeconds": 10**400},
     "spec.drainTimeoutSeconds"),
])
def test_an_invalid_schedule_is_said_untouched_and_the_others_go_on(
        tmp_path: Path, layout: dict[str, Any], spec: dict[str, Any], field: str) -> None:
    w = World(tmp_path, {"n1": "A100-80GB", "n2": "A100-80GB"})
    w.add("a-bad", layout, ["n1"], **spec)
    w.add("b-good", {"mig-devices": {"7g.80gb": 1}}, ["n2"])
    w.passes(8)
    bad = w.ready("a-bad")
    assert bad["reason"] == "Invalid" and bad["message"].startswith(f"{field}: expected")
    w.untouched("n1")  # never cordoned, never asked to change
    assert w.ready("b-good")["reason"] == "Done" and w.layout("n2") == [("7g.80gb", 0)]


def test_a_selected_gpu_model_that_cannot_hold_the_layout_makes_it_invalid(
        tmp_path: Path) -> None:
    w = World(tmp_path, {"n1": "A30", "n2": "A100-80GB"})
    w.add("a-all", {"mig-devices": {"1g.10gb": 7}})  # an A100 layout, every MIG GPU selected
    w.add("b-good", {"mig-devices": {"7g.80gb": 1}}, ["n2"])
    w.passes(8)
    bad = w.ready("a-all")
    assert bad["reason"] == "Invalid"
    assert bad["message"].startswith("spec.layouts.x.mig.mig-devices.1g.10gb: expected")
    assert "(on the A30)" in bad["message"]
    assert w.ready("b-good")["reason"] == "Done"


def test_an_unexpected_error_in_one_schedule_is_logged_and_said_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    w = World(tmp_path, {"n1": "A100-80GB", "n2": "A100-80GB"})
    w.add("a-boom", {"mig-devices": {"7g.80gb": 1}}, ["n1"])
    w.add("b-good", {"mig-devices": {"7g.80gb": 1}}, ["n2"])
    real = ReconfigController._reconcile

    def flaky(self: ReconfigController, obj: dict[str, Any], sched: Any) -> None:
        if obj["metadata"]["name"] == "a-boom":
            raise KeyError("a bug")
        real(self, obj, sched)

    monkeypatch.setattr(ReconfigController, "_reconcile", flaky)
    w.passes(8)
    boom = w.ready("a-boom")
    assert boom["reason"] == "Error" and "KeyError" in boom["message"]
    assert any("a-boom" in r.getMessage() and r.exc_info for r in caplog.records)
    w.untouched("n1")
    assert w.ready("b-good")["reason"] == "Done"


def test_run_outlives_any_error_of_a_step(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, {"n1": "A100-80GB"})
    stop = threading.Event()
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OverflowError("int too large to convert to float")
        stop.set()

    monkeypatch.setattr(w.ctl, "step", step)
    w.ctl.run(stop, every_s=0)
    assert len(calls) == 2


def test_the_agent_refuses_a_layout_with_one_instance_twice(tmp_path: Path) -> None:
    w = World(tmp_path, {"n1": "A100-80GB"})
    for want in ("3g.40gb@0,3g.40gb@0", "4g.40gb@0,3g.40gb@0"):
        w.api.patch_node("n1", {}, {MIG_DESIRED: json.dumps({"GPU-n1": want})})
        for _ in range(2):
            rep = w.agents["n1"].reconcile_layouts()["GPU-n1"]
            assert rep["state"] == "failed" and "mig layout" in rep["message"]
            assert rep["layout"] == "4g.40gb@0,3g.40gb@4"
            assert w.layout("n1") == START  # nothing destroyed
