"""What kube-apiserver's ResourceSlice strategy does to a stored spec besides validation:
canonical quantities, a device taint's ``timeAdded``, and the fields of disabled DRA feature
gates dropped."""

from __future__ import annotations

from typing import Any

# fields of resource.k8s.io/v1 that an API server drops when their feature gate is off
GATED_FIELDS = {
    "DRAConsumableCapacity": ("allowMultipleAllocations", "capacity.*.requestPolicy"),
    "DRAPartitionableDevices": ("sharedCounters", "consumesCounters", "perDeviceNodeSelection"),
    "DRADeviceTaints": ("taints",),
}


def normalize_slice_spec(spec: dict[str, Any], now: str) -> None:
    """What kube-apiserver does to a stored ResourceSlice spec besides validation: quantities
    are kept in their canonical form (``81920Mi`` reads back as ``80Gi``), and a device taint
    without ``timeAdded`` gets the time of the write (resource/v1 types.go, DeviceTaint:
    "Added automatically during create or update if not set")."""
    from gpuslice.core.dra import canonical_quantity

    def counters(cs: dict[str, Any]) -> None:
        for c in cs.values():
            if isinstance(c, dict) and "value" in c:
                c["value"] = canonical_quantity(c["value"])

    for s in spec.get("sharedCounters") or []:
        counters(s.get("counters") or {})
    for d in spec.get("devices") or []:
        for c in (d.get("capacity") or {}).values():
            if "value" in c:
                c["value"] = canonical_quantity(c["value"])
            pol = c.get("requestPolicy") or {}
            if "default" in pol:
                pol["default"] = canonical_quantity(pol["default"])
            if pol.get("validValues"):
                pol["validValues"] = [canonical_quantity(v) for v in pol["validValues"]]
            rng = pol.get("validRange") or {}
            for k in ("min", "max", "step"):
                if k in rng:
                    rng[k] = canonical_quantity(rng[k])
        for cc in d.get("consumesCounters") or []:
            counters(cc.get("counters") or {})
        for t in d.get("taints") or []:
            t.setdefault("timeAdded", now)



def drop_gated_fields(spec: dict[str, Any], gates: set[str]) -> None:
    """Remove from a ResourceSlice spec the fields of the gates not in ``gates``, as
    kube-apiserver's strategy does on create and update (``dropDisabledFields``)."""
    off = {f for gate, fields in GATED_FIELDS.items() if gate not in gates for f in fields}
    for f in ("sharedCounters", "perDeviceNodeSelection"):
        if f in off:
            spec.pop(f, None)
    for d in spec.get("devices") or []:
        for f in ("allowMultipleAllocations", "consumesCounters", "taints"):
            if f in off:
                d.pop(f, None)
        if "capacity.*.requestPolicy" in off:
            for c in (d.get("capacity") or {}).values():
                c.pop("requestPolicy", None)
