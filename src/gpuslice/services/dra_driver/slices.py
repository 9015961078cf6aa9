"""The node's pool in the API server: which DRA features it serves, and the ResourceSlices
kept equal to the wanted ones."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

from gpuslice.adapters.kube.fake import ApiNotFound, DraPort
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.core import dra
from gpuslice.core.errors import GpusliceError

log = logging.getLogger("gpuslice.dra")


def pci_of(index: int, nvml: NvmlPort) -> tuple[str, str]:
    """(PCI bus ID, PCIe root) of GPU ``index`` when the NVML adapter knows them."""
    fn = getattr(nvml, "pci_info", None)
    if fn is None:
        return "", ""
    try:
        bus, root = fn(index)
    except (NvmlError, OSError):
        return "", ""
    return str(bus), str(root)


# -- feature detection and publishing --------------------------------------------------------

def detect_features(api: DraPort, driver: str, node: str) -> dra.Features:
    """Ask the API server (``dryRun=All`` creates of probe slices: nothing is stored) whether
    consumable capacity, partitionable devices and device taints are served; a disabled
    gate's fields come back dropped. A probe the server refuses counts as not served."""
    base = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice"}
    spec = {"driver": driver, "nodeName": node,
            "pool": {"name": node, "generation": 0, "resourceSliceCount": 1}}
    share_probe = {**base, "metadata": {"name": f"{node}-{driver}-probe-share"}, "spec": {
        **spec, "devices": [{
            "name": "probe", "allowMultipleAllocations": True,
            "taints": [{"key": dra.UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}],
            "capacity": {"memory": {"value": "1Gi", "requestPolicy": {
                "default": "1Gi", "validRange": {"min": "1Gi"}}}}}]}}
    counter_probe = {**base, "metadata": {"name": f"{node}-{driver}-probe-counters"}, "spec": {
        **spec, "sharedCounters": [{"name": "probe", "counters": {"c": {"value": "1"}}}]}}
    consumable = taints = partitionable = False
    try:
        got = api.create_resource_slice(share_probe, dry_run=True)
        dev = (got.get("spec", {}).get("devices") or [{}])[0]
        consumable = bool(dev.get("allowMultipleAllocations")) and \
            "requestPolicy" in (dev.get("capacity") or {}).get("memory", {})
        taints = bool(dev.get("taints"))
    except GpusliceError as exc:
        log.warning("probe of consumable capacity refused: %s", exc)
    try:
        got = api.create_resource_slice(counter_probe, dry_run=True)
        partitionable = bool(got.get("spec", {}).get("sharedCounters"))
    except GpusliceError as exc:
        log.warning("probe of partitionable devices refused: %s", exc)
    return dra.Features(consumable, partitionable, taints)


class SlicePublisher:
    """Keeps the node's pool in the API server equal to the wanted slices, as the Go
    ``resourceslice`` controller does (dynamic-resource-allocation
    resourceslice/resourceslicecontroller.go, ``syncPool``): slices are compared by meaning
    (quantities by value, the taints' server-set ``timeAdded`` ignored, as its
    ``DevicesDeepEqual``), unchanged content is left alone, any change is written as a new
    pool generation across all the pool's slices (created, replaced keeping the stored
    ``timeAdded`` of taints that stay, the extra ones deleted), owned by the Node so that they
    go with it. The generation never goes down while the driver runs, even when someone
    deleted every slice of the pool meanwhile."""

    def __init__(self, api: DraPort, driver: str, node: str) -> None:
        self.api, self.driver, self.node = api, driver, node
        self.generation = -1  # the last generation written or seen
        # slices the API server stored other than written (fields of a gate turned off: the
        # Go controller's DroppedFieldsError), from the last publish
        self.dropped: list[str] = []

    def name(self, i: int) -> str:
        """``<node>-<driver>-<i>``: a DNS subdomain of at most 253 characters."""
        tail = f"-{self.driver.replace('.', '-')}-{i}"
        return f"{self.node[:253 - len(tail)].rstrip('.-')}{tail}"

    def publish(self, specs: list[dict[str, Any]]) -> bool:
        """Returns whether anything was written."""
        current = {s["metadata"]["name"]: s for s in self.api.list_resource_slices(
            self.driver, self.node)}
        pools = [s["spec"].get("pool") or {} for s in current.values()]
        top = max((int(p.get("generation", 0)) for p in pools), default=-1)
        same = len(current) == len(specs) and all(
            self.name(i) in current and _same(current[self.name(i)].get("spec") or {},
                                              self._spec(w, 0, len(specs)))
            for i, w in enumerate(specs))
        if same and all(int(p.get("generation", 0)) == top
                        and int(p.get("resourceSliceCount", 0)) == len(specs) for p in pools):
            self.generation = max(self.generation, top)
            return False
        gen = max(top, self.generation) + 1
        owner = self._owner()
        self.dropped = []
        for i, spec in enumerate(specs):
            obj: dict[str, Any] = {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": self.name(i), **owner},
                "spec": self._spec(spec, gen, len(specs))}
            cur = current.pop(self.name(i), None)
            if cur is None:
                stored = self.api.create_resource_slice(obj)
            else:
                _keep_time_added(obj["spec"], cur.get("spec") or {})
                obj["metadata"]["resourceVersion"] = cur["metadata"].get("resourceVersion")
                stored = self.api.update_resource_slice(obj)
            if not _same(stored.get("spec") or {}, obj["spec"]):
                self.dropped.append(self.name(i))
        for stale in current:
            with contextlib.suppress(ApiNotFound):
                self.api.delete_resource_slice(stale)
        self.generation = gen
        return True

    def _spec(self, want: dict[str, Any], gen: int, count: int) -> dict[str, Any]:
        return {"driver": self.driver, "nodeName": self.node,
                "pool": {"name": self.node, "generation": gen, "resourceSliceCount": count},
                **copy.deepcopy(want)}

    def _owner(self) -> dict[str, Any]:
        try:
            node = self.api.get_node(self.node)
        except GpusliceError:
            return {}
        uid = (node.get("metadata") or {}).get("uid")
        if not uid:
            return {}
        return {"ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.node,
                                     "uid": uid, "controller": True}]}


def _keep_time_added(new: dict[str, Any], old: dict[str, Any]) -> None:
    """Taints that stay keep the ``timeAdded`` the API server gave them (the controller's
    ``copyTaintTimeAdded``): a republish does not make an old taint look new."""
    stamps = {(d.get("name"), t.get("key"), t.get("value"), t.get("effect")): t["timeAdded"]
              for d in old.get("devices") or [] for t in d.get("taints") or []
              if t.get("timeAdded")}
    for d in new.get("devices") or []:
        for t in d.get("taints") or []:
            stamp = stamps.get((d.get("name"), t.get("key"), t.get("value"), t.get("effect")))
            if stamp and "timeAdded" not in t:
                t["timeAdded"] = stamp


# the ResourceSlice fields this driver writes; others a newer API server may add (defaults,
# fields this driver does not know) are not differences, while a field it dropped is one
_SPEC_FIELDS = ("driver", "nodeName", "pool", "devices", "sharedCounters", "nodeSelector",
                "allNodes", "perDeviceNodeSelection")
_DEVICE_FIELDS = ("name", "attributes", "capacity", "allowMultipleAllocations", "taints",
                  "consumesCounters")


def _project(spec: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in spec.items() if k in _SPEC_FIELDS}
    if isinstance(out.get("devices"), list):
        out["devices"] = [{k: v for k, v in d.items() if k in _DEVICE_FIELDS}
                          for d in out["devices"]]
    return out


def _same(stored: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether a stored slice spec says what ``want`` says (pool aside), by meaning."""
    import json

    def key(spec: dict[str, Any]) -> str:
        content = {k: v for k, v in spec.items() if k != "pool"}
        return json.dumps(dra.semantic_spec(content), sort_keys=True)

    return key(_project(stored)) == key(_project(want))
