"""Who may call the extender, on the real control plane (issue 29): the extender the
kube-scheduler of this cluster schedules through (tests/cluster/test_scheduling.py) answers its
verbs only for the scheduler's client certificate; and the Helm chart's certificates, issued
once, are what a later upgrade renders again (its ``lookup`` against the real API server)."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from typing import Any

import yaml

from gpuslice.devcluster import DevCluster
from tests.cluster.conftest import DEPLOY
from tests.cluster.helpers import ExtenderProcess


def test_the_extender_answers_only_the_schedulers_certificate(
        dev: DevCluster, extender: ExtenderProcess) -> None:
    body = json.dumps({"Pod": {"metadata": {"name": "x", "namespace": "default"}},
                       "NodeNames": []}).encode()

    def post(ctx: ssl.SSLContext) -> int:
        req = urllib.request.Request(dev.extender_url + "/filter", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    ctx = ssl.create_default_context(cafile=str(dev.ca_crt))
    assert post(ctx) == 403  # no client certificate
    ctx.load_cert_chain(*(str(p) for p in dev.scheduler_client_cert))
    assert post(ctx) == 200


def test_the_chart_keeps_its_certificates_across_upgrades(dev: DevCluster) -> None:
    from tests.deploy.test_helm_chart import helm as find_helm

    helm = find_helm()  # skipped without helm (a failure under CI)
    ns = "t-helm-certificates"
    dev.kubectl("create", "namespace", ns)

    def render(server: bool) -> dict[str, dict[str, Any]]:
        argv = [helm, "template", "gpuslice", str(DEPLOY / "helm" / "gpuslice"), "-n", ns,
                "--show-only", "templates/tls.yaml"]
        argv += [f"--kubeconfig={dev.kubeconfig}", "--dry-run=server"] if server else \
            ["--kube-version", "1.32.0"]
        out = subprocess.run(argv, check=True, capture_output=True, text=True,
                             timeout=120).stdout
        return {d["metadata"]["name"]: d["data"] for d in yaml.safe_load_all(out) if d}

    try:
        installed = render(server=False)  # what an install writes ...
        dev.apply("\n---\n".join(yaml.safe_dump(
            {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
             "metadata": {"name": name, "namespace": ns}, "data": data})
            for name, data in installed.items()))
        assert render(server=True) == installed  # ... an upgrade renders again, unchanged
        dev.kubectl("-n", ns, "delete", "secret", "gpuslice-scheduler-tls")
        again = render(server=True)  # one of the two gone: both issued anew, one CA
        assert again["gpuslice-extender-tls"] != installed["gpuslice-extender-tls"]
        assert again["gpuslice-extender-tls"]["ca.crt"] == \
            again["gpuslice-scheduler-tls"]["ca.crt"]
    finally:
        dev.kubectl("delete", "namespace", ns, "--wait=false", check=False)
