"""A filter waits while too many binds are under way (services/extender/flow.py), over real
HTTP on loopback: kube-scheduler's filters can outrun the Binding writes in a burst, and binds
would queue in the extender holding their shares; the filter answers once a bind finishes, or
after its bounded wait, and never waits with the limit off."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.services.extender import ExtenderState, make_app
from gpuslice.services.extender.flow import BindFlow
from tests.extender.helpers import KEY, clock, node, pod, post


def cluster(pods: int) -> FakeApiServer:
    api = FakeApiServer()
    api.add_node(node("a", "A100-80GB", 8))
    api.add_node(node("b", "A100-80GB", 8))
    for i in range(pods):
        api.add_pod(pod(f"p{i}", 250))
    return api


class SlowBinds:
    """The fake's Binding write held until :attr:`release` is set; counts the writes entered."""

    def __init__(self, api: FakeApiServer) -> None:
        self.release = threading.Event()
        self.entered = 0
        real = api.bind

        def bind(*args: Any, **kw: Any) -> Any:
            self.entered += 1
            self.release.wait(10)
            return real(*args, **kw)

        api.bind = bind  # type: ignore[method-assign]


async def serving(api: FakeApiServer, limit: int, wait_s: float,
                  body: Callable[[str, aiohttp.ClientSession], Awaitable[None]]) -> None:
    state = ExtenderState(api, KEY, clock=clock)
    runner = web.AppRunner(make_app(state, binds_in_flight=limit, flow_wait_s=wait_s))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as s:
            await body(f"http://127.0.0.1:{port}", s)
    finally:
        await runner.cleanup()


def bind_doc(api: FakeApiServer, name: str, node_name: str) -> dict[str, str]:
    uid = api.get_pod("default", name)["metadata"]["uid"]
    return {"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node_name}


def waits(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("gpuslice_extender_filter_waits_total "))


async def until(check: Callable[[], bool]) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


@pytest.mark.parametrize("limit", [1, 2])
def test_a_filter_waits_while_the_limit_of_binds_is_under_way_and_answers_once_one_ends(
        limit: int) -> None:
    api = cluster(limit + 1)
    slow = SlowBinds(api)

    async def body(url: str, s: aiohttp.ClientSession) -> None:
        binds = [asyncio.create_task(post(s, url + "/bind", bind_doc(api, f"p{i}", "a")))
                 for i in range(limit)]
        await until(lambda: slow.entered == limit)
        last = api.get_pod("default", f"p{limit}")
        t0 = time.monotonic()
        filtering = asyncio.create_task(post(s, url + "/filter",
                                             {"Pod": last, "NodeNames": ["a", "b"]}))
        await asyncio.sleep(0.3)
        assert not filtering.done()  # held back: the limit of binds is under way
        slow.release.set()
        st, res = await filtering
        assert st == 200 and res["Error"] == "" and len(res["NodeNames"]) == 1
        assert time.monotonic() - t0 >= 0.3
        for b in binds:
            st, res = await b
            assert st == 200 and res["Error"] == ""
        async with s.get(url + "/metrics") as r:
            assert waits(await r.text()) == 1

    asyncio.run(serving(api, limit, 5.0, body))


@pytest.mark.parametrize(("limit", "at_least", "at_most"), [(1, 0.25, 2.0), (0, 0.0, 0.2)])
def test_the_wait_is_bounded_and_off_with_a_limit_of_zero(limit: int, at_least: float,
                                                          at_most: float) -> None:
    api = cluster(2)
    slow = SlowBinds(api)

    async def body(url: str, s: aiohttp.ClientSession) -> None:
        bind = asyncio.create_task(post(s, url + "/bind", bind_doc(api, "p0", "a")))
        await until(lambda: slow.entered == 1)
        t0 = time.monotonic()
        st, res = await post(s, url + "/filter", {"Pod": api.get_pod("default", "p1"),
                                                  "NodeNames": ["a", "b"]})
        took = time.monotonic() - t0
        # answered (the bind still under way) after the bounded wait, or at once
        assert st == 200 and len(res["NodeNames"]) == 1
        assert at_least <= took < at_most, took
        slow.release.set()
        assert (await bind)[1]["Error"] == ""

    asyncio.run(serving(api, limit, 0.25, body))


def test_binds_that_fail_free_their_place_too() -> None:
    """A refused bind (its pod gone) counts out as a written one does."""
    async def main() -> None:
        flow = BindFlow(1, 5.0)
        flow.started()
        waiter = asyncio.create_task(flow.room())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        flow.finished()
        assert 0.0 < await waiter < 1.0
        assert flow.under_way == 0 and await flow.room() == 0.0

    asyncio.run(main())
    with pytest.raises(ValueError, match="limit"):
        BindFlow(-1, 1.0)


def test_the_limit_is_on_by_default_and_the_help_says_which() -> None:
    """Binds in flight are limited unless asked otherwise (0): the extender's default, which
    deploy/ runs, is the one its --help quotes."""
    import inspect

    from gpuslice.cli import _build_parser
    from gpuslice.services.extender.flow import BINDS_IN_FLIGHT

    assert BINDS_IN_FLIGHT > 0
    assert inspect.signature(make_app).parameters["binds_in_flight"].default == BINDS_IN_FLIGHT
    sub = next(a for a in _build_parser()._actions if a.dest == "command")
    help_text = sub.choices["extender"].format_help()  # type: ignore[attr-defined]
    assert f"(default {BINDS_IN_FLIGHT}," in " ".join(help_text.split())
