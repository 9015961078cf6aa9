"""Day two, part two on the real control plane (issue 56): a slice move behind the production
router cuts no request.

Two ``gpuslice router --endpointslices`` processes (deploy/examples/router.yaml's two
replicas, on its Role) route a Service's pods; ``gpuslice reconfig run --routers
--leader-elect`` (deploy/base's account) moves the pods off a GPU whose layout changes. kwok
runs no container, so this file stands in for what a node would do for the model pods: a
fake replica process per running pod (one of the old pods slow: 1.5 s per request), the
model Service's EndpointSlices pointing at those processes (as the EndpointSlice controller
would point at the pods), the router Service's EndpointSlices pointing at the two router
processes, and the node agent's MIG report. A pod's process is killed the moment the pod is
being deleted, as a container whose pod is evicted dies: a request still on it is cut.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.devcluster import DevCluster, wait_until
from gpuslice.devcluster.procs import host_ip
from tests.cluster.conftest import DEPLOY
from tests.cluster.helpers import Kube, gpu_node, gpu_pod

INFERENCE = ",".join(f"1g.10gb@{i}" for i in range(7))
BATCH = "7g.80gb@0"
SYSTEM = "gpuslice-system"
SLOW = {"m-0"}  # its requests take 1.5 s: some are always in flight when it drains


def _ready(p: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (p.get("status") or {}).get("conditions") or [])


class NodeStandIn(threading.Thread):
    """What kwok does not: the model pods' containers (fake replica processes on this host's
    address), the model Service's EndpointSlices, and the node agent's MIG layout report."""

    def __init__(self, dev: DevCluster, ns: str, ip: str, folder: Path, src: str,
                 gpu: str) -> None:
        super().__init__(daemon=True)
        from kubernetes import client

        self.kube = Kube(dev)
        self.disc = client.DiscoveryV1Api(self.kube.api_client)
        self.ns, self.ip, self.folder, self.src, self.gpu = ns, ip, folder, src, gpu
        self.procs: dict[str, tuple[subprocess.Popen[str], int]] = {}
        self.written: dict[str, dict[str, Any]] = {}
        self.killed: list[str] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # said at the end of the test
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        self.join(10)
        for p, _ in self.procs.values():
            p.kill()
            p.wait(10)
        self.kube.close()

    def sync(self) -> None:
        pods = {p["metadata"]["name"]: p for p in self.kube.pods(self.ns)
                if (p["metadata"].get("labels") or {}).get("model") == "m"}
        for name in list(self.procs):
            p = pods.get(name)
            if p is None or p["metadata"].get("deletionTimestamp"):
                proc, _ = self.procs.pop(name)
                proc.kill()  # the container dies with its pod: what is in flight is cut
                proc.wait(10)
                self.killed.append(name)
        for name, p in pods.items():
            if name not in self.procs and name not in self.killed and _ready(p) and \
                    not p["metadata"].get("deletionTimestamp"):
                self.procs[name] = self._start(name)
        want = {name: {"port": port, "ready": _ready(pods[name])} for name, (_, port)
                in self.procs.items()}
        for name in [n for n in self.written if n not in want]:
            self.disc.delete_namespaced_endpoint_slice(f"model-{name}", self.ns)
            del self.written[name]
        for name, st in want.items():
            if self.written.get(name) != st:
                self._slice(name, "model", [{"name": "http", "port": st["port"]}],
                            ready=st["ready"])
                self.written[name] = st
        self._agent()

    def _start(self, name: str) -> tuple[subprocess.Popen[str], int]:
        p = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.adapters.http.fake_replica", "--host", self.ip,
             "--port", "0", "--name", name, "--concurrency", "64",
             "--service-ms", "1500" if name in SLOW else "30"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"fake replica for {name} did not start: {line!r}")
        return p, int(line.split()[1])

    def _slice(self, name: str, service: str, ports: list[dict[str, Any]],
               ready: bool = True) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": f"{service}-{name}", "namespace": self.ns, "labels": {
                    "kubernetes.io/service-name": service,
                    "endpointslice.kubernetes.io/managed-by": "gpuslice-cluster-tier"}},
                "addressType": "IPv4", "ports": [{**p, "protocol": "TCP"} for p in ports],
                "endpoints": [{"addresses": [self.ip],
                               "conditions": {"ready": ready, "serving": ready},
                               "targetRef": {"kind": "Pod", "name": name,
                                             "namespace": self.ns}}]}
        try:
            self.disc.create_namespaced_endpoint_slice(self.ns, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            cur = self.disc.read_namespaced_endpoint_slice(f"{service}-{name}", self.ns)
            body["metadata"]["resourceVersion"] = cur.metadata.resource_version
            self.disc.replace_namespaced_endpoint_slice(f"{service}-{name}", self.ns, body)

    def _agent(self) -> None:
        """The source node's agent: a layout asked is applied (its GPU has no client left)."""
        node = self.kube.core.read_node(self.src, _preload_content=False)
        ann = json.loads(node.data)["metadata"].get("annotations") or {}
        want = json.loads(ann.get("gpuslice.io/mig-desired") or "{}").get(self.gpu)
        have = json.loads(ann.get("gpuslice.io/mig-layouts") or "{}")
        if want and (have.get(self.gpu) or {}).get("layout") != want:
            have[self.gpu] = {"layout": want, "state": "success", "message": ""}
            self.kube.core.patch_node(self.src, {"metadata": {"annotations": {
                "gpuslice.io/mig-layouts": json.dumps(have)}}})


def _router(dev: DevCluster, ns: str, kc: Path, ip: str, log: Path,
            ) -> tuple[subprocess.Popen[bytes], int, int]:
    with log.open("wb") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "router", "--endpointslices", f"{ns}/model",
             "--kubeconfig", str(kc), "--port-name", "http", "--listen", "127.0.0.1:0",
             "--admin", f"{ip}:0", "--access-log", "off", "--no-admission", "--policy",
             "round-robin", "--poll", "1", "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=out)
    box: list[dict[str, Any]] = []

    def listening() -> bool:
        for line in log.read_text(errors="replace").splitlines():
            if '"listening"' in line:
                box.append(json.loads(line))
                return True
        return False

    wait_until("router listening", listening, 120, p, log)
    return p, int(box[0]["port"]), int(box[0]["admin_port"])


def _replicas(ip: str, admin: int) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"http://{ip}:{admin}/replicas", timeout=5) as r:
        doc = json.loads(r.read())
    return {x["name"]: x for svc in doc.values() for x in svc["replicas"]}


class Load:
    """POSTs at 20/s, open loop, to the two routers in turn (as their Service would spread
    new connections); each request's router, send time, status and error."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.out: list[tuple[int, float, int, str]] = []
        self.stop = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(96)
        self.t = threading.Thread(target=self._run, daemon=True)

    def _one(self, port: int, at: float) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/m/infer", data=b"{}",
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
                self.out.append((port, at, r.status, ""))
        except urllib.error.HTTPError as exc:
            self.out.append((port, at, exc.code, exc.read()[:300].decode(errors="replace")))
        except OSError as exc:
            self.out.append((port, at, 0, str(exc)))

    def _run(self) -> None:
        n, t0 = 0, time.monotonic()
        while not self.stop.is_set():
            self.pool.submit(self._one, self.ports[n % 2], time.monotonic() - t0)
            n += 1
            self.stop.wait(max(0.0, t0 + n / 20 - time.monotonic()))

    def __enter__(self) -> Load:
        self.t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.t.join(10)
        self.pool.shutdown(wait=True)


def _router_role(dev: DevCluster, ns: str) -> str:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "examples" / "router.yaml").read_text())
            if d and d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    for d in docs:
        d["metadata"]["namespace"] = ns
        for s in d.get("subjects") or []:
            s["namespace"] = ns
    dev.apply(yaml.safe_dump_all(docs))
    return str(next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"))


def _nodes(dev: DevCluster, kube: Kube, group: str) -> tuple[str, str, str]:
    """The source node (one A100 in 7 x 1g) with two pods on it, then the destination node;
    both reported in their layout as the node agent would."""
    src, dst = f"{group}-src", f"{group}-dst"
    kube.add_nodes([gpu_node(src, group, "A100-80GB", count=1, mig=INFERENCE)])
    kube.create([gpu_pod(f"m-{i}", group, milli=100, memory=4000, models="A100-80GB",
                         labels={"model": "m"}) for i in range(2)])
    kube.wait_bound(group, 2)
    kube.add_nodes([gpu_node(dst, group, "A100-80GB", count=1, mig=INFERENCE)])
    gpus = {}
    for n in (src, dst):
        node = json.loads(kube.core.read_node(n, _preload_content=False).data)
        [g] = json.loads(node["metadata"]["annotations"]["gpuslice.io/inventory"])
        gpus[n] = g["uuid"]
        kube.core.patch_node(n, {"metadata": {"annotations": {"gpuslice.io/mig-layouts":
                                                              json.dumps({g["uuid"]: {
                                                                  "layout": INFERENCE,
                                                                  "state": "success",
                                                                  "message": ""}})}}})
    return src, dst, gpus[src]


def _schedule(dev: DevCluster, group: str, src: str) -> None:
    dev.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceSchedule",
        "metadata": {"name": "nightly", "namespace": group},
        "spec": {"selector": {"nodes": [src], "gpuModels": ["A100-80GB"]},
                 "layouts": {"inference": {"mig": {"mig-devices": {"1g.10gb": 7}}},
                             "batch": {"mig": {"mig-devices": {"7g.80gb": 1}}}},
                 "default": "inference", "override": "batch", "drainTimeoutSeconds": 90,
                 "readyTimeoutSeconds": 120}}))


def _services(dev: DevCluster, group: str) -> None:
    for name, ports in (("model", [("http", 80)]), ("gpuslice-router", [("http", 80),
                                                                         ("admin", 9901)])):
        dev.apply(yaml.safe_dump({"apiVersion": "v1", "kind": "Service",
                                  "metadata": {"name": name, "namespace": group},
                                  "spec": {"ports": [{"name": n, "port": p}
                                                     for n, p in ports]}}))


def test_a_slice_move_behind_both_router_replicas_cuts_no_request(
        dev: DevCluster, kube: Kube, extender: Any, group: str, tmp_path: Path) -> None:
    ip = host_ip()
    src, _dst, gpu = _nodes(dev, kube, group)
    _services(dev, group)
    node = NodeStandIn(dev, group, ip, tmp_path, src, gpu)
    node.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        wait_until("the pods' replicas serve", lambda: set(node.written) == {"m-0", "m-1"}, 120)
        sa = _router_role(dev, group)
        kc = dev.service_account_kubeconfig(group, sa, tmp_path / "router.kc")
        routers = [_router(dev, group, kc, ip, tmp_path / f"router-{i}.log") for i in range(2)]
        procs += [p for p, _, _ in routers]
        for i, (_, port, admin) in enumerate(routers):
            node._slice(f"r{i}", "gpuslice-router", [{"name": "http", "port": port},
                                                      {"name": "admin", "port": admin}])
        for _, _, admin in routers:
            wait_until("a router lists both pods", lambda a=admin: set(_replicas(ip, a)) ==
                       {"m-0", "m-1"}, 60)
        ckc = dev.service_account_kubeconfig(SYSTEM, "gpuslice-reconfig")
        with Load([port for _, port, _ in routers]) as load:
            time.sleep(3)
            _schedule(dev, group, src)
            clog = tmp_path / "reconfig.log"
            with clog.open("wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "gpuslice.cli", "reconfig", "run", "--kubeconfig",
                     str(ckc), "--routers", f"{group}/gpuslice-router", "--every", "0.5",
                     "--leader-elect", "--lease", f"{SYSTEM}/reconfig-{group}",
                     "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=out))

            def status() -> dict[str, Any]:
                obj = json.loads(dev.kubectl("get", "sliceschedule", "nightly", "-n", group,
                                             "-o", "json").stdout)
                return dict(((obj.get("status") or {}).get("gpus") or {}).get(gpu) or {})

            wait_until("the GPU moved and re-sliced", lambda: status().get("phase") == "Done",
                       300, procs[-1], clog)
            time.sleep(3)  # the load goes on after the move
        st = status()
        cut = [x for x in load.out if x[2] != 200]
        assert len(load.out) > 100 and not cut, (len(load.out), cut[:5], node.errors)
        assert "drainNote" not in st, st  # drained on the routers' word, not the timeout
        print(json.dumps({"requests": len(load.out), "cut": len(cut),
                          "move_s": st.get("seconds"), "killed": sorted(node.killed)}))
        pods = {p["metadata"]["name"] for p in kube.pods(group)}
        assert pods == {"m-0-m0", "m-1-m1"} and {"m-0", "m-1"} <= set(node.killed), pods
        obj = json.loads(dev.kubectl("get", "sliceschedule", "nightly", "-n", group, "-o",
                                     "json").stdout)
        wait_until("the finalizer is off once no GPU moves", lambda: not json.loads(
            dev.kubectl("get", "sliceschedule", "nightly", "-n", group, "-o", "json").stdout
        )["metadata"].get("finalizers"), 30)
        assert obj["status"]["gpus"][gpu]["toLayout"] == BATCH
        lease = json.loads(dev.kubectl("get", "lease", f"reconfig-{group}", "-n", SYSTEM,
                                       "-o", "json").stdout)
        assert lease["spec"]["holderIdentity"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        node.close()


@pytest.mark.parametrize(("account", "verb", "resource", "namespace", "allowed"), [
    ("gpuslice-reconfig", "update", "sliceschedules.gpuslice.io", "ml", True),
    ("gpuslice-reconfig", "update", "sliceschedules.gpuslice.io/finalizers", "ml", True),
    ("gpuslice-reconfig", "delete", "sliceschedules.gpuslice.io", "ml", False),
    ("gpuslice-reconfig", "update", "leases.coordination.k8s.io", SYSTEM, True),
    ("gpuslice-reconfig", "update", "leases.coordination.k8s.io", "kube-system", False),
    ("gpuslice-reconfig", "list", "endpointslices.discovery.k8s.io", "default", True),
    ("gpuslice-reconfig", "delete", "pods", "ml", False),
])
def test_the_controllers_new_rights_and_no_more(dev: DevCluster, account: str, verb: str,
                                                resource: str, namespace: str,
                                                allowed: bool) -> None:
    kind, _, sub = resource.partition("/")
    res = dev.kubectl("auth", "can-i", verb, kind, "-n", namespace,
                      *([f"--subresource={sub}"] if sub else []),
                      f"--as=system:serviceaccount:{SYSTEM}:{account}", check=False)
    assert (res.stdout.strip() == "yes") is allowed, res.stdout
