"""kube-scheduler's structured allocator for the one claim shape gpuslice's claim allocator
leaves to it in ``gpuslice demo --dra``: a MIG profile chosen by a CEL selector, allocated first
fit with the pool's shared counters (:func:`first_fit_counters`), and the demo's error."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube.objects import quantity
from gpuslice.core import dra
from gpuslice.core.dra_placement import DeviceResult, DraPlacement
from gpuslice.core.errors import GpusliceError


class DraDemoFailed(GpusliceError):
    """A step of the DRA demo did not do what it should; the message names the step."""


_PROFILE_SELECTOR = re.compile(
    r"^device\.attributes\['(?P<domain>[^']+)'\]\.migProfile\.startsWith\('(?P<prefix>[^']*)'\)$")
_CLASS_TYPES = {"gpu.gpuslice.io": dra.TYPE_GPU, "mig.gpuslice.io": dra.TYPE_MIG,
                "share.gpuslice.io": dra.TYPE_SHARE}


def _selector(exactly: Mapping[str, Any], driver: str) -> Callable[[Mapping[str, Any]], bool]:
    """The request's CEL selectors as a predicate on a device. Only the form the example
    template uses is understood (``migProfile.startsWith('<prefix>')``): this is not a CEL
    evaluator, and any other selector is refused rather than ignored."""
    prefixes = []
    for i, sel in enumerate(exactly.get("selectors") or []):
        expr = str((sel.get("cel") or {}).get("expression", "")).strip()
        m = _PROFILE_SELECTOR.match(expr)
        if m is None or m.group("domain") != driver:
            raise DraDemoFailed(f"selectors[{i}].cel.expression {expr!r}: the demo's stand-in "
                                f"for kube-scheduler evaluates only device.attributes"
                                f"['{driver}'].migProfile.startsWith('<prefix>')")
        prefixes.append(m.group("prefix"))

    def ok(device: Mapping[str, Any]) -> bool:
        profile = str(((device.get("attributes") or {}).get("migProfile") or {}).get("string")
                      or "")
        return all(profile.startswith(p) for p in prefixes)

    return ok


def first_fit_counters(claim: Mapping[str, Any], slices: Sequence[Mapping[str, Any]],
                       claims: Sequence[Mapping[str, Any]], node: str,
                       driver: str = kdra.DRIVER) -> DraPlacement:
    """kube-scheduler's structured allocator for a one-request claim on ``node``, as it treats
    partitionable devices (k8s.io/dynamic-resource-allocation structured ``allocateOne`` and
    its counter check): pools by name, slices by name, devices in slice order (newest pool
    generation); the first device of the class's type that the selectors accept, that no
    allocated claim holds, and whose ``consumesCounters`` fit what the pool's
    ``sharedCounters`` have left after the allocated devices' consumption."""
    exactly = ((claim.get("spec") or {}).get("devices") or {}).get("requests", [{}])[0]
    request = str(exactly.get("name") or "")
    exactly = exactly.get("exactly") or {}
    want = _CLASS_TYPES.get(str(exactly.get("deviceClassName")))
    if want is None:
        raise DraDemoFailed(f"claim {claim['metadata']['name']}: device class "
                            f"{exactly.get('deviceClassName')!r} is not one of ours")
    accepts = _selector(exactly, driver)
    ours = [s for s in slices if (s.get("spec") or {}).get("driver") == driver]
    top: dict[str, int] = {}
    for s in ours:
        pool = s["spec"]["pool"]
        top[pool["name"]] = max(top.get(pool["name"], 0), int(pool.get("generation", 0)))
    ours = sorted((s for s in ours if int(s["spec"]["pool"].get("generation", 0))
                   == top[s["spec"]["pool"]["name"]]),
                  key=lambda s: (s["spec"]["pool"]["name"], s["metadata"]["name"]))
    left: dict[tuple[str, str], dict[str, float]] = {}
    devices: dict[tuple[str, str], Mapping[str, Any]] = {}
    for s in ours:
        pool = s["spec"]["pool"]["name"]
        for cs in s["spec"].get("sharedCounters") or []:
            left[(pool, cs["name"])] = {
                k: quantity((v or {}).get("value"), f"sharedCounters {cs['name']}.{k}")
                for k, v in (cs.get("counters") or {}).items()}
        for d in s["spec"].get("devices") or []:
            devices[(pool, d["name"])] = d

    def take(pool: str, device: Mapping[str, Any], check: bool) -> bool:
        """Take the device's ``consumesCounters`` from what is left; with ``check``, nothing
        is taken and False returned when they do not fit."""
        wants = [((pool, c["counterSet"]), k, quantity((v or {}).get("value"), k))
                 for c in device.get("consumesCounters") or []
                 for k, v in (c.get("counters") or {}).items()]
        if check and any(left.get(cs, {}).get(k, 0.0) < n for cs, k, n in wants):
            return False
        for cs, k, n in wants:
            left.setdefault(cs, {})[k] = left.get(cs, {}).get(k, 0.0) - n
        return True

    # devices allocated whole (a result without a shareID), each counted once
    held: set[tuple[str, str]] = set()
    for c in claims:
        for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
                "results") or []:
            key = (str(r.get("pool")), str(r.get("device")))
            if r.get("driver") != driver or r.get("adminAccess") or r.get("shareID") \
                    or key in held:
                continue
            held.add(key)
            if key in devices:
                take(key[0], devices[key], check=False)
    for s in ours:
        if s["spec"].get("nodeName") != node:
            continue
        pool = s["spec"]["pool"]["name"]
        for d in s["spec"].get("devices") or []:
            attrs = d.get("attributes") or {}
            if (attrs.get("type") or {}).get("string") != want or not accepts(d) \
                    or d.get("allowMultipleAllocations") or (pool, d["name"]) in held \
                    or any(t.get("effect") in ("NoSchedule", "NoExecute")
                           for t in d.get("taints") or []):
                continue  # consumable capacity is DraAllocator's (core.dra_placement) part
            if take(pool, d, check=True):
                return DraPlacement(node, (DeviceResult(request, pool, str(d["name"]),
                                                        False),), 0.0)
    raise DraDemoFailed(f"claim {claim['metadata']['name']}: no {want} device on {node} fits "
                        "(selectors, devices held, shared counters)")
