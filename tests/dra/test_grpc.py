"""The driver's gRPC contract with the kubelet, over unix sockets, with a kubelet-side client
written from the kubelet's behaviour (tests/dra/kubelet.py). Rules checked, by upstream
source:

- pluginregistration/v1 api.proto + constants.go (kubernetes/kubelet release-1.35): GetInfo's
  type "DRAPlugin", name, endpoint, supported_versions; NotifyRegistrationStatus;
- kubernetes pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go: the first supported version of
  the plugin's list is used, so v1 must come first;
- dra/v1 api.proto: every claim has an entry in the answer, errors are per claim, share_id
  (field 5) only in v1; dra/v1beta1 api.proto: the same without share_id;
- dynamic-resource-allocation kubeletplugin draplugin.go (PrepareResourceClaims): the claim is
  read from the API server; a different UID ("got replaced") or no allocation is an error;
  results of other drivers are not ours; subrequest names are stripped from request_names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.core import dra
from tests.dra.conftest import NODE, Node, claim
from tests.dra.kubelet import KUBELET_VERSIONS, DraClient, register


def test_registration_advertises_v1_first_and_the_health_service(node: Node) -> None:
    node.serve()
    assert node.client is not None
    reg = node.client.reg
    assert reg.name == "gpu.gpuslice.io"
    assert reg.version == "v1.DRAPlugin"  # the kubelet's choice: the plugin's first
    assert reg.health
    assert Path(reg.endpoint) == node.cfg.dra_socket.resolve()
    assert node.cfg.registration_socket.name == "gpu.gpuslice.io-reg.sock"
    assert node.cfg.registration_socket.parent.name == "plugins_registry"
    assert node.driver.registration == [(True, "")]


def test_a_kubelet_that_knows_only_v1beta1_gets_v1beta1_without_share_ids(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.dra import kubelet

    node.serve()
    monkeypatch.setattr(kubelet, "KUBELET_VERSIONS", ("v1beta1.DRAPlugin",))
    old = DraClient(register(node.cfg.registration_socket))
    try:
        assert old.reg.version == "v1beta1.DRAPlugin"
        ref = node.add(claim("share", [{"request": "gpu", "device": "gpu-0",
                                        "shareID": "aaaa-1111",
                                        "consumedCapacity": {"compute": "50",
                                                             "memory": "8Gi"}}]))
        got = old.prepare([ref])[ref[1]]
        assert got.error == ""
        assert [d.device_name for d in got.devices] == ["gpu-0"]
        assert not hasattr(got.devices[0], "share_id")  # v1beta1 has no field 5
    finally:
        old.close()
    assert KUBELET_VERSIONS[0] == "v1.DRAPlugin"


def test_prepare_whole_gpu_answers_cdi_ids_and_writes_the_spec(node: Node) -> None:
    client = node.serve()
    ref = node.add(claim("whole", [{"request": "gpu", "device": "gpu-2"}]))
    got = client.prepare([ref])[ref[1]]
    assert got.error == ""
    (dev,) = got.devices
    assert (dev.pool_name, dev.device_name, list(dev.request_names)) == (NODE, "gpu-2", ["gpu"])
    assert list(dev.cdi_device_ids) == [f"k8s.gpu.gpuslice.io/claim={ref[1]}-gpu-2"]
    assert not dev.HasField("share_id")
    spec = json.loads(node.driver.cdi.path(ref[1]).read_text())
    (cdi_dev,) = spec["devices"]
    assert cdi_dev["name"] == f"{ref[1]}-gpu-2"
    env = dict(e.split("=", 1) for e in cdi_dev["containerEdits"]["env"])
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-node-a-02"
    paths = [d["path"] for d in cdi_dev["containerEdits"]["deviceNodes"]]
    assert str(Path(node.cfg.dev_dir) / "nvidia2") in paths


def test_errors_are_per_claim_and_every_claim_is_answered(node: Node) -> None:
    client = node.serve()
    good = node.add(claim("good", [{"request": "gpu", "device": "gpu-2"}]))
    missing = ("default", "uid-gone", "gone")
    replaced = node.add(claim("replaced", [{"request": "gpu", "device": "gpu-2"}],
                              uid="new-uid"))
    unallocated = node.add({"metadata": {"name": "pending", "namespace": "default",
                                         "uid": "uid-pending"}, "status": {}})
    nowhere = node.add(claim("nowhere", [{"request": "gpu", "device": "gpu-9"}]))
    got = client.prepare([good, missing, ("default", "old-uid", "replaced"), unallocated,
                          nowhere])
    assert got[good[1]].error == ""
    assert "not found" in got["uid-gone"].error
    assert "new-uid" in got["old-uid"].error and "recreated" in got["old-uid"].error
    assert "not allocated" in got["uid-pending"].error
    assert "gpu-9" in got[nowhere[1]].error and "results[0].device" in got[nowhere[1]].error
    assert replaced[1] == "new-uid"


def test_only_this_drivers_results_and_subrequests_map_to_their_request(node: Node) -> None:
    client = node.serve()
    c = claim("mixed", [{"request": "gpu/t4", "device": "gpu-2"}])
    c["status"]["allocation"]["devices"]["results"].append(
        {"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "eth0"})
    ref = node.add(c)
    got = client.prepare([ref])[ref[1]]
    assert got.error == ""
    assert [(d.device_name, list(d.request_names)) for d in got.devices] == \
        [("gpu-2", ["gpu"])]


def test_unprepare_answers_every_claim_including_unknown_ones(node: Node) -> None:
    client = node.serve()
    ref = node.add(claim("whole", [{"request": "gpu", "device": "gpu-2"}]))
    assert client.prepare([ref])[ref[1]].error == ""
    assert node.driver.cdi.path(ref[1]).exists()
    got = client.unprepare([ref, ("default", "never-seen", "ghost")])
    assert got == {ref[1]: "", "never-seen": ""}
    assert not node.driver.cdi.path(ref[1]).exists()
    assert node.driver.checkpoint.get(ref[1]) is None
    # the claim's device is free again for another claim
    other = node.add(claim("next", [{"request": "gpu", "device": "gpu-2"}]))
    assert client.prepare([other])[other[1]].error == ""


def test_a_whole_gpu_is_never_prepared_for_two_claims(node: Node) -> None:
    client = node.serve()
    a = node.add(claim("a", [{"request": "gpu", "device": "gpu-2"}]))
    b = node.add(claim("b", [{"request": "gpu", "device": "gpu-2"}]))
    assert client.prepare([a])[a[1]].error == ""
    err = client.prepare([b])[b[1]].error
    assert "default/a" in err and "gpu-2" in err


def test_health_stream_reports_every_device_and_an_unhealthy_gpu(node: Node) -> None:
    client = node.serve()
    stream = client.health_stream()
    first = next(stream)
    names = {d.device.device_name: d.health for d in first.devices}
    assert set(names) == set(node.driver.plan.devices)
    assert set(names.values()) == {1}  # HEALTHY
    node.nvml.inject("GPU-node-a-02", 79, "fell off the bus")
    assert node.driver.health_step(1.0)
    second = next(stream)
    health = {d.device.device_name: d.health for d in second.devices}
    assert health["gpu-2"] == 2  # UNHEALTHY
    assert health["gpu-0"] == 1
    assert all(d.device.pool_name == NODE and d.health_check_timeout_seconds > 0
               for d in second.devices)
    stream.cancel()
    assert dra.UNHEALTHY_TAINT  # the slice side is tested in test_slices
