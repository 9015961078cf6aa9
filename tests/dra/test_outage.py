"""The DRA driver through an API server outage, over its real transports: the kubelet's gRPC
on unix sockets, and the real Kubernetes client against an API server that accepts
connections and never answers (frozen), then recovers.

The kubelet gives up on a DRA call after 45 s and calls again; a prepare must answer well
inside that, each claim with its own error, and nothing that needs no API server (unprepare,
health, registration) may wait behind the prepares that do."""

from __future__ import annotations

import queue
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
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core import dra
from gpuslice.services.dra_driver import DraConfig, DraDriver
from tests.dra.conftest import NODE, Node, claim, inventory
from tests.dra.kubelet import DraClient, register
from tests.fake_mps import write_fake_mps
from tests.kube.frozen_api import FrozenApiServer

BUDGET_S = 2.0  # the claim reads' deadline here (20 s by default)
PREPARES = 4  # prepares at a time


@pytest.fixture
def frozen() -> Iterator[FrozenApiServer]:
    server = FrozenApiServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def node(short_dir: Path, frozen: FrozenApiServer) -> Iterator[Node]:
    """Two T4s (whole GPUs), the driver on the real client of ``frozen``."""
    frozen.add_node({"metadata": {"name": NODE, "uid": "node-uid"}})
    nvml = FakeNvml.from_yaml(inventory(short_dir / "gpus.yaml",
                                        [{"model": "T4"}, {"model": "T4"}]), NODE)
    cfg = DraConfig(NODE, kubelet_dir=short_dir / "k", cdi_dir=short_dir / "cdi",
                    mps_pipe_dir=str(short_dir / "mps"),
                    mps_binary=str(write_fake_mps(short_dir / "mps-control")),
                    allocator_lease=None, claim_read_timeout_s=BUDGET_S,
                    max_prepares=PREPARES, health_timeout_s=4)  # health resent every 1 s
    api = KubeClient(str(frozen.kubeconfig(short_dir / "kubeconfig")))
    driver = DraDriver(cfg, nvml, api, features=dra.Features())
    driver.start()
    n = Node(short_dir, frozen, nvml, cfg, driver)
    n.serve()
    yield n
    n.stop()
    driver.close()


def whole(name: str, device: str = "gpu-0") -> dict[str, Any]:
    return claim(name, [{"request": "gpu", "device": device}])


def timed_prepare(client: DraClient, refs: list[tuple[str, str, str]]
                  ) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    got = client.prepare(refs)
    return time.monotonic() - t0, got


def follow(stream: Any) -> queue.Queue[float]:
    """The times the health stream's messages arrive at."""
    q: queue.Queue[float] = queue.Queue()

    def run() -> None:
        try:
            for _ in stream:
                q.put(time.monotonic())
        except grpc.RpcError:
            pass

    threading.Thread(target=run, daemon=True).start()
    return q


def test_a_prepare_on_a_frozen_api_server_answers_each_claim_an_error_within_the_budget(
        node: Node, frozen: FrozenApiServer) -> None:
    assert node.client is not None
    a, b = node.add(whole("a")), node.add(whole("b", "gpu-1"))
    frozen.freeze()
    took, got = timed_prepare(node.client, [a, b])
    # the claims are read in parallel within one deadline: about the budget, not 120 s
    assert BUDGET_S * 0.8 < took < 3 * BUDGET_S, took
    for ref in (a, b):
        err = got[ref[1]].error
        assert err.startswith(f"claim default/{ref[2]}: ") and "API server" in err, err
        assert f"{BUDGET_S:g} s" in err, err
        assert not got[ref[1]].devices
    assert not node.driver.checkpoint.claims  # nothing reserved for a claim never read
    frozen.thaw()  # the kubelet calls again: the claims are read and prepared
    got = node.client.prepare([a, b])
    assert [got[r[1]].error for r in (a, b)] == ["", ""]
    assert [got[r[1]].devices[0].device_name for r in (a, b)] == ["gpu-0", "gpu-1"]


def test_unprepare_health_and_registration_never_wait_behind_stuck_prepares(
        node: Node, frozen: FrozenApiServer) -> None:
    client = node.client
    assert client is not None
    held = node.add(whole("held", "gpu-1"))
    assert client.prepare([held])[held[1]].error == ""  # checkpointed
    beats = follow(client.health_stream())
    assert beats.get(timeout=5)
    stuck = [node.add(whole(f"stuck-{i}")) for i in range(PREPARES)]
    frozen.freeze()
    with futures.ThreadPoolExecutor(PREPARES) as pool:
        waiting = [pool.submit(timed_prepare, client, [r]) for r in stuck]
        assert frozen.wait_arrived(PREPARES)  # every prepare slot waits on the API server
        # one more prepare is answered at once, an error the kubelet retries
        extra = node.add(whole("extra"))
        took, got = timed_prepare(client, [extra])
        assert took < 1.0 and "prepares are under way" in got[extra[1]].error, (took, got)
        # the unprepare needs no API server: answered at once, the claim let go
        t0 = time.monotonic()
        assert client.unprepare([held]) == {held[1]: ""}
        assert time.monotonic() - t0 < 1.0
        assert held[1] not in node.driver.checkpoint.claims
        assert not list((node.root / "cdi").glob(f"*{held[1]}*"))
        # the kubelet's registration and its health stream are answered meanwhile
        t0 = time.monotonic()
        register(node.cfg.registration_socket)
        assert time.monotonic() - t0 < 1.0
        while not beats.empty():
            beats.get_nowait()
        assert beats.get(timeout=2.5)  # resent every second, as before the outage
        fresh = follow(client.health_stream())
        assert fresh.get(timeout=1.0)
        # each stuck prepare answers within its budget
        for f in waiting:
            took, got = f.result(timeout=3 * BUDGET_S)
            assert took < 3 * BUDGET_S, took
            (res,) = got.values()
            assert "API server" in res.error and not res.devices
    frozen.thaw()
    got = client.prepare([stuck[0]])
    assert got[stuck[0][1]].error == "" and got[stuck[0][1]].devices[0].device_name == "gpu-0"


def test_more_health_streams_than_allowed_end_the_oldest_and_leave_the_calls_their_threads(
        node: Node) -> None:
    client = node.client
    assert client is not None
    streams, beats = [], []
    for _ in range(3 * node.cfg.health_streams):  # one after the other, each answered
        streams.append(client.health_stream())
        beats.append(follow(streams[-1]))
        assert beats[-1].get(timeout=5)
    # the newest ones speak on (resent every second); the others were ended
    for b in beats[-node.cfg.health_streams:]:
        while not b.empty():
            b.get_nowait()
        assert b.get(timeout=2.5)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not all(
            s.done() for s in streams[:-node.cfg.health_streams]):
        time.sleep(0.05)
    assert all(s.done() for s in streams[:-node.cfg.health_streams])
    ref = node.add(whole("a"))
    assert client.prepare([ref])[ref[1]].error == ""
    assert client.unprepare([ref]) == {ref[1]: ""}
