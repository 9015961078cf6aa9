"""Helpers of the cluster tier: the admin client, kwok GPU nodes as the node agent would
describe them, GPU pods, waits with deadlines, and the over-allocation check read back from the
API server (independent of the extender's ledger)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuslice import devcluster
from gpuslice.adapters.kube.annotation import decode
from gpuslice.core.assignment import ANNOTATION
from gpuslice.devcluster import DevCluster, wait_until

EXTENDER_KEY = "cluster-tier-assignment-key-0123456789abcdef"
GROUP = "gpuslice.test/group"
INVENTORY = "gpuslice.io/inventory"


def gpu_node(name: str, group: str, model: str = "A100-80GB", count: int = 2,
             mig: str | None = None, replicas: int = 10) -> dict[str, Any]:
    """:func:`gpuslice.devcluster.gpu_node` in the test's node group."""
    return devcluster.gpu_node(name, model, count, mig, replicas, labels={GROUP: group})


def gpu_pod(name: str, group: str, *, milli: int = 1000, memory: int | None = None,
            gpus: int = 1, isolation: str | None = None, models: str | None = None,
            containers: int = 1, init_gpu: bool = False, sidecar_gpu: bool = False,
            priority: str | None = None, labels: dict[str, str] | None = None,
            scheduler: str = "gpuslice-scheduler") -> dict[str, Any]:
    limits: dict[str, str] = {"gpuslice.io/gpu": str(gpus), "gpuslice.io/gpu-milli": str(milli)}
    if memory is not None:
        limits["gpuslice.io/gpu-memory"] = str(memory)
    ann: dict[str, str] = {}
    if isolation:
        ann["gpuslice.io/isolation"] = isolation
    if models:
        ann["gpuslice.io/gpu-model"] = models
    gpu_res = {"limits": limits}
    main = [{"name": f"c{i}", "image": "registry.local/model:1",
             "resources": gpu_res if not (init_gpu or sidecar_gpu) else {}}
            for i in range(containers)]
    spec: dict[str, Any] = {"schedulerName": scheduler, "containers": main,
                            "nodeSelector": {GROUP: group},
                            "tolerations": [{"operator": "Exists"}],
                            "terminationGracePeriodSeconds": 0}
    if init_gpu:
        spec["initContainers"] = [{"name": "warmup", "image": "registry.local/model:1",
                                   "resources": gpu_res}]
    if sidecar_gpu:
        spec["initContainers"] = [{"name": "sidecar", "image": "registry.local/model:1",
                                   "restartPolicy": "Always", "resources": gpu_res}]
    if priority:
        spec["priorityClassName"] = priority
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": group, "annotations": ann,
                         "labels": {"app": group, **(labels or {})}},
            "spec": spec}


@dataclass
class ExtenderProcess:
    """``gpuslice extender`` as a process on the dev cluster's extender URL and certificate,
    with mutual TLS (kube-scheduler presents its client certificate)."""

    dev: DevCluster
    kubeconfig: Path
    key: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        log = (self.dev.dir / f"extender-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "extender",
             "--listen", f"127.0.0.1:{self.dev.extender_port}",
             *self.dev.extender_tls_args(), "--key-file", str(self.key),
             "--kubeconfig", str(self.kubeconfig), "--resync", "30"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        log.close()
        import ssl
        import urllib.request

        ctx = ssl.create_default_context(cafile=str(self.dev.ca_crt))

        def healthy() -> bool:
            with urllib.request.urlopen(self.dev.extender_url + "/healthz", context=ctx,
                                        timeout=5) as r:
                return bool(r.status == 200)

        wait_until("gpuslice extender /healthz", healthy, 120, self.proc,
                   self.dev.dir / f"extender-{self.starts}.log")

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def kill(self) -> None:
        """SIGKILL: no chance to finish what it was doing."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return "\n".join((self.dev.dir / f"extender-{i}.log").read_text(errors="replace")
                         for i in range(1, self.starts + 1))


class Kube:
    """The admin's view through the official Python client (what the tests check)."""

    def __init__(self, dev: DevCluster) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(dev.kubeconfig), client_configuration=cfg)
        self.dev = dev
        self.api_client = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api_client)
        self.client = client

    def close(self) -> None:
        self.api_client.close()

    def create_namespace(self, name: str) -> None:
        self.core.create_namespace({"metadata": {"name": name}})
        # pods need the namespace's default ServiceAccount (the controller-manager makes it)
        wait_until(f"ServiceAccount {name}/default", lambda: bool(
            self.core.read_namespaced_service_account("default", name)), 60)

    def add_nodes(self, nodes: list[dict[str, Any]]) -> None:
        self.dev.add_nodes(nodes)

    def create(self, objs: Iterable[dict[str, Any]], retry_s: float = 120.0) -> None:
        """Create the pods; while the API server is away (a restart), retry each until
        ``retry_s`` has passed (409: it was created before the connection broke)."""
        from kubernetes.client.exceptions import ApiException

        for o in objs:
            end = time.monotonic() + retry_s
            while True:
                try:
                    self.core.create_namespaced_pod(o["metadata"]["namespace"], o,
                                                    _request_timeout=30)
                    break
                except ApiException as exc:
                    if exc.status == 409:
                        break
                    if (exc.status and exc.status < 500) or time.monotonic() > end:
                        raise
                except Exception:  # refused / reset while the API server restarts
                    if time.monotonic() > end:
                        raise
                time.sleep(0.5)

    def pods(self, namespace: str) -> list[dict[str, Any]]:
        raw = self.core.list_namespaced_pod(namespace, _preload_content=False)
        return list(json.loads(raw.data)["items"])

    def all_pods(self) -> list[dict[str, Any]]:
        raw = self.core.list_pod_for_all_namespaces(_preload_content=False)
        return list(json.loads(raw.data)["items"])

    def wait_pods(self, namespace: str, what: str,
                  done: Callable[[list[dict[str, Any]]], bool],
                  timeout_s: float = 180.0) -> list[dict[str, Any]]:
        box: list[list[dict[str, Any]]] = []

        def check() -> bool:
            pods = self.pods(namespace)
            box[:] = [pods]
            return done(pods)

        try:
            wait_until(what, check, timeout_s, every_s=0.5)
        except Exception as exc:
            raise AssertionError(f"{exc}\n{describe(box[0] if box else [])}") from None
        return box[0]

    def wait_bound(self, namespace: str, count: int, timeout_s: float = 180.0,
                   ) -> list[dict[str, Any]]:
        return self.wait_pods(namespace, f"{count} pods bound in {namespace}",
                              lambda ps: len(bound(ps)) >= count, timeout_s)

    def events(self, namespace: str) -> list[str]:
        raw = self.core.list_namespaced_event(namespace, _preload_content=False)
        return [f"{e['involvedObject'].get('name')}: {e.get('reason')}: {e.get('message')}"
                for e in json.loads(raw.data)["items"]]

    def cleanup_group(self, name: str) -> None:
        """Delete the namespace (kwok finishes its pods), then the group's nodes; wait until
        both are gone so the next test starts from a quiet cluster."""
        self.core.delete_namespace(name)
        try:
            wait_until(f"namespace {name} deleted", lambda: not any(
                ns.metadata.name == name for ns in self.core.list_namespace().items), 180,
                every_s=1.0)
        except Exception as exc:  # leave it: the next test uses another namespace
            sys.stderr.write(f"cleanup of {name}: {exc}\n")
        self.core.delete_collection_node(label_selector=f"{GROUP}={name}")


def bound(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if (p.get("spec") or {}).get("nodeName")]


def assignment(pod: dict[str, Any]) -> Any:
    return decode(pod["metadata"]["annotations"][ANNOTATION])


def describe(pods: list[dict[str, Any]]) -> str:
    out = []
    for p in pods[:30]:
        conds = [(c.get("type"), c.get("reason"), (c.get("message") or "")[:200])
                 for c in (p.get("status") or {}).get("conditions") or []]
        out.append(f"{p['metadata']['name']}: node={p['spec'].get('nodeName')} "
                   f"phase={(p.get('status') or {}).get('phase')} {conds}")
    return "\n".join(out)


def over_allocation(pods: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> list[str]:
    """Every GPU's (and MIG instance's) share summed over the live pods' assignments, against
    the GPU's 1000 milli and memory from the node's inventory; also: an assignment's node must
    be the node the pod is bound to. Returns the violations (none expected)."""
    memory: dict[str, int] = {}
    for n in nodes:
        for g in json.loads(((n["metadata"].get("annotations") or {}).get(INVENTORY)) or "[]"):
            memory[g["uuid"]] = g["memoryMiB"]
            for m in g.get("mig") or []:
                memory[m["uuid"]] = m["memoryMiB"]
    milli: dict[str, int] = defaultdict(int)
    mem: dict[str, int] = defaultdict(int)
    mig_instances: dict[tuple[str, str, int], list[str]] = defaultdict(list)
    problems: list[str] = []
    for p in pods:
        phase = (p.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed") or ANNOTATION not in (
                p["metadata"].get("annotations") or {}):
            continue
        a = assignment(p)
        name = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        node = p["spec"].get("nodeName")
        if node and node != a.node:
            problems.append(f"{name}: bound to {node}, assignment names {a.node}")
        for c in a.containers:  # each container holds its own share (PodRequests sums them)
            for g in c.gpus:
                if g.mig_profile:
                    mig_instances[(g.uuid, g.mig_profile, g.mig_start)].append(
                        f"{name} ({c.mode.value})")
                milli[g.uuid] += g.milli
                mem[g.uuid] += g.memory_mib
    for (uuid, prof, start), holders in mig_instances.items():
        # a MIG-isolated pod owns its instance; only MPS slices share one
        if len(set(holders)) > 1 and any(h.endswith("(mig)") for h in holders):
            problems.append(f"MIG instance {prof}@{start} of {uuid} given to {holders}")
    for uuid, m in milli.items():
        if m > 1000:
            problems.append(f"GPU {uuid}: {m} milli assigned")
        cap = memory.get(uuid)
        if cap is not None and mem[uuid] > cap:
            problems.append(f"GPU {uuid}: {mem[uuid]} MiB assigned of {cap}")
    return problems


def deadline(seconds: float) -> Callable[[], bool]:
    end = time.monotonic() + seconds
    return lambda: time.monotonic() < end
