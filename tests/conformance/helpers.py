"""A node as the upstream components see it: node agent (device plugin over gRPC on a unix
socket), the kubelet's device manager (``tests.conformance.kubelet``), and the extender's
state over the same API server fake."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.devices import GpuDevice
from gpuslice.services.device_plugin import PluginConfig, wait_for
from gpuslice.services.extender import ExtenderState
from gpuslice.services.node_agent import NodeAgent
from tests.conformance.kubelet import CheckingKubelet, DeviceManager

KEY = b"conformance-key-0123456789"
RESOURCE = "gpuslice.io/gpu"


def clock() -> str:
    return "2026-11-22T18:00:00.000000Z"


@dataclass
class NodeRig:
    name: str
    agent: NodeAgent
    kubelet: CheckingKubelet
    dm: DeviceManager
    sock_dir: Path


@contextmanager
def node_rig(api: FakeApiServer, name: str, gpus: list[GpuDevice], *, replicas: int = 10,
             **cfg: Any) -> Iterator[NodeRig]:
    """A node ``name`` with ``gpus``: its agent registered with a checking kubelet, its
    inventory published on the API server."""
    with tempfile.TemporaryDirectory(prefix=f"cf-{name}-") as d:
        sock_dir = Path(d)
        if name not in {n["metadata"]["name"] for n in api.list_nodes()}:
            api.add_node({"metadata": {"name": name}})
        kubelet = CheckingKubelet(sock_dir).start()  # type: ignore[assignment]
        assert isinstance(kubelet, CheckingKubelet)
        agent = NodeAgent(PluginConfig(name, sock_dir, KEY, replicas=replicas, **cfg),
                          FakeNvml(list(gpus)), api)
        for s in agent.servers:
            s.start()
        agent.publish()
        try:
            assert kubelet.registered.wait(5)
            assert wait_for(lambda: bool(kubelet.lists), 5)
            yield NodeRig(name, agent, kubelet, DeviceManager(kubelet, RESOURCE), sock_dir)
        finally:
            agent.stop()
            kubelet.stop()


def gpus(node: str, n: int, model: str = "A100-80GB", mib: int = 81920) -> list[GpuDevice]:
    return [GpuDevice(i, f"GPU-{node}-{i}", f"NVIDIA {model}", model, mib) for i in range(n)]


def container(name: str, gpu: int = 0, milli: int = 0, mem: int = 0,
              sidecar: bool = False, cpu: str = "100m") -> dict[str, Any]:
    limits: dict[str, str] = {}
    if gpu:
        limits[RESOURCE] = str(gpu)
    if milli:
        limits["gpuslice.io/gpu-milli"] = str(milli)
    if mem:
        limits["gpuslice.io/gpu-memory"] = str(mem)
    c: dict[str, Any] = {"name": name, "image": "img",
                         "resources": {"limits": limits, "requests": {"cpu": cpu}}}
    if sidecar:
        c["restartPolicy"] = "Always"
    return c


def make_pod(name: str, containers: list[dict[str, Any]],
             init: list[dict[str, Any]] | None = None, *, ns: str = "ml",
             annotations: dict[str, str] | None = None, priority: int | None = None,
             overhead: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulerName": "gpuslice-scheduler", "containers": containers}
    if init:
        spec["initContainers"] = init
    if priority is not None:
        spec["priority"] = priority
    if overhead:
        spec["overhead"] = overhead
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": annotations or {}},
            "spec": spec}


def schedule(api: FakeApiServer, state: ExtenderState, pod: dict[str, Any],
             node: str) -> dict[str, Any]:
    """Create ``pod``, filter it on ``node`` and bind it there (the extender's verbs, in
    process); the bound pod."""
    p = api.add_pod(pod)
    meta = p["metadata"]
    keep, failed = state.filter(p, [node])
    assert keep == [node], failed
    err = state.bind(meta["namespace"], meta["name"], meta["uid"], node)
    assert err == "", err
    return api.get_pod(meta["namespace"], meta["name"])


def extender(api: FakeApiServer, narrow: bool = True) -> ExtenderState:
    return ExtenderState(api, KEY, clock=clock, narrow=narrow)


async def serving(api: FakeApiServer, body: Any, narrow: bool = True) -> None:
    """The extender over real HTTP on loopback (signing with the node agents' key) while
    ``body(url, state)`` runs."""
    from aiohttp import web

    from gpuslice.services.extender import make_app

    state = extender(api, narrow)
    runner = web.AppRunner(make_app(state))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await body(f"http://127.0.0.1:{port}", state)
    finally:
        await runner.cleanup()
