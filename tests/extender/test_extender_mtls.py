"""Who may call the extender (issue 29): over real HTTPS on loopback with ``--client-ca``, the
scheduler's verbs answer only a client whose certificate that CA signed. A client without a
certificate gets 403 and changes nothing; one with a certificate of another CA does not get
through the handshake; the kubelet's probes (no certificate) still reach /healthz and /readyz."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.errors import ValidationError
from gpuslice.services.extender import ExtenderState, serve, tls_context
from tests.extender.helpers import KEY, clock, node, pod

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="openssl CLI not installed")

VERBS = ("filter", "prioritize", "bind", "preempt")


@dataclass
class Certs:
    ca: Path
    server: tuple[Path, Path]
    client: tuple[Path, Path]  # signed by ca: kube-scheduler's
    stranger: tuple[Path, Path]  # signed by another CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    from gpuslice.devcluster.procs import Pki

    root = tmp_path_factory.mktemp("mtls")
    ours, other = Pki(root / "ours"), Pki(root / "other")
    return Certs(ours.ca_crt,
                 ours.issue("extender", "/CN=gpuslice-extender", server=True),
                 ours.issue("scheduler", "/CN=gpuslice-scheduler"),
                 other.issue("scheduler", "/CN=gpuslice-scheduler"))


def client_ssl(certs: Certs, cert: tuple[Path, Path] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


def cluster() -> FakeApiServer:
    api = FakeApiServer()
    api.add_node(node("a", "T4", 2))
    api.add_pod(pod("p", 500))
    return api


def run_https(certs: Certs, api: FakeApiServer, body: Callable[[str], Awaitable[None]],
              server: tuple[Path, Path] | None = None, reload_s: float = 60.0,
              run: Callable[[Any], Any] = asyncio.run) -> None:
    """``serve`` (as ``gpuslice extender --client-ca`` runs it) on a free loopback port while
    ``body(base_url)`` runs; ``server``: its certificate and key files (default the
    fixture's), checked for a renewal every ``reload_s``; ``run``: the event loop's runner
    (``adapters.eventloop.run``: uvloop, as the extender runs)."""
    crt, key = server or certs.server
    ctx = tls_context(str(crt), str(key), str(certs.ca))

    async def main() -> None:
        state = ExtenderState(api, KEY, clock=clock)
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        server = asyncio.create_task(serve(state, "127.0.0.1", 0, ctx, ready=started.set_result,
                                           stop=stop, tls_files=(str(crt), str(key)),
                                           tls_reload_s=reload_s))
        try:
            port = await asyncio.wait_for(started, 10)
            await body(f"https://127.0.0.1:{port}")
        finally:
            stop.set()
            await asyncio.wait_for(server, 10)

    run(main())


def requests(p: dict[str, Any]) -> dict[str, Any]:
    meta = p["metadata"]
    return {"filter": {"Pod": p, "NodeNames": ["a"]},
            "prioritize": {"Pod": p, "NodeNames": ["a"]},
            "bind": {"PodName": meta["name"], "PodNamespace": meta["namespace"],
                     "PodUID": meta["uid"], "Node": "a"},
            "preempt": {"Pod": p, "NodeNameToMetaVictims": {"a": {"Pods": []}}}}


async def call(ctx: ssl.SSLContext, url: str, doc: Any = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        if doc is None:
            async with s.get(url, ssl=ctx) as r:
                return r.status, await r.text()
        async with s.post(url, data=json.dumps(doc), ssl=ctx,
                          headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.text()


def test_a_client_without_a_certificate_is_refused_and_changes_nothing(certs: Certs) -> None:
    api = cluster()
    pending = api.get_pod("default", "p")

    async def body(base: str) -> None:
        anonymous = client_ssl(certs, None)
        for verb, doc in requests(pending).items():
            status, text = await call(anonymous, f"{base}/{verb}", doc)
            assert status == 403, (verb, status, text)
            assert "client certificate" in json.loads(text)["Error"]
        # the kubelet's probes present no certificate: health and readiness stay open
        for path in ("/healthz", "/readyz"):
            assert (await call(anonymous, base + path))[0] == 200
        status, metrics = await call(anonymous, base + "/metrics")
        assert status == 200
        for verb in VERBS:
            assert f'gpuslice_extender_unauthenticated_calls_total{{verb="{verb}"}} 1.0' \
                in metrics

    run_https(certs, api, body)
    assert not api.get_pod("default", "p")["spec"].get("nodeName")


def test_a_certificate_of_another_ca_does_not_get_through_the_handshake(certs: Certs) -> None:
    api = cluster()
    pending = api.get_pod("default", "p")

    async def body(base: str) -> None:
        stranger = client_ssl(certs, certs.stranger)
        for verb, doc in requests(pending).items():
            with pytest.raises(aiohttp.ClientError):
                await call(stranger, f"{base}/{verb}", doc)
        with pytest.raises(aiohttp.ClientError):  # nothing at all over such a connection
            await call(stranger, base + "/healthz")

    run_https(certs, api, body)
    assert not api.get_pod("default", "p")["spec"].get("nodeName")


def test_the_schedulers_certificate_filters_and_binds(certs: Certs) -> None:
    api = cluster()
    pending = api.get_pod("default", "p")

    async def body(base: str) -> None:
        scheduler = client_ssl(certs, certs.client)
        docs = requests(pending)
        status, text = await call(scheduler, base + "/filter", docs["filter"])
        assert status == 200 and json.loads(text)["NodeNames"] == ["a"], text
        status, text = await call(scheduler, base + "/bind", docs["bind"])
        assert status == 200 and json.loads(text)["Error"] == "", text

    run_https(certs, api, body)
    assert api.get_pod("default", "p")["spec"]["nodeName"] == "a"


def test_a_client_ca_file_without_a_certificate_is_refused(certs: Certs,
                                                           tmp_path: Path) -> None:
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    with pytest.raises(ValidationError, match="--client-ca"):
        tls_context(str(certs.server[0]), str(certs.server[1]), str(empty))


def test_a_renewed_serving_certificate_is_served_without_a_restart(certs: Certs,
                                                                   tmp_path: Path) -> None:
    """cert-manager renews into the Secret and the kubelet updates the mounted files: the next
    connection gets the new certificate; a pair that does not load keeps the old one."""
    from gpuslice.devcluster.procs import Pki

    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(certs.server[0], crt)
    shutil.copy(certs.server[1], key)
    renewed = Pki(tmp_path / "pki")  # another key pair under a CA the client also trusts
    new_crt, new_key = renewed.issue("renewed", "/CN=renewed-extender", server=True)

    def served_name(port: int) -> str:
        ctx = ssl.create_default_context(cafile=str(certs.ca))
        ctx.load_verify_locations(str(renewed.ca_crt))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            subject = dict(x[0] for x in tls.getpeercert()["subject"])  # type: ignore[index]
            return str(subject["commonName"])

    async def body(base: str) -> None:
        port = int(base.rsplit(":", 1)[1])
        assert await asyncio.to_thread(served_name, port) == "gpuslice-extender"
        # half-written renewals: still the old certificate, and handshakes go on
        key.write_text("not a key")
        await asyncio.sleep(0.3)
        assert await asyncio.to_thread(served_name, port) == "gpuslice-extender"
        shutil.copy(certs.server[1], key)
        shutil.copy(new_crt, crt)  # the new certificate, the old key
        await asyncio.sleep(0.3)
        assert await asyncio.to_thread(served_name, port) == "gpuslice-extender"
        shutil.copy(new_key, key)
        for _ in range(100):
            if await asyncio.to_thread(served_name, port) == "renewed-extender":
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the renewed certificate was not served")

    run_https(certs, cluster(), body, server=(crt, key), reload_s=0.05)
