"""The cluster of tests/reconfig and its switch under load, shared by the tests and by
benchmarks/reconfig_under_load.py: 4 nodes x 4 A100-80GB in MIG, the real node agents, extender
(HTTP) and router (HTTP), MPS replicas of two services in-process."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from gpuslice.adapters.http.router_admin import HttpRouter
from gpuslice.adapters.kube.fake import ApiConflict
from gpuslice.adapters.kube.objects import CORDONED_ANNOTATION
from gpuslice.core.routing_config import parse_router_config
from gpuslice.demo.cluster import (
    Cluster,
    NodeSpec,
    gpu_pod,
    router_config_from_pods,
)
from gpuslice.demo.runtime import EventLog, InProcessRuntime
from gpuslice.services.reconfig import PLURAL, ReconfigController
from gpuslice.services.router import start_router

INFERENCE = ",".join(f"1g.10gb@{i}" for i in range(7))
BATCH = "7g.80gb@0"
SERVICES = [{"name": "alpha", "slo_ms": 300, "models": ["alpha"]},
            {"name": "beta", "slo_ms": 300, "models": ["beta"]}]


def schedule(override: str | None = None, drain_s: float = 0.3) -> dict[str, Any]:
    """A day/night SliceSchedule; without a router to ask, the controller waits ``drain_s``
    for the old pods to drain."""
    return {"apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceSchedule",
            "metadata": {"name": "day-night", "namespace": "gpuslice"},
            "spec": {"selector": {"gpuModels": ["A100-80GB"]},
                     "layouts": {"inference": {"mig": {"mig-devices": {"1g.10gb": 7}}},
                                 "batch": {"mig": {"mig-devices": {"7g.80gb": 1}}}},
                     "windows": [{"layout": "inference", "start": "08:00", "end": "20:00"}],
                     "default": "batch", "override": override, "drainTimeoutSeconds": drain_s}}


@contextlib.contextmanager
def cluster(tmp_path: Path, nodes: int, gpus: int, replicas: int,
            mig: str | None = INFERENCE, **over: Any) -> Iterator[Cluster]:
    """A100-80GB nodes in ``mig`` layout (None: MIG disabled), ``replicas`` MPS pods of alpha
    and beta (inside MIG instances when MIG is enabled); ``over``: other Cluster fields (its
    API server, the components' clients)."""
    c = Cluster(tmp_path, uuid.uuid4().hex[:8], b"reconfig-test-key-0123456789", EventLog(),
                runtime=InProcessRuntime(), agent_poll_s=0.05, **over)
    try:
        for i in range(nodes):
            c.add_node(NodeSpec(f"n{i}", ("A100-80GB",) * gpus, mig=mig))
        c.start_extender()
        names = []
        for svc in ("alpha", "beta"):
            for k in range(replicas):
                c.api.add_pod(gpu_pod(f"{svc}-{k}", service=svc, model="resnet50", milli=142,
                                      memory_mib=9000, gpu_models="A100-80GB", batch=2))
                names.append(f"demo/{svc}-{k}")
        if not wait(lambda: all(c.container_of(n) for n in names), 60):
            raise RuntimeError(f"replicas did not start: {c.log.tail(10)}")
        yield c
    finally:
        c.stop()


def wait(pred: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


@contextlib.asynccontextmanager
async def routed_pods(c: Cluster, services: list[dict[str, Any]]) -> AsyncIterator[Any]:
    """The real router (HTTP, admin port) in front of the cluster's running pods, following
    them as they come, go and drain (as it would follow EndpointSlices)."""
    cfg = router_config_from_pods(c, services, health_interval_s=0.2)
    app = await start_router(parse_router_config(cfg), admin_port=0)

    async def follow() -> None:
        last = cfg
        while True:
            await asyncio.sleep(0.05)
            now = router_config_from_pods(c, services, health_interval_s=0.2)
            if now != last and all(x["replicas"] for x in now["services"]):
                app.router.apply(parse_router_config(now))
                last = now

    task = asyncio.create_task(follow())
    try:
        yield app
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await app.close()


def layouts(c: Cluster) -> dict[str, str]:
    from gpuslice.core.catalog import lookup
    from gpuslice.core.mig import MigPlacement
    from gpuslice.core.reconfig import layout_text

    geo = lookup("A100-80GB").mig  # type: ignore[union-attr]
    assert geo is not None
    out = {}
    for n in c.nodes.values():
        for g in n.nvml.devices():
            out[g.uuid] = layout_text([MigPlacement(s, geo.profile(p))
                                       for p, s in n.nvml.mig_layout(g.uuid)])
    return out


def set_override(c: Cluster, layout: str | None) -> None:
    while True:
        obj = c.api.get_custom(PLURAL, "gpuslice", "day-night")
        obj["spec"]["override"] = layout
        try:
            c.api.replace_custom(PLURAL, obj)
            return
        except ApiConflict:  # a concurrent status update: read again
            continue


def status(c: Cluster) -> dict[str, Any]:
    return c.api.get_custom(PLURAL, "gpuslice", "day-night").get("status") or {}


def running(c: Cluster, svc: str) -> int:
    return sum(1 for p in c.api.list_pods()
               if (p["metadata"].get("labels") or {}).get("gpuslice.io/service") == svc
               and (p.get("status") or {}).get("endpoint"))


@dataclass
class SwitchRun:
    """What one run under load saw: (service, seconds, HTTP status) per request, seconds per
    GPU per target layout, replica moves, how long the middle part (the switch there and back,
    or the plain wait) took, and what was found wrong at the end."""
    samples: list[tuple[str, float, int]]
    per_gpu: dict[str, list[float]]
    moves: int
    middle_s: float
    running: dict[str, int]
    wrong: list[str] = field(default_factory=list)

    def p99_ms(self, svc: str) -> float:
        return float(np.percentile([x for s, x, _ in self.samples if s == svc], 99)) * 1000

    @property
    def failed(self) -> list[tuple[str, float, int]]:
        return [s for s in self.samples if s[2] != 200]


def switch_under_load(tmp_path: Path, reconfigure: bool = True, hold_s: float = 0.0,
                      rate: float = 80.0) -> SwitchRun:
    """An open-loop load of ``rate`` req/s per service through the router while the
    controller switches all 16 GPUs from 7 x 1g to 1 x 7g and back (``reconfigure``), or
    while nothing happens for ``hold_s`` seconds (the baseline)."""
    with cluster(tmp_path, nodes=4, gpus=4, replicas=10) as c:
        c.api.replace_custom(PLURAL, schedule(override="batch" if reconfigure else None))
        took: list[float] = []
        wrong: list[str] = []
        samples: list[tuple[str, float, int]] = []
        per_gpu: dict[str, list[float]] = {}

        async def go() -> None:
            async with routed_pods(c, SERVICES) as app:
                stop = asyncio.Event()

                async def load(session: aiohttp.ClientSession, svc: str, rate: float) -> None:
                    rng = np.random.default_rng(len(svc))
                    loop = asyncio.get_running_loop()
                    nxt = loop.time()
                    pending: set[asyncio.Task[None]] = set()

                    async def one() -> None:
                        t0 = time.monotonic()
                        try:
                            async with session.post(f"http://127.0.0.1:{app.port}/v2/models/"
                                                    f"{svc}/infer", data=b"{}") as r:
                                await r.read()
                                code = r.status
                        except aiohttp.ClientError:
                            code = 0
                        samples.append((svc, time.monotonic() - t0, code))

                    while not stop.is_set():
                        nxt += float(rng.exponential(1 / rate))
                        await asyncio.sleep(max(0.0, nxt - loop.time()))
                        t = asyncio.create_task(one())
                        pending.add(t)
                        t.add_done_callback(pending.discard)
                    await asyncio.gather(*pending)

                ctl = ReconfigController(c.api, router=HttpRouter(f"http://127.0.0.1:"
                                                                  f"{app.admin_port}"))

                def drive() -> None:
                    for target, layout in (("batch", BATCH), ("inference", INFERENCE)):
                        if target == "inference":
                            set_override(c, "inference")
                        end = time.monotonic() + 180
                        while time.monotonic() < end:
                            ctl.step()
                            st = status(c)
                            if st.get("target") == target and \
                                    (st.get("summary") or {}).get("inTarget") == 16:
                                break
                            time.sleep(0.05)
                        for g in (st.get("gpus") or {}).values():
                            if g.get("phase") == "Done" and "seconds" in g:
                                per_gpu.setdefault(target, []).append(g["seconds"])
                        if any(v != layout for v in layouts(c).values()):
                            wrong.append(f"{target}: {layouts(c)}")

                async with aiohttp.ClientSession() as session:
                    tasks = [asyncio.create_task(load(session, "alpha", rate)),
                             asyncio.create_task(load(session, "beta", rate))]
                    await asyncio.sleep(1.0)
                    t0 = time.monotonic()
                    if reconfigure:
                        await asyncio.get_running_loop().run_in_executor(None, drive)
                    else:
                        await asyncio.sleep(hold_s)
                    took.append(time.monotonic() - t0)
                    await asyncio.sleep(0.5)
                    stop.set()
                    await asyncio.gather(*tasks)

        asyncio.run(go())
        if any((n["metadata"].get("annotations") or {}).get(CORDONED_ANNOTATION)
               for n in c.api.list_nodes()):
            wrong.append("a node still has cordoned GPUs")
        return SwitchRun(samples, per_gpu, int(status(c).get("moves", 0)),
                         took[0] if took else 0.0,
                         {svc: running(c, svc) for svc in ("alpha", "beta")}, wrong)
