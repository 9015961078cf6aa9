"""Fuzz the router over real HTTP on loopback (the real proxy and admin sites in front of an
in-process replica): inference requests with any method, path, model name, batch-size header,
Via, request ID, content type and body (Open Inference Protocol / KServe shapes with any value,
bytes that are not JSON, bodies over the limit), malformed HTTP, and the admin API, including
``/reload`` of a config file holding any document.

Properties: every request is answered within the timeout; the router never answers 500 (its
own errors are JSON with a clear status: 400, 404, 413, 429, 502, 503, 504, 508; a failed
reload is ``{"reloaded": false, "error": ...}`` and keeps the old replica set); its background
tasks (health checks) survive; after the run, a valid inference request is still proxied."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.adapters.http.config import read_config
from gpuslice.services.router import RouterApp, ServeOptions, make_loader, start_router
from tests.fuzz.helpers import (
    MALFORMED_JSON,
    LoopThread,
    fuzz,
    json_values,
    raw_http,
    request,
    status_of,
    tried,
)

MAX_BODY = 4096
ROUTER_ERRORS = {400, 404, 405, 413, 429, 502, 503, 504, 508}  # 405: CONNECT (proxy.py)
INFER = "/v2/models/m/infer"


class Env:
    def __init__(self, tmp: Path) -> None:
        self.loop = LoopThread()
        self.backend: web.ServerRunner | None = None
        self.backend_port = self.loop.run(self._start_backend())
        self.config = tmp / "router.json"
        self.good = self.document()
        self.config.write_text(json.dumps(self.good))
        loader, _ = make_loader(ServeOptions(config=self.config))
        cfg = read_config(self.config)
        self.app: RouterApp = self.loop.run(self._start_router(cfg, loader))

    def document(self, **top: Any) -> dict[str, Any]:
        return {"max_body_bytes": MAX_BODY, "request_timeout_s": 5.0,
                "health": {"interval_s": 0.2, "timeout_s": 1.0},
                "services": [{"name": "m", "models": ["m", "other"], "replicas": [
                    {"name": "one", "url": f"http://127.0.0.1:{self.backend_port}"},
                    {"name": "two", "url": f"http://127.0.0.1:{self.backend_port}",
                     "concurrency": 2}]}], **top}

    async def _replica(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        return web.json_response({"model_name": "one", "path": request.path,
                                  "bytes": len(body)})

    async def _start_backend(self) -> int:
        # the replica answers every request 200 (a body it cannot decode included), so that
        # any other status comes from the router
        self.backend = web.ServerRunner(web.Server(self._replica, auto_decompress=False),
                                        access_log=None)
        await self.backend.setup()
        site = web.TCPSite(self.backend, "127.0.0.1", 0)
        await site.start()
        return int(self.backend.addresses[0][1])

    async def _start_router(self, cfg: Any, loader: Any) -> RouterApp:
        return await start_router(cfg, loader=loader, admin_port=0)

    def close(self) -> None:
        self.loop.run(self.app.close())
        assert self.backend is not None
        self.loop.run(self.backend.cleanup())
        self.loop.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    e = Env(tmp_path_factory.mktemp("router-fuzz"))
    yield e
    e.close()


def router_answer(status: int, headers: dict[str, str], body: bytes) -> None:
    """Proxied (the replica's 200) or refused by the router with a JSON error."""
    assert status != 500 and b"Traceback" not in body, (status, body[:300])
    if headers.get("x-gpuslice-replica") and status == 200:
        return  # the replica's own answer
    assert status in ROUTER_ERRORS, (status, body[:300])
    if not body and headers.get("content-type", "").startswith("application/json"):
        return  # a HEAD request: the error's headers without its body
    if status == 400 and headers.get("content-type", "").startswith("text/plain"):
        return  # refused by aiohttp's HTTP parser before the router saw it (a bad method)
    doc = json.loads(body)
    assert doc["code"] == status and doc["error"], doc


# -- inputs -----------------------------------------------------------------------------------

visible = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=16)
latin1 = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                               exclude_characters="\x7f"), max_size=16)
models = st.one_of(st.sampled_from(["m", "other", "unknown", "", "m:predict", "m%2Fx"]),
                   visible.map(lambda t: urllib.parse.quote(t, safe="")))
paths = st.one_of(
    st.builds(lambda m: f"/v2/models/{m}/infer", models),
    st.builds(lambda m, v: f"/v2/models/{m}/versions/{v}/infer", models,
              st.sampled_from(["1", "", "x"])),
    st.builds(lambda m: f"/v1/models/{m}:predict", models),
    visible.map(lambda t: "/" + urllib.parse.quote(t, safe="/?=&%:")),
    st.sampled_from(["/", "//", "/v2", "/v2/models", "/v2/models/", "/v1/models/:predict",
                     "/v2/health/ready", "/%00", "/%ff%fe", "/..%2f..%2fetc", "*"]))
sizes = st.one_of(st.integers(-3, 2**21).map(str), latin1,
                  st.sampled_from(["", " 7 ", "+5", "1e3", "0x10", "٣", "9" * 5000]))
shape_values = st.one_of(json_values, st.integers(-(2**70), 2**70))
bodies = st.one_of(
    st.builds(lambda s: json.dumps({"inputs": [{"name": "x", "shape": s, "datatype": "FP32",
                                                "data": []}]}).encode(),
              st.one_of(st.lists(shape_values, max_size=3), shape_values)),
    st.builds(lambda v: json.dumps({"instances": v}).encode(), shape_values),
    st.builds(lambda v: json.dumps({"inputs": v}).encode(), shape_values),
    st.builds(lambda v: json.dumps({"batch_size": v}).encode(), shape_values),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300), st.sampled_from([b"x" * (MAX_BODY + 1), b"[" * 3000]),
    st.sampled_from(MALFORMED_JSON).filter(lambda b: len(b) <= MAX_BODY))
methods = st.one_of(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                     "OPTIONS"]),
                    st.text(st.characters(min_codepoint=0x41, max_codepoint=0x5A), min_size=1,
                            max_size=8))
headers = st.fixed_dictionaries({}, optional={
    "X-Batch-Size": sizes, "Via": latin1, "X-Request-Id": latin1,
    "X-Forwarded-For": latin1, "Idempotency-Key": visible,
    "Content-Type": st.sampled_from(["application/json", "text/plain", "", "json",
                                     "application/json; charset=latin-1"]),
    "Accept-Encoding": st.sampled_from(["gzip", "identity", ""]),
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "x"])})


# -- tests ------------------------------------------------------------------------------------

@fuzz(800)
@given(methods, paths, headers, st.one_of(st.none(), bodies))
def test_any_inference_request_is_proxied_or_refused_clearly(
        env: Env, method: str, path: str, hdrs: dict[str, str], body: bytes | None) -> None:
    tried("router proxy (HTTP requests)")
    router_answer(*request(env.app.port, method, path, body, hdrs))


MALFORMED_HTTP: tuple[bytes, ...] = (
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}",
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999999\r\n"
    b"\r\n",
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"fffff\r\nabc\r\n0\r\n\r\n",
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n",
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"1000\r\n" + b"a" * 4096 + b"\r\n1\r\nb\r\n0\r\n\r\n",  # over the limit, chunked
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 3\r\n\r\n0\r\n\r\n",
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Content-Length: 4\r\n\r\n{}{}",
    b"GET " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Batch-Size: \xff\xfe\r\n\r\n",
    b"GET " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nVia: \x00\r\n\r\n",
    b"GET /v2/models/\xff\xfe/infer HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\rb\r\n\r\n",
    b"GET " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 100_000 + b"\r\n\r\n",
    b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET " + INFER.encode() + b" HTTP/2.0\r\nHost: x\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET " + INFER.encode() + b"\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello
    b"GET " + INFER.encode() + b" HTTP/1.1\r\n" + b"H: v\r\n" * 200 + b"\r\n",
    b"GET " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\n\r\n",
    b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n",
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\n"
    b"Content-Length: 4\r\n\r\n\x00\x01\x02\x03",
    b"GET http://127.0.0.1:1/v2/models/m/infer HTTP/1.1\r\nHost: x\r\n\r\n",
)


@pytest.mark.parametrize("data", MALFORMED_HTTP, ids=range(len(MALFORMED_HTTP)))
def test_malformed_http_gets_a_4xx_or_a_closed_connection(env: Env, data: bytes) -> None:
    tried("router proxy (malformed HTTP)")
    answer = raw_http(env.app.port, data)
    status = status_of(answer)
    assert status is None or status != 500, answer[:300]
    assert b"Traceback" not in answer


@fuzz(200)
@given(st.one_of(methods, st.just("GET")), st.one_of(
    st.sampled_from(["/metrics", "/healthz", "/replicas", "/reload", "/", "/metrics/",
                     "/replicas?x=1", "/%00"]),
    visible.map(lambda t: "/" + urllib.parse.quote(t, safe="/?=&"))),
    st.one_of(st.none(), st.binary(max_size=100)))
def test_the_admin_api_answers_any_request(env: Env, method: str, path: str,
                                           body: bytes | None) -> None:
    tried("router admin API (HTTP requests)")
    if path.startswith("/reload"):
        method = "GET" if method == "POST" else method  # reloads: the test below
    status, _, data = request(env.app.admin_port, method, path, body)
    # 400: a method aiohttp's HTTP parser does not know
    assert status in (200, 400, 404, 405) and b"Traceback" not in data, (status, data[:300])
    if status == 200 and path.startswith("/replicas") and method == "GET":
        assert "m" in json.loads(data)


# a config document with one part replaced by anything
CONFIG_PATHS: list[list[Any]] = [
    [], ["services"], ["services", 0], ["services", 0, "name"], ["services", 0, "replicas"],
    ["services", 0, "models"], ["services", 0, "slo_ms"], ["services", 0, "policy"],
    ["services", 0, "port"], ["services", 0, "replicas", 0],
    *[["services", 0, "replicas", 0, k] for k in ("name", "url", "weight", "concurrency",
                                                  "service_time_ms", "labels", "draining")],
    *[[k] for k in ("policy", "batch_header", "retry_post", "request_timeout_s",
                    "min_samples", "max_body_bytes", "health", "gpu_list")],
    *[["health", k] for k in ("path", "interval_s", "timeout_s", "unhealthy_after")],
]
config_values = st.one_of(json_values, st.sampled_from([
    0, -1, 1e-300, 1e308, 2**64, "", "sed", "round-robin", "nope", "http://127.0.0.1:1",
    "http://127.0.0.1:99999", "http://127.0.0.1:x", "http://[::1", "http://[zz]:80",
    "http://%zz", "ftp://127.0.0.1", "http://", "http:///x", "https://127.0.0.1:1", "/x",
    "health", [], {}, [{"name": "a"}], [{"name": "a", "url": "http://127.0.0.1:1"}] * 2]))


def config_with(base: dict[str, Any], path: list[Any], value: Any) -> Any:
    if not path:
        return value
    doc = json.loads(json.dumps(base))
    cur = doc
    for key in path[:-1]:
        cur = cur[key]
    cur[path[-1]] = value
    return doc


@fuzz(300)
@given(st.sampled_from(CONFIG_PATHS), config_values, st.booleans())
def test_reload_of_any_config_document_reloads_or_keeps_the_old_set(
        env: Env, path: list[Any], value: Any, as_text: bool) -> None:
    tried("router admin /reload (config documents)")
    doc = config_with(env.good, path, value)
    env.config.write_text(json.dumps(doc) if not as_text or not isinstance(value, str)
                          else value)
    generation = env.app.router.generation
    status, _, data = request(env.app.admin_port, "POST", "/reload")
    result = json.loads(data)
    if status == 200:
        assert result == {"reloaded": True, "generation": generation + 1}
    else:
        assert status == 500 and result["reloaded"] is False and result["error"], result
        assert env.app.router.generation == generation  # the old replica set stays
    # the proxy still answers (whatever the new replica set makes of the request)
    router_answer(*request(env.app.port, "POST", INFER, b'{"instances": [1, 2]}',
                           {"Content-Type": "application/json"}))


def test_a_compressed_request_body_reaches_the_replica_as_the_client_sent_it(env: Env) -> None:
    """Found by the fuzzing: the router decoded a gzip body and forwarded the plain bytes still
    labelled gzip (a body that did not decode failed with 500); CONNECT opened a tunnel that
    never ended."""
    import gzip

    body = gzip.compress(json.dumps({"instances": [1, 2, 3]}).encode())
    status, _, data = request(env.app.port, "POST", INFER, body, {
        "Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert status == 200 and json.loads(data)["bytes"] == len(body)
    status, _, data = request(env.app.port, "POST", INFER, b"\x00\x01", {
        "Content-Encoding": "gzip"})
    assert status == 200 and json.loads(data)["bytes"] == 2  # the replica judges it
    status, _, data = request(env.app.port, "CONNECT", "127.0.0.1:1")
    assert status == 405 and "not a tunnel" in json.loads(data)["error"]


def test_after_the_fuzzing_the_router_still_proxies_and_checks_health(env: Env) -> None:
    env.config.write_text(json.dumps(env.good))
    status, _, data = request(env.app.admin_port, "POST", "/reload")
    assert status == 200 and json.loads(data)["reloaded"] is True
    for t in env.app.tasks:
        assert not t.done(), t  # a background task that died would never come back
    status, hdrs, data = request(env.app.port, "POST", INFER,
                                 json.dumps({"inputs": [{"name": "x", "shape": [3, 4],
                                                         "datatype": "FP32",
                                                         "data": [0] * 12}]}).encode(),
                                 {"Content-Type": "application/json", "X-Request-Id": "r1"})
    assert status == 200 and hdrs["x-gpuslice-replica"] in ("one", "two")
    assert json.loads(data)["path"] == INFER
    status, _, data = request(env.app.admin_port, "GET", "/replicas")
    assert status == 200 and {r["name"] for r in json.loads(data)["m"]["replicas"]} == \
        {"one", "two"}
