"""The Helm chart deploy/helm/gpuslice: lints, renders with its defaults the same objects as the
production overlay (kustomize) plus the two TLS Secrets it issues, maps the sharing-mode values
to node-agent flags the CLI accepts, refuses values its schema does not allow, and every object
it renders validates against the Kubernetes 1.32 schemas."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.test_manifests import K8S_VERSION, render

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuslice"
NAMESPACE = "gpuslice-system"
# labels Helm charts carry by convention and kustomize does not add
HELM_ONLY_LABELS = ("app.kubernetes.io/managed-by", "helm.sh/chart")


def helm() -> str:
    found = shutil.which("helm") or next(
        (str(p) for p in [Path.home() / ".cache" / "gpuslice-tools" / "bin" / "helm"]
         if p.exists()), None)
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("helm is needed under CI (.ci/run installs it)")
        pytest.skip("helm not installed (go install helm.sh/helm/v3/cmd/helm@v3.17.3)")
    return found


def template(*sets: str) -> subprocess.CompletedProcess[str]:
    args = [helm(), "template", "gpuslice", str(CHART), "--namespace", NAMESPACE,
            "--kube-version", f"{K8S_VERSION}.0"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def rendered(*sets: str) -> list[dict[str, Any]]:
    out = template(*sets)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_helm_lint_strict_passes() -> None:
    out = subprocess.run([helm(), "lint", "--strict", str(CHART)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def hooks(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The objects Helm runs as hooks (not installed with the release)."""
    return {k: d for k, d in by_key(docs).items()
            if "helm.sh/hook" in (d["metadata"].get("annotations") or {})}


CLEANUP_HOOK = {(kind, "gpuslice-node-agent-cleanup") for kind in (
    "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Job")}


def test_defaults_render_the_objects_of_the_production_overlay() -> None:
    docs = rendered()
    chart = by_key(docs)
    # the differences: the chart issues the extender's mutual-TLS certificates (tls.create),
    # which the overlay's users bring (cert-manager or scripts/extender-certs.sh), and has
    # helm uninstall's pre-delete hook (deploy/README.md: kubectl delete's users delete the
    # DaemonSet first themselves)
    for name in ("gpuslice-extender-tls", "gpuslice-scheduler-tls", "gpuslice-webhook-tls"):
        assert chart.pop(("Secret", name))["type"] == "kubernetes.io/tls"
    # ... and the webhook's caBundle from the CA it issued, where the overlay names
    # cert-manager's injector (deploy/cert-manager) or scripts/extender-certs.sh writes it
    hooks_of = chart[("MutatingWebhookConfiguration", "gpuslice-webhook")]["webhooks"]
    assert all(w["clientConfig"].pop("caBundle") for w in hooks_of)
    assert set(hooks(docs)) == CLEANUP_HOOK
    for key in CLEANUP_HOOK:
        del chart[key]
    for d in chart.values():
        for label in HELM_ONLY_LABELS:
            d["metadata"]["labels"].pop(label)
    overlay = by_key(render("production"))
    # Helm installs into a namespace it is given (helm install --create-namespace): the chart
    # does not own the Namespace object
    del overlay[("Namespace", NAMESPACE)]
    del overlay[("MutatingWebhookConfiguration", "gpuslice-webhook")]["metadata"]["annotations"]
    assert sorted(chart) == sorted(overlay)
    for key, obj in overlay.items():
        assert chart[key] == obj, key


def _agent_args(docs: list[dict[str, Any]]) -> list[str]:
    ds = by_key(docs)[("DaemonSet", "gpuslice-node-agent")]
    args: list[str] = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize(("sets", "flags"), [
    ((), {"--mps-pipe-dir=/run/gpuslice/mps"}),
    (("sharing.mps.enabled=false",), {"--no-mps"}),
    (("sharing.mig.strategy=mixed",), {"--mig-strategy=mixed"}),
    (("sharing.devicesPerGpu=4", "sharing.mps.pipeDir=/var/run/mps"),
     {"--replicas=4", "--mps-pipe-dir=/var/run/mps"}),
])
def test_sharing_values_become_node_agent_flags_the_cli_accepts(
        sets: tuple[str, ...], flags: set[str]) -> None:
    from gpuslice.cli import _build_parser

    docs = rendered(*sets)
    args = _agent_args(docs)
    assert flags <= set(args), args
    parsed = _build_parser().parse_args(args)
    assert parsed.command == "node-agent"
    ds = by_key(docs)[("DaemonSet", "gpuslice-node-agent")]["spec"]["template"]["spec"]
    [mps] = [v for v in ds["volumes"] if v["name"] == "mps"]
    [mount] = [m for m in ds["containers"][0]["volumeMounts"] if m["name"] == "mps"]
    pipe = next(a for a in args if a.startswith("--mps-pipe-dir=")).split("=", 1)[1]
    assert mps["hostPath"]["path"] == mount["mountPath"] == pipe


def test_extender_extra_args_reach_its_command_line_and_the_cli_accepts_them() -> None:
    from gpuslice.cli import _build_parser

    docs = rendered("extender.extraArgs[0]=--binds-in-flight=0",
                    "extender.extraArgs[1]=--policy=fgd")
    dep = by_key(docs)[("Deployment", "gpuslice-extender")]
    args: list[str] = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--binds-in-flight=0", "--policy=fgd"]
    parsed = _build_parser().parse_args(args)
    assert (parsed.command, parsed.binds_in_flight, parsed.policy) == ("extender", 0, "fgd")
    out = template("extender.extraArgs[0]=binds-in-flight=0")  # not an option
    assert out.returncode != 0 and "extraArgs" in out.stderr, out.stderr


def test_the_uninstall_hook_stops_the_agents_then_cleans_the_nodes() -> None:
    """helm uninstall runs the hook Job before it deletes anything (pre-delete): its command
    line parses, it deletes only the agents' DaemonSet (foreground) and patches nodes, its own
    objects go once it succeeded, and it can be turned off. Its calls over the REST API, on
    these rules: tests/kube/test_node_cleanup_over_http.py."""
    from gpuslice.cli import _build_parser

    objs = hooks(rendered())
    for d in objs.values():
        ann = d["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == "pre-delete"
        assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        # the RBAC and the ServiceAccount exist before the Job starts
        assert int(ann["helm.sh/hook-weight"]) < 0 or d["kind"] == "Job"
    job = objs[("Job", "gpuslice-node-agent-cleanup")]
    spec = job["spec"]["template"]["spec"]
    args = _build_parser().parse_args(spec["containers"][0]["args"])
    assert (args.command, args.cleanup, args.all_nodes) == ("node-agent", True, True)
    assert args.stop_daemonset == f"{NAMESPACE}/gpuslice-node-agent"
    assert args.stop_wait < job["spec"]["activeDeadlineSeconds"] < 300  # helm's --timeout 5m
    assert spec["serviceAccountName"] == "gpuslice-node-agent-cleanup"
    [rule] = objs[("Role", "gpuslice-node-agent-cleanup")]["rules"]
    assert rule == {"apiGroups": ["apps"], "resources": ["daemonsets"],
                    "resourceNames": ["gpuslice-node-agent"], "verbs": ["get", "delete"]}
    rules = objs[("ClusterRole", "gpuslice-node-agent-cleanup")]["rules"]
    assert {v for r in rules for v in r["verbs"]} == {"get", "list", "patch"}
    assert not hooks(rendered("nodeAgent.cleanupOnUninstall=false"))


def test_optional_parts() -> None:
    assert ("Deployment", "gpuslice-reconfig") not in by_key(rendered("reconfig.enabled=false"))
    assert not [k for k in by_key(rendered("tls.create=false")) if k[0] == "Secret"]
    assert ("NetworkPolicy", "gpuslice-extender") not in by_key(
        rendered("networkPolicy.enabled=false"))
    prometheus = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}
    out = template("networkPolicy.extraFrom[0].namespaceSelector.matchLabels."
                   "kubernetes\\.io/metadata\\.name=monitoring")
    assert out.returncode == 0, out.stderr
    policy = by_key([d for d in yaml.safe_load_all(out.stdout) if d])[
        ("NetworkPolicy", "gpuslice-extender")]
    assert policy["spec"]["ingress"][0]["from"][1:] == [prometheus]
    key = "k" * 64
    secret = by_key(rendered("assignmentKey.create=true", f"assignmentKey.value={key}"))[
        ("Secret", "gpuslice-assignment-key")]
    assert secret["stringData"]["key"] == key
    ds = by_key(rendered("nodeAgent.runtimeClassName=nvidia"))[("DaemonSet",
                                                                 "gpuslice-node-agent")]
    assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    image = by_key(rendered("image.digest="))[("Deployment", "gpuslice-extender")]
    assert image["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example.com/gpuslice:0.1.0"


@pytest.mark.parametrize(("sets", "said"), [
    (("sharing.mig.strategy=all",), "strategy"),
    (("sharing.devicesPerGpu=0",), "devicesPerGpu"),
    (("image.digest=latest",), "digest"),
    (("extender.replica=3",), "replica"),  # a misspelt key is refused, not ignored
    (("assignmentKey.create=true",), "assignmentKey"),
    (("assignmentKey.create=true", "assignmentKey.value=short"), "value"),
    (("tls.clientSecretName=",), "clientSecretName"),
    (("networkPolicy.enable=false",), "enable"),
])
def test_values_the_schema_refuses_name_the_field(sets: tuple[str, ...], said: str) -> None:
    out = template(*sets)
    assert out.returncode != 0
    assert said in out.stderr, out.stderr


@pytest.mark.parametrize("sets", [(), ("assignmentKey.create=true", "assignmentKey.value=" +
                                       "0" * 64, "sharing.mig.strategy=single",
                                       "nodeAgent.runtimeClassName=nvidia")])
def test_every_rendered_object_validates_against_the_kubernetes_schemas(
        sets: tuple[str, ...]) -> None:
    docs = rendered(*sets)
    assert len(docs) >= 20
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_the_guides_helm_template_renders_without_flags() -> None:
    """``helm template deploy/helm/gpuslice`` as deploy/README.md writes it: no --kube-version
    (a Helm built without version stamps assumes v1.20.0 then)."""
    out = subprocess.run([helm(), "template", "deploy/helm/gpuslice"], capture_output=True,
                         text=True, timeout=60, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert len([d for d in yaml.safe_load_all(out.stdout) if d]) >= 20


def template_at(version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), "template", "gpuslice", str(CHART), "--kube-version", version],
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_kubernetes_version_given_older_than_1_29_is_refused() -> None:
    out = template_at("1.28.5")
    assert out.returncode != 0
    assert "gpuslice needs Kubernetes 1.29 or newer, and the cluster is v1.28.5" in out.stderr
    assert template_at("1.29.0").returncode == 0


@contextlib.contextmanager
def api_server(version: str) -> Iterator[str]:
    """The discovery of an API server of ``version`` that serves only the core group (as a
    cluster older than 1.29 does not serve flowcontrol.apiserver.k8s.io/v1); its URL."""
    major, minor, _ = version.split(".")
    answers = {"/version": {"major": major, "minor": minor, "gitVersion": f"v{version}"},
               "/api": {"kind": "APIVersions", "versions": ["v1"]},
               "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
               "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": []}}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer = answers.get(self.path.split("?", 1)[0])
            body = json.dumps(answer or {"kind": "Status", "code": 404}).encode()
            self.send_response(404 if answer is None else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("version", "refused"), [("1.20.0", True), ("1.28.5", True),
                                                  ("1.32.0", False)])
def test_a_cluster_older_than_1_29_is_refused_at_install(
        tmp_path: Path, version: str, refused: bool) -> None:
    """What ``helm install`` sees: the cluster's own version and API groups (here through
    ``helm template --validate``, which asks the cluster as install does). A 1.20.0 cluster is
    refused too, though v1.20.0 is also Helm's offline default version."""
    with api_server(version) as url:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": url}}],
            "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c"}))
        env = {**os.environ, "KUBECONFIG": str(kubeconfig),
               "HELM_CACHE_HOME": str(tmp_path / "cache"),
               "HELM_CONFIG_HOME": str(tmp_path / "config"),
               "HELM_DATA_HOME": str(tmp_path / "data")}
        out = subprocess.run([helm(), "template", "gpuslice", str(CHART), "--namespace",
                              NAMESPACE, "--validate"], capture_output=True, text=True,
                             timeout=60, check=False, env=env)
    said = f"gpuslice needs Kubernetes 1.29 or newer, and the cluster is v{version}"
    assert out.returncode != 0  # a 1.32 cluster renders, then this one serves no OpenAPI
    assert (said in out.stderr) == refused, out.stderr
