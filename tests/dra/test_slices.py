"""ResourceSlices: layout rules from k8s.io/api resource/v1 types.go (release-1.35:
ResourceSliceMaxDevices, ResourceSliceMaxDevicesWithTaintsOrConsumesCounters,
ResourceSliceMaxCounterSets, ResourceSliceMaxCountersPerCounterSet, "Only one of Devices and
SharedCounters can be set in a ResourceSlice", CapacityRequestPolicy rules, attribute
limits), the pool's generation and count (dynamic-resource-allocation resourceslice
controller), MIG counters (KEP-4815), feature fallback, health taints."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from gpuslice.core import catalog, dra
from gpuslice.core.devices import GpuDevice
from gpuslice.core.mig import MigPlacement, layout_problems
from tests.dra.conftest import NODE, Node, make_node


def facts(n: int, model: str = "H100-SXM", mig: bool = False) -> list[dra.GpuFacts]:
    m = catalog.lookup(model)
    assert m is not None
    return [dra.GpuFacts(GpuDevice(i, f"GPU-{i}", f"NVIDIA {m.name}", m.name, m.memory_mib,
                                   m.sms, m.compute_capability, mig), f"0000:{i:02x}:00.0",
                         "pci0000:00") for i in range(n)]


def full(spec: dict[str, Any], gen: int = 0, count: int = 1) -> dict[str, Any]:
    return {"driver": dra.DRIVER, "nodeName": NODE,
            "pool": {"name": NODE, "generation": gen, "resourceSliceCount": count}, **spec}


@pytest.mark.parametrize("mode", dra.MODES)
@pytest.mark.parametrize("gpus", [1, 8, 20])
def test_every_published_slice_keeps_the_api_limits(mode: str, gpus: int) -> None:
    plan = dra.pool_slices(facts(gpus, mig=mode == dra.MIG), {f"GPU-{i}": mode
                                                            for i in range(gpus)},
                           "580.95.05", dra.Features(), unhealthy={"GPU-0"})
    for s in plan.slices:
        assert dra.slice_problems(full(s, count=len(plan.slices))) == []
        assert not (s.get("devices") and s.get("sharedCounters"))
    names = [d["name"] for s in plan.slices for d in s.get("devices", [])]
    assert len(names) == len(set(names)) == len(plan.devices)
    if mode == dra.MIG:
        # 25 placements per H100 consume counters: at most 64 devices per slice
        assert len(names) == 25 * gpus
        assert max(len(s.get("devices", [])) for s in plan.slices) <= 64
        sets = [c for s in plan.slices for c in s.get("sharedCounters", [])]
        assert len(sets) == gpus
        assert all(len(s.get("sharedCounters", [])) <= 8 for s in plan.slices)


def test_slice_problems_catches_each_rule() -> None:
    dev = {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}},
           "capacity": {"memory": {"value": "1Gi"}}}
    assert dra.slice_problems(full({"devices": [dev]})) == []
    cases = {
        "only one of devices and sharedCounters":
            {"devices": [dev], "sharedCounters": [{"name": "c", "counters": {"x": {"value":
                                                                                 "1"}}}]},
        "129 devices, at most 128": {"devices": [dict(dev, name=f"d-{i}") for i in range(129)]},
        "65 devices, at most 64": {"devices": [dict(dev, name=f"d-{i}", taints=[{
            "key": "k", "effect": "NoSchedule"}]) for i in range(65)]},
        "9 counter sets": {"sharedCounters": [{"name": f"c{i}", "counters": {"x": {
            "value": "1"}}} for i in range(9)]},
        "1..32 counters": {"sharedCounters": [{"name": "c", "counters": {
            f"x{i}": {"value": "1"} for i in range(33)}}]},
        "name must be a DNS label": {"devices": [dict(dev, name="GPU_0")]},
        "used twice": {"devices": [dev, dev]},
        "attributes and capacities": {"devices": [dict(dev, attributes={
            f"a{i}": {"int": i} for i in range(32)})]},
        "longer than 64": {"devices": [dict(dev, attributes={"x": {"string": "y" * 65}})]},
        "not a semver": {"devices": [dict(dev, attributes={"v": {"version": "580.95.05"}})]},
        "C identifier": {"devices": [dict(dev, attributes={"bad-name": {"int": 1}})]},
        "needs allowMultipleAllocations": {"devices": [dict(dev, capacity={"memory": {
            "value": "1Gi", "requestPolicy": {"default": "1Gi", "validRange": {
                "min": "1Gi"}}}})]},
        "multiple of validRange.step": {"devices": [dict(dev, allowMultipleAllocations=True,
            capacity={"memory": {"value": "10Gi", "requestPolicy": {
                "default": "3Gi", "validRange": {"min": "2Gi", "step": "2Gi"}}}})]},
        "validValues must be ascending": {"devices": [dict(dev, allowMultipleAllocations=True,
            capacity={"c": {"value": "10", "requestPolicy": {
                "default": "5", "validValues": ["5", "2"]}}})]},
    }
    for expect, spec in cases.items():
        problems = dra.slice_problems(full(spec))
        assert any(expect in p for p in problems), (expect, problems)


def test_share_devices_carry_the_attributes_and_request_policies() -> None:
    plan = dra.pool_slices(facts(1), {"GPU-0": dra.SHARE}, "580.95.05", dra.Features())
    (dev,) = plan.slices[0]["devices"]
    assert dev["allowMultipleAllocations"] is True
    a = dev["attributes"]
    assert a["type"] == {"string": "share"} and a["uuid"] == {"string": "GPU-0"}
    assert a["productName"] == {"string": "NVIDIA H100-SXM"}
    assert a["architecture"] == {"string": "Hopper"}
    assert a["cudaComputeCapability"] == {"version": "9.0.0"}
    assert a["driverVersion"] == {"version": "580.95.5"}
    assert a["resource.kubernetes.io/pciBusID"] == {"string": "0000:00:00.0"}
    assert a["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    mem, comp = dev["capacity"]["memory"], dev["capacity"]["compute"]
    assert mem["value"] == "81920Mi" and "validRange" in mem["requestPolicy"]
    assert comp["requestPolicy"]["validRange"] == {"min": "1", "max": "100", "step": "1"}


def test_mig_counters_allow_exactly_the_valid_layouts() -> None:
    """Every set of placement devices whose counters fit together is a layout NVML accepts,
    and every valid layout fits the counters (A100-80GB and A30 geometries)."""
    for model in ("A100-80GB", "A30"):
        geo = catalog.lookup(model).mig  # type: ignore[union-attr]
        assert geo is not None
        counters = dra.mig_counters(geo)
        places = [(p, s) for p in geo.profiles for s in p.starts
                  if s + p.memory_slices <= geo.memory_slices]

        def fits(chosen: tuple[tuple[Any, int], ...], geo: Any = geo,
                 counters: dict[str, int] = counters) -> bool:
            used: dict[str, int] = {}
            for p, s in chosen:
                for k, v in dra.mig_consumption(geo, p, s).items():
                    used[k] = used.get(k, 0) + v
            return all(used[k] <= counters[k] for k in used)

        checked = 0
        for r in range(1, 5):
            for chosen in itertools.combinations(places, r):
                valid = not layout_problems(geo, [MigPlacement(s, p) for p, s in chosen])
                assert fits(chosen) == valid, (model, [f"{p.name}@{s}" for p, s in chosen])
                checked += 1
        assert checked > 1000


def test_a_feature_the_api_server_drops_falls_back_to_whole_gpus() -> None:
    plan = dra.pool_slices(facts(2, mig=True), {"GPU-0": dra.SHARE, "GPU-1": dra.MIG},
                           "580", dra.Features(consumable_capacity=False, partitionable=False))
    types = {d["name"]: d["attributes"]["type"]["string"]
             for s in plan.slices for d in s["devices"]}
    assert types == {"gpu-0": "gpu"}  # GPU 1 has no MIG instance to publish as fixed
    assert len(plan.warnings) == 2
    assert not any("sharedCounters" in s for s in plan.slices)


def test_detection_probes_with_dry_run_and_the_driver_warns_with_an_event(short_dir) -> None:  # type: ignore[no-untyped-def]
    from gpuslice.services.dra_driver import detect_features

    n = make_node(short_dir, [{"model": "H100-SXM"}], {"0": dra.SHARE}, features=None)
    assert detect_features(n.api, dra.DRIVER, NODE) == dra.Features(True, True, True)
    n.api.dra_gates = {"DRADeviceTaints"}  # a 1.35 cluster with only taints on
    feats = detect_features(n.api, dra.DRIVER, NODE)
    assert feats == dra.Features(False, False, True)
    assert n.api.list_resource_slices(dra.DRIVER, NODE)[0]["spec"]["devices"][0][
        "attributes"]["type"] == {"string": "share"}  # the dry runs stored nothing new
    n.driver.features = None
    n.driver.start()
    devices = [d for s in n.api.list_resource_slices(dra.DRIVER, NODE)
               for d in s["spec"].get("devices", [])]
    assert [d["attributes"]["type"]["string"] for d in devices] == ["gpu"]
    assert any(e["reason"] == "DeviceModelFallback" and "DRAConsumableCapacity" in
               e["message"] and e["involvedObject"]["name"] == NODE for e in n.api.events)


def test_publisher_bumps_the_generation_only_on_change_and_taints_unhealthy_gpus(
        node: Node) -> None:
    def pool() -> list[dict[str, Any]]:
        return node.api.list_resource_slices(dra.DRIVER, NODE)

    first = pool()
    assert {s["spec"]["pool"]["generation"] for s in first} == {0}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in first} == {len(first)}
    assert all(s["metadata"]["ownerReferences"][0]["uid"] == "node-uid" for s in first)
    assert not node.driver.publisher.publish(node.driver.plan.slices)  # unchanged: no write
    node.nvml.inject("GPU-node-a-02", 48, "double-bit ECC error")
    node.driver.health_step(0.5)
    second = pool()
    assert {s["spec"]["pool"]["generation"] for s in second} == {1}
    gpu2 = next(d for s in second for d in s["spec"].get("devices", [])
                if d["name"] == "gpu-2")
    (taint,) = gpu2["taints"]
    assert taint.pop("timeAdded")  # the API server stamps it
    assert taint == {"key": dra.UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}
    node.nvml.inject("GPU-node-a-02", 13, "an application's fault")  # not the GPU's
    assert not node.driver.health_step(0.1)
    node.driver.clock = lambda: 1e12  # quiet for long enough: healthy again
    assert node.driver.health_step(0.1)
    third = pool()
    assert {s["spec"]["pool"]["generation"] for s in third} == {2}
    assert not any("taints" in d for s in third for d in s["spec"].get("devices", []))


def test_without_taints_an_unhealthy_gpu_leaves_the_slice(short_dir) -> None:  # type: ignore[no-untyped-def]
    n = make_node(short_dir, [{"model": "T4"}, {"model": "T4", "faults": [79]}], {},
                  taints=False)
    n.driver.health_step(0.5)
    names = [d["name"] for s in n.api.list_resource_slices(dra.DRIVER, NODE)
             for d in s["spec"].get("devices", [])]
    assert names == ["gpu-0"]


def test_counters_live_in_their_own_slices_and_devices_reference_them(node: Node) -> None:
    slices = [s["spec"] for s in node.api.list_resource_slices(dra.DRIVER, NODE)]
    sets = {c["name"] for s in slices for c in s.get("sharedCounters", [])}
    assert sets == {"gpu-1-counters"}
    used = {c["counterSet"] for s in slices for d in s.get("devices", [])
            for c in d.get("consumesCounters", [])}
    assert used == sets
    assert all(not (s.get("devices") and s.get("sharedCounters")) for s in slices)
