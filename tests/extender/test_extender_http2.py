"""The extender over HTTP/2 (adapters/http/h2.py), as kube-scheduler's client negotiates it
by ALPN (pkg/scheduler/extender.go ``makeTransport`` -> k8s.io/apimachinery
pkg/util/net/http.go ``SetTransportDefaults``, which configures HTTP/2 unless ``NextProtos``
excludes it): every verb on one connection, the same answers and the same client-certificate
rule as over HTTP/1.1 (test_extender_mtls.py), request bodies beyond the flow-control window,
a body over the limit refused on its stream alone, a client that breaks the protocol
dropped without harm to the others, and the binds under way finished on shutdown; on uvloop,
as the extender runs. The client here is httpx's HTTP/2 (the h2 library's client side); the
cluster tier's real kube-scheduler speaks Go's."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
from typing import Any

import pytest

from gpuslice.adapters import eventloop
from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.assignment import ANNOTATION
from gpuslice.services.extender import ExtenderState, serve, tls_context
from gpuslice.services.extender.http import MAX_BODY
from tests.extender.helpers import KEY, clock, node, pod
from tests.extender.test_extender_mtls import Certs, certs, client_ssl, cluster, run_https

httpx = pytest.importorskip("httpx", reason="httpx[http2] (the dev extra) is needed")
pytest.importorskip("h2", reason="the h2 library is needed")

__all__ = ["certs"]  # the module's fixture, used here


def client(certs: Certs, with_cert: bool = True) -> Any:
    ctx = client_ssl(certs, certs.client if with_cert else None)
    return httpx.AsyncClient(http2=True, verify=ctx, timeout=30)


def test_every_verb_over_one_http2_connection(certs: Certs) -> None:
    api = cluster()
    for i in range(20):
        api.add_pod(pod(f"q{i}", 50))
    p = api.get_pod("default", "p")

    async def body(base: str) -> None:
        async with client(certs) as c:
            r = await c.post(f"{base}/filter", json={"Pod": p, "NodeNames": ["a"]})
            assert r.http_version == "HTTP/2" and r.status_code == 200
            assert r.json()["NodeNames"] == ["a"]
            r = await c.post(f"{base}/prioritize", json={"Pod": p, "NodeNames": ["a"]})
            assert r.json()[0]["Host"] == "a"
            r = await c.post(f"{base}/bind", json={
                "PodName": "p", "PodNamespace": "default", "PodUID": p["metadata"]["uid"],
                "Node": "a"})
            assert r.json() == {"Error": ""}
            # twenty pods filtered at once: twenty streams on the same connection
            qs = [api.get_pod("default", f"q{i}") for i in range(20)]
            answers = await asyncio.gather(*(c.post(f"{base}/filter", json={
                "Pod": q, "NodeNames": ["a"]}) for q in qs))
            assert all(a.json()["NodeNames"] == ["a"] for a in answers)
            r = await c.get(f"{base}/metrics")
            metrics = r.text
        got = decode(api.get_pod("default", "p")["metadata"]["annotations"][ANNOTATION])
        assert got.node == "a" and got.containers[0].gpus[0].milli == 500
        [line] = [x for x in metrics.splitlines()
                  if x.startswith("gpuslice_extender_connections_total ")]
        assert float(line.split()[1]) == 1.0, line  # every call on the one connection

    run_https(certs, api, body, run=eventloop.run)


def test_without_a_client_certificate_the_verbs_answer_403_and_the_probes_200(
        certs: Certs) -> None:
    api = cluster()
    p = api.get_pod("default", "p")

    async def body(base: str) -> None:
        async with client(certs, with_cert=False) as c:
            r = await c.post(f"{base}/bind", json={
                "PodName": "p", "PodNamespace": "default", "PodUID": p["metadata"]["uid"],
                "Node": "a"})
            assert r.http_version == "HTTP/2" and r.status_code == 403
            assert "client certificate" in r.json()["Error"]
            assert (await c.get(f"{base}/healthz")).status_code == 200
            assert (await c.get(f"{base}/readyz")).status_code == 200
            assert (await c.get(f"{base}/nowhere")).status_code == 404
            assert (await c.get(f"{base}/filter")).status_code == 405

    run_https(certs, api, body, run=eventloop.run)
    assert not api.get_pod("default", "p")["spec"].get("nodeName")


def test_large_bodies_pass_the_windows_and_one_over_the_limit_is_refused_alone(
        certs: Certs) -> None:
    """A filter with node objects (no nodeCacheCapable) is several flow-control windows
    long; a body over MAX_BODY gets 413 on its stream while the connection goes on."""
    api = cluster()
    p = api.get_pod("default", "p")
    many = [node(f"n{i:04d}", "T4", 1) for i in range(6000)]
    many[0] = api.get_node("a")

    async def body(base: str) -> None:
        async with client(certs) as c:
            doc = {"Pod": p, "Nodes": {"items": many}}
            assert len(json.dumps(doc)) > 1 << 20
            r = await c.post(f"{base}/filter", json=doc)
            assert r.status_code == 200, r.text
            assert [n["metadata"]["name"] for n in r.json()["Nodes"]["items"]] == ["a"]
            big = b"{" + b" " * MAX_BODY + b"}"
            r = await c.post(f"{base}/filter", content=big,
                             headers={"Content-Type": "application/json"})
            assert r.status_code == 413
            r = await c.post(f"{base}/filter", json={"Pod": p, "NodeNames": ["a"]})
            assert r.json()["NodeNames"] == ["a"]
            # a body that is not JSON: the same 400 as over HTTP/1.1
            r = await c.post(f"{base}/filter", content=b"{not json",
                             headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "not JSON" in r.text

    run_https(certs, api, body, run=eventloop.run)


def test_a_client_that_breaks_the_protocol_is_dropped_and_the_others_served(
        certs: Certs) -> None:
    api = cluster()
    p = api.get_pod("default", "p")

    async def body(base: str) -> None:
        port = int(base.rsplit(":", 1)[1])

        def garbage() -> bytes:
            ctx = client_ssl(certs, certs.client)
            ctx.set_alpn_protocols(["h2"])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                    ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.selected_alpn_protocol() == "h2"
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x04\x09" * 64)
                got = b""
                try:
                    while chunk := tls.recv(65536):
                        got += chunk
                except (ssl.SSLError, OSError):
                    pass
                return got  # the server's SETTINGS, then its GOAWAY, then the close

        got = await asyncio.get_running_loop().run_in_executor(None, garbage)
        types = []
        while len(got) >= 9:  # the frames: length (3 bytes), type, flags, stream (4)
            length = int.from_bytes(got[:3], "big")
            types.append(got[3])
            got = got[9 + length:]
        assert types[0] == 0x4 and 0x7 in types, types  # SETTINGS first, a GOAWAY after
        async with client(certs) as c:
            r = await c.post(f"{base}/filter", json={"Pod": p, "NodeNames": ["a"]})
            assert r.json()["NodeNames"] == ["a"]

    run_https(certs, api, body, run=eventloop.run)


class SlowBinds(FakeApiServer):
    """The API server fake whose Binding writes wait until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.waiting = threading.Event()

    def bind(self, *args: Any, **kwargs: Any) -> None:
        self.waiting.set()
        assert self.release.wait(10), "the Binding write was never released"
        super().bind(*args, **kwargs)


def test_a_stopping_extender_finishes_the_binds_under_way_on_its_http2_connections(
        certs: Certs) -> None:
    """SIGTERM while kube-scheduler waits for a bind: the connection gets a GOAWAY (no new
    streams) and the bind under way is written and answered before the process ends."""
    api = SlowBinds()
    api.add_node(node("a", "T4", 2))
    api.add_pod(pod("p", 500))
    p = api.get_pod("default", "p")
    ctx = tls_context(str(certs.server[0]), str(certs.server[1]), str(certs.ca))

    async def main() -> None:
        state = ExtenderState(api, KEY, clock=clock)
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        server = asyncio.create_task(serve(state, "127.0.0.1", 0, ctx,
                                           ready=started.set_result, stop=stop))
        base = f"https://127.0.0.1:{await asyncio.wait_for(started, 10)}"
        async with client(certs) as c:
            await c.post(f"{base}/filter", json={"Pod": p, "NodeNames": ["a"]})
            binding = asyncio.ensure_future(c.post(f"{base}/bind", json={
                "PodName": "p", "PodNamespace": "default", "PodUID": p["metadata"]["uid"],
                "Node": "a"}))
            await asyncio.get_running_loop().run_in_executor(None, api.waiting.wait, 10)
            stop.set()  # as SIGTERM does
            await asyncio.sleep(0.3)
            assert not server.done()  # waiting for the bind
            api.release.set()
            r = await asyncio.wait_for(binding, 10)
            assert r.status_code == 200 and r.json() == {"Error": ""}
        await asyncio.wait_for(server, 10)

    eventloop.run(main())
    assert api.get_pod("default", "p")["spec"]["nodeName"] == "a"


def test_a_client_holding_too_many_bodies_at_once_is_sent_away() -> None:
    """Each stream's body is capped, and all of a connection's bodies together too (else one
    client could hold MAX_STREAMS bodies of the cap each): past it, GOAWAY
    ENHANCE_YOUR_CALM and the connection closed. Driven frame by frame, no socket."""
    import h2.config
    import h2.connection
    import h2.events

    from gpuslice.adapters.http.h2 import H2Answer, H2Server

    class Transport:
        def __init__(self) -> None:
            self.out, self.closed = b"", False

        def write(self, data: bytes) -> None:
            self.out += data

        def close(self) -> None:
            self.closed = True

    async def main() -> None:
        async def dispatch(method: str, path: str, body: bytes, t: Any) -> H2Answer:
            return H2Answer(200, "text/plain", b"%d" % len(body))

        server = H2Server(dispatch, max_body=1000, max_buffered=2500)
        t = Transport()
        server.connection_made(t)  # type: ignore[arg-type]
        c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        c.initiate_connection()
        server.data_received(c.data_to_send())
        c.receive_data(t.out)
        t.out = b""
        hdrs = [(":method", "POST"), (":scheme", "https"), (":authority", "x"),
                (":path", "/filter")]
        # one whole body within the caps: answered
        c.send_headers(1, hdrs)
        c.send_data(1, b"x" * 900, end_stream=True)
        server.data_received(c.data_to_send())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        got = [e for e in c.receive_data(t.out) if isinstance(e, h2.events.DataReceived)]
        assert got and got[0].data == b"900"
        t.out = b""
        # three bodies under way at once, each under its cap, together over 2500
        for sid in (3, 5, 7):
            c.send_headers(sid, hdrs)
            c.send_data(sid, b"y" * 900)
            server.data_received(c.data_to_send())
        assert t.closed
        ended = [e for e in c.receive_data(t.out)
                 if isinstance(e, h2.events.ConnectionTerminated)]
        assert ended and ended[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM

    asyncio.run(main())
