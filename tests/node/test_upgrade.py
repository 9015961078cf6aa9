"""Day two on the real node, with models serving: the Helm chart installed from the built image,
fake inference replicas on MPS slices (stand-in MPS clients: each exits as a CUDA process
does when its daemon goes) behind the router, open-loop load throughout, then in turn a
``helm upgrade`` to a new image revision (every gpuslice component rolls, and the second
scheduler's image too), ``kill -9`` of the node agent, a kubelet restart, a containerd restart
and ``kill -9`` of the extender leader. After each step: requests sent, failed and answered
5xx, the replicas' container restarts, and the MPS daemons' PIDs. Goal: 0 failed, 0 restarts,
the same daemons (they live in the MPS host's pod, which upgrades do not roll).

Also the multi-process rule on the real node: a pod declaring 4 processes runs 4 stand-in
clients, each held to a quarter of its memory; a pod running 2 while declaring none gets the
node agent's Warning event."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.devcluster import wait_until
from gpuslice.devcluster.realnode import KUBE_SCHEDULER
from gpuslice.kubectl_plugin import main as kubectl_gpuslice
from tests.node.conftest import DEPLOY, FIGURES
from tests.node.helpers import NodeEnv, kubectl_json, wait_ready
from tests.node.serving import MPS_ROOT, Load, Snapshot, kill_pod_process

NS = "gpuslice-system"
APP = "serving"
KEY = "node-tier-upgrade-key-0123456789abcdef012345678"
FAKE_GPUS = "gpus:\n  - model: L4\n  - model: L4\n"
REPLICAS = 3
SELECTOR = "app=llm"


def replica_deployment(image: str) -> dict[str, Any]:
    """Three fake model replicas on 40% MPS slices of 2 GiB (so on both GPUs: two daemons),
    each a stand-in MPS client for its whole life (it exits 1 when its daemon goes, as a CUDA
    process would)."""
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": APP},
        "spec": {"replicas": REPLICAS, "selector": {"matchLabels": {"app": "llm"}},
                 "template": {
                     "metadata": {"labels": {"app": "llm"}},
                     "spec": {
                         "schedulerName": "gpuslice-scheduler",
                         "terminationGracePeriodSeconds": 1,
                         "containers": [{
                             "name": "server", "image": image, "imagePullPolicy": "Never",
                             "command": ["python3", "-m", "gpuslice.adapters.http.fake_replica",
                                         "--host", "0.0.0.0", "--port", "8080",
                                         "--service-ms", "5", "--concurrency", "8",
                                         "--mps-client"],
                             "readinessProbe": {"httpGet": {"path": "/v2/health/ready",
                                                            "port": 8080},
                                                "periodSeconds": 2},
                             "resources": {"limits": {"gpuslice.io/gpu": "1",
                                                      "gpuslice.io/gpu-milli": "400",
                                                      "gpuslice.io/gpu-memory": "2048"}}}]}}}}


def clients_pod(name: str, image: str, processes: int, declared: int | None,
                memory: int, use: tuple[int, float] = (0, 0.0)) -> dict[str, Any]:
    """A pod of ``processes`` stand-in CUDA processes on an MPS slice of ``memory`` MiB;
    ``use``: the MiB and percent of SMs each process says it uses (what NVML lists)."""
    ann = {"gpuslice.io/processes": str(declared)} if declared is not None else {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": APP, "annotations": ann,
                     "labels": {"app": "clients"}},
        "spec": {"schedulerName": "gpuslice-scheduler", "terminationGracePeriodSeconds": 1,
                 "containers": [{
                     "name": "c", "image": image, "imagePullPolicy": "Never",
                     "command": ["python3", "-m", "gpuslice.adapters.mps.standin", "client",
                                 "--processes", str(processes), "--name", name,
                                 "--use-mib", str(use[0]), "--sm", str(use[1])],
                     "resources": {"limits": {"gpuslice.io/gpu": "1",
                                              "gpuslice.io/gpu-milli": "100",
                                              "gpuslice.io/gpu-memory": str(memory)}}}]}}


def helm_run(helm_bin: str, env: NodeEnv, verb: str, values: dict[str, Any]) -> None:
    vfile = env.dev.dir / f"values-{verb}.yaml"
    vfile.write_text(yaml.safe_dump(values))
    res = subprocess.run([helm_bin, verb, "gpuslice", str(DEPLOY / "helm" / "gpuslice"),
                          "-n", NS, "--create-namespace", "-f", str(vfile), "--kubeconfig",
                          str(env.dev.kubeconfig), "--wait", "--timeout", "5m"],
                         capture_output=True, text=True, timeout=400, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def images_of(env: NodeEnv, selector: str) -> set[str]:
    pods = kubectl_json(env, "get", "pods", "-n", NS, "-l", selector)["items"]
    return {c["image"] for p in pods if not p["metadata"].get("deletionTimestamp")
            for c in p["spec"]["containers"]}


def components_ready(env: NodeEnv) -> None:
    wait_ready(env, "the node agent", "app.kubernetes.io/name=gpuslice-node-agent")
    wait_ready(env, "both extenders", "app.kubernetes.io/name=gpuslice-extender", 2)
    wait_ready(env, "the extender leader",
               "app.kubernetes.io/name=gpuslice-extender,gpuslice.io/extender-role=leader")
    wait_ready(env, "the second scheduler", "app.kubernetes.io/name=gpuslice-scheduler")
    wait_ready(env, "the MPS host", "app.kubernetes.io/name=gpuslice-mps-host")


def kill_and_wait(env: NodeEnv, selector: str, needle: str) -> None:
    """SIGKILL a component's process (a crash, an OOM kill): its container restarts."""
    kill_pod_process(env, NS, selector, needle)
    time.sleep(2)


def clients_state(target: str) -> list[dict[str, Any]]:
    state = json.loads((MPS_ROOT / target / "fake-state.json").read_text())
    return list(state.get("clients") or [])


@pytest.fixture(autouse=True)
def _nothing_left_for_the_next(net: NodeEnv, helm: str) -> Iterator[None]:
    """What a test that failed half-way left (its replicas, the release, the MPS records of
    daemons that went with it) must not fail the next one: removed after each test, best
    effort (a no-op after a test that cleaned up itself)."""
    yield
    net.dev.kubectl("delete", "namespace", APP, "serving-dra", "--ignore-not-found",
                    "--wait=true", "--timeout=120s", check=False, timeout_s=150)
    subprocess.run([helm, "uninstall", "gpuslice", "-n", NS, "--wait", "--timeout", "120s",
                    "--kubeconfig", str(net.dev.kubeconfig)], capture_output=True, text=True,
                   timeout=200, check=False)
    for record in MPS_ROOT.glob("*.want"):  # no MPS host is left to quit their daemons
        record.unlink(missing_ok=True)


def test_upgrades_kills_and_restarts_while_replicas_serve_drop_nothing(
        net: NodeEnv, image: dict[str, Any], helm: str) -> None:
    env = net
    env.node.ctr("images", "import", image["archive"])
    repo, tag = image["reference"].rsplit(":", 1)
    env.node.ctr("images", "tag", "--force", image["reference"], f"{repo}:{tag}-rev2")
    env.node.ctr("images", "tag", "--force", KUBE_SCHEDULER, f"{KUBE_SCHEDULER}-rev2")
    values = {"image": {"repository": repo, "tag": tag, "digest": ""},
              "assignmentKey": {"create": True, "value": KEY},
              "scheduler": {"image": KUBE_SCHEDULER},
              "nodeAgent": {"fakeGpus": FAKE_GPUS},
              # the real node has 2 CPUs: the rolling update's surge pods must fit beside the
              # replicas (two webhook replicas of 100m each left an extender pending)
              "webhook": {"replicas": 1, "resources": {"requests": {"cpu": "10m"}}}}
    env.dev.kubectl("label", "node", env.node.name, "nvidia.com/gpu.present=true")
    helm_run(helm, env, "install", values)
    components_ready(env)
    env.dev.kubectl("create", "namespace", APP)
    env.dev.kubectl("apply", "-f", "-", input=json.dumps(replica_deployment(
        image["reference"])))
    wait_ready(env, "the replicas", SELECTOR, REPLICAS, namespace=APP, timeout_s=180)
    _multi_process_pods(env, image["reference"])
    pods = kubectl_json(env, "get", "pods", "-n", APP, "-l", SELECTOR)["items"]
    load = Load(env.dev.dir, "llm", {p["metadata"]["name"]: p["status"]["podIP"]
                                     for p in pods})
    load.ready()
    before = Snapshot.take(env, APP, SELECTOR)
    assert len(before.daemons) == 2 and all(before.daemons.values()), before
    load.start()
    rows: list[dict[str, Any]] = []

    def upgrade() -> None:
        rev2 = {**values, "image": {**values["image"], "tag": f"{tag}-rev2"},
                "scheduler": {"image": f"{KUBE_SCHEDULER}-rev2"}}
        helm_run(helm, env, "upgrade", rev2)
        t_wait = time.monotonic()  # helm --wait returned: how long until a leader is labelled
        wait_ready(env, "the extender leader", "app.kubernetes.io/name=gpuslice-extender,"
                   "gpuslice.io/extender-role=leader", timeout_s=120)
        FIGURES.append(f"  after helm upgrade --wait: a labelled extender leader in "
                       f"{time.monotonic() - t_wait:.1f} s")
        for sel in ("gpuslice-node-agent", "gpuslice-extender", "gpuslice-reconfig"):
            wait_until(f"{sel} on the new image", lambda s=sel: images_of(
                env, f"app.kubernetes.io/name={s}") == {f"{repo}:{tag}-rev2"}, 240)
        assert images_of(env, "app.kubernetes.io/name=gpuslice-scheduler") == \
            {f"{KUBE_SCHEDULER}-rev2"}
        assert images_of(env, "app.kubernetes.io/name=gpuslice-mps-host") == \
            {image["reference"]}  # OnDelete: not rolled

    steps: list[tuple[str, Callable[[], None]]] = [
        ("helm upgrade (new image revision)", upgrade),
        ("kill -9 node agent", lambda: kill_and_wait(
            env, "app.kubernetes.io/name=gpuslice-node-agent", "node-agent")),
        ("kubelet restart", env.node.restart_kubelet),
        ("containerd restart", env.node.restart_containerd),
        ("kill -9 extender leader", lambda: kill_and_wait(
            env, "app.kubernetes.io/name=gpuslice-extender,gpuslice.io/extender-role=leader",
            "extender"))]
    try:
        for name, action in steps:
            sent0 = load.counts.row()
            t0 = time.monotonic()
            action()
            components_ready(env)
            time.sleep(5)  # serving on after the step
            after = Snapshot.take(env, APP, SELECTOR)
            rows.append({"step": name, "seconds": round(time.monotonic() - t0, 1),
                         **{k: v - sent0[k] for k, v in load.counts.row().items()},
                         "replica restarts": after.restarts - before.restarts,
                         "same daemons": after.daemons == before.daemons,
                         "daemons": after.daemons})
    finally:
        counts = load.stop()
    _report(env, rows, counts.row())
    assert counts.failed == 0 and counts.status_5xx == 0, counts.errors[:20]
    assert counts.answered == counts.sent > 0
    for row in rows:
        assert row["replica restarts"] == 0 and row["same daemons"], row
    after = Snapshot.take(env, APP, SELECTOR)
    assert (after.replicas, after.mps_host) == (before.replicas, before.mps_host)
    agent_log = env.dev.kubectl("logs", "-n", NS, "-l", "app.kubernetes.io/name="
                                "gpuslice-node-agent", "--tail=400", check=False).stdout
    assert "adopted the MPS daemons" in agent_log
    _replacing_the_mps_host_costs_every_client(env, before)
    _uninstall(env, helm)


def _replacing_the_mps_host_costs_every_client(env: NodeEnv, before: Snapshot) -> None:
    """The control: what the steps above were spared. Deleting the MPS host's pod (what an
    operator drains the node for, docs/node-agent.md) ends the daemons, and every replica
    fails as a CUDA process does and restarts; the new host starts the daemons again from
    their records (new PIDs), and the replicas serve again."""
    pods = kubectl_json(env, "get", "pods", "-n", APP, "-l", SELECTOR)["items"]
    load = Load(env.dev.dir, "llm", {p["metadata"]["name"]: p["status"]["podIP"]
                                     for p in pods})
    load.ready()
    load.start()
    t0 = time.monotonic()
    try:
        env.dev.kubectl("delete", "pod", "-n", NS, "-l",
                        "app.kubernetes.io/name=gpuslice-mps-host", "--wait=true")
        wait_ready(env, "the new MPS host", "app.kubernetes.io/name=gpuslice-mps-host")
        wait_until("every replica restarted", lambda: Snapshot.take(
            env, APP, SELECTOR).restarts >= before.restarts + REPLICAS, 120)
        wait_ready(env, "the replicas again", SELECTOR, REPLICAS, namespace=APP, timeout_s=180)
        load.ready()
        time.sleep(3)
    finally:
        counts = load.stop()
    after = Snapshot.take(env, APP, SELECTOR)
    row = {"step": "control: MPS host pod deleted", "seconds": round(time.monotonic() - t0, 1),
           **counts.row(), "replica restarts": after.restarts - before.restarts,
           "same daemons": after.daemons == before.daemons, "daemons": after.daemons}
    _report(env, [row], counts.row(), "upgrade-control-figures.json")
    assert row["replica restarts"] >= REPLICAS and not row["same daemons"], row
    assert all(after.daemons.values()) and set(after.daemons) == set(before.daemons)
    assert counts.failed + counts.status_5xx > 0, row  # the load saw it


def _multi_process_pods(env: NodeEnv, image: str) -> None:
    """4 declared processes on 8 GiB: each client held to 2 GiB, 8 GiB in all; 2 running
    where 1 is declared: the node agent's Warning event on the pod. What each uses shows in
    ``kubectl gpuslice top`` (the agents' metrics through the API server's pod proxy)."""
    env.dev.kubectl("apply", "-f", "-", input=json.dumps(clients_pod("quad", image, 4, 4,
                                                                     8192, (1500, 5.0))))
    env.dev.kubectl("apply", "-f", "-", input=json.dumps(clients_pod("twin", image, 2, None,
                                                                     1024)))
    got: dict[str, list[dict[str, Any]]] = {}

    def connected() -> bool:
        got.clear()
        for target in (w.name.removesuffix(".want") for w in MPS_ROOT.glob("*.want")):
            for c in clients_state(target):
                got.setdefault(str(c["name"]).split("/")[0], []).append(c)
        return len(got.get("quad", [])) == 4 and len(got.get("twin", [])) == 2

    wait_until("the multi-process pods' clients", connected, 120, every_s=1.0)
    assert [c["mem_mib"] for c in got["quad"]] == [2048] * 4
    assert sum(c["mem_mib"] for c in got["quad"]) <= 8192

    def warned() -> bool:
        events = kubectl_json(env, "get", "events", "-n", APP)["items"]
        return any(e.get("reason") == "GpuProcessesOverDeclared"
                   and e["involvedObject"]["name"] == "twin" for e in events)

    wait_until("the node agent's warning on pod twin", warned, 60, every_s=1.0)
    _top_shows_what_quad_uses(env)
    env.dev.kubectl("delete", "pod", "-n", APP, "quad", "twin", "--wait=true",
                    "--timeout=60s", timeout_s=90)


def top_rows(env: NodeEnv, pod_prefix: str, count: int,
             processes: int = 1) -> list[dict[str, Any]]:
    """``kubectl gpuslice top -o json`` on the real API server (each node agent's and DRA
    driver's metrics through the pod proxy), until ``count`` rows of pods named
    ``pod_prefix``... show ``processes`` processes each, with their memory used and their
    share (a pod's first measurement may see its processes before its share is read)."""
    rows: list[dict[str, Any]] = []

    def shown() -> bool:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = kubectl_gpuslice(["top", "--kubeconfig", str(env.dev.kubeconfig), "-o",
                                     "json"])
        assert code == 0
        rows[:] = [r for r in json.loads(out.getvalue())["usage"]
                   if str(r["pod"]).startswith(pod_prefix) and r.get("processes") == processes
                   and all(k in r for k in ("used_mib", "cap_mib", "share_pct"))]
        return len(rows) == count

    wait_until(f"kubectl gpuslice top: {count} pod(s) {pod_prefix}...", shown, 60, every_s=2.0)
    return rows


def _top_shows_what_quad_uses(env: NodeEnv) -> None:
    """quad's 4 processes use 4 x 1500 MiB of its 8192 and keep 20% of the SMs busy on a
    10% share."""
    [row] = top_rows(env, f"{APP}/quad", 1, processes=4)
    assert (row["processes"], row["used_mib"], row["cap_mib"], row["share_pct"]) == \
        (4, 6000, 8192, 10), row
    assert row["sm_pct"] == 20, row


def _report(env: NodeEnv, rows: list[dict[str, Any]], total: dict[str, int],
            name: str = "upgrade-figures.json") -> None:
    out = env.dev.dir / name
    out.write_text(json.dumps({"steps": rows, "total": total}, indent=2))
    lines = [f"{name.removesuffix('.json')}: step: seconds, requests sent/failed/5xx, replica "
             "restarts, same daemon PIDs"]
    lines += [f"  {r['step']}: {r['seconds']} s, {r['sent']}/{r['failed']}/{r['5xx']}, "
              f"{r['replica restarts']}, {r['same daemons']}" for r in rows]
    lines.append(f"  total: {total}")
    FIGURES.extend(lines)
    sys.stderr.write("\n" + "\n".join(lines) + "\n")


def _uninstall(env: NodeEnv, helm_bin: str) -> None:
    env.dev.kubectl("delete", "namespace", APP, "--wait=true", "--timeout=120s",
                    timeout_s=150)
    res = subprocess.run([helm_bin, "uninstall", "gpuslice", "-n", NS, "--wait", "--timeout",
                          "120s", "--kubeconfig", str(env.dev.kubeconfig)],
                         capture_output=True, text=True, timeout=200, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    wait_until("no MPS daemon left", lambda: not list(Path(MPS_ROOT).glob("*.want")), 60)


DRA_APP = "serving-dra"
DRA_SELECTOR = "app=llm-dra"


def dra_manifests(env: NodeEnv, reference: str) -> str:
    """deploy/overlays/dra-fake-gpus (driver, MPS host, DeviceClasses on two stand-in GPUs)
    and deploy/dra-allocator, rendered for image ``reference``."""
    out = []
    for folder in (DEPLOY / "overlays" / "dra-fake-gpus", DEPLOY / "dra-allocator"):
        text = env.dev.kubectl("kustomize", str(folder)).stdout
        out.append(text.replace("registry.example.com/gpuslice:0.1.0", reference))
    return "\n---\n".join(out)


def dra_replicas(image: str) -> list[dict[str, Any]]:
    """Two fake model replicas, each on its own share (20% and 2 GiB) of a stand-in GPU."""
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "fifth", "namespace": DRA_APP},
                "spec": {"spec": {"devices": {"requests": [{
                    "name": "gpu", "exactly": {
                        "deviceClassName": "share.gpuslice.io",
                        "capacity": {"requests": {"compute": "20", "memory": "2Gi"}}}}]}}}}
    dep = replica_deployment(image)
    dep["metadata"] = {"name": "llm-dra", "namespace": DRA_APP}
    dep["spec"]["replicas"] = 2
    dep["spec"]["selector"] = {"matchLabels": {"app": "llm-dra"}}
    spec = dep["spec"]["template"]["spec"]
    dep["spec"]["template"]["metadata"] = {"labels": {"app": "llm-dra"}}
    spec.pop("schedulerName")
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "fifth"}]
    spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return [template, dep]


def dra_ready(env: NodeEnv) -> None:
    wait_ready(env, "the DRA driver", "app=gpuslice-dra-driver")
    wait_ready(env, "the claim allocator", "app.kubernetes.io/name=gpuslice-dra-allocator")
    wait_ready(env, "the MPS host", "app.kubernetes.io/name=gpuslice-mps-host")


def test_the_dra_path_upgrades_and_its_driver_dies_while_replicas_serve(
        net: NodeEnv, image: dict[str, Any]) -> None:
    """The same on the DRA path: the driver and the claim allocator rolled to a new image
    revision, the driver killed (-9), the kubelet restarted, while two replicas on shares
    serve: 0 failed requests, 0 restarts, the same daemons."""
    env = net
    env.node.ctr("images", "import", image["archive"])
    repo, tag = image["reference"].rsplit(":", 1)
    rev2 = f"{repo}:{tag}-rev2"
    env.node.ctr("images", "tag", "--force", image["reference"], rev2)
    env.dev.kubectl("label", "node", env.node.name, "gpuslice.io/fake-gpus=true", "--overwrite")
    env.dev.apply(dra_manifests(env, image["reference"]))
    dra_ready(env)
    env.dev.kubectl("create", "namespace", DRA_APP)
    for obj in dra_replicas(image["reference"]):
        env.dev.kubectl("apply", "-f", "-", input=json.dumps(obj))
    wait_ready(env, "the DRA replicas", DRA_SELECTOR, 2, namespace=DRA_APP, timeout_s=240)
    pods = kubectl_json(env, "get", "pods", "-n", DRA_APP, "-l", DRA_SELECTOR)["items"]
    load = Load(env.dev.dir, "llm", {p["metadata"]["name"]: p["status"]["podIP"]
                                     for p in pods})
    load.ready()
    before = Snapshot.take(env, DRA_APP, DRA_SELECTOR)
    assert before.daemons and all(before.daemons.values()), before
    load.start()
    rows: list[dict[str, Any]] = []

    def upgrade() -> None:
        env.dev.apply(dra_manifests(env, rev2))
        for sel in ("app=gpuslice-dra-driver", "app.kubernetes.io/name=gpuslice-dra-allocator"):
            wait_until(f"{sel} on the new image",
                       lambda s=sel: images_of(env, s) == {rev2}, 240)
        assert images_of(env, "app.kubernetes.io/name=gpuslice-mps-host") == \
            {image["reference"]}

    steps: list[tuple[str, Callable[[], None]]] = [
        ("re-apply with a new image revision", upgrade),
        ("kill -9 DRA driver", lambda: kill_and_wait(env, "app=gpuslice-dra-driver",
                                                      "dra-driver")),
        ("kill -9 claim allocator", lambda: kill_and_wait(
            env, "app.kubernetes.io/name=gpuslice-dra-allocator", "dra-allocator")),
        ("kubelet restart", env.node.restart_kubelet)]
    try:
        for name, action in steps:
            sent0 = load.counts.row()
            t0 = time.monotonic()
            action()
            dra_ready(env)
            time.sleep(5)
            after = Snapshot.take(env, DRA_APP, DRA_SELECTOR)
            rows.append({"step": name, "seconds": round(time.monotonic() - t0, 1),
                         **{k: v - sent0[k] for k, v in load.counts.row().items()},
                         "replica restarts": after.restarts - before.restarts,
                         "same daemons": after.daemons == before.daemons,
                         "daemons": after.daemons})
    finally:
        counts = load.stop()
    _report(env, rows, counts.row(), "upgrade-dra-figures.json")
    assert counts.failed == 0 and counts.status_5xx == 0, counts.errors[:20]
    assert counts.answered == counts.sent > 0
    for row in rows:
        assert row["replica restarts"] == 0 and row["same daemons"], row
    after = Snapshot.take(env, DRA_APP, DRA_SELECTOR)
    assert (after.replicas, after.mps_host) == (before.replicas, before.mps_host)
    driver_log = env.dev.kubectl("logs", "-n", NS, "-l", "app=gpuslice-dra-driver",
                                 "--tail=400", check=False).stdout
    assert "adopted the MPS daemons" in driver_log
    # what each replica uses of its claim's share, measured by the DRA driver (1 process,
    # the claim's 2 GiB and 20%)
    for row in top_rows(env, f"{DRA_APP}/llm-dra", 2):
        assert (row["processes"], row["cap_mib"], row["share_pct"]) == (1, 2048, 20), row
    # the replicas go, their claims with them: the driver quits the daemons it kept
    env.dev.kubectl("delete", "namespace", DRA_APP, "--wait=true", "--timeout=120s",
                    timeout_s=150)
    wait_until("the driver's daemons quit with their last share",
               lambda: not list(Path(MPS_ROOT).glob("*.want")), 90)
