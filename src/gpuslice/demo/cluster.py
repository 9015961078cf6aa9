"""The demo cluster: real gpuslice services, with the kubelet, the scheduler and the GPUs simulated.

- The API server is :class:`~gpuslice.adapters.kube.fake.FakeApiServer` (in memory).
- Each node runs the real :class:`~gpuslice.services.node_agent.NodeAgent` on fake NVML; it
  serves the kubelet device-plugin API over gRPC on a unix socket in the node's own directory.
- :class:`KubeletSim` is the kubelet side of a node: a Registration server on ``kubelet.sock``
  that dials the plugin back, follows ListAndWatch, and admits each pod bound to its node as the
  kubelet does (GetPreferredAllocation, then Allocate with device IDs it tracks as free), then
  starts the container: a simulated replica process whose speed follows the slice in the
  Allocate response (an LLM's engine for a pod annotated as a generative, OpenAI-style one).
  Crashed containers are restarted after a back-off, with the same devices.
- The real extender serves HTTP on loopback; :class:`SchedulerSim` sends it the scheduler's
  filter / prioritize / bind calls for every pending gpuslice pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer, KubePort
from gpuslice.adapters.kube.objects import GPU, INVENTORY_ANNOTATION, pod_request
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.kubelet import deviceplugin_pb2_grpc as pbg
from gpuslice.adapters.nvml.port import FakeNvml, NvmlPort
from gpuslice.core import catalog
from gpuslice.core.assignment import ANNOTATION
from gpuslice.core.devices import GpuDevice, MigInstance
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.mig import parse_layout
from gpuslice.core.speedmodel import service_time_s
from gpuslice.demo.runtime import (
    Container,
    EventLog,
    InProcessRuntime,
    ProcessRuntime,
    Runtime,
    llm_engine,
)
from gpuslice.services.device_plugin import PluginConfig
from gpuslice.services.node_agent import NodeAgent

MODEL = "demo.gpuslice.io/model"
BATCH = "demo.gpuslice.io/batch"  # a generative replica's: its sequences at most
API = "demo.gpuslice.io/api"  # "openai": a generative replica (fake_llm), else a fake_replica


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: tuple[str, ...]  # catalogue model per GPU
    mig: str | None = None  # MIG enabled on every GPU, with this layout ("1g.10gb@0,...")


class KubeletSim(pbg.RegistrationServicer):
    """The kubelet side of one node (see the module docstring)."""

    def __init__(self, node: str, sock_dir: Path, api: FakeApiServer, log: EventLog,
                 run_id: str, gpu_models: dict[str, str], *, runtime: Runtime | None = None,
                 nvml: FakeNvml | None = None) -> None:
        self.node, self.dir, self.api, self.log = node, sock_dir, api, log
        self.run_id = run_id
        self.runtime: Runtime = runtime or ProcessRuntime()
        self.nvml = nvml  # the node's GPUs: containers count as their clients
        self.gpu_models = gpu_models  # GPU UUID -> catalogue model
        self.devices: list[pb.Device] = []
        self.allocated: dict[str, list[str]] = {}  # pod -> device IDs
        self.containers: dict[str, Container] = {}
        self.failed: dict[str, str] = {}  # pod -> why admission failed
        self._stub: pbg.DevicePluginStub | None = None
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.registered = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pbg.add_RegistrationServicer_to_server(self, self.server)  # type: ignore[no-untyped-call]
        self.server.add_insecure_port(f"unix://{sock_dir / 'kubelet.sock'}")
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"kubelet-{node}")

    # -- Registration, as the kubelet's plugin manager does it ---------------------------------

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"version: expected v1beta1, got {request.version}")
        self._channel = grpc.insecure_channel(f"unix://{self.dir / request.endpoint}")
        stub = pbg.DevicePluginStub(self._channel)  # type: ignore[no-untyped-call]
        stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        self._stub = stub

        def follow() -> None:
            with contextlib.suppress(grpc.RpcError):
                for resp in stub.ListAndWatch(pb.Empty()):
                    with self._lock:
                        self.devices = list(resp.devices)

        threading.Thread(target=follow, daemon=True).start()
        self.log.add("kubelet", f"{self.node}: device plugin registered {request.resource_name}")
        self.registered.set()
        return pb.Empty()

    def start(self) -> KubeletSim:
        self.server.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.containers.values():
            self.runtime.stop(c)
        self.server.stop(grace=None)
        if self._channel is not None:
            self._channel.close()

    # -- pods ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._sync()
            except (GpusliceError, grpc.RpcError) as exc:
                self.log.add("error", f"kubelet {self.node}: {exc}")

    def _sync(self) -> None:
        pods = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p
                for p in self.api.list_pods()
                if (p.get("spec") or {}).get("nodeName") == self.node}
        # the kubelet sees pods in the order they were bound, and the device plugin executes
        # the oldest waiting assignment first: admit in that order
        for key, p in sorted(pods.items(), key=lambda kv: _bind_order(kv[1])):
            if key not in self.containers and key not in self.failed and self._stub is not None:
                self._admit(key, p)
        for key in list(self.containers):
            if key not in pods:  # deleted: stop the container, free its devices
                c = self.containers.pop(key)
                self.runtime.stop(c)
                self._clients(c, -1)
                self.allocated.pop(key, None)
        now = time.monotonic()
        for c in self.containers.values():
            if not self.runtime.alive(c) and now - c.started_at > 1.0:
                code = c.proc.returncode if c.proc is not None else "killed"
                self.log.add("kubelet", f"{self.node}: container of {c.pod} exited "
                             f"({code}); restarting it on the same slice")
                self._status(c, ready=False)
                c.restarts += 1
                self._run(c)

    def _admit(self, key: str, pod: dict[str, Any]) -> None:
        assert self._stub is not None
        try:
            req = pod_request(pod)
        except ValidationError as exc:
            self.failed[key] = str(exc)
            return
        if req is None:
            return
        n = req.gpus
        with self._lock:
            taken = {d for ids in self.allocated.values() for d in ids}
            free = [d.ID for d in self.devices if d.health == "Healthy" and d.ID not in taken]
        # like the kubelet: a container needs n devices of the resource, on distinct GPUs here
        if len({d.split("::")[0] for d in free}) < n:
            return  # not enough devices advertised yet; the next sync tries again
        pref = self._stub.GetPreferredAllocation(pb.PreferredAllocationRequest(
            container_requests=[pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=free, allocation_size=n)]), timeout=5)
        chosen = list(pref.container_responses[0].deviceIDs)
        try:
            resp = self._stub.Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=chosen)]), timeout=5)
        except grpc.RpcError as exc:
            self.failed[key] = f"Allocate: {exc.details()}"
            self.log.add("error", f"{self.node}: Allocate for {key} refused: {exc.details()}")
            return
        envs = dict(resp.container_responses[0].envs)
        self.allocated[key] = chosen
        if envs.get("GPUSLICE_ASSIGNMENT", key) != key:
            self.log.add("error", f"{self.node}: Allocate for {key} executed the assignment of "
                         f"{envs['GPUSLICE_ASSIGNMENT']}")
        ann = pod["metadata"].get("annotations") or {}
        uuids = [u for u in envs.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if u]
        seen = [self._device(u) for u in uuids] or [("", "?", 1.0, "")]
        gpu_model, fraction = seen[0][1], seen[0][2]
        pct = int(envs.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"))
        model = str(ann.get(MODEL, "embedder"))
        batch = int(ann.get(BATCH, "1"))
        share = fraction * pct / 100  # of the whole GPU: a MIG instance's part, then MPS's
        try:
            llm = llm_engine(model, share, batch) if ann.get(API) == "openai" else None
        except ValidationError as exc:
            self.failed[key] = str(exc)
            self.allocated.pop(key, None)
            self.log.add("error", f"{self.node}: {key}: {exc}")
            return
        ms = llm.step_ms if llm is not None else \
            1000 * service_time_s(model, gpu_model, share, batch)
        c = Container(key, str((pod["metadata"].get("labels") or {}).get(
            "gpuslice.io/service", key)), model, gpu_model, round(1000 * share), batch, ms,
            envs, gpus=tuple(g for g, _, _, _ in seen if g), llm=llm)
        self.containers[key] = c
        self._clients(c, +1)
        self._run(c)
        where = ",".join(f"{g} {inst}".strip() for g, _, _, inst in seen)
        inside = f"{pct}% of {seen[0][3]}" if seen[0][3] else f"{pct}% of the SMs"
        self.log.add("kubelet", f"{self.node}: started {key} on {where} "
                     f"({gpu_model}, {inside}, {_what_runs(c)})")

    def _device(self, uuid: str) -> tuple[str, str, float, str]:
        """(GPU UUID, model, part of the GPU, MIG instance) of a visible device: a GPU, or a
        MIG instance of one (its compute slices' part of the GPU)."""
        if uuid in self.gpu_models:
            return uuid, self.gpu_models[uuid], 1.0, ""
        for g in self.nvml.devices() if self.nvml is not None else []:
            for m in g.mig:
                known = catalog.lookup(g.model)
                if m.uuid == uuid and known is not None and known.mig is not None:
                    part = known.mig.profile(m.profile).compute_slices / known.mig.compute_slices
                    return g.uuid, g.model, part, m.profile
        return uuid, "?", 1.0, ''

    def _run(self, c: Container) -> None:
        c.started_at = time.monotonic()
        try:
            c.port = self.runtime.start(c, self.run_id)
        except GpusliceError as exc:
            self.log.add("error", f"{self.node}: {exc}")
            return
        self._status(c, ready=True)

    def _clients(self, c: Container, delta: int) -> None:
        if self.nvml is not None:
            for u in c.gpus:
                self.nvml.set_clients(u, max(0, self.nvml.clients(u) + delta))

    def _status(self, c: Container, ready: bool) -> None:
        """The pod's status as the kubelet reports it; ``endpoint`` stands in for the pod IP
        and container port (replicas share 127.0.0.1, so each has its own port)."""
        ns, name = c.pod.split("/", 1)
        status = {"phase": "Running", "podIP": "127.0.0.1",
                  "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if ready:
            status["endpoint"] = f"http://127.0.0.1:{c.port}"
        with contextlib.suppress(GpusliceError):  # deleted meanwhile
            self.api.set_pod_status(ns, name, status)

    def kill(self, pod: str) -> int | None:
        """Crash a container (SIGKILL), as a faulty replica would."""
        c = self.containers.get(pod)
        return None if c is None else self.runtime.kill(c)


def _what_runs(c: Container) -> str:
    if c.llm is None:
        return f"batch {c.batch}: {c.service_ms:.1f} ms/batch"
    e = c.llm.spec
    return (f"LLM {c.model} as on an A100 {c.llm.slice}: prefill {e.prefill_tps:.0f} tokens/s, "
            f"{c.service_ms:.1f} ms per token at {e.max_seqs} sequences, KV cache "
            f"{e.kv_tokens} tokens")


def _bind_order(pod: dict[str, Any]) -> tuple[str, str]:
    text = (pod["metadata"].get("annotations") or {}).get(ANNOTATION)
    if not text:
        return ("~", pod["metadata"]["name"])
    try:
        return (decode(text).bind_time, pod["metadata"]["name"])
    except GpusliceError:
        return ("~", pod["metadata"]["name"])


class SchedulerSim:
    """kube-scheduler's side of the extender protocol: for each pending gpuslice pod, POST
    /filter with every node, /prioritize with the survivors when there are several (a lone
    feasible node is taken unscored, as kube-scheduler does), and /bind to the best."""

    def __init__(self, api: FakeApiServer, url: str, log: EventLog) -> None:
        self.api, self.url, self.log = api, url, log
        self.pending: dict[str, dict[str, str]] = {}  # pod -> node -> why not
        # pod -> (node, its extender score 0..10; None: the lone node the filter kept)
        self.placed: dict[str, tuple[str, int | None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="scheduler")

    def _post(self, path: str, doc: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def start(self) -> SchedulerSim:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.schedule_once()
            except (OSError, ValueError, urllib.error.URLError) as exc:
                self.log.add("error", f"scheduler: {exc}")

    def schedule_once(self) -> None:
        nodes = [n["metadata"]["name"] for n in self.api.list_nodes()]
        pods = [p for p in self.api.list_pods() if not (p.get("spec") or {}).get("nodeName")]
        pods.sort(key=lambda p: -_milli(p))  # big slices first, as a bin packer would
        for p in pods:
            meta = p["metadata"]
            key = f"{meta['namespace']}/{meta['name']}"
            res = self._post("/filter", {"Pod": p, "NodeNames": nodes, "Nodes": None})
            fits = res.get("NodeNames") or []
            if not fits:
                # a node no preemption can help is listed apart; the scheduler keeps both
                # as the pod's reasons, the unresolvable one first (schedule_one.go,
                # findNodesThatPassExtenders)
                why = {**(res.get("FailedNodes") or {}),
                       **(res.get("FailedAndUnresolvableNodes") or {})}
                if self.pending.get(key) != why:
                    self.log.add("pending", f"{key} fits no node: " + "; ".join(
                        f"{n}: {r}" for n, r in sorted(why.items())))
                self.pending[key] = why
                continue
            score: int | None = None
            if len(fits) == 1:  # kube-scheduler scores no lone feasible node (schedule_one.go)
                host = fits[0]
                how = f"the one node of {len(nodes)} the filter kept"
            else:
                scores = self._post("/prioritize", {"Pod": p, "NodeNames": fits})
                best = max(scores, key=lambda h: (h["Score"], -fits.index(h["Host"])))
                host, score = best["Host"], int(best["Score"])
                how = (f"score {score}/10, the best of the {len(fits)} nodes of {len(nodes)} "
                       "the filter kept")
            out = self._post("/bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                       "PodUID": meta["uid"], "Node": host})
            if out.get("Error"):
                self.log.add("error", f"bind {key}: {out['Error']}")
                continue
            self.pending.pop(key, None)
            self.placed[key] = (host, score)
            self.log.add("bind", f"{key} -> {host} ({how})")


def _milli(pod: dict[str, Any]) -> int:
    try:
        req = pod_request(pod)
    except ValidationError:
        return 0
    return 0 if req is None else req.gpus * req.milli


@dataclass
class DemoNode:
    spec: NodeSpec
    nvml: NvmlPort
    agent: NodeAgent
    kubelet: KubeletSim
    thread: threading.Thread


@dataclass
class Cluster:
    """Everything the demo runs, and how to stop it."""

    root: Path
    run_id: str
    key: bytes
    log: EventLog
    api: FakeApiServer = field(default_factory=FakeApiServer)
    nodes: dict[str, DemoNode] = field(default_factory=dict)
    extender_url: str = ""
    scheduler: SchedulerSim | None = None
    runtime: Runtime = field(default_factory=ProcessRuntime)
    agent_poll_s: float = 1.0
    # the API client each component uses ("extender", "node-agent"), by default ``api``
    # itself; a test gives each its own client with its own credentials
    clients: Callable[[str], KubePort] | None = None
    _ext_loop: asyncio.AbstractEventLoop | None = None
    _ext_thread: threading.Thread | None = None

    def client(self, component: str) -> KubePort:
        return self.api if self.clients is None else self.clients(component)

    def start_extender(self, policy: str = "frag-strand") -> None:
        from gpuslice.services.extender import ExtenderState, bind_clock, serve

        state = ExtenderState(self.client("extender"), self.key, policy=policy,
                              clock=bind_clock)
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        port: list[int] = []

        def on_ready(p: int) -> None:
            port.append(p)
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(loop)
            task = loop.create_task(serve(state, "127.0.0.1", 0, ready=on_ready))
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)

        self._ext_loop = loop
        self._ext_thread = threading.Thread(target=run, daemon=True, name="extender")
        self._ext_thread.start()
        if not ready.wait(10):
            raise GpusliceError("the extender did not start")
        self.extender_url = f"http://127.0.0.1:{port[0]}"
        self.log.add("extender", f"serving filter/prioritize/bind on {self.extender_url}")
        self.scheduler = SchedulerSim(self.api, self.extender_url, self.log).start()

    def add_node(self, spec: NodeSpec, real: NvmlPort | None = None,
                 mps_binary: str = "nvidia-cuda-mps-control") -> DemoNode:
        """A node of simulated GPUs from ``spec``, or, with ``real``, of the GPUs that NVML
        port reports (this machine's): its node agent then starts real MPS daemons."""
        node_dir = self.root / spec.name
        node_dir.mkdir(parents=True)
        if real is not None:
            return self._start_node(spec, node_dir, real, None, mps_binary)
        gpus = []
        for i, m in enumerate(spec.gpus):
            model = catalog.lookup(m)
            if model is None:
                raise ValidationError("node gpus", "catalogue GPU models", m)
            uuid = f"GPU-{spec.name}-{i}"
            mig: tuple[MigInstance, ...] = ()
            if spec.mig is not None:
                if model.mig is None:
                    raise ValidationError("node mig", "a MIG-capable GPU model", m)
                mig = tuple(MigInstance(f"MIG-{uuid}-{p.start}", p.profile.name, p.start,
                                        p.profile.memory_mib)
                            for p in parse_layout(model.mig, spec.mig))
            gpus.append(GpuDevice(i, uuid, f"NVIDIA {model.name}", model.name,
                                  model.memory_mib, model.sms, model.compute_capability,
                                  spec.mig is not None, mig))
        nvml = FakeNvml(gpus)
        return self._start_node(spec, node_dir, nvml, nvml, None)

    def _start_node(self, spec: NodeSpec, node_dir: Path, nvml: NvmlPort,
                    fake: FakeNvml | None, mps_binary: str | None) -> DemoNode:
        gpus = nvml.devices()
        self.api.add_node({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": spec.name, "labels": {}, "annotations": {}}})
        kubelet = KubeletSim(spec.name, node_dir, self.api, self.log, self.run_id,
                             {g.uuid: g.model for g in gpus}, runtime=self.runtime,
                             nvml=fake).start()
        cfg = PluginConfig(spec.name, node_dir, self.key, replicas=10,
                           mps_pipe_dir=str(node_dir / "mps"))
        agent = NodeAgent(cfg, nvml, self.client("node-agent"), quiet_s=30.0,
                          poll_s=self.agent_poll_s,
                          mps=mps_binary is not None,
                          mps_binary=mps_binary or "nvidia-cuda-mps-control")
        thread = threading.Thread(target=agent.run, daemon=True, name=f"agent-{spec.name}")
        thread.start()
        if not kubelet.registered.wait(10):
            raise GpusliceError(f"the node agent of {spec.name} did not register: "
                                f"{agent.problems}")
        self._wait_inventory(spec.name)  # "joined" once the extender can know its GPUs
        node = DemoNode(spec, nvml, agent, kubelet, thread)
        self.nodes[spec.name] = node
        kind = "real NVML and MPS" if fake is None else "simulated"
        self.log.add("node", f"{spec.name} joined: {len(gpus)} x "
                     f"{gpus[0].model if gpus else '-'} ({kind})")
        return node

    def _wait_inventory(self, node: str, timeout_s: float = 10.0) -> None:
        """Until the node agent has published ``node``'s GPU inventory (a node said to have
        joined is one the extender can place on)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            ann = self.api.get_node(node)["metadata"].get("annotations") or {}
            if ann.get(INVENTORY_ANNOTATION):
                return
            time.sleep(0.02)

    def container_of(self, pod: str) -> tuple[DemoNode, Container] | None:
        for n in self.nodes.values():
            c = n.kubelet.containers.get(pod)
            if c is not None:
                return n, c
        return None

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        for n in self.nodes.values():
            n.kubelet.stop()
            n.agent.stop()
        if self._ext_loop is not None:
            loop = self._ext_loop
            for task in asyncio.all_tasks(loop):
                loop.call_soon_threadsafe(task.cancel)
            if self._ext_thread is not None:
                self._ext_thread.join(5)
        if isinstance(self.runtime, InProcessRuntime):
            self.runtime.close()


def router_config_from_pods(cluster: Cluster, services: list[dict[str, Any]],
                            health_interval_s: float = 0.5) -> dict[str, Any]:
    """A router config with the running pods of each service as replicas (the EndpointSlice
    view: ready pods, and draining pods that still serve their in-flight requests).
    ``services``: ``{name, slo_ms, models}`` each, or a generative service's entry
    (``api: openai``, its TTFT and TPOT SLOs...; its replicas get their token speeds); pods
    are matched by their ``gpuslice.io/service`` label."""
    from gpuslice.adapters.kube.objects import DRAINING_ANNOTATION

    reps: dict[str, list[dict[str, Any]]] = {s["name"]: [] for s in services}
    for p in cluster.api.list_pods():
        meta = p["metadata"]
        svc = (meta.get("labels") or {}).get("gpuslice.io/service")
        url = (p.get("status") or {}).get("endpoint")
        if svc not in reps or not url:
            continue
        draining = (meta.get("annotations") or {}).get(DRAINING_ANNOTATION) == "true"
        rep: dict[str, Any] = {"name": meta["name"], "url": url, "draining": draining}
        found = cluster.container_of(f"{meta['namespace']}/{meta['name']}")
        if found is not None:
            node, c = found
            rep.update({"gpu": c.gpu_model, "slice": f"{c.milli}m", "node": node.spec.name,
                        **_speed(c)})
        reps[svc].append(rep)
    return {"policy": "sed", "retry_post": False,
            "health": {"path": "/v2/health/ready", "interval_s": health_interval_s,
                       "timeout_s": 0.5, "unhealthy_after": 1, "healthy_after": 1},
            "services": [{**s, "replicas": reps[s["name"]]} for s in services]}


def _speed(c: Container) -> dict[str, Any]:
    """What the router is told of a replica's speed: a generative one's token speeds, else
    its concurrency and service time."""
    if c.llm is not None:
        return c.llm.router_fields()
    return {"concurrency": c.batch, "service_time_ms": round(c.service_ms, 3),
            "throughput_rps": round(1000 * c.batch / c.service_ms, 3)}


def gpu_pod(name: str, *, service: str, model: str, gpus: int = 1, milli: int = 1000,
            memory_mib: int = 0, gpu_models: str = "", batch: int = 1,
            namespace: str = "demo", extra: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod as a Deployment of the planner's manifests would create it."""
    limits = {GPU: str(gpus), "gpuslice.io/gpu-milli": str(milli)}
    if memory_mib:
        limits["gpuslice.io/gpu-memory"] = str(memory_mib)
    ann = {MODEL: model, BATCH: str(batch), "gpuslice.io/isolation": "any", **(extra or {})}
    if gpu_models:
        ann["gpuslice.io/gpu-model"] = gpu_models
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": ann,
                         "labels": {"gpuslice.io/service": service}},
            "spec": {"schedulerName": "gpuslice-scheduler", "containers": [{
                "name": "server", "image": "demo/fake-replica",
                "resources": {"limits": limits, "requests": {"cpu": "500m", "memory": "2Gi"}}}]}}
