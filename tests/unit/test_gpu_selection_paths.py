"""GPU selection per pod (core.gpuselect) honoured where pods are placed: the extender's filter
(over its HTTP app, on a fake API server) and the DRA claim allocator's reading of pending
claims, with gpuslice's and HAMi's annotations; the simulator's and the policies' model
checks read the same set (a :class:`~gpuslice.core.gpuselect.ModelSet`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from gpuslice.adapters.kube.dra import pending_claims
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kube.objects import pod_request
from gpuslice.core.dra_placement import DraDevice
from gpuslice.core.gpuselect import ModelSet, by_uuid
from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import bound, mig_node, node, pod, post, reasons, serving


def _with(ann: dict[str, str]) -> dict[str, Any]:
    p = pod("sel", 250)
    p["metadata"]["annotations"] = ann
    return p


@pytest.mark.parametrize(("ann", "kept"), [
    ({}, ["t4", "a100", "l4"]),
    ({"gpuslice.io/gpu-model": "a100-80gb|L4"}, ["a100", "l4"]),  # catalogue-aware names
    ({"gpuslice.io/gpu-model-exclude": "T4"}, ["a100", "l4"]),
    ({"nvidia.com/use-gputype": "A100"}, ["a100"]),  # HAMi: a part of the name
    ({"nvidia.com/nouse-gputype": "t4,l4"}, ["a100"]),
    ({"gpuslice.io/gpu-model": "L4", "nvidia.com/use-gputype": "A100"}, ["a100", "l4"]),
])
def test_the_extenders_filter_keeps_the_nodes_of_the_models_the_pod_accepts(
        ann: dict[str, str], kept: list[str]) -> None:
    api = FakeApiServer()
    for name, model in (("t4", "T4"), ("a100", "A100-80GB"), ("l4", "L4")):
        api.add_node(node(name, model, 2))
    api.add_pod(_with(ann))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            p = api.get_pod("default", "sel")
            status, res = await post(s, url + "/filter",
                                     {"Pod": p, "NodeNames": ["t4", "a100", "l4"]})
            assert status == 200 and res["Error"] == ""
            assert res["NodeNames"] == kept
            for n in {"t4", "a100", "l4"} - set(kept):
                assert "pod accepts" in reasons(res)[n]

    asyncio.run(serving(api, body))


def test_the_request_carries_the_rule() -> None:
    req = pod_request(_with({"nvidia.com/nouse-gputype": "T4"}))
    assert req is not None and isinstance(req.models, ModelSet)
    assert "A100-80GB" in req.models and "T4" not in req.models
    plain = pod_request(_with({}))
    assert plain is not None and not plain.models


def _dra(ann: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "c", "namespace": "ml"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": "share.gpuslice.io",
                 "capacity": {"requests": {"compute": "250"}}}}]}}}
    p = {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "p", "namespace": "ml", "annotations": ann,
                      "creationTimestamp": "2026-11-22T18:00:00Z"},
         "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}],
                  "containers": [{"name": "m", "resources": {"claims": [{"name": "gpu"}]}}]}}
    return p, claim


def test_the_dra_allocator_reads_the_pods_selection_into_its_request() -> None:
    p, claim = _dra({"nvidia.com/use-gputype": "A100"})
    (pending,) = pending_claims([p], [claim])
    a100 = DraDevice("node-a", "share-0", "share", "A100-80GB", True)
    t4 = DraDevice("node-b", "share-0", "share", "T4", True)
    assert pending.request.accepts(a100) and not pending.request.accepts(t4)
    p, claim = _dra({})
    (pending,) = pending_claims([p], [claim])
    assert pending.request.accepts(t4) and not pending.request.models


@pytest.mark.parametrize(("ann", "kept", "gpus"), [
    # pinned: the node of the GPU, and that GPU of it (the extender's own pick is GPU 0)
    ({"gpuslice.io/gpu-uuid": "GPU-b-1"}, ["b"], {"b": "GPU-b-1"}),
    ({"nvidia.com/use-gpuuuid": "GPU-a-1,GPU-b-0"}, ["a", "b"],
     {"a": "GPU-a-1", "b": "GPU-b-0"}),
    # avoided: every GPU of a is excluded, b's GPU 0 too
    ({"gpuslice.io/gpu-uuid-exclude": "GPU-a-0|GPU-a-1|GPU-b-0"}, ["b"], {"b": "GPU-b-1"}),
    ({"nvidia.com/nouse-gpuuuid": "GPU-a-0", "gpuslice.io/gpu-uuid": "GPU-a-0"}, [], {}),
])
def test_the_extender_honours_a_selection_by_uuid_in_filter_and_bind(
        ann: dict[str, str], kept: list[str], gpus: dict[str, str]) -> None:
    """Pin or avoid GPUs by UUID (HAMi's use-gpuuuid / nouse-gpuuuid and gpuslice's
    spelling): filter keeps the nodes with an allowed GPU that has room, says why of the
    others, and bind puts the share on an allowed GPU, on every node kept."""
    api = FakeApiServer()
    for name in ("a", "b"):
        api.add_node(node(name, "L4", 2))
    for name in ("sel", *(f"sel-{n}" for n in kept)):
        p = _with(ann)
        p["metadata"]["name"] = name
        api.add_pod(p)

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            p = api.get_pod("default", "sel")
            status, res = await post(s, url + "/filter", {"Pod": p, "NodeNames": ["a", "b"]})
            assert status == 200 and res["Error"] == ""
            assert res["NodeNames"] == kept, res
            for n in {"a", "b"} - set(kept):
                assert "by UUID allows none" in reasons(res)[n], reasons(res)
            for n in kept:  # a pod of the same selection bound to each node kept
                a = await bound(s, url, api, api.get_pod("default", f"sel-{n}"), n)
                assert a.containers[0].gpus[0].uuid == gpus[n], a

    asyncio.run(serving(api, body))


def test_a_uuid_on_a_full_gpu_leaves_the_node_out() -> None:
    """The pinned GPU is full (another pod holds 900 milli of it) while the node's other
    GPU is free: the node is refused, by the pinned GPU's room."""
    api = FakeApiServer()
    api.add_node(node("a", "L4", 2))
    api.add_pod(pod("big", 900))
    api.add_pod(_with({"gpuslice.io/gpu-uuid": "GPU-a-0"}))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            a = await bound(s, url, api, api.get_pod("default", "big"), "a")
            assert a.containers[0].gpus[0].uuid == "GPU-a-0"
            status, res = await post(s, url + "/filter", {
                "Pod": api.get_pod("default", "sel"), "NodeNames": ["a"]})
            assert status == 200
            assert res["NodeNames"] == [] and "GPU 0 has 100 milli free" in reasons(res)["a"]

    asyncio.run(serving(api, body))


def test_a_mig_instance_uuid_selects_that_instance() -> None:
    """A MIG-isolated pod pinned to one instance (its MIG UUID) gets that instance, not the
    tightest free one the extender would pick; excluding the GPU's UUID excludes all."""
    instances = [("MIG-1", "1g.10gb", 0, 9728), ("MIG-2", "1g.10gb", 1, 9728),
                 ("MIG-3", "3g.40gb", 4, 40192)]
    for ann, want in (({"gpuslice.io/gpu-uuid": "MIG-2"}, "1g.10gb@1"),
                      ({"gpuslice.io/gpu-uuid": "MIG-3"}, "3g.40gb@4"),
                      ({"gpuslice.io/gpu-uuid-exclude": "GPU-m0"}, None)):
        api = FakeApiServer()
        api.add_node(mig_node("m", instances))
        p = pod("sel", 140, isolation="mig")
        p["metadata"]["annotations"].update(ann)
        api.add_pod(p)
        asyncio.run(serving(api, _mig_check(api, want)))


def _mig_check(api: FakeApiServer, want: str | None
               ) -> Callable[[str, ExtenderState], Awaitable[None]]:
    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            got = api.get_pod("default", "sel")
            status, res = await post(s, url + "/filter", {"Pod": got, "NodeNames": ["m"]})
            assert status == 200
            if want is None:
                assert res["NodeNames"] == [], res
                return
            a = await bound(s, url, api, got, "m")
            share = a.containers[0].gpus[0]
            assert f"{share.mig_profile}@{share.mig_start}" == want, a

    return body


def test_the_dra_allocator_honours_a_selection_by_uuid() -> None:
    """The claim allocator's request accepts a device by the ``uuid`` (a GPU's, a static MIG
    instance's) and ``parentUUID`` attributes its ResourceSlices publish."""
    p, claim = _dra({"nvidia.com/use-gpuuuid": "GPU-1", "gpuslice.io/gpu-uuid-exclude": "MIG-9"})
    (pending,) = pending_claims([p], [claim])
    assert by_uuid(pending.request.models) is not None
    share = DraDevice("node-a", "share-0", "share", "L4", True, uuid="GPU-0")
    share1 = DraDevice("node-a", "share-1", "share", "L4", True, uuid="GPU-1")
    mig_ok = DraDevice("node-a", "mig-0", "share", "A100-80GB", True, uuid="MIG-8",
                       gpu_uuid="GPU-1")
    mig_no = DraDevice("node-a", "mig-1", "share", "A100-80GB", True, uuid="MIG-9",
                       gpu_uuid="GPU-1")
    accepted = [d.name for d in (share, share1, mig_ok, mig_no) if pending.request.accepts(d)]
    assert accepted == ["share-1", "mig-0"]
