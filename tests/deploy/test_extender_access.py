"""Who may call the extender (issue 29), in every install path: the kustomize overlays, the Helm
chart and the dev cluster run it with mutual TLS (``--client-ca``; the second scheduler presents
its client certificate: tlsConfig certFile/keyFile), and a NetworkPolicy admits only the
scheduler's pods to its port. The certificates each path documents (the chart's own, the
cert-manager recipe, scripts/extender-certs.sh) fit what the pods mount and hold a real mutual
TLS handshake."""

from __future__ import annotations

import base64
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.deploy.test_manifests import OVERLAYS, ROOT, render

NAMESPACE = "gpuslice-system"
PATHS = [*OVERLAYS, "helm"]
EXTENDER_HOST = f"gpuslice-extender.{NAMESPACE}.svc"


def docs_of(path: str) -> list[dict[str, Any]]:
    if path == "helm":
        from tests.deploy.test_helm_chart import rendered

        return rendered()
    return render(path)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return obj


def secret_mounted_at(pod: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The Secret whose volume ``container`` mounts at the folder holding ``path``."""
    folder = path.rsplit("/", 1)[0]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = vol["secret"]
    items = {i["path"]: i["key"] for i in secret.get("items") or []}
    assert not items or path.rsplit("/", 1)[1] in items, (path, items)
    return str(secret["secretName"])


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what these manifests use
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


@pytest.mark.parametrize("path", PATHS)
def test_every_install_path_runs_the_extender_with_mutual_tls(path: str) -> None:
    from gpuslice.cli import _build_parser

    docs = docs_of(path)
    ext_pod = find(docs, "Deployment", "gpuslice-extender")["spec"]["template"]["spec"]
    (ext,) = ext_pod["containers"]
    args = _build_parser().parse_args(ext["args"])
    assert args.tls_cert and args.tls_key and args.client_ca, ext["args"]
    assert not args.insecure_no_client_auth
    served = secret_mounted_at(ext_pod, ext, args.tls_cert)
    assert secret_mounted_at(ext_pod, ext, args.client_ca) == served

    cm = find(docs, "ConfigMap", "gpuslice-scheduler-config")
    (extender,) = yaml.safe_load(cm["data"]["config.yaml"])["extenders"]
    assert extender["urlPrefix"].startswith(f"https://{EXTENDER_HOST}:")
    assert extender["enableHTTPS"] is True
    tls = extender["tlsConfig"]
    assert tls.get("insecure") is False and {"caFile", "certFile", "keyFile"} <= set(tls), tls
    sched_pod = find(docs, "Deployment", "gpuslice-scheduler")["spec"]["template"]["spec"]
    (sched,) = sched_pod["containers"]
    client = {secret_mounted_at(sched_pod, sched, tls[k]) for k in ("caFile", "certFile",
                                                                    "keyFile")}
    assert len(client) == 1 and served not in client  # the scheduler's key is its own
    if path == "helm":  # the chart issues both Secrets (tls.create, default true)
        for name in (served, *client):
            assert set(find(docs, "Secret", name)["data"]) == {"tls.crt", "tls.key", "ca.crt"}


@pytest.mark.parametrize("path", PATHS)
def test_every_install_path_admits_only_the_scheduler_to_the_extender(path: str) -> None:
    docs = docs_of(path)
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in docs
            if d["kind"] in ("Deployment", "DaemonSet")}
    ext = pods["gpuslice-extender"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and matches(d["spec"]["podSelector"], ext["metadata"]["labels"])]
    assert len(policies) == 1, policies
    spec = policies[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    ports = {p for c in ext["spec"]["containers"] for port in c["ports"]
             for p in (port["name"], port["containerPort"])}
    (rule,) = spec["ingress"]
    assert rule["ports"] and all(p["port"] in ports and p.get("protocol", "TCP") == "TCP"
                                 for p in rule["ports"])
    for peer in rule["from"]:  # pods of this namespace only: no namespaceSelector, no ipBlock
        assert set(peer) == {"podSelector"}, peer
    admitted = {name for name, t in pods.items()
                if any(matches(p["podSelector"], t["metadata"]["labels"]) for p in rule["from"])}
    assert admitted == {"gpuslice-scheduler"}


def test_the_dev_cluster_runs_the_extender_and_the_scheduler_with_mutual_tls(
        tmp_path: Path) -> None:
    from gpuslice.cli import _build_parser
    from gpuslice.devcluster import DevCluster, scheduler_config

    ca, crt, key = tmp_path / "ca.crt", tmp_path / "ext.crt", tmp_path / "ext.key"
    dev = SimpleNamespace(extender_tls=True, extender_cert=(crt, key), ca_crt=ca)
    argv = DevCluster.extender_tls_args(dev)  # type: ignore[arg-type]
    args = _build_parser().parse_args(["extender", "--key-file", "k", *argv])
    assert (args.tls_cert, args.tls_key, args.client_ca) == (str(crt), str(key), str(ca))
    client = (tmp_path / "sched.crt", tmp_path / "sched.key")
    cfg = scheduler_config(ROOT / "deploy" / "base" / "scheduler-config.yaml",
                           tmp_path / "kubeconfig", "https://127.0.0.1:1", ca,
                           client_cert=client)
    assert cfg["extenders"][0]["tlsConfig"] == {
        "insecure": False, "caFile": str(ca), "certFile": str(client[0]),
        "keyFile": str(client[1])}
    plain = SimpleNamespace(extender_tls=False)  # http: the flag must say so
    assert DevCluster.extender_tls_args(plain) == [  # type: ignore[arg-type]
        "--insecure-no-client-auth"]


def test_the_cert_manager_recipe_issues_the_secrets_the_pods_mount() -> None:
    docs = [d for d in yaml.safe_load_all(
        (ROOT / "deploy" / "cert-manager" / "certificates.yaml").read_text()) if d]
    assert {d["metadata"]["namespace"] for d in docs} == {NAMESPACE}
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    issuers = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Issuer"}
    (ca,) = [c for c in certs.values() if c.get("isCA")]
    (ca_issuer,) = [n for n, i in issuers.items() if (i.get("ca") or {}).get("secretName")
                    == ca["secretName"]]
    production = render("production")
    ext_pod = find(production, "Deployment", "gpuslice-extender")["spec"]["template"]["spec"]
    sched_pod = find(production, "Deployment", "gpuslice-scheduler")["spec"]["template"]["spec"]
    served = {v["secret"]["secretName"] for v in ext_pod["volumes"] if "secret" in v}
    client = {v["secret"]["secretName"] for v in sched_pod["volumes"] if "secret" in v}
    server_cert = next(c for c in certs.values() if c["secretName"] in served)
    client_cert = next(c for c in certs.values() if c["secretName"] in client)
    for c in (server_cert, client_cert):  # one CA signs both: the extender's --client-ca
        assert c["issuerRef"] == {"name": ca_issuer, "kind": "Issuer"}
    assert EXTENDER_HOST in server_cert["dnsNames"]
    assert "server auth" in server_cert["usages"] and "client auth" not in server_cert["usages"]
    assert "client auth" in client_cert["usages"] and "server auth" not in client_cert["usages"]


# -- the certificates hold a real handshake -----------------------------------------------------


def script_certificates(tmp_path: Path) -> dict[str, Path]:
    out = tmp_path / "certs"
    subprocess.run([str(ROOT / "scripts" / "extender-certs.sh"), "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=60)
    return {"ca": out / "ca.crt", "server.crt": out / "extender.crt",
            "server.key": out / "extender.key", "client.crt": out / "scheduler.crt",
            "client.key": out / "scheduler.key"}


def chart_certificates(tmp_path: Path) -> dict[str, Path]:
    from tests.deploy.test_helm_chart import CHART, helm

    out = subprocess.run([helm(), "template", "gpuslice", str(CHART), "--namespace", NAMESPACE,
                          "--kube-version", "1.32.0", "--show-only", "templates/tls.yaml"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    secrets = {d["metadata"]["name"]: d["data"] for d in yaml.safe_load_all(out) if d}
    files = {}
    for name, prefix in (("gpuslice-extender-tls", "server"),
                         ("gpuslice-scheduler-tls", "client")):
        for key in ("tls.crt", "tls.key", "ca.crt"):
            path = tmp_path / f"{prefix}-{key}"
            path.write_bytes(base64.b64decode(secrets[name][key]))
            files[f"{prefix}.{key.split('.')[1]}" if key != "ca.crt" else f"{prefix}-ca"] = path
    assert files["server-ca"].read_bytes() == files["client-ca"].read_bytes()
    files["ca"] = files["server-ca"]
    return files


def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> dict[str, Any]:
    """One TLS handshake over a socket pair, the client asking for the extender's Service
    name; the certificate the server verified (empty: none presented)."""
    a, b = socket.socketpair()
    seen: dict[str, Any] = {}
    errors: list[BaseException] = []

    def serve_one() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as tls:
                seen.update(tls.getpeercert() or {})
                tls.recv(1)
        except (OSError, ssl.SSLError) as exc:
            errors.append(exc)

    t = threading.Thread(target=serve_one)
    t.start()
    try:
        with client.wrap_socket(b, server_hostname=EXTENDER_HOST) as tls:
            tls.sendall(b"x")
    finally:
        t.join(10)
    if errors:
        raise errors[0]
    return seen


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
@pytest.mark.parametrize("source", ["script", "chart"])
def test_the_issued_certificates_hold_mutual_tls_for_the_service_name(
        source: str, tmp_path: Path) -> None:
    from gpuslice.services.extender import tls_context

    f = script_certificates(tmp_path) if source == "script" else chart_certificates(tmp_path)
    server = tls_context(str(f["server.crt"]), str(f["server.key"]), str(f["ca"]))
    client = ssl.create_default_context(cafile=str(f["ca"]))
    assert handshake(server, client) == {}  # the TLS layer lets a probe through ...
    client.load_cert_chain(str(f["client.crt"]), str(f["client.key"]))
    peer = handshake(server, client)  # ... and sees the scheduler's certificate
    assert dict(x[0] for x in peer["subject"])["commonName"] == "gpuslice-scheduler"
    if source == "script":  # each certificate does one job
        for crt, purpose, ok in (("server.crt", "sslclient", False),
                                 ("client.crt", "sslserver", False),
                                 ("client.crt", "sslclient", True)):
            res = subprocess.run(["openssl", "verify", "-CAfile", str(f["ca"]), "-purpose",
                                  purpose, str(f[crt])], capture_output=True, check=False)
            assert (res.returncode == 0) == ok, (crt, purpose)
