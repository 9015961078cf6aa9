"""The chaos soak's components (benchmarks/chaos.py): gpuslice's processes run as their
Deployments and DaemonSets run them, on their own service accounts, each restarted when a
fault kills it, as its controller would, and the Service that sends kube-scheduler's extender
calls to the leader.

* ``gpuslice extender`` x 2 with ``--leader-elect`` (deploy/base/extender.yaml): each has a
  Pod object in gpuslice-system (bound to the soak's system node; kwok runs it) named by
  ``POD_NAME``, and the leader labels its pod ``gpuslice.io/extender-role=leader``.
  :class:`LeaderService` plays the Service that selects that label plus kube-proxy: a TCP
  forwarder on the URL kube-scheduler calls, each connection sent to a replica whose pod
  carries the label and whose ``/readyz`` answered at the last probe (the Deployment's
  readiness probe, every 2 s); TLS passes through, so mutual TLS is between kube-scheduler
  and the replica.
* ``gpuslice dra-allocator`` x 2 (deploy/dra-allocator: one Lease, ``--settle 10``).
* ``gpuslice node-agent`` per device-plugin kwok node, on a fake NVML inventory that is the
  node's (the same GPUs and UUIDs as the node object carries), its folders temporary; kwok
  nodes run no kubelet, so the agent publishes the node's inventory, labels and totals and its
  device plugin never gets an Allocate.
* ``gpuslice dra-driver`` per DRA kwok node (tests/cluster/test_dra.py's way), with the
  stand-in MPS control program; :mod:`chaos_kubelet` plays the kubelet's DRA side."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SYSTEM = "gpuslice-system"
LEADER_LABEL = "gpuslice.io/extender-role"
EXTENDER_APP = "gpuslice-extender"
SYSTEM_NODE = "chaos-system"


class ApiError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text[:300]}")
        self.status = status


@dataclass
class Api:
    """A small JSON client of the API server (admin credentials), one connection per call,
    with a timeout: while kube-apiserver is frozen a call fails instead of hanging."""

    server: str
    ctx: ssl.SSLContext
    timeout_s: float = 8.0

    def call(self, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": content_type,
                                              "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
        return json.loads(raw) if raw else None

    def items(self, path: str, **params: str) -> list[dict[str, Any]]:
        q = ("?" + urllib.parse.urlencode(params)) if params else ""
        return list(self.call("GET", path + q)["items"] or [])

    def pods(self, ns: str, **params: str) -> list[dict[str, Any]]:
        return self.items(f"/api/v1/namespaces/{ns}/pods", **params)


@dataclass
class Managed:
    """One component process, restarted by :meth:`start` with the same arguments (a
    container restarted in the same pod)."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)  # exit codes of ends it was not told to

    def start(self) -> None:
        self.starts += 1
        with self.log.open("ab") as out:
            out.write(f"\n=== start {self.starts} at {time.strftime('%H:%M:%S')} ===\n".encode())
            out.flush()
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          env={**os.environ, **self.env})

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash, an OOM kill, a node's container killed)."""
        p = self.popen
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(10)

    def stop(self) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuslice.cli", *args]


def system_pod(name: str, app: str) -> dict[str, Any]:
    """The Pod object a replica runs as (kwok marks it Running on the system node)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": SYSTEM,
                         "labels": {"app.kubernetes.io/name": app}},
            "spec": {"nodeName": SYSTEM_NODE, "terminationGracePeriodSeconds": 0,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "main", "image": "gpuslice"}]}}


def lease_holder(api: Api, name: str) -> str:
    lease = api.call("GET", f"/apis/coordination.k8s.io/v1/namespaces/{SYSTEM}/leases/{name}")
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


class LeaderService:
    """The extender Service (selector: the leader label) and kube-proxy: connections to
    ``port`` go to a ready replica whose pod carries the label, the rest are closed."""

    def __init__(self, api: Api, port: int, replicas: dict[str, int], ca: Path) -> None:
        self.api, self.port, self.replicas = api, port, replicas  # pod name -> local port
        self.ctx = ssl.create_default_context(cafile=str(ca))
        self.labelled: set[str] = set()
        self.ready: set[str] = set()
        self.refused = 0  # connections closed for want of an endpoint
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads = [threading.Thread(target=self._endpoints, daemon=True,
                                          name="service-endpoints"),
                         threading.Thread(target=self._serve, daemon=True,
                                          name="service-proxy")]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    @property
    def endpoints(self) -> list[int]:
        return [self.replicas[n] for n in sorted(self.labelled & self.ready)]

    def _probe(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=self.ctx,
                                        timeout=1.5) as r:
                return bool(r.status == 200)
        except (OSError, ValueError):
            return False

    def _endpoints(self) -> None:
        last_probe = 0.0
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the API server away: keep the last view
                pods = self.api.pods(SYSTEM, labelSelector=f"app.kubernetes.io/name="
                                     f"{EXTENDER_APP},{LEADER_LABEL}=leader")
                self.labelled = {p["metadata"]["name"] for p in pods}
            if time.monotonic() - last_probe >= 2.0:  # the readiness probe's period
                last_probe = time.monotonic()
                self.ready = {n for n, port in self.replicas.items() if self._probe(port)}
            self._stop.wait(0.5)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        server = loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1",
                                                              self.port))
        try:
            loop.run_forever()
        finally:
            server.close()
            tasks = asyncio.all_tasks(loop)
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ends = self.endpoints
        if not ends:
            self.refused += 1
            writer.close()
            return
        try:
            r2, w2 = await asyncio.open_connection("127.0.0.1", random.choice(ends))
        except OSError:
            self.refused += 1
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
                pass  # a side closed, or the Service stopped
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        with contextlib.suppress(asyncio.CancelledError):  # the Service stopped
            await asyncio.gather(pipe(reader, w2), pipe(r2, writer))


@dataclass
class Components:
    """Every gpuslice process of the soak, by name."""

    procs: dict[str, Managed] = field(default_factory=dict)
    extender_pods: dict[str, int] = field(default_factory=dict)  # pod name -> port
    allocators: list[str] = field(default_factory=list)
    agents: dict[str, str] = field(default_factory=dict)  # node -> process name
    drivers: dict[str, str] = field(default_factory=dict)  # node -> process name
    driver_roots: dict[str, Path] = field(default_factory=dict)
    agent_roots: dict[str, Path] = field(default_factory=dict)

    def add(self, m: Managed) -> Managed:
        self.procs[m.name] = m
        m.start()
        return m

    def stop(self) -> None:
        for m in reversed(list(self.procs.values())):
            m.stop()


def start_extenders(dev: Any, api: Api, comps: Components, key: Path, ports: list[int],
                    folder: Path) -> None:
    kubeconfig = dev.service_account_kubeconfig(SYSTEM, "gpuslice-extender")
    crt, k = dev.extender_cert
    for i, port in enumerate(ports):
        pod = f"gpuslice-extender-{i}"
        api.call("POST", f"/api/v1/namespaces/{SYSTEM}/pods", system_pod(pod, EXTENDER_APP))
        comps.extender_pods[pod] = port
        comps.add(Managed(pod, cli(
            "extender", "--listen", f"127.0.0.1:{port}", "--tls-cert", str(crt),
            "--tls-key", str(k), "--client-ca", str(dev.ca_crt), "--key-file", str(key),
            "--kubeconfig", str(kubeconfig), "--leader-elect",
            "--lease", f"{SYSTEM}/gpuslice-extender", "--resync", "60"),
            folder / f"{pod}.log", {"POD_NAME": pod, "POD_NAMESPACE": SYSTEM}))


def start_allocators(dev: Any, comps: Components, folder: Path, replicas: int = 2) -> None:
    kubeconfig = dev.service_account_kubeconfig(SYSTEM, "gpuslice-dra-allocator")
    for i in range(replicas):
        name = f"gpuslice-dra-allocator-{i}"
        comps.allocators.append(name)
        comps.add(Managed(name, cli(
            "dra-allocator", "--kubeconfig", str(kubeconfig), "--interval", "0.2",
            "--settle", "10", "--identity", name), folder / f"{name}.log",
            {"POD_NAME": name}))


def fake_inventory(path: Path, gpus: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"driver": "580.95.05", "gpus": gpus}))
    return path


def start_agent(dev: Any, comps: Components, key: Path, node: str, gpus: list[dict[str, Any]],
                kubeconfig: Path, folder: Path) -> None:
    root = Path(dev.dir) / "agents" / node
    for sub in ("dp", "mps", "shm", "cdi"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    inv = fake_inventory(root / "gpus.yaml", gpus)
    comps.agent_roots[node] = root
    name = f"node-agent-{node}"
    comps.agents[node] = name
    comps.add(Managed(name, cli(
        "node-agent", "--node", node, "--key-file", str(key), "--fake-gpus", str(inv),
        "--socket-dir", str(root / "dp"), "--mps-pipe-dir", str(root / "mps"),
        "--mps-shm-dir", str(root / "shm"), "--cdi-root", str(root / "cdi"),
        "--metrics", "off", "--pod-resources-socket", "off",
        "--kubeconfig", str(kubeconfig)), folder / f"{name}.log"))


def start_driver(comps: Components, node: str, gpus: list[dict[str, Any]], modes: list[str],
                 kubeconfig: Path, folder: Path, root: Path) -> None:
    """``gpuslice dra-driver`` for a kwok node (``root``: a short folder, for the unix
    sockets' 107-byte limit)."""
    from gpuslice.adapters.mps.fake import write_fake_control

    inv = fake_inventory(root / "gpus.yaml", gpus)
    mps = write_fake_control(root / "mps-control")
    (root / "shm").mkdir(exist_ok=True)
    comps.driver_roots[node] = root
    name = f"dra-driver-{node}"
    comps.drivers[node] = name
    comps.add(Managed(name, cli(
        "dra-driver", "--node", node, "--fake-gpus", str(inv), "--kubeconfig", str(kubeconfig),
        "--kubelet-dir", str(root / "k"), "--cdi-dir", str(root / "cdi"),
        "--mps-pipe-dir", str(root / "mps"), "--mps-shm-dir", str(root / "shm"),
        "--mps-binary", str(mps), "--metrics", "off",
        *[x for m in modes for x in ("--gpu-mode", m)]),
        folder / f"{name}.log"))


def wait_for(what: str, check: Callable[[], bool], timeout_s: float,
             every_s: float = 0.5) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
