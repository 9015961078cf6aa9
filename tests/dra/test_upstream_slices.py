"""The DRA driver against the upstream rules for what it publishes and writes: ResourceSlices
(resource/v1 types.go, validation.go, resourceslicecontroller.go), the claim allocator's taint,
CDI specs (SPEC.md) and device nodes, the time-slice opaque config and the order its sockets
appear in; one test per rule, each naming the upstream file and function it comes from (the
sources: test_upstream_rules.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from gpuslice.adapters.kube.dra import ALLOCATOR_TAINT as ALLOCATOR_SIDE_TAINT
from gpuslice.adapters.kube.dra import slice_devices
from gpuslice.adapters.nvml.caps import cap_minor, mig_cap_minors
from gpuslice.adapters.nvml.port import NvmlError
from gpuslice.core import dra
from gpuslice.core.dra import slices as dra_slices
from gpuslice.services.dra_driver import DraServer
from tests.dra.conftest import NODE, Node, claim, make_node, opaque
from tests.dra.upstream_helpers import (
    CDI_NAME,
    DNS_LABEL,
    DNS_SUBDOMAIN,
    LEASE,
    cdi_spec,
    devices,
    env,
    renew,
    share,
    slices,
)

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
    # with its GPU's UUID, which a pod's selection by UUID is judged by (core.gpuselect)
    (share,) = slice_devices(slices(node), dra.DRIVER, require_taint=True)[NODE]
    assert share.uuid.startswith("GPU-") and \
        share.uuid == devices(node)["gpu-0"]["attributes"]["uuid"]["string"]
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
