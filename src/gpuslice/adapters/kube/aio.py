"""The Binding write on the caller's event loop (aiohttp), for the extender's binds.

The extender serves kube-scheduler on an asyncio loop; a bind written through the
synchronous client runs on a thread, and every hand-over to it and back, and the GIL the
thread then takes from the loop, cost the extender 0.8 ms of CPU per pod in a scheduling
burst (docs/scale.md). This port writes the same Binding as
:meth:`KubeClient.bind <gpuslice.adapters.kube.client.KubeClient.bind>` (the same body, from
:func:`~gpuslice.adapters.kube.wire.binding_body`), to the same server with the same
credentials and TLS, the credentials read from the client's configuration again every
``auth_ttl_s`` (10 s) and after a 401 (its refresh hook re-reads a token the kubelet rotated;
the kubeconfig loader's hook rebuilds the configuration, 0.2 ms, so not on every bind), and
raises the same errors: :class:`ApiNotFound` (404), :class:`ApiConflict` (409, a precondition),
:class:`ApiInvalid` (422), and :class:`GpusliceError` otherwise, an unreachable server
included (the outcome unknown)."""

from __future__ import annotations

import ssl
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from gpuslice.adapters.kube.ports import ApiConflict, ApiInvalid, ApiNotFound
from gpuslice.adapters.kube.wire import binding_body, status_text
from gpuslice.core.errors import GpusliceError

KEEP_ALIVE = 64  # connections to the API server at most: binds written at once (more wait)
AUTH_TTL_S = 10.0  # how long the credentials read from the configuration are used


class AsyncBinder:
    """``await bind(...)`` on the loop that first calls it; :meth:`close` on the same loop.
    ``cfg``: the Kubernetes client's ``Configuration`` (host, TLS files or data, the token
    and its refresh hook, a proxy)."""

    def __init__(self, cfg: Any, timeout_s: float, auth_ttl_s: float = AUTH_TTL_S) -> None:
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.auth_ttl_s = auth_ttl_s
        self._session: aiohttp.ClientSession | None = None
        self._auth: tuple[float, str, dict[str, str]] | None = None  # (read at, host, headers)

    def _tls(self) -> ssl.SSLContext | bool:
        cfg = self.cfg
        if not str(cfg.host).startswith("https:"):
            return False
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None,
                                         cadata=getattr(cfg, "ca_cert_data", None) or None)
        if not cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
        return ctx

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            try:
                tls = self._tls()
            except (OSError, ssl.SSLError) as exc:
                raise GpusliceError(f"the API server's TLS settings do not load: {exc}") \
                    from None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=KEEP_ALIVE, ssl=tls),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    def _headers(self) -> tuple[str, dict[str, str]]:
        """The API server's URL and the headers of a call, read from the configuration again
        when ``auth_ttl_s`` has passed."""
        now = time.monotonic()
        if self._auth is None or now - self._auth[0] >= self.auth_ttl_s:
            headers = {"Accept": "application/json", "Content-Type": "application/json"}
            # as the client's calls: the token (its refresh hook run first), else basic auth
            for auth in self.cfg.auth_settings().values():
                if auth.get("in") == "header" and auth.get("value"):
                    headers[auth["key"]] = auth["value"]
            self._auth = (now, str(self.cfg.host).rstrip("/"), headers)
        return self._auth[1], self._auth[2]

    async def bind(self, namespace: str, name: str, uid: str, node: str,
                   annotations: Mapping[str, str] | None = None,
                   resource_version: str | None = None) -> None:
        """The pod's ``binding`` subresource (see ``KubeClient.bind``)."""
        session = self._open()
        host, headers = self._headers()
        url = f"{host}/api/v1/namespaces/{namespace}/pods/{name}/binding"
        body = orjson.dumps(binding_body(namespace, name, uid, node, annotations,
                                         resource_version))
        kwargs: dict[str, Any] = {}
        if getattr(self.cfg, "proxy", None):
            kwargs["proxy"] = self.cfg.proxy
        if getattr(self.cfg, "tls_server_name", None):
            kwargs["server_hostname"] = self.cfg.tls_server_name
        try:
            async with session.post(url, data=body, headers=headers, **kwargs) as resp:
                answer = await resp.read()
                status, reason = resp.status, resp.reason or ""
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise GpusliceError(f"API server unreachable: {exc!r}") from None
        if status < 300:
            return
        if status == 401:  # credentials rotated meanwhile: read them again for the next call
            self._auth = None
        message = status_text(answer, reason)
        if status == 404:
            raise ApiNotFound(message)
        if status == 409:
            raise ApiConflict(message)
        if status == 422:
            raise ApiInvalid(f"API server: 422 {message}")
        raise GpusliceError(f"API server: {status} {message}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
