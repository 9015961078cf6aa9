"""deploy/ as issue 56's day-two behaviour needs it: the reconfiguration controller leads
through a Lease it may hold, asks the routers of a Service that exposes their admin port, may
write its finalizer and read EndpointSlices (kustomize and Helm alike); the router example
waits out its endpoint's removal and its requests in flight within the pod's grace period, and
may list the pods marked draining; the SliceSchedule CRD takes the readiness limit the code
validates."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gpuslice.core.reconfig import MAX_DRAIN_S, MAX_READY_S
from tests.deploy.test_helm_chart import rendered
from tests.deploy.test_manifests import OVERLAYS, ROOT, render


def _controller(docs: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
    from gpuslice.cli import _build_parser

    dep = next(d for d in docs if d["kind"] == "Deployment"
               and d["metadata"]["name"] == "gpuslice-reconfig")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return _build_parser().parse_args(c["args"]), c


def _rules(docs: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    return [r for d in docs if d["kind"] == kind and d["metadata"]["name"] == name
            for r in d["rules"]]


def _allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               for r in rules)


def _check_controller(docs: list[dict[str, Any]], namespace: str) -> None:
    args, c = _controller(docs)
    assert args.leader_elect and args.lease == f"{namespace}/gpuslice-reconfig"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in \
        c["env"]
    assert args.routers == ["default/gpuslice-router"] and args.router_admin_port == "admin"
    cluster = _rules(docs, "ClusterRole", "gpuslice-reconfig")
    for resource in ("sliceschedules", "sliceschedules/finalizers"):
        assert _allows(cluster, "gpuslice.io", resource, "update"), resource
    assert _allows(cluster, "discovery.k8s.io", "endpointslices", "list")
    lease = _rules(docs, "Role", "gpuslice-reconfig-leader-election")
    assert all(_allows(lease, "coordination.k8s.io", "leases", v)
               for v in ("get", "create", "update"))
    role = next(d for d in docs if d["kind"] == "Role"
                and d["metadata"]["name"] == "gpuslice-reconfig-leader-election")
    assert role["metadata"].get("namespace", namespace) == namespace


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_controller_leads_through_its_lease_and_asks_the_routers(overlay: str) -> None:
    _check_controller(render(overlay), "gpuslice-system")


def test_the_charts_controller_does_the_same() -> None:
    _check_controller(rendered(), "gpuslice-system")


def test_the_router_example_covers_its_delay_and_grace_and_exposes_its_admin_port() -> None:
    from gpuslice.cli import _build_parser

    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "examples" / "router.yaml")
                                          .read_text()) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args = _build_parser().parse_args(c["args"])
    assert args.shutdown_delay > 0 and args.shutdown_grace > 0
    # the kubelet's SIGKILL comes terminationGracePeriodSeconds after SIGTERM
    assert spec["terminationGracePeriodSeconds"] >= args.shutdown_delay + args.shutdown_grace
    assert dep["spec"]["replicas"] >= 2
    svc = next(d for d in docs if d["kind"] == "Service"
               and d["metadata"]["name"] == "gpuslice-router")
    admin = next(p for p in svc["spec"]["ports"] if p["name"] == "admin")
    port = next(p for p in c["ports"] if p["name"] == admin["targetPort"])
    assert port["containerPort"] == int(args.admin.rpartition(":")[2])
    role = _rules(docs, "Role", "gpuslice-router")
    assert _allows(role, "", "pods", "list") and not _allows(role, "", "pods", "get")


@pytest.mark.parametrize("path", ["deploy/base/crd-slice-schedule.yaml",
                                  "deploy/helm/gpuslice/templates/crd-slice-schedule.yaml"])
def test_the_crd_takes_the_time_limits_the_controller_validates(path: str) -> None:
    text = (ROOT / path).read_text()
    body = text[text.index("spec:\n  group"):]  # the Helm copy's labels are templated
    spec = yaml.safe_load(body)["spec"]
    props = spec["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert props["readyTimeoutSeconds"]["maximum"] == MAX_READY_S
    assert props["drainTimeoutSeconds"]["maximum"] == MAX_DRAIN_S
    for key in ("readyTimeoutSeconds", "drainTimeoutSeconds"):
        assert props[key]["type"] == "number" and props[key]["minimum"] == 1
