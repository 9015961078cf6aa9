"""The DRA driver against the rules an independent harness written from the upstream sources
would check, one test per rule, each naming the upstream file and function it comes from:
the plugin's registration, NodePrepareResources / NodeUnprepareResources and health here;
ResourceSlices, the allocator's taint, CDI, opaque config and serving order in
test_upstream_slices.py.
Everything runs over the real transports (gRPC on unix sockets, the kubelet side written
from its behaviour in tests/dra/kubelet.py) with fakes only behind the ports (NVML, the API
server).

Sources (see shared/reference/dra.md for commits): kubernetes/kubelet pkg/apis/dra/v1 and
v1beta1 api.proto, pluginregistration/v1 api.proto, dra-health/v1alpha1 api.proto;
kubernetes/dynamic-resource-allocation kubeletplugin/draplugin.go and
resourceslice/resourceslicecontroller.go; kubernetes/kubernetes pkg/kubelet/cm/dra
(healthinfo.go, plugin/registration.go), pkg/apis/resource/validation/validation.go,
pkg/registry/resource/resourceslice/strategy.go; k8s.io/api resource/v1 types.go; the CDI
SPEC.md.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuslice.adapters.kubelet import dra_v1_pb2 as v1
from gpuslice.adapters.kubelet import dra_v1_pb2_grpc as v1g
from gpuslice.adapters.kubelet import dra_v1beta1_pb2 as v1beta1
from gpuslice.adapters.kubelet import dra_v1beta1_pb2_grpc as v1beta1g
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2 as rpb
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2_grpc as rpbg
from gpuslice.core import dra
from tests.dra.conftest import NODE, Node, claim, make_node
from tests.dra.upstream_helpers import (
    DNS_SUBDOMAIN,
    cdi_spec,
    devices,
    env,
    share,
    slices,
)

# -- registration (pluginregistration/v1 api.proto; kubeletplugin draplugin.go Start) --------

def test_get_info_names_the_plugin_its_socket_and_its_services_in_the_helpers_order(
        node: Node) -> None:
    """draplugin.go ``Start``: supportedServices = v1.DRAPlugin, v1beta1.DRAPlugin, then
    v1alpha1.DRAResourceHealth when the plugin implements it; registration.go
    (``validateSupportedServices``) refuses an empty list; constants.go: type DRAPlugin."""
    node.serve()
    with grpc.insecure_channel(f"unix://{node.cfg.registration_socket}") as ch:
        info = rpbg.RegistrationStub(ch).GetInfo(rpb.InfoRequest(), timeout=10)
    assert info.type == "DRAPlugin"
    assert info.name == dra.DRIVER and DNS_SUBDOMAIN.match(info.name)
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin",
                                             "v1alpha1.DRAResourceHealth"]
    assert Path(info.endpoint).is_absolute() and Path(info.endpoint).is_socket()
    assert Path(info.endpoint).name == "dra.sock"
    assert Path(info.endpoint).parent.name == dra.DRIVER  # plugins/<driver>/dra.sock


def test_a_refused_registration_is_logged_and_the_plugin_keeps_serving(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """registrationserver.go ``NotifyRegistrationStatus``: the kubelet's verdict is recorded
    (``RegistrationStatus``) and answered; an error does not stop the plugin, the kubelet may
    retry the registration."""
    node.serve()
    with grpc.insecure_channel(f"unix://{node.cfg.registration_socket}") as ch:
        stub = rpbg.RegistrationStub(ch)
        stub.NotifyRegistrationStatus(rpb.RegistrationStatus(
            plugin_registered=False, error="version check failed"), timeout=10)
        stub.NotifyRegistrationStatus(rpb.RegistrationStatus(plugin_registered=True),
                                      timeout=10)
        assert stub.GetInfo(rpb.InfoRequest(), timeout=10).name == dra.DRIVER
    assert (False, "version check failed") in node.driver.registration
    assert any("version check failed" in r.message for r in caplog.records)
    client = node.client
    assert client is not None
    ref = node.add(claim("after", [{"request": "gpu", "device": "gpu-2"}]))
    assert client.prepare([ref])[ref[1]].error == ""


# -- NodePrepareResources / NodeUnprepareResources (dra/v1, dra/v1beta1 api.proto) ------------

def _both(node: Node, claims: list[tuple[str, str, str]]) -> tuple[Any, Any]:
    with grpc.insecure_channel(f"unix://{node.cfg.dra_socket}") as ch:
        a = v1g.DRAPluginStub(ch).NodePrepareResources(v1.NodePrepareResourcesRequest(
            claims=[v1.Claim(namespace=n, uid=u, name=m) for n, u, m in claims]), timeout=10)
        b = v1beta1g.DRAPluginStub(ch).NodePrepareResources(
            v1beta1.NodePrepareResourcesRequest(
                claims=[v1beta1.Claim(namespace=n, uid=u, name=m) for n, u, m in claims]),
            timeout=10)
    return a, b


def test_v1_and_v1beta1_answer_the_same_and_only_v1_carries_share_ids(node: Node) -> None:
    """KEP-4381: "v1beta1 and v1 are supported by kubelet. Both are identical"; dra/v1
    api.proto Device.share_id (field 5, 1.35) has no v1beta1 counterpart (draplugin.go
    registers the v1beta1 service as a wrapper of the same implementation)."""
    node.serve()
    refs = [node.add(share("s", "sid-1", "25", "8Gi")),
            node.add(claim("w", [{"request": "gpu", "device": "gpu-2"}]))]
    a, b = _both(node, refs)
    assert set(a.claims) == set(b.claims) == {r[1] for r in refs}
    for _, uid, _ in refs:
        assert a.claims[uid].error == b.claims[uid].error == ""
        da = [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
              for d in a.claims[uid].devices]
        db = [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
              for d in b.claims[uid].devices]
        assert da == db
    assert a.claims[refs[0][1]].devices[0].share_id == "sid-1"
    assert not a.claims[refs[1][1]].devices[0].HasField("share_id")
    assert "share_id" not in v1beta1.Device.DESCRIPTOR.fields_by_name


def test_an_empty_request_gets_an_empty_answer(node: Node) -> None:
    """dra/v1 api.proto: the response maps every claim of the request; none asked, none
    answered, and no error for the call."""
    client = node.serve()
    assert client.prepare([]) == {}
    assert client.unprepare([]) == {}


def test_a_claim_listed_twice_is_prepared_once(node: Node) -> None:
    """draplugin.go ``PrepareResourceClaims``: "the result must have exactly one entry for
    each claim, identified by the UID"; the map answer has one key per UID."""
    client = node.serve()
    ref = node.add(share("dup", "sid-1", "30", "4Gi"))
    got = client.prepare([ref, ref])
    assert list(got) == [ref[1]] and got[ref[1]].error == ""
    assert len(got[ref[1]].devices) == 1
    # held once: 30% + 70% fit the GPU
    other = node.add(share("rest", "sid-2", "70", "4Gi"))
    assert client.prepare([other])[other[1]].error == ""


def test_claims_missing_a_required_field_are_refused_per_claim(node: Node) -> None:
    """dra/v1 api.proto Claim: namespace, uid and name are all "REQUIRED"."""
    client = node.serve()
    good = node.add(claim("good", [{"request": "gpu", "device": "gpu-2"}]))
    got = client.prepare([good, ("default", "uid-no-name", "")])
    assert got[good[1]].error == ""
    assert "claims[1].name: required" in got["uid-no-name"].error


def test_several_requests_devices_drivers_and_a_subrequest_in_one_claim(node: Node) -> None:
    """types.go DeviceRequestAllocationResult.Request ("<main>/<sub>" for a subrequest);
    draplugin.go ``stripSubrequestNames``; results of other drivers are theirs; every device
    of ours gets its own CDI device."""
    client = node.serve()
    c = claim("many", [{"request": "whole/t4", "device": "gpu-2"},
                       {"request": "mig", "device": "gpu-1-mig-1g10gb-0"},
                       {"request": "mig", "device": "gpu-1-mig-1g10gb-1"}])
    c["status"]["allocation"]["devices"]["results"].insert(1, {
        "request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "eth0"})
    ref = node.add(c)
    got = client.prepare([ref])[ref[1]]
    assert got.error == ""
    assert [(d.device_name, list(d.request_names)) for d in got.devices] == [
        ("gpu-2", ["whole"]), ("gpu-1-mig-1g10gb-0", ["mig"]), ("gpu-1-mig-1g10gb-1", ["mig"])]
    ids = [i for d in got.devices for i in d.cdi_device_ids]
    assert len(ids) == len(set(ids)) == 3
    assert sorted(node.nvml.mig_layout("GPU-node-a-01")) == [("1g.10gb", 0), ("1g.10gb", 1)]


def test_a_claim_with_no_result_of_ours_prepares_to_nothing(node: Node) -> None:
    """draplugin.go PrepareResult.Devices: "The empty slice is also valid"."""
    client = node.serve()
    c = claim("theirs", [])
    c["status"]["allocation"]["devices"]["results"] = [
        {"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "eth0"}]
    ref = node.add(c)
    got = client.prepare([ref])[ref[1]]
    assert got.error == "" and list(got.devices) == []
    assert not node.driver.cdi.path(ref[1]).exists()
    assert client.unprepare([ref]) == {ref[1]: ""}


def test_admin_access_is_granted_on_a_device_in_use_and_holds_nothing(node: Node) -> None:
    """types.go DeviceRequestAllocationResult.AdminAccess: "the device may be in use by
    others" (monitoring); the driver's last line of defense must not refuse it, and it takes
    no capacity from the users' claims."""
    client = node.serve()
    whole = node.add(claim("user", [{"request": "gpu", "device": "gpu-2"}]))
    full = node.add(share("full", "sid-1", "100", "80Gi"))
    admin = node.add(claim("admin", [
        {"request": "mon", "device": "gpu-2", "adminAccess": True},
        {"request": "mon", "device": "gpu-0", "adminAccess": True, "shareID": "sid-adm"}]))
    got = client.prepare([whole, full, admin])
    assert {uid: r.error for uid, r in got.items()} == {whole[1]: "", full[1]: "",
                                                        admin[1]: ""}
    (d2, d0) = cdi_spec(node, admin[1])["devices"]
    assert env(d2)["CUDA_VISIBLE_DEVICES"] == "GPU-node-a-02"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env(d0)  # no share limits
    assert client.unprepare([admin]) == {admin[1]: ""}
    # and the users still hold everything
    late = node.add(share("late", "sid-2", "1", "256Mi"))
    assert "over-committed" in client.prepare([late])[late[1]].error


def test_a_replaced_claim_is_refused_even_after_its_predecessor_was_prepared(
        node: Node) -> None:
    """draplugin.go ``getResourceClaims``: a claim whose UID differs from the kubelet's "got
    replaced"; the claim is read before anything is answered."""
    client = node.serve()
    ref = node.add(claim("w", [{"request": "gpu", "device": "gpu-2"}], uid="uid-old"))
    assert client.prepare([ref])[ref[1]].error == ""
    node.api.delete_resource_claim("default", "w")
    node.add(claim("w", [{"request": "gpu", "device": "gpu-2"}], uid="uid-new"))
    err = client.prepare([ref])["uid-old"].error
    assert "got replaced" in err and "uid-new" in err


def test_unprepare_of_unknown_never_prepared_and_twice_unprepared_claims_succeeds(
        node: Node) -> None:
    """draplugin.go ``UnprepareResourceClaims``: "it is not an error if this gets called
    for a ResourceClaim which is not currently prepared"; every claim has an entry."""
    client = node.serve()
    ref = node.add(claim("w", [{"request": "gpu", "device": "gpu-2"}]))
    failed = node.add(share("bad", "sid-9", "150", "1Gi"))  # a prepare that failed
    assert client.prepare([ref])[ref[1]].error == ""
    assert client.prepare([failed])[failed[1]].error != ""
    got = client.unprepare([ref, failed, ("ns", "never", "seen")])
    assert got == {ref[1]: "", failed[1]: "", "never": ""}
    assert client.unprepare([ref]) == {ref[1]: ""}


def test_concurrent_prepares_of_one_claim_give_one_answer(node: Node) -> None:
    """draplugin.go: prepare "must be idempotent"; the helper serializes calls; the CDI IDs
    of a claim never change (the runtime may cache them)."""
    client = node.serve()
    ref = node.add(share("s", "sid-1", "40", "8Gi"))
    answers: list[Any] = []
    threads = [threading.Thread(target=lambda: answers.append(client.prepare([ref])[ref[1]]))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(answers) == 4 and all(a == answers[0] for a in answers)
    assert answers[0].error == ""
    assert list(answers[0].devices[0].cdi_device_ids) == [
        f"k8s.gpu.gpuslice.io/claim={ref[1]}-gpu-0-sid-1"]


def test_concurrent_claims_on_one_whole_gpu_get_it_once(node: Node) -> None:
    """draplugin.go ``DRAPlugin``: the driver is "the last line of defense against using the
    same device for two different unrelated workloads", also when both arrive at once."""
    client = node.serve()
    refs = [node.add(claim(f"c{i}", [{"request": "gpu", "device": "gpu-2"}]))
            for i in range(4)]
    errors: dict[str, str] = {}
    threads = [threading.Thread(target=lambda r=r: errors.update(
        {r[1]: client.prepare([r])[r[1]].error})) for r in refs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 4
    assert sum(e == "" for e in errors.values()) == 1
    assert all("prepared for claim" in e for e in errors.values() if e)


def test_mps_shares_of_two_gpus_in_one_claim_are_refused_clearly(short_dir: Path) -> None:
    """One CUDA process talks to one MPS control daemon (CUDA_MPS_PIPE_DIRECTORY, one
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so the CDI edits of two GPUs' shares would collide
    in a container using both: refused, naming the way out."""
    n = make_node(short_dir, [{"model": "H100-SXM"}, {"model": "H100-SXM"}],
                  {"0": dra.SHARE, "1": dra.SHARE})
    try:
        client = n.serve()
        two = n.add(claim("two", [
            {"request": "a", "device": "gpu-0", "shareID": "s-a",
             "consumedCapacity": {"compute": "20", "memory": "4Gi"}},
            {"request": "b", "device": "gpu-1", "shareID": "s-b",
             "consumedCapacity": {"compute": "20", "memory": "4Gi"}}]))
        err = client.prepare([two])[two[1]].error
        assert "MPS on 2 GPUs" in err and "its own claim" in err
        assert not n.driver.cdi.path(two[1]).exists()
        one = n.add(claim("one", [{"request": "a", "device": "gpu-1", "shareID": "s-c",
                                   "consumedCapacity": {"compute": "20", "memory": "4Gi"}}]))
        assert client.prepare([one])[one[1]].error == ""
    finally:
        n.stop()


# -- health (dra-health/v1alpha1 api.proto; kubelet healthinfo.go) ----------------------------

def test_health_messages_are_complete_match_the_slices_and_repeat_before_the_timeout(
        short_dir: Path) -> None:
    """dra-health api.proto NodeWatchResourcesResponse: "a complete list for the driver";
    DeviceIdentifier pool/device as published; last_updated_time in unix seconds;
    healthinfo.go ``getHealthInfo``: a device whose last report is older than
    health_check_timeout_seconds reads Unknown, so the list must come again before that even
    when nothing changes."""
    n = make_node(short_dir, [{"model": "H100-SXM", "mig_enabled": True}, {"model": "T4"}],
                  {"0": dra.MIG}, health_timeout_s=30, health_resend_s=0.2)
    try:
        client = n.serve()
        stream = client.health_stream()
        before = int(time.time())
        first, second = next(stream), next(stream)  # the second without any change
        after = int(time.time())
        published = {(s["spec"]["pool"]["name"], d["name"]) for s in slices(n)
                     for d in s["spec"].get("devices") or []}
        for msg in (first, second):
            got = {(d.device.pool_name, d.device.device_name) for d in msg.devices}
            assert got == published
            assert all(before <= d.last_updated_time <= after for d in msg.devices)
            assert all(d.health_check_timeout_seconds == 30 for d in msg.devices)
        assert n.driver.cfg.health_resend < n.driver.cfg.health_timeout_s
        stream.cancel()
    finally:
        n.stop()


def test_a_prepared_device_left_out_of_the_slices_is_still_reported_unhealthy(
        short_dir: Path) -> None:
    """dra-health api.proto: devices not in the list turn Unknown; a GPU removed from the
    slices for being unhealthy (no taints) is still in use by its pods, which must see it
    Unhealthy (KEP-4680 allocatedResourcesStatus)."""
    n = make_node(short_dir, [{"model": "T4"}, {"model": "T4"}], {}, taints=False)
    try:
        client = n.serve()
        ref = n.add(claim("w", [{"request": "gpu", "device": "gpu-1"}]))
        assert client.prepare([ref])[ref[1]].error == ""
        n.nvml.inject("GPU-node-a-01", 79, "fell off the bus")
        assert n.driver.health_step(0.5)
        assert set(devices(n)) == {"gpu-0"}
        health = {(d.device.device_name, d.health) for d in next(client.health_stream()).devices}
        assert health == {("gpu-0", 1), ("gpu-1", 2)}  # HEALTHY, UNHEALTHY
    finally:
        n.stop()
