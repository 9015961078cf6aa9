"""The API-server port on the official Kubernetes Python client (the ``kube`` extra).

The only module that talks to a real API server. The official client was chosen over lightkube
because its generated API covers every call we need (pod binding subresource included) with the
same semantics as kubectl, and its kubeconfig / in-cluster loading is the reference one. The
one call the extender makes on its event loop, the Binding, goes through
:mod:`gpuslice.adapters.kube.aio` (aiohttp) with this client's configuration.

Patches are maps, which the client sends as strategic-merge patches (``null`` removes a key),
except the removal of a node's extended resources, a list of JSON patch operations on the
node's ``status`` subresource (the client sends a list as ``application/json-patch+json`` by
itself: ``_content_type`` is not passed, kubernetes 35, the image's, refuses it).
Optimistic concurrency: the assignment patch carries the pod's ``resourceVersion``; the API
server answers 409 when the pod changed since it was read, which becomes :class:`ApiConflict`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpuslice.adapters.install import pip_install
from gpuslice.adapters.kube.ports import ApiConflict, ApiInvalid, ApiNotFound, WatchEvent
from gpuslice.adapters.kube.wire import binding_body, status_text
from gpuslice.core.errors import GpusliceError, Unavailable


class KubeClient:
    """The configuration is the pod's service account (in-cluster) when no kubeconfig is given
    and the process runs in a pod, else the kubeconfig given, ``$KUBECONFIG`` or
    ``~/.kube/config``, as kubectl finds it. Every call goes through one ApiClient built from
    this client's own configuration (the Kubernetes client's loaders otherwise write a
    process-wide default, which the next client loaded in the same process would replace),
    with a request timeout so that a hung API server is an error, not a stuck thread.

    That timeout is per attempt, and the client retries on its own (urllib3's three retries:
    four attempts of ``timeout_s`` against a frozen server). Calls that must answer within a
    deadline (a DRA prepare, an Allocate) take ``timeout_s``: the whole call, connection,
    reads and attempts together, then runs on a second ApiClient that never retries on its own
    (:meth:`_within` makes the attempts)."""

    LINGER_S = 0.05  # watch(): how long a batch waits for more events after its first
    BATCH = 256  # watch(): events handed over at most at once

    def __init__(self, kubeconfig: str | None = None, context: str | None = None,
                 timeout_s: float = 30.0) -> None:
        try:
            from kubernetes import client, config
        except ImportError:
            raise GpusliceError(
                "the Kubernetes client is not installed: " + pip_install("kube")
            ) from None
        cfg = client.Configuration()
        try:
            if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=cfg)  # in a pod
            else:  # as kubectl: the file given, else $KUBECONFIG (a list merges), else ~/.kube
                path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
                config.load_kube_config(config_file=path, context=context,
                                        client_configuration=cfg)
        except Exception as exc:  # the client raises several unrelated types here
            raise GpusliceError(f"cannot load the Kubernetes configuration: {exc}") from None
        self._client = client
        self._api_client = client.ApiClient(cfg)
        self._api = client.CoreV1Api(self._api_client)
        self._apps = client.AppsV1Api(self._api_client)
        self._leases = client.CoordinationV1Api(self._api_client)
        self._policy = client.PolicyV1Api(self._api_client)
        self._custom = client.CustomObjectsApi(self._api_client)
        self._resource = client.ResourceV1Api(self._api_client)  # kubernetes >= 34.1
        self.timeout_s = timeout_s
        self._bounded: Any = None  # (ApiClient, CoreV1Api) without retries, made when needed
        self._bounded_lock = threading.Lock()
        self._followers: list[_Follower] | None = None
        self._queue: Any = None
        self._generation = 0

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        kwargs.setdefault("_request_timeout", self.timeout_s)
        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            message = _status_message(exc)
            if exc.status == 404:
                raise ApiNotFound(message) from None
            if exc.status == 409:
                raise ApiConflict(message) from None
            if exc.status == 422:
                raise ApiInvalid(f"API server: 422 {message}") from None
            raise GpusliceError(f"API server: {exc.status} {message}") from None
        except urllib3.exceptions.HTTPError as exc:  # refused, timed out, connection lost
            raise _Unreachable(f"API server unreachable: {exc}") from None

    def _no_retry(self) -> Any:
        """(ApiClient, CoreV1Api) of this client's configuration that never retry on their
        own: a call with a deadline makes its own attempts (:meth:`_within`)."""
        import copy

        with self._bounded_lock:
            if self._bounded is None:
                cfg = copy.deepcopy(self._api_client.configuration)
                cfg.retries = False
                api = self._client.ApiClient(cfg)
                self._bounded = (api, self._client.CoreV1Api(api))
            return self._bounded

    @staticmethod
    def _within(timeout_s: float, attempt: Callable[[float], Any]) -> Any:
        """``attempt(seconds left)`` until the API server answers, all attempts within
        ``timeout_s``: an unreachable server (refused, reset, a stale kept-alive connection)
        is asked again after a short pause while time is left; a frozen one (connections
        accepted, never answered) uses the time left in one attempt. An answer, error
        statuses included, ends it."""
        deadline = time.monotonic() + timeout_s
        pause, attempts, last = 0.1, 0, ""
        while True:
            left = deadline - time.monotonic()
            if left < 0.01:
                raise GpusliceError(
                    f"API server unreachable: no answer within {timeout_s:g} s "
                    f"({attempts} attempt{'s' if attempts != 1 else ''})"
                    + (f"; last: {last}" if attempts else ""))
            attempts += 1
            try:
                return attempt(left)
            except _Unreachable as exc:
                last = str(exc).removeprefix("API server unreachable: ")
            time.sleep(max(0.0, min(pause, deadline - time.monotonic() - 0.01)))
            pause = min(1.0, 2 * pause)

    def _json(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """The call's answer as the server's JSON, parsed with orjson: the generated models
        are skipped (they cost about as much as the rest of a large list, and drop the fields
        this client version does not know)."""
        import orjson

        resp = self._call(fn, *args, _preload_content=False, **kwargs)
        try:
            return orjson.loads(resp.data)
        finally:
            resp.release_conn()

    def _send(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """A call whose answer is not needed: its body is read and the connection given back
        to the pool. A response left unread keeps its connection, so each such call would
        open (and TLS-handshake) a new one: measured, the extender's binds spent a quarter of
        its CPU in handshakes that way."""
        resp = self._call(fn, *args, _preload_content=False, **kwargs)
        resp.drain_conn()
        resp.release_conn()

    def _items(self, fn: Any, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return list(self._json(fn, *args, **kwargs).get("items") or [])

    def watch(self, since: str, timeout_s: float) -> tuple[list[WatchEvent], str]:
        """Pod and node events, as they come: both watches stay open in background threads
        (:class:`_Follower`) and this hands over what they queued, waiting up to ``timeout_s``
        for the first. ``since=""`` (re)starts them from now; any other value continues. A
        broken watch (an expired resourceVersion, 410, or the server gone) raises once, and
        the caller re-reads everything and starts again with ``""``."""
        import queue

        if not since or self._followers is None:
            self.close()
            self._generation += 1
            q: queue.Queue[WatchEvent | GpusliceError] = queue.Queue()
            self._queue = q
            self._followers = [
                _Follower(self, self._api.list_pod_for_all_namespaces, "Pod", q),
                _Follower(self, self._api.list_node, "Node", q)]
            for f in self._followers:
                f.start()
        events: list[WatchEvent] = []
        items: list[WatchEvent | GpusliceError] = []
        try:
            items.append(self._queue.get(timeout=max(0.0, timeout_s)))
            # what else comes within LINGER_S joins the batch: events come a few at a time
            # while pods are bound, and each batch costs the caller a hand-over between
            # threads (the extender's watch batches of one or two events were a tenth of
            # its CPU at 80 binds/s)
            until = time.monotonic() + self.LINGER_S
            while len(items) < self.BATCH:
                left = until - time.monotonic()
                items.append(self._queue.get(timeout=left) if left > 0 else
                             self._queue.get_nowait())
        except queue.Empty:
            pass
        for item in items:
            if isinstance(item, GpusliceError):
                self.close()
                raise item
            events.append(item)
        return events, f"watching-{self._generation}"

    def close(self) -> None:
        """Stop the background watches (their threads end with their current stream)."""
        for f in self._followers or []:
            f.stop.set()
        self._followers = None

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = self._json(self._leases.read_namespaced_lease, name,
                                             namespace)
            return out
        except ApiNotFound:
            return None

    def put_lease(self, namespace: str, name: str, spec: dict[str, Any],
                  resource_version: str | None) -> dict[str, Any]:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": namespace,
                             **({"resourceVersion": resource_version}
                                if resource_version else {})},
                "spec": spec}
        if resource_version is None:
            return dict(self._json(self._leases.create_namespaced_lease, namespace, body))
        return dict(self._json(self._leases.replace_namespaced_lease, name, namespace, body))

    def patch_node(self, name: str, labels: Mapping[str, str | None],
                   annotations: Mapping[str, str | None]) -> None:
        """A strategic merge patch of the node's labels and annotations (``None``: ``null``,
        which removes the key)."""
        body = {"metadata": {"labels": dict(labels), "annotations": dict(annotations)}}
        self._call(self._api.patch_node, name, body)

    def patch_node_annotations(self, name: str, annotations: Mapping[str, str | None],
                               resource_version: str) -> dict[str, Any]:
        """A strategic merge patch of the node's annotations carrying its resourceVersion:
        the API server applies it only to that version (409 otherwise)."""
        body = {"metadata": {"annotations": dict(annotations),
                             "resourceVersion": resource_version}}
        return dict(self._json(self._api.patch_node, name, body))

    def patch_node_status(self, name: str, ops: list[dict[str, Any]]) -> None:
        """A JSON patch (RFC 6902 operations) of the node's ``status`` subresource (RBAC:
        nodes/status patch), as ``kubectl patch node N --subresource=status --type=json``."""
        if not isinstance(ops, list):  # a map would go out as a strategic merge patch
            raise TypeError("a JSON patch is a list of operations")
        self._send(self._api.patch_node_status, name, list(ops))

    def get_daemonset(self, namespace: str, name: str) -> dict[str, Any]:
        return dict(self._json(self._apps.read_namespaced_daemon_set, name, namespace))

    def delete_daemonset(self, namespace: str, name: str,
                         propagation: str = "Background") -> None:
        """Delete a DaemonSet (RBAC: daemonsets delete); ``Foreground``: it stays, with a
        deletionTimestamp, until the garbage collector has deleted its pods."""
        self._send(self._apps.delete_namespaced_daemon_set, name, namespace,
                   propagation_policy=propagation)

    def patch_node_capacity(self, name: str, resources: dict[str, str]) -> None:
        """Node-level extended resources through the node's ``status`` subresource (RBAC:
        nodes/status patch), as the Kubernetes docs advertise them."""
        body = {"status": {"capacity": resources, "allocatable": resources}}
        self._call(self._api.patch_node_status, name, body)

    def list_nodes(self) -> list[dict[str, Any]]:
        return self._items(self._api.list_node)

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        """Create a core/v1 Event (what ``kubectl describe`` shows on its object)."""
        self._call(self._api.create_namespaced_event, namespace, event)

    def get_node(self, name: str) -> dict[str, Any]:
        return dict(self._json(self._api.read_node, name))

    def list_pods(self, node: str | None = None,
                  timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Every pod, or (``node``) the pods bound to that node, selected by the API server;
        ``timeout_s``: the whole call's deadline (see the class)."""
        kw = {"field_selector": f"spec.nodeName={node}"} if node is not None else {}
        if timeout_s is None:
            return self._items(self._api.list_pod_for_all_namespaces, **kw)
        core = self._no_retry()[1]
        out: list[dict[str, Any]] = self._within(timeout_s, lambda left: self._items(
            core.list_pod_for_all_namespaces, _request_timeout=left, **kw))
        return out

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return dict(self._json(self._api.read_namespaced_pod, name, namespace))

    def list_pod_disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        return self._items(self._policy.list_namespaced_pod_disruption_budget, namespace)

    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str],
                              resource_version: str) -> dict[str, Any]:
        body = {"metadata": {"annotations": annotations, "resourceVersion": resource_version}}
        return dict(self._json(self._api.patch_namespaced_pod, name, namespace, body))

    def patch_pod_labels(self, namespace: str, name: str,
                         labels: Mapping[str, str | None]) -> dict[str, Any]:
        """Set (a value) or remove (``None``) labels of the pod, as a strategic merge patch
        (the client's content type for a mapping body, every client version the image may
        carry: ``_content_type`` is not accepted before kubernetes 36; ``null`` deletes a key
        there as in a JSON merge patch): no resourceVersion, so it applies whatever else
        changed on the pod meanwhile (RBAC: pods patch)."""
        body = {"metadata": {"labels": dict(labels)}}
        return dict(self._json(self._api.patch_namespaced_pod, name, namespace, body))

    def patch_pod_metadata(self, namespace: str, name: str, labels: Mapping[str, str | None],
                           annotations: Mapping[str, str | None],
                           resource_version: str) -> dict[str, Any]:
        """Labels and annotations in one strategic merge patch, at ``resource_version``."""
        body = {"metadata": {"labels": dict(labels), "annotations": dict(annotations),
                             "resourceVersion": resource_version}}
        return dict(self._json(self._api.patch_namespaced_pod, name, namespace, body))

    def remove_pod_scheduling_gate(self, namespace: str, name: str,
                                   ops: list[dict[str, Any]]) -> dict[str, Any]:
        """A JSON patch of the pod (``dra_gate.removal_patch``: test, then remove a gate;
        RBAC: pods patch); the pod as patched. A gate moved meanwhile fails the test: 422."""
        if not isinstance(ops, list):  # a map would go out as a strategic merge patch
            raise TypeError("a JSON patch is a list of operations")
        return dict(self._json(self._api.patch_namespaced_pod, name, namespace, list(ops)))

    def list_namespaced_pods(self, namespace: str, label_selector: str) -> Any:
        """The PodList of ``namespace`` that ``label_selector`` selects, as JSON (the router:
        the pods marked draining)."""
        return self._rest("GET", f"/api/v1/namespaces/{namespace}/pods",
                          {"labelSelector": label_selector})

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        ns = (pod.get("metadata") or {}).get("namespace", "default")
        return dict(self._json(self._api.create_namespaced_pod, ns, pod))

    def delete_pod(self, namespace: str, name: str) -> None:
        """Remove a pod through the Eviction API, so PodDisruptionBudgets hold (a 429 from a
        budget is an error the controller retries on its next pass)."""
        c = self._client
        body = c.V1Eviction(metadata=c.V1ObjectMeta(name=name, namespace=namespace))
        with contextlib.suppress(ApiNotFound):
            self._call(self._api.create_namespaced_pod_eviction, name, namespace, body)

    # gpuslice's custom objects: group gpuslice.io, version v1alpha1, namespaced
    def list_custom(self, plural: str) -> list[dict[str, Any]]:
        out = self._call(self._custom.list_cluster_custom_object, "gpuslice.io", "v1alpha1",
                         plural)
        return list(out.get("items", []))

    def get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self._call(self._custom.get_namespaced_custom_object,
                                         "gpuslice.io", "v1alpha1", namespace, plural, name)
        return out

    def replace_custom(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace the object's status (the controller owns it; the spec is the user's)."""
        meta = obj["metadata"]
        out: dict[str, Any] = self._call(self._custom.replace_namespaced_custom_object_status,
                                         "gpuslice.io", "v1alpha1", meta["namespace"], plural,
                                         meta["name"], obj)
        return out

    def update_custom(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace the main resource (metadata such as finalizers, and the spec read with
        it), at the object's resourceVersion; the status subresource ignores it."""
        meta = obj["metadata"]
        out: dict[str, Any] = self._call(self._custom.replace_namespaced_custom_object,
                                         "gpuslice.io", "v1alpha1", meta["namespace"], plural,
                                         meta["name"], obj)
        return out

    def list_deployments(self, namespace: str) -> list[dict[str, Any]]:
        return self._items(self._apps.list_namespaced_deployment, namespace)

    def create_deployment(self, obj: dict[str, Any]) -> dict[str, Any]:
        ns = (obj.get("metadata") or {}).get("namespace", "default")
        return dict(self._json(self._apps.create_namespaced_deployment, ns, obj))

    def delete_deployment(self, namespace: str, name: str) -> None:
        with contextlib.suppress(ApiNotFound):
            self._call(self._apps.delete_namespaced_deployment, name, namespace)

    # -- resource.k8s.io/v1 (the DRA driver) ------------------------------------------------
    # raw REST calls: the generated models would drop (or refuse) fields that the client
    # version in use does not know, and DRA's fields move with every Kubernetes release

    def _rest(self, method: str, path: str, query: dict[str, str] | None = None,
              body: Any = None, client: Any = None, timeout: float | None = None,
              answer: bool = True) -> Any:
        """A call by path with a plain JSON body; its parsed answer, or (``answer`` off)
        ``None`` and the answer's body read and dropped."""
        api = self._api_client if client is None else client
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        params = list((query or {}).items())

        if hasattr(api, "param_serialize"):  # kubernetes >= 35: the pydantic client
            req = api.param_serialize(method=method, resource_path=path, query_params=params,
                                      header_params=headers, body=body,
                                      auth_settings=["BearerToken"])

            def send(_preload_content: bool = False, _request_timeout: Any = None) -> Any:
                return api._call_with_legacy_options(req, {}, None, _preload_content,
                                                     _request_timeout, True)
        else:  # the older generated client
            def send(_preload_content: bool = False, _request_timeout: Any = None) -> Any:
                return api.call_api(  # type: ignore[call-arg,misc]
                    path, method, {}, params, headers, body=body,
                    auth_settings=["BearerToken"], response_type=None,
                    _preload_content=_preload_content, _request_timeout=_request_timeout,
                    _return_http_data_only=True)
        if not answer:
            self._send(send, _request_timeout=timeout or self.timeout_s)
            return None
        return self._json(send, _request_timeout=timeout or self.timeout_s)

    def pod_proxy_get(self, namespace: str, name: str, port: int, path: str) -> str:
        """GET ``path`` of the pod's ``port`` through the API server's proxy (RBAC:
        pods/proxy get), as text: ``kubectl gpuslice top`` reads the node agents' metrics."""
        resp = self._call(self._api.connect_get_namespaced_pod_proxy_with_path,
                          f"{name}:{port}", namespace, path, _preload_content=False)
        try:
            return bytes(resp.data).decode("utf-8", "replace")
        finally:
            resp.release_conn()

    def list_endpoint_slices(self, namespace: str, service: str) -> Any:
        """The EndpointSliceList of ``service`` (the router's replicas), as JSON."""
        return self._rest("GET", f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/"
                          "endpointslices", {"labelSelector": f"kubernetes.io/service-name="
                                                              f"{service}"})

    def get_resource_claim(self, namespace: str, name: str,
                           timeout_s: float | None = None) -> dict[str, Any]:
        """``timeout_s``: the whole read's deadline (see the class)."""
        return self._get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/"
                         f"{name}", timeout_s)

    def get_resource_claim_template(self, namespace: str, name: str,
                                    timeout_s: float | None = None) -> dict[str, Any]:
        """A ResourceClaimTemplate (the admission webhook's read of a pod's claim to come);
        ``timeout_s`` as :meth:`get_resource_claim`'s."""
        return self._get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/"
                         f"resourceclaimtemplates/{name}", timeout_s)

    def _get(self, path: str, timeout_s: float | None) -> dict[str, Any]:
        """GET ``path``, within ``timeout_s`` as a whole (None: the client's own retries)."""
        if timeout_s is None:
            return dict(self._rest("GET", path))
        api = self._no_retry()[0]
        return dict(self._within(timeout_s, lambda left: self._rest("GET", path, client=api,
                                                                     timeout=left)))

    def list_resource_slices(self, driver: str = "", node: str = "") -> list[dict[str, Any]]:
        sel = ",".join(s for s in (f"spec.driver={driver}" if driver else "",
                                   f"spec.nodeName={node}" if node else "") if s)
        out = self._rest("GET", "/apis/resource.k8s.io/v1/resourceslices",
                         {"fieldSelector": sel} if sel else None)
        return list(out.get("items") or [])

    def create_resource_slice(self, obj: dict[str, Any],
                              dry_run: bool = False) -> dict[str, Any]:
        return dict(self._rest("POST", "/apis/resource.k8s.io/v1/resourceslices",
                               {"dryRun": "All"} if dry_run else None, obj))

    def update_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        return dict(self._rest("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{name}",
                               None, obj))

    def delete_resource_slice(self, name: str) -> None:
        self._rest("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{name}")

    # resource.k8s.io/v1 (DRA): the claim allocator's calls; both claim writes are replaces
    # that carry the claim's resourceVersion, so a claim changed since it was read is a 409
    def list_device_classes(self) -> list[dict[str, Any]]:
        return self._items(self._resource.list_device_class)

    def list_resource_claims(self) -> list[dict[str, Any]]:
        return self._items(self._resource.list_resource_claim_for_all_namespaces)

    def update_resource_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        meta = claim["metadata"]
        return dict(self._json(self._resource.replace_namespaced_resource_claim, meta["name"],
                               meta["namespace"], claim))

    def update_resource_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]:
        meta = claim["metadata"]
        return dict(self._json(self._resource.replace_namespaced_resource_claim_status,
                               meta["name"], meta["namespace"], claim))

    def bind(self, namespace: str, name: str, uid: str, node: str,
             annotations: Mapping[str, str] | None = None,
             resource_version: str | None = None) -> None:
        """The pod's ``binding`` subresource, as kube-scheduler binds (RBAC: pods/binding).
        ``annotations`` are set on the pod in the same write, and ``uid`` and
        ``resource_version`` are its preconditions (kube-apiserver's
        ``BindingREST.setPodNodeAndMetadata``, pkg/registry/core/pod/storage/storage.go)."""
        # plain JSON, not the generated models (their validation cost as much as the call)
        self._rest("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/binding",
                   body=binding_body(namespace, name, uid, node, annotations,
                                     resource_version), answer=False)

    def async_binder(self, **kwargs: Any) -> Any:
        """:meth:`bind` for an event loop: an :class:`~gpuslice.adapters.kube.aio.AsyncBinder`
        on this client's configuration."""
        from gpuslice.adapters.kube.aio import AsyncBinder

        return AsyncBinder(self._api_client.configuration, self.timeout_s, **kwargs)


class _Follower(threading.Thread):
    """One resource's watch held open: lists the current resourceVersion, streams from it in
    windows of :attr:`WINDOW_S`, resumes each window from the last event seen, and queues the
    events; a broken stream queues one error and the thread ends (the caller starts anew)."""

    WINDOW_S = 50

    def __init__(self, client: KubeClient, list_fn: Any, kind: str, out: Any,
                 since: str = "") -> None:
        """``since``: the resourceVersion to stream from (a list's); by default the
        current one, read first."""
        super().__init__(daemon=True, name=f"watch-{kind.lower()}")
        self.client, self.list_fn, self.kind, self.out = client, list_fn, kind, out
        self.since = since
        self.stop = threading.Event()

    def run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        c = self.client
        pause_s = 0.0
        try:
            rv = self.since or c._json(self.list_fn, limit=1)["metadata"]["resourceVersion"]
            while not self.stop.wait(pause_s):
                # a window the server ends at once (it is shutting down, say) is reopened
                # after a pause that grows, not in a busy loop
                opened = time.monotonic()
                resp = c._call(self.list_fn, watch=True, resource_version=rv,
                               timeout_seconds=self.WINDOW_S, _preload_content=False,
                               _request_timeout=self.WINDOW_S + c.timeout_s)
                finished = False
                try:
                    for event in _events(resp):
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            raise GpusliceError(f"{obj.get('code', '')} {obj.get('reason', '')}: "
                                                f"{obj.get('message', '')}")
                        rv = obj["metadata"]["resourceVersion"]
                        if self.stop.is_set():
                            break
                        self.out.put(WatchEvent(event["type"], self.kind, obj))
                    else:
                        finished = True
                finally:  # a stream left part-read must not go back to the pool
                    if finished:
                        resp.release_conn()
                    else:
                        resp.close()
                quick = time.monotonic() - opened < 1.0
                pause_s = min(5.0, max(0.1, 2 * pause_s)) if quick else 0.0
        except Exception as exc:  # any broken stream: the caller re-reads and starts anew
            if isinstance(exc, ApiException):
                why = f"{exc.status} {_status_message(exc)}"
            else:
                why = str(exc) if isinstance(exc, GpusliceError) else repr(exc)
            if not self.stop.is_set():
                self.out.put(GpusliceError(f"{self.kind.lower()} watch: {why}"))


def _events(resp: Any) -> Any:
    """The watch events of a streamed response, one JSON document per line, parsed with
    orjson as they arrive (the client's ``Watch`` parses each event, writes it back to JSON
    and parses it again: measured, an eighth of the extender's CPU in a scheduling burst)."""
    import orjson

    rest = b""
    for chunk in resp.stream(65536, decode_content=True):
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            if line.strip():
                yield orjson.loads(line)
    if rest.strip():
        yield orjson.loads(rest)


class _Unreachable(Unavailable):
    """No answer from the API server (refused, timed out, connection lost): not the input's
    fault, so the CLI exits 1, not 2."""


def _status_message(exc: Any) -> str:
    return status_text(exc.body, exc.reason)
