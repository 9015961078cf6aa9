"""What the DRA driver publishes: a node's GPUs as the ResourceSlices of its pool
(:func:`pool_slices`), checked against the API server's validation limits
(:func:`slice_problems`). The three sharing models are described in :mod:`gpuslice.core.dra`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from gpuslice.core import catalog
from gpuslice.core.catalog import MigGeometry, MigProfile
from gpuslice.core.devices import GpuDevice
from gpuslice.core.dra.quantity import mib_quantity, parse_quantity
from gpuslice.core.errors import ValidationError

DRIVER = "gpu.gpuslice.io"
CONFIG_API_VERSION = "gpuslice.io/v1alpha1"
SHARE, MIG, WHOLE = "share", "mig", "whole"
MODES = (SHARE, MIG, WHOLE)
# device types (the ``type`` attribute the DeviceClasses select on)
TYPE_GPU, TYPE_MIG, TYPE_SHARE = "gpu", "mig", "share"
UNHEALTHY_TAINT = "gpu.gpuslice.io/unhealthy"
# the claim allocator's ownership taint (docs/dra-placement.md; the allocator's
# adapters.kube.dra.ALLOCATOR_TAINT): on consumable-capacity devices while its Lease is fresh
ALLOCATOR_TAINT = "gpu.gpuslice.io/allocator"
ALLOCATOR_TAINT_VALUE = "gpuslice"

# resource/v1 types.go (release-1.35) validation limits
MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_TAINTS_OR_COUNTERS = 64  # ResourceSliceMaxDevicesWithTaintsOrConsumesCounters
MAX_COUNTER_SETS = 8  # ResourceSliceMaxCounterSets
MAX_COUNTERS_PER_SET = 32  # ResourceSliceMaxCountersPerCounterSet
MAX_CONSUMPTIONS_PER_DEVICE = 2  # ResourceSliceMaxDeviceCounterConsumptionsPerDevice
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_ATTRIBUTE_VALUE = 64  # DeviceAttributeMaxValueLength
MAX_ID_LENGTH = 32  # DeviceMaxIDLength
MAX_DOMAIN_LENGTH = 63  # DeviceMaxDomainLength
MAX_TAINTS = 16  # DeviceTaintsMaxLength
MAX_VALID_VALUES = 10  # CapacityRequestPolicy.validValues
POOL_NAME_MAX = 253  # PoolNameMaxLength
DEVICE_NAME_MAX = 63  # a DNS label

MEMORY_STEP_MIB = 256  # the smallest memory a share may ask for, and its granularity
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
                     r"(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$")


# -- node inventory ------------------------------------------------------------------------

@dataclass(frozen=True)
class Features:
    """What the API server serves (fields of disabled gates are dropped silently)."""

    consumable_capacity: bool = True  # DRAConsumableCapacity
    partitionable: bool = True  # DRAPartitionableDevices (counters in their own slice, 1.35+)
    taints: bool = True  # DRADeviceTaints


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as the driver publishes it: the NVML device and what the node adds."""

    gpu: GpuDevice
    pci_bus_id: str = ""  # "0000:3b:00.0"
    pcie_root: str = ""  # "pci0000:3a"


@dataclass(frozen=True)
class PoolPlan:
    """The pool's slice specs (pool generation and count left to the publisher) and, per
    device name, what it stands for; ``warnings`` for models that fell back."""

    slices: list[dict[str, Any]]
    devices: dict[str, DeviceRef]
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DeviceRef:
    """What a published device is: its type, GPU, and for a MIG placement the profile and
    start memory slice."""

    type: str
    gpu_uuid: str
    gpu_index: int
    memory_mib: int
    profile: str = ""
    start: int = -1
    mig_uuid: str = ""  # a static MIG instance (published when partitioning is not served)


_ARCH = ((10, "Blackwell"), (9, "Hopper"), (8, "Ampere"), (7, "Volta"), (6, "Pascal"))


def architecture(cc: tuple[int, int] | None) -> str:
    if cc is None:
        return ""
    if cc == (8, 9):
        return "Ada Lovelace"
    if cc == (7, 5):
        return "Turing"
    for major, name in _ARCH:
        if cc[0] >= major:
            return name
    return ""


def semver(text: str) -> str:
    """A driver version such as ``580.95.05`` as semver (``580.95.5``); "" when not one."""
    parts = [p for p in text.strip().split(".") if p]
    if not parts or not all(p.isdigit() for p in parts):
        return ""
    nums = [str(int(p)) for p in parts[:3]]
    nums += ["0"] * (3 - len(nums))
    return ".".join(nums)


def mig_device_name(index: int, profile: MigProfile, start: int) -> str:
    short = re.sub(r"[^a-z0-9]", "", profile.name.lower())
    return f"gpu-{index}-mig-{short}-{start}"


def counter_set_name(index: int) -> str:
    return f"gpu-{index}-counters"


def _attrs(f: GpuFacts, dtype: str, driver_version: str) -> dict[str, dict[str, Any]]:
    g = f.gpu
    out: dict[str, dict[str, Any]] = {
        "type": {"string": dtype},
        "uuid": {"string": g.uuid[:MAX_ATTRIBUTE_VALUE]},
        "productName": {"string": g.name[:MAX_ATTRIBUTE_VALUE]},
        "model": {"string": g.model[:MAX_ATTRIBUTE_VALUE]},
        "index": {"int": g.index},
    }
    arch = architecture(g.compute_capability)
    if arch:
        out["architecture"] = {"string": arch}
    if g.compute_capability:
        out["cudaComputeCapability"] = {"version": f"{g.compute_capability[0]}."
                                                   f"{g.compute_capability[1]}.0"}
    if semver(driver_version):
        out["driverVersion"] = {"version": semver(driver_version)}
    known = catalog.lookup(g.model)
    if known is not None:  # whether the GPU can be partitioned (MIG), whatever its mode now
        out["migCapable"] = {"bool": known.mig_capable}
    if f.pci_bus_id:
        out["resource.kubernetes.io/pciBusID"] = {"string": f.pci_bus_id}
    if f.pcie_root:
        out["resource.kubernetes.io/pcieRoot"] = {"string": f.pcie_root}
    return out


def _share_device(f: GpuFacts, driver_version: str) -> dict[str, Any]:
    g = f.gpu
    step = MEMORY_STEP_MIB
    top = g.memory_mib // step * step
    attrs = _attrs(f, TYPE_SHARE, driver_version)
    return {
        "name": f"gpu-{g.index}",
        "allowMultipleAllocations": True,
        "attributes": attrs,
        "capacity": {
            "memory": {"value": mib_quantity(g.memory_mib), "requestPolicy": {
                "default": mib_quantity(top),
                "validRange": {"min": mib_quantity(step), "max": mib_quantity(top),
                               "step": mib_quantity(step)}}},
            "compute": {"value": "100", "requestPolicy": {
                "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}},
        },
    }


def _whole_device(f: GpuFacts, driver_version: str) -> dict[str, Any]:
    g = f.gpu
    cap: dict[str, Any] = {"memory": {"value": mib_quantity(g.memory_mib)},
                           "compute": {"value": "100"}}
    if g.sms:
        cap["multiprocessors"] = {"value": str(g.sms)}
    return {"name": f"gpu-{g.index}", "attributes": _attrs(f, TYPE_GPU, driver_version),
            "capacity": cap}


def mig_counters(geo: MigGeometry) -> dict[str, int]:
    """The counters of one GPU's counter set: one per memory slice, the compute slices, and
    one per profile whose instance limit the slices alone would not enforce."""
    out = {f"memory-slice-{i}": 1 for i in range(geo.memory_slices)}
    out["compute-slices"] = geo.compute_slices
    for p in geo.profiles:
        if p.max_instances < _implied_max(geo, p):
            out[f"profile-{p.profile_id}"] = p.max_instances
    return out


def _implied_max(geo: MigGeometry, p: MigProfile) -> int:
    return min(len(p.starts), geo.memory_slices // p.memory_slices,
               geo.compute_slices // p.compute_slices)


def mig_consumption(geo: MigGeometry, p: MigProfile, start: int) -> dict[str, int]:
    """What an instance of ``p`` at ``start`` takes from its GPU's counters."""
    out = {f"memory-slice-{s}": 1 for s in p.span(start)}
    out["compute-slices"] = p.compute_slices
    if f"profile-{p.profile_id}" in mig_counters(geo):
        out[f"profile-{p.profile_id}"] = 1
    return out


def _mig_devices(f: GpuFacts, geo: MigGeometry, driver_version: str) -> list[dict[str, Any]]:
    g = f.gpu
    out = []
    for p in sorted(geo.profiles, key=lambda p: (p.compute_slices, p.memory_slices,
                                                 p.profile_id)):
        for start in p.starts:
            if start + p.memory_slices > geo.memory_slices:
                continue
            attrs = _attrs(f, TYPE_MIG, driver_version)
            attrs["migProfile"] = {"string": p.name}
            attrs["parentUUID"] = attrs.pop("uuid")
            attrs["placementStart"] = {"int": start}
            out.append({
                "name": mig_device_name(g.index, p, start),
                "attributes": attrs,
                "capacity": {"memory": {"value": mib_quantity(p.memory_mib)},
                             "multiprocessors": {"value": str(p.sms)},
                             "compute": {"value": str(100 * p.compute_slices
                                                      // geo.compute_slices)}},
                "consumesCounters": [{
                    "counterSet": counter_set_name(g.index),
                    "counters": {k: {"value": str(v)} for k, v in
                                 mig_consumption(geo, p, start).items()}}],
            })
    return out


def _static_mig_devices(f: GpuFacts, driver_version: str) -> list[dict[str, Any]]:
    g = f.gpu
    out = []
    for inst in g.mig:
        model = catalog.lookup(g.model)
        prof = model.mig.profile(inst.profile) if model and model.mig else None
        attrs = _attrs(f, TYPE_MIG, driver_version)
        attrs["migProfile"] = {"string": inst.profile}
        attrs["parentUUID"] = attrs.pop("uuid")
        attrs["uuid"] = {"string": inst.uuid[:MAX_ATTRIBUTE_VALUE]}
        attrs["placementStart"] = {"int": inst.start}
        cap: dict[str, Any] = {"memory": {"value": mib_quantity(inst.memory_mib)}}
        if prof is not None:
            cap["multiprocessors"] = {"value": str(prof.sms)}
        name = (mig_device_name(g.index, prof, inst.start) if prof is not None
                else f"gpu-{g.index}-mig-{inst.start}")
        out.append({"name": name, "attributes": attrs, "capacity": cap})
    return out


def pool_slices(gpus: Sequence[GpuFacts], modes: Mapping[str, str], driver_version: str,
                features: Features, unhealthy: Iterable[str] = (),
                taint_unhealthy: bool = True, allocator_taint: bool = False) -> PoolPlan:
    """The slices of a node's pool. ``modes``: GPU UUID -> share | mig | whole (missing:
    whole). Unhealthy GPUs' devices carry the taint :data:`UNHEALTHY_TAINT` (NoSchedule), or
    are left out when ``taint_unhealthy`` is off or taints are not served. A model the API
    server does not serve falls back (share -> whole GPU, MIG -> its current instances as
    fixed devices) and says so in ``warnings``. With ``allocator_taint`` (the claim
    allocator's Lease is fresh) every consumable-capacity device carries
    :data:`ALLOCATOR_TAINT` (NoSchedule), so that kube-scheduler leaves them to it."""
    bad = set(unhealthy)
    devices: list[dict[str, Any]] = []
    refs: dict[str, DeviceRef] = {}
    counter_sets: list[dict[str, Any]] = []
    warnings: list[str] = []
    for f in sorted(gpus, key=lambda f: f.gpu.index):
        g = f.gpu
        mode = modes.get(g.uuid, WHOLE)
        if mode not in MODES:
            raise ValidationError(f"mode of GPU {g.index}", " | ".join(MODES), mode)
        model = catalog.lookup(g.model)
        geo = model.mig if model is not None else None
        if g.uuid in bad and not (taint_unhealthy and features.taints):
            continue
        own: list[dict[str, Any]]
        if mode == MIG and geo is None:
            raise ValidationError(f"mode of GPU {g.index}", "share or whole (not a MIG-capable "
                                  "model)", g.model)
        if mode == MIG and not g.mig_enabled:
            warnings.append(f"GPU {g.index}: MIG mode is disabled on the GPU (an "
                            "administrator's action); published as a whole GPU")
            mode = WHOLE
        if mode == MIG and geo is not None and features.partitionable:
            own = _mig_devices(f, geo, driver_version)
            counter_sets.append({"name": counter_set_name(g.index), "counters": {
                k: {"value": str(v)} for k, v in mig_counters(geo).items()}})
            for d in own:
                p = geo.profile(d["attributes"]["migProfile"]["string"])
                refs[d["name"]] = DeviceRef(TYPE_MIG, g.uuid, g.index, p.memory_mib, p.name,
                                            int(d["attributes"]["placementStart"]["int"]))
        elif mode == MIG:
            warnings.append(f"GPU {g.index}: partitionable devices (DRAPartitionableDevices) "
                            "are not served by the API server; its current MIG instances are "
                            "published as fixed devices")
            own = _static_mig_devices(f, driver_version)
            for d, inst in zip(own, g.mig, strict=True):
                refs[d["name"]] = DeviceRef(TYPE_MIG, g.uuid, g.index, inst.memory_mib,
                                            inst.profile, inst.start, inst.uuid)
        elif mode == SHARE and features.consumable_capacity:
            own = [_share_device(f, driver_version)]
            refs[own[0]["name"]] = DeviceRef(TYPE_SHARE, g.uuid, g.index, g.memory_mib)
        else:
            if mode == SHARE:
                warnings.append(f"GPU {g.index}: consumable capacity (DRAConsumableCapacity) "
                                "is not served by the API server; published as a whole GPU")
            own = [_whole_device(f, driver_version)]
            refs[own[0]["name"]] = DeviceRef(TYPE_GPU, g.uuid, g.index, g.memory_mib)
        _taint(own, unhealthy=g.uuid in bad, allocator=allocator_taint and features.taints)
        devices.extend(own)
    return PoolPlan(_chunked(devices, counter_sets), refs, warnings)


def _taint(devices: list[dict[str, Any]], *, unhealthy: bool, allocator: bool) -> None:
    """A GPU's devices tainted: :data:`UNHEALTHY_TAINT` on every one of an unhealthy GPU,
    :data:`ALLOCATOR_TAINT` on the consumable-capacity ones while the allocator is fresh."""
    for d in devices:
        if unhealthy:
            d.setdefault("taints", []).append(
                {"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"})
        if allocator and d.get("allowMultipleAllocations"):
            d.setdefault("taints", []).append(
                {"key": ALLOCATOR_TAINT, "value": ALLOCATOR_TAINT_VALUE, "effect": "NoSchedule"})


def _chunked(devices: list[dict[str, Any]],
             counter_sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pool's slice specs: the counter sets (:data:`MAX_COUNTER_SETS` a slice), then the
    devices, as many a slice as the limits allow (fewer where one has taints or consumes
    counters); at least one slice, even an empty one."""
    slices: list[dict[str, Any]] = []
    for i in range(0, len(counter_sets), MAX_COUNTER_SETS):
        slices.append({"sharedCounters": counter_sets[i:i + MAX_COUNTER_SETS]})
    chunk: list[dict[str, Any]] = []
    for d in devices:
        limited = any("taints" in x or "consumesCounters" in x for x in [*chunk, d])
        limit = MAX_DEVICES_TAINTS_OR_COUNTERS if limited else MAX_DEVICES
        if len(chunk) + 1 > limit:
            slices.append({"devices": chunk})
            chunk = []
        chunk.append(d)
    if chunk or not slices:
        slices.append({"devices": chunk})
    return slices


def slice_problems(spec: Mapping[str, Any]) -> list[str]:
    """Every rule of resource/v1 types.go (release-1.35) that a ResourceSlice spec breaks:
    the limits on devices, counter sets, counters, attributes and capacities, names, and
    "only one of devices and sharedCounters"."""
    out: list[str] = []
    devices = spec.get("devices") or []
    sets = spec.get("sharedCounters") or []
    if devices and sets:
        out.append("only one of devices and sharedCounters can be set in a ResourceSlice")
    driver = str(spec.get("driver", ""))
    if not driver or len(driver) > MAX_DOMAIN_LENGTH or not _DNS_SUBDOMAIN.match(driver):
        out.append(f"driver {driver!r}: a DNS subdomain of at most 63 characters")
    pool = spec.get("pool") or {}
    name = str(pool.get("name", ""))
    if not name or len(name) > POOL_NAME_MAX:
        out.append(f"pool.name {name!r}: 1..253 characters")
    if int(pool.get("resourceSliceCount", 0)) < 1:
        out.append("pool.resourceSliceCount must be at least 1")
    if int(pool.get("generation", -1)) < 0:
        out.append("pool.generation must be >= 0")
    selectors = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
                 if spec.get(k)]
    if len(selectors) != 1:
        out.append(f"exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection "
                   f"must be set (got {selectors or 'none'})")
    limited = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = MAX_DEVICES_TAINTS_OR_COUNTERS if limited else MAX_DEVICES
    if len(devices) > limit:
        out.append(f"{len(devices)} devices, at most {limit}"
                   f"{' when a device has taints or consumes counters' if limited else ''}")
    if len(sets) > MAX_COUNTER_SETS:
        out.append(f"{len(sets)} counter sets, at most {MAX_COUNTER_SETS}")
    for s in sets:
        if not _DNS_LABEL.match(str(s.get("name", ""))):
            out.append(f"counter set {s.get('name')!r}: a DNS label")
        counters = s.get("counters") or {}
        if not counters or len(counters) > MAX_COUNTERS_PER_SET:
            out.append(f"counter set {s.get('name')}: 1..{MAX_COUNTERS_PER_SET} counters")
        out.extend(f"counter {c!r}: a DNS label" for c in counters if not _DNS_LABEL.match(c))
    seen: set[str] = set()
    for d in devices:
        dn = str(d.get("name", ""))
        where = f"device {dn!r}"
        if not _DNS_LABEL.match(dn) or len(dn) > DEVICE_NAME_MAX:
            out.append(f"{where}: the name must be a DNS label")
        if dn in seen:
            out.append(f"{where}: the name is used twice")
        seen.add(dn)
        attrs = d.get("attributes") or {}
        caps = d.get("capacity") or {}
        if len(attrs) + len(caps) > MAX_ATTRIBUTES_AND_CAPACITIES:
            out.append(f"{where}: {len(attrs) + len(caps)} attributes and capacities, at most "
                       f"{MAX_ATTRIBUTES_AND_CAPACITIES}")
        for q in [*attrs, *caps]:
            out.extend(f"{where}: {p}" for p in _qualified_name_problems(q))
        for q, v in attrs.items():
            kinds = [k for k in ("int", "bool", "string", "version") if k in v]
            if len(kinds) != 1:
                out.append(f"{where}: attribute {q} must have exactly one value, has {kinds}")
            elif kinds[0] in ("string", "version") and len(str(v[kinds[0]])) > \
                    MAX_ATTRIBUTE_VALUE:
                out.append(f"{where}: attribute {q} is longer than {MAX_ATTRIBUTE_VALUE}")
            elif kinds[0] == "version" and not _SEMVER.match(str(v["version"])):
                out.append(f"{where}: attribute {q}: {v['version']!r} is not a semver")
        multi = bool(d.get("allowMultipleAllocations"))
        for q, c in caps.items():
            out.extend(f"{where}: capacity {q}: {p}" for p in _capacity_problems(c, multi))
        consumes = d.get("consumesCounters") or []
        if len(consumes) > MAX_CONSUMPTIONS_PER_DEVICE:
            out.append(f"{where}: consumes {len(consumes)} counter sets, at most "
                       f"{MAX_CONSUMPTIONS_PER_DEVICE}")
        for c in consumes:
            if len(c.get("counters") or {}) > MAX_COUNTERS_PER_SET:
                out.append(f"{where}: consumes more than {MAX_COUNTERS_PER_SET} counters")
        if len(d.get("taints") or []) > MAX_TAINTS:
            out.append(f"{where}: more than {MAX_TAINTS} taints")
    return out


def _qualified_name_problems(name: str) -> list[str]:
    domain, sep, ident = name.rpartition("/")
    out = []
    if not _C_IDENTIFIER.match(ident) or len(ident) > MAX_ID_LENGTH:
        out.append(f"{name!r}: the name must be a C identifier of at most {MAX_ID_LENGTH}")
    if sep and (len(domain) > MAX_DOMAIN_LENGTH or not _DNS_SUBDOMAIN.match(domain)):
        out.append(f"{name!r}: the domain must be a DNS subdomain of at most "
                   f"{MAX_DOMAIN_LENGTH}")
    return out


def _capacity_problems(cap: Mapping[str, Any], multi: bool) -> list[str]:
    out: list[str] = []
    try:
        value = parse_quantity(cap.get("value"), "value")
    except ValidationError as exc:
        return [str(exc)]
    policy = cap.get("requestPolicy")
    if policy is None:
        return out
    if not multi:
        return ["a requestPolicy needs allowMultipleAllocations"]
    try:
        default = parse_quantity(policy.get("default"), "requestPolicy.default")
        values = [parse_quantity(v, "validValues") for v in policy.get("validValues") or []]
        rng = policy.get("validRange")
    except ValidationError as exc:
        return [str(exc)]
    if values and rng:
        out.append("only one of validValues and validRange")
    if values:
        if len(values) > MAX_VALID_VALUES:
            out.append(f"more than {MAX_VALID_VALUES} validValues")
        if values != sorted(set(values)):
            out.append("validValues must be ascending and unique")
        if default not in values:
            out.append("the default must be one of validValues")
    if rng:
        lo = parse_quantity(rng.get("min"), "validRange.min")
        hi = parse_quantity(rng["max"], "validRange.max") if "max" in rng else None
        step = parse_quantity(rng["step"], "validRange.step") if "step" in rng else None
        if not Decimal(0) <= lo <= value:
            out.append("validRange.min must be within 0..value")
        if default < lo:
            out.append("the default must be >= validRange.min")
        if hi is not None and (hi > value or lo > hi or default > hi):
            out.append("validRange.max must be <= value and >= min and default")
        if step is not None:
            if lo + step > value:
                out.append("validRange.min + step must be <= value")
            for what, q in (("max", hi), ("default", default)):
                if q is not None and q % step != 0:
                    out.append(f"{what} must be a multiple of validRange.step")
    return out
