"""Fuzz the DRA driver's gRPC service over its unix socket, as the kubelet calls it
(tests/dra/kubelet.py): NodePrepareResources and NodeUnprepareResources with random claim
references (namespaces, names and UIDs of any text: empty, path-like, very long, repeated),
some naming claims the API server holds, in both API versions (v1, v1beta1).

Properties: every call answers within the timeout with an entry for every claim (an error per
claim, never a failed call: dra/v1 api.proto); nothing is written outside the driver's own
folders; after the run, a valid claim still prepares and unprepares."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.adapters.kubelet import dra_v1beta1_pb2 as v1beta1
from gpuslice.adapters.kubelet import dra_v1beta1_pb2_grpc as v1beta1g
from tests.dra.conftest import NODE, Node, claim
from tests.dra.kubelet import DraClient
from tests.fuzz.dra_env import dra_node, files_under
from tests.fuzz.helpers import ANSWER_TIMEOUT_S, fuzz, tried

Ref = tuple[str, str, str]


@pytest.fixture(scope="module")
def dra() -> Iterator[tuple[Node, DraClient, set[Any]]]:
    with dra_node() as (node, client):
        # claims the API server holds, so that some references resolve (to a claim that
        # prepares, to one with another UID, to one not allocated)
        node.add(claim("whole", [{"request": "gpu", "device": "gpu-2"}], uid="uid-whole"))
        node.add(claim("share", [{"request": "gpu", "device": "gpu-0", "shareID": "s-1",
                                  "consumedCapacity": {"compute": "10", "memory": "1Gi"}}],
                       uid="uid-share"))
        node.add({"metadata": {"name": "pending", "namespace": "default", "uid": "uid-pending"},
                  "status": {}})
        node.add(claim("other-ns", [{"request": "gpu", "device": "gpu-2"}], uid="uid-ns",
                       namespace="team-a"))
        before = files_under(node.root)
        yield node, client, before


texts = st.one_of(st.text(max_size=12), st.sampled_from([
    "", " ", "/", "..", "../..", "../../etc/passwd", "a/b", "\x00", "\t\n", "é", "*", "-",
    "x" * 300, "default", "team-a", "whole", "share", "pending", "other-ns", "uid-whole",
    "uid-share", "uid-pending", "uid-ns"]))
refs = st.lists(st.tuples(texts, texts, texts), max_size=5)


def v1beta1_call(client: DraClient, method: str, claims: list[Ref]) -> Any:
    stub = v1beta1g.DRAPluginStub(client.channel)  # type: ignore[no-untyped-call]
    req = getattr(v1beta1, f"{method}Request")(
        claims=[v1beta1.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims])
    return getattr(stub, method)(req, timeout=ANSWER_TIMEOUT_S)


@fuzz(400)
@given(refs, st.booleans())
def test_prepare_answers_every_claim_reference(dra: tuple[Node, DraClient, set[Any]],
                                               claims: list[Ref], old: bool) -> None:
    _, client, _ = dra
    tried("DRA NodePrepareResources (refs)")
    try:
        if old:
            resp = v1beta1_call(client, "NodePrepareResources", claims)
            got = {uid: resp.claims[uid] for uid in resp.claims}
        else:
            got = client.prepare(claims)  # raises when a claim is left out
    except grpc.RpcError as exc:
        raise AssertionError(f"the call failed: {exc.code()} {exc.details()}") from None
    assert {uid for _, uid, _ in claims} <= set(got)
    for _, uid, _ in claims:
        answer = got[uid]
        assert answer.error or list(answer.devices), uid
    # the kubelet unprepares what it prepared (a pod deleted): leave the node as it was
    prepared = [c for c in claims if not got[c[1]].error]
    if prepared:
        assert set(client.unprepare(prepared).values()) == {""}


@fuzz(300)
@given(refs, st.booleans())
def test_unprepare_answers_every_claim_reference(dra: tuple[Node, DraClient, set[Any]],
                                                 claims: list[Ref], old: bool) -> None:
    node, client, before = dra
    tried("DRA NodeUnprepareResources (refs)")
    try:
        if old:
            resp = v1beta1_call(client, "NodeUnprepareResources", claims)
            got = {uid: resp.claims[uid].error for uid in resp.claims}
        else:
            got = client.unprepare(claims)
    except grpc.RpcError as exc:
        raise AssertionError(f"the call failed: {exc.code()} {exc.details()}") from None
    assert {uid for _, uid, _ in claims} <= set(got)
    # a claim never prepared here unprepares cleanly; no file of the node's went away
    assert all(isinstance(e, str) for e in got.values())
    assert before <= files_under(node.root) | {node.cfg.checkpoint_path}


def test_after_the_fuzzing_a_valid_claim_prepares_and_unprepares(
        dra: tuple[Node, DraClient, set[Any]]) -> None:
    node, client, before = dra
    ref = node.add(claim("final", [{"request": "gpu", "device": "gpu-2"}], uid="uid-final"))
    got = client.prepare([ref])[ref[1]]
    assert got.error == ""
    (dev,) = got.devices
    assert (dev.pool_name, dev.device_name) == (NODE, "gpu-2")
    assert list(dev.cdi_device_ids) == ["k8s.gpu.gpuslice.io/claim=uid-final-gpu-2"]
    assert node.driver.cdi.path("uid-final").exists()
    assert client.unprepare([ref]) == {"uid-final": ""}
    assert not node.driver.cdi.path("uid-final").exists()
    # nothing outside the driver's folders (a path-like UID must not name a file elsewhere)
    stray = [p for p in files_under(node.root)
             if not p.is_relative_to(node.cfg.cdi_dir)
             and not p.is_relative_to(node.cfg.kubelet_dir) and p not in before]
    assert stray == []
