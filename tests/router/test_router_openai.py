"""Contract tier for generative services (issue 52): OpenAI-style requests through the real
router over real HTTP on 127.0.0.1, against fake OpenAI-style replica processes
(``gpuslice.adapters.http.fake_llm``) and in-process servers. No timing assertions: the order
of events is proven by making the replica wait for the client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gpuslice.adapters.http.engine_metrics import parse_engine_metrics
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing_config import RouterConfig, parse_router_config
from tests.router.harness import eventually, router, run, url

CHAT = "/v1/chat/completions"


@contextlib.contextmanager
def llm(model: str, *extra: str) -> Iterator[int]:
    """A fake OpenAI-style replica process serving ``model``; yields its port."""
    args = [sys.executable, "-m", "gpuslice.adapters.http.fake_llm", "--port", "0",
            "--model", model, *extra]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"fake LLM did not start: {line!r}")
        yield int(line.split()[1])
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


def llm_config(services: list[dict[str, Any]], **top: Any) -> RouterConfig:
    for s in services:
        s.setdefault("api", "openai")
    top.setdefault("health", {"interval_s": 0.2, "timeout_s": 1.0, "path": "/health"})
    return parse_router_config({"services": services, **top})


def chat(model: str, max_tokens: int = 3, stream: bool = False, **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens, "stream": stream, **more}


async def stats(session: aiohttp.ClientSession, port: int) -> dict[str, Any]:
    async with session.get(url(port) + "/fake/stats") as r:
        return await r.json()  # type: ignore[no-any-return]


def test_requests_for_several_models_route_by_the_body_and_list_the_union() -> None:
    with llm("llama", "--lora", "sql-lora") as pa, llm("qwen") as pb, llm("embed") as pc:
        async def go() -> None:
            cfg = llm_config([
                {"name": "llama", "models": ["llama"], "adapters": ["sql-lora"],
                 "replicas": [{"name": "a", "url": url(pa)}]},
                {"name": "qwen", "models": ["qwen"], "replicas": [{"name": "b", "url": url(pb)}]},
                {"name": "embed", "models": ["embed"],
                 "replicas": [{"name": "c", "url": url(pc)}]}])
            async with router(cfg) as (app, s):
                base = url(app.port)
                for model, replica in (("llama", "a"), ("qwen", "b"), ("sql-lora", "a")):
                    async with s.post(base + CHAT, json=chat(model)) as r:
                        assert r.status == 200, await r.text()
                        assert r.headers["X-Gpuslice-Replica"] == replica
                        doc = await r.json()
                        assert doc["model"] == model
                        assert doc["usage"]["completion_tokens"] == 3
                async with s.post(base + "/v1/completions",
                                  json={"model": "qwen", "prompt": "x", "max_tokens": 2}) as r:
                    assert r.headers["X-Gpuslice-Replica"] == "b"
                    assert (await r.json())["choices"][0]["text"] == " t1 t2"
                async with s.post(base + "/v1/embeddings",
                                  json={"model": "embed", "input": ["a", "b"]}) as r:
                    assert r.headers["X-Gpuslice-Replica"] == "c"
                    assert (await r.json())["data"][0]["object"] == "embedding"
                async with s.get(base + "/v1/models") as r:
                    assert r.status == 200
                    listed = {m["id"]: m["parent"] for m in (await r.json())["data"]}
                assert listed == {"llama": None, "sql-lora": "llama", "qwen": None,
                                  "embed": None}
                described = app.router.describe()
                assert described["qwen"]["api"] == "openai"  # type: ignore[index]
        run(go())


def test_unknown_model_and_bad_bodies_get_openai_shaped_errors() -> None:
    with llm("llama") as port:
        async def go() -> None:
            cfg = llm_config([{"name": "llama", "models": ["llama"],
                               "replicas": [{"name": "a", "url": url(port)}]}],
                             max_body_bytes=2048)
            async with router(cfg) as (app, s):
                base = url(app.port)
                async with s.post(base + CHAT, json=chat("gpt-9")) as r:
                    assert r.status == 404
                    err = (await r.json())["error"]
                    assert err["type"] == "NotFoundError"
                    assert err["param"] == "model"
                    assert err["code"] == 404
                    assert "gpt-9" in err["message"]
                async with s.post(base + CHAT, json={"messages": []}) as r:
                    assert r.status == 400
                    err = (await r.json())["error"]
                    assert err["param"] == "model"
                    assert "model" in err["message"]
                async with s.post(base + CHAT, data=b"{not json",
                                  headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 400
                    assert "not valid JSON" in (await r.json())["error"]["message"]
                big = chat("llama", messages=[{"role": "user", "content": "x" * 4000}])
                async with s.post(base + CHAT, json=big) as r:
                    assert r.status == 413
                    assert "2048 bytes" in (await r.json())["error"]["message"]
                async with s.post(base + CHAT, json=chat("llama")) as r:
                    assert r.status == 200  # the router keeps serving
        run(go())


def test_the_body_is_forwarded_unchanged() -> None:
    seen: list[bytes] = []

    async def handler(request: web.BaseRequest) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"ok": True})

    async def go() -> None:
        server = web.Server(handler)
        runner = web.ServerRunner(server)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            cfg = llm_config([{"name": "m", "models": ["m"], "metrics_path": None,
                               "replicas": [{"name": "x", "url": url(port)}]}])
            async with router(cfg, health=False) as (app, s):
                raw = b'{"model":"m",  "messages":[{"role":"user","content":"\\u00e9t\\u00e9"}],' \
                      b'"max_tokens":7,"custom_field":[1,2,3]}'
                async with s.post(url(app.port) + CHAT, data=raw,
                                  headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()
        assert seen == [raw]

    run(go())


def test_a_stream_is_passed_event_by_event_and_timed() -> None:
    """The replica writes its second event only after the client has received the first:
    buffering anywhere on the way would deadlock (and fail the test by its timeout)."""
    got_first = asyncio.Event()

    def event(content: str) -> bytes:
        doc = {"object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": 0, "delta": {"content": content}}]}
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event("first"))
        await asyncio.wait_for(got_first.wait(), 20)
        for word in ("second", "third"):
            await resp.write(event(word))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def go() -> None:
        runner = web.ServerRunner(web.Server(handler))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            cfg = llm_config([{"name": "m", "models": ["m"], "metrics_path": None,
                               "replicas": [{"name": "x", "url": url(port)}]}])
            async with router(cfg, health=False) as (app, s):
                async with s.post(url(app.port) + CHAT, json=chat("m", stream=True)) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    first = await r.content.readuntil(b"\n\n")
                    assert b'"first"' in first
                    got_first.set()
                    rest = await r.content.read()
                assert rest.count(b"data:") == 3 and rest.endswith(b"data: [DONE]\n\n")
                text = await (await s.get(url(app.admin_port) + "/metrics")).text()
                count = _sample(text, "gpuslice_router_time_to_first_token_seconds_count")
                assert count == 1.0
                assert _sample(text, "gpuslice_router_time_per_output_token_seconds_count") == 1.0
                view = app.router.services["m"].views[0]
                assert view.tokens is not None and view.tokens.samples == 1
                assert view.outstanding == 0
        finally:
            await runner.cleanup()

    run(go())


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def test_streams_through_the_fake_replica_report_ttft_tpot_in_the_access_log(
        tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    with llm("llama", "--step-ms", "1") as port:
        async def go() -> None:
            cfg = llm_config([{"name": "llama", "models": ["llama"],
                               "replicas": [{"name": "a", "url": url(port)}]}])
            with log.open("w") as f:
                async with router(cfg, access_log=f) as (app, s):
                    body = chat("llama", max_tokens=5, stream=True,
                                stream_options={"include_usage": True})
                    async with s.post(url(app.port) + CHAT, json=body) as r:
                        text = await r.text()
                    assert text.count('"content":" t') == 5
                    assert text.endswith("data: [DONE]\n\n")
        run(go())
    line = json.loads(log.read_text().splitlines()[0])
    assert line["status"] == 200
    assert line["tokens_out"] == 5
    assert line["tokens_in"] > 0
    assert line["ttft_ms"] > 0 and line["tpot_ms"] > 0


def test_a_client_that_goes_away_cancels_the_generation_on_the_replica() -> None:
    with llm("llama", "--step-ms", "20") as port:
        async def go() -> None:
            cfg = llm_config([{"name": "llama", "models": ["llama"],
                               "replicas": [{"name": "a", "url": url(port)}]}])
            async with router(cfg) as (app, s):
                client = aiohttp.ClientSession()
                r = await client.post(url(app.port) + CHAT,
                                      json=chat("llama", max_tokens=100_000, stream=True))
                assert r.status == 200
                await r.content.readuntil(b'"content":" t1"')
                r.close()  # the client hangs up mid-stream
                await client.close()

                async def aborted() -> bool:
                    st = await stats(s, port)
                    return st["aborted"] == 1 and st["running"] == 0

                await eventually(aborted)
                assert (await stats(s, port))["generated_tokens"] < 100_000

                async def released() -> bool:
                    return app.router.services["llama"].views[0].outstanding == 0

                await eventually(released)
        run(go())


def test_replica_gauges_are_scraped_and_routing_avoids_the_queued_replica() -> None:
    """Two equal replicas; one is kept busy by a client that bypasses the router (the router
    cannot count those requests): only its vLLM gauges tell, and new requests go to the other
    one."""
    with llm("llama", "--step-ms", "50", "--max-num-seqs", "1") as pa, \
            llm("llama", "--step-ms", "1") as pb:
        async def go() -> None:
            cfg = llm_config([{"name": "llama", "models": ["llama"], "policy": "sed",
                               "replicas": [{"name": "a", "url": url(pa)},
                                            {"name": "b", "url": url(pb)}]}])
            async with router(cfg) as (app, s):
                side = aiohttp.ClientSession()
                busy = [asyncio.ensure_future(side.post(
                    url(pa) + CHAT, json=chat("llama", max_tokens=2000, stream=True)))
                    for _ in range(3)]

                def seen_busy() -> bool:
                    eng = app.router.describe()["llama"]["replicas"][0]["engine"]  # type: ignore
                    return eng is not None and eng["waiting"] >= 2 and eng["running"] == 1

                await eventually(seen_busy)
                for _ in range(5):
                    async with s.post(url(app.port) + CHAT, json=chat("llama")) as r:
                        assert r.status == 200
                        assert r.headers["X-Gpuslice-Replica"] == "b"
                for f in busy:
                    (await f).close()
                await side.close()
        run(go())


def test_generative_service_config_errors_name_the_field() -> None:
    def bad(svc: dict[str, Any], field: str) -> None:
        base = {"name": "s", "replicas": [{"name": "a", "url": "http://127.0.0.1:1"}]}
        with pytest.raises(ValidationError) as exc:
            parse_router_config({"services": [{**base, **svc}]})
        assert exc.value.field == field, exc.value.field

    bad({"api": "grpc"}, "services[s].api")
    bad({"api": "openai", "metrics_path": "metrics"}, "services[s].metrics_path")
    bad({"api": "openai", "slo_ttft_ms": "fast"}, "services[s].slo_ttft_ms")
    bad({"api": "openai", "adapters": [3]}, "services[s].adapters[0]")
    bad({"api": "openai", "replicas": [{"name": "a", "url": "http://h:1",
                                        "decode_tokens_per_s": -1}]},
        "services[s].replicas[0].decode_tokens_per_s")
    cfg = parse_router_config({"services": [{"name": "s", "slo_ttft_ms": 500,
                                             "replicas": [{"name": "a", "url": "http://h:1"}]}]})
    spec = cfg.services[0]
    assert spec.generative and spec.slo_ttft_s == 0.5 and spec.metrics_path == "/metrics"
    assert spec.replicas[0].concurrency == 256


def test_the_fake_replica_queues_what_its_kv_cache_cannot_hold() -> None:
    """Two requests of 60 tokens each (prompt + output) on a KV cache of 100 tokens: the second
    waits for the first, and the replica's vLLM gauges say so."""
    with llm("llama", "--kv-tokens", "100", "--step-ms", "20") as port:
        async def go() -> None:
            async with aiohttp.ClientSession() as s:
                body = {"model": "llama", "prompt": "x" * 40, "max_tokens": 50, "stream": True}
                first = await s.post(url(port) + "/v1/completions", json=body)
                await first.content.readuntil(b" t1\"")
                second = asyncio.ensure_future(s.post(url(port) + "/v1/completions", json=body))

                async def queued() -> bool:
                    async with s.get(url(port) + "/metrics") as r:
                        page = await r.read()
                    load = parse_engine_metrics(page)
                    return load is not None and load.running == 1 and load.waiting == 1 \
                        and load.kv_usage > 0

                await eventually(queued)
                rest = await first.content.read()
                assert rest.endswith(b"data: [DONE]\n\n")
                r2 = await second
                assert (await r2.content.read()).count(b'"text":" t') == 50
                st = await stats(s, port)
                assert st["finished"] == 2 and st["waiting"] == 0
        run(go())


def test_admission_by_predicted_ttft_answers_an_openai_429() -> None:
    with llm("llama", "--step-ms", "5") as port:
        async def go() -> None:
            cfg = llm_config([{"name": "llama", "models": ["llama"], "slo_ttft_ms": 0.5,
                               "replicas": [{"name": "a", "url": url(port)}]}], min_samples=1)
            async with router(cfg) as (app, s):
                async with s.post(url(app.port) + CHAT, json=chat("llama")) as r:
                    assert r.status == 200  # still learning: admitted
                for _ in range(20):  # a probe may be let through; the next one is judged
                    async with s.post(url(app.port) + CHAT, json=chat("llama")) as r:
                        if r.status == 429:
                            err = (await r.json())["error"]
                            assert err["type"] == "RateLimitError"
                            assert "time to first token" in err["message"]
                            assert int(r.headers["Retry-After"]) >= 1
                            return
                        assert r.status == 200
                raise AssertionError("no request was refused")
        run(go())


def test_without_a_generative_service_v1_models_is_kserve_v1_and_forwarded() -> None:
    seen: list[str] = []

    async def handler(request: web.BaseRequest) -> web.Response:
        seen.append(request.path)
        return web.json_response({"models": ["resnet"]})

    async def go() -> None:
        runner = web.ServerRunner(web.Server(handler))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            cfg = parse_router_config({"services": [
                {"name": "resnet", "replicas": [{"name": "x", "url": url(port)}]}]})
            async with router(cfg, health=False) as (app, s):
                r = await s.get(url(app.port) + "/v1/models")
                assert r.status == 200
                assert r.headers["X-Gpuslice-Replica"] == "x"
                assert await r.json() == {"models": ["resnet"]}
        finally:
            await runner.cleanup()
        assert seen == ["/v1/models"]

    run(go())
