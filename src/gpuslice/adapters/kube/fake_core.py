"""The in-memory API server fake's core/v1 part: pods, nodes, PodDisruptionBudgets and
Events (see :mod:`gpuslice.adapters.kube.fake`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from gpuslice.adapters.kube.fake_state import FakeState
from gpuslice.adapters.kube.jsonpatch import apply_json_patch
from gpuslice.adapters.kube.ports import ApiConflict, ApiInvalid, ApiNotFound


class FakeCoreApi(FakeState):
    """Pods, nodes, PodDisruptionBudgets and Events."""

    def add_pdb(self, pdb: dict[str, Any]) -> None:
        """Store a PodDisruptionBudget as given (its ``status``, which the disruption
        controller would keep, included)."""
        meta = pdb.get("metadata") or {}
        with self._lock:
            self._pdbs[(meta.get("namespace", "default"), meta["name"])] = copy.deepcopy(pdb)

    def list_pod_disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy([p for (ns, _), p in self._pdbs.items() if ns == namespace])

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

    def _pod_at(self, namespace: str, name: str, resource_version: str) -> dict[str, Any]:
        """The stored pod, if it is still at ``resource_version`` (a patch's precondition);
        lock held."""
        p = self._pods.get((namespace, name))
        if p is None:
            raise ApiNotFound(f"pod {namespace}/{name} not found")
        if p["metadata"]["resourceVersion"] != resource_version:
            raise ApiConflict(f"pod {namespace}/{name} changed (resourceVersion "
                              f"{p['metadata']['resourceVersion']} != {resource_version})")
        return p

    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str],
                              resource_version: str) -> dict[str, Any]:
        with self._lock:
            p = self._pod_at(namespace, name, resource_version)
            p["metadata"].setdefault("annotations", {}).update(annotations)
            self._bump(p)
            return copy.deepcopy(p)

    def patch_pod_metadata(self, namespace: str, name: str, labels: Mapping[str, str | None],
                           annotations: Mapping[str, str | None],
                           resource_version: str) -> dict[str, Any]:
        with self._lock:
            p = self._pod_at(namespace, name, resource_version)
            _merge(p["metadata"], "labels", labels)
            _merge(p["metadata"], "annotations", annotations)
            self._bump(p)
            return copy.deepcopy(p)

    def remove_pod_scheduling_gate(self, namespace: str, name: str,
                                   ops: list[dict[str, Any]]) -> dict[str, Any]:
        """A JSON patch of the pod that may remove scheduling gates (as the API server's
        ``validateOnlyDeletedSchedulingGates``) and, while the pod as read was gated, change
        the preferred terms of its node affinity (``validateNodeAffinityMutation``: the
        required ones only narrowed; this fake allows them no change at all), and its
        annotations; the rest of the spec is immutable."""
        with self._lock:
            p = self._pods.get((namespace, name))
            if p is None:
                raise ApiNotFound(f"pod {namespace}/{name} not found")
            patched = apply_json_patch(p, ops)
            old_spec = p.get("spec") or {}
            before = {g.get("name") for g in old_spec.get("schedulingGates") or []}
            spec = dict(patched.get("spec") or {})
            after = {g.get("name") for g in spec.pop("schedulingGates", None) or []}
            rest = {k: v for k, v in old_spec.items() if k != "schedulingGates"}
            if before:  # a gated pod: its preferred node-affinity terms may change
                spec, rest = _without_preferred(spec), _without_preferred(rest)
            if after - before or spec != rest:
                raise ApiInvalid(f"pod {namespace}/{name}: only the deletion of scheduling "
                                 "gates (and, while gated, a change of preferred node "
                                 "affinity) is allowed here")
            p["spec"] = patched["spec"]
            annotations = (patched.get("metadata") or {}).get("annotations")
            if annotations is not None:
                p["metadata"]["annotations"] = annotations
            self._bump(p)
            return copy.deepcopy(p)

    def patch_node_annotations(self, name: str, annotations: Mapping[str, str | None],
                               resource_version: str) -> dict[str, Any]:
        with self._lock:
            n = self._nodes.get(name)
            if n is None:
                raise ApiNotFound(f"node {name} not found")
            if n["metadata"].get("resourceVersion") != resource_version:
                raise ApiConflict(f"node {name} changed (resourceVersion "
                                  f"{n['metadata'].get('resourceVersion')} != "
                                  f"{resource_version})")
            _merge(n["metadata"], "annotations", annotations)
            self._bump(n)
            return copy.deepcopy(n)

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


def _merge(meta: dict[str, Any], field: str, values: Mapping[str, str | None]) -> None:
    """A merge patch of ``meta[field]``: ``None`` removes a key."""
    mine = meta.setdefault(field, {})
    for k, v in values.items():
        if v is None:
            mine.pop(k, None)
        else:
            mine[k] = v


def _without_preferred(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` without its node affinity's preferred terms (an affinity left empty goes)."""
    out = dict(spec)
    affinity = dict(out.get("affinity") or {})
    node = dict(affinity.get("nodeAffinity") or {})
    node.pop("preferredDuringSchedulingIgnoredDuringExecution", None)
    if node:
        affinity["nodeAffinity"] = node
    else:
        affinity.pop("nodeAffinity", None)
    if affinity:
        out["affinity"] = affinity
    else:
        out.pop("affinity", None)
    return out
