"""An API server outage, over the real client: the node agent publishes its GPUs once the
server is back, the extender keeps answering and catches up, Allocate rides out a short
outage and names a long one."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.services.device_plugin import DevicePlugin, PluginConfig, PluginServer, wait_for
from gpuslice.services.extender import ExtenderState, serve
from gpuslice.services.node_agent import NodeAgent
from tests.extender.helpers import node as gpu_node
from tests.extender.helpers import pod as gpu_pod
from tests.kube.helpers import EXTENDER, post_json
from tests.kube.helpers import NODE_AGENT as AGENT
from tests.kube.helpers import kube_client as client
from tests.kube.rest_fake import RestApiServer
from tests.nodeagent.test_device_plugin import GPUS, KEY, Kubelet, allocate, assign


def test_the_node_agent_publishes_its_gpus_once_the_api_server_is_back(
        rest: RestApiServer, tmp_path: Path) -> None:
    rest.add_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}})
    rest.down.set()
    with tempfile.TemporaryDirectory(prefix="out-") as d:
        kubelet = Kubelet(Path(d)).start()
        agent = NodeAgent(PluginConfig("node-1", Path(d), KEY, replicas=2),
                          FakeNvml(list(GPUS)), client(rest, tmp_path, AGENT), poll_s=0.05)
        agent.max_backoff_s = 0.2
        t = threading.Thread(target=agent.run, daemon=True)
        t.start()
        try:
            assert kubelet.registered.wait(5)  # the kubelet side does not need the API
            time.sleep(1.0)
            assert t.is_alive()
            assert "gpuslice.io/inventory" not in (
                rest.get_node("node-1")["metadata"].get("annotations") or {})
            assert len(agent.problems) <= 3, agent.problems  # noted, not once per pass
            assert any("publishing node labels" in x for x in agent.problems)
            rest.down.clear()
            assert wait_for(lambda: "gpuslice.io/inventory" in (
                rest.get_node("node-1")["metadata"].get("annotations") or {}), 5)
            time.sleep(0.3)
            # no MIG-enabled GPU here: no layout to read, so no read of the node every pass
            # (one: the labels the node had before the agent's first publish)
            assert len([r for r in rest.requests if r[1] == "GET" and "/nodes" in r[2]]) <= 1
        finally:
            agent.stop()
            kubelet.stop()


def test_the_extender_keeps_answering_through_an_outage_and_catches_up(
        rest: RestApiServer, tmp_path: Path) -> None:
    rest.add_node(gpu_node("a", "T4", 2))
    state = ExtenderState(client(rest, tmp_path, EXTENDER), KEY, clock=lambda: "t",
                          narrow=False)  # every node that fits, to see "b" join
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        task = loop.create_task(serve(state, "127.0.0.1", 0, ready=lambda p: (
            port.append(p), ready.set())))
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    url = f"http://127.0.0.1:{port[0]}"
    p = gpu_pod("p", 500, model="T4")
    try:
        rest.down.set()
        time.sleep(1.5)
        res = post_json(url + "/filter", {"Pod": p, "NodeNames": ["a", "b"]})
        assert res["NodeNames"] == ["a"]  # the last view answers
        rest.add_node(gpu_node("b", "T4", 2))  # joins while the extender cannot see it
        time.sleep(1.0)
        assert thread.is_alive()
        rest.down.clear()
        assert wait_for(lambda: post_json(url + "/filter", {"Pod": p, "NodeNames": ["a", "b"]})[
            "NodeNames"] == ["a", "b"], 15), state.problems
        assert any("watch" in x for x in state.problems)
    finally:
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
        state.api.close()  # type: ignore[attr-defined]


def test_allocate_rides_out_a_short_outage_and_names_a_long_one(
        rest: RestApiServer, tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="out-") as d:
        kubelet = Kubelet(Path(d)).start()
        plugin = DevicePlugin(PluginConfig("node-1", Path(d), KEY, replicas=4, api_retry_s=1.0),
                              FakeNvml(list(GPUS)), client(rest, tmp_path, AGENT))
        server = PluginServer(plugin)
        server.start()
        try:
            assert kubelet.registered.wait(5)
            assign(rest, "short", ["GPU-aaa"], milli=300)
            rest.down.set()
            threading.Timer(0.5, rest.down.clear).start()
            resp = allocate(kubelet.stub(), "GPU-aaa::0")
            assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
            assign(rest, "long", ["GPU-aaa"], milli=200, t="t2")
            rest.down.set()
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                allocate(kubelet.stub(), "GPU-aaa::1")
            assert 0.5 < time.monotonic() - t0 < 5  # asked again for about api_retry_s
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "API server is not answering" in str(err.value.details())
            rest.down.clear()  # the kubelet tries the pod's admission again: it goes through
            assert allocate(kubelet.stub(), "GPU-aaa::1").envs[
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
        finally:
            server.stop()
            kubelet.stop()
