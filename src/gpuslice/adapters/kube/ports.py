"""The ports the services use to reach the Kubernetes API server (the real client in
:mod:`gpuslice.adapters.kube.client`, the in-memory
:class:`~gpuslice.adapters.kube.fake.FakeApiServer` in tests and demos), the errors both raise,
and the watch event they deliver."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gpuslice.core.errors import GpusliceError


class ApiConflict(GpusliceError):
    """The object changed since it was read (HTTP 409)."""


class ApiNotFound(GpusliceError):
    """No such object (HTTP 404)."""


class ApiInvalid(GpusliceError):
    """The request cannot apply to the object as it is (HTTP 422), e.g. a JSON patch that
    removes a key the object does not have."""


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
    def list_pods(self, node: str | None = None,
                  timeout_s: float | None = None) -> list[dict[str, Any]]: ...


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
    def patch_pod_metadata(self, namespace: str, name: str,
                           labels: Mapping[str, str | None],
                           annotations: Mapping[str, str | None],
                           resource_version: str) -> dict[str, Any]:
        """Set (or, ``None``, remove) labels and annotations of the pod in one write, if it
        is still at ``resource_version`` (else :class:`ApiConflict`)."""
        ...
    def patch_node_annotations(self, name: str, annotations: Mapping[str, str | None],
                               resource_version: str) -> dict[str, Any]:
        """Set (or, ``None``, remove) annotations of the node, if it is still at
        ``resource_version`` (else :class:`ApiConflict`): a read-modify-write of an
        annotation several writers share (the cordoned GPUs) loses no one's change."""
        ...
    def list_custom(self, plural: str) -> list[dict[str, Any]]: ...
    def get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any]: ...
    def replace_custom(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]: ...
    def update_custom(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace the object's main resource (its metadata, such as ``finalizers``, and
        spec; the status stays), if it is still at its ``metadata.resourceVersion``. An
        object being deleted whose last finalizer this removes is gone."""
        ...
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


class PodGatePort(Protocol):
    """What removes a pod's scheduling gate and notes why (the DRA claim allocator and its
    fallback, issue 58): a JSON patch of the pod (pods patch) and an Event (events create)."""

    def remove_pod_scheduling_gate(self, namespace: str, name: str,
                                   ops: list[dict[str, Any]]) -> dict[str, Any]: ...
    def create_event(self, namespace: str, event: dict[str, Any]) -> None: ...


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
