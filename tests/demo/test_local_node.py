"""The demo's node of this machine's GPUs: real NVML and real MPS daemons when there are GPUs
(here NVML is stood in for by the fake, and MPS by the control-tool stand-in), and a clear line
when there are none."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.devices import GpuDevice
from gpuslice.demo.cluster import Cluster, NodeSpec, gpu_pod
from gpuslice.demo.runtime import EventLog, InProcessRuntime
from gpuslice.demo.scenario import local_nvml
from tests.fake_mps import write_fake_mps


def test_a_node_of_local_gpus_starts_and_quits_its_mps_daemon(tmp_path: Path) -> None:
    mps = write_fake_mps(tmp_path / "mps-control")
    gpu = GpuDevice(0, "GPU-real-0", "NVIDIA H100 80GB HBM3", "H100-SXM", 81559, 132, (9, 0))
    c = Cluster(tmp_path / "c", uuid.uuid4().hex[:8], b"local-node-test-key-0123456",
                EventLog(), runtime=InProcessRuntime(), agent_poll_s=0.1)
    (tmp_path / "c").mkdir()
    try:
        c.add_node(NodeSpec("local", ("H100-SXM",)), FakeNvml([gpu]), str(mps))
        c.start_extender()
        c.api.add_pod(gpu_pod("r0", service="s", model="resnet50", milli=300,
                              memory_mib=8192, gpu_models="H100-SXM"))
        end = time.monotonic() + 20
        while c.container_of("demo/r0") is None and time.monotonic() < end:
            time.sleep(0.05)
        found = c.container_of("demo/r0")
        assert found is not None and found[0].spec.name == "local"
        assert found[1].envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        control = tmp_path / "c" / "local" / "mps" / "GPU-real-0" / "control"
        assert control.exists()  # the agent started the GPU's MPS daemon for the slice
        assert any("local joined: 1 x H100-SXM (real NVML and MPS)" in e.text
                   for e in c.log.events)
    finally:
        c.stop()
    assert not control.exists()  # and quit it when the demo stopped


def test_without_gpus_the_demo_says_every_gpu_is_simulated(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from gpuslice.adapters.nvml import real
    from gpuslice.adapters.nvml.port import NullNvml

    monkeypatch.setattr(real, "load", lambda: NullNvml("libnvidia-ml.so is not on this node"))
    log = EventLog()
    assert local_nvml(log) is None
    assert "libnvidia-ml.so is not on this node" in log.events[-1].text
    assert "every GPU is simulated" in log.events[-1].text


def test_a_node_has_joined_once_its_gpus_are_published(tmp_path: Path,
                                                        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 54: "h100-1 joined" was followed by the extender's "h100-1: node has no GPU", as
    the agent had not yet written the node's inventory; the demo says a node joined once it
    has (here the API server is slow to take the agent's write)."""
    from gpuslice.adapters.kube.fake import FakeApiServer

    slow = FakeApiServer.patch_node

    def patch_node(self, name, labels, annotations):  # type: ignore[no-untyped-def]
        if "gpuslice.io/inventory" in annotations:
            time.sleep(0.5)
        slow(self, name, labels, annotations)

    monkeypatch.setattr(FakeApiServer, "patch_node", patch_node)
    c = Cluster(tmp_path / "c", uuid.uuid4().hex[:8], b"local-node-test-key-0123456",
                EventLog(), runtime=InProcessRuntime(), agent_poll_s=0.1)
    (tmp_path / "c").mkdir()
    try:
        c.add_node(NodeSpec("late", ("H100-SXM",) * 2))
        ann = c.api.get_node("late")["metadata"].get("annotations") or {}
        assert ann.get("gpuslice.io/inventory"), ann
    finally:
        c.stop()
