"""deploy/ renders with kubectl's built-in kustomize and every object validates against the
Kubernetes schemas (kubernetes-validate ships them; no cluster needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["dev", "production"]
K8S_VERSION = "1.32"


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("kubectl is needed to render deploy/ under CI")
        pytest.skip("kubectl not installed: cannot render deploy/ with kustomize")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / "overlays" / overlay)],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    docs = render(overlay)
    assert len(docs) >= 15
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_is_least_privilege(overlay: str) -> None:
    for d in render(overlay):
        if d["kind"] in ("ClusterRole", "Role"):
            for rule in d["rules"]:
                assert "*" not in rule["verbs"] and "*" not in rule["resources"], d["metadata"]
                assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & \
                    set(rule["verbs"]), d["metadata"]


def packing_profile(profile: dict[str, Any]) -> None:
    """The gpuslice-scheduler profile packs (issue 26): kube-scheduler's smallest window of
    feasible nodes (100) reaches the extender (issue 28: the simulator's model of this path,
    sim/deployed.py, replays with the same window), the spreading scores are off (their
    filters stay), and no system-default topology spreading; explicit constraints are kept
    (defaultingType List)."""
    from gpuslice.sim.deployed import NODES_TO_SCORE

    assert profile["schedulerName"] == "gpuslice-scheduler"
    assert profile["percentageOfNodesToScore"] == NODES_TO_SCORE == 1
    off = {p["name"] for p in profile["plugins"]["score"]["disabled"]}
    assert off == {"NodeResourcesFit", "NodeResourcesBalancedAllocation", "ImageLocality"}
    assert "filter" not in profile["plugins"]
    spread = next(c for c in profile["pluginConfig"] if c["name"] == "PodTopologySpread")
    assert spread["args"] == {"defaultingType": "List", "defaultConstraints": []}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_install_path_schedules_with_the_packing_profile(overlay: str, tmp_path: Any
                                                              ) -> None:
    cm = next(d for d in render(overlay) if d["kind"] == "ConfigMap"
              and d["metadata"]["name"] == "gpuslice-scheduler-config")
    packing_profile(yaml.safe_load(cm["data"]["config.yaml"])["profiles"][0])
    # the dev cluster's kube-scheduler runs deploy/base's profile, beside a default one
    from gpuslice.devcluster import scheduler_config

    cfg = scheduler_config(ROOT / "deploy" / "base" / "scheduler-config.yaml",
                           tmp_path / "kubeconfig", "http://127.0.0.1:1", None)
    packing_profile(cfg["profiles"][0])
    assert cfg["profiles"][1] == {"schedulerName": "default-scheduler"}


def test_scheduler_profile_uses_the_extender_without_touching_the_default_scheduler() -> None:
    docs = render("dev")
    cm = next(d for d in docs if d["kind"] == "ConfigMap"
              and d["metadata"]["name"] == "gpuslice-scheduler-config")
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    assert [p["schedulerName"] for p in cfg["profiles"]] == ["gpuslice-scheduler"]
    ext = cfg["extenders"][0]
    assert ext["nodeCacheCapable"] is True and ext["bindVerb"] == "bind"
    # every verb the scheduler is told to call is a route the extender serves
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.services.extender import ExtenderState, make_app

    app = make_app(ExtenderState(FakeApiServer(), b"k" * 16, clock=lambda: "t"))
    served = {r.resource.canonical.strip("/") for r in app.router.routes()
              if r.method == "POST" and r.resource is not None}
    verbs = {ext[k] for k in ("filterVerb", "prioritizeVerb", "preemptVerb", "bindVerb")}
    assert verbs <= served, (verbs, served)
    packing_profile(cfg["profiles"][0])
    managed = {m["name"]: m["ignoredByScheduler"] for m in ext["managedResources"]}
    # gpu-milli and gpu-memory are counted by the scheduler too (the node agent publishes the
    # node's totals), so its preemption sees share and memory contention (a node where its dry
    # run needs no victim is never offered to the extender's preempt: preemption.go)
    assert managed == {"gpuslice.io/gpu": False, "gpuslice.io/gpu-milli": False,
                       "gpuslice.io/gpu-memory": False}
    def wants_gpu(d: dict[str, Any]) -> bool:
        return any("gpuslice.io/gpu" in ((c.get("resources") or {}).get("limits") or {})
                   for c in d["spec"]["template"]["spec"]["containers"])

    examples = [d for d in docs if d["kind"] in ("Deployment", "Job")
                and d["metadata"].get("namespace") == "default"]
    # fractional, mig-sized, multi-gpu (the router is not one; the generative examples are
    # applied on their own, tests/deploy/test_generative_examples.py)
    assert len([d for d in examples if wants_gpu(d)]) == 3
    for d in examples:  # GPU workloads go through the gpuslice scheduler, the router does not
        assert (d["spec"]["template"]["spec"].get("schedulerName") == "gpuslice-scheduler") \
            == wants_gpu(d), d["metadata"]["name"]


def test_production_carries_no_key_and_pins_the_image() -> None:
    docs = render("production")
    assert not [d for d in docs if d["kind"] == "Secret"]
    images = {c["image"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    env = dict(line.split("=", 1) for line in (ROOT / "deploy" / "image.env").read_text()
               .splitlines() if line and not line.startswith("#"))
    pinned = f"{env['IMAGE_REPOSITORY']}:{env['IMAGE_TAG']}@{env['IMAGE_DIGEST']}"
    assert {i for i in images if "gpuslice" in i.rsplit("/", 1)[-1]} == {pinned}


def _agent_exposition() -> str:
    """Every metric the node agent exports (its own and its usage measurement's: labelled
    gauges show their HELP and TYPE lines before any sample)."""
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.services.node_agent import AgentMetrics
    from gpuslice.services.pod_usage import PodUsage

    metrics = AgentMetrics()
    PodUsage("n", FakeNvml([]), FakeApiServer(), metrics.registry)
    return metrics.render().decode()


def test_the_alerts_are_rules_on_metrics_the_agent_exports() -> None:
    """deploy/prometheus/gpuslice-alerts.yaml: a PrometheusRule whose every rule has an
    alert name, an expression naming only exported metrics, a severity and a summary."""
    import re

    doc = yaml.safe_load((ROOT / "deploy" / "prometheus" / "gpuslice-alerts.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    exported = _agent_exposition()
    rules = [r for g in doc["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"GpuslicePodNearMemoryCap",
                                            "GpuslicePodProcessesOverDeclared",
                                            "GpusliceMpsDaemonRestarted", "GpusliceMpsHostDown"}
    for r in rules:
        names = re.findall(r"gpuslice_[a-z_]+", r["expr"])
        assert names and all(f"# TYPE {n} " in exported for n in names), (r["alert"], names)
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"]
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]


def test_grafana_dashboard_queries_metrics_the_code_exports() -> None:
    import json
    import re


    dash = json.loads((ROOT / "deploy" / "grafana" / "gpuslice.json").read_text())
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.services.extender import ExtenderState
    from gpuslice.services.extender.metrics import ExtenderMetrics

    exported = _agent_exposition()
    state = ExtenderState(FakeApiServer(), b"k" * 16, clock=lambda: "t")
    extender = ExtenderMetrics(state)
    for verb in ("filter", "bind"):  # labelled series appear once used
        extender.seconds.labels(verb).observe(0.001)
    extender.filtered(0, {"n": "node has no GPU"})
    exported += extender.exposition().decode()
    router = (ROOT / "src" / "gpuslice" / "adapters" / "http" / "metrics.py").read_text()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"gpuslice_[a-z_]+", target["expr"]):
                base = re.sub(r"_(bucket|total|sum|count)$", "", name)
                assert base in exported or f'"{base}"' in router, name
            # the legend names only labels the query keeps (an aggregation keeps its "by")
            labels = re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", ""))
            aggs = re.findall(r"\b(?:sum|count|avg|min|max)\s*(?:by\s*\(([^)]*)\))?\s*\(",
                              target["expr"])
            if labels and aggs:
                kept = {x.strip() for x in aggs[0].split(",") if x.strip()}
                assert set(labels) <= kept, (panel["title"], labels, kept)


def test_the_slice_schedule_crd_and_its_example() -> None:
    from gpuslice.core.reconfig import parse_schedule, target_layout

    docs = render("dev")
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "sliceschedules.gpuslice.io"
    assert "namespace" not in crd["metadata"]  # cluster-scoped
    example = yaml.safe_load((ROOT / "deploy" / "examples" / "day-night.yaml").read_text())
    assert example["apiVersion"] == f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
    sched = parse_schedule(example)
    assert target_layout(sched, 12 * 60) == "inference"
    assert target_layout(sched, 23 * 60) == "batch"
    role = next(d for d in docs if d["kind"] == "ClusterRole"
                and d["metadata"]["name"] == "gpuslice-reconfig")
    assert {"resources": ["pods/eviction"], "verbs": ["create"], "apiGroups": [""]} in \
        role["rules"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_gpuslice_container_runs_a_command_line_the_cli_accepts(overlay: str) -> None:
    """The manifests and the CLI must not drift apart (a renamed or dropped flag would
    crash-loop the pod): each gpuslice container's args parse, and the service account
    it runs as exists."""
    from gpuslice.cli import _build_parser

    docs = render(overlay)
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    seen = set()
    for d in docs:
        spec = ((d.get("spec") or {}).get("template") or {}).get("spec")
        if not spec:
            continue
        for c in spec["containers"]:
            if not c["image"].rsplit("/", 1)[-1].startswith("gpuslice:") or c.get("command"):
                continue
            args = _build_parser().parse_args(c["args"])
            seen.add(args.command)
            # one that talks to no API server (the MPS host) mounts no token instead
            assert spec.get("serviceAccountName") in accounts or \
                spec.get("automountServiceAccountToken") is False, d["metadata"]["name"]
    assert {"extender", "node-agent", "reconfig", "mps-host"} <= seen


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_mps_daemons_live_in_a_daemonset_upgrades_do_not_roll(overlay: str) -> None:
    """The node agent asks (--mps-host), the MPS host starts the daemons in its own pod:
    rolled by no upgrade (OnDelete), with the agent's pipe directory, the shm directory the
    clients get at /dev/shm, and the host's PIDs; the agent reads the host's /proc too."""
    from gpuslice.cli import _build_parser

    obj = {(d["kind"], d["metadata"]["name"]): d for d in render(overlay)}
    host = obj[("DaemonSet", "gpuslice-mps-host")]
    agent = obj[("DaemonSet", "gpuslice-node-agent")]
    assert host["spec"]["updateStrategy"] == {"type": "OnDelete"}
    hspec, aspec = host["spec"]["template"]["spec"], agent["spec"]["template"]["spec"]
    assert hspec["hostPID"] is True and aspec["hostPID"] is True
    assert hspec["nodeSelector"] == aspec["nodeSelector"]
    (hc,), (ac,) = hspec["containers"], aspec["containers"]
    hargs, aargs = _build_parser().parse_args(hc["args"]), _build_parser().parse_args(ac["args"])
    assert aargs.mps_host and str(hargs.mps_pipe_dir) == aargs.mps_pipe_dir
    assert "limits" not in hc.get("resources", {})  # an OOM kill would take every client
    vols = {v["name"]: v["hostPath"]["path"] for v in hspec["volumes"]}
    mounts = {m["mountPath"]: vols[m["name"]] for m in hc["volumeMounts"]}
    assert mounts["/dev/shm"] == aargs.mps_shm_dir
    assert mounts[aargs.mps_pipe_dir] == aargs.mps_pipe_dir


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_node_agents_dev_shm_is_the_directory_mps_clients_get(overlay: str) -> None:
    """MPS clients and their control daemon exchange shared memory through /dev/shm; the
    device plugin mounts ``--mps-shm-dir`` (a host path) at /dev/shm in every MPS client, so
    the node agent, parent of the daemons, must have that same host directory as its own
    /dev/shm (NVIDIA's device plugin: a shm directory shared by daemon and clients)."""
    from gpuslice.cli import _build_parser

    (ds,) = [d for d in render(overlay) if d["kind"] == "DaemonSet"
             and d["metadata"]["name"].endswith("node-agent")]
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args = _build_parser().parse_args(c["args"])
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["hostPath"]["path"] == args.mps_shm_dir != ""
    assert not mount.get("readOnly")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_node_agent_can_tell_an_uninstall_and_undo_what_it_published(overlay: str) -> None:
    """On SIGTERM the agent reads its own pod (the downward API names it) and that pod's
    DaemonSet, in its own namespace only, and on uninstall removes its resources with a JSON
    patch of nodes/status; it empties the MPS shm folder under its host path, mounted there
    as well as at /dev/shm (issue 27)."""
    from gpuslice.cli import _build_parser

    docs = render(overlay)
    obj = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    ds = obj[("DaemonSet", "gpuslice-node-agent")]
    ns = ds["metadata"]["namespace"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]
           if "valueFrom" in e}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_NAME": "metadata.name",
                   "POD_NAMESPACE": "metadata.namespace"}
    args = _build_parser().parse_args(c["args"])
    shm = {m["mountPath"] for m in c["volumeMounts"] if m["name"] == "mps-shm"}
    assert shm == {"/dev/shm", args.mps_shm_dir}
    sa = {"kind": "ServiceAccount", "name": "gpuslice-node-agent", "namespace": ns}
    grants: set[tuple[str, str, str, str]] = set()  # (scope, group, resource, verb)
    for b in docs:
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding") and sa in b["subjects"]:
            scope = b["metadata"].get("namespace", "") if b["kind"] == "RoleBinding" else "*"
            for rule in obj[(b["roleRef"]["kind"], b["roleRef"]["name"])]["rules"]:
                assert not rule.get("resourceNames")
                grants |= {(scope, g, r, v) for g in rule["apiGroups"]
                           for r in rule["resources"] for v in rule["verbs"]}
    assert {(ns, "apps", "daemonsets", "get"), (ns, "", "pods", "get"),
            ("*", "", "nodes/status", "patch"), ("*", "", "nodes", "patch")} <= grants
    # nothing more on DaemonSets, nowhere else
    assert {g for g in grants if g[2] == "daemonsets"} == {(ns, "apps", "daemonsets", "get")}
    assert not {g for g in grants if g[2] == "pods" and g[3] == "get" and g[0] != ns}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_extender_service_reaches_the_leader_while_every_replica_is_ready(
        overlay: str) -> None:
    """Readiness is health, not leadership (both replicas Ready: rollouts and ``helm
    --wait`` finish): the Service selects the label the leader puts on its own pod, which no
    pod template carries; the Deployment rolls an ordinary update, a new pod Ready before an
    old one goes; the pod knows its name and namespace (the downward API) and the extender's
    account may get and patch pods in its own namespace (its label), patch pods elsewhere only
    through its ClusterRole (the requeue annotation) and never update, create or delete
    them."""
    from gpuslice.services.extender import LEADER_LABEL

    docs = render(overlay)
    obj = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    deploy = obj[("Deployment", "gpuslice-extender")]
    svc = obj[("Service", "gpuslice-extender")]
    template = deploy["spec"]["template"]
    assert svc["spec"]["selector"] == {**deploy["spec"]["selector"]["matchLabels"],
                                       LEADER_LABEL: "leader"}
    assert LEADER_LABEL not in template["metadata"]["labels"]
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (c,) = template["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"

    ns = deploy["metadata"]["namespace"]
    bound = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
             and {"kind": "ServiceAccount", "name": "gpuslice-extender", "namespace": ns}
             in d["subjects"]]
    grants: dict[str, set[tuple[str, str]]] = {}  # verb on pods -> (kind, namespace) granting
    for b in bound:
        role = obj[(b["roleRef"]["kind"], b["roleRef"]["name"])]
        for rule in role["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"] and \
                    not rule.get("resourceNames"):
                for verb in rule["verbs"]:
                    grants.setdefault(verb, set()).add(
                        (b["kind"], b["metadata"].get("namespace", "")))
    # patch: its own pod's leader label (its namespace), and cluster-wide the requeue
    # annotation on a pending pod its filter refused (services/extender/requeue.py)
    assert grants["patch"] == {("RoleBinding", ns), ("ClusterRoleBinding", "")}
    assert ("RoleBinding", ns) in grants["get"]
    assert not {"update", "delete", "create"} & set(grants)
