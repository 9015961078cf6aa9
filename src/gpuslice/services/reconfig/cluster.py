"""The reconfiguration controller's reads and writes of nodes and pods.

Annotations that several writers share (a node's cordoned GPUs and desired MIG layouts, a
pod's draining mark) are read-modify-written at the object's resourceVersion: a write that
lost a race (409) reads the object again and redoes its change, so two controllers at once (a
replacement of an evicted controller pod beside the old one, before the Lease settles it) never
undo each other's cordons."""

from __future__ import annotations

import json
from typing import Any

from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound, ClusterPort
from gpuslice.adapters.kube.objects import (
    CORDONED_ANNOTATION,
    DRAINING_ANNOTATION,
    DRAINING_LABEL,
    InventoryGpu,
    node_inventory,
    pod_request,
)
from gpuslice.core import catalog, migmps
from gpuslice.core.assignment import ANNOTATION, Assignment
from gpuslice.core.errors import ValidationError
from gpuslice.core.reconfig import GpuRoom, PodNeed, room_for
from gpuslice.services.node_layouts import MIG_DESIRED
from gpuslice.services.reconfig.pods import Gpu, split

TRIES = 10  # a read-modify-write that keeps losing its race gives up (the next pass retries)


def annotation(node: dict[str, Any], name: str) -> Any:
    """A node annotation the controller reads: the cordoned GPUs as a list, the others as the
    JSON map they hold ({} when absent or unreadable)."""
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(name)
    if name == CORDONED_ANNOTATION:
        return [u for u in (raw or "").split(",") if u]
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ClusterOps:
    def __init__(self, api: ClusterPort) -> None:
        self.api = api

    # -- nodes ----------------------------------------------------------------------------

    def set_cordon(self, node: str, uuid: str, on: bool) -> None:
        """Put ``uuid`` into the node's cordoned GPUs (or take it out)."""
        def change(n: dict[str, Any]) -> dict[str, str | None] | None:
            cur = annotation(n, CORDONED_ANNOTATION)
            new = sorted(set(cur) | {uuid}) if on else [u for u in cur if u != uuid]
            return None if new == cur else {CORDONED_ANNOTATION: ",".join(new)}
        self._node_write(node, change)

    def set_desired(self, node: str, uuid: str, layout: str | None) -> None:
        """Ask the node agent for ``layout`` on ``uuid`` (None: withdraw the request)."""
        def change(n: dict[str, Any]) -> dict[str, str | None] | None:
            cur = dict(annotation(n, MIG_DESIRED))
            if cur.get(uuid) == layout or (layout is None and uuid not in cur):
                return None
            if layout is None:
                del cur[uuid]
            else:
                cur[uuid] = layout
            return {MIG_DESIRED: json.dumps(cur, sort_keys=True) if cur else None}
        self._node_write(node, change)

    def _node_write(self, name: str, change: Any) -> None:
        for _ in range(TRIES):
            node = self.api.get_node(name)
            ann = change(node)
            if ann is None:
                return
            try:
                self.api.patch_node_annotations(name, ann,
                                                node["metadata"]["resourceVersion"])
                return
            except ApiConflict:
                continue  # someone wrote the node meanwhile: read it again, redo the change
        raise ApiConflict(f"node {name}: changed under every one of {TRIES} writes")

    # -- pods -----------------------------------------------------------------------------

    def exists(self, pod_key: str) -> bool:
        try:
            self.api.get_pod(*split(pod_key))
        except ApiNotFound:
            return False
        return True

    def mark_draining(self, pod_key: str) -> None:
        """The draining mark, as an annotation and a label in one write (routers select the
        label); a pod gone is no error."""
        self.patch_pod(pod_key, {DRAINING_LABEL: "true"}, {DRAINING_ANNOTATION: "true"})

    def patch_pod(self, pod_key: str, labels: dict[str, str | None],
                  annotations: dict[str, str | None]) -> bool:
        """Labels and annotations of a pod at its resourceVersion, read again on a conflict;
        False when the pod is gone."""
        ns, name = split(pod_key)
        for _ in range(TRIES):
            try:
                p = self.api.get_pod(ns, name)
                meta = p["metadata"]
                if all((meta.get("labels") or {}).get(k) == v for k, v in labels.items()) and \
                        all((meta.get("annotations") or {}).get(k) == v
                            for k, v in annotations.items()):
                    return True
                self.api.patch_pod_metadata(ns, name, labels, annotations,
                                            meta["resourceVersion"])
                return True
            except ApiConflict:
                continue
            except ApiNotFound:
                return False
        raise ApiConflict(f"pod {pod_key}: changed under every one of {TRIES} writes")

    def assignments(self) -> list[tuple[dict[str, Any], Assignment]]:
        out = []
        for p in self.api.list_pods():
            text = (p["metadata"].get("annotations") or {}).get(ANNOTATION)
            if not text:
                continue
            try:
                out.append((p, decode(text)))
            except AnnotationError:
                continue
        return out

    def pods_on(self, uuid: str) -> list[str]:
        """The pods on GPU ``uuid`` that are not draining (``namespace/name``)."""
        return [f"{a.namespace}/{a.pod}" for p, a in self.assignments()
                if uuid in a.gpu_uuids()
                and (p["metadata"].get("annotations") or {}).get(DRAINING_ANNOTATION) != "true"]

    # -- room -----------------------------------------------------------------------------

    def no_room(self, g: Gpu, nodes: dict[str, dict[str, Any]]) -> str | None:
        """Why the replicas on ``g`` could not move (None: they can)."""
        used: dict[str, list[int]] = {}
        needs = []
        for p, a in self.assignments():
            for c in a.containers:
                for share in c.gpus:
                    u = used.setdefault(share.uuid, [0, 0])
                    u[0] += share.milli
                    u[1] += share.memory_mib
            if g.uuid in a.gpu_uuids():
                kinds = {r.get("kind") for r in p["metadata"].get("ownerReferences") or []}
                if kinds - {"ReplicaSet"}:
                    return (f"pod {a.namespace}/{a.pod} is managed by a "
                            f"{'/'.join(sorted(str(k) for k in kinds - {'ReplicaSet'}))}, whose "
                            "pods gpuslice does not move (their names are their identity)")
                try:
                    req = pod_request(p)
                except ValidationError:
                    req = None
                share = a.containers[0].gpus[0]
                needs.append(PodNeed(f"{a.namespace}/{a.pod}", share.milli, share.memory_mib,
                                     req.models if req else frozenset()))
        if not needs:
            return None
        cordoned = {u for n in nodes.values() for u in annotation(n, CORDONED_ANNOTATION)}
        in_mig = migmps.usage(a for _, a in self.assignments())
        rooms = []
        for n in nodes.values():
            try:
                inv = node_inventory(n)
            except ValidationError:
                continue
            for x in inv:
                if x.uuid == g.uuid or x.uuid in cordoned:
                    continue
                if x.mig_enabled:  # as the extender places them: MPS slices inside instances
                    rooms.extend(instance_rooms(x, n["metadata"]["name"], in_mig))
                    continue
                u = used.get(x.uuid, [0, 0])
                rooms.append(GpuRoom(x.uuid, n["metadata"]["name"], x.model, 1000 - u[0],
                                     x.memory_mib - u[1]))
        return room_for(needs, rooms)


def instance_rooms(x: InventoryGpu, node: str,
                   in_mig: dict[tuple[str, int], tuple[int, int, bool]]) -> list[GpuRoom]:
    """The room each MIG instance of a MIG-enabled GPU has for MPS slices (none in one held
    whole by a MIG-isolated pod)."""
    model = catalog.lookup(x.model)
    if model is None or model.mig is None:
        return []
    out = []
    for m in x.mig:
        milli, mib, whole = in_mig.get((x.uuid, m.start), (0, 0, False))
        if whole:
            continue
        cap = migmps.capacity_milli(model.mig.profile(m.profile).compute_slices,
                                    model.mig.compute_slices)
        out.append(GpuRoom(f"{x.uuid} {m.profile}@{m.start}", node, x.model, cap - milli,
                           m.memory_mib - mib))
    return out
