"""deploy/ against the real kube-apiserver: the manifests applied with ``kubectl apply
--server-side`` (again: no conflict, nothing changes), the RBAC least-privilege (what each
component does is allowed, a step beyond is refused with 403), the SliceSchedule CRD's schema,
status subresource and printer columns, the reconfiguration controller as a process on its own
service account, and ``kubectl gpuslice`` through the real kubectl."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.devcluster import DevCluster, wait_until
from tests.cluster.conftest import DEPLOY, run_gpuslice
from tests.cluster.helpers import EXTENDER_KEY, ExtenderProcess, Kube, gpu_node, gpu_pod

SYSTEM = "gpuslice-system"


def test_deploy_base_applies_server_side_and_reapplies_without_change(dev: DevCluster) -> None:
    out = dev.apply(DEPLOY / "base")  # the session applied it once already
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines and all(ln.endswith("serverside-applied") for ln in lines), out
    managed = json.loads(dev.kubectl("get", "clusterrole", "gpuslice-extender", "-o", "json",
                                     "--show-managed-fields").stdout)
    assert any(m.get("operation") == "Apply" and m.get("manager") == "kubectl"
               for m in managed["metadata"]["managedFields"])
    # a field owned by kubectl's apply and changed by another manager: a real conflict
    res = dev.kubectl("apply", "--server-side", "--field-manager=someone-else", "-f", "-",
                      input="apiVersion: v1\nkind: ServiceAccount\nmetadata:\n"
                      f"  name: gpuslice-extender\n  namespace: {SYSTEM}\n"
                      "  labels: {app.kubernetes.io/part-of: other}\n", check=False)
    assert res.returncode != 0 and "conflict" in res.stderr.lower(), res.stderr


def _can(dev: DevCluster, account: str, verb: str, resource: str,
         namespace: str = "default") -> bool:
    """``resource`` may name a subresource (pods/binding): can-i takes it as a flag (its
    TYPE/NAME argument names an object)."""
    kind, _, sub = resource.partition("/")
    res = dev.kubectl("auth", "can-i", verb, kind, "-n", namespace,
                      *([f"--subresource={sub}"] if sub else []),
                      f"--as=system:serviceaccount:{SYSTEM}:{account}", check=False)
    return res.stdout.strip() == "yes"


@pytest.mark.parametrize(("account", "verb", "resource", "namespace", "allowed"), [
    ("gpuslice-extender", "get", "pods", "ml", True),
    # the assignment rides on the Binding; patch anywhere is the requeue annotation on a pending
    # pod the filter refused (services/extender/requeue.py)
    ("gpuslice-extender", "patch", "pods", "ml", True),
    ("gpuslice-extender", "patch", "pods", SYSTEM, True),  # the leader labels its own pod
    ("gpuslice-extender", "get", "pods", SYSTEM, True),
    ("gpuslice-extender", "update", "pods", SYSTEM, False),
    ("gpuslice-extender", "delete", "pods", SYSTEM, False),
    ("gpuslice-extender", "create", "pods/binding", "ml", True),
    ("gpuslice-extender", "watch", "nodes", "default", True),
    ("gpuslice-extender", "update", "leases", SYSTEM, True),
    ("gpuslice-extender", "update", "leases", "kube-system", False),
    ("gpuslice-extender", "delete", "pods", "ml", False),
    ("gpuslice-extender", "patch", "nodes", "default", False),
    ("gpuslice-extender", "get", "secrets", SYSTEM, False),
    ("gpuslice-extender", "list", "poddisruptionbudgets.policy", "ml", True),
    ("gpuslice-extender", "create", "poddisruptionbudgets.policy", "ml", False),
    ("gpuslice-node-agent", "patch", "nodes", "default", True),
    ("gpuslice-node-agent", "list", "pods", "ml", True),
    ("gpuslice-node-agent", "watch", "pods", "ml", False),
    ("gpuslice-node-agent", "create", "pods/binding", "ml", False),
    # on SIGTERM: its own pod and DaemonSet (an uninstall?), then its node's resources off
    ("gpuslice-node-agent", "get", "daemonsets.apps", SYSTEM, True),
    ("gpuslice-node-agent", "get", "daemonsets.apps", "ml", False),
    ("gpuslice-node-agent", "delete", "daemonsets.apps", SYSTEM, False),
    ("gpuslice-node-agent", "get", "pods", SYSTEM, True),
    ("gpuslice-node-agent", "get", "pods", "ml", False),
    ("gpuslice-node-agent", "patch", "nodes/status", "default", True),
    ("gpuslice-reconfig", "create", "pods/eviction", "ml", True),
    ("gpuslice-reconfig", "update", "sliceschedules.gpuslice.io/status", "ml", True),
    ("gpuslice-reconfig", "update", "sliceschedules.gpuslice.io", "ml", True),  # finalizer
    ("gpuslice-reconfig", "patch", "sliceschedules.gpuslice.io", "ml", False),
    ("gpuslice-reconfig", "delete", "pods", "ml", False),
    ("gpuslice-scheduler", "create", "pods/binding", "ml", True),
    # the admission webhook reads the nodes' GPU inventories, and nothing else
    ("gpuslice-webhook", "list", "nodes", "default", True),
    ("gpuslice-webhook", "watch", "nodes", "default", False),
    ("gpuslice-webhook", "patch", "nodes", "default", False),
    ("gpuslice-webhook", "get", "pods", "ml", False),
    ("gpuslice-webhook", "get", "secrets", SYSTEM, False),
])
def test_rbac_allows_each_components_calls_and_nothing_beyond(
        dev: DevCluster, account: str, verb: str, resource: str, namespace: str,
        allowed: bool) -> None:
    assert _can(dev, account, verb, resource, namespace) is allowed


def test_a_forbidden_call_on_a_service_account_token_is_refused_with_403(
        dev: DevCluster, kube: Kube, tmp_path: Path) -> None:
    """Not only can-i: real requests on the extender's token, through kubectl."""
    kc = dev.service_account_kubeconfig(SYSTEM, "gpuslice-extender", tmp_path / "ext.kc")
    assert dev.kubectl("get", "nodes", kubeconfig=kc).returncode == 0
    res = dev.kubectl("delete", "pod", "anything", "-n", "default", kubeconfig=kc, check=False)
    assert res.returncode != 0 and "forbidden" in res.stderr.lower(), res.stderr
    res = dev.kubectl("get", "secrets", "-n", SYSTEM, kubeconfig=kc, check=False)
    assert res.returncode != 0 and "forbidden" in res.stderr.lower(), res.stderr


def test_the_scheduler_account_can_hold_its_leader_election_lease(dev: DevCluster) -> None:
    """deploy/base runs kube-scheduler on the gpuslice-scheduler account with leader election
    on the Lease gpuslice-system/gpuslice-scheduler (scheduler-config.yaml)."""
    cfg = yaml.safe_load(yaml.safe_load(
        (DEPLOY / "base" / "scheduler-config.yaml").read_text())["data"]["config.yaml"])
    le = cfg["leaderElection"]
    assert le["leaderElect"] is True
    ns, name = le["resourceNamespace"], le["resourceName"]
    for verb in ("get", "update"):
        res = dev.kubectl("auth", "can-i", verb, f"leases/{name}", "-n", ns,
                          f"--as=system:serviceaccount:{SYSTEM}:gpuslice-scheduler",
                          check=False)
        assert res.stdout.strip() == "yes", f"{verb} leases/{name} in {ns}: {res.stdout}"


def _schedule(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceSchedule",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"gpuModels": ["A100-80GB"]},
                     "layouts": {"inference": {"mig": {"mig-devices": {"1g.10gb": 7}}},
                                 "batch": {"mig": {"mig-devices": {"7g.80gb": 1}}}},
                     "windows": [{"layout": "inference", "start": "08:00", "end": "20:00"}],
                     "default": "batch", "drainTimeoutSeconds": 1, **spec}}


def test_the_crd_schema_status_subresource_and_printer_columns(
        dev: DevCluster, kube: Kube, group: str) -> None:
    bad = _schedule("bad", group)
    bad["spec"]["windows"][0]["start"] = "8 o'clock"
    res = dev.kubectl("create", "-f", "-", input=json.dumps(bad), check=False)
    assert res.returncode != 0 and "spec.windows[0].start" in res.stderr, res.stderr
    empty = _schedule("empty", group)
    empty["spec"]["layouts"] = {}
    res = dev.kubectl("create", "-f", "-", input=json.dumps(empty), check=False)
    assert res.returncode != 0 and "spec.layouts" in res.stderr, res.stderr

    dev.kubectl("create", "-f", "-", input=json.dumps(_schedule("ok", group)))
    # status is a subresource: a write to the main resource does not change it
    patched = json.loads(dev.kubectl(
        "patch", "sliceschedule", "ok", "-n", group, "--type=merge", "-o", "json",
        "-p", json.dumps({"status": {"target": "forged"}})).stdout)
    assert "status" not in patched or patched["status"].get("target") != "forged"
    dev.kubectl("patch", "sliceschedule", "ok", "-n", group, "--subresource=status",
                "--type=merge", "-p", json.dumps({"status": {
                    "target": "batch", "summary": {"inTarget": 3, "gpus": 4},
                    "conditions": [{"type": "Ready", "status": "False",
                                    "reason": "Moving"}]}}))
    table = dev.kubectl("get", "sliceschedules", "-n", group).stdout.splitlines()
    # the CRD's columns after NAME (a CRD with its own columns has no AGE unless it lists one)
    assert table[0].split() == ["NAME", "TARGET", "IN", "TARGET", "GPUS", "READY"]
    assert table[1].split()[:5] == ["ok", "batch", "3", "4", "Moving"]
    short = dev.kubectl("get", "ssched", "-n", group, "-o", "name").stdout.split()
    assert short == ["sliceschedule.gpuslice.io/ok"]


def test_the_reconfiguration_controller_process_writes_status_on_its_account(
        dev: DevCluster, kube: Kube, group: str) -> None:
    """`gpuslice reconfig run --once` with the gpuslice-reconfig token: it reads the
    SliceSchedule and nodes and writes the status subresource (its RBAC allows no more)."""
    kube.add_nodes([gpu_node(f"{group}-a100", group, "A100-80GB", count=1, mig="7g.80gb@0")])
    dev.kubectl("create", "-f", "-", input=json.dumps(_schedule("nightly", group,
                                                                override="batch")))
    kc = dev.service_account_kubeconfig(SYSTEM, "gpuslice-reconfig")
    res = run_gpuslice("reconfig", "run", "--once", "--kubeconfig", str(kc), timeout_s=180)
    assert res.returncode == 0, res.stdout + res.stderr
    obj = json.loads(dev.kubectl("get", "sliceschedule", "nightly", "-n", group, "-o",
                                 "json").stdout)
    status = obj.get("status") or {}
    assert status.get("target") == "batch", (status, res.stdout)
    assert (status.get("summary") or {}).get("gpus", 0) >= 1, status
    table = dev.kubectl("get", "sliceschedules", "-n", group).stdout
    assert "batch" in table.splitlines()[1]


def test_kubectl_gpuslice_status_through_the_real_kubectl(
        dev: DevCluster, kube: Kube, extender: ExtenderProcess, group: str,
        tmp_path: Path) -> None:
    plugin = shutil.which("kubectl-gpuslice", path=str(Path(sys.executable).parent)) \
        or shutil.which("kubectl-gpuslice")
    if plugin is None:
        pytest.fail("kubectl-gpuslice is not installed (pip install -e .)")
    kube.add_nodes([gpu_node(f"{group}-t4", group, "T4", count=1)])
    kube.create([gpu_pod("shared-a", group, milli=300, memory=2048),
                 gpu_pod("shared-b", group, milli=200, memory=2048)])
    kube.wait_bound(group, 2)
    key = tmp_path / "key"
    key.write_text(EXTENDER_KEY)
    env = {**os.environ, "PATH": f"{Path(plugin).parent}{os.pathsep}{os.environ['PATH']}",
           "KUBECONFIG": str(dev.kubeconfig), "COLUMNS": "250"}
    import subprocess

    # kubectl allows no flag before a plugin's name: the kubeconfig comes from $KUBECONFIG
    plugins = subprocess.run([dev.bin("kubectl"), "plugin", "list"], env=env, text=True,
                             capture_output=True, timeout=60, check=False).stdout
    assert "kubectl-gpuslice" in plugins
    res = subprocess.run([dev.bin("kubectl"), "gpuslice", "status", "--key-file", str(key)],
                         env=env, text=True, capture_output=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    row = next(ln for ln in res.stdout.splitlines() if f"{group}-t4" in ln)
    assert row.split("│")[4].strip() == "500", res.stdout  # used milli: 300 + 200
    assert f"{group}/shared-a (300 mps)" in res.stdout, res.stdout
    assert f"{group}/shared-b (200 mps)" in res.stdout, res.stdout


def test_router_follows_real_endpointslices(dev: DevCluster, kube: Kube, group: str,
                                            tmp_path: Path) -> None:
    """`gpuslice router --endpointslices` reads the EndpointSlices that the real
    EndpointSlice controller writes for a Service, through `kubectl proxy` on a service
    account that has only deploy/examples/router.yaml's Role; a deleted pod leaves."""
    import subprocess
    import urllib.request

    from gpuslice.devcluster import free_port

    docs = [d for d in yaml.safe_load_all((DEPLOY / "examples" / "router.yaml").read_text())
            if d and d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    for d in docs:
        d["metadata"]["namespace"] = group
        for s in d.get("subjects") or []:
            s["namespace"] = group
    dev.apply(yaml.safe_dump_all(docs))
    sa = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    kube.add_nodes([gpu_node(f"{group}-n0", group, "L4", count=1)])
    backends = []
    for i in range(3):
        backends.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": f"model-{i}", "namespace": group,
                                      "labels": {"app": "model"}},
                         "spec": {"nodeSelector": {"gpuslice.test/group": group},
                                  "tolerations": [{"operator": "Exists"}],
                                  "terminationGracePeriodSeconds": 0,
                                  "containers": [{"name": "server", "image": "model:1",
                                                  "ports": [{"name": "http",
                                                             "containerPort": 8000}]}]}})
    kube.create(backends)
    dev.apply(yaml.safe_dump({"apiVersion": "v1", "kind": "Service",
                              "metadata": {"name": "model", "namespace": group},
                              "spec": {"selector": {"app": "model"}, "ports": [
                                  {"name": "http", "port": 80, "targetPort": "http"}]}}))
    kc = dev.service_account_kubeconfig(group, sa, tmp_path / "router.kc")
    pport, lport, aport = free_port(), free_port(), free_port()
    procs = [subprocess.Popen([dev.bin("kubectl"), f"--kubeconfig={kc}", "proxy",
                               f"--port={pport}", "--address=127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "router", "--endpointslices",
             f"{group}/model", "--kube-api", f"http://127.0.0.1:{pport}", "--port-name",
             "http", "--listen", f"127.0.0.1:{lport}", "--admin", f"127.0.0.1:{aport}",
             "--access-log", "off"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def replicas() -> set[str]:
            with urllib.request.urlopen(f"http://127.0.0.1:{aport}/replicas",
                                        timeout=5) as r:
                doc = json.loads(r.read())
            return {str(r["name"]) for svc in doc.values() for r in svc["replicas"]}

        def pod_ips() -> dict[str, str]:
            return {p["metadata"]["name"]: (p.get("status") or {}).get("podIP", "")
                    for p in kube.pods(group)}

        wait_until("router sees three replicas", lambda: replicas() == {
            "model-0", "model-1", "model-2"}, 180, procs[-1])
        assert all(ip.startswith("10.") for ip in pod_ips().values())
        kube.core.delete_namespaced_pod("model-1", group, grace_period_seconds=0)
        wait_until("router drops model-1", lambda: replicas() == {"model-0", "model-2"}, 120,
                   procs[-1])
    finally:
        for p in procs:
            p.terminate()
            p.wait(20)
