"""Shared builders for the extender's tests: scheduler-shaped nodes and pods, the extender
served over HTTP on loopback, and a bind over it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.assignment import ANNOTATION
from gpuslice.services.extender import ExtenderState, make_app

KEY = b"test-key-0123456789abcdef"
MODELS = ["T4", "V100M32", "A100-80GB", "H100-SXM"]


def node(name: str, model: str, gpus: int = 8) -> dict[str, Any]:
    inv = [{"uuid": f"GPU-{name}-{i}", "index": i, "model": model, "memoryMiB": 16384}
           for i in range(gpus)]
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"gpuslice.io/inventory": json.dumps(inv)}}}


def mig_node(name: str, instances: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """A node with one MIG-enabled A100-80GB (GPU-m0) holding ``instances``: (UUID, profile,
    start, MiB)."""
    inv = [{"uuid": "GPU-m0", "index": 0, "model": "A100-80GB", "memoryMiB": 81920,
            "mig": [{"uuid": u, "profile": p, "start": st, "memoryMiB": mib}
                    for u, p, st, mib in instances]}]
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"gpuslice.io/inventory": json.dumps(inv)}}}


def pod(name: str, milli: int = 500, gpus: int = 1, model: str = "",
        ns: str = "default", isolation: str = "") -> dict[str, Any]:
    ann = {"gpuslice.io/gpu-model": model} if model else {}
    if isolation:
        ann["gpuslice.io/isolation"] = isolation
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": ann},
            "spec": {"containers": [{"name": "main", "resources": {
                "limits": {"gpuslice.io/gpu": str(gpus), "gpuslice.io/gpu-milli": str(milli)},
                "requests": {"cpu": "500m", "memory": "1Gi"}}}]}}


def reasons(res: dict[str, Any]) -> dict[str, str]:
    """Every node a filter answer refused and why, resolvable by preemption or not."""
    return {**res["FailedNodes"], **res["FailedAndUnresolvableNodes"]}


def clock() -> str:
    return "2026-11-22T18:00:00Z"


async def serving(api: FakeApiServer,
                  body: Callable[[str, ExtenderState], Awaitable[None]],
                  narrow: bool = False, client: Any = None) -> None:
    """The extender over HTTP on loopback while ``body`` runs; its filter keeps every node
    that fits unless ``narrow`` (the deployed default, tested on its own). ``client``: what
    the extender talks to ``api`` through (by default the fake itself, in-process)."""
    state = ExtenderState(client or api, KEY, clock=clock, narrow=narrow)
    runner = web.AppRunner(make_app(state))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await body(f"http://127.0.0.1:{port}", state)
    finally:
        await runner.cleanup()


async def post(session: aiohttp.ClientSession, url: str, doc: Any) -> tuple[int, Any]:
    async with session.post(url, data=json.dumps(doc) if not isinstance(doc, bytes) else doc,
                            headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def bound(session: aiohttp.ClientSession, url: str, api: FakeApiServer,
                pod_obj: dict[str, Any], node_name: str) -> Any:
    """Bind over HTTP (it must succeed); the assignment written on the pod."""
    meta = pod_obj["metadata"]
    st, res = await post(session, url + "/bind", {
        "PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
        "Node": node_name})
    assert st == 200 and res["Error"] == "", res
    return decode(api.get_pod(meta["namespace"], meta["name"])["metadata"]["annotations"]
                  [ANNOTATION])


def small_cluster() -> FakeApiServer:
    api = FakeApiServer()
    api.add_node(node("a", "T4", 2))
    api.add_node(node("b", "A100-80GB", 2))
    api.add_pod(pod("big", 700))
    return api
