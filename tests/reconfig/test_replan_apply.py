"""Applying a re-plan on the fake cluster (real node agents, extender and router over HTTP;
a stand-in for the Deployment/ReplicaSet controllers): added slices first, then the removed
ones drained and deleted, with no failed request under load."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import numpy as np

from gpuslice.adapters.http.router_admin import HttpRouter
from gpuslice.core.planner import FleetType, Plan, PlanOptions, Service
from gpuslice.core.replay import plan_and_check, replan
from gpuslice.core.speedmodel import profiles
from gpuslice.planning.apply import REPLICA_LABEL, apply_plan
from tests.reconfig.harness import cluster, routed_pods
from tests.reconfig.test_reconfig import FakeController

NS = "ml"
PROFILES = profiles(["A100-80GB"], ["resnet50", "bert-base"])
SERVICES = [Service("resnet50", "resnet50", 400, 150), Service("bert", "bert-base", 120, 300)]
FLEET = [FleetType("A100-80GB")]
ROUTED = [{"name": s.name, "slo_ms": 2000, "models": [s.name]} for s in SERVICES]


class FakeDeployments(FakeController):
    """The Deployment and ReplicaSet controllers as far as these tests need them: one pod per
    Deployment from its template, and a deleted Deployment's pods deleted."""

    def reconcile(self) -> None:
        deps = {d["metadata"]["name"]: d for d in self.c.api.list_deployments(NS)}
        pods = [p for p in self.c.api.list_pods() if p["metadata"]["namespace"] == NS]
        have = {(p["metadata"].get("labels") or {}).get(REPLICA_LABEL) for p in pods}
        for name, d in deps.items():
            if name not in have:
                tpl = d["spec"]["template"]
                self.c.api.add_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {
                    "name": f"{name}-x", "namespace": NS,
                    "labels": dict(tpl["metadata"]["labels"]),
                    "annotations": dict(tpl["metadata"].get("annotations") or {})},
                    "spec": dict(tpl["spec"])})
        for p in pods:
            if (p["metadata"].get("labels") or {}).get(REPLICA_LABEL) not in deps:
                self.c.api.delete_pod(NS, p["metadata"]["name"])


def test_a_replan_is_applied_adds_first_without_failing_a_request(tmp_path: Path) -> None:
    current = plan_and_check(PROFILES, SERVICES, FLEET, PlanOptions(),
                             rng=np.random.default_rng(1)).plan
    less = [Service(s.name, s.model, s.rate * 0.4, s.slo_ms) for s in SERVICES]
    new = replan(PROFILES, current, less, rng=np.random.default_rng(2), fleet=FLEET).plan
    with cluster(tmp_path, nodes=2, gpus=2, replicas=0, mig=None) as c, FakeDeployments(c):
        first = apply_plan(c.api, Plan((), "gpus", 0, 0, "none"), current, namespace=NS,
                           ready_timeout_s=60, poll_s=0.05)
        assert any("ready" in line for line in first)
        codes: list[int] = []

        async def go() -> list[str]:
            async with routed_pods(c, ROUTED) as app:
                stop = asyncio.Event()

                async def load(session: aiohttp.ClientSession) -> None:
                    while not stop.is_set():
                        for svc in ("resnet50", "bert"):
                            async with session.post(f"http://127.0.0.1:{app.port}/v2/models/"
                                                    f"{svc}/infer", data=b"{}") as r:
                                await r.read()
                                codes.append(r.status)
                        await asyncio.sleep(0.01)

                async with aiohttp.ClientSession() as session:
                    tasks = [asyncio.create_task(load(session))]
                    await asyncio.sleep(0.5)
                    router = HttpRouter(f"http://127.0.0.1:{app.admin_port}")
                    done = await asyncio.get_running_loop().run_in_executor(
                        None, lambda: apply_plan(c.api, current, new, namespace=NS,
                                                 router=router, ready_timeout_s=60,
                                                 drain_timeout_s=20, poll_s=0.05))
                    await asyncio.sleep(0.5)
                    stop.set()
                    await asyncio.gather(*tasks)
                return done

        done = asyncio.run(go())
        assert codes and set(codes) == {200}, sorted(set(codes))
        names = {d["metadata"]["name"] for d in c.api.list_deployments(NS)}
        from gpuslice.planning.export import manifests

        assert names == {d["metadata"]["name"] for d in manifests(new, NS)
                         if d["kind"] == "Deployment"}
        assert any(line.startswith("deleted Deployment") for line in done)
        end = time.monotonic() + 10
        while time.monotonic() < end and len([p for p in c.api.list_pods()
                                              if p["metadata"]["namespace"] == NS]) != len(names):
            time.sleep(0.05)
        assert len([p for p in c.api.list_pods() if p["metadata"]["namespace"] == NS]) == \
            len(names)


def test_a_plan_on_gpus_in_its_mig_layouts_puts_every_slice_inside_an_instance(
        tmp_path: Path) -> None:
    """The planner's manifests on MIG-enabled GPUs in the plan's own layouts (what its
    mig-parted config makes): each planned slice's pod fits an instance through the extender,
    as an MPS slice inside it, and runs."""
    import uuid

    from gpuslice.adapters.kube.annotation import decode
    from gpuslice.core.assignment import ANNOTATION
    from gpuslice.demo.cluster import Cluster, NodeSpec
    from gpuslice.demo.runtime import EventLog, InProcessRuntime

    plan = plan_and_check(PROFILES, SERVICES, FLEET, PlanOptions(),
                          rng=np.random.default_rng(1)).plan
    c = Cluster(tmp_path, uuid.uuid4().hex[:8], b"plan-on-mig-key-0123456789ab", EventLog(),
                runtime=InProcessRuntime(), agent_poll_s=0.05)
    try:
        for g in plan.gpus:
            layout = ",".join(f"{s.placement.profile.name}@{s.placement.start}" for s in g.slots)
            c.add_node(NodeSpec(f"n{g.index}", (g.gpu,), mig=layout))
        c.start_extender()
        with FakeDeployments(c):
            done = apply_plan(c.api, Plan((), "gpus", 0, 0, "none"), plan, namespace=NS,
                              ready_timeout_s=60, poll_s=0.05)
        assert any("ready" in line for line in done), done
        pods = [p for p in c.api.list_pods() if p["metadata"]["namespace"] == NS]
        planned = sum(len(s.parts) for g in plan.gpus for s in g.slots)
        assert len(pods) == planned
        for p in pods:
            share = decode(p["metadata"]["annotations"][ANNOTATION]).containers[0].gpus[0]
            assert share.mig_profile, p["metadata"]["name"]  # inside an instance
    finally:
        c.stop()
