"""The extender's Binding written from its event loop (adapters/kube/aio.py, aiohttp) against
the REST API fake: the same write, preconditions, errors, credentials and TLS as the
synchronous client's ``bind`` (tests/kube/test_kube_client.py checks that one)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube.client import KubeClient
from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound
from gpuslice.core.errors import GpusliceError
from tests.kube.helpers import EXTENDER, NODE_AGENT, self_signed
from tests.kube.helpers import kube_client as client
from tests.kube.rest_fake import Rbac, RestApiServer


def pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"containers": [{"name": "main", "image": "registry.local/model:1"}]}}


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def run(api: KubeClient, *calls: tuple[Any, ...]) -> list[BaseException | None]:
    """Each call's outcome (None: bound), all on one event loop and one binder."""

    async def go() -> list[BaseException | None]:
        binder = api.async_binder()
        out: list[BaseException | None] = []
        try:
            for args in calls:
                try:
                    await binder.bind(*args)
                    out.append(None)
                except GpusliceError as exc:
                    out.append(exc)
        finally:
            await binder.close()
        return out

    return asyncio.run(go())


def test_the_binding_and_its_preconditions(rest: RestApiServer, tmp_path: Path) -> None:
    rest.add_node(node("n1"))
    api = client(rest, tmp_path)
    made = api.create_pod(pod("x"))
    uid, rv = made["metadata"]["uid"], made["metadata"]["resourceVersion"]
    rest.patch_pod_annotations("ml", "x", {"other": "writer"}, rv)  # changed since read
    fresh = rest.get_pod("ml", "x")["metadata"]["resourceVersion"]
    other_uid, stale_rv, missing, ok, again = run(
        api,
        ("ml", "x", "some-other-uid", "n1"),  # the pod was replaced: another UID
        ("ml", "x", uid, "n1", {"gpuslice.io/assignment": "a"}, rv),  # a stale version
        ("ml", "gone", "u", "n1"),
        ("ml", "x", uid, "n1", {"gpuslice.io/assignment": "a"}, fresh),
        ("ml", "x", uid, "n1"))  # bound already
    assert isinstance(other_uid, ApiConflict) and "UID" in str(other_uid)
    assert isinstance(stale_rv, ApiConflict)
    assert isinstance(missing, ApiNotFound) and "gone" in str(missing)
    assert ok is None
    assert isinstance(again, ApiConflict)
    bound = rest.get_pod("ml", "x")  # node and annotation in one write
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"] == {"other": "writer", "gpuslice.io/assignment": "a"}
    # the same body as the synchronous client's, with the extender's credentials
    posts = [r for r in rest.requests if r[1] == "POST" and r[2].endswith("/binding")]
    assert len(posts) == 5 and all(r[3] == "application/json" for r in posts)


def test_one_kept_alive_connection_and_the_token_read_again_after_its_ttl(
        rest: RestApiServer, tmp_path: Path) -> None:
    """Binds one after another reuse one connection (over TLS, each new one is a handshake);
    the credentials are read from the configuration (its refresh hook run first) once per
    ``auth_ttl_s``, so a rotated token goes with the first call after it."""
    rest.add_node(node("n1"))
    api = client(rest, tmp_path)
    uids = [api.create_pod(pod(f"p{i}"))["metadata"]["uid"] for i in range(5)]
    before = len(rest._connections)  # the synchronous client's kept-alive one
    seen: list[int] = []
    cfg = api._api_client.configuration
    hooked: list[str] = []

    def rotated(c: Any) -> None:  # as the in-cluster loader's hook re-reads the token file
        hooked.append("read")
        c.api_key.update({k: f"Bearer {EXTENDER}" for k in c.api_key})

    async def go() -> None:
        binder = api.async_binder(auth_ttl_s=0.5)
        try:
            for i, uid in enumerate(uids):
                if i == 2:
                    cfg.refresh_api_key_hook = rotated
                if i == 4:
                    await asyncio.sleep(0.6)  # the credentials' time is up
                await binder.bind("ml", f"p{i}", uid, "n1")
                seen.append(len(rest._connections))
        finally:
            await binder.close()

    asyncio.run(go())
    assert seen == [before + 1] * 5
    posts = [r[0] for r in rest.requests if r[2].endswith("/binding")]
    assert posts == ["admin"] * 4 + [EXTENDER]  # read once, then again after the TTL
    assert hooked == ["read"]


def test_a_401_reads_the_credentials_again_for_the_next_call(
        rest: RestApiServer, tmp_path: Path) -> None:
    rest.add_node(node("n1"))
    api = client(rest, tmp_path)
    uid = api.create_pod(pod("x"))["metadata"]["uid"]
    cfg = api._api_client.configuration
    good = dict(cfg.api_key)
    cfg.api_key.update({k: "Bearer nobody" for k in cfg.api_key})
    cfg.refresh_api_key_hook = None

    async def go() -> list[BaseException | None]:
        binder = api.async_binder()  # 10 s: only the 401 makes it read them again
        out: list[BaseException | None] = []
        try:
            for _ in range(2):
                try:
                    await binder.bind("ml", "x", uid, "n1")
                    out.append(None)
                except GpusliceError as exc:
                    out.append(exc)
                cfg.api_key.update(good)  # the rotated token, in place now
        finally:
            await binder.close()
        return out

    refused, ok = asyncio.run(go())
    assert isinstance(refused, GpusliceError) and "401" in str(refused)
    assert ok is None and rest.get_pod("ml", "x")["spec"]["nodeName"] == "n1"


def test_refusals_name_the_api_servers_reason(tmp_path: Path) -> None:
    """RBAC's 403 and an unreachable server are errors that say so (outcome unknown for the
    extender: the share stays in flight until a re-read)."""
    rest = RestApiServer(rbac=Rbac()).start()  # deploy/'s roles
    try:
        rest.add_node(node("n1"))
        admin = client(rest, tmp_path)
        uid = admin.create_pod(pod("x"))["metadata"]["uid"]
        [allowed] = run(client(rest, tmp_path, EXTENDER), ("ml", "x", uid, "n1"))
        assert allowed is None  # deploy/'s RBAC lets the extender bind
        uid = admin.create_pod(pod("y"))["metadata"]["uid"]
        [denied] = run(client(rest, tmp_path, NODE_AGENT), ("ml", "y", uid, "n1"))
        assert isinstance(denied, GpusliceError) and "403" in str(denied)
        assert "pods/binding" in str(denied) or "forbidden" in str(denied).lower()
        port = rest.port
    finally:
        rest.stop()
    [down] = run(admin, ("ml", "y", "u", "n1"))
    assert isinstance(down, GpusliceError) and "unreachable" in str(down), (down, port)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_over_https_the_server_is_verified(tmp_path: Path) -> None:
    for name in ("ca", "other"):
        self_signed(tmp_path, name)
    rest = RestApiServer(tls=(tmp_path / "ca.crt", tmp_path / "ca.key")).start()
    try:
        rest.add_node(node("n1"))
        trusted = KubeClient(str(rest.kubeconfig(tmp_path / "ok", ca=tmp_path / "ca.crt")))
        uid = trusted.create_pod(pod("x"))["metadata"]["uid"]
        wrong = KubeClient(str(rest.kubeconfig(tmp_path / "bad", ca=tmp_path / "other.crt")))
        [refused] = run(wrong, ("ml", "x", uid, "n1"))
        assert isinstance(refused, GpusliceError) and "certificate" in str(refused).lower()
        assert not rest.get_pod("ml", "x")["spec"].get("nodeName")
        [ok] = run(trusted, ("ml", "x", uid, "n1"))
        assert ok is None and rest.get_pod("ml", "x")["spec"]["nodeName"] == "n1"
    finally:
        rest.stop()
