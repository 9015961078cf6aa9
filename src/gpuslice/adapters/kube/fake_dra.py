"""The in-memory API server fake's resource.k8s.io/v1 part: ResourceSlices, DeviceClasses
and ResourceClaims (see :mod:`gpuslice.adapters.kube.fake`)."""

from __future__ import annotations

import copy
from typing import Any

from gpuslice.adapters.kube.fake_state import FakeState, _now
from gpuslice.adapters.kube.ports import ApiConflict, ApiNotFound
from gpuslice.adapters.kube.slice_strategy import drop_gated_fields, normalize_slice_spec
from gpuslice.core.errors import ValidationError


class FakeDraApi(FakeState):
    """ResourceSlices, DeviceClasses and ResourceClaims (resource.k8s.io/v1)."""

    # -- resource.k8s.io/v1: ResourceSlices, DeviceClasses, ResourceClaims --------------------

    def add_resourceslice(self, obj: dict[str, Any]) -> None:
        with self._lock:
            o = copy.deepcopy(obj)
            o["kind"] = "ResourceSlice"
            self._bump(o, "ADDED")
            self._slices[o["metadata"]["name"]] = o

    def add_deviceclass(self, obj: dict[str, Any]) -> None:
        with self._lock:
            o = copy.deepcopy(obj)
            o["kind"] = "DeviceClass"
            self._bump(o, "ADDED")
            self._classes[o["metadata"]["name"]] = o

    def add_resourceclaim(self, obj: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            o = copy.deepcopy(obj)
            meta = o.setdefault("metadata", {})
            meta.setdefault("namespace", "default")
            meta.setdefault("uid", f"uid-claim-{self.uid_token}-{meta['namespace']}-"
                                   f"{meta['name']}")
            o["kind"] = "ResourceClaim"
            o.setdefault("status", {})
            self._bump(o, "ADDED")
            self._claims[(meta["namespace"], meta["name"])] = o
            return copy.deepcopy(o)

    def list_device_classes(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(list(self._classes.values()))

    def list_resource_claims(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(list(self._claims.values()))

    def _claim_for_write(self, claim: dict[str, Any]) -> dict[str, Any]:
        meta = claim.get("metadata") or {}
        key = (str(meta.get("namespace", "default")), str(meta.get("name")))
        cur = self._claims.get(key)
        if cur is None:
            raise ApiNotFound(f'resourceclaims.resource.k8s.io "{key[1]}" not found')
        rv = meta.get("resourceVersion")
        if rv and rv != cur["metadata"]["resourceVersion"]:  # none given: unconditional
            raise ApiConflict(f'Operation cannot be fulfilled on resourceclaims.resource.k8s.io '
                              f'"{key[1]}": the object has been modified; please apply your '
                              "changes to the latest version and try again")
        return cur

    def update_resource_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Replace the claim's metadata (labels, annotations, finalizers); the spec is
        immutable and the status is the status subresource's."""
        with self._lock:
            cur = self._claim_for_write(claim)
            meta = claim.get("metadata") or {}
            for k in ("labels", "annotations", "finalizers"):
                if k in meta:
                    cur["metadata"][k] = copy.deepcopy(meta[k])
                else:
                    cur["metadata"].pop(k, None)
            self._bump(cur)
            return copy.deepcopy(cur)

    def update_resource_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Replace the claim's status (``resourceclaims/status``); metadata and spec stay."""
        with self._lock:
            cur = self._claim_for_write(claim)
            cur["status"] = copy.deepcopy(claim.get("status") or {})
            self._bump(cur)
            return copy.deepcopy(cur)

    # -- resource.k8s.io/v1 ---------------------------------------------------------------------

    def put_resource_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a ResourceClaim as the scheduler leaves it (tests set
        ``status.allocation`` themselves)."""
        with self._lock:
            c = copy.deepcopy(claim)
            meta = c.setdefault("metadata", {})
            meta.setdefault("namespace", "default")
            meta.setdefault("uid", f"uid-claim-{self.uid_token}-{meta['namespace']}-"
                                   f"{meta['name']}")
            c.setdefault("kind", "ResourceClaim")
            c.setdefault("apiVersion", "resource.k8s.io/v1")
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._claims[(meta["namespace"], meta["name"])] = c
            return copy.deepcopy(c)

    def delete_resource_claim(self, namespace: str, name: str) -> None:
        with self._lock:
            self._claims.pop((namespace, name), None)

    def add_resourceclaimtemplate(self, obj: dict[str, Any]) -> None:
        with self._lock:
            meta = obj["metadata"]
            self._templates[(meta["namespace"], meta["name"])] = copy.deepcopy(obj)

    def get_resource_claim_template(self, namespace: str, name: str,
                                    timeout_s: float | None = None) -> dict[str, Any]:
        with self._lock:
            t = self._templates.get((namespace, name))
            if t is None:
                raise ApiNotFound(f'resourceclaimtemplates.resource.k8s.io "{name}" not found')
            return copy.deepcopy(t)

    def get_resource_claim(self, namespace: str, name: str,
                           timeout_s: float | None = None) -> dict[str, Any]:
        with self._lock:
            c = self._claims.get((namespace, name))
            if c is None:
                raise ApiNotFound(f'resourceclaims.resource.k8s.io "{name}" not found')
            return copy.deepcopy(c)

    def list_resource_slices(self, driver: str = "", node: str = "") -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(s) for s in self._slices.values()
                    if (not driver or s["spec"].get("driver") == driver)
                    and (not node or s["spec"].get("nodeName") == node)]

    def create_resource_slice(self, obj: dict[str, Any],
                              dry_run: bool = False) -> dict[str, Any]:
        s = copy.deepcopy(obj)
        meta = s.setdefault("metadata", {})
        s.setdefault("kind", "ResourceSlice")
        s.setdefault("apiVersion", "resource.k8s.io/v1")
        drop_gated_fields(s.setdefault("spec", {}), self.dra_gates)
        normalize_slice_spec(s["spec"], _now())
        with self._lock:
            name = meta.get("name") or ""
            if not name and meta.get("generateName"):
                name = f"{meta['generateName']}{len(self._slices) + self._rv:05x}"
            if not name:
                raise ValidationError("metadata.name", "a name or generateName", meta)
            if name in self._slices:
                raise ApiConflict(f'resourceslices "{name}" already exists')
            meta["name"] = name
            meta.setdefault("uid", f"uid-slice-{self.uid_token}-{name}")
            if dry_run:
                return s
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._slices[name] = s
            return copy.deepcopy(s)

    def update_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        s = copy.deepcopy(obj)
        meta = s.get("metadata") or {}
        drop_gated_fields(s.setdefault("spec", {}), self.dra_gates)
        normalize_slice_spec(s["spec"], _now())
        with self._lock:
            cur = self._slices.get(str(meta.get("name")))
            if cur is None:
                raise ApiNotFound(f'resourceslices "{meta.get("name")}" not found')
            if meta.get("resourceVersion") and \
                    meta["resourceVersion"] != cur["metadata"]["resourceVersion"]:
                raise ApiConflict(f'resourceslices "{meta["name"]}" changed')
            self._rv += 1
            s["metadata"] = {**cur["metadata"], **meta, "resourceVersion": str(self._rv)}
            self._slices[s["metadata"]["name"]] = s
            return copy.deepcopy(s)

    def delete_resource_slice(self, name: str) -> None:
        with self._lock:
            if self._slices.pop(name, None) is None:
                raise ApiNotFound(f'resourceslices "{name}" not found')
