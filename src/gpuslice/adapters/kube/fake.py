"""An in-memory API server fake behind the same port the extender uses.

Pods and nodes are plain Kubernetes JSON objects. Every write bumps a cluster-wide
``resourceVersion``; a patch that names a stale ``resourceVersion`` fails with :class:`Conflict`
(optimistic concurrency, as the API server's 409). A Binding sets ``spec.nodeName`` once; binding
a bound pod again to another node is a conflict. Thread-safe, so concurrent extender requests
can share it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuslice.core.errors import GpusliceError, ValidationError


class ApiConflict(GpusliceError):
    """The object changed since it was read (HTTP 409)."""


class ApiNotFound(GpusliceError):
    """No such object (HTTP 404)."""


class ApiInvalid(GpusliceError):
    """The request cannot apply to the object as it is (HTTP 422), e.g. a JSON patch that
    removes a key the object does not have."""


def json_pointer(*parts: str) -> str:
    """An RFC 6901 pointer to ``parts``: ``~`` is written ``~0`` and ``/`` ``~1``
    (``/status/capacity/gpuslice.io~1gpu-milli``), as ``kubectl patch --type=json`` wants."""
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def apply_json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """``doc`` with the RFC 6902 operations ``add``, ``remove``, ``replace`` and ``test``
    applied, all or none (a copy is changed): a missing path (``remove``, ``replace``) or a
    failed ``test`` raises :class:`ApiInvalid`, as kube-apiserver answers 422."""
    out = copy.deepcopy(doc)
    for i, op in enumerate(ops):
        kind, path = op.get("op"), op.get("path")
        if kind not in ("add", "remove", "replace", "test") or not isinstance(path, str) or \
                (path and not path.startswith("/")):
            raise ApiInvalid(f"patch[{i}]: unsupported operation {op!r}")
        keys = [k.replace("~1", "/").replace("~0", "~") for k in path.split("/")[1:]]
        if not keys:
            raise ApiInvalid(f"patch[{i}]: the whole document cannot be patched")
        parent = out
        for k in keys[:-1]:
            if isinstance(parent, dict) and k in parent:
                parent = parent[k]
            elif isinstance(parent, list) and k.isdigit() and int(k) < len(parent):
                parent = parent[int(k)]
            else:
                raise ApiInvalid(f"patch[{i}] {kind} {path}: no such path")
        last = keys[-1]
        if not isinstance(parent, dict):
            raise ApiInvalid(f"patch[{i}] {kind} {path}: only object members are supported")
        if kind == "add":
            parent[last] = copy.deepcopy(op.get("value"))
        elif last not in parent:
            raise ApiInvalid(f"patch[{i}] {kind} {path}: Unable to {kind} nonexistent key: "
                             f"{last}: missing value")
        elif kind == "remove":
            del parent[last]
        elif kind == "replace":
            parent[last] = copy.deepcopy(op.get("value"))
        elif parent[last] != op.get("value"):
            raise ApiInvalid(f"patch[{i}] test {path}: testing value {parent[last]!r} failed")
    return out


@dataclass(frozen=True)
class WatchEvent:
    """A change to a pod or node: ``ADDED``, ``MODIFIED`` or ``DELETED``, with the object."""

    type: str
    kind: str  # "Pod" or "Node"
    obj: dict[str, Any]


class KubePort(Protocol):
    def watch(self, since: str, timeout_s: float) -> tuple[list[WatchEvent], str]:
        """Pod and node events after ``since`` (waiting up to ``timeout_s`` for the first), and
        the token to continue from (opaque: this fake's resourceVersion; the real client's
        watches stay open between calls). ``since=""`` starts from now. A watch that broke
        (an expired resourceVersion) raises, and the caller re-reads and starts again."""
        ...

    def list_nodes(self) -> list[dict[str, Any]]: ...
    def get_node(self, name: str) -> dict[str, Any]: ...
    def patch_node(self, name: str, labels: Mapping[str, str | None],
                   annotations: Mapping[str, str | None]) -> None:
        """Set labels and annotations of the node (``None`` removes one; one absent already
        is no error)."""
        ...
    def patch_node_capacity(self, name: str, resources: dict[str, str]) -> None:
        """Set node-level extended resources in ``status.capacity`` and ``allocatable`` (the
        node's status subresource, as the Kubernetes docs advertise extended resources)."""
        ...
    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def put_lease(self, namespace: str, name: str, spec: dict[str, Any],
                  resource_version: str | None) -> dict[str, Any]: ...
    def list_pods(self, node: str | None = None,
                  timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Every pod, or (``node``) those bound to that node (a ``spec.nodeName`` field
        selector, evaluated by the API server). ``timeout_s``: an answer or an error within
        that many seconds, connection, reads and retries included (None: the client's own
        per-attempt timeout and retries)."""
        ...
    def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...
    def list_pod_disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        """The PodDisruptionBudgets of ``namespace`` (policy/v1), with their status."""
        ...
    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str],
                              resource_version: str) -> dict[str, Any]: ...
    def bind(self, namespace: str, name: str, uid: str, node: str,
             annotations: Mapping[str, str] | None = None,
             resource_version: str | None = None) -> None:
        """Bind the pod to ``node`` (its ``binding`` subresource), setting ``annotations`` on
        it in the same write; ``uid`` and ``resource_version`` (when given) are
        preconditions."""
        ...


class PodLabelPort(Protocol):
    """What a replica needs to mark its own pod (a Service that selects the label then sends
    its traffic there): read the pod, and set or remove labels with a JSON merge patch
    (``None`` removes a label; one absent already is no error)."""

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...
    def patch_pod_labels(self, namespace: str, name: str,
                         labels: Mapping[str, str | None]) -> dict[str, Any]: ...


class NodeCleanupPort(Protocol):
    """What taking gpuslice off a node needs (the node agent when it is uninstalled, and
    ``gpuslice node-agent --cleanup``): its nodes, their labels and annotations, a JSON patch
    of a node's ``status`` subresource (a list of RFC 6902 operations: extended resources are
    removed with ``remove`` operations, as ``kubectl patch --subresource=status --type=json``
    does), and, to tell an uninstall from a restart, the agent's own pod and its DaemonSet."""

    def list_nodes(self) -> list[dict[str, Any]]: ...
    def get_node(self, name: str) -> dict[str, Any]: ...
    def patch_node(self, name: str, labels: Mapping[str, str | None],
                   annotations: Mapping[str, str | None]) -> None: ...
    def patch_node_status(self, name: str, ops: list[dict[str, Any]]) -> None: ...
    def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...
    def get_daemonset(self, namespace: str, name: str) -> dict[str, Any]: ...


class DaemonSetPort(Protocol):
    """Deleting a DaemonSet (``propagation``: Background, Foreground or Orphan) and reading
    it until it is gone."""

    def get_daemonset(self, namespace: str, name: str) -> dict[str, Any]: ...
    def delete_daemonset(self, namespace: str, name: str,
                         propagation: str = "Background") -> None: ...


class ClusterPort(KubePort, Protocol):
    """What a controller that moves pods needs on top of :class:`KubePort`: creating and
    deleting pods, and gpuslice's custom objects (``SliceSchedule``) with optimistic
    concurrency on replace."""

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]: ...
    def delete_pod(self, namespace: str, name: str) -> None: ...
    def list_custom(self, plural: str) -> list[dict[str, Any]]: ...
    def get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any]: ...
    def replace_custom(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]: ...
    def list_deployments(self, namespace: str) -> list[dict[str, Any]]: ...
    def create_deployment(self, obj: dict[str, Any]) -> dict[str, Any]: ...
    def delete_deployment(self, namespace: str, name: str) -> None: ...


class DraPort(Protocol):
    """What a DRA driver needs of the API server (``resource.k8s.io/v1``): its claims, its
    node's ResourceSlices (``dry_run`` creates nothing and answers what would be stored, as
    ``?dryRun=All``: fields of a disabled feature gate are dropped), Events, and the claim
    allocator's Lease (read only: its devices carry the allocator's taint while it is
    fresh)."""

    def get_node(self, name: str) -> dict[str, Any]: ...
    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def get_resource_claim(self, namespace: str, name: str,
                           timeout_s: float | None = None) -> dict[str, Any]:
        """``timeout_s``: an answer or an error within that many seconds, all attempts
        included (see :meth:`KubePort.list_pods`)."""
        ...
    def list_resource_slices(self, driver: str = "", node: str = "") -> list[dict[str, Any]]: ...
    def create_resource_slice(self, obj: dict[str, Any],
                              dry_run: bool = False) -> dict[str, Any]: ...
    def update_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]: ...
    def delete_resource_slice(self, name: str) -> None: ...
    def create_event(self, namespace: str, event: dict[str, Any]) -> None: ...


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


def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


class DraApiPort(Protocol):
    """What the DRA claim allocator needs (resource.k8s.io/v1): slices and classes to read,
    claims to read and to update (metadata, then the status subresource), both writes
    preconditioned on the claim's ``metadata.resourceVersion`` (a stale one: 409)."""

    def list_resource_slices(self, driver: str = "", node: str = "") -> list[dict[str, Any]]: ...
    def list_device_classes(self) -> list[dict[str, Any]]: ...
    def list_resource_claims(self) -> list[dict[str, Any]]: ...
    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...
    def update_resource_claim(self, claim: dict[str, Any]) -> dict[str, Any]: ...
    def update_resource_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]: ...


class FakeApiServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._events: list[tuple[int, WatchEvent]] = []
        self._rv = 0
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._leases: dict[tuple[str, str], dict[str, Any]] = {}
        self._custom: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._deployments: dict[tuple[str, str], dict[str, Any]] = {}
        self._daemonsets: dict[tuple[str, str], dict[str, Any]] = {}
        self._claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._slices: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []  # core/v1 Events created
        # the DRA feature gates this API server has on (1.36 defaults: all three beta, on)
        self.dra_gates: set[str] = set(GATED_FIELDS)
        self._classes: dict[str, dict[str, Any]] = {}
        self._pdbs: dict[tuple[str, str], dict[str, Any]] = {}

    def add_pdb(self, pdb: dict[str, Any]) -> None:
        """Store a PodDisruptionBudget as given (its ``status``, which the disruption
        controller would keep, included)."""
        meta = pdb.get("metadata") or {}
        with self._lock:
            self._pdbs[(meta.get("namespace", "default"), meta["name"])] = copy.deepcopy(pdb)

    def list_pod_disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy([p for (ns, _), p in self._pdbs.items() if ns == namespace])

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

    def _bump(self, obj: dict[str, Any], event: str = "MODIFIED") -> None:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        kind = str(obj.get("kind", "Pod"))
        self._events.append((self._rv, WatchEvent(event, kind, copy.deepcopy(obj))))
        self._changed.notify_all()

    def watch(self, since: str, timeout_s: float) -> tuple[list[WatchEvent], str]:
        with self._changed:
            start = int(since) if since else self._rv
            if not any(rv > start for rv, _ in self._events[-1:]):
                self._changed.wait(timeout_s)
            out = [ev for rv, ev in self._events if rv > start]
            return out, str(self._rv)

    def add_node(self, node: dict[str, Any]) -> None:
        with self._lock:
            n = copy.deepcopy(node)
            n.setdefault("kind", "Node")
            self._bump(n, "ADDED")
            self._nodes[n["metadata"]["name"]] = n

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            p = copy.deepcopy(pod)
            meta = p.setdefault("metadata", {})
            meta.setdefault("namespace", "default")
            meta.setdefault("uid", f"uid-{meta['namespace']}-{meta['name']}")
            p.setdefault("kind", "Pod")
            self._bump(p, "ADDED")
            self._pods[(meta["namespace"], meta["name"])] = p
            return copy.deepcopy(p)

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        meta = pod.get("metadata") or {}
        with self._lock:
            if (meta.get("namespace", "default"), meta.get("name")) in self._pods:
                raise ApiConflict(f"pod {meta.get('namespace', 'default')}/{meta.get('name')} "
                                  "already exists")
        return self.add_pod(pod)

    def set_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """The kubelet's status update (pods/status)."""
        with self._lock:
            p = self._pods.get((namespace, name))
            if p is None:
                raise ApiNotFound(f"pod {namespace}/{name} not found")
            p["status"] = copy.deepcopy(status)
            self._bump(p)

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
        """Create (no resourceVersion) or replace (matching resourceVersion) an object."""
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
            self._rv += 1
            o["metadata"]["resourceVersion"] = str(self._rv)
            self._custom[key] = o
            return copy.deepcopy(o)

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
            meta.setdefault("uid", f"uid-claim-{meta['namespace']}-{meta['name']}")
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

    def delete_pod(self, namespace: str, name: str) -> None:
        with self._lock:
            p = self._pods.pop((namespace, name), None)
            if p is not None:
                self._bump(p, "DELETED")

    def list_nodes(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(list(self._nodes.values()))

    def get_node(self, name: str) -> dict[str, Any]:
        with self._lock:
            n = self._nodes.get(name)
            if n is None:
                raise ApiNotFound(f"node {name} not found")
            return copy.deepcopy(n)

    def patch_node(self, name: str, labels: Mapping[str, str | None],
                   annotations: Mapping[str, str | None]) -> None:
        with self._lock:
            n = self._nodes.get(name)
            if n is None:
                raise ApiNotFound(f"node {name} not found")
            meta = n.setdefault("metadata", {})
            for field, values in (("labels", labels), ("annotations", annotations)):
                mine = meta.setdefault(field, {})
                for k, v in values.items():
                    if v is None:
                        mine.pop(k, None)
                    else:
                        mine[k] = v
            self._bump(n)

    def patch_node_status(self, name: str, ops: list[dict[str, Any]]) -> None:
        """A JSON patch (RFC 6902) of the node's ``status`` subresource: only ``status``
        changes (the API server's status strategy keeps the rest); all operations or none."""
        with self._lock:
            n = self._nodes.get(name)
            if n is None:
                raise ApiNotFound(f"node {name} not found")
            patched = apply_json_patch(n, ops)
            n["status"] = patched.get("status") or {}
            self._bump(n)

    def patch_node_capacity(self, name: str, resources: dict[str, str]) -> None:
        with self._lock:
            n = self._nodes.get(name)
            if n is None:
                raise ApiNotFound(f"node {name} not found")
            status = n.setdefault("status", {})
            for field in ("capacity", "allocatable"):
                status.setdefault(field, {}).update(resources)
            self._bump(n)

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(copy.deepcopy({**event, "metadata": {
                **(event.get("metadata") or {}), "namespace": namespace}}))

    def list_pods(self, node: str | None = None,
                  timeout_s: float | None = None) -> list[dict[str, Any]]:
        with self._lock:  # in memory: answered at once, whatever the deadline
            return copy.deepcopy([p for p in self._pods.values()
                                  if node is None or (p.get("spec") or {}).get("nodeName", "")
                                  == node])

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            p = self._pods.get((namespace, name))
            if p is None:
                raise ApiNotFound(f"pod {namespace}/{name} not found")
            return copy.deepcopy(p)

    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str],
                              resource_version: str) -> dict[str, Any]:
        with self._lock:
            p = self._pods.get((namespace, name))
            if p is None:
                raise ApiNotFound(f"pod {namespace}/{name} not found")
            if p["metadata"]["resourceVersion"] != resource_version:
                raise ApiConflict(f"pod {namespace}/{name} changed (resourceVersion "
                                  f"{p['metadata']['resourceVersion']} != {resource_version})")
            p["metadata"].setdefault("annotations", {}).update(annotations)
            self._bump(p)
            return copy.deepcopy(p)

    def patch_pod_labels(self, namespace: str, name: str,
                         labels: Mapping[str, str | None]) -> dict[str, Any]:
        """A JSON merge patch of the pod's labels: ``None`` removes one."""
        with self._lock:
            p = self._pods.get((namespace, name))
            if p is None:
                raise ApiNotFound(f"pod {namespace}/{name} not found")
            mine = p["metadata"].setdefault("labels", {})
            for k, v in labels.items():
                if v is None:
                    mine.pop(k, None)
                else:
                    mine[k] = v
            self._bump(p)
            return copy.deepcopy(p)

    def bind(self, namespace: str, name: str, uid: str, node: str,
             annotations: Mapping[str, str] | None = None,
             resource_version: str | None = None) -> None:
        with self._lock:
            p = self._pods.get((namespace, name))
            if p is None:
                raise ApiNotFound(f"pod {namespace}/{name} not found")
            if p["metadata"].get("uid") != uid:
                raise ApiConflict(f"pod {namespace}/{name} has another UID")
            if resource_version and p["metadata"].get("resourceVersion") != resource_version:
                raise ApiConflict(f"pod {namespace}/{name} changed (resourceVersion "
                                  f"{p['metadata'].get('resourceVersion')} != "
                                  f"{resource_version})")
            if node not in self._nodes:
                raise ApiNotFound(f"node {node} not found")
            spec = p.setdefault("spec", {})
            if spec.get("nodeName") and spec["nodeName"] != node:
                raise ApiConflict(f"pod {namespace}/{name} is already bound to "
                                  f"{spec['nodeName']}")
            spec["nodeName"] = node
            if annotations:
                p["metadata"].setdefault("annotations", {}).update(annotations)
            self._bump(p)


    # -- resource.k8s.io/v1 ---------------------------------------------------------------------

    def put_resource_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a ResourceClaim as the scheduler leaves it (tests set
        ``status.allocation`` themselves)."""
        with self._lock:
            c = copy.deepcopy(claim)
            meta = c.setdefault("metadata", {})
            meta.setdefault("namespace", "default")
            meta.setdefault("uid", f"uid-claim-{meta['namespace']}-{meta['name']}")
            c.setdefault("kind", "ResourceClaim")
            c.setdefault("apiVersion", "resource.k8s.io/v1")
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._claims[(meta["namespace"], meta["name"])] = c
            return copy.deepcopy(c)

    def delete_resource_claim(self, namespace: str, name: str) -> None:
        with self._lock:
            self._claims.pop((namespace, name), None)

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
            meta.setdefault("uid", f"uid-slice-{name}")
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



def load_fake_cluster(path: Path) -> FakeApiServer:
    """A fake API server holding the ``nodes``, ``pods`` and ``sliceschedules`` lists of a
    YAML file (the ``--fake-cluster`` option of ``gpuslice extender``, ``gpuslice reconfig``
    and ``kubectl gpuslice``)."""
    import yaml

    from gpuslice.adapters.kube.objects import node_inventory

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValidationError("--fake-cluster", "a readable YAML file", str(exc)) from None
    where = f"--fake-cluster {path}"
    if not isinstance(doc, dict):
        raise ValidationError(where, "a mapping with 'nodes' (and 'pods', 'sliceschedules'); "
                              "see examples/fake-cluster.yaml", type(doc).__name__)
    unknown = sorted(str(k) for k in doc if k not in FAKE_CLUSTER_KEYS)
    if unknown or not any(k in doc for k in FAKE_CLUSTER_KEYS):
        raise ValidationError(where, f"only the keys {', '.join(FAKE_CLUSTER_KEYS)} (see "
                              "examples/fake-cluster.yaml)",
                              f"keys {unknown}" if unknown else "none of them")
    lists: dict[str, list[Any]] = {}
    for key in FAKE_CLUSTER_KEYS:
        items = doc.get(key) or []
        if not isinstance(items, list):
            raise ValidationError(f"{where}: {key}", "a list", type(items).__name__)
        for i, item in enumerate(items):
            meta = item.get("metadata") if isinstance(item, dict) else None
            if not isinstance(meta, dict) or not meta.get("name"):
                raise ValidationError(f"{where}: {key}[{i}].metadata.name",
                                      "an object with a name", item)
            if key == "pods" and not meta.get("namespace"):
                raise ValidationError(f"{where}: pods[{i}].metadata.namespace",
                                      "the pod's namespace", meta.get("namespace"))
            if key == "nodes":
                try:
                    node_inventory(item)  # a bad GPU inventory annotation is named here
                except ValidationError as exc:
                    raise ValidationError(f"{where}: {exc.field}", exc.expected,
                                          exc.got) from None
        lists[key] = items
    fake = FakeApiServer()
    for n in lists["nodes"]:
        fake.add_node(n)
    for p in lists["pods"]:
        fake.add_pod(p)
    for o in lists["sliceschedules"]:
        fake.replace_custom("sliceschedules", o)
    return fake


FAKE_CLUSTER_KEYS = ("nodes", "pods", "sliceschedules")
