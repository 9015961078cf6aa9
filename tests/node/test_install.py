"""The install, as a user does it, on the real node: the image ``scripts/build-image.sh``
builds, imported into containerd (no registry), the Helm chart installed with ``helm install``
on this cluster; the node agent DaemonSet runs as a real pod with the chart's securityContext
and mounts, the extender Deployment serves the chart's second kube-scheduler over mutual TLS,
and the fractional Deployment of ``deploy/examples`` (its image swapped for busybox) runs with
its caps, beside a stock Deployment (``nvidia.com/gpu: 1``) that only the chart's admission
webhook (its opt-in label) turns into a slice. The DRA path is installed both ways, with
kubectl (deploy/dra, deploy/dra-allocator) and with ``helm install --set path=dra``. Pods reach
the API server through kube-proxy (10.96.0.1) and the extender's Service name through CoreDNS:
the real node's ``network`` mode. What breaks here is a bug in the chart or the image, not in
the test."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from gpuslice.devcluster import wait_until
from gpuslice.devcluster.realnode import BUSYBOX, KUBE_SCHEDULER
from tests.node.conftest import DEPLOY
from tests.node.helpers import END, REPORT, NodeEnv, Report, kubectl_json, wait_ready

NS = "gpuslice-system"
APP_NS = "inference"
KEY = "node-tier-install-key-0123456789abcdef0123456789"
# what the example asks for: T4 or L4 (gpuslice.io/gpu-model)
FAKE_GPUS = "gpus:\n  - model: L4\n  - model: L4\n"


def example_deployment() -> dict[str, Any]:
    """deploy/examples/fractional.yaml's first Deployment, one replica, its model server
    swapped for busybox printing what the container sees."""
    [dep] = [d for d in yaml.safe_load_all((DEPLOY / "examples" / "fractional.yaml").read_text())
             if d and d["kind"] == "Deployment"][:1]
    dep["metadata"]["namespace"] = APP_NS
    dep["spec"]["replicas"] = 1
    pod = dep["spec"]["template"]["spec"]
    pod["terminationGracePeriodSeconds"] = 1
    c = pod["containers"][0]
    c.update(image=BUSYBOX, imagePullPolicy="Never", command=["sh", "-c", REPORT + "sleep 3600"])
    c.pop("args", None)
    c.pop("ports", None)
    c.pop("readinessProbe", None)
    c.pop("livenessProbe", None)
    return dict(dep)


def stock_deployment() -> dict[str, Any]:
    """A Deployment as users write it for a GPU server (a plain ``nvidia.com/gpu`` and no
    schedulerName) with only the admission webhook's opt-in label and a fraction added."""
    pod = {"terminationGracePeriodSeconds": 1, "containers": [{
        "name": "server", "image": BUSYBOX, "imagePullPolicy": "Never",
        "command": ["sh", "-c", REPORT + "sleep 3600"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "stock", "namespace": APP_NS},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "stock"}},
                     "template": {"metadata": {
                         "labels": {"app": "stock", "gpuslice.io/webhook": "enabled"},
                         "annotations": {"gpuslice.io/gpu-milli": "500"}}, "spec": pod}}}


def _running_pods(net: NodeEnv, count: int) -> list[dict[str, Any]]:
    """The pods of APP_NS once ``count`` run, by name; on time-out, why not."""
    pods: list[dict[str, Any]] = []

    def running() -> bool:
        pods[:] = sorted(kubectl_json(net, "get", "pods", "-n", APP_NS)["items"],
                         key=lambda p: p["metadata"]["name"])
        return len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods)

    try:
        wait_until(f"{count} pods of {APP_NS} running", running, 180, every_s=1.0)
    except Exception as exc:
        ev = net.dev.kubectl("get", "events", "-A", check=False).stdout[-4000:]
        ev += net.dev.kubectl("logs", "-n", NS, "-l", "app.kubernetes.io/name=gpuslice-webhook",
                              "--tail=20", check=False).stdout[-2000:]
        ev += net.dev.kubectl("get", "endpointslices,pods", "-n", NS, "--show-labels",
                              check=False).stdout[-2000:]
        ev += net.dev.kubectl("logs", "-n", NS, "-l", "app.kubernetes.io/name=gpuslice-extender",
                              "--tail=20", check=False).stdout[-3000:]
        sched = net.dev.kubectl("logs", "-n", NS, "-l",
                                "app.kubernetes.io/name=gpuslice-scheduler", "--tail=40",
                                check=False)
        raise AssertionError(f"{exc}\n{ev}\n{sched.stdout[-3000:]}") from None
    return pods


def _report(net: NodeEnv, pod: dict[str, Any]) -> Report:
    logs = ""
    for _ in range(60):
        logs = net.dev.kubectl("logs", "-n", APP_NS, pod["metadata"]["name"], check=False).stdout
        if END in logs:
            break
    return Report(logs)


def test_helm_chart_on_the_real_node_runs_a_fractional_example_with_its_caps(
        net: NodeEnv, image: dict[str, Any], helm: str) -> None:
    # the image, loaded as deploy/README.md says for a cluster without a registry
    net.node.ctr("images", "import", image["archive"])
    listed = net.node.ctr("images", "ls", "-q").stdout.split()
    assert image["reference"] in listed, listed
    repo, tag = image["reference"].rsplit(":", 1)
    values = {
        "image": {"repository": repo, "tag": tag, "digest": ""},
        "assignmentKey": {"create": True, "value": KEY},
        "scheduler": {"image": KUBE_SCHEDULER},
        "nodeAgent": {"fakeGpus": FAKE_GPUS},
    }
    # what GPU feature discovery (or the GPU operator) says of a GPU node: the chart's node
    # agent runs on such nodes
    net.dev.kubectl("label", "node", net.node.name, "nvidia.com/gpu.present=true")
    vfile = net.dev.dir / "values.yaml"
    vfile.write_text(yaml.safe_dump(values))
    res = subprocess.run([helm, "install", "gpuslice", str(DEPLOY / "helm" / "gpuslice"),
                          "-n", NS, "--create-namespace", "-f", str(vfile),
                          "--kubeconfig", str(net.dev.kubeconfig), "--wait", "--timeout", "5m"],
                         capture_output=True, text=True, timeout=400, check=False)
    if res.returncode != 0:  # what did not come up
        wait_ready(net, "the node agent pod", "app.kubernetes.io/name=gpuslice-node-agent", 1, 1)
        wait_ready(net, "both extenders", "app.kubernetes.io/name=gpuslice-extender", 2, 1)
        wait_ready(net, "the second scheduler", "app.kubernetes.io/name=gpuslice-scheduler", 1, 1)
    assert res.returncode == 0, res.stdout + res.stderr
    # helm --wait: every Deployment and the DaemonSet rolled out; one extender leads
    wait_ready(net, "the extender leader",
               "app.kubernetes.io/name=gpuslice-extender,gpuslice.io/extender-role=leader")
    wait_until("node agent: gpuslice.io/gpu on the real node",
               lambda: int(net.allocatable().get("gpuslice.io/gpu", "0")) > 0, 120)
    # the webhook judges pods against the published inventories (and reads them again while
    # it has none): the stock pod's memory is made explicit from them
    wait_until("node agent: the node's GPU inventory published", lambda: "gpuslice.io/inventory"
               in (net.node_obj()["metadata"].get("annotations") or {}), 60)
    net.dev.kubectl("create", "namespace", APP_NS)
    net.dev.kubectl("apply", "-f", "-", input=json.dumps(example_deployment()))
    # and a stock one through the chart's admission webhook (its opt-in label only)
    net.dev.kubectl("apply", "-f", "-", input=json.dumps(stock_deployment()))
    example, stock = _running_pods(net, 2)
    r = _report(net, example)
    assert r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", r.env
    assert r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert r.env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    assert example["spec"]["nodeName"] == net.node.name
    # the webhook's work: the gpuslice scheduler, nvidia.com/gpu translated, the memory of
    # half an L4 made explicit; the node agent capped the container by it
    assert stock["spec"]["schedulerName"] == "gpuslice-scheduler"
    limits = stock["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and limits["gpuslice.io/gpu-milli"] == "500", limits
    r = _report(net, stock)
    assert r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50", r.env
    assert r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == \
        f"0={limits['gpuslice.io/gpu-memory']}M"
    assert stock["spec"]["nodeName"] == net.node.name
    # uninstall: the chart's objects go, the node's pods with them
    net.dev.kubectl("delete", "namespace", APP_NS, "--wait=true", "--timeout=120s",
                    timeout_s=150)
    res = subprocess.run([helm, "uninstall", "gpuslice", "-n", NS, "--wait", "--timeout",
                          "120s", "--kubeconfig", str(net.dev.kubeconfig)],
                         capture_output=True, text=True, timeout=200, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    # the node as it was: what the agent published is gone (its pre-delete hook stopped the
    # DaemonSet first, each agent cleaned its node), the admin's own label stays
    node = net.node_obj()
    labels = node["metadata"].get("labels") or {}
    assert "gpuslice.io/gpu-model" not in labels and "nvidia.com/gpu.count" not in labels, labels
    assert labels.get("nvidia.com/gpu.present") == "true"
    assert "gpuslice.io/inventory" not in (node["metadata"].get("annotations") or {})
    for field in ("capacity", "allocatable"):
        left = [k for k in node["status"][field] if k in ("gpuslice.io/gpu-milli",
                                                           "gpuslice.io/gpu-memory")]
        assert left == [], (field, node["status"][field])


def _install_dra(net: NodeEnv, image: dict[str, Any], how: str, helm: str) -> None:
    """deploy/dra through deploy/overlays/dra-fake-gpus and deploy/dra-allocator with
    kubectl, or the chart's ``path=dra`` with ``dra.fakeGpus`` (the same objects) with helm."""
    net.dev.kubectl("label", "node", net.node.name, "gpuslice.io/fake-gpus=true", "--overwrite")
    if how == "kubectl":
        net.dev.apply(DEPLOY / "overlays" / "dra-fake-gpus")
        net.dev.apply(DEPLOY / "dra-allocator")
        return
    repo, tag = image["reference"].rsplit(":", 1)
    fake = {"gpuslice.io/fake-gpus": "true", "nvidia.com/gpu.present": None}
    vfile = net.dev.dir / "dra-values.yaml"
    vfile.write_text(yaml.safe_dump({
        "path": "dra", "image": {"repository": repo, "tag": tag, "digest": ""},
        "dra": {"fakeGpus": 2, "nodeSelector": fake}, "nodeAgent": {"nodeSelector": fake}}))
    res = subprocess.run([helm, "install", "gpuslice", str(DEPLOY / "helm" / "gpuslice"),
                          "-n", NS, "--create-namespace", "-f", str(vfile),
                          "--kubeconfig", str(net.dev.kubeconfig), "--wait", "--timeout", "4m"],
                         capture_output=True, text=True, timeout=300, check=False)
    if res.returncode != 0:  # what did not come up
        wait_ready(net, "the driver pod", "app=gpuslice-dra-driver", 1, 1)
        wait_ready(net, "an allocator", "app.kubernetes.io/name=gpuslice-dra-allocator", 1, 1)
    assert res.returncode == 0, res.stdout + res.stderr


def _uninstall_dra(net: NodeEnv, how: str, helm: str) -> None:
    if how == "kubectl":
        for folder in (DEPLOY / "dra-allocator", DEPLOY / "overlays" / "dra-fake-gpus"):
            net.dev.kubectl("delete", "-k", str(folder), "--ignore-not-found", "--wait=true",
                            "--timeout=180s", timeout_s=200)
    else:
        res = subprocess.run([helm, "uninstall", "gpuslice", "-n", NS, "--wait", "--timeout",
                              "120s", "--kubeconfig", str(net.dev.kubeconfig)],
                             capture_output=True, text=True, timeout=200, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
    # the next install's driver must publish its own slices (the test waits for them)
    net.dev.kubectl("delete", "resourceslices", "--field-selector",
                    f"spec.nodeName={net.node.name}", "--ignore-not-found")


@pytest.mark.parametrize("how", ["kubectl", "helm"])
def test_dra_install_on_the_real_node_allocates_and_prepares_a_share(
        net: NodeEnv, image: dict[str, Any], helm: str, how: str) -> None:
    """deploy/dra (through deploy/overlays/dra-fake-gpus: two stand-in GPUs) and
    deploy/dra-allocator from the built image, applied with kubectl, or the Helm chart with
    ``path=dra`` and ``dra.fakeGpus=2`` (one ``helm install``): the driver DaemonSet runs as a
    real pod (root, the kubelet's plugin folders), registers and publishes the node's slices;
    the claim allocator allocates the example's quarter-GPU claim on Kubernetes 1.36 (its
    resourceclaims/binding right); the kubelet prepares it and the container reads its caps.
    Each install is removed afterwards, so that the next one starts from a bare node."""
    net.node.ctr("images", "import", image["archive"])
    _install_dra(net, image, how, helm)
    try:
        _allocates_and_prepares(net)
    finally:
        _uninstall_dra(net, how, helm)


def _allocates_and_prepares(net: NodeEnv) -> None:
    def published() -> bool:
        items = kubectl_json(net, "get", "resourceslices")["items"]
        return any(s["spec"].get("nodeName") == net.node.name for s in items)

    try:
        wait_until("the driver pod's ResourceSlices", published, 180, every_s=1.0)
    except Exception as exc:
        wait_ready(net, str(exc), "app=gpuslice-dra-driver", 1, 1)
        raise
    wait_ready(net, "an allocator", "app.kubernetes.io/name=gpuslice-dra-allocator")
    net.dev.apply(DEPLOY / "dra" / "examples")
    logs = ""

    def reported() -> bool:
        nonlocal logs
        logs = net.dev.kubectl("logs", "-n", "default", "inference-quarter", check=False).stdout
        return "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in logs

    try:
        wait_until("the quarter-GPU example's caps", reported, 180, every_s=1.0)
    except Exception as exc:
        out = net.dev.kubectl("describe", "pod", "-n", "default", "inference-quarter",
                              check=False).stdout[-3000:]
        alloc = net.dev.kubectl("logs", "-n", NS, "-l",
                                "app.kubernetes.io/name=gpuslice-dra-allocator", "--tail=30",
                                check=False).stdout[-3000:]
        drv = net.dev.kubectl("logs", "-n", NS, "-l", "app=gpuslice-dra-driver", "--tail=30",
                              check=False).stdout[-3000:]
        raise AssertionError(f"{exc}\n{out}\n--- allocator\n{alloc}\n--- driver\n{drv}") from None
    env = dict(line.split("=", 1) for line in logs.splitlines() if "=" in line)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", logs
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    claims = kubectl_json(net, "get", "resourceclaims", "-n", "default")["items"]
    quarter = next(c for c in claims if c["metadata"]["name"].startswith("inference-quarter"))
    assert quarter["status"]["allocation"]["devices"]["results"][0]["driver"] == "gpu.gpuslice.io"
    # the allocator placed it: its log names the claim (kube-scheduler cannot: the slices carry
    # the allocator's taint while its Lease is fresh)
    alloc = net.dev.kubectl("logs", "-n", NS, "-l",
                            "app.kubernetes.io/name=gpuslice-dra-allocator", "--tail=200",
                            check=False).stdout
    assert quarter["metadata"]["name"] in alloc, alloc[-2000:]
    net.dev.kubectl("delete", "-k", str(DEPLOY / "dra" / "examples"), "--wait=true",
                    "--timeout=120s", timeout_s=150)
