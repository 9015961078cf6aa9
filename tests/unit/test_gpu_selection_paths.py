"""GPU selection per pod (core.gpuselect) honoured where pods are placed: the extender's filter
(over its HTTP app, on a fake API server) and the DRA claim allocator's reading of pending
claims, with gpuslice's and HAMi's annotations; the simulator's and the policies' model
checks read the same set (a :class:`~gpuslice.core.gpuselect.ModelSet`)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gpuslice.adapters.kube.dra import pending_claims
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kube.objects import pod_request
from gpuslice.core.dra_placement import DraDevice
from gpuslice.core.gpuselect import ModelSet
from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import node, pod, post, reasons, serving


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
