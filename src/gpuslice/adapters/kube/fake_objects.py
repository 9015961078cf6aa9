"""The in-memory API server fake's other stores: Leases, custom objects (SliceSchedule),
Deployments and DaemonSets (see :mod:`gpuslice.adapters.kube.fake`)."""

from __future__ import annotations

import copy
from typing import Any

from gpuslice.adapters.kube.fake_state import FakeState, _now
from gpuslice.adapters.kube.ports import ApiConflict, ApiNotFound


class FakeObjectsApi(FakeState):
    """Leases, custom objects, Deployments and DaemonSets."""

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            lease = self._leases.get((namespace, name))
            return copy.deepcopy(lease) if lease else None

    def put_lease(self, namespace: str, name: str, spec: dict[str, Any],
                  resource_version: str | None) -> dict[str, Any]:
        """Create the lease (``resource_version`` None) or replace its spec, optimistically."""
        with self._lock:
            cur = self._leases.get((namespace, name))
            if resource_version is None:
                if cur is not None:
                    raise ApiConflict(f"lease {namespace}/{name} already exists")
            elif cur is None or cur["metadata"]["resourceVersion"] != resource_version:
                raise ApiConflict(f"lease {namespace}/{name} changed")
            self._rv += 1
            lease = {"metadata": {"name": name, "namespace": namespace,
                                  "resourceVersion": str(self._rv)}, "spec": dict(spec)}
            self._leases[(namespace, name)] = lease
            return copy.deepcopy(lease)

    # -- custom objects (SliceSchedule) -----------------------------------------------------

    def list_custom(self, plural: str) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(o) for (pl, _, _), o in self._custom.items() if pl == plural]

    def get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            o = self._custom.get((plural, namespace, name))
            if o is None:
                raise ApiNotFound(f"{plural} {namespace}/{name} not found")
            return copy.deepcopy(o)

    def replace_custom(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create (no resourceVersion) or replace (matching resourceVersion) an object. A
        replace keeps the stored ``finalizers`` and ``deletionTimestamp`` (as the status
        subresource does: only :meth:`update_custom` changes finalizers)."""
        meta = obj.get("metadata") or {}
        key = (plural, str(meta.get("namespace", "default")), str(meta.get("name")))
        with self._lock:
            cur = self._custom.get(key)
            rv = meta.get("resourceVersion")
            if rv is None and cur is not None:
                raise ApiConflict(f"{plural} {key[1]}/{key[2]} already exists")
            if rv is not None and (cur is None or cur["metadata"]["resourceVersion"] != rv):
                raise ApiConflict(f"{plural} {key[1]}/{key[2]} changed")
            o = copy.deepcopy(obj)
            o.setdefault("metadata", {})["namespace"] = key[1]
            if cur is not None:
                for k in ("finalizers", "deletionTimestamp"):
                    o["metadata"].pop(k, None)
                    if k in cur["metadata"]:
                        o["metadata"][k] = copy.deepcopy(cur["metadata"][k])
            self._rv += 1
            o["metadata"]["resourceVersion"] = str(self._rv)
            self._custom[key] = o
            return copy.deepcopy(o)

    def update_custom(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """The main resource: metadata (finalizers) and spec, at the object's resourceVersion;
        the status stays. An object being deleted whose finalizers this empties is gone."""
        meta = obj.get("metadata") or {}
        key = (plural, str(meta.get("namespace", "default")), str(meta.get("name")))
        with self._lock:
            cur = self._custom.get(key)
            if cur is None:
                raise ApiNotFound(f"{plural} {key[1]}/{key[2]} not found")
            if meta.get("resourceVersion") != cur["metadata"]["resourceVersion"]:
                raise ApiConflict(f"{plural} {key[1]}/{key[2]} changed")
            o = copy.deepcopy(obj)
            o["metadata"]["namespace"] = key[1]
            o["status"] = copy.deepcopy(cur.get("status"))
            if "deletionTimestamp" in cur["metadata"]:
                o["metadata"]["deletionTimestamp"] = cur["metadata"]["deletionTimestamp"]
                if not o["metadata"].get("finalizers"):
                    del self._custom[key]
                    return o
            self._rv += 1
            o["metadata"]["resourceVersion"] = str(self._rv)
            self._custom[key] = o
            return copy.deepcopy(o)

    def delete_custom(self, plural: str, namespace: str, name: str) -> None:
        """Delete an object: gone at once without finalizers, else kept with a
        ``deletionTimestamp`` until :meth:`update_custom` removes the last one."""
        key = (plural, namespace, name)
        with self._lock:
            cur = self._custom.get(key)
            if cur is None:
                raise ApiNotFound(f"{plural} {namespace}/{name} not found")
            if not cur["metadata"].get("finalizers"):
                del self._custom[key]
                return
            cur["metadata"].setdefault("deletionTimestamp", _now())
            self._rv += 1
            cur["metadata"]["resourceVersion"] = str(self._rv)

    # -- Deployments (no controller here: tests run a stand-in for the ReplicaSet controller) --

    def list_deployments(self, namespace: str) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(d) for (ns, _), d in self._deployments.items()
                    if ns == namespace]

    def create_deployment(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "default")), str(meta.get("name")))
        with self._lock:
            if key in self._deployments:
                raise ApiConflict(f"deployment {key[0]}/{key[1]} already exists")
            d = copy.deepcopy(obj)
            d.setdefault("metadata", {})["namespace"] = key[0]
            d["metadata"].setdefault("uid", f"uid-deploy-{key[0]}-{key[1]}")
            self._rv += 1
            d["metadata"]["resourceVersion"] = str(self._rv)
            self._deployments[key] = d
            return copy.deepcopy(d)

    def delete_deployment(self, namespace: str, name: str) -> None:
        with self._lock:
            self._deployments.pop((namespace, name), None)

    # -- DaemonSets (stored as given: no controller; tests delete the pods themselves) --------

    def add_daemonset(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "default")), str(meta.get("name")))
        with self._lock:
            d = copy.deepcopy(obj)
            d.setdefault("kind", "DaemonSet")
            d.setdefault("apiVersion", "apps/v1")
            d.setdefault("metadata", {})["namespace"] = key[0]
            d["metadata"].setdefault("uid", f"uid-ds-{key[0]}-{key[1]}")
            self._rv += 1
            d["metadata"]["resourceVersion"] = str(self._rv)
            self._daemonsets[key] = d
            return copy.deepcopy(d)

    def get_daemonset(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            d = self._daemonsets.get((namespace, name))
            if d is None:
                raise ApiNotFound(f'daemonsets.apps "{name}" not found')
            return copy.deepcopy(d)

    def delete_daemonset(self, namespace: str, name: str, propagation: str = "Background",
                         timestamp: str = "") -> None:
        """``Background`` (and ``Orphan``): gone at once; ``Foreground``: kept with a
        ``deletionTimestamp`` and the ``foregroundDeletion`` finalizer until
        :meth:`finish_daemonset_deletion` (the garbage collector, once its pods are gone)."""
        with self._lock:
            d = self._daemonsets.get((namespace, name))
            if d is None:
                raise ApiNotFound(f'daemonsets.apps "{name}" not found')
            if propagation != "Foreground":
                del self._daemonsets[(namespace, name)]
                return
            meta = d["metadata"]
            meta.setdefault("deletionTimestamp", timestamp or _now())
            if "foregroundDeletion" not in meta.setdefault("finalizers", []):
                meta["finalizers"].append("foregroundDeletion")
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)

    def finish_daemonset_deletion(self, namespace: str, name: str) -> None:
        with self._lock:
            self._daemonsets.pop((namespace, name), None)
