"""A 50-pod mixed burst over two node agents and the extender, on the real transports.

kube-scheduler's side (extender.go Filter / Prioritize / Bind over HTTP, nodeCacheCapable)
is played for every pod at once; each node's kubelet (tests.conformance.kubelet, after
manager.go Allocate / devicesToAllocate / allocateContainerResources) admits the pods bound
to it over gRPC on unix sockets in the order the real kubelet would see them bound (their
resourceVersions: the order of its watch), while the extender's binds to one node run
concurrently. Whole GPUs, fractions, MIG instances, init-only
GPU pods and multi-container pods are mixed. Checked: every pod (they all fit) is bound and
admitted; no GPU holds more than 1000 milli at any pod's peak (effective-request rule); no
device goes to two pods; every container sees the GPU (or MIG instance) its own pod's
assignment names for it."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections import defaultdict
from typing import Any

import aiohttp

from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.assignment import ANNOTATION, verify
from gpuslice.core.devices import GpuDevice, MigInstance
from gpuslice.services.extender import ExtenderState
from tests.conformance import helpers
from tests.conformance.helpers import KEY, container, gpus, make_pod, node_rig
from tests.extender.helpers import post


def burst_pods(seed: int = 7) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two waves: the pods that need a unit to themselves (whole GPUs, MIG instances), then
    the shares in random order (a share may also go inside a MIG instance, as MPS)."""
    first = [make_pod(f"whole-{i}", [container("main", 1, 1000)]) for i in range(3)]
    first += [make_pod(f"mig-{i}", [container("main", 1, 142)],
                       annotations={"gpuslice.io/isolation": "mig"}) for i in range(4)]
    rest = [make_pod(f"frac-{i}", [container("main", 1, 50)]) for i in range(20)]
    rest += [make_pod(f"init-{i}", [container("main")], init=[container("warm", 1, 100)])
             for i in range(10)]
    rest += [make_pod(f"multi-{i}", [container("a", 1, 25), container("b", 1, 25)],
                      init=[container("prep", 1, 50)]) for i in range(13)]
    random.Random(seed).shuffle(rest)
    return first, rest


def test_fifty_pod_mixed_burst_over_two_nodes() -> None:
    api = FakeApiServer()
    mig_gpu = GpuDevice(3, "GPU-n2-mig", "NVIDIA A100-80GB", "A100-80GB", 81920,
                        mig_enabled=True, mig=tuple(
                            MigInstance(f"MIG-n2-{s}", "1g.10gb", s, 9728) for s in range(7)))
    counter = itertools.count()
    clock = lambda: f"2026-11-22T18:00:00.{next(counter):06d}Z"  # noqa: E731
    with node_rig(api, "n1", gpus("n1", 4), replicas=32) as n1, \
            node_rig(api, "n2", [*gpus("n2", 3), mig_gpu], replicas=32) as n2:
        rigs = {"n1": n1, "n2": n2}
        first, rest = burst_pods()
        pods = first + rest
        for p in pods:
            api.add_pod(p)
        bound: dict[str, str] = {}
        order: list[str] = []

        async def body(url: str, state: ExtenderState) -> None:
            state.clock = clock
            async with aiohttp.ClientSession() as s:
                async def schedule(p: dict[str, Any]) -> None:
                    meta = p["metadata"]
                    why: Any = None
                    for _ in range(10):  # a lost bind race is retried, as the scheduler does
                        cur = api.get_pod(meta["namespace"], meta["name"])
                        st, res = await post(s, url + "/filter",
                                             {"Pod": cur, "NodeNames": ["n1", "n2"]})
                        assert st == 200 and res["Error"] == "", res
                        why = res
                        if not res["NodeNames"]:
                            await asyncio.sleep(0.01)
                            continue
                        st, scores = await post(s, url + "/prioritize",
                                                {"Pod": cur, "NodeNames": res["NodeNames"]})
                        best = max(scores, key=lambda h: (h["Score"], h["Host"]))["Host"]
                        st, res = await post(s, url + "/bind", {
                            "PodName": meta["name"], "PodNamespace": meta["namespace"],
                            "PodUID": cur["metadata"]["uid"], "Node": best})
                        why = res
                        if res["Error"] == "":
                            bound[meta["name"]] = best
                            order.append(meta["name"])
                            return
                    raise AssertionError(f"{meta['name']} was never bound: {why}")

                await asyncio.gather(*(schedule(p) for p in first))
                await asyncio.gather(*(schedule(p) for p in rest))

        asyncio.run(helpers.serving(api, body))
        assert len(bound) == 50  # every pod fits, and every one was bound

        errors: list[BaseException] = []

        def admit(node: str) -> None:
            try:
                mine = [api.get_pod("ml", n) for n in order if bound[n] == node]
                for p in sorted(mine, key=lambda p: int(p["metadata"]["resourceVersion"])):
                    rigs[node].dm.admit(p)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=admit, args=(n,)) for n in rigs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []

        peak: dict[str, int] = defaultdict(int)
        for name, where in bound.items():
            a = decode(api.get_pod("ml", name)["metadata"]["annotations"][ANNOTATION])
            assert verify(a, KEY) and a.node == where
            for uuid, (milli, _) in a.held().items():
                peak[uuid] += milli
            dm = rigs[a.node].dm
            for c in a.containers:
                r = dm.responses[(f"ml/{name}", c.name)]
                assert r.envs["GPUSLICE_ASSIGNMENT"] == f"ml/{name}"  # its own assignment
                assert r.envs["GPUSLICE_CONTAINER"] == c.name
                seen = set(r.envs["NVIDIA_VISIBLE_DEVICES"].split(","))
                want = {f"MIG-n2-{g.mig_start}" if g.mig_profile else g.uuid for g in c.gpus}
                assert seen == want, (name, c.name)
        assert peak and max(peak.values()) <= 1000, dict(peak)
        for rig in rigs.values():  # no device in two pods
            owners: dict[str, set[str]] = defaultdict(set)
            for (pod_key, _), ids in rig.dm.devices_of.items():
                for d in ids:
                    owners[d].add(pod_key)
            assert all(len(o) == 1 for o in owners.values())
        assert sum(1 for n in bound if n.startswith("mig-")) == 4
        assert {bound[n] for n in bound if n.startswith("mig-")} == {"n2"}
