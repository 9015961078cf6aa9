"""The admission webhook as deployed (deploy/base, both overlays, the Helm chart, the
cert-manager recipe and scripts/extender-certs.sh): the configuration calls the Service the
Deployment serves behind, on the path its app routes, for pod creation only, never in
kube-system or gpuslice's namespace; its account may list nodes and nothing else; and the
certificates each install path issues verify for the Service's name against the caBundle the
API server is given."""

from __future__ import annotations

import base64
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_helm_chart import by_key, rendered, template
from tests.deploy.test_manifests import OVERLAYS, ROOT, render

NAMESPACE = "gpuslice-system"
HOOK_HOST = f"gpuslice-webhook.{NAMESPACE}.svc"


def _objects(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _expr(selector: dict[str, Any], key: str) -> dict[str, Any]:
    return next(e for e in selector.get("matchExpressions", []) if e["key"] == key)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configuration_reaches_the_webhooks_route_for_pod_creation_only(
        overlay: str) -> None:
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.cli import _build_parser
    from gpuslice.core.admission import Options
    from gpuslice.services.webhook import FleetView, make_app

    obj = _objects(render(overlay))
    cfg = obj[("MutatingWebhookConfiguration", "gpuslice-webhook")]
    dep = obj[("Deployment", "gpuslice-webhook")]
    svc = obj[("Service", "gpuslice-webhook")]
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = _build_parser().parse_args(c["args"])
    assert args.command == "webhook"
    routes = {r.resource.canonical for r in make_app(FleetView(FakeApiServer()), Options())
              .router.routes() if r.method == "POST" and r.resource is not None}
    (svc_port,) = svc["spec"]["ports"]
    (c_port,) = c["ports"]
    assert svc_port["targetPort"] == c_port["name"] and \
        c_port["containerPort"] == int(args.listen.rsplit(":", 1)[1])
    assert svc["spec"]["selector"] == pod["metadata"]["labels"]
    names = set()
    for hook in cfg["webhooks"]:
        names.add(hook["name"])
        assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
        assert hook["failurePolicy"] == "Fail" and hook["timeoutSeconds"] <= 10
        ref = hook["clientConfig"]["service"]
        assert (ref["namespace"], ref["name"], ref["port"]) == (
            dep["metadata"]["namespace"], "gpuslice-webhook", svc_port["port"])
        assert ref["path"] in routes
        (rule,) = hook["rules"]
        assert rule["operations"] == ["CREATE"] and rule["resources"] == ["pods"]
        never = _expr(hook["namespaceSelector"], "kubernetes.io/metadata.name")
        assert never["operator"] == "NotIn"
        assert {"kube-system", dep["metadata"]["namespace"]} <= set(never["values"])
    assert len(names) == 2
    # one webhook per opt-in: a labelled namespace (pods labelled disabled left out), or a
    # labelled pod in a namespace that is neither enabled nor disabled: never both
    by_ns, by_pod = cfg["webhooks"]
    assert _expr(by_ns["namespaceSelector"], "gpuslice.io/webhook") == {
        "key": "gpuslice.io/webhook", "operator": "In", "values": ["enabled"]}
    assert _expr(by_ns["objectSelector"], "gpuslice.io/webhook")["operator"] == "NotIn"
    assert set(_expr(by_pod["namespaceSelector"], "gpuslice.io/webhook")["values"]) == {
        "enabled", "disabled"}
    assert by_pod["objectSelector"] == {"matchLabels": {"gpuslice.io/webhook": "enabled"}}
    pdb = obj[("PodDisruptionBudget", "gpuslice-webhook")]
    assert pdb["spec"]["minAvailable"] == 1 and dep["spec"]["replicas"] >= 2
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_webhooks_account_may_read_nodes_claims_and_the_allocators_lease_only(
        overlay: str) -> None:
    """List nodes (the fleet), get claims and claim templates (the allocator's gate), get
    the allocator's Lease by name in gpuslice's namespace; no write of any kind."""
    docs = render(overlay)
    obj = _objects(docs)
    sa = {"kind": "ServiceAccount", "name": "gpuslice-webhook", "namespace": NAMESPACE}
    grants = set()
    for b in docs:
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding") and sa in b["subjects"]:
            for rule in obj[(b["roleRef"]["kind"], b["roleRef"]["name"])]["rules"]:
                names = tuple(rule.get("resourceNames") or ())
                grants |= {(b["kind"], g, r, v, names) for g in rule["apiGroups"]
                           for r in rule["resources"] for v in rule["verbs"]}
    assert grants == {
        ("ClusterRoleBinding", "", "nodes", "list", ()),
        ("ClusterRoleBinding", "resource.k8s.io", "resourceclaims", "get", ()),
        ("ClusterRoleBinding", "resource.k8s.io", "resourceclaimtemplates", "get", ()),
        ("RoleBinding", "coordination.k8s.io", "leases", "get", ("gpuslice-dra-allocator",))}
    binding = obj[("RoleBinding", "gpuslice-webhook")]
    assert binding["metadata"]["namespace"] == NAMESPACE
    dep = obj[("Deployment", "gpuslice-webhook")]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "gpuslice-webhook"


def _secret_files(secret: dict[str, Any], tmp: Path) -> dict[str, Path]:
    out = {}
    for key in ("tls.crt", "tls.key", "ca.crt"):
        out[key] = tmp / f"hook-{key}"
        out[key].write_bytes(base64.b64decode(secret["data"][key]))
    return out


def _handshake(crt: Path, key: Path, ca_pem: bytes) -> None:
    """A TLS handshake as the API server makes it: the Service's name checked against the
    caBundle."""
    from gpuslice.services.tls import tls_context

    server = tls_context(str(crt), str(key), None)
    client = ssl.create_default_context(cadata=ca_pem.decode())
    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as tls:
                tls.recv(1)
        except (OSError, ssl.SSLError) as exc:
            errors.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.wrap_socket(b, server_hostname=HOOK_HOST) as tls:
            tls.sendall(b"x")
    finally:
        t.join(10)
    assert not errors, errors


def test_the_chart_issues_a_certificate_its_ca_bundle_verifies(tmp_path: Path) -> None:
    obj = by_key(rendered())
    secret = obj[("Secret", "gpuslice-webhook-tls")]
    files = _secret_files(secret, tmp_path)
    cfg = obj[("MutatingWebhookConfiguration", "gpuslice-webhook")]
    bundles = {w["clientConfig"]["caBundle"] for w in cfg["webhooks"]}
    assert bundles == {secret["data"]["ca.crt"]}
    _handshake(files["tls.crt"], files["tls.key"], base64.b64decode(bundles.pop()))
    dep = obj[("Deployment", "gpuslice-webhook")]
    (vol,) = dep["spec"]["template"]["spec"]["volumes"]
    assert vol["secret"]["secretName"] == "gpuslice-webhook-tls"


def test_the_charts_webhook_values() -> None:
    from gpuslice.cli import _build_parser

    assert not [k for k in by_key(rendered("webhook.enabled=false")) if "webhook" in k[1]]
    cfg = by_key(rendered("webhook.failurePolicy=Ignore", "webhook.excludeNamespaces[0]=ops",
                          "webhook.timeoutSeconds=3"))[
        ("MutatingWebhookConfiguration", "gpuslice-webhook")]
    for hook in cfg["webhooks"]:
        assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] == 3
        assert _expr(hook["namespaceSelector"], "kubernetes.io/metadata.name")["values"] == [
            "ops", NAMESPACE]
    obj = by_key(rendered("tls.create=false",
                          "webhook.certManagerInjectFrom=gpuslice-system/gpuslice-webhook"))
    cfg = obj[("MutatingWebhookConfiguration", "gpuslice-webhook")]
    assert cfg["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "gpuslice-system/gpuslice-webhook"}
    assert all("caBundle" not in w["clientConfig"] for w in cfg["webhooks"])
    dep = by_key(rendered("webhook.translatePlainRequests=false",
                          "webhook.extraArgs[0]=--resync=60"))[("Deployment", "gpuslice-webhook")]
    args = _build_parser().parse_args(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.no_translate and args.resync == 60
    for bad, field in (("webhook.failurePolicy=Never", "failurePolicy"),
                       ("webhook.timeoutSeconds=60", "timeoutSeconds"),
                       ("webhook.caBundle=not*base64", "caBundle")):
        out = template(bad)
        assert out.returncode != 0 and field in out.stderr, out.stderr


def test_the_cert_manager_recipe_issues_the_secret_the_webhook_mounts_and_injects_it() -> None:
    docs = [d for d in yaml.safe_load_all(
        (ROOT / "deploy" / "cert-manager" / "certificates.yaml").read_text()) if d]
    certs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    obj = _objects(render("production"))
    cfg = obj[("MutatingWebhookConfiguration", "gpuslice-webhook")]
    ns, name = cfg["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].split("/")
    cert = certs[name]
    assert cert["metadata"]["namespace"] == ns == NAMESPACE
    dep = obj[("Deployment", "gpuslice-webhook")]
    (vol,) = dep["spec"]["template"]["spec"]["volumes"]
    assert cert["spec"]["secretName"] == vol["secret"]["secretName"]
    assert HOOK_HOST in cert["spec"]["dnsNames"] and "server auth" in cert["spec"]["usages"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_the_script_issues_a_webhook_certificate_for_the_service_name(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    subprocess.run([str(ROOT / "scripts" / "extender-certs.sh"), "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=60)
    _handshake(out / "webhook.crt", out / "webhook.key", (out / "ca.crt").read_bytes())
    res = subprocess.run(["openssl", "verify", "-CAfile", str(out / "ca.crt"), "-purpose",
                          "sslclient", str(out / "webhook.crt")], capture_output=True,
                         check=False)
    assert res.returncode != 0  # a serving certificate only
