"""The DRA driver against the rules an independent harness written from the upstream sources
would check, one test per rule, each naming the upstream file and function it comes from.
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

import json
import re
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuslice.adapters.kube.dra import ALLOCATOR_TAINT as ALLOCATOR_SIDE_TAINT
from gpuslice.adapters.kube.dra import slice_devices
from gpuslice.adapters.kubelet import dra_v1_pb2 as v1
from gpuslice.adapters.kubelet import dra_v1_pb2_grpc as v1g
from gpuslice.adapters.kubelet import dra_v1beta1_pb2 as v1beta1
from gpuslice.adapters.kubelet import dra_v1beta1_pb2_grpc as v1beta1g
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2 as rpb
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2_grpc as rpbg
from gpuslice.adapters.nvml.caps import cap_minor, mig_cap_minors
from gpuslice.adapters.nvml.port import NvmlError
from gpuslice.core import dra
from gpuslice.core.dra import slices as dra_slices
from gpuslice.services.dra_driver import DraServer
from tests.dra.conftest import NODE, Node, claim, make_node, opaque

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
CDI_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
LEASE = ("gpuslice-system", "gpuslice-dra-allocator")


def slices(node: Node) -> list[dict[str, Any]]:
    return node.api.list_resource_slices(dra.DRIVER, NODE)


def devices(node: Node) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices(node) for d in s["spec"].get("devices") or []}


def share(name: str, sid: str, compute: str, memory: str, device: str = "gpu-0",
          **kw: Any) -> dict[str, Any]:
    return claim(name, [{"request": "gpu", "device": device, "shareID": sid,
                         "consumedCapacity": {"compute": compute, "memory": memory}}], **kw)


def cdi_spec(node: Node, uid: str) -> dict[str, Any]:
    return dict(json.loads(node.driver.cdi.path(uid).read_text()))


def env(spec_device: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec_device["containerEdits"].get("env", []))


def renew(node: Node, seconds_ago: float, holder: str = "allocator-0") -> None:
    stamp = datetime.fromtimestamp(time.time() - seconds_ago, UTC).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")
    cur = node.api.get_lease(*LEASE)
    node.api.put_lease(*LEASE, {"holderIdentity": holder, "leaseDurationSeconds": 15,
                                "renewTime": stamp},
                       cur["metadata"]["resourceVersion"] if cur else None)


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


# -- ResourceSlices (resource/v1 types.go, validation.go, resourceslicecontroller.go) ---------

def _check_pool(pool: list[dict[str, Any]]) -> None:
    """validation.go ``validateResourceSliceSpec`` and friends, over a whole pool."""
    counters: dict[str, dict[str, int]] = {}
    count = len(pool)
    gens = {s["spec"]["pool"]["generation"] for s in pool}
    assert len(gens) == 1
    for s in pool:
        spec = s["spec"]
        assert DNS_SUBDOMAIN.match(s["metadata"]["name"]) and len(s["metadata"]["name"]) <= 253
        assert dra.slice_problems(spec) == [], dra.slice_problems(spec)
        assert spec["pool"]["resourceSliceCount"] == count
        assert not ("devices" in spec and "sharedCounters" in spec)  # 1.35
        for cs in spec.get("sharedCounters") or []:
            counters[cs["name"]] = {k: int(v["value"]) for k, v in cs["counters"].items()}
    for s in pool:
        for d in s["spec"].get("devices") or []:
            assert DNS_LABEL.match(d["name"]) and len(d["name"]) <= 63
            assert len(d.get("attributes", {})) + len(d.get("capacity", {})) <= 32
            for c in d.get("consumesCounters") or []:
                have = counters[c["counterSet"]]  # a set of the same pool
                for k, v in c["counters"].items():
                    assert int(v["value"]) <= have[k], (d["name"], k)
            for t in d.get("taints") or []:
                assert t["effect"] in ("NoSchedule", "NoExecute", "None")


def test_every_slice_of_every_model_passes_the_api_servers_validation(node: Node) -> None:
    """validation.go: names are DNS labels (devices, counters) or subdomains (slices,
    driver), attribute names qualified (C identifier <= 32), strings <= 64, versions semver,
    capacities quantities with valid request policies, <= 32 attributes + capacities, <= 64
    devices with counters or taints, counters only in their own slices, each consumption
    within its counter set of the pool; the pool's resourceSliceCount is its slice count."""
    node.nvml.inject("GPU-node-a-00", 48, "ECC")
    node.driver.health_step(0.5)  # a taint too
    pool = slices(node)
    assert any(s["spec"].get("sharedCounters") for s in pool)
    _check_pool(pool)
    versions = [a["version"] for d in devices(node).values()
                for a in d["attributes"].values() if "version" in a]
    assert versions and all(dra_slices._SEMVER.match(v) for v in versions)


def test_a_republish_of_the_same_devices_writes_nothing_against_a_canonicalizing_server(
        node: Node) -> None:
    """resourceslicecontroller.go ``syncPool`` compares with apiequality.Semantic and
    ``DevicesDeepEqual``: kube-apiserver returns quantities canonical (81920Mi reads 80Gi)
    and stamps taints' timeAdded (types.go DeviceTaint), neither is a change."""
    node.nvml.inject("GPU-node-a-02", 48, "ECC")
    node.driver.health_step(0.5)
    stored = slices(node)
    assert any(d["capacity"]["memory"]["value"] == "80Gi" for s in stored
               for d in s["spec"].get("devices") or [] if d["name"] == "gpu-0")
    gen = stored[0]["spec"]["pool"]["generation"]
    for _ in range(3):
        assert not node.driver.resync()
    assert slices(node) == stored
    assert node.driver.publisher.generation == gen


def test_taints_that_stay_keep_their_time_added_across_a_new_generation(node: Node) -> None:
    """resourceslicecontroller.go ``copyTaintTimeAdded``: an update keeps the stored
    timeAdded of a taint that is still wanted."""
    node.nvml.inject("GPU-node-a-02", 48, "ECC")
    node.driver.health_step(0.5)
    stamp = devices(node)["gpu-2"]["taints"][0]["timeAdded"]
    node.nvml.inject("GPU-node-a-00", 48, "ECC")  # another change: a new generation
    time.sleep(1.1)  # a later write would stamp a later second
    node.driver.health_step(0.5)
    assert devices(node)["gpu-2"]["taints"][0]["timeAdded"] == stamp
    assert devices(node)["gpu-0"]["taints"]


def test_slices_deleted_behind_the_drivers_back_come_back_with_a_higher_generation(
        node: Node) -> None:
    """plugin/registration.go ``wipeResourceSlices``: the kubelet deletes a node's slices at
    its start; the resourceslice controller recreates what its informer sees missing. Pool
    generations only go up (types.go ResourcePool.Generation: consumers use the highest)."""
    before = slices(node)
    gen = before[0]["spec"]["pool"]["generation"]
    for s in before:
        node.api.delete_resource_slice(s["metadata"]["name"])
    assert slices(node) == []
    assert node.driver.resync()
    after = slices(node)
    assert len(after) == len(before)
    assert {s["spec"]["pool"]["generation"] for s in after} == {gen + 1}
    _check_pool(after)
    node.driver.tick(0.01)  # the loop's periodic resync finds nothing to do
    assert slices(node) == after


# -- the claim allocator's taint (docs/dra-placement.md, issue 21) ----------------------------

def test_consumable_devices_carry_the_allocator_taint_while_its_lease_is_fresh(
        node: Node) -> None:
    """docs/dra-placement.md: while the Lease gpuslice-system/gpuslice-dra-allocator was
    renewed within its leaseDurationSeconds, each consumable-capacity device carries
    gpu.gpuslice.io/allocator:NoSchedule (which kube-scheduler's allocator does not allocate:
    structured allocator ``taintPreventsAllocation``); stale or gone, the taint goes."""
    assert dra.ALLOCATOR_TAINT == ALLOCATOR_SIDE_TAINT  # the allocator reads the same key

    def tainted() -> set[str]:
        return {name for name, d in devices(node).items()
                if any(t["key"] == dra.ALLOCATOR_TAINT and t["effect"] == "NoSchedule"
                       for t in d.get("taints") or [])}

    assert tainted() == set()
    renew(node, 1)
    assert node.driver.check_allocator()
    assert tainted() == {"gpu-0"}  # the share device; MIG placements and whole GPUs: not
    # the allocator's own reading of our slices now offers it the device
    assert [d.name for d in slice_devices(slices(node), dra.DRIVER,
                                          require_taint=True)[NODE]] == ["gpu-0"]
    assert not node.driver.check_allocator()  # still fresh: nothing written
    renew(node, 60)  # stale: its holder stopped renewing
    assert node.driver.check_allocator()
    assert tainted() == set()
    renew(node, 0)
    node.driver.tick(0.01)  # the background loop notices
    assert tainted() == {"gpu-0"}
    node.api._leases.clear()  # deleted
    node.driver._due.clear()
    node.driver.tick(0.01)
    assert tainted() == set()
    _check_pool(slices(node))


def test_no_allocator_taint_where_the_api_server_drops_taints(short_dir: Path) -> None:
    """strategy.go ``dropDisabledDRADeviceTaintsFields``: without DRADeviceTaints the field
    is dropped, so the driver does not rely on it (the allocator then needs race mode)."""
    n = make_node(short_dir, [{"model": "H100-SXM"}], {"0": dra.SHARE},
                  features=dra.Features(taints=False))
    try:
        renew(n, 0)
        n.driver.check_allocator()
        assert "taints" not in devices(n)["gpu-0"]
    finally:
        n.stop()


# -- CDI (SPEC.md) and device nodes -----------------------------------------------------------

def test_device_nodes_use_nvmls_minor_number_and_mig_gets_its_capability_nodes(
        short_dir: Path) -> None:
    """/dev/nvidia<minor> is NVML's minor number (nvmlDeviceGetMinorNumber), not the index;
    a MIG device needs /dev/nvidia-caps/nvidia-cap<N> of its GPU and compute instance, N from
    /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>[/ci<c>]/access."""
    n = make_node(short_dir, [{"model": "T4", "minor": 3},
                              {"model": "A100-80GB", "mig_enabled": True, "minor": 0}],
                  {"1": dra.MIG})
    try:
        client = n.serve()
        w = n.add(claim("w", [{"request": "gpu", "device": "gpu-0"}]))
        m = n.add(claim("m", [{"request": "mig", "device": "gpu-1-mig-3g40gb-4"}]))
        got = client.prepare([w, m])
        assert got[w[1]].error == "" and got[m[1]].error == ""
        (wd,) = cdi_spec(n, w[1])["devices"]
        paths = [x["path"] for x in wd["containerEdits"]["deviceNodes"]]
        assert f"{n.cfg.dev_dir}/nvidia3" in paths and f"{n.cfg.dev_dir}/nvidia0" not in paths
        (md,) = cdi_spec(n, m[1])["devices"]
        mig_uuid = env(md)["CUDA_VISIBLE_DEVICES"]
        gi, ci = n.nvml.mig_cap_minors("GPU-node-a-01", mig_uuid)
        paths = [x["path"] for x in md["containerEdits"]["deviceNodes"]]
        assert f"{n.cfg.dev_dir}/nvidia0" in paths
        assert {f"{n.cfg.dev_dir}/nvidia-caps/nvidia-cap{gi}",
                f"{n.cfg.dev_dir}/nvidia-caps/nvidia-cap{ci}"} <= set(paths)
    finally:
        n.stop()


def test_capability_minors_are_read_from_the_proc_files(tmp_path: Path) -> None:
    """The layout NVIDIA's plugins read: gpu<minor>/mig/gi<g>/access and
    gpu<minor>/mig/gi<g>/ci<c>/access, each with a ``DeviceFileMinor: N`` line."""
    gi_dir = tmp_path / "gpu2" / "mig" / "gi7"
    (gi_dir / "ci0").mkdir(parents=True)
    (gi_dir / "access").write_text("DeviceFileMinor: 66\nDeviceFileMode: 292\n"
                                   "DeviceFileModify: 1\n")
    (gi_dir / "ci0" / "access").write_text("DeviceFileMinor: 67\nDeviceFileMode: 292\n")
    assert mig_cap_minors(2, 7, 0, tmp_path) == (66, 67)
    with pytest.raises(NvmlError, match="DeviceFileMinor"):
        cap_minor("DeviceFileMode: 292\n", "x")
    with pytest.raises(NvmlError, match="/proc/driver/nvidia"):
        mig_cap_minors(2, 8, 0, tmp_path)


def test_cdi_ids_and_names_follow_the_spec_and_the_helpers_advice(node: Node) -> None:
    """CDI SPEC.md: ``kind`` is ``vendor/class``, device names of letters, digits and
    ``-_.:``, IDs ``kind=name``; draplugin.go: the unique name should not be reused, use the
    claim UID; each spec file named after its claim and removed on unprepare."""
    client = node.serve()
    refs = [node.add(share("s", "sid-1", "20", "2Gi")),
            node.add(claim("w", [{"request": "gpu", "device": "gpu-2"}]))]
    got = client.prepare(refs)
    for _, uid, _ in refs:
        spec = cdi_spec(node, uid)
        assert re.match(r"^[a-z0-9.-]+/[a-zA-Z0-9_.-]+$", spec["kind"])
        for d in spec["devices"]:
            assert CDI_NAME.match(d["name"]) and d["name"].startswith(uid)
        assert sorted(f"{spec['kind']}={d['name']}" for d in spec["devices"]) == sorted(
            i for d in got[uid].devices for i in d.cdi_device_ids)
    assert client.unprepare(refs) == {r[1]: "" for r in refs}
    assert node.driver.cdi.claims() == set()


# -- opaque config: the time-slice interval ---------------------------------------------------

def _ts(interval: str) -> dict[str, Any]:
    return opaque({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuConfig",
                   "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}})


def test_the_time_slice_interval_is_applied_and_reset_on_unprepare(node: Node) -> None:
    """GpuConfig sharing.timeSlicing.interval: Default/Short/Medium/Long are nvidia-smi
    compute-policy --set-timeslice 0..3 (what NVIDIA's DRA driver sets); the next claim
    starts from the default."""
    client = node.serve()
    ref = node.add(claim("ts", [{"request": "gpu", "device": "gpu-2"}], config=[_ts("Long")]))
    assert client.prepare([ref])[ref[1]].error == ""
    assert node.nvml.timeslice["GPU-node-a-02"] == 3
    assert client.unprepare([ref]) == {ref[1]: ""}
    assert node.nvml.timeslice["GPU-node-a-02"] == 0


def test_a_time_slice_the_gpu_cannot_take_fails_the_claim_naming_the_field(node: Node) -> None:
    """No silent default: a GPU or driver that cannot set the interval fails that claim."""
    client = node.serve()
    node.nvml.timeslice_supported = False
    ref = node.add(claim("ts", [{"request": "gpu", "device": "gpu-2"}], config=[_ts("Short")]))
    err = client.prepare([ref])[ref[1]].error
    assert "sharing.timeSlicing.interval 'Short'" in err and "not supported" in err
    assert not node.driver.cdi.path(ref[1]).exists()


# -- serving: the DRA socket comes before the registration socket -----------------------------

def test_the_dra_socket_serves_before_the_registration_socket_appears(node: Node) -> None:
    """draplugin.go ``Start``: "Run the node plugin gRPC server first to ensure that it is
    ready", then the registrar: the kubelet never finds a registration it cannot follow."""
    server = DraServer(node.driver)
    server.start()
    try:
        assert node.cfg.dra_socket.is_socket() and node.cfg.registration_socket.is_socket()
        assert node.cfg.dra_socket.stat().st_mtime_ns <= \
            node.cfg.registration_socket.stat().st_mtime_ns
    finally:
        server.stop()
    assert not node.cfg.registration_socket.exists() and not node.cfg.dra_socket.exists()


def test_a_gate_turned_off_after_start_is_noticed_and_the_pool_falls_back(node: Node) -> None:
    """strategy.go ``dropDisabledFields`` drops a disabled gate's fields silently; the Go
    resourceslice controller reports that as a ``DroppedFieldsError`` to the driver's
    ``HandleError`` (draplugin.go). Here the driver notices the stored slice differs from
    what it wrote, detects the served features again and publishes the fallback, instead of
    rewriting the same slices every resync."""
    node.api.dra_gates = {"DRADeviceTaints"}  # consumable capacity and partitioning now off
    node.nvml.inject("GPU-node-a-02", 48, "ECC")  # any change makes the driver write
    node.driver.health_step(0.5)
    assert node.driver.features == dra.Features(False, False, True)
    types = {name: d["attributes"]["type"]["string"] for name, d in devices(node).items()}
    assert types["gpu-0"] == "gpu"  # the share device fell back to a whole GPU
    assert not any(s["spec"].get("sharedCounters") for s in slices(node))
    assert any(e["reason"] == "DroppedFields" for e in node.api.events)
    gen = node.driver.publisher.generation
    assert not node.driver.resync() and node.driver.publisher.generation == gen


def test_fields_a_newer_api_server_adds_are_not_differences(node: Node) -> None:
    """resourceslicecontroller.go compares the fields it manages; a field the server adds
    (a default of a newer release) must not make the driver rewrite its pool forever."""
    for s in slices(node):
        s["spec"]["skipNodeOperations"] = []
        for d in s["spec"].get("devices") or []:
            d["bindsToNode"] = False
        node.api._slices[s["metadata"]["name"]] = s
    assert not node.driver.resync()


def test_the_taint_protocol_end_to_end_over_http_with_the_allocators_own_elector(
        short_dir: Path) -> None:
    """docs/dra-placement.md with the real pieces: the allocator's LeaderElector (the
    extender's, coordination/v1 Lease) holds the Lease through the Kubernetes client, the
    driver reads it through the Kubernetes client, and the allocator's slice reader then
    finds our share device tainted for it; a lease its holder stopped renewing lifts it."""
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.services.dra_driver import DraConfig, DraDriver
    from gpuslice.services.leader import LeaderElector
    from tests.dra.conftest import inventory
    from tests.fake_mps import write_fake_mps
    from tests.kube.rest_fake import RestApiServer

    rest = RestApiServer().start()
    try:
        rest.add_node({"metadata": {"name": NODE, "uid": "node-uid"}})
        api = KubeClient(str(rest.kubeconfig(short_dir / "kc")))
        nvml = FakeNvml.from_yaml(inventory(short_dir / "g.yaml", [{"model": "H100-SXM"},
                                                                   {"model": "T4"}]), NODE)
        cfg = DraConfig(NODE, kubelet_dir=short_dir / "k", cdi_dir=short_dir / "cdi",
                        mps_pipe_dir=str(short_dir / "mps"),
                        mps_binary=str(write_fake_mps(short_dir / "mps-control")),
                        modes={"0": dra.SHARE})
        driver = DraDriver(cfg, nvml, api)
        driver.start()

        def usable() -> list[str]:
            got = slice_devices(rest.list_resource_slices(dra.DRIVER, NODE), dra.DRIVER,
                                require_taint=True)
            return [d.name for d in got.get(NODE, [])]

        assert usable() == []
        elector = LeaderElector(api, *LEASE, "allocator-0", time.time)
        assert elector.step()
        assert driver.check_allocator() and usable() == ["gpu-0"]
        # the holder dies: its last renewal ages past leaseDurationSeconds (15 s)
        old = LeaderElector(api, *LEASE, "allocator-0", lambda: time.time() - 60)
        assert old.step()
        assert driver.check_allocator() and usable() == []
        _check_pool(rest.list_resource_slices(dra.DRIVER, NODE))
    finally:
        rest.stop()


def test_slice_names_stay_dns_subdomains_for_the_longest_node_names() -> None:
    """validation.go ``ValidateResourceSlice``: metadata.name is a DNS subdomain (<= 253);
    node names are DNS subdomains of up to 253 characters themselves."""
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.services.dra_driver import SlicePublisher

    for node_name in ("node-a", "a" * 253, ("n." * 126)[:-1], "x" * 230 + "-" * 2 + "y"):
        pub = SlicePublisher(FakeApiServer(), dra.DRIVER, node_name)
        for i in (0, 7, 123):
            name = pub.name(i)
            assert len(name) <= 253 and DNS_SUBDOMAIN.match(name), name
        assert len({pub.name(i) for i in range(20)}) == 20
