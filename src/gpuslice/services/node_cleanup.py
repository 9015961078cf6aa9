"""Taking gpuslice off a node: what the node agent (and the reconfiguration controller) wrote on
it, and telling an uninstall from a restart.

When the node agent stops (SIGTERM) it asks whether it is being uninstalled: its pod's
controller, a DaemonSet (the pod's ownerReferences), is gone or being deleted (``helm
uninstall`` and ``kubectl delete`` delete the DaemonSet, then the garbage collector its pods;
with ``--cascade=foreground`` the DaemonSet stays, with a deletionTimestamp, until they are
gone). A rolling update, a restart, a deleted or evicted pod leave the DaemonSet as it was,
and then the node keeps everything. A DaemonSet of the same name with another UID is a new
install: its agent publishes the node again, so nothing is removed either.

On uninstall (and by ``gpuslice node-agent --cleanup`` for nodes whose agent is gone) the node
loses exactly what gpuslice put there:

* labels: those the agent recorded as its own (:data:`~gpuslice.services.node_agent.AGENT_LABELS`:
  the ones it added, not those it found with the same value, e.g. the
  ``nvidia.com/gpu.present=true`` that selects the node), ``gpuslice.io/gpu-model``, and the
  reconfiguration controller's ``gpuslice.io/reconfig.<GPU>``; no other label;
* annotations: the inventory, the MIG layout report and wish, the cordoned GPUs, the record;
* ``gpuslice.io/gpu-milli`` and ``gpuslice.io/gpu-memory`` in ``status.capacity`` and
  ``status.allocatable``, with ``remove`` operations of a JSON patch on the node's ``status``
  subresource (the kubelet keeps extended resources it does not serve, across restarts).

The functions that decide (:func:`cleanup_plan`, :func:`uninstall_verdict`) are pure; the
others apply them through :class:`~gpuslice.adapters.kube.fake.NodeCleanupPort`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gpuslice.adapters.kube.fake import (
    ApiNotFound,
    DaemonSetPort,
    NodeCleanupPort,
    json_pointer,
)
from gpuslice.adapters.kube.objects import CORDONED_ANNOTATION, GPU_MEMORY, GPU_MILLI
from gpuslice.core.errors import GpusliceError
from gpuslice.services.node_agent import AGENT_LABELS, INVENTORY, label_keys
from gpuslice.services.node_layouts import MIG_DESIRED, MIG_LAYOUTS

MODEL_LABEL = "gpuslice.io/gpu-model"  # core.devices.node_labels: the agent's in any version
RECONFIG_LABELS = "gpuslice.io/reconfig."  # the reconfiguration controller's, one per GPU
ANNOTATIONS = (INVENTORY, MIG_LAYOUTS, MIG_DESIRED, CORDONED_ANNOTATION, AGENT_LABELS)
RESOURCES = (GPU_MILLI, GPU_MEMORY)
STATUS_FIELDS = ("capacity", "allocatable")


@dataclass(frozen=True)
class NodeCleanup:
    """What to remove from one node (each tuple sorted); empty when nothing is left."""

    node: str
    labels: tuple[str, ...] = ()
    annotations: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()  # "capacity/<name>" and "allocatable/<name>"

    def __bool__(self) -> bool:
        return bool(self.labels or self.annotations or self.resources)

    def status_patch(self) -> list[dict[str, Any]]:
        """The JSON patch of the node's ``status`` subresource: one ``remove`` per resource
        present (``/status/capacity/gpuslice.io~1gpu-milli``)."""
        return [{"op": "remove", "path": json_pointer("status", *r.split("/", 1))}
                for r in self.resources]

    def summary(self) -> str:
        """``labels a, b; annotations c; resources d`` (``nothing left to remove``)."""
        names = sorted({r.split("/", 1)[1] for r in self.resources})
        parts = [f"{what} {', '.join(items)}" for what, items in (
            ("labels", self.labels), ("annotations", self.annotations),
            ("resources", names)) if items]
        return "; ".join(parts) if parts else "nothing left to remove"


def cleanup_plan(node: dict[str, Any]) -> NodeCleanup:
    """What gpuslice left on ``node`` (a Node object as the API server returns it)."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    mine = label_keys(annotations.get(AGENT_LABELS)) | {MODEL_LABEL}
    status = node.get("status") or {}
    return NodeCleanup(
        str(meta.get("name", "")),
        tuple(sorted(k for k in labels if k in mine or k.startswith(RECONFIG_LABELS))),
        tuple(sorted(k for k in annotations if k in ANNOTATIONS)),
        tuple(f"{f}/{r}" for f in STATUS_FIELDS for r in RESOURCES
              if r in (status.get(f) or {})))


def carries_gpuslice(node: dict[str, Any]) -> bool:
    """The node has an inventory published (``--all-nodes`` cleans those)."""
    return INVENTORY in ((node.get("metadata") or {}).get("annotations") or {})


def clean_node(api: NodeCleanupPort, name: str, attempts: int = 3) -> NodeCleanup:
    """Remove from node ``name`` what :func:`cleanup_plan` finds there; returns what was
    removed. The node is read again and the patch retried when the status patch no longer
    applies (a resource removed meanwhile: 422)."""
    for attempt in range(attempts):
        plan = cleanup_plan(api.get_node(name))
        if plan.labels or plan.annotations:
            api.patch_node(name, dict.fromkeys(plan.labels), dict.fromkeys(plan.annotations))
        if plan.resources:
            try:
                api.patch_node_status(name, plan.status_patch())
            except ApiNotFound:
                raise
            except GpusliceError:
                if attempt + 1 == attempts:
                    raise
                continue
        return plan
    raise AssertionError("unreachable")  # pragma: no cover


def owner_daemonset(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the DaemonSet that controls ``pod``, if one does."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "DaemonSet" and ref.get("controller") and \
                str(ref.get("apiVersion", "")).startswith("apps/"):
            return str(ref.get("name", "")), str(ref.get("uid", ""))
    return None


def uninstall_verdict(pod: dict[str, Any],
                      daemonset: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether the agent whose pod is ``pod`` is being uninstalled, given its DaemonSet as
    the API server has it now (None: not found), and why."""
    ns = (pod.get("metadata") or {}).get("namespace", "")
    owner = owner_daemonset(pod)
    if owner is None:
        return False, "its pod has no DaemonSet controller"
    name, uid = owner
    what = f"DaemonSet {ns}/{name}"
    if daemonset is None:
        return True, f"{what} is gone"
    meta = daemonset.get("metadata") or {}
    if uid and meta.get("uid") and meta["uid"] != uid:
        return False, f"{what} was replaced by a new one (another UID), whose agent publishes"
    if meta.get("deletionTimestamp"):
        return True, f"{what} is being deleted"
    return False, f"{what} is still there (a rolling update or a restart)"


AGENT_POD_LABEL = ("app.kubernetes.io/name", "gpuslice-node-agent")  # every install path's


def other_agent(pod: dict[str, Any], pods: list[dict[str, Any]]) -> str:
    """Another node agent serving the node of ``pod`` (``namespace/name``), or "": a live
    pod of any install's agent DaemonSet there (a migration from kustomize to Helm, a
    renamed DaemonSet) that is not this one and not being deleted."""
    me = (pod.get("metadata") or {}).get("uid")
    key, value = AGENT_POD_LABEL
    for p in pods:
        meta = p.get("metadata") or {}
        if meta.get("uid") == me or meta.get("deletionTimestamp"):
            continue
        if (meta.get("labels") or {}).get(key) != value or owner_daemonset(p) is None:
            continue
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        return f"{meta.get('namespace')}/{meta.get('name')}"
    return ""


def check_uninstall(api: NodeCleanupPort, namespace: str, pod_name: str) -> tuple[bool, str]:
    """:func:`uninstall_verdict` for the pod ``namespace/pod_name``, read from the API server;
    an uninstall while another agent serves the node (:func:`other_agent`) is not one for
    the node: that agent keeps what it published. An error (the pod already gone, RBAC) is a
    no: the node keeps everything."""
    try:
        pod = api.get_pod(namespace, pod_name)
        owner = owner_daemonset(pod)
        daemonset = None
        if owner is not None:
            try:
                daemonset = api.get_daemonset(namespace, owner[0])
            except ApiNotFound:
                daemonset = None
        verdict, why = uninstall_verdict(pod, daemonset)
        if verdict:
            node = str((pod.get("spec") or {}).get("nodeName") or "")
            other = other_agent(pod, api.list_pods(node=node)) if node else ""
            if other:
                return False, (f"{why}, but the node agent {other} serves this node: it keeps "
                               "what it published")
    except GpusliceError as exc:
        return False, f"cannot tell whether the agent is being uninstalled: {exc}"
    return verdict, why


def clean_nodes(api: NodeCleanupPort, names: list[str] | None) -> list[NodeCleanup]:
    """:func:`clean_node` on each node named, or (``None``) on every node that carries an
    inventory."""
    if names is None:
        names = sorted(str(n["metadata"]["name"]) for n in api.list_nodes()
                       if carries_gpuslice(n))
    return [clean_node(api, n) for n in names]


def stop_daemonset(api: DaemonSetPort, namespace: str, name: str, wait_s: float,
                   poll_s: float = 1.0) -> bool:
    """Delete the DaemonSet with foreground propagation and wait up to ``wait_s`` until it
    is gone, its pods with it (each agent cleans its own node, host included, while its
    RBAC still holds). Returns whether it is gone (a missing one is)."""
    try:
        api.delete_daemonset(namespace, name, "Foreground")
    except ApiNotFound:
        return True
    deadline = time.monotonic() + wait_s
    while True:
        try:
            api.get_daemonset(namespace, name)
        except ApiNotFound:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
