"""Plans that deploy as they are (issue 51): ``gpuslice plan --out`` and ``gpuslice router
--export istio`` applied unedited to the real control plane. Every exported replica is created
by the real ReplicaSet controller and bound by the gpuslice scheduler and extender to its
slice (the plan's milli and memory in its signed assignment), and every Istio subset
selects, among its Service's pods, exactly the replicas on that GPU model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from gpuslice.core.assignment import verify
from gpuslice.devcluster import DevCluster
from tests.cluster.conftest import run_gpuslice
from tests.cluster.helpers import EXTENDER_KEY, Kube, assignment, bound, gpu_node

# DestinationRule and VirtualService as Istio serves them (networking.istio.io/v1), their
# schema left open: what is checked is the export's own selection, not Istio's validation
ISTIO_KINDS = (("DestinationRule", "destinationrules"), ("VirtualService", "virtualservices"))


def _istio_crds() -> str:
    return yaml.safe_dump_all([{
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.networking.istio.io"},
        "spec": {"group": "networking.istio.io", "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                           "listKind": f"{kind}List"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                     "openAPIV3Schema": {"type": "object",
                                         "x-kubernetes-preserve-unknown-fields": True}}}]},
    } for kind, plural in ISTIO_KINDS])


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_an_exported_plan_and_its_istio_export_apply_and_bind_unedited(
        dev: DevCluster, kube: Kube, group: str, tmp_path: Path) -> None:
    out = tmp_path / "plan"
    res = run_gpuslice("plan", "--example", "--out", str(out), "--namespace", group)
    assert res.returncode == 0, res.stderr
    res = run_gpuslice("router", "--plan", str(out / "plan.json"), "--export", "istio",
                       "--namespace", group)
    assert res.returncode == 0, res.stderr
    istio = json.loads(res.stdout)["items"]
    manifests = [d for d in yaml.safe_load_all((out / "manifests.yaml").read_text()) if d]
    deployments = [d for d in manifests if d["kind"] == "Deployment"]
    models = {d["spec"]["template"]["metadata"]["annotations"]["gpuslice.io/gpu-model"]
              for d in deployments}
    kube.add_nodes([gpu_node(f"{group}-{i}", group, m, count=2)
                    for i, m in enumerate(sorted(models))])
    dev.apply(_istio_crds())
    crds = [f"crd/{p}.networking.istio.io" for _, p in ISTIO_KINDS]
    try:
        dev.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
        dev.kubectl("apply", "-f", str(out / "manifests.yaml"))  # as a user would, unedited
        dev.kubectl("apply", "-f", "-", input=res.stdout)
        _check(dev, kube, group, deployments, istio)
    finally:
        dev.kubectl("delete", *crds, "--wait=false", check=False)


def _check(dev: DevCluster, kube: Kube, group: str, deployments: list[dict[str, Any]],
           istio: list[dict[str, Any]]) -> None:

    pods = kube.wait_bound(group, len(deployments), timeout_s=180)
    by_replica: dict[str, dict[str, Any]] = {p["metadata"]["labels"]["gpuslice.io/replica"]: p
                                             for p in bound(pods)}
    for d in deployments:
        p = by_replica[d["metadata"]["name"]]
        a = assignment(p)
        assert verify(a, EXTENDER_KEY.encode()) and a.node == p["spec"]["nodeName"]
        (share,) = a.containers[0].gpus
        limits = d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert (share.milli, share.memory_mib) == (int(limits["gpuslice.io/gpu-milli"]),
                                                   int(limits["gpuslice.io/gpu-memory"]))
        assert p["metadata"]["annotations"]["gpuslice.io/processes"]

    services = {s["metadata"]["name"]: s["spec"]["selector"] for s in (
        json.loads(dev.kubectl("get", "services", "-n", group, "-o", "json").stdout)["items"])}
    rules = [i for i in istio if i["kind"] == "DestinationRule"]
    assert rules
    for rule in rules:
        host = rule["spec"]["host"]
        service = host.split(".")[0]
        assert host == f"{service}.{group}.svc.cluster.local" and service in services, host
        members = [p for p in bound(pods) if _selects(services[service],
                                                      p["metadata"]["labels"])]
        for subset in rule["spec"]["subsets"]:
            chosen = {p["metadata"]["name"] for p in members
                      if _selects(subset["labels"], p["metadata"]["labels"])}
            model = subset["labels"]["gpuslice.io/gpu-model"]
            want = {p["metadata"]["name"] for p in members
                    if p["metadata"]["annotations"]["gpuslice.io/gpu-model"] == model}
            assert chosen and chosen == want, (service, subset)
    # what Istio was given is what was exported
    got = json.loads(dev.kubectl("get", "destinationrules.networking.istio.io", "-n", group,
                                 "-o", "json").stdout)["items"]
    assert {r["metadata"]["name"] for r in got} == {r["metadata"]["name"] for r in rules}
