"""The admission webhook on the real control plane: ``gpuslice webhook`` as a process on its
service account (deploy/base's RBAC: nodes list), kube-apiserver calling it over HTTPS through
deploy/base's MutatingWebhookConfiguration (its selectors and failurePolicy as shipped; only the
clientConfig points at the process, with the dev cluster's CA as caBundle), the real
ReplicaSet controller creating the pods, the gpuslice-scheduler profile and the extender
binding them.

- a stock Deployment with the opt-in label gets its slice: schedulerName set, GPU memory made
  explicit, bound by the extender with a signed assignment;
- what no GPU could take is refused at creation with the field named, through kubectl;
- kube-system and gpuslice-system are never seen, and an opt-out label is honoured;
- a ResourceQuota on requests.gpuslice.io/gpu-milli and gpu-memory refuses past quota, a pod
  that named only gpu-milli included (the webhook made its memory explicit);
- GPU selection, gpuslice's and HAMi's annotations, places each pod on a model it allows."""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.core.assignment import verify
from gpuslice.devcluster import DevCluster, wait_until
from gpuslice.devcluster.procs import free_port
from tests.cluster.conftest import DEPLOY
from tests.cluster.helpers import EXTENDER_KEY, GROUP, Kube, assignment, bound, gpu_node

SYSTEM = "gpuslice-system"
OPT_IN = "gpuslice.io/webhook"


@dataclass
class WebhookProc:
    dev: DevCluster
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        ctx = ssl.create_default_context(cafile=str(self.dev.ca_crt))
        with urllib.request.urlopen(self.url + "/metrics", context=ctx, timeout=5) as r:
            return str(r.read().decode())

    def sees(self, model: str, gpus: int) -> bool:
        return f'gpuslice_webhook_fleet_gpus{{model="{model}"}} {float(gpus)}' in \
            self.metrics()


def _configuration(url: str, ca: Path) -> dict[str, Any]:
    """deploy/base's MutatingWebhookConfiguration, its clientConfig pointed at ``url``."""
    docs = yaml.safe_load_all((DEPLOY / "base" / "webhook.yaml").read_text())
    cfg = next(d for d in docs if d and d["kind"] == "MutatingWebhookConfiguration")
    cfg["metadata"].pop("annotations", None)
    for w in cfg["webhooks"]:
        w["clientConfig"] = {"url": url + w["clientConfig"]["service"]["path"],
                             "caBundle": base64.b64encode(ca.read_bytes()).decode()}
    return dict(cfg)


@pytest.fixture(scope="module")
def webhook(dev: DevCluster) -> Iterator[WebhookProc]:
    crt, key = dev.pki.issue("webhook", "/CN=gpuslice-webhook", server=True)
    kubeconfig = dev.service_account_kubeconfig(SYSTEM, "gpuslice-webhook")
    port = free_port()
    log = dev.dir / "webhook.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "webhook", "--listen", f"127.0.0.1:{port}",
             "--tls-cert", str(crt), "--tls-key", str(key), "--kubeconfig", str(kubeconfig),
             "--resync", "1"], stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    hook = WebhookProc(dev, port, proc, log)
    ctx = ssl.create_default_context(cafile=str(dev.ca_crt))
    wait_until("gpuslice webhook /readyz", lambda: urllib.request.urlopen(
        hook.url + "/readyz", context=ctx, timeout=5).status == 200, 120, proc, log)
    dev.kubectl("delete", "mutatingwebhookconfiguration", "gpuslice-webhook",
                "--ignore-not-found")
    dev.apply(yaml.safe_dump(_configuration(hook.url, dev.ca_crt)))
    try:
        yield hook
    finally:
        dev.kubectl("delete", "mutatingwebhookconfiguration", "gpuslice-webhook",
                    "--ignore-not-found")
        dev.apply(DEPLOY / "base")  # as the session left it
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _label_namespace(dev: DevCluster, ns: str, value: str = "enabled") -> None:
    dev.kubectl("label", "namespace", ns, f"{OPT_IN}={value}", "--overwrite")


def _deployment(name: str, ns: str, limits: dict[str, str], replicas: int = 2,
                labels: dict[str, str] | None = None,
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A Deployment as users write it for a GPU server: no schedulerName, no gpuslice
    annotation, the GPU in its limits."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {
                         "metadata": {"labels": {"app": name, **(labels or {})},
                                      "annotations": annotations or {}},
                         "spec": {"terminationGracePeriodSeconds": 0,
                                  "tolerations": [{"operator": "Exists"}],
                                  "containers": [{"name": "server",
                                                  "image": "registry.local/model:1",
                                                  "resources": {"limits": limits}}]}}}}


def _pod(name: str, ns: str, limits: dict[str, str],
         annotations: dict[str, str] | None = None,
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": annotations or {},
                         "labels": labels or {}},
            "spec": {"terminationGracePeriodSeconds": 0,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "server", "image": "registry.local/model:1",
                                     "resources": {"limits": limits}}]}}


def _create(dev: DevCluster, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return dev.kubectl("create", "-f", "-", input=yaml.safe_dump(obj), check=False)


def _limits(pod: dict[str, Any]) -> dict[str, str]:
    return dict(pod["spec"]["containers"][0]["resources"]["limits"])


def test_a_stock_deployment_with_the_opt_in_label_gets_its_slice(
        dev: DevCluster, kube: Kube, group: str, webhook: WebhookProc) -> None:
    kube.add_nodes([gpu_node(f"{group}-l4", group, "L4", count=2)])
    wait_until("the webhook reads the L4 node", lambda: webhook.sees("L4", 2), 30)
    # the pod template's label alone: a quarter of a GPU, nothing else said
    dev.apply(yaml.safe_dump(_deployment("quarter", group, {"gpuslice.io/gpu-milli": "250"},
                                         labels={OPT_IN: "enabled"})))
    # a plain NVIDIA request with the fraction in an annotation
    dev.apply(yaml.safe_dump(_deployment("plain", group, {"nvidia.com/gpu": "1"}, replicas=1,
                                         labels={OPT_IN: "enabled"},
                                         annotations={"gpuslice.io/gpu-milli": "500"})))
    pods = kube.wait_bound(group, 3, timeout_s=120)
    for p in bound(pods):
        name = p["metadata"]["name"]
        assert p["spec"]["schedulerName"] == "gpuslice-scheduler", name
        a = assignment(p)
        assert verify(a, EXTENDER_KEY.encode()) and a.node == p["spec"]["nodeName"], name
        (share,) = a.containers[0].gpus
        limits = _limits(p)
        requests = p["spec"]["containers"][0]["resources"]["requests"]
        assert {k: v for k, v in requests.items() if k.startswith("gpuslice.io/")} == limits
        if name.startswith("quarter"):  # memory explicit: a quarter of the L4's 24576 MiB
            assert limits == {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "250",
                              "gpuslice.io/gpu-memory": "6144"}, name
            assert (share.milli, share.memory_mib) == (250, 6144)
        else:  # nvidia.com/gpu translated
            assert limits == {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "500",
                              "gpuslice.io/gpu-memory": "12288"}, name
            assert (share.milli, share.memory_mib) == (500, 12288)
        assert "gpuslice.io/webhook-changes" in p["metadata"]["annotations"]


REFUSED = [  # (limits, annotations, the field the refusal names)
    ({"gpuslice.io/gpu-milli": "1500"}, {}, "gpuslice.io/gpu-milli"),
    ({"gpuslice.io/gpu": "2", "gpuslice.io/gpu-milli": "500"}, {}, "gpuslice.io/gpu-milli"),
    ({"gpuslice.io/gpu-memory": "100000"}, {}, "gpuslice.io/gpu-memory"),
    ({"gpuslice.io/gpu-milli": "250"}, {"gpuslice.io/mig-profile": "5g.50gb"},
     "gpuslice.io/mig-profile"),
    ({"gpuslice.io/gpu-milli": "250"}, {"gpuslice.io/gpu-model": "L4",
                                        "gpuslice.io/gpu-model-exclude": "L4"},
     "gpuslice.io/gpu-model"),
    ({"gpuslice.io/gpu-milli": "250", "nvidia.com/gpu": "1"}, {}, "nvidia.com/gpu"),
]


def test_what_no_gpu_could_take_is_refused_at_creation_naming_the_field(
        dev: DevCluster, kube: Kube, group: str, webhook: WebhookProc) -> None:
    kube.add_nodes([gpu_node(f"{group}-l4", group, "L4", count=1)])
    wait_until("the webhook reads the L4 node", lambda: webhook.sees("L4", 1), 30)
    _label_namespace(dev, group)
    for i, (limits, ann, field) in enumerate(REFUSED):
        res = _create(dev, _pod(f"refused-{i}", group, limits, ann))
        assert res.returncode != 0, (limits, res.stdout)
        assert "denied the request" in res.stderr and field in res.stderr, res.stderr
    # a model no node has is a warning, not a refusal (a node may join)
    res = _create(dev, _pod("warned", group, {"gpuslice.io/gpu-milli": "250"},
                            {"gpuslice.io/gpu-model": "H100-SXM"}))
    assert res.returncode == 0, res.stderr
    assert "Warning:" in res.stderr and "no GPU of the cluster matches" in res.stderr


def test_kube_system_gpuslice_system_and_opted_out_pods_are_never_seen(
        dev: DevCluster, webhook: WebhookProc) -> None:
    """A pod the webhook would refuse is created untouched where it may not look."""
    bad = {"gpuslice.io/gpu-milli": "1500"}
    ns = "t-webhook-out"
    dev.kubectl("create", "namespace", ns)
    _label_namespace(dev, ns)
    try:
        for where, labels in (("kube-system", {OPT_IN: "enabled"}),
                              (SYSTEM, {OPT_IN: "enabled"}), (ns, {OPT_IN: "disabled"})):
            res = _create(dev, _pod("unseen", where, bad, labels=labels))
            assert res.returncode == 0, (where, res.stderr)
            pod = json.loads(dev.kubectl("get", "pod", "unseen", "-n", where, "-o",
                                         "json").stdout)
            assert pod["spec"]["schedulerName"] == "default-scheduler", where
            dev.kubectl("delete", "pod", "unseen", "-n", where, "--wait=false")
        # a namespace labelled disabled: even a pod labelled enabled is left alone
        _label_namespace(dev, ns, "disabled")
        res = _create(dev, _pod("unseen-2", ns, bad, labels={OPT_IN: "enabled"}))
        assert res.returncode == 0, res.stderr
    finally:
        dev.kubectl("delete", "namespace", ns, "--wait=false")


def test_a_quota_on_gpu_milli_and_gpu_memory_refuses_past_it(
        dev: DevCluster, kube: Kube, group: str, webhook: WebhookProc) -> None:
    kube.add_nodes([gpu_node(f"{group}-l4", group, "L4", count=2)])
    wait_until("the webhook reads the L4 node", lambda: webhook.sees("L4", 2), 30)
    _label_namespace(dev, group)
    quota = {"apiVersion": "v1", "kind": "ResourceQuota",
             "metadata": {"name": "team-gpus", "namespace": group},
             "spec": {"hard": {"requests.gpuslice.io/gpu-milli": "1000",
                               "requests.gpuslice.io/gpu-memory": "12288"}}}
    dev.apply(yaml.safe_dump(quota))

    def counted() -> bool:  # the quota controller has filled status.hard: admission counts
        q = json.loads(dev.kubectl("get", "resourcequota", "team-gpus", "-n", group, "-o",
                                   "json").stdout)
        return bool((q.get("status") or {}).get("hard"))

    wait_until("the quota's status", counted, 60)
    quarter = {"gpuslice.io/gpu-milli": "250"}  # memory left to the webhook: 6144 MiB
    for i in range(2):
        res = _create(dev, _pod(f"q{i}", group, quarter))
        assert res.returncode == 0, res.stderr
    # a third quarter: 750 of 1000 milli, but 18432 of 12288 MiB
    res = _create(dev, _pod("q2", group, quarter))
    assert res.returncode != 0
    assert "exceeded quota: team-gpus" in res.stderr, res.stderr
    assert "requests.gpuslice.io/gpu-memory" in res.stderr, res.stderr
    # within memory, past milli: 500 + 600 of 1000
    res = _create(dev, _pod("big", group, {"gpuslice.io/gpu-milli": "600",
                                           "gpuslice.io/gpu-memory": "1"}))
    assert res.returncode != 0 and "requests.gpuslice.io/gpu-milli" in res.stderr, res.stderr
    q = json.loads(dev.kubectl("get", "resourcequota", "team-gpus", "-n", group, "-o",
                               "json").stdout)
    assert q["status"]["used"] == {"requests.gpuslice.io/gpu-milli": "500",
                                   "requests.gpuslice.io/gpu-memory": "12288"}
    assert len(bound(kube.wait_bound(group, 2, timeout_s=120))) == 2


def test_gpu_selection_by_either_spelling_places_each_pod_on_its_model(
        dev: DevCluster, kube: Kube, group: str, webhook: WebhookProc) -> None:
    """The one rule (core.gpuselect) on the device-plugin path: the webhook lets the
    selection through and the extender keeps the nodes of the models it allows, HAMi's
    spelling (a part of the name) as gpuslice's (an exclude)."""
    kube.add_nodes([gpu_node(f"{group}-t4", group, "T4", count=1),
                    gpu_node(f"{group}-l4", group, "L4", count=1)])
    wait_until("the webhook reads both nodes",
               lambda: webhook.sees("T4", 1) and webhook.sees("L4", 1), 30)
    _label_namespace(dev, group)
    quarter = {"gpuslice.io/gpu-milli": "250"}
    asks = {"hami-l4": {"nvidia.com/use-gputype": "l4"},
            "hami-not-l4": {"nvidia.com/nouse-gputype": "L4"},
            "only-l4": {"gpuslice.io/gpu-model": "L4"},
            "not-l4": {"gpuslice.io/gpu-model-exclude": "l4"}}
    for name, ann in asks.items():
        res = _create(dev, _pod(name, group, quarter, ann))
        assert res.returncode == 0, res.stderr
    pods = {p["metadata"]["name"]: p for p in kube.wait_bound(group, len(asks), timeout_s=120)}
    on = {name: p["spec"]["nodeName"] for name, p in pods.items()}
    assert on == {"hami-l4": f"{group}-l4", "hami-not-l4": f"{group}-t4",
                  "only-l4": f"{group}-l4", "not-l4": f"{group}-t4"}, on
    for name, p in pods.items():  # the memory made explicit from the model it may use
        a = assignment(p)
        assert verify(a, EXTENDER_KEY.encode()), name
        assert _limits(p)["gpuslice.io/gpu-memory"] == str(a.containers[0].gpus[0].memory_mib)


def test_gpu_selection_by_uuid_pins_and_avoids_gpus(
        dev: DevCluster, kube: Kube, group: str, webhook: WebhookProc) -> None:
    """Pin or avoid GPUs by UUID (gpuslice's and HAMi's spelling) on the device-plugin path:
    the webhook lets the selection through and the extender's filter and bind put each share
    on an allowed GPU. The extender's own pick on an empty node is GPU 0: the pinned pod and
    the pod that avoids GPU 0 both get GPU 1."""
    node = f"{group}-two"
    kube.add_nodes([gpu_node(node, group, "L4", count=2)])
    wait_until("the webhook reads the node", lambda: webhook.sees("L4", 2), 30)
    _label_namespace(dev, group)
    quarter = {"gpuslice.io/gpu-milli": "250"}
    asks = {"pin-1": {"gpuslice.io/gpu-uuid": f"GPU-{node}-01"},
            "avoid-0": {"nvidia.com/nouse-gpuuuid": f"GPU-{node}-00",
                        "gpuslice.io/gpu-model": "L4"}}
    for name, ann in asks.items():
        pod = _pod(name, group, quarter, ann)
        pod["spec"]["nodeSelector"] = {GROUP: group}
        res = _create(dev, pod)
        assert res.returncode == 0, res.stderr
    pods = {p["metadata"]["name"]: p for p in kube.wait_bound(group, len(asks), timeout_s=120)}
    for name, p in pods.items():
        a = assignment(p)
        assert verify(a, EXTENDER_KEY.encode()), name
        assert p["spec"]["nodeName"] == node, name
        assert a.containers[0].gpus[0].uuid == f"GPU-{node}-01", (name, a)
