"""A follower that refuses a bind sends kube-scheduler away from its connection, so that the
scheduler's next calls go through the Service to the leader.

Found by the chaos soak (benchmarks/chaos.py, docs/testing.md): kube-scheduler keeps one
HTTP/2 connection for all its extender calls, and kube-proxy keeps an established connection
on the backend it chose when it was opened, whatever the Service selects later. Once
leadership moved (the leader lost its Lease while the API server was frozen, and the other
replica took it), every bind reached the old leader, now a follower, and was refused for as
long as the connection lived: 23 pods waited to the end of a 2-minute soak although GPUs
were free."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gpuslice.adapters import eventloop
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.services.extender import ExtenderState, serve, tls_context
from gpuslice.services.leader import LeaderElector
from tests.extender.helpers import KEY, clock, node, pod
from tests.extender.test_extender_mtls import Certs, certs, client_ssl

httpx = pytest.importorskip("httpx", reason="httpx[http2] (the dev extra) is needed")
pytest.importorskip("h2", reason="the h2 library is needed")

__all__ = ["certs"]  # the module's fixture, used here
NS = "gpuslice-system"


def _connections(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("gpuslice_extender_connections_total "):
            return float(line.split()[1])
    raise AssertionError("no gpuslice_extender_connections_total in /metrics")


def _run(certs: Certs, lead: bool, http2: bool) -> tuple[list[str], float, list[str]]:
    """Filter, bind, filter on one client of a replica that leads (``lead``) or follows;
    the bind's error, the connections the verbs came on, and the bind answer's Connection
    header."""
    api = FakeApiServer()
    api.add_node(node("a", "T4", 1))
    api.add_pod(pod("p", 500, gpus=2 if lead else 1))  # the leader refuses 2 GPUs of 1
    holder = "me" if lead else "the-other-replica"
    LeaderElector(api, NS, "ext", holder, time.time, 15).step()
    p = api.get_pod("default", "p")
    ctx = tls_context(str(certs.server[0]), str(certs.server[1]), str(certs.ca))
    out: tuple[list[str], float, list[str]] = ([], 0.0, [])

    async def main() -> None:
        nonlocal out
        state = ExtenderState(api, KEY, clock=clock)
        state.elector = LeaderElector(api, NS, "ext", "me", time.time, 15)
        state.elector.step()
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        server = asyncio.create_task(serve(state, "127.0.0.1", 0, ctx,
                                           ready=started.set_result, stop=stop))
        base = f"https://127.0.0.1:{await asyncio.wait_for(started, 10)}"
        try:
            async with httpx.AsyncClient(http2=http2, timeout=30,
                                         verify=client_ssl(certs, certs.client)) as c:
                flt = {"Pod": p, "NodeNames": ["a"]}
                assert (await c.post(f"{base}/filter", json=flt)).status_code == 200
                r = await c.post(f"{base}/bind", json={
                    "PodName": "p", "PodNamespace": "default",
                    "PodUID": p["metadata"]["uid"], "Node": "a"})
                assert r.status_code == 200
                error: Any = r.json()["Error"]
                await asyncio.sleep(0.3)  # a GOAWAY, if one comes
                assert (await c.post(f"{base}/filter", json=flt)).status_code == 200
                metrics = (await c.get(f"{base}/metrics")).text
                out = ([error], _connections(metrics), r.headers.get_list("connection"))
        finally:
            stop.set()
            await asyncio.wait_for(server, 10)

    eventloop.run(main())
    return out


@pytest.mark.parametrize("http2", [True, False], ids=["http2", "http1.1"])
def test_a_follower_refusing_a_bind_sends_the_client_to_connect_again(
        certs: Certs, http2: bool) -> None:
    errors, connections, header = _run(certs, lead=False, http2=http2)
    assert "not the leader" in errors[0]
    assert connections == 2  # the next call came on a new connection (through the Service)
    if not http2:
        assert header == ["close"]


def test_the_leader_keeps_the_connection_when_it_refuses_a_bind(certs: Certs) -> None:
    errors, connections, _ = _run(certs, lead=True, http2=True)
    assert errors[0] and "not the leader" not in errors[0]
    assert connections == 1
