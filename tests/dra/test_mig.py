"""Partitionable MIG devices (KEP-4815): a prepared MIG device is created through the MIG
executor, named in the container's CUDA_VISIBLE_DEVICES, and destroyed on unprepare when no
other claim holds it; a placement that clashes with a held one is refused (the rules of
core.mig.layout_problems, NVML's for nvmlDeviceCreateGpuInstanceWithPlacement)."""

from __future__ import annotations

import json

from tests.dra.conftest import Node, claim, opaque

GPU1 = "GPU-node-a-01"


def test_prepare_creates_the_instance_and_unprepare_removes_it(node: Node) -> None:
    client = node.serve()
    assert node.nvml.mig_layout(GPU1) == []
    ref = node.add(claim("mig", [{"request": "mig", "device": "gpu-1-mig-3g40gb-4"}]))
    got = client.prepare([ref])[ref[1]]
    assert got.error == ""
    assert node.nvml.mig_layout(GPU1) == [("3g.40gb", 4)]
    spec = json.loads(node.driver.cdi.path(ref[1]).read_text())
    env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    assert env["CUDA_VISIBLE_DEVICES"] == f"MIG-{GPU1}-4"
    # repeated: same answer, no second instance
    again = client.prepare([ref])[ref[1]]
    assert list(again.devices[0].cdi_device_ids) == list(got.devices[0].cdi_device_ids)
    assert node.nvml.mig_layout(GPU1) == [("3g.40gb", 4)]
    assert client.unprepare([ref]) == {ref[1]: ""}
    assert node.nvml.mig_layout(GPU1) == []


def test_two_placements_that_fit_together_and_one_that_clashes(node: Node) -> None:
    client = node.serve()
    a = node.add(claim("a", [{"request": "mig", "device": "gpu-1-mig-3g40gb-0"}]))
    b = node.add(claim("b", [{"request": "mig", "device": "gpu-1-mig-2g20gb-4"}]))
    c = node.add(claim("c", [{"request": "mig", "device": "gpu-1-mig-1g10gb-2"}]))
    got = client.prepare([a, b, c])
    assert got[a[1]].error == "" and got[b[1]].error == ""
    assert "memory slice 2 is already used by 3g.40gb@0" in got[c[1]].error
    assert sorted(node.nvml.mig_layout(GPU1)) == [("2g.20gb", 4), ("3g.40gb", 0)]


def test_a_failed_instance_creation_fails_the_claim_and_a_retry_succeeds(node: Node) -> None:
    client = node.serve()
    ref = node.add(claim("mig", [{"request": "mig", "device": "gpu-1-mig-1g10gb-0"}]))
    node.nvml.fail_next_create(GPU1)
    err = client.prepare([ref])[ref[1]].error
    assert "INSUFFICIENT_RESOURCES" in err
    assert client.prepare([ref])[ref[1]].error == ""  # the kubelet retries
    assert node.nvml.mig_layout(GPU1) == [("1g.10gb", 0)]


def test_mig_config_with_mps_starts_a_daemon_inside_the_instance(node: Node) -> None:
    client = node.serve()
    ref = node.add(claim("mig-mps", [{"request": "mig", "device": "gpu-1-mig-3g40gb-0"}],
                         config=[opaque({"apiVersion": "gpuslice.io/v1alpha1",
                                         "kind": "MigConfig", "sharing": {
                                             "strategy": "MPS",
                                             "mps": {"activeThreadPercentage": 50}}})]))
    assert client.prepare([ref])[ref[1]].error == ""
    assert f"MIG-{GPU1}-0" in node.driver._mps
