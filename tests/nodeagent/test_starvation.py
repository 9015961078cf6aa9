"""The device plugin's calls do not starve each other, over real gRPC on unix sockets: while
Allocates wait on a frozen API server (the real client; connections accepted, never
answered) they answer within their budget, one more is answered at once, and ListAndWatch and
the options keep answering; streams beyond the limit end the oldest, not the calls."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube.client import KubeClient
from gpuslice.adapters.kube.fake import FakeApiServer, KubePort
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.kubelet import deviceplugin_pb2_grpc as pbg
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.services.device_plugin import DevicePlugin, PluginConfig, PluginServer, wait_for
from tests.kube.frozen_api import FrozenApiServer
from tests.nodeagent.test_device_plugin import GPUS, KEY, Kubelet, allocate, assign

BUDGET_S = 2.0  # api_retry_s: how long an Allocate may wait on the API server
SLOTS = 2  # Allocates waiting on the API server at a time


def serve(sock_dir: Path, api: KubePort, **cfg: Any) -> tuple[Kubelet, DevicePlugin,
                                                               PluginServer]:
    kubelet = Kubelet(sock_dir).start()
    plugin = DevicePlugin(PluginConfig("node-1", sock_dir, KEY, replicas=4, **cfg),
                          FakeNvml(list(GPUS)), api)
    server = PluginServer(plugin)
    server.start()
    assert kubelet.registered.wait(5)
    assert wait_for(lambda: bool(kubelet.lists), 5)
    return kubelet, plugin, server


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dp-") as d:
        yield Path(d)


def timed_allocate(stub: pbg.DevicePluginStub, device: str) -> tuple[float, object]:
    t0 = time.monotonic()
    try:
        out: object = allocate(stub, device)
    except grpc.RpcError as exc:
        out = exc
    return time.monotonic() - t0, out


def first_list(stub: pbg.DevicePluginStub) -> tuple[float, Any]:
    t0 = time.monotonic()
    stream = stub.ListAndWatch(pb.Empty())
    next(stream)
    return time.monotonic() - t0, stream


def test_allocates_on_a_frozen_api_server_starve_neither_each_other_nor_list_and_watch(
        sock_dir: Path, tmp_path: Path) -> None:
    frozen = FrozenApiServer()
    frozen.start()
    kubelet, plugin, server = serve(
        sock_dir, KubeClient(str(frozen.kubeconfig(tmp_path / "kc"))), api_retry_s=BUDGET_S,
        api_calls=SLOTS)
    try:
        assign(frozen, "p1", ["GPU-aaa"], milli=300)
        stub = kubelet.stub()
        frozen.freeze()
        with futures.ThreadPoolExecutor(SLOTS) as pool:
            waiting = [pool.submit(timed_allocate, stub, f"GPU-aaa::{k}") for k in range(SLOTS)]
            assert frozen.wait_arrived(SLOTS)
            # one more is answered at once: an error, not a place in a queue
            took, err = timed_allocate(stub, "GPU-aaa::3")
            assert isinstance(err, grpc.RpcError) and took < 1.0, (took, err)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "waiting on the API server already" in str(err.details())
            # the kubelet's other calls are answered meanwhile
            t0 = time.monotonic()
            assert stub.GetDevicePluginOptions(pb.Empty(), timeout=5).pre_start_required is False
            assert time.monotonic() - t0 < 1.0
            seen = len(kubelet.lists)
            plugin.set_health("GPU-bbb", False)  # streamed to the kubelet at once
            assert wait_for(lambda: len(kubelet.lists) > seen, 1.0)
            assert {d.health for d in kubelet.lists[-1] if d.ID.startswith("GPU-bbb")} == {
                "Unhealthy"}
            took, stream = first_list(stub)
            assert took < 1.0
            stream.cancel()
            for f in waiting:  # each waiting one answers within its budget
                took, err = f.result(timeout=3 * BUDGET_S)
                assert took < 3 * BUDGET_S, took
                assert isinstance(err, grpc.RpcError), err
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert "API server is not answering" in str(err.details())
        frozen.thaw()  # the kubelet admits the pod again: it goes through
        resp = allocate(stub, "GPU-aaa::0")
        assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    finally:
        server.stop()
        kubelet.stop()
        frozen.stop()


def test_list_and_watch_streams_beyond_the_limit_end_the_oldest_and_leave_allocate_its_thread(
        sock_dir: Path) -> None:
    api = FakeApiServer()
    kubelet, plugin, server = serve(sock_dir, api)
    try:
        limit = plugin.cfg.streams
        stub = kubelet.stub()
        streams = [first_list(stub)[1] for _ in range(3 * limit)]  # the kubelet's one first
        assert wait_for(lambda: all(s.done() for s in streams[:-limit]), 3)
        assert not any(s.done() for s in streams[-limit:])
        assert plugin.streams.ended == 2 * limit + 1
        got: list[int] = []

        def count(s: Any) -> None:
            for _ in s:
                got.append(1)
                return

        readers = [threading.Thread(target=count, args=(s,), daemon=True)
                   for s in streams[-limit:]]
        for r in readers:
            r.start()
        plugin.set_health("GPU-bbb", False)
        assert wait_for(lambda: len(got) == limit, 2)  # the live streams hear of it
        assign(api, "p1", ["GPU-aaa"], milli=300)
        assert allocate(stub, "GPU-aaa::0").envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        for s in streams[-limit:]:
            s.cancel()
    finally:
        server.stop()
        kubelet.stop()
