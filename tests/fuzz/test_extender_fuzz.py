"""Fuzz the scheduler extender's verbs over real HTTP on loopback: /filter, /prioritize, /bind
and /preempt, with scheduler-shaped JSON whose every part may be wrong, with bytes that are not
JSON at all, and with malformed HTTP. tests/extender/test_decoder_fuzz.py fuzzes the decoding
functions in-process; here the whole server answers.

Properties: every request is answered within the timeout, with 200 (the verb's answer, errors
in its ``Error`` field as kube-scheduler reads them) or a 4xx that says what is wrong, never a
500; after the run, a valid filter, prioritize and bind still give the right answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.assignment import ANNOTATION, verify
from gpuslice.services.extender import ExtenderState, make_app
from tests.extender.helpers import KEY, clock, node, pod
from tests.extender.test_decoder_fuzz import pods as random_pods
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

VERBS = ("filter", "prioritize", "bind", "preempt")
NODES = ("a", "b", "zz", "")


class Extender:
    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.state = ExtenderState(api, KEY, clock=clock)
        self.loop = LoopThread()
        self.runner = web.AppRunner(make_app(self.state))

        async def start() -> int:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

        self.port = self.loop.run(start())

    def post(self, verb: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        return request(self.port, "POST", f"/{verb}", body,
                       {"Content-Type": "application/json"})

    def close(self) -> None:
        self.loop.run(self.runner.cleanup())
        self.loop.close()


@pytest.fixture(scope="module")
def ext() -> Iterator[Extender]:
    api = FakeApiServer()
    api.add_node(node("a", "T4", 2))
    api.add_node(node("b", "A100-80GB", 2))
    for name, milli in (("big", 700), ("small", 200)):
        api.add_pod(pod(name, milli))
    e = Extender(api)
    yield e
    e.close()


def check_answer(verb: str, status: int, headers: dict[str, str], body: bytes) -> Any:
    """The answer is one kube-scheduler can read: 200 with the verb's JSON, or a 4xx with a
    message (JSON ``Error`` or aiohttp's plain text for a body that is not JSON)."""
    assert status in (200, 400, 413), (verb, status, body[:500])
    assert b"Traceback" not in body and b"Internal Server Error" not in body
    if status == 413:
        return None
    if headers.get("content-type", "").startswith("text/plain"):
        assert status == 400 and body.strip(), body
        return None
    doc = orjson.loads(body)
    if status == 400:
        assert isinstance(doc, dict) and doc.get("Error"), doc
        return doc
    if verb == "prioritize":
        assert isinstance(doc, list)
        assert all(isinstance(h["Host"], str) and 0 <= h["Score"] <= 10 for h in doc), doc
    elif verb == "preempt":
        assert isinstance(doc.get("NodeNameToMetaVictims"), dict), doc
    else:
        assert isinstance(doc, dict) and isinstance(doc.get("Error"), str), doc
    return doc


# -- inputs -----------------------------------------------------------------------------------

names = st.one_of(st.sampled_from(NODES), st.text(max_size=10))
node_names = st.one_of(json_values, st.lists(names, max_size=5))


def node_objects() -> st.SearchStrategy[Any]:
    meta = st.one_of(json_values, st.fixed_dictionaries({"name": st.one_of(names,
                                                                           json_values)}))
    items = st.lists(st.one_of(json_values, st.fixed_dictionaries({"metadata": meta})),
                     max_size=4)
    return st.one_of(json_values, st.fixed_dictionaries({"items": st.one_of(items,
                                                                            json_values)}))


def stored_pod() -> st.SearchStrategy[Any]:
    """A real pod from the fake API server with one part replaced by anything."""
    def mutate(base: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(json.dumps(base))
        cur = obj
        for key in path[:-1]:
            nxt = cur.get(key) if isinstance(cur, dict) else None
            if not isinstance(nxt, dict):
                return obj
            cur = nxt
        cur[path[-1]] = value
        return obj

    paths = st.sampled_from([["metadata"], ["metadata", "name"], ["metadata", "namespace"],
                             ["metadata", "uid"], ["metadata", "annotations"],
                             ["metadata", "annotations", "gpuslice.io/gpu-model"],
                             ["metadata", "annotations", "gpuslice.io/isolation"],
                             ["metadata", "annotations", "gpuslice.io/assignment"],
                             ["spec"], ["spec", "containers"], ["spec", "nodeName"],
                             ["spec", "initContainers"], ["status"], ["spec", "priority"]])
    base = st.sampled_from([pod("big", 700), pod("small", 200), pod("w", 1000, 2),
                            pod("m", 300, model="T4|A100-80GB", isolation="mps")])
    return st.builds(mutate, base, paths, json_values)


pods = st.one_of(random_pods, stored_pod(), json_values)
extender_args = st.fixed_dictionaries({}, optional={
    "Pod": pods, "NodeNames": node_names, "Nodes": node_objects()})
victims = st.dictionaries(names, st.one_of(json_values, st.fixed_dictionaries(
    {"Pods": st.lists(st.one_of(json_values, st.fixed_dictionaries(
        {"UID": st.one_of(st.text(max_size=8), json_values)}),
        st.fixed_dictionaries({"metadata": st.fixed_dictionaries(
            {"uid": st.one_of(st.text(max_size=8), json_values)})})), max_size=3)},
    optional={"NumPDBViolations": json_values})), max_size=3)
preempt_args = st.fixed_dictionaries({}, optional={
    "Pod": pods, "NodeNameToVictims": st.one_of(victims, json_values),
    "NodeNameToMetaVictims": st.one_of(victims, json_values)})
bind_args = st.fixed_dictionaries({}, optional={
    "PodName": st.one_of(st.sampled_from(["big", "small", "gone"]), json_values),
    "PodNamespace": st.one_of(st.just("default"), json_values),
    "PodUID": st.one_of(st.sampled_from(["uid-default-big", "uid-default-small"]),
                        json_values),
    "Node": st.one_of(names, json_values)})
ARGS = {"filter": extender_args, "prioritize": extender_args, "bind": bind_args,
        "preempt": preempt_args}


def encoded(doc: Any) -> bytes:
    return json.dumps(doc).encode()


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_answers_any_json_with_its_answer_or_a_clear_error(ext: Extender,
                                                                     verb: str) -> None:
    @fuzz(400)
    @given(ARGS[verb])
    def one(args: dict[str, Any]) -> None:
        tried(f"extender /{verb} (JSON)")
        check_answer(verb, *ext.post(verb, encoded(args)))

    one()


@fuzz(300)
@given(st.sampled_from(VERBS), st.one_of(st.binary(max_size=200), st.sampled_from(
    MALFORMED_JSON), json_values.map(encoded)))
def test_bytes_that_are_not_scheduler_json_get_a_clear_400(ext: Extender, verb: str,
                                                           body: bytes) -> None:
    tried("extender verbs (raw bytes)")
    status, headers, data = ext.post(verb, body)
    check_answer(verb, status, headers, data)


MALFORMED_HTTP: tuple[bytes, ...] = (
    b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{}",  # body cut short
    b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
    b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{}",
    b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2"
    b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST /bind HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /preempt HTTP/9.9\r\nHost: x\r\n\r\n",
    b"POST /filter\r\n\r\n", b"\r\n\r\n", b"GARBAGE\r\n\r\n", b"\x00\x01\x02\r\n\r\n",
    b"POST /filter HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
    b"POST /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 9000000\r\n\r\n" + b"{" * 1000,
    b"GET /filter HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /filter?x=%zz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /filter HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}",
)


@pytest.mark.parametrize("data", MALFORMED_HTTP, ids=range(len(MALFORMED_HTTP)))
def test_malformed_http_is_refused_without_a_500_or_a_hang(ext: Extender,
                                                           data: bytes) -> None:
    tried("extender (malformed HTTP)")
    answer = raw_http(ext.port, data)
    status = status_of(answer)
    # an answer, or a closed connection (a body cut short: the client went away)
    assert status is None or 200 <= status < 500, answer[:300]
    assert b"Traceback" not in answer


HOSTILE_ASSIGNMENTS = ('{"mac": "v1:\u00e9\u00e9"}', '{"namespace": "\\ud800"}', "{" * 5000, "null")


@pytest.mark.parametrize("text", HOSTILE_ASSIGNMENTS, ids=range(len(HOSTILE_ASSIGNMENTS)))
def test_a_hand_written_assignment_on_a_pod_is_a_problem_not_a_crash(ext: Extender,
                                                                     text: str) -> None:
    """The assignment annotations the extender reads back from the API server (rebuild and
    watch) are user-writable: with a non-ASCII MAC, ``verify`` raised TypeError, which ended
    the watch loop and so the extender process."""
    import json as json_

    from gpuslice.adapters.kube.annotation import encode
    from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign

    tried("extender (assignments read back)")
    a = sign(Assignment("default", "forged", "uid-forged", "a", (ContainerAssignment(
        "main", Mode.MPS, (GpuShare("GPU-a-0", 900, 1024),)),), "t0"), KEY)
    doc = json_.loads(encode(a))
    extra = json_.loads(text) if text.startswith('{"') else None
    annotation = json_.dumps({**doc, **extra}) if extra is not None else text
    name = f"forged-{HOSTILE_ASSIGNMENTS.index(text)}"
    forged = pod(name, 900)
    forged["metadata"]["annotations"][ANNOTATION] = annotation
    forged["spec"]["nodeName"] = "a"
    ext.api.add_pod(forged)
    ext.state.rebuild()
    assert any(name in p for p in ext.state.problems), ext.state.problems[-3:]


def test_after_the_fuzzing_the_extender_still_filters_prioritizes_and_binds(
        ext: Extender) -> None:
    """Runs last in this module: the state the fuzzing left still answers correctly."""
    ext.api.add_pod(pod("after", 500))
    p = ext.api.get_pod("default", "after")
    status, headers, body = ext.post("filter", encoded({"Pod": p, "NodeNames": ["a", "b",
                                                                                "zz"]}))
    res = check_answer("filter", status, headers, body)
    # the policy's choice alone; no reasons written while a node fits (kube-scheduler reads
    # them only when none is left)
    assert res["Error"] == "" and "zz" not in (res["NodeNames"] or [])
    assert res["NodeNames"], res  # at least one of a, b still has room for 500 milli
    status, headers, body = ext.post("filter", encoded({"Pod": p, "NodeNames": ["zz"]}))
    alone = check_answer("filter", status, headers, body)
    assert not alone["NodeNames"] and "zz" in {**alone["FailedNodes"],
                                               **alone["FailedAndUnresolvableNodes"]}
    target = res["NodeNames"][0]
    status, headers, body = ext.post("prioritize", encoded({"Pod": p,
                                                            "NodeNames": res["NodeNames"]}))
    scores = check_answer("prioritize", status, headers, body)
    assert {h["Host"] for h in scores} == set(res["NodeNames"])
    status, headers, body = ext.post("bind", encoded({
        "PodName": "after", "PodNamespace": "default", "PodUID": p["metadata"]["uid"],
        "Node": target}))
    assert check_answer("bind", status, headers, body) == {"Error": ""}
    a = decode(ext.api.get_pod("default", "after")["metadata"]["annotations"][ANNOTATION])
    assert verify(a, KEY) and a.node == target
    assert request(ext.port, "GET", "/healthz")[0] == 200
