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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuslice.core.errors import GpusliceError, ValidationError


class ApiConflict(GpusliceError):
    """The object changed since it was read (HTTP 409)."""


class ApiNotFound(GpusliceError):
    """No such object (HTTP 404)."""


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
    def patch_node(self, name: str, labels: dict[str, str],
                   annotations: dict[str, str]) -> None: ...
    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def put_lease(self, namespace: str, name: str, spec: dict[str, Any],
                  resource_version: str | None) -> dict[str, Any]: ...
    def list_pods(self, node: str | None = None) -> list[dict[str, Any]]:
        """Every pod, or (``node``) those bound to that node (a ``spec.nodeName`` field
        selector, evaluated by the API server)."""
        ...
    def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...
    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str],
                              resource_version: str) -> dict[str, Any]: ...
    def bind(self, namespace: str, name: str, uid: str, node: str) -> None: ...


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

    def patch_node(self, name: str, labels: dict[str, str],
                   annotations: dict[str, str]) -> None:
        with self._lock:
            n = self._nodes.get(name)
            if n is None:
                raise ApiNotFound(f"node {name} not found")
            meta = n.setdefault("metadata", {})
            meta.setdefault("labels", {}).update(labels)
            meta.setdefault("annotations", {}).update(annotations)
            self._bump(n)

    def list_pods(self, node: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
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

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        with self._lock:
            p = self._pods.get((namespace, name))
            if p is None:
                raise ApiNotFound(f"pod {namespace}/{name} not found")
            if p["metadata"].get("uid") != uid:
                raise ApiConflict(f"pod {namespace}/{name} has another UID")
            if node not in self._nodes:
                raise ApiNotFound(f"node {node} not found")
            spec = p.setdefault("spec", {})
            if spec.get("nodeName") and spec["nodeName"] != node:
                raise ApiConflict(f"pod {namespace}/{name} is already bound to "
                                  f"{spec['nodeName']}")
            spec["nodeName"] = node
            self._bump(p)


def load_fake_cluster(path: Path) -> FakeApiServer:
    """A fake API server holding the ``nodes``, ``pods`` and ``sliceschedules`` lists of a
    YAML file (the ``--fake-cluster`` option of ``gpuslice extender``, ``gpuslice reconfig``
    and ``kubectl gpuslice``)."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValidationError("--fake-cluster", "a readable YAML file", str(exc)) from None
    if not isinstance(doc, dict):
        raise ValidationError("--fake-cluster", "a mapping with 'nodes' and 'pods'", type(doc))
    fake = FakeApiServer()
    for n in doc.get("nodes") or []:
        fake.add_node(n)
    for p in doc.get("pods") or []:
        fake.add_pod(p)
    for o in doc.get("sliceschedules") or []:
        fake.replace_custom("sliceschedules", o)
    return fake
