"""The API-server port on the official Kubernetes Python client (``pip install gpuslice[kube]``).

The only module that talks to a real API server. The official client was chosen over lightkube
because its generated API covers every call we need (pod binding subresource included) with the
same semantics as kubectl, and its kubeconfig / in-cluster loading is the reference one; the
extender is synchronous per request, so the async clients bring nothing here.

Optimistic concurrency: the assignment patch carries the pod's ``resourceVersion``; the API
server answers 409 when the pod changed since it was read, which becomes :class:`ApiConflict`.
"""

from __future__ import annotations

import contextlib
from typing import Any

from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound, WatchEvent
from gpuslice.core.errors import GpusliceError


class KubeClient:
    def __init__(self, kubeconfig: str | None = None, context: str | None = None) -> None:
        try:
            from kubernetes import client, config
        except ImportError:
            raise GpusliceError(
                "the Kubernetes client is not installed: pip install 'gpuslice[kube]'"
            ) from None
        try:
            if kubeconfig is None:
                config.load_incluster_config()
            else:
                config.load_kube_config(config_file=kubeconfig, context=context)
        except Exception as exc:  # the client raises several unrelated types here
            raise GpusliceError(f"cannot load the Kubernetes configuration: {exc}") from None
        self._api = client.CoreV1Api()
        self._client = client

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.rest import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                raise ApiNotFound(str(exc.reason)) from None
            if exc.status == 409:
                raise ApiConflict(str(exc.reason)) from None
            raise GpusliceError(f"API server: {exc.status} {exc.reason}") from None

    def _plain(self, obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = self._api.api_client.sanitize_for_serialization(obj)
        return out

    def watch(self, since: str, timeout_s: float) -> tuple[list[WatchEvent], str]:
        """Pod events for up to ``timeout_s`` (nodes change rarely: the periodic re-read covers
        them). An expired resourceVersion (410) raises, and the caller re-reads everything."""
        from kubernetes import watch

        if not since:
            since = self._call(self._api.list_pod_for_all_namespaces,
                               limit=1).metadata.resource_version
        events: list[WatchEvent] = []
        w = watch.Watch()
        start = since
        raws = self._call(lambda: list(w.stream(
            self._api.list_pod_for_all_namespaces, resource_version=start,
            timeout_seconds=max(1, int(timeout_s)), _request_timeout=timeout_s + 5)))
        for raw in raws:
            if raw["type"] == "ERROR":
                raise GpusliceError(f"watch error: {raw['object']}")
            obj = self._plain(raw["object"])
            since = obj["metadata"]["resourceVersion"]
            events.append(WatchEvent(raw["type"], "Pod", obj))
        return events, since

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        api = self._client.CoordinationV1Api()
        try:
            return self._plain(self._call(api.read_namespaced_lease, name, namespace))
        except ApiNotFound:
            return None

    def put_lease(self, namespace: str, name: str, spec: dict[str, Any],
                  resource_version: str | None) -> dict[str, Any]:
        api = self._client.CoordinationV1Api()
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": namespace,
                             **({"resourceVersion": resource_version}
                                if resource_version else {})},
                "spec": spec}
        if resource_version is None:
            return self._plain(self._call(api.create_namespaced_lease, namespace, body))
        return self._plain(self._call(api.replace_namespaced_lease, name, namespace, body))

    def patch_node(self, name: str, labels: dict[str, str],
                   annotations: dict[str, str]) -> None:
        body = {"metadata": {"labels": labels, "annotations": annotations}}
        self._call(self._api.patch_node, name, body)

    def list_nodes(self) -> list[dict[str, Any]]:
        return [self._plain(n) for n in self._call(self._api.list_node).items]

    def list_pods(self) -> list[dict[str, Any]]:
        return [self._plain(p) for p in self._call(self._api.list_pod_for_all_namespaces).items]

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self._plain(self._call(self._api.read_namespaced_pod, name, namespace))

    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str],
                              resource_version: str) -> dict[str, Any]:
        body = {"metadata": {"annotations": annotations, "resourceVersion": resource_version}}
        return self._plain(self._call(self._api.patch_namespaced_pod, name, namespace, body))

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        ns = (pod.get("metadata") or {}).get("namespace", "default")
        return self._plain(self._call(self._api.create_namespaced_pod, ns, pod))

    def delete_pod(self, namespace: str, name: str) -> None:
        """Remove a pod through the Eviction API, so PodDisruptionBudgets hold (a 429 from a
        budget is an error the controller retries on its next pass)."""
        c = self._client
        body = c.V1Eviction(metadata=c.V1ObjectMeta(name=name, namespace=namespace))
        with contextlib.suppress(ApiNotFound):
            self._call(self._api.create_namespaced_pod_eviction, name, namespace, body)

    # gpuslice's custom objects: group gpuslice.io, version v1alpha1, namespaced
    def list_custom(self, plural: str) -> list[dict[str, Any]]:
        api = self._client.CustomObjectsApi()
        out = self._call(api.list_cluster_custom_object, "gpuslice.io", "v1alpha1", plural)
        return list(out.get("items", []))

    def get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        api = self._client.CustomObjectsApi()
        out: dict[str, Any] = self._call(api.get_namespaced_custom_object, "gpuslice.io",
                                         "v1alpha1", namespace, plural, name)
        return out

    def replace_custom(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace the object's status (the controller owns it; the spec is the user's)."""
        api = self._client.CustomObjectsApi()
        meta = obj["metadata"]
        out: dict[str, Any] = self._call(api.replace_namespaced_custom_object_status,
                                         "gpuslice.io", "v1alpha1", meta["namespace"], plural,
                                         meta["name"], obj)
        return out

    def list_deployments(self, namespace: str) -> list[dict[str, Any]]:
        api = self._client.AppsV1Api()
        return [self._plain(d) for d in
                self._call(api.list_namespaced_deployment, namespace).items]

    def create_deployment(self, obj: dict[str, Any]) -> dict[str, Any]:
        api = self._client.AppsV1Api()
        ns = (obj.get("metadata") or {}).get("namespace", "default")
        return self._plain(self._call(api.create_namespaced_deployment, ns, obj))

    def delete_deployment(self, namespace: str, name: str) -> None:
        api = self._client.AppsV1Api()
        with contextlib.suppress(ApiNotFound):
            self._call(api.delete_namespaced_deployment, name, namespace)

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        c = self._client
        body = c.V1Binding(
            metadata=c.V1ObjectMeta(name=name, namespace=namespace, uid=uid),
            target=c.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        # the generated client fails to deserialise the Binding it gets back; the call succeeded
        self._call(self._api.create_namespaced_binding, namespace, body,
                   _preload_content=False)
