"""The real NVML adapter (``RealNvml``) over the real ``pynvml`` module, with only the C library
beneath it faked (tests/nodeagent/libnvml_fake.py): the calling conventions (array arguments
sized by the caller, placements passed by pointer, profile index vs profile ID) are the driver's,
so a mistake in them fails here rather than on the first MIG node."""

from __future__ import annotations

import pytest

from gpuslice.adapters.nvml.port import NullNvml, NvmlError
from gpuslice.adapters.nvml.real import RealNvml, load
from gpuslice.core import catalog
from gpuslice.services.mig_executor import MigExecutor
from tests.nodeagent.libnvml_fake import (
    INSUFFICIENT_RESOURCES,
    FakeLibNvml,
    GpuInstance,
    a100_80,
    h100,
    t4,
)


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> FakeLibNvml:
    a100 = a100_80()
    a100.gis[1] = GpuInstance(1, 9, 4, 4, 3, {0: 2})  # 3g.40gb@4 with its compute instance
    return FakeLibNvml([h100(), a100, t4()]).install(monkeypatch)


def test_discovery_reads_models_mig_devices_and_their_placements(node: FakeLibNvml) -> None:
    nv = load()
    assert isinstance(nv, RealNvml)
    assert nv.driver_version() == "580.159.04"
    h, a, t = nv.devices()
    assert (h.model, h.memory_mib, h.sms, h.compute_capability, h.mig_enabled) == \
        ("H100-SXM", 81559, 132, (9, 0), False)
    assert (a.model, a.mig_enabled, t.model, t.mig_enabled) == ("A100-80GB", True, "T4", False)
    assert a.sms == 108  # the catalogue's, not the 7g profile's 98
    (m,) = a.mig
    assert (m.profile, m.start, m.memory_mib) == ("3g.40gb", 4, 40192)
    assert m.uuid.startswith("MIG-")


def test_mig_profiles_and_placements_match_the_catalogue(node: FakeLibNvml) -> None:
    """The H100's table in the fake is the one measured through NVML on an H100 (MIG disabled):
    the catalogue the planner and extender use must agree with it."""
    nv = RealNvml()
    for gpu in nv.devices()[:2]:
        got = nv.mig_profiles(gpu.uuid)
        model = catalog.lookup(gpu.model)
        assert model is not None and model.mig is not None
        assert sorted(got, key=lambda p: p.profile_id) == \
            sorted(model.mig.profiles, key=lambda p: p.profile_id), gpu.model
    assert nv.mig_profiles(nv.devices()[2].uuid) == []  # T4: not MIG-capable


def test_layout_create_and_destroy_with_explicit_placements(node: FakeLibNvml) -> None:
    nv = RealNvml()
    uuid = node.gpus[1].uuid
    assert nv.mig_layout(uuid) == [("3g.40gb", 4)]
    nv.create_instance(uuid, "2g.20gb", 0)
    nv.create_instance(uuid, "1g.10gb", 2)
    assert nv.mig_layout(uuid) == [("1g.10gb", 2), ("2g.20gb", 0), ("3g.40gb", 4)]
    # each GPU instance got one compute instance spanning it
    assert sorted((gi.profile_id, gi.cis) for gi in node.gpus[1].gis.values()) == \
        [(9, {0: 2}), (14, {0: 1}), (19, {0: 0})]
    assert len(nv.devices()[1].mig) == 3
    nv.destroy_instance(uuid, "3g.40gb", 4)  # its compute instance goes first
    assert nv.mig_layout(uuid) == [("1g.10gb", 2), ("2g.20gb", 0)]
    assert "nvmlComputeInstanceDestroy" in node.calls


def test_bad_mig_requests_are_explained(node: FakeLibNvml) -> None:
    nv = RealNvml()
    a100, h = node.gpus[1].uuid, node.gpus[0].uuid
    nv.create_instance(a100, "4g.40gb", 0)  # 4g next to 3g: allowed since R510
    with pytest.raises(NvmlError, match=r"\(1g.10gb@1\) failed: Insufficient Resources"):
        nv.create_instance(a100, "1g.10gb", 1)  # memory slice 1 belongs to 4g.40gb@0
    with pytest.raises(NvmlError, match=r"cannot start at memory slice 1 .*0, 2, 4"):
        nv.create_instance(a100, "2g.20gb", 1)
    with pytest.raises(NvmlError, match=r"no MIG profile '9g\.90gb'"):
        nv.create_instance(a100, "9g.90gb", 0)
    with pytest.raises(NvmlError, match="MIG mode is disabled"):
        nv.mig_layout(h)
    with pytest.raises(NvmlError, match=r"no 1g\.10gb instance at 6"):
        nv.destroy_instance(a100, "1g.10gb", 6)
    with pytest.raises(NvmlError, match="not MIG-capable"):
        nv.create_instance(node.gpus[2].uuid, "1g.10gb", 0)


def test_a_failed_compute_instance_leaves_no_gpu_instance(node: FakeLibNvml,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    nv = RealNvml()
    uuid = node.gpus[1].uuid
    monkeypatch.setattr(node, "nvmlGpuInstanceCreateComputeInstance",
                        lambda gi, pid, ci: INSUFFICIENT_RESOURCES)
    with pytest.raises(NvmlError, match="nvmlGpuInstanceCreateComputeInstance"):
        nv.create_instance(uuid, "2g.20gb", 0)
    assert nv.mig_layout(uuid) == [("3g.40gb", 4)]


def test_mig_parted_config_applied_through_the_real_adapter(node: FakeLibNvml) -> None:
    nv = RealNvml()
    doc = {"version": "v1", "mig-configs": {
        "all-1g": [{"devices": [1], "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}]}}
    ex = MigExecutor(nv)
    assert ex.apply(doc, "all-1g", dry_run=True).state == "dry-run"
    assert nv.mig_layout(node.gpus[1].uuid) == [("3g.40gb", 4)]  # the dry run changed nothing
    node.gpus[1].pids = [4242]
    busy = ex.apply(doc, "all-1g")
    assert busy.state == "failed" and "1 process(es)" in busy.skipped[node.gpus[1].uuid]
    node.gpus[1].pids = []
    report = ex.apply(doc, "all-1g")
    assert report.state == "success", report.skipped
    assert nv.mig_layout(node.gpus[1].uuid) == [("1g.10gb", s) for s in range(7)]


def test_clients_usage_and_xid_events(node: FakeLibNvml) -> None:
    nv = RealNvml()
    h, a, _ = node.gpus
    h.pids, h.used_mib, h.util = [11, 12], 2048, 37
    assert nv.clients(h.uuid) == 2 and nv.clients(a.uuid) == 0
    assert nv.usage(h.uuid) == (2048, 37)
    assert nv.usage(a.uuid) == (0, 0)  # utilisation is not reported with MIG enabled
    assert nv.events(0.01) == []
    a.events.append(79)
    (ev,) = nv.events(0.01)
    assert (ev.uuid, ev.xid) == (a.uuid, 79)


def test_processes_with_their_memory_and_sm_utilization(node: FakeLibNvml) -> None:
    """nvmlDeviceGetComputeRunningProcesses (each one's used memory) with the SM utilization
    of nvmlDeviceGetProcessUtilization's samples since the last read (pynvml's two-call
    convention); a driver without the MPS listing (a missing symbol) is no error."""
    from gpuslice.adapters.nvml.port import GpuProcess

    nv = RealNvml()
    h, a, _ = node.gpus
    h.pids = [11, 12]
    h.samples = [(11, 1_000, 30), (12, 1_000, 5)]
    assert nv.processes(h.uuid) == [GpuProcess(11, 100, 30.0), GpuProcess(12, 100, 5.0)]
    # nothing newer: the processes, without a figure (not a stale one)
    assert nv.processes(h.uuid) == [GpuProcess(11, 100, None), GpuProcess(12, 100, None)]
    h.samples.append((11, 2_000, 60))
    assert nv.processes(h.uuid)[0] == GpuProcess(11, 100, 60.0)
    assert nv.processes(a.uuid) == []


def test_no_driver_gives_the_null_port_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeLibNvml([], init_error=9).install(monkeypatch)  # NVML_ERROR_DRIVER_NOT_LOADED
    nv = load()
    assert isinstance(nv, NullNvml) and nv.devices() == []
    assert "modprobe nvidia" in nv.why_empty()


def test_gpus_local_shows_discovery_and_checks_the_catalogue(
        node: FakeLibNvml, capsys: pytest.CaptureFixture[str]) -> None:
    from gpuslice.cli import main

    assert main(["gpus", "--local"]) == 0
    out = capsys.readouterr().out
    assert "driver 580.159.04" in out and "NVIDIA H100 80GB HBM3 (H100-SXM)" in out
    assert "instance 3g.40gb@4 MIG-" in out
    assert out.count("table agrees") == 2  # H100 and A100; the T4 has no MIG table
    assert "1g.10gb+me" in out and "0-6" in out
    # a driver whose table differs from the catalogue's is named, and the command fails
    node.gpus[0].profiles[0] = (0, 19, "1g.10gb", 1, 1, 9000, 16, 7, (0, 1, 2, 3, 4, 5, 6))
    assert main(["gpus", "--local"]) == 1
    assert "H100-SXM table differs for: 1g.10gb" in capsys.readouterr().out


def test_the_node_agent_says_when_the_drivers_mig_table_differs(node: FakeLibNvml) -> None:
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.services.device_plugin import PluginConfig
    from gpuslice.services.node_agent import NodeAgent

    agent = NodeAgent(PluginConfig("n1", "/tmp", b"k" * 16), RealNvml(), FakeApiServer())
    assert agent.check_mig_tables() == []
    node.gpus[1].profiles[4] = (2, 9, "3g.40gb", 3, 4, 40192, 42, 2, (0, 4, 6))
    node.gpus[0].name = "NVIDIA H100 NVL"  # not in the catalogue
    found = RealNvml()  # a fresh adapter: profile tables are read once per GPU
    agent = NodeAgent(PluginConfig("n1", "/tmp", b"k" * 16), found, FakeApiServer())
    problems = agent.check_mig_tables()
    assert any("NVIDIA H100 NVL" in p and "no MIG table" in p for p in problems), problems
    assert any("A100-80GB" in p and "differs from the catalogue's for 3g.40gb" in p
               for p in problems), problems
    assert agent.problems == problems
