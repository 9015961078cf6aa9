"""The Kubernetes REST API over HTTP in front of :class:`FakeApiServer`, for the real client.

The in-memory fake is the port's stand-in everywhere else; this puts kube-apiserver's wire
behaviour in front of it so that :class:`gpuslice.adapters.kube.client.KubeClient`, on the
official Kubernetes client, is exercised through real HTTP:

- paths and verbs of the core, apps (Deployments; DaemonSets: get, and delete with a
  ``propagationPolicy``, ``Foreground`` keeping the object with a deletionTimestamp),
  coordination.k8s.io, policy (PodDisruptionBudgets, list)
  and gpuslice.io groups the project
  calls; a call to anything else is a 404, so an unexpected path fails the test;
- errors as ``Status`` objects with their code (404 NotFound, 409 Conflict / AlreadyExists,
  400 BadRequest, 415 UnsupportedMediaType, 422 Invalid, 401, 403 Forbidden);
- patches only in the patch media types, a JSON patch must be a list, a strategic-merge or
  merge patch merges maps and a ``null`` deletes (a pod's and a node's annotations and
  labels); JSON patches (RFC 6902: add, remove, replace, test) of a node's ``status``
  subresource only, all operations or none, a ``remove`` of a missing key 422 as
  kube-apiserver answers;
  ``metadata.resourceVersion`` in a patch or a replace is a precondition (409);
- creation checks (a name, no resourceVersion, the namespace of the path; pods and
  Deployments against the Kubernetes 1.32 schema, and a pod's containers need an image); a
  new pod gets ``status.phase`` Pending and a fresh ``uid``;
- watches: ``?watch=true`` streams one JSON event per line (chunked) until ``timeoutSeconds``,
  from after ``resourceVersion`` (``""``/``"0"``: ADDED for what exists, then changes); a
  resourceVersion older than :attr:`RestApiServer.compacted` gets the ERROR event with code 410
  that an etcd compaction gives; ``fieldSelector=spec.nodeName=...`` on pods; pods, nodes,
  ResourceClaims and ResourceSlices only;
- bindings (``pods/{name}/binding`` and the ``bindings`` collection) with the UID precondition,
  evictions (a pod listed in :attr:`RestApiServer.disruption_blocked` gets 429 as a
  PodDisruptionBudget gives), the ``status`` subresource of the custom objects (the spec
  stays; the CRD's schema lives in deploy/base), their main resource (replaced at its
  resourceVersion, the status kept: finalizers) and deletion (held by finalizers);
  ``labelSelector=key=value[,...]`` on pod lists;
- outages: while :attr:`RestApiServer.down` is set every call gets 503 and open watches end;
- resource.k8s.io/v1: ResourceSlices and DeviceClasses (list), ResourceClaims (list across
  namespaces, get, replace with the metadata only, and replace of the ``status`` subresource,
  both with the resourceVersion precondition; a status write that changes the allocation or
  reservedFor also needs ``update`` on ``resourceclaims/binding``, as Kubernetes 1.36 asks);
- EndpointSlices of a Service (:attr:`RestApiServer.endpointslices`, selected by the
  ``kubernetes.io/service-name`` label) for the router;
- RBAC: a bearer token ``sa:<namespace>:<name>`` is that ServiceAccount, allowed what the
  ClusterRoles, Roles and their bindings in ``deploy/base`` and ``deploy/examples`` grant it
  (verbs from the request as the API server derives them: get, list, watch, create, update,
  patch, delete); the token ``admin`` may do anything.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from gpuslice.adapters.kube.fake import ApiConflict, ApiInvalid, ApiNotFound, FakeApiServer

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "base"
EXAMPLES = DEPLOY.parent / "examples"  # the router example's role
PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json",
               "application/strategic-merge-patch+json")
NAMESPACED_RBAC = ("Role", "RoleBinding", "ServiceAccount")


class HttpError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


@dataclass(frozen=True)
class Rule:
    groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    names: frozenset[str]

    def allows(self, group: str, resource: str, verb: str, name: str) -> bool:
        return ((group in self.groups or "*" in self.groups)
                and (resource in self.resources or "*" in self.resources)
                and (verb in self.verbs or "*" in self.verbs)
                and (not self.names or name in self.names))


class Rbac:
    """The roles and bindings of a kustomize base (its ``namespace`` applied to namespaced
    objects), as kube-apiserver's RBAC authorizer reads them."""

    def __init__(self, bases: tuple[Path, ...] = (DEPLOY, EXAMPLES)) -> None:
        self.roles: dict[tuple[str, str], list[Rule]] = {}  # (namespace or "", name)
        self.bindings: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = []
        self.service_accounts: set[tuple[str, str]] = set()
        for base in bases:
            self._load(base)

    def _load(self, base: Path) -> None:
        kust = yaml.safe_load((base / "kustomization.yaml").read_text())
        default_ns = kust.get("namespace", "default")
        for res in kust["resources"]:
            if (base / res).is_dir():  # a kustomization of its own (deploy/mps-host)
                self._load(base / res)
                continue
            for doc in yaml.safe_load_all((base / res).read_text()):
                if doc:
                    self.add(doc, default_ns)

    def add(self, doc: dict[str, Any], default_ns: str = "default") -> None:
        """One object (a role, binding or ServiceAccount; others are ignored), e.g. from a
        rendered Helm chart."""
        kind = doc["kind"]
        ns = (doc["metadata"].get("namespace") or default_ns
              if kind in NAMESPACED_RBAC else "")
        name = doc["metadata"]["name"]
        if kind in ("ClusterRole", "Role"):
            self.roles[(ns, name)] = [Rule(
                frozenset(r.get("apiGroups", [])), frozenset(r.get("resources", [])),
                frozenset(r.get("verbs", [])), frozenset(r.get("resourceNames", [])))
                for r in doc.get("rules", [])]
        elif kind in ("ClusterRoleBinding", "RoleBinding"):
            subjects = [dict(s, namespace=s.get("namespace") or ns)
                        for s in doc.get("subjects", [])]
            self.bindings.append((ns, doc["roleRef"], subjects))
        elif kind == "ServiceAccount":
            self.service_accounts.add((ns, name))

    def allowed(self, sa: tuple[str, str], group: str, resource: str, verb: str,
                namespace: str, name: str) -> bool:
        for bind_ns, ref, subjects in self.bindings:
            if not any(s.get("kind") == "ServiceAccount"
                       and (s["namespace"], s["name"]) == sa for s in subjects):
                continue
            if bind_ns and bind_ns != namespace:  # a RoleBinding grants in its namespace only
                continue
            role_ns = bind_ns if ref["kind"] == "Role" else ""
            for rule in self.roles.get((role_ns, ref["name"]), []):
                if rule.allows(group, resource, verb, name):
                    return True
        return False


def strategic_merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Maps merge key by key, ``None`` deletes, anything else replaces (lists included: the
    project patches only maps; a list merge key would need the type's schema)."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict):
            if not isinstance(target.get(k), dict):
                target[k] = {}
            strategic_merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


class RestApiServer(FakeApiServer):
    """:class:`FakeApiServer` with kube-apiserver's REST API on 127.0.0.1 (see module doc)."""

    def __init__(self, rbac: Rbac | None = None, tls: tuple[Path, Path] | None = None) -> None:
        """``tls``: (certificate, key) PEM files to serve HTTPS, as a cluster does."""
        super().__init__()
        self.rbac = rbac or Rbac()
        self.compacted = 0  # watches from a resourceVersion below this get 410 Gone
        self.disruption_blocked: set[tuple[str, str]] = set()
        self.endpointslices: dict[tuple[str, str], list[dict[str, Any]]] = {}  # (ns, service)
        self.requests: list[tuple[str, str, str, str]] = []  # (who, verb, path, content type)
        self.denied: list[str] = []
        self.down = threading.Event()  # set: an outage, every call gets 503, watches end
        self.on_stop: list[Any] = []  # called first by stop() (clients closing their watches)
        self._connections: set[Any] = set()  # open client connections, shut down by stop()
        self._stop = threading.Event()
        rest = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                rest._connections.add(self.connection)

            def finish(self) -> None:
                rest._connections.discard(self.connection)
                super().finish()

            def _any(self) -> None:
                rest._handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            import ssl

            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self._http.socket = ctx.wrap_socket(self._http.socket, server_side=True)
            self.scheme = "https"
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> RestApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        for fn in self.on_stop:
            fn()
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._http.shutdown()
        self._http.server_close()
        import socket

        for conn in list(self._connections):  # kept-alive ones wait for a next request
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def kubeconfig(self, path: Path, token: str = "admin", ca: Path | None = None) -> Path:
        """A kubeconfig for this server and ``token`` (context ``fake``; ``ca``: the CA file
        that verifies an HTTPS server)."""
        cluster: dict[str, Any] = {"server": f"{self.scheme}://127.0.0.1:{self.port}"}
        if ca is not None:
            cluster["certificate-authority"] = str(ca)
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
               "clusters": [{"name": "fake", "cluster": cluster}],
               "users": [{"name": "u", "user": {"token": token}}],
               "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}
        path.write_text(yaml.safe_dump(doc))
        return path

    def current_rv(self) -> str:
        with self._lock:
            return str(self._rv)

    # -- HTTP ------------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        ctype = (h.headers.get("Content-Type") or "").split(";")[0].strip()
        if self._stop.is_set():  # stopped: no more answers on kept-alive connections
            h.close_connection = True
            return
        try:
            if self.down.is_set():
                raise HttpError(503, "ServiceUnavailable", "the API server is down (test)")
            who = self._authenticate(h.headers.get("Authorization") or "")
            self.requests.append((who, h.command, url.path, ctype))
            status, body = self._route(h, who, h.command, url.path, query, raw, ctype)
        except Exception as exc:
            if not isinstance(exc, HttpError):
                exc = HttpError(500, "InternalError", f"{type(exc).__name__}: {exc}")
            status, body = exc.code, {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": exc.message, "reason": exc.reason, "code": exc.code}
        if status == 0:  # a watch wrote its own response
            return
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _authenticate(self, header: str) -> str:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:  # the scheme is case-insensitive
            raise HttpError(401, "Unauthorized", "Unauthorized")
        token = token.strip()
        if token == "admin":
            return token
        parts = token.split(":")
        if len(parts) != 3 or parts[0] != "sa" or (parts[1], parts[2]) not in \
                self.rbac.service_accounts:
            raise HttpError(401, "Unauthorized", "Unauthorized")
        return token

    def _authorize(self, who: str, group: str, resource: str, verb: str, namespace: str,
                   name: str) -> None:
        if who == "admin":
            return
        _, ns, sa = who.split(":")
        if not self.rbac.allowed((ns, sa), group, resource, verb, namespace, name):
            what = f'{resource} "{name}"' if name else resource
            scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            base = resource.split("/", maxsplit=1)[0]
            message = (f'{what} is forbidden: User "system:serviceaccount:{ns}:{sa}" cannot '
                       f'{verb} resource "{base}" in API group "{group}" {scope}')
            self.denied.append(message)
            raise HttpError(403, "Forbidden", message)

    def _authorize_binding(self, who: str, verb: str, namespace: str, name: str,
                           body: Any) -> None:
        """Kubernetes 1.36 (DRAResourceClaimGranularStatusAuthorization, beta, on): a status
        write that changes ``status.allocation`` or ``status.reservedFor`` also needs the
        request's verb on the synthetic ``resourceclaims/binding``, cluster-wide
        (pkg/registry/resource/resourceclaim: AuthorizedForBinding), else 422 Invalid."""
        cur = (self.get_resource_claim(namespace, name).get("status") or {})
        new = (body.get("status") if isinstance(body, dict) else None) or {}
        if all(cur.get(f) == new.get(f) for f in ("allocation", "reservedFor")):
            return
        if who == "admin":
            return
        _, ns, sa = who.split(":")
        if self.rbac.allowed((ns, sa), "resource.k8s.io", "resourceclaims/binding", verb, "",
                             ""):
            return
        message = (f'ResourceClaim.resource.k8s.io "{name}" is invalid: status: Forbidden: '
                   "changing status.allocation or status.reservedFor requires "
                   f'resource="resourceclaims/binding", verb="{verb}" permission: '
                   f'User "system:serviceaccount:{ns}:{sa}" cannot {verb} resource '
                   '"resourceclaims/binding" in API group "resource.k8s.io" at the cluster scope')
        self.denied.append(message)
        raise HttpError(422, "Invalid", message)

    def _route(self, h: BaseHTTPRequestHandler, who: str, method: str, path: str,
               query: dict[str, str], raw: bytes, ctype: str) -> tuple[int, Any]:
        seg = [s for s in path.split("/") if s]
        if seg[:2] == ["api", "v1"]:
            group, rest = "", seg[2:]
        elif len(seg) >= 3 and seg[0] == "apis":
            group, rest = seg[1], seg[3:]
        else:
            raise HttpError(404, "NotFound", f"the server could not find {path}")
        namespace = ""
        if len(rest) >= 2 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise HttpError(404, "NotFound", f"the server could not find {path}")
        resource = rest[0]
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        watching = query.get("watch") in ("1", "t", "T", "true", "TRUE", "True")  # ParseBool
        verb = {"GET": "watch" if watching else ("get" if name else "list"),
                "POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete"}[method]
        self._authorize(who, group, f"{resource}/{sub}" if sub else resource, verb, namespace,
                        name)
        body: Any = None
        if method in ("POST", "PUT", "PATCH"):
            if method == "PATCH" and ctype not in PATCH_TYPES:
                raise HttpError(415, "UnsupportedMediaType",
                                f"the body of the request was in an unknown format - accepted "
                                f"media types include: {', '.join(PATCH_TYPES)}")
            try:
                body = json.loads(raw or b"null")
            except ValueError as exc:
                raise HttpError(400, "BadRequest", f"invalid JSON: {exc}") from None
            if method == "PATCH" and ctype == "application/json-patch+json" \
                    and not isinstance(body, list):
                raise HttpError(400, "BadRequest", "json: cannot unmarshal object into Go "
                                "value of type []handlers.jsonPatchOp")
            if not isinstance(body, dict) and ctype != "application/json-patch+json":
                raise HttpError(400, "BadRequest", "the request body must be an object")
            if method == "PATCH" and ctype == "application/json-patch+json" and \
                    (group, resource, sub) not in (("", "nodes", "status"), ("", "pods", "")):
                raise HttpError(400, "BadRequest", "the fake supports JSON patches of a "
                                "node's status and of a pod's scheduling gates only")
        key = (group, resource, method, bool(namespace), bool(name), sub)
        try:
            if (group, resource, sub, method) == ("resource.k8s.io", "resourceclaims",
                                                   "status", "PUT"):
                self._authorize_binding(who, verb, namespace, name, body)
            if watching:
                return self._watch(h, group, resource, namespace, query)
            return self._dispatch(key, namespace, name, query, body)
        except ApiNotFound as exc:
            raise HttpError(404, "NotFound", str(exc)) from None
        except ApiConflict as exc:
            reason = "AlreadyExists" if "exists" in str(exc) else "Conflict"
            raise HttpError(409, reason, str(exc)) from None
        except ApiInvalid as exc:
            raise HttpError(422, "Invalid", f"the server rejected our request due to an error "
                            f"in our request: {exc}") from None

    def _dispatch(self, key: tuple[str, str, str, bool, bool, str], ns: str, name: str,
                  query: dict[str, str], body: Any) -> tuple[int, Any]:
        group, resource = key[0], key[1]
        if (group, resource) == ("", "pods"):
            return self._pod_calls(key, ns, name, query, body)
        if key == ("", "bindings", "POST", True, False, ""):
            return self._bind(ns, str((body.get("metadata") or {}).get("name") or ""), body)
        if (group, resource) == ("", "nodes"):
            if key[2:] == ("GET", False, False, ""):
                return 200, self._list("NodeList", self.list_nodes(), self.current_rv())
            if key[2:] == ("GET", False, True, ""):
                return 200, self.get_node(name)
            if key[2:] == ("PATCH", False, True, ""):
                return 200, self._patch_node(name, body)
            if key[2:] == ("PATCH", False, True, "status") and isinstance(body, list):
                for op in body:  # the status strategy would drop anything else silently
                    if not isinstance(op, dict) or \
                            not str(op.get("path", "")).startswith("/status/"):
                        raise HttpError(400, "BadRequest", f"the fake's JSON patches of a "
                                        f"node's status touch /status only, not {op!r}")
                self.patch_node_status(name, body)
                return 200, self.get_node(name)
            if key[2:] == ("PATCH", False, True, "status"):
                status = body.get("status") if isinstance(body, dict) else None
                if set(body) != {"status"} or not isinstance(status, dict) or \
                        set(status) - {"capacity", "allocatable"}:
                    raise HttpError(400, "BadRequest", "the fake patches only a node's "
                                    "status.capacity and status.allocatable")
                if status.get("capacity") != status.get("allocatable"):
                    raise HttpError(400, "BadRequest", "the fake sets capacity and "
                                    "allocatable alike")
                self.patch_node_capacity(name, dict(status.get("capacity") or {}))
                return 200, self.get_node(name)
        if (group, resource) == ("coordination.k8s.io", "leases"):
            return self._lease_calls(key, ns, name, body)
        if (group, resource) == ("apps", "deployments"):
            if key[2:] == ("GET", True, False, ""):
                return 200, self._list("DeploymentList", self.list_deployments(ns))
            if key[2:] == ("POST", True, False, ""):
                self._check_create(body, ns)
                self._check_schema(body, "Deployment", "apps/v1")
                return 201, self.create_deployment(body)
            if key[2:] == ("DELETE", True, True, ""):
                if not any(d["metadata"]["name"] == name for d in self.list_deployments(ns)):
                    raise ApiNotFound(f'deployments.apps "{name}" not found')
                self.delete_deployment(ns, name)
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if (group, resource) == ("apps", "daemonsets"):
            if key[2:] == ("GET", True, True, ""):
                return 200, self.get_daemonset(ns, name)
            if key[2:] == ("DELETE", True, True, ""):
                policy = query.get("propagationPolicy") or \
                    (body or {}).get("propagationPolicy") or "Background"
                if policy not in ("Background", "Foreground", "Orphan"):
                    raise HttpError(400, "BadRequest", f"unknown propagationPolicy {policy!r}")
                self.delete_daemonset(ns, name, policy)
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if group == "gpuslice.io":
            return self._custom_calls(key, ns, name, body)
        if group == "resource.k8s.io":
            return self._resource_calls(key, ns, name, query, body)
        if key == ("", "events", "POST", True, False, ""):
            self._check_create(body, ns)
            self.create_event(ns, body)
            return 201, body
        if key == ("policy", "poddisruptionbudgets", "GET", True, False, ""):
            return 200, self._list("PodDisruptionBudgetList",
                                   self.list_pod_disruption_budgets(ns), self.current_rv())
        if key == ("discovery.k8s.io", "endpointslices", "GET", True, False, ""):
            sel = query.get("labelSelector", "")
            label, _, service = sel.partition("=")
            if label != "kubernetes.io/service-name" or not service:
                raise HttpError(400, "BadRequest", f"the fake selects EndpointSlices by "
                                f"kubernetes.io/service-name only, not {sel!r}")
            return 200, {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                         "metadata": {"resourceVersion": self.current_rv()},
                         "items": copy.deepcopy(self.endpointslices.get((ns, service), []))}
        raise HttpError(404, "NotFound", f"the fake serves no {key[2]} on {group}/{resource}")

    def _resource_calls(self, key: tuple[str, str, str, bool, bool, str], ns: str, name: str,
                        query: dict[str, str], body: Any) -> tuple[int, Any]:
        """resource.k8s.io/v1: a claim's GET; ResourceSlices listed by the field selectors
        spec.driver / spec.nodeName, created (``dryRun=All`` stores nothing), replaced and
        deleted. Fields of the gates not in :attr:`dra_gates` are dropped, as the API server
        does."""
        resource, rest = key[1], key[2:]
        if resource == "resourceclaims" and rest == ("GET", True, True, ""):
            return 200, self.get_resource_claim(ns, name)
        if resource == "resourceslices":
            if rest == ("GET", False, False, ""):
                driver = node = ""
                for term in filter(None, query.get("fieldSelector", "").split(",")):
                    field, _, value = term.partition("=")
                    if field == "spec.driver":
                        driver = value
                    elif field == "spec.nodeName":
                        node = value
                    else:
                        raise HttpError(400, "BadRequest", f'field label not supported: '
                                        f'"{field}"')
                return 200, self._list("ResourceSliceList",
                                       self.list_resource_slices(driver, node),
                                       self.current_rv())
            if rest == ("POST", False, False, ""):
                dry = query.get("dryRun")
                if dry not in (None, "All"):
                    raise HttpError(400, "BadRequest", f"unsupported dryRun {dry!r}")
                return 201, self.create_resource_slice(body, dry_run=dry == "All")
            if rest == ("PUT", False, True, ""):
                if (body.get("metadata") or {}).get("name") != name:
                    raise HttpError(400, "BadRequest", "the name in the body differs")
                return 200, self.update_resource_slice(body)
            if rest == ("DELETE", False, True, ""):
                self.delete_resource_slice(name)
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if resource in ("resourceclaims", "deviceclasses"):
            return self._claim_calls(key, ns, name, body)
        raise HttpError(404, "NotFound", f"the fake serves no {key[2]} on resource.k8s.io/"
                        f"{resource}")

    @staticmethod
    def _list(kind: str, items: list[dict[str, Any]], rv: str = "") -> dict[str, Any]:
        return {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": rv},
                "items": items}

    # -- pods ------------------------------------------------------------------------------

    @staticmethod
    def _field_selector(query: dict[str, str]) -> str | None:
        """The node a ``spec.nodeName=`` field selector names (None: no selector)."""
        sel = query.get("fieldSelector")
        if not sel:
            return None
        field, sep, value = sel.partition("=")
        if field != "spec.nodeName" or not sep or value.startswith("="):
            raise HttpError(400, "BadRequest", f'field label not supported by the fake: "{sel}"')
        return value

    def _pod_calls(self, key: tuple[str, str, str, bool, bool, str], ns: str, name: str,
              query: dict[str, str], body: Any) -> tuple[int, Any]:
        method, has_ns, has_name, sub = key[2:]
        if method == "GET" and not has_name:
            rv = self.current_rv()
            pods = [p for p in self.list_pods()
                    if not ns or p["metadata"].get("namespace") == ns]
            node = self._field_selector(query)
            if node is not None:
                pods = [p for p in pods if (p.get("spec") or {}).get("nodeName", "") == node]
            for term in filter(None, query.get("labelSelector", "").split(",")):
                label, sep, value = term.partition("=")
                if not sep or value.startswith("="):
                    raise HttpError(400, "BadRequest", f"the fake selects pods by label=value "
                                    f"only, not {term!r}")
                pods = [p for p in pods
                        if (p["metadata"].get("labels") or {}).get(label) == value]
            if query.get("limit"):
                pods = pods[:int(query["limit"])]
            return 200, self._list("PodList", pods, rv)
        if method == "GET" and has_name and not sub:
            return 200, self.get_pod(ns, name)
        if method == "POST" and has_ns and not has_name:
            return 201, self._create_pod(ns, body)
        if method == "PATCH" and has_name and not sub and isinstance(body, list):
            return 200, self.remove_pod_scheduling_gate(ns, name, body)  # gates only
        if method == "PATCH" and has_name and not sub:
            return 200, self._patch_pod(ns, name, body)
        if method == "POST" and sub == "binding":
            return self._bind(ns, name, body)
        if method == "POST" and sub == "eviction":
            self.get_pod(ns, name)
            if (ns, name) in self.disruption_blocked:
                raise HttpError(429, "TooManyRequests", "Cannot evict pod as it would violate "
                                "the pod's disruption budget.")
            self.delete_pod(ns, name)
            return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                         "status": "Success", "code": 201}
        raise HttpError(405, "MethodNotAllowed", f"the fake serves no {method} here")

    @staticmethod
    def _check_schema(body: dict[str, Any], kind: str, api_version: str) -> None:
        """The object against the Kubernetes 1.32 OpenAPI schema (what the API server's
        decoding and validation would refuse: unknown fields, wrong types)."""
        import kubernetes_validate

        doc = dict(body, kind=body.get("kind") or kind,
                   apiVersion=body.get("apiVersion") or api_version)
        try:
            kubernetes_validate.validate(doc, "1.32", strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise HttpError(422, "Invalid", f"{kind} is invalid: {exc}") from None

    def _check_create(self, body: dict[str, Any], ns: str) -> dict[str, Any]:
        meta = body.get("metadata")
        if not isinstance(meta, dict) or not meta.get("name"):
            raise HttpError(422, "Invalid", "metadata.name: Required value: name or "
                            "generateName is required")
        if meta.get("resourceVersion"):
            raise HttpError(400, "BadRequest",
                            "resourceVersion should not be set on objects to be created")
        if meta.get("namespace", ns) != ns:
            raise HttpError(400, "BadRequest", "the namespace of the provided object does not "
                            "match the namespace sent on the request")
        meta["namespace"] = ns
        return meta

    def _create_pod(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = self._check_create(body, ns)
        self._check_schema(body, "Pod", "v1")
        containers = (body.get("spec") or {}).get("containers") or []
        if not containers:
            raise HttpError(422, "Invalid", f'Pod "{meta["name"]}" is invalid: '
                            "spec.containers: Required value")
        for i, c in enumerate(containers):
            for f in ("name", "image"):
                if not c.get(f):
                    raise HttpError(422, "Invalid", f'Pod "{meta["name"]}" is invalid: '
                                    f"spec.containers[{i}].{f}: Required value")
        pod = copy.deepcopy(body)
        pod["metadata"]["uid"] = str(uuid.uuid4())
        pod["metadata"]["creationTimestamp"] = "2026-11-23T00:00:00Z"
        pod["status"] = {"phase": "Pending"}
        return self.create_pod(pod)

    def _patch_pod(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.get("metadata") or {}
        extra = set(body) - {"metadata"} or \
            set(meta) - {"annotations", "labels", "resourceVersion"}
        if extra:
            raise HttpError(400, "BadRequest", f"the fake patches only metadata.annotations "
                            f"and metadata.labels of pods, not {sorted(extra)}")
        for field in ("annotations", "labels"):
            values = meta.get(field) or {}
            if not isinstance(values, dict) or not all(
                    isinstance(v, str) or v is None for v in values.values()):
                raise HttpError(400, "BadRequest", f"metadata.{field}: a map of strings "
                                "(null removes a key)")
        with self._lock:
            cur = self._pods.get((ns, name))
            if cur is None:
                raise ApiNotFound(f'pods "{name}" not found')
            rv = meta.get("resourceVersion") or cur["metadata"]["resourceVersion"]
            if rv != cur["metadata"]["resourceVersion"]:
                raise ApiConflict(f'Operation cannot be fulfilled on pods "{name}": the object '
                                  "has been modified; please apply your changes to the "
                                  "latest version and try again")
            strategic_merge(cur["metadata"], {"annotations": meta.get("annotations") or {},
                                              "labels": meta.get("labels") or {}})
            self._bump(cur)
            return copy.deepcopy(cur)

    def _bind(self, ns: str, name: str, body: dict[str, Any]) -> tuple[int, Any]:
        target = body.get("target") or {}
        if target.get("kind", "Node") != "Node" or not target.get("name"):
            raise HttpError(422, "Invalid", "target: a Node by name is required")
        meta = body.get("metadata") or {}
        uid, rv = meta.get("uid"), meta.get("resourceVersion")
        pod = self.get_pod(ns, name)
        if uid and uid != pod["metadata"].get("uid"):
            raise ApiConflict(f"Precondition failed: UID in precondition: {uid}, UID in object "
                              f"meta: {pod['metadata'].get('uid')}")
        if rv and rv != pod["metadata"].get("resourceVersion"):
            raise ApiConflict(f"Operation cannot be fulfilled on pods \"{name}\": the object "
                              "has been modified; please apply your changes to the latest "
                              "version and try again")
        if (pod.get("spec") or {}).get("nodeName"):
            raise ApiConflict(f'pod {name} is already assigned to node '
                              f'"{pod["spec"]["nodeName"]}"')
        # kube-apiserver's BindingREST.setPodNodeAndMetadata: the binding's annotations are
        # set on the pod in the same write
        self.bind(ns, name, str(pod["metadata"].get("uid")), str(target["name"]),
                  meta.get("annotations") or None, rv or None)
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                     "status": "Success", "code": 201}

    # -- nodes, leases, custom objects ------------------------------------------------------

    def _patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.get("metadata") or {}
        if set(body) - {"metadata"} or set(meta) - {"labels", "annotations", "resourceVersion"}:
            raise HttpError(400, "BadRequest", "the fake patches only node labels and "
                            "annotations")
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                raise ApiNotFound(f'nodes "{name}" not found')
            if meta.get("resourceVersion") and \
                    meta["resourceVersion"] != node["metadata"].get("resourceVersion"):
                raise ApiConflict(f'Operation cannot be fulfilled on nodes "{name}": the '
                                  "object has been modified; please apply your changes to the "
                                  "latest version and try again")
            m = node.setdefault("metadata", {})
            strategic_merge(m, {"labels": meta.get("labels") or {},
                                "annotations": meta.get("annotations") or {}})
            self._bump(node)
            return copy.deepcopy(node)

    def _lease_calls(self, key: tuple[str, str, str, bool, bool, str], ns: str, name: str,
                body: Any) -> tuple[int, Any]:
        method, _, has_name, _ = key[2:]
        if method == "GET" and has_name:
            lease = self.get_lease(ns, name)
            if lease is None:
                raise ApiNotFound(f'leases.coordination.k8s.io "{name}" not found')
            return 200, lease
        if method == "POST" and not has_name:
            meta = self._check_create(body, ns)
            return 201, self.put_lease(ns, meta["name"], body.get("spec") or {}, None)
        if method == "PUT" and has_name:
            meta = body.get("metadata") or {}
            if meta.get("name") != name:
                raise HttpError(400, "BadRequest", "the name of the object does not match the "
                                "name on the URL")
            cur = self.get_lease(ns, name)
            if cur is None:
                raise ApiNotFound(f'leases.coordination.k8s.io "{name}" not found')
            rv = meta.get("resourceVersion") or cur["metadata"]["resourceVersion"]
            return 200, self.put_lease(ns, name, body.get("spec") or {}, rv)
        raise HttpError(405, "MethodNotAllowed", f"the fake serves no {method} on leases")

    def _custom_calls(self, key: tuple[str, str, str, bool, bool, str], ns: str, name: str,
                body: Any) -> tuple[int, Any]:
        resource = key[1]
        method, has_ns, has_name, sub = key[2:]
        if method == "GET" and not has_name:
            items = [o for o in self.list_custom(resource)
                     if not ns or o["metadata"].get("namespace") == ns]
            return 200, {"apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceScheduleList",
                         "metadata": {"resourceVersion": self.current_rv()}, "items": items}
        if method == "GET" and has_name and not sub:
            return 200, self.get_custom(resource, ns, name)
        if method == "POST" and has_ns and not has_name:
            meta = self._check_create(body, ns)
            obj = copy.deepcopy(body)
            obj.pop("status", None)  # the status subresource: create ignores it
            meta = obj["metadata"]
            meta["uid"] = str(uuid.uuid4())
            return 201, self.replace_custom(resource, obj)
        if method == "PUT" and has_name and not sub:  # the main resource: metadata, spec
            meta = body.get("metadata") or {}
            if meta.get("name") != name:
                raise HttpError(400, "BadRequest", "the name of the object does not match the "
                                "name on the URL")
            cur = self.get_custom(resource, ns, name)
            obj = copy.deepcopy(body)
            obj["metadata"].setdefault("resourceVersion", cur["metadata"]["resourceVersion"])
            obj["metadata"]["namespace"] = ns
            return 200, self.update_custom(resource, obj)
        if method == "DELETE" and has_name and not sub:
            self.delete_custom(resource, ns, name)
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if method == "PUT" and has_name and sub == "status":
            cur = self.get_custom(resource, ns, name)
            meta = body.get("metadata") or {}
            if meta.get("resourceVersion") and \
                    meta["resourceVersion"] != cur["metadata"]["resourceVersion"]:
                raise ApiConflict(f'Operation cannot be fulfilled on {resource}.gpuslice.io '
                                  f'"{name}": the object has been modified')
            new = dict(cur, status=copy.deepcopy(body.get("status")))  # the spec stays
            return 200, self.replace_custom(resource, new)
        raise HttpError(405, "MethodNotAllowed", f"the fake serves no {method} here")

    # -- resource.k8s.io/v1 ----------------------------------------------------------------

    def _claim_calls(self, key: tuple[str, str, str, bool, bool, str], ns: str, name: str,
                     body: Any) -> tuple[int, Any]:
        """resource.k8s.io/v1 DeviceClasses (list) and ResourceClaims (list, get, replace and
        the status subresource, preconditioned on resourceVersion; the spec is immutable)."""
        resource = key[1]
        method, has_ns, has_name, sub = key[2:]

        def listing(kind: str, items: list[dict[str, Any]]) -> dict[str, Any]:
            return {"kind": kind, "apiVersion": "resource.k8s.io/v1",
                    "metadata": {"resourceVersion": self.current_rv()}, "items": items}

        if (resource, method, has_ns, has_name) == ("deviceclasses", "GET", False, False):
            return 200, listing("DeviceClassList", self.list_device_classes())
        if resource != "resourceclaims":
            raise HttpError(404, "NotFound", f"the fake serves no {method} on {resource}")
        if method == "GET" and not has_name:
            items = [c for c in self.list_resource_claims()
                     if not ns or c["metadata"].get("namespace") == ns]
            return 200, listing("ResourceClaimList", items)
        if method == "GET" and has_name and not sub:
            return 200, self.get_resource_claim(ns, name)
        if method == "PUT" and has_name and sub in ("", "status"):
            meta = body.get("metadata") or {}
            if meta.get("name") != name or meta.get("namespace", ns) != ns:
                raise HttpError(400, "BadRequest", "the name of the object does not match the "
                                "name on the URL")
            if body.get("apiVersion") not in (None, "resource.k8s.io/v1") or \
                    body.get("kind") not in (None, "ResourceClaim"):
                raise HttpError(400, "BadRequest", f"expected resource.k8s.io/v1 "
                                f"ResourceClaim, got {body.get('apiVersion')} {body.get('kind')}")
            cur = self.get_resource_claim(ns, name)
            if sub == "" and body.get("spec") != cur.get("spec"):
                raise HttpError(422, "Invalid", f'ResourceClaim.resource.k8s.io "{name}" is '
                                "invalid: spec: Invalid value: field is immutable")
            body = dict(body, metadata=dict(meta, namespace=ns))
            if sub == "status":
                return 200, self.update_resource_claim_status(body)
            return 200, self.update_resource_claim(body)
        raise HttpError(405, "MethodNotAllowed", f"the fake serves no {method} here")

    # -- watch -----------------------------------------------------------------------------

    def _watch(self, h: BaseHTTPRequestHandler, group: str, resource: str, ns: str,
               query: dict[str, str]) -> tuple[int, Any]:
        import time

        kinds = {("", "pods"): "Pod", ("", "nodes"): "Node",
                 ("resource.k8s.io", "resourceclaims"): "ResourceClaim",
                 ("resource.k8s.io", "resourceslices"): "ResourceSlice"}
        kind = kinds.get((group, resource))
        if kind is None:
            raise HttpError(405, "MethodNotAllowed", f"the fake watches no {resource}")
        node = self._field_selector(query) if kind == "Pod" else None
        timeout = float(query.get("timeoutSeconds") or 30)
        since = query.get("resourceVersion", "")
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def keep(obj: dict[str, Any]) -> bool:
            return ((not ns or obj["metadata"].get("namespace") == ns)
                    and (node is None or (obj.get("spec") or {}).get("nodeName", "") == node))

        def send(event: dict[str, Any]) -> None:
            line = json.dumps(event).encode() + b"\n"
            h.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            h.wfile.flush()

        try:
            if since in ("", "0"):
                since = self.current_rv()
                objs = {"Pod": self.list_pods, "Node": self.list_nodes,
                        "ResourceClaim": self.list_resource_claims,
                        "ResourceSlice": self.list_resource_slices}[kind]()
                for obj in objs:
                    if keep(obj):
                        send({"type": "ADDED", "object": obj})
            elif int(since) < self.compacted:
                send({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": f"too old resource version: {since} ({self.compacted})",
                    "reason": "Expired", "code": 410}})
                h.wfile.write(b"0\r\n\r\n")
                return 0, None
            deadline = time.monotonic() + timeout
            while not self._stop.is_set() and not self.down.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                events, since = self.watch(since, min(left, 0.2))
                for ev in events:
                    if ev.kind == kind and keep(ev.obj):
                        send({"type": ev.type, "object": ev.obj})
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        return 0, None
