"""Contract tier: the drain of a reconfiguration as the routers of deploy/examples/router.yaml
see it. Two routers follow one Service's EndpointSlices (a fake API server over HTTP, as
``kubectl proxy`` serves them); the controller marks a pod ``gpuslice.io/draining`` (a label
the routers list with the EndpointSlices); every router stops sending it new requests and
lets those in flight finish, and the controller's :class:`ServiceRouters`, which finds the
routers through their own Service's EndpointSlices, reports the requests in flight on it
until none is left."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from gpuslice.adapters.http.router_admin import ServiceRouters, admin_urls
from gpuslice.services.router import ServeOptions, make_loader, start_router
from tests.router.harness import backend, run, url


def _slices(eps: list[tuple[str, int]], port_name: str = "http") -> dict[str, Any]:
    """An EndpointSliceList: one slice per (pod, port) on 127.0.0.1."""
    return {"kind": "EndpointSliceList", "items": [{
        "ports": [{"name": port_name, "port": port}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": pod}}]} for pod, port in eps]}


class FakeApi:
    """The model Service's EndpointSlices and the namespace's pods (the draining label
    selected as the API server selects it) over HTTP; the router Service's EndpointSlices
    for the controller (``list_endpoint_slices``)."""

    def __init__(self, model: list[tuple[str, int]]) -> None:
        self.model = model
        self.draining: set[str] = set()
        self.routers: list[tuple[str, int]] = []
        self.pod_reads: list[str] = []

    async def handle(self, request: web.BaseRequest) -> web.Response:
        if request.path.endswith("/endpointslices"):
            return web.json_response(_slices(self.model))
        if request.path == "/api/v1/namespaces/ml/pods":
            self.pod_reads.append(request.query.get("labelSelector", ""))
            sel = request.query.get("labelSelector")
            assert sel == "gpuslice.io/draining=true", sel
            return web.json_response({"kind": "PodList", "items": [
                {"metadata": {"name": n, "labels": {"gpuslice.io/draining": "true"}}}
                for n in sorted(self.draining)]})
        return web.json_response({"kind": "Status", "code": 404}, status=404)

    def list_endpoint_slices(self, namespace: str, service: str) -> dict[str, Any]:
        assert (namespace, service) == ("default", "gpuslice-router")
        return _slices(self.routers, "admin")


def test_every_router_stops_sending_to_a_draining_pod_and_reports_it_drained() -> None:
    with backend("slow", service_ms=1500, concurrency=16) as (ps, _), \
            backend("fast", service_ms=5, concurrency=16) as (pf, _):
        api = FakeApi([("slow", ps), ("fast", pf)])

        async def go() -> None:
            server = web.ServerRunner(web.Server(api.handle))
            await server.setup()
            await web.TCPSite(server, "127.0.0.1", 0).start()
            base = url(server.addresses[0][1])
            apps = []
            for _ in range(2):
                loader, _w = make_loader(ServeOptions(endpointslices="ml/model", kube_api=base))
                apps.append(await start_router(await loader(), loader=loader, policy="round-robin",
                                               reload_every_s=0.1, health=False, admission=False))
            api.routers = [("r", a.admin_port) for a in apps]
            ctl = ServiceRouters(api, "default", "gpuslice-router")
            try:
                async with aiohttp.ClientSession() as s:
                    async def send(app: Any) -> tuple[int, str]:
                        async with s.post(url(app.port) + "/v2/models/m/infer", data=b"{}") as r:
                            await r.read()
                            return r.status, r.headers.get("X-Gpuslice-Replica", "")

                    first = [asyncio.create_task(send(a)) for a in apps for _ in range(4)]
                    await asyncio.sleep(0.3)  # the slow pod has requests in flight
                    assert await asyncio.to_thread(ctl.outstanding, ["slow"]) is None
                    # before the mark: the routers have somewhere else to send (and a pod
                    # they do not list is nowhere to send)
                    assert await asyncio.to_thread(ctl.serving, ["fast"], ["slow"]) is True
                    assert await asyncio.to_thread(ctl.serving, ["new"], ["slow"]) is False
                    assert await asyncio.to_thread(ctl.serving, ["new"], ["other"]) is True
                    api.draining.add("slow")  # the controller's mark
                    for _ in range(100):  # both routers have it draining, requests in flight
                        left = await asyncio.to_thread(ctl.outstanding, ["slow"])
                        if left is not None:
                            break
                        await asyncio.sleep(0.05)
                    assert left is not None and left > 0, left
                    later = await asyncio.gather(*(send(a) for a in apps for _ in range(6)))
                    assert all(r == (200, "fast") for r in later), later  # none to "slow"
                    assert all(st == 200 for st, _ in await asyncio.gather(*first))
                    assert await asyncio.to_thread(ctl.outstanding, ["slow"]) == 0
                    # evicted: the pod leaves the pod list while the EndpointSlices still
                    # list it for a moment; it stays draining, nothing new goes to it
                    api.draining.clear()
                    await asyncio.sleep(0.5)  # a few reloads
                    again = await asyncio.gather(*(send(a) for a in apps for _ in range(6)))
                    assert all(r == (200, "fast") for r in again), again
                    assert await asyncio.to_thread(ctl.outstanding, ["slow"]) == 0
                    # a router that is gone (its admin port refuses) holds nothing
                    await apps[1].close()
                    assert await asyncio.to_thread(ctl.outstanding, ["slow"]) == 0
            finally:
                for a in apps:
                    await a.close()
                await server.cleanup()
            assert api.pod_reads  # the routers read the draining pods with the slices

        run(go())


def test_the_routers_admin_addresses_come_from_every_endpoint_of_their_service() -> None:
    doc = {"items": [
        {"ports": [{"name": "http", "port": 8080}, {"name": "admin", "port": 9901}],
         "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                       {"addresses": ["10.0.0.2"], "conditions": {"ready": False,
                                                                  "terminating": True}}]},
        {"ports": [{"name": "http", "port": 8080}], "endpoints": [{"addresses": ["10.0.0.3"]}]},
        {"ports": [{"name": "admin", "port": 9901}], "endpoints": [{"addresses": ["fd00::1"]}]},
        "junk", {"ports": "x"}]}
    # a terminating router still finishes its requests: it is asked too
    assert admin_urls(doc, "admin") == ["http://10.0.0.1:9901", "http://10.0.0.2:9901",
                                        "http://[fd00::1]:9901"]
    assert admin_urls(doc, "9901") == admin_urls(doc, "admin")
    assert admin_urls({"items": []}, "admin") == []


def test_no_router_found_is_unknown_not_drained() -> None:
    class Empty:
        def list_endpoint_slices(self, namespace: str, service: str) -> dict[str, Any]:
            return {"items": []}

    class Broken:
        def list_endpoint_slices(self, namespace: str, service: str) -> dict[str, Any]:
            raise OSError("API server away")

    assert ServiceRouters(Empty(), "default", "r").outstanding(["p"]) is None
    assert ServiceRouters(Broken(), "default", "r").outstanding(["p"]) is None


def test_a_failed_read_of_the_draining_pods_keeps_the_last_set() -> None:
    """A pod once draining stays so when the pod list fails (403, the API server away): the
    controller may be about to evict it."""
    with backend("a") as (pa, _), backend("b") as (pb, _):
        state = {"fail": False}

        async def handle(request: web.BaseRequest) -> web.Response:
            if request.path.endswith("/endpointslices"):
                return web.json_response(_slices([("a", pa), ("b", pb)]))
            if state["fail"]:
                return web.Response(status=403, text="forbidden")
            return web.json_response({"items": [{"metadata": {
                "name": "a", "labels": {"gpuslice.io/draining": "true"}}}]})

        async def go() -> None:
            server = web.ServerRunner(web.Server(handle))
            await server.setup()
            await web.TCPSite(server, "127.0.0.1", 0).start()
            loader, _w = make_loader(ServeOptions(endpointslices="ml/model",
                                                  kube_api=url(server.addresses[0][1])))
            try:
                cfg = await loader()
                assert {r.name: r.draining for r in cfg.services[0].replicas} == \
                    {"a": True, "b": False}
                state["fail"] = True
                cfg = await loader()
                assert {r.name: r.draining for r in cfg.services[0].replicas} == \
                    {"a": True, "b": False}
            finally:
                await server.cleanup()

        run(go())
