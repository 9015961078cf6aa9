"""Fuzz the node agent's device plugin over real gRPC on a unix socket, as the kubelet calls it
(the kubelet side of tests/nodeagent/test_device_plugin.py): Allocate, GetPreferredAllocation
and PreStartContainer with random device IDs (known, unknown, repeated, empty, any text) and
sizes (the whole int32 range), while the API server holds signed assignments and hand-written
(hostile) ``gpuslice.io/assignment`` annotations on this node's pods.

Properties: every call answers within the timeout; a refusal is a proper gRPC status
(INVALID_ARGUMENT, FAILED_PRECONDITION or UNAVAILABLE) with a message, never UNKNOWN (an
exception in the servicer) or INTERNAL; a preferred allocation keeps the kubelet's rules
(api.proto: every must-include device, only offered devices, no repeats, the size asked when
enough are offered); after the run, a valid assignment is still steered to and executed."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.adapters.kube.annotation import encode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign
from gpuslice.services.device_plugin import DevicePlugin, PluginConfig, PluginServer, wait_for
from tests.fuzz.helpers import ANSWER_TIMEOUT_S, fuzz, json_values, tried
from tests.nodeagent.test_device_plugin import GPUS, KEY, Kubelet, assign

REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.UNAVAILABLE}
KNOWN = [f"{g.uuid}::{k}" for g in GPUS for k in range(4)]  # replicas=4


class Env:
    def __init__(self, sock_dir: Path) -> None:
        self.api = FakeApiServer()
        self.kubelet = Kubelet(sock_dir).start()
        self.plugin = DevicePlugin(PluginConfig("node-1", sock_dir, KEY, replicas=4,
                                                api_retry_s=1.0),
                                   FakeNvml(list(GPUS)), self.api)
        self.server = PluginServer(self.plugin)
        self.server.start()
        assert self.kubelet.registered.wait(5)
        assert wait_for(lambda: bool(self.kubelet.lists), 5)
        self.stub = self.kubelet.stub()
        self.pods = 0

    def add_pod(self, annotation: str) -> str:
        """A pending pod on this node carrying ``annotation`` as its assignment."""
        self.pods += 1
        name = f"f{self.pods}"
        self.api.add_pod({"metadata": {"name": name, "namespace": "ml",
                                       "annotations": {"gpuslice.io/assignment": annotation}},
                          "spec": {"nodeName": "node-1", "containers": [{"name": "main"}]}})
        return name

    def close(self) -> None:
        self.server.stop()
        self.kubelet.stop()


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with tempfile.TemporaryDirectory(prefix="dpf-") as d:
        e = Env(Path(d))
        # signed assignments waiting for the kubelet, so that some Allocates succeed
        for i, (gpus, milli) in enumerate([(["GPU-aaa"], 300), (["GPU-bbb"], 500),
                                           (["GPU-aaa", "GPU-bbb"], 1000)]):
            assign(e.api, f"valid{i}", gpus, milli=milli, t=f"t{i}")
        yield e
        e.close()


def refused_properly(exc: grpc.RpcError) -> None:
    assert exc.code() in REFUSALS, (exc.code(), exc.details())
    assert exc.details(), exc.code()


device_ids = st.one_of(st.sampled_from(KNOWN), st.text(max_size=20),
                       st.sampled_from(["", "::", "GPU-aaa", "GPU-aaa::", "GPU-aaa::99",
                                        "GPU-zzz::0", "GPU-aaa::0::0", "\x00", "é::0"]))
id_lists = st.lists(device_ids, max_size=6)


@fuzz(500)
@given(st.lists(id_lists, max_size=4))
def test_allocate_answers_or_refuses_with_a_status(env: Env, requests: list[list[str]]) -> None:
    tried("device plugin Allocate")
    try:
        resp = env.stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=ids) for ids in requests]),
            timeout=ANSWER_TIMEOUT_S)
    except grpc.RpcError as exc:
        refused_properly(exc)
        return
    assert len(resp.container_responses) == len(requests)


sizes = st.one_of(st.integers(-5, 12), st.integers(-(2**31), 2**31 - 1))


@fuzz(500)
@given(st.lists(st.tuples(st.lists(device_ids, max_size=10), st.lists(device_ids, max_size=3),
                          sizes), max_size=3))
def test_preferred_allocation_keeps_the_kubelets_rules(
        env: Env, requests: list[tuple[list[str], list[str], int]]) -> None:
    tried("device plugin GetPreferredAllocation")
    try:
        resp = env.stub.GetPreferredAllocation(pb.PreferredAllocationRequest(
            container_requests=[pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=avail, must_include_deviceIDs=must, allocation_size=size)
                for avail, must, size in requests]), timeout=ANSWER_TIMEOUT_S)
    except grpc.RpcError as exc:
        refused_properly(exc)
        return
    assert len(resp.container_responses) == len(requests)
    for (avail, must, size), got in zip(requests, resp.container_responses, strict=True):
        chosen = list(got.deviceIDs)
        assert len(set(chosen)) == len(chosen), chosen
        assert set(must) <= set(chosen)
        assert set(chosen) <= set(avail) | set(must)
        want = max(len(set(must)), min(size, len(set(avail) | set(must))))
        assert len(chosen) == want, (avail, must, size, chosen)


@fuzz(100)
@given(id_lists)
def test_pre_start_container_answers_any_devices(env: Env, ids: list[str]) -> None:
    tried("device plugin PreStartContainer")
    env.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids),
                               timeout=ANSWER_TIMEOUT_S)


VALID = json.loads(encode(sign(Assignment("ml", "x", "uid-x", "node-1", (ContainerAssignment(
    "main", Mode.MPS, (GpuShare("GPU-aaa", 300, 8192),)),), "t0"), KEY)))


def hostile(field: str, value: Any) -> str:
    return json.dumps({**VALID, field: value})


hostile_annotations = st.one_of(
    st.text(max_size=60),
    st.builds(hostile, st.sampled_from(sorted(VALID)), st.one_of(json_values, st.sampled_from(
        ["v1:\u00e9\u00e9", "v1:" + "0" * 64, "\ud800", "node-2", "", "v2:abc"]))),
    json_values.map(json.dumps))


# hand-written annotations a JSON encoder in the user's hands makes (the API server keeps them)
HOSTILE = (hostile("mac", "v1:\u00e9" * 64), hostile("mac", "v1:\ud800"),
           hostile("namespace", "\ud800"), hostile("mac", "v1:" + "0" * 64),
           hostile("containers", [{**VALID["containers"][0], "mode": "mig"}]),
           hostile("containers", [{**VALID["containers"][0], "gpus": [{
               **VALID["containers"][0]["gpus"][0], "migProfile": "\udc80", "migStart": 0}]}]),
           "{" * 10_000, "", "null", json.dumps(VALID)[:-2])


@pytest.mark.parametrize("annotation", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_annotations_from_the_corpus_never_break_allocate(env: Env,
                                                                  annotation: str) -> None:
    tried("device plugin Allocate (hostile annotations)")
    allocate_next_to(env, annotation, ["GPU-aaa::0"])


@fuzz(200)
@given(hostile_annotations, st.sampled_from([["GPU-aaa::0"], ["GPU-bbb::1"], ["GPU-aaa::1",
                                                                    "GPU-bbb::2"]]))
def test_hostile_assignments_on_the_node_never_break_allocate(env: Env, annotation: str,
                                                              ids: list[str]) -> None:
    tried("device plugin Allocate (hostile annotations)")
    allocate_next_to(env, annotation, ids)


def allocate_next_to(env: Env, annotation: str, ids: list[str]) -> None:
    """A user writes ``annotation`` on a pod of this node; the next Allocate reads it."""
    name = env.add_pod(annotation)
    try:
        env.stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=ANSWER_TIMEOUT_S)
    except grpc.RpcError as exc:
        refused_properly(exc)
    finally:
        env.api.delete_pod("ml", name)
    # nothing unsigned was executed
    assert not any(a.pod == name for a in env.plugin.executed())


def test_after_the_fuzzing_a_valid_assignment_is_steered_to_and_executed(env: Env) -> None:
    for p in env.api.list_pods():
        env.api.delete_pod(p["metadata"]["namespace"], p["metadata"]["name"])
    assign(env.api, "final", ["GPU-bbb"], milli=400, mem=4096, t="z")
    pref = env.stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
        pb.ContainerPreferredAllocationRequest(available_deviceIDs=KNOWN, allocation_size=1)]),
        timeout=ANSWER_TIMEOUT_S)
    chosen = list(pref.container_responses[0].deviceIDs)
    assert [c.split("::")[0] for c in chosen] == ["GPU-bbb"]
    resp = env.stub.Allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=chosen)]), timeout=ANSWER_TIMEOUT_S)
    r = resp.container_responses[0]
    assert r.annotations["gpuslice.io/pod"] == "ml/final"
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert r.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbb"
