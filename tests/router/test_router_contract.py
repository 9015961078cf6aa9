"""Contract tier: the real router over real HTTP on 127.0.0.1, against fake replica processes
and in-process servers (fakes only behind ports). No timing assertions."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gpuslice.adapters.http.config import read_config
from gpuslice.core.routing_config import RouterConfig
from gpuslice.services.router import RouterApp
from tests.router.harness import backend, config, eventually, router, run, url

INFER = "/v2/models/m/infer"
V2_BODY = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": [0] * 12}]}


def test_proxies_inference_streams_and_reports_the_replica() -> None:
    with backend("one", service_ms=1) as (port, _):
        async def go() -> None:
            async with router(config([{"name": "one", "url": url(port)}])) as (app, s):
                base = url(app.port)
                async with s.post(base + INFER, json=V2_BODY) as r:
                    assert r.status == 200
                    assert r.headers["X-Gpuslice-Replica"] == "one"
                    out = await r.json()
                    assert out["model_name"] == "one"
                async with s.get(base + "/stream?n=4") as r:
                    assert r.status == 200
                    text = await r.text()
                    assert text.count("data:") == 4
                async with s.get(base + "/status?code=503") as r:
                    assert r.status == 503  # a replica's own error passes through
                replicas = app.router.describe()["m"]["replicas"]  # type: ignore[index]
                assert replicas[0]["outstanding"] == 0
                assert replicas[0]["samples"] >= 1
        run(go())


def test_batch_size_from_header_and_body_reaches_the_policy() -> None:
    with backend("one") as (port, _):
        async def go() -> None:
            async with router(config([{"name": "one", "url": url(port)}])) as (app, s):
                seen: list[int] = []
                orig = app.router.pick

                def spy(service, size, exclude, first):  # type: ignore[no-untyped-def]
                    seen.append(size)
                    return orig(service, size, exclude, first)

                app.router.pick = spy  # type: ignore[method-assign]
                base = url(app.port)
                async with s.post(base + INFER, json=V2_BODY) as r:
                    assert r.status == 200
                async with s.post(base + INFER, json={"instances": [1, 2, 3, 4, 5]}) as r:
                    assert r.status == 200
                async with s.post(base + INFER, data=b"{not json",
                                  headers={"X-Batch-Size": "7"}) as r:
                    assert r.status == 200
                assert seen == [3, 5, 7]
        run(go())


def test_malformed_requests_get_clear_4xx_and_the_router_keeps_serving() -> None:
    with backend("one") as (port, _):
        async def go() -> None:
            cfg = config([{"name": "one", "url": url(port)}], max_body_bytes=1000)
            async with router(cfg) as (app, s):
                base = url(app.port)
                async with s.post(base + INFER, data=b"{}", headers={"X-Batch-Size": "-2"}) as r:
                    assert r.status == 400
                    err = await r.json()
                    assert err["field"] == "header X-Batch-Size"
                    assert "batch size" in err["error"]
                async with s.post(base + INFER, data=b"x" * 5000) as r:
                    assert r.status == 413
                    assert "exceeds the limit" in (await r.json())["error"]
                # bytes that are not HTTP at all
                reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
                writer.write(b"\x16\x03\x01 NOT HTTP\r\n\r\n")
                await writer.drain()
                status_line = await reader.readline()
                assert status_line.startswith(b"HTTP/1.") and b" 400 " in status_line
                writer.close()
                async with s.post(base + INFER, json=V2_BODY) as r:
                    assert r.status == 200
        run(go())


def test_backend_garbage_gives_502_and_idempotent_requests_retry_elsewhere() -> None:
    with backend("bad", garbage=True) as (bad, _), backend("good") as (good, _):
        async def go() -> None:
            # weighted round-robin with all weight on the garbage replica: it is tried first
            cfg = config([{"name": "bad", "url": url(bad), "weight": 1000},
                          {"name": "good", "url": url(good), "weight": 1}],
                         policy="weighted-round-robin")
            async with router(cfg, health=False) as (app, s):
                base = url(app.port)
                async with s.post(base + INFER, json=V2_BODY) as r:
                    assert r.status == 502  # POST without Idempotency-Key: not repeated
                    err = await r.json()
                    assert "invalid HTTP response" in err["error"]
                    assert err["replica"] == "bad"
                async with s.get(base + "/v2/models/m") as r:
                    assert r.status == 200  # GET: retried once on the good replica
                    assert r.headers["X-Gpuslice-Replica"] == "good"
                async with s.post(base + INFER, json=V2_BODY,
                                  headers={"Idempotency-Key": "k1"}) as r:
                    assert r.status == 200
                # after repeated failures the garbage replica is taken out
                await eventually(lambda: not app.router.services["m"].views[0].healthy)
                async with s.post(base + INFER, json=V2_BODY) as r:
                    assert r.status == 200
        run(go())


def test_replica_killed_mid_load_loses_no_idempotent_request() -> None:
    with backend("a", service_ms=20, concurrency=8) as (pa, proc_a), \
            backend("b", service_ms=20, concurrency=8) as (pb, _):
        async def go() -> None:
            cfg = config([{"name": "a", "url": url(pa)}, {"name": "b", "url": url(pb)}],
                         policy="round-robin")
            async with router(cfg) as (app, s):
                base = url(app.port)
                statuses: list[int] = []
                started = asyncio.Event()

                async def one(i: int) -> None:
                    if i % 2:
                        req = s.get(base + "/v2/models/m/ready")
                    else:
                        req = s.post(base + INFER, json=V2_BODY,
                                     headers={"Idempotency-Key": f"k{i}"})
                    async with req as r:
                        await r.read()
                        statuses.append(r.status)
                    if len(statuses) >= 20:
                        started.set()

                async def load() -> None:
                    tasks = []
                    for i in range(240):
                        tasks.append(asyncio.ensure_future(one(i)))
                        await asyncio.sleep(0.002)
                    await asyncio.gather(*tasks)

                loader = asyncio.ensure_future(load())
                await started.wait()
                proc_a.send_signal(signal.SIGKILL)  # in-flight requests on a are cut
                await loader
                assert len(statuses) == 240
                assert set(statuses) == {200}, sorted(statuses)
                assert not app.router.services["m"].views[0].healthy
        run(go())


def test_admission_control_answers_429_with_retry_after() -> None:
    with backend("slow", service_ms=60, concurrency=1) as (port, _):
        async def go() -> None:
            cfg = config([{"name": "slow", "url": url(port)}], slo_ms=20, min_samples=3)
            async with router(cfg) as (app, s):
                base = url(app.port)
                codes = []
                for _ in range(6):
                    async with s.post(base + INFER, json=V2_BODY) as r:
                        codes.append(r.status)
                        if r.status == 429:
                            assert int(r.headers["Retry-After"]) >= 1
                            assert "exceeds the SLO" in (await r.json())["error"]
                assert codes[:3] == [200, 200, 200]  # cold: learning
                assert codes[3:] == [429, 429, 429]
                async with s.get(url(app.admin_port) + "/metrics") as r:
                    text = await r.text()
                assert 'gpuslice_router_rejects_total{reason="slo",service="m"} 3.0' in text
                assert 'gpuslice_router_outstanding_requests{replica="slow",service="m"}' in text
                assert "gpuslice_router_request_duration_seconds_bucket" in text
            # the same service with admission off queues instead
            async with router(cfg, admission=False) as (app, s):
                for _ in range(5):
                    async with s.post(url(app.port) + INFER, json=V2_BODY) as r:
                        assert r.status == 200
        run(go())


def test_no_healthy_replica_gives_502_then_503() -> None:
    async def go() -> None:
        # a port nobody listens on, held (bound, never listening: connections are refused)
        # so that no one else, the router itself included, is given it while the test runs
        hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        hold.bind(("127.0.0.1", 0))
        dead = hold.getsockname()[1]
        cfg = config([{"name": "gone", "url": url(dead)}])
        with hold:
            await check(cfg)

    async def check(cfg: dict[str, Any]) -> None:
        async with router(cfg, health=False) as (app, s):
            async with s.get(url(app.port) + "/v2/models/m/ready") as r:
                assert r.status == 502
                assert "refused the connection" in (await r.json())["error"]
            async with s.get(url(app.port) + "/v2/models/m/ready") as r:
                assert r.status == 503
                assert r.headers["Retry-After"] == "1"
                assert "no healthy replica" in (await r.json())["error"]
    run(go())


def test_health_checks_take_a_replica_out_and_back() -> None:
    async def go() -> None:
        state = {"ready": True}

        async def handler(request: web.BaseRequest) -> web.Response:
            if request.path == "/v2/health/ready":
                return web.Response(status=200 if state["ready"] else 503)
            return web.Response(text="ok")

        runner = web.ServerRunner(web.Server(handler))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            cfg = config([{"name": "x", "url": url(port)}],
                         health={"interval_s": 0.05, "unhealthy_after": 2})
            async with router(cfg) as (app, s):
                views = app.router.services["m"].views
                state["ready"] = False
                await eventually(lambda: not views[0].healthy)
                async with s.get(url(app.port) + "/") as r:
                    assert r.status == 503
                state["ready"] = True
                await eventually(lambda: views[0].healthy)
                async with s.get(url(app.port) + "/") as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()
    run(go())


def test_hot_reload_swaps_replicas_without_dropping_in_flight_requests(tmp_path: Path) -> None:
    with backend("a", service_ms=400) as (pa, _), backend("b") as (pb, _):
        path = tmp_path / "router.json"

        def write(names: list[tuple[str, int]]) -> None:
            path.write_text(json.dumps({"services": [{"name": "m", "replicas": [
                {"name": n, "url": url(p)} for n, p in names]}]}))

        write([("a", pa)])

        async def go() -> None:
            async def loader() -> RouterConfig:
                return read_config(path)

            async with router(read_config(path), loader=loader) as (app, s):
                base = url(app.port)
                slow = asyncio.ensure_future(s.post(base + INFER, json=V2_BODY))
                await eventually(lambda: app.router.services["m"].views[0].outstanding == 1)
                write([("b", pb)])
                async with s.post(url(app.admin_port) + "/reload") as r:
                    assert (await r.json())["reloaded"] is True
                async with s.post(base + INFER, json=V2_BODY) as r:
                    assert r.headers["X-Gpuslice-Replica"] == "b"
                resp = await slow  # started on a before the reload, still answered by a
                assert resp.status == 200
                assert resp.headers["X-Gpuslice-Replica"] == "a"
                resp.release()
                path.write_text("{ broken")
                async with s.post(url(app.admin_port) + "/reload") as r:
                    assert r.status == 500
                    assert "valid JSON" in (await r.json())["error"]
                async with s.post(base + INFER, json=V2_BODY) as r:
                    assert r.status == 200  # the old replica set stays
                async with s.get(url(app.admin_port) + "/replicas") as r:
                    assert [x["name"] for x in (await r.json())["m"]["replicas"]] == ["b"]
        run(go())


def test_a_draining_replica_takes_no_new_request_and_finishes_its_in_flight_ones() -> None:
    with backend("a", service_ms=400) as (pa, _), backend("b") as (pb, _):
        def cfg(drain_a: bool) -> RouterConfig:
            return config([{"name": "a", "url": url(pa), "draining": drain_a},
                           {"name": "b", "url": url(pb)}], policy="round-robin")

        async def go() -> None:
            async with router(cfg(False)) as (app, s):
                base = url(app.port)
                slow = [asyncio.ensure_future(s.post(base + INFER, json=V2_BODY))
                        for _ in range(2)]
                await eventually(lambda: app.router.services["m"].views[0].outstanding == 1)
                app.router.apply(cfg(True))
                for _ in range(6):
                    async with s.post(base + INFER, json=V2_BODY) as r:
                        assert r.headers["X-Gpuslice-Replica"] == "b"
                async with s.get(url(app.admin_port) + "/replicas") as r:
                    a = (await r.json())["m"]["replicas"][0]
                    assert a["draining"] is True and a["outstanding"] == 1
                for fut in slow:
                    resp = await fut
                    assert resp.status == 200
                    resp.release()
                await eventually(lambda: app.router.services["m"].views[0].outstanding == 0)
        run(go())


def test_access_log_is_one_json_object_per_request(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    with backend("one") as (port, _):
        async def go() -> RouterApp:
            with log.open("w") as f:
                async with router(config([{"name": "one", "url": url(port)}]),
                                  access_log=f) as (app, s):
                    async with s.post(url(app.port) + INFER, json=V2_BODY,
                                      headers={"X-Request-Id": "req-1"}) as r:
                        assert r.status == 200
                    async with s.post(url(app.port) + INFER,
                                      headers={"X-Batch-Size": "zero"}) as r:
                        assert r.status == 400
            return app
        run(go())
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["status"] for x in lines] == [200, 400]
    assert lines[0]["request_id"] == "req-1"
    assert lines[0]["replica"] == "one"
    assert lines[0]["size"] == 3
    assert "X-Batch-Size" in lines[1]["error"]


def test_two_services_are_chosen_by_model_name() -> None:
    with backend("ra") as (pa, _), backend("rb") as (pb, _):
        async def go() -> None:
            from gpuslice.core.routing_config import parse_router_config

            cfg = parse_router_config({"services": [
                {"name": "resnet", "replicas": [{"name": "ra", "url": url(pa)}]},
                {"name": "bert", "models": ["bert", "bert-large"],
                 "replicas": [{"name": "rb", "url": url(pb)}]}]})
            async with router(cfg) as (app, s):
                base = url(app.port)
                for model, replica in (("resnet", "ra"), ("bert-large", "rb")):
                    async with s.post(f"{base}/v2/models/{model}/infer", json=V2_BODY) as r:
                        assert r.headers["X-Gpuslice-Replica"] == replica
                async with s.post(f"{base}/v1/models/bert:predict", json={}) as r:
                    assert r.headers["X-Gpuslice-Replica"] == "rb"
                async with s.post(f"{base}/v2/models/gpt/infer", json=V2_BODY) as r:
                    assert r.status == 404
                    assert "no service serves model 'gpt'" in (await r.json())["error"]
        run(go())


def test_endpointslices_from_a_fake_api_server() -> None:
    from gpuslice.services.router import ServeOptions, make_loader

    with backend("pod-a") as (pa, _):
        async def go() -> None:
            doc = {"kind": "EndpointSliceList", "items": [{
                "ports": [{"name": "http", "port": pa}],
                "endpoints": [
                    {"addresses": ["127.0.0.1"], "conditions": {"ready": True},
                     "targetRef": {"kind": "Pod", "name": "pod-a"}, "nodeName": "n1"},
                    {"addresses": ["10.9.9.9"], "conditions": {"ready": False},
                     "targetRef": {"kind": "Pod", "name": "pod-b"}}]}]}
            seen: list[str] = []

            async def handler(request: web.BaseRequest) -> web.Response:
                seen.append(request.path_qs)
                return web.json_response(doc)

            runner = web.ServerRunner(web.Server(handler))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            api = url(runner.addresses[0][1])
            try:
                loader, _ = make_loader(ServeOptions(endpointslices="ml/resnet", kube_api=api))
                cfg = await loader()
                assert [r.name for r in cfg.services[0].replicas] == ["pod-a"]
                assert seen[0].startswith("/apis/discovery.k8s.io/v1/namespaces/ml/")
                assert "kubernetes.io/service-name%3Dresnet" in seen[0]
                async with router(cfg) as (app, s):
                    r = await s.post(url(app.port) + "/v2/models/resnet/infer", json=V2_BODY)
                    assert r.status == 200
                    r.release()
            finally:
                await runner.cleanup()
        run(go())


def test_cli_router_exports_and_errors(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from gpuslice.cli import main

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"services": [{"name": "resnet50", "slo_p99_ms": 100, "replicas": [
        {"name": "r0", "gpu": "H100-SXM", "throughput_rps": 300, "url": "http://10.0.0.1:8000"},
        {"name": "r1", "gpu": "T4", "throughput_rps": 100, "url": "http://10.0.0.2:8000"},
        {"name": "r2", "gpu": "T4", "throughput_rps": 100, "url": "http://10.0.0.3:8000"}]}]}))
    assert main(["router", "--plan", str(plan), "--export", "istio", "--namespace", "ml"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kinds = [x["kind"] for x in doc["items"]]
    assert kinds == ["DestinationRule", "VirtualService"]
    route = doc["items"][1]["spec"]["http"][0]["route"]
    assert {d["destination"]["subset"]: d["weight"] for d in route} == {"h100-sxm": 60, "t4": 40}
    assert doc["items"][0]["spec"]["subsets"][0]["labels"] == {"gpuslice.io/gpu-model":
                                                               "H100-SXM"}
    assert main(["router", "--plan", str(plan), "--export", "envoy"]) == 0
    eds = json.loads(capsys.readouterr().out)
    eps = eds["resources"][0]["endpoints"][0]["lb_endpoints"]
    assert [e["load_balancing_weight"] for e in eps] == [128, 43, 43]
    assert eps[0]["endpoint"]["address"]["socket_address"] == {"address": "10.0.0.1",
                                                               "port_value": 8000}
    assert main(["router"]) == 2
    assert "--config is missing: expected a router config" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"services": [{"name": "m", "replicas": [{"url": "nope"}]}]}))
    assert main(["router", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.json: services[m].replicas[0].url: expected an http:// URL with a host" in err
    assert main(["router", "--config", str(bad), "--policy", "fastest"]) == 2
    assert "policy: expected a routing policy" in capsys.readouterr().err


def test_body_size_parsing() -> None:
    from gpuslice.adapters.http.inference import body_size, model_from_path

    cases = [
        (b'{"inputs":[{"name":"x","shape":[8,3],"datatype":"FP32","data":[]}]}', 8),
        (b'{"instances":[[1],[2]]}', 2),
        (b'{"inputs":[[1],[2],[3]]}', 3),
        (b'{"batch_size": 16}', 16),
        (b'{"batch_size": true}', 1),
        (b"[1, 2]", 1),
        (b"garbage", 1),
        (b"", 1),
    ]
    for raw, size in cases:
        assert body_size(raw, "application/json") == size, raw
    assert body_size(b'{"batch_size": 4}', "text/plain") == 1
    assert model_from_path("/v2/models/resnet/versions/2/infer") == "resnet"
    assert model_from_path("/v1/models/bert:predict") == "bert"
    assert model_from_path("/v2/health/ready") is None


def test_session_is_reused_for_concurrent_requests() -> None:
    with backend("one", service_ms=5, concurrency=16) as (port, _):
        async def go() -> None:
            async with router(config([{"name": "one", "url": url(port)}])) as (app, s):
                async def one() -> int:
                    async with s.post(url(app.port) + INFER, json=V2_BODY) as r:
                        await r.read()
                        return r.status
                codes = await asyncio.gather(*(one() for _ in range(50)))
                assert set(codes) == {200}
                assert app.router.services["m"].views[0].outstanding == 0
        run(go())


_ = aiohttp


def test_planner_plan_segments_become_weighted_replicas(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from gpuslice.adapters.http.endpointslices import replicas_from_slices
    from gpuslice.cli import main

    plan = {"gpus": 2, "gpu_list": [{"index": 0, "gpu": "A100-80GB"}, {"index": 1, "gpu": "A30"}],
            "services": [{"name": "resnet50", "slo_ms": 50, "capacity_rps": 400, "segments": [
                {"gpu": 0, "profile": "3g.40gb", "start": 0, "throughput_rps": 300.0},
                {"gpu": 1, "profile": "1g.6gb", "start": 3, "throughput_rps": 100.0}]}]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    cfg = read_config(path, need_urls=False)
    reps = cfg.services[0].replicas
    assert [(r.name, r.weight, r.labels["gpu"]) for r in reps] == [
        ("resnet50-g0-3g-40gb-0", 300.0, "A100-80GB"), ("resnet50-g1-1g-6gb-3", 100.0, "A30")]
    assert main(["router", "--plan", str(path), "--export", "istio"]) == 0
    route = json.loads(capsys.readouterr().out)["items"][1]["spec"]["http"][0]["route"]
    assert [d["weight"] for d in route] == [75, 25]
    # pods of the planner's Deployments pick up the weights by name prefix
    doc = {"items": [{"ports": [{"port": 8000}], "endpoints": [
        {"addresses": ["10.0.0.9"], "targetRef": {"name": "resnet50-g0-3g-40gb-0-7d9f-abcde"}},
        {"addresses": ["10.0.0.8"], "targetRef": {"name": "other-pod"}}]}]}
    got = replicas_from_slices(doc, None, {r.name: r for r in reps})
    assert [(r.url, r.weight) for r in got] == [("http://10.0.0.9:8000", 300.0),
                                                ("http://10.0.0.8:8000", 1.0)]


def test_terminating_endpoints_that_still_serve_are_draining_replicas() -> None:
    from gpuslice.adapters.http.endpointslices import replicas_from_slices

    def ep(name: str, **cond: bool) -> dict[str, object]:
        return {"addresses": [f"10.0.0.{len(name)}"], "conditions": cond,
                "targetRef": {"name": name}}

    doc = {"items": [{"ports": [{"port": 8000}], "endpoints": [
        ep("up", ready=True), ep("leaving", ready=False, serving=True, terminating=True),
        ep("gone", ready=False, serving=False, terminating=True), ep("notready", ready=False)]}]}
    reps = {r.name: r for r in replicas_from_slices(doc)}
    assert set(reps) == {"up", "leaving"}
    assert reps["leaving"].draining and not reps["up"].draining


def test_endpoints_whose_fields_are_not_of_their_types_are_skipped() -> None:
    """discovery/v1 EndpointSlice (k8s.io/api discovery/v1 types.go): ``addresses`` a list of
    strings, ``conditions`` and ``targetRef`` objects, a port 1..65535. A source that sends
    anything else (a proxy, a fake) gets those endpoints skipped, not turned into replicas
    such as ``http://1:80`` from a string's characters or ``http://10.0.0.1:True``."""
    from gpuslice.adapters.http.endpointslices import replicas_from_slices

    good = {"addresses": ["10.0.0.1"], "targetRef": {"name": "good"}}
    doc = {"items": [
        {"ports": [{"port": 8000}], "endpoints": [
            good, {"addresses": "10.0.0.2"}, {"addresses": [None, 7, "", "a b"]},
            {"addresses": ["10.0.0.3"], "conditions": "x"},
            {"addresses": ["10.0.0.4"], "targetRef": "x"},
            {"addresses": ["10.0.0.5"], "nodeName": 5, "targetRef": {"name": 5}}]},
        {"ports": [{"port": True}], "endpoints": [{"addresses": ["10.0.1.1"]}]},
        {"ports": [{"port": 99999}], "endpoints": [{"addresses": ["10.0.1.2"]}]},
        {"ports": "x", "endpoints": [{"addresses": ["10.0.1.3"]}]}]}
    reps = {r.name: r.url for r in replicas_from_slices(doc)}
    assert reps == {"good": "http://10.0.0.1:8000", "10.0.0.5": "http://10.0.0.5:8000"}


def test_a_source_that_answers_garbage_leaves_the_replicas_and_the_reload_loop_alive() -> None:
    """The EndpointSlice source answers a login page (HTML with 200), then a good list again:
    the failed reload keeps the replica set, says why (``POST /reload``), and the periodic
    reload goes on and picks up the good list."""
    from gpuslice.services.router import ServeOptions, make_loader, start_router

    with backend("pod-a") as (pa, _):
        async def go() -> None:
            answers = ["good", "html", "html", "good2"]

            async def handler(request: web.BaseRequest) -> web.Response:
                kind = answers[0] if len(answers) == 1 else answers.pop(0)
                if kind == "html":
                    return web.Response(text="<html>login</html>", content_type="text/html")
                name = "pod-a" if kind == "good" else "pod-a2"
                return web.json_response({"items": [{"ports": [{"port": pa}], "endpoints": [
                    {"addresses": ["127.0.0.1"], "targetRef": {"name": name}}]}]})

            runner = web.ServerRunner(web.Server(handler))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            loader, _ = make_loader(ServeOptions(endpointslices="ml/resnet",
                                                 kube_api=url(runner.addresses[0][1])))
            app = await start_router(await loader(), loader=loader, reload_every_s=0.1,
                                     health=False)

            def names() -> list[str]:
                return [r.name for r in app.router.config.services[0].replicas]

            try:
                async with aiohttp.ClientSession() as s:
                    for _ in range(100):
                        if app.reload_errors:
                            break
                        await asyncio.sleep(0.05)
                    assert "a JSON answer from the API server" in app.reload_errors[0]
                    assert names() == ["pod-a"]
                    for _ in range(100):
                        if names() == ["pod-a2"]:
                            break
                        await asyncio.sleep(0.05)
                    assert names() == ["pod-a2"]
                    assert not any(t.done() for t in app.tasks)
                    r = await s.post(url(app.port) + "/v2/models/resnet/infer", json=V2_BODY)
                    assert r.status == 200
                    r.release()
            finally:
                await app.close()
                await runner.cleanup()
        run(go())


def test_a_replica_url_pointing_back_at_a_router_is_refused_as_a_loop() -> None:
    """RFC 9110 7.6.3: the router adds itself to Via both ways; a request that comes back to
    the router that already forwarded it is answered 508 instead of going round again, for a
    router pointing at itself and for two routers pointing at each other."""
    async def go() -> None:
        seen_via: list[str] = []

        async def handler(request: web.BaseRequest) -> web.Response:
            seen_via.append(request.headers.get("Via", ""))
            return web.Response(text="ok", headers={"Via": "1.1 upstream-cache"})

        runner = web.ServerRunner(web.Server(handler))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        real = runner.addresses[0][1]
        try:
            async with router(config([{"name": "real", "url": url(real)}]),
                              health=False) as (a, s), \
                    router(config([{"name": "real", "url": url(real)}]),
                           health=False) as (b, _):
                async with s.get(url(a.port) + "/v2/models/m/ready",
                                 headers={"Via": "1.0 edge"}) as r:
                    assert r.status == 200
                    assert r.headers["Via"] == f"1.1 upstream-cache, 1.1 {a.proxy.via_name}"
                assert seen_via == [f"1.0 edge, 1.1 {a.proxy.via_name}"]
                # a router whose only replica is itself
                a.router.apply(config([{"name": "me", "url": url(a.port)}]))
                async with s.get(url(a.port) + "/v2/models/m/ready") as r:
                    assert r.status == 508
                    body = await r.json()
                    assert "loop" in body["error"] and a.proxy.via_name in body["error"]
                    assert r.headers["X-Gpuslice-Replica"] == "me"
                # a -> b -> a
                a.router.apply(config([{"name": "b", "url": url(b.port)}]))
                b.router.apply(config([{"name": "a", "url": url(a.port)}]))
                async with s.get(url(a.port) + "/v2/models/m/ready") as r:
                    assert r.status == 508
                # both keep serving once pointed at a real replica
                a.router.apply(config([{"name": "real", "url": url(real)}]))
                b.router.apply(config([{"name": "real", "url": url(real)}]))
                for app in (a, b):
                    async with s.get(url(app.port) + "/v2/models/m/ready") as r:
                        assert r.status == 200
        finally:
            await runner.cleanup()
    run(go())
