"""What slices the extender gives: MIG instances by name, MPS inside MIG, cordoned GPUs, pods
naming no GPU memory."""

from __future__ import annotations

import asyncio

import aiohttp

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import (
    KEY,
    bound,
    clock,
    mig_node,
    node,
    pod,
    post,
    reasons,
    serving,
)


def test_mig_isolation_gets_a_named_instance_and_the_reasons_when_none_is_free() -> None:
    api = FakeApiServer()
    api.add_node(node("plain", "A100-80GB", 1))
    api.add_node(mig_node("mig", [("MIG-a", "3g.40gb", 4, 40192), ("MIG-b", "4g.40gb", 0, 40192)]))
    for n in ("m1", "m2", "m3"):
        api.add_pod(pod(n, 429, model="A100-80GB", isolation="mig"))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            starts = []
            for n in ("m1", "m2"):
                stored = api.get_pod("default", n)
                _st, res = await post(s, url + "/filter", {"Pod": stored,
                                                          "NodeNames": ["plain", "mig"]})
                assert res["NodeNames"] == ["mig"]
                assert "no MIG instance" in reasons(res)["plain"]
                a = await bound(s, url, api, stored, "mig")
                share = a.containers[0].gpus[0]
                assert a.containers[0].mode.value == "mig" and share.uuid == "GPU-m0"
                starts.append((share.mig_profile, share.mig_start))
            # the tightest instance first (3g for a 3g-sized request), then the 4g
            assert starts == [("3g.40gb", 4), ("4g.40gb", 0)]
            stored = api.get_pod("default", "m3")
            _, res = await post(s, url + "/filter", {"Pod": stored, "NodeNames": ["mig"]})
            assert res["NodeNames"] == []
            assert "no free MIG instance of >= 3g" in reasons(res)["mig"]

    asyncio.run(serving(api, body))


def test_mps_slices_go_inside_mig_instances_of_a_mig_enabled_gpu() -> None:
    """A MIG-enabled GPU has no whole-GPU device: MPS slices share its instances (best fit),
    an instance with MPS tenants is not given to a MIG-isolated pod, and nothing asks for the
    GPU whole."""
    api = FakeApiServer()
    api.add_node(mig_node("mig", [("MIG-3g", "3g.40gb", 0, 40192), ("MIG-2g", "2g.20gb", 4, 19968),
                                  ("MIG-1g", "1g.10gb", 6, 9728)]))
    api.add_node(node("plain", "T4", 1))
    for n in ("s1", "s2"):
        api.add_pod(pod(n, 200, model="A100-80GB"))
    api.add_pod(pod("whole", 1000, model="A100-80GB"))
    api.add_pod(pod("big", 600, model="A100-80GB"))
    api.add_pod(pod("mig3", 429, model="A100-80GB", isolation="mig"))
    planned = pod("planned", 100, model="A100-80GB")
    planned["metadata"]["annotations"]["gpuslice.io/mig-profile"] = "3g.40gb"
    api.add_pod(planned)
    api.add_pod(pod("unplanned", 130, model="A100-80GB"))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            placed = []
            for n in ("s1", "s2"):
                stored = api.get_pod("default", n)
                _st, res = await post(s, url + "/filter", {"Pod": stored, "NodeNames": ["mig"]})
                assert res["NodeNames"] == ["mig"], res
                _st, res = await post(s, url + "/prioritize", {"Pod": stored,
                                                              "NodeNames": ["mig"]})
                assert res[0]["Score"] > 0
                a = await bound(s, url, api, stored, "mig")
                share = a.containers[0].gpus[0]
                assert a.containers[0].mode.value == "mps" and share.milli == 200
                # no gpu-memory named: its share of the instance's memory (200 of 285 or 428)
                assert share.memory_mib in (200 * 19968 // 285, 200 * 40192 // 428)
                placed.append((share.uuid, share.mig_profile, share.mig_start))
            # 200 milli: the 2g (285) fits tightest; the second no longer fits there: the 3g
            assert placed == [("GPU-m0", "2g.20gb", 4), ("GPU-m0", "3g.40gb", 0)]
            for name, why in (("whole", "GPU 0 has 0 milli free, pod needs 1000 (the most free "
                                        "GPU of the node); 1 GPU(s) MIG-enabled: no whole-GPU "
                                        "exclusive slice there"),
                              ("big", "MPS inside MIG instances: none has 600 milli and its "
                                      "share of the memory free (3g.40gb@0 (228 milli, 21411 "
                                      "MiB free), 2g.20gb@4 (85 milli, 5956 MiB free), "
                                      "1g.10gb@6"),
                              ("mig3", "no free MIG instance of >= 3g")):
                stored = api.get_pod("default", name)
                _, res = await post(s, url + "/filter", {"Pod": stored, "NodeNames": ["mig"]})
                assert res["NodeNames"] == [] and why in reasons(res)["mig"], res
            # a slice the planner sized for a 3g goes to a 3g with room (best fit alone would
            # take the 1g); another to the tightest that fits
            for name, want in (("planned", ("3g.40gb", 0)), ("unplanned", ("1g.10gb", 6))):
                a = await bound(s, url, api, api.get_pod("default", name), "mig")
                share = a.containers[0].gpus[0]
                assert (share.mig_profile, share.mig_start) == want
        # a restarted extender derives the same instance use from the assignments
        again = ExtenderState(api, KEY, clock=clock)
        rooms = {(r.profile, r.start): r for r in again._mig_rooms(0, frozenset())}
        assert (rooms[("2g.20gb", 4)].used_milli, rooms[("3g.40gb", 0)].used_milli,
                rooms[("1g.10gb", 6)].used_milli) == (200, 300, 130)

    asyncio.run(serving(api, body))


def test_a_cordoned_gpu_takes_no_new_slice_and_the_reason_says_so() -> None:
    api = FakeApiServer()
    n = node("a", "T4", 1)
    n["metadata"]["annotations"]["gpuslice.io/cordoned-gpus"] = "GPU-a-0"
    api.add_node(n)
    api.add_pod(pod("p", 300))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            _, res = await post(s, url + "/filter", {"Pod": api.get_pod("default", "p"),
                                                     "NodeNames": ["a"]})
            assert res["NodeNames"] == []
            assert "1 GPU(s) cordoned for reconfiguration" in reasons(res)["a"]

    asyncio.run(serving(api, body))


def test_a_pod_naming_no_gpu_memory_takes_its_share_of_the_gpus() -> None:
    """The contract's default: milli/1000 of the GPU's memory, accounted in the ledger (so
    memory cannot be oversubscribed) and written in the assignment (the device plugin turns it
    into the MPS pinned-memory cap)."""
    api = FakeApiServer()
    api.add_node(node("a", "T4", 1))  # 16384 MiB
    big_mem = pod("big-mem", 200)
    big_mem["spec"]["containers"][0]["resources"]["limits"]["gpuslice.io/gpu-memory"] = "14000"
    api.add_pod(big_mem)
    api.add_pod(pod("plain", 250))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            a = await bound(s, url, api, api.get_pod("default", "big-mem"), "a")
            assert a.containers[0].gpus[0].memory_mib == 14000
            plain = api.get_pod("default", "plain")
            _, res = await post(s, url + "/filter", {"Pod": plain, "NodeNames": ["a"]})
            # 250 milli of 16384 MiB is 4096 MiB; 2384 are left
            assert res["NodeNames"] == [] and \
                "GPU 0 has 2384 MiB free, pod needs 4096" in reasons(res)["a"], res
        again = ExtenderState(api, KEY, clock=clock)
        assert again.ledger.free("GPU-a-0") == (800, 2384)

    asyncio.run(serving(api, body))
    api2 = FakeApiServer()
    api2.add_node(node("a", "T4", 1))
    api2.add_pod(pod("plain", 250))

    async def body2(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            a = await bound(s, url, api2, api2.get_pod("default", "plain"), "a")
            assert a.containers[0].gpus[0].memory_mib == 4096

    asyncio.run(serving(api2, body2))
