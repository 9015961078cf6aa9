"""``gpuslice replan --usage-from`` (issue 53, item 5): measured use, from the node agents'
metrics in a file or from a Prometheus server, proposes smaller or larger slices, the SLO
checked by the planner's replay; bad inputs are one line naming the option."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gpuslice.cli import main
from gpuslice.core.planner import Service
from tests.planner.usage_helpers import (
    PodUse,
    agent_metrics,
    plan_of,
    profiles,
    write_plan,
    write_services,
)

CLASSIFY = Service("classify", "resnet50", 600, 150)
DETECT = Service("detect", "densenet121", 500, 150)


@pytest.fixture
def inputs(tmp_path: Path) -> list[str]:
    """classify on a 3g.40gb at 0, detect on a 2g.20gb at 4 of one A100-80GB."""
    plan = plan_of(profiles(), [(0, CLASSIFY, 3, 0), (0, DETECT, 2, 4)])
    return ["replan", "--current", str(write_plan(tmp_path / "plan.json", plan,
                                                  [CLASSIFY, DETECT])),
            "--profiles", "builtin:a100-80gb",
            "--services", str(write_services(tmp_path / "s.yaml", [CLASSIFY, DETECT]))]


def metrics(tmp_path: Path, classify: tuple[int, float | None],
            detect: tuple[int, float | None]) -> str:
    """Two node agents' /metrics, concatenated: (MiB used, % of the GPU's SMs) per pod."""
    path = tmp_path / "metrics.txt"
    path.write_text(agent_metrics("n1", [PodUse("classify", "c-0", *classify, 428, 40192)])
                    + agent_metrics("n2", [PodUse("detect", "d-0", *detect, 285, 19968)]))
    return str(path)


def segments(path: Path, name: str) -> list[str]:
    doc = json.loads(path.read_text())
    svc = next(s for s in doc["services"] if s["name"] == name)
    return [f"{s['profile']}@{s['start']}" for s in svc["segments"]]


def test_a_service_using_a_third_of_its_share_gets_a_smaller_slice(
        inputs: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # classify's pod: 13 of its 40 GB, 12% of the GPU's SMs (28% of its 3/7); detect at half
    src = metrics(tmp_path, (13000, 12.0), (10000, 10.0))
    new = tmp_path / "new.json"
    code = main([*inputs, "--usage-from", src, "--write-json", str(new), "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    use = {u["service"]: u for u in doc["usage"]}
    assert use["classify"]["action"] == "smaller" and use["classify"]["after"] == ["2g.20gb"]
    assert use["classify"]["memory"] == pytest.approx(13000 / 40192, abs=1e-4)
    assert "replayed p99" in use["classify"]["reason"]
    assert use["detect"]["action"] == "kept"
    assert {(c["action"], c["profile"]) for c in doc["changes"]} == {
        ("remove", "3g.40gb"), ("add", "2g.20gb")}
    assert all(r["ok"] for r in doc["replay"])  # the replay holds every SLO
    assert segments(new, "classify") == ["2g.20gb@0"] and segments(new, "detect") == ["2g.20gb@4"]
    plan = json.loads(new.read_text())
    assert plan["valid"] and not plan["slo_violations"]
    # the table says it too: the measured use, the slices before and after, and why
    assert main([*inputs, "--usage-from", src]) == 0
    out = capsys.readouterr().out
    assert "measured use" in out and "32%" in out and "3g.40gb" in out and "2g.20gb" in out
    assert "classify: replayed p99" in out


def test_a_service_near_its_share_gets_a_larger_slice(
        inputs: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # detect keeps 27% of the GPU's SMs busy: 95% of its 2/7; classify at half
    src = metrics(tmp_path, (20000, 21.0), (10000, 27.1))
    new = tmp_path / "new.json"
    code = main([*inputs, "--usage-from", src, "--write-json", str(new), "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    use = {u["service"]: u for u in doc["usage"]}
    assert use["detect"]["action"] == "larger" and use["detect"]["after"] == ["3g.40gb"]
    assert "(SMs) >= 90%" in use["detect"]["reason"]
    assert segments(new, "detect") == ["3g.40gb@4"] and segments(new, "classify") == ["3g.40gb@0"]
    assert doc["gpus_after"] == 1


@contextmanager
def prometheus(answer: Callable[[str], tuple[int, Any]]) -> Iterator[tuple[str, list[str]]]:
    """A Prometheus stand-in on loopback: GET /api/v1/query answered by ``answer(query)``
    (status, JSON body); yields its URL and the queries asked."""
    seen: list[str] = []
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    ready = threading.Event()

    async def query(request: web.Request) -> web.Response:
        seen.append(request.query.get("query", ""))
        status, body = answer(seen[-1])
        return web.json_response(body, status=status)

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/api/v1/query", query)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        return runner

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = loop.run_until_complete(start())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        sock.close()


def vector(values: dict[str, float]) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"service": s}, "value": [1700000000.0, str(v)]} for s, v in values.items()]}}


def test_use_from_a_prometheus_server(inputs: list[str], capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    def answer(q: str) -> tuple[int, Any]:
        if "memory_used_bytes" in q:
            return 200, vector({"classify": 0.3, "detect": 0.5, "elsewhere": 0.1})
        return 200, vector({"classify": 0.2})  # detect's driver gave no SM samples

    with prometheus(answer) as (url, seen):
        code = main([*inputs, "--usage-from", url, "--usage-window", "6h", "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert len(seen) == 2 and all("[6h:1m]" in q and "max by (service)" in q for q in seen)
    use = {u["service"]: u for u in doc["usage"]}
    assert use["classify"]["action"] == "smaller" and use["classify"]["memory"] == 0.3
    assert use["detect"]["sm"] is None and "no SM samples" in use["detect"]["reason"]
    assert set(use) == {"classify", "detect"}  # a service not in the plan is not in it


def one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The exit code must be 2 and stderr one line; returns it."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("gpuslice: error: "), err
    return err.strip()


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuslice.core.resize

    def started(*a: object, **k: object) -> None:
        raise AssertionError("the re-plan started before the bad input was refused")

    monkeypatch.setattr(gpuslice.core.resize, "replan_by_usage", started)


def test_nothing_listening_at_the_url_is_one_line(inputs: list[str], no_work: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    err = one_line([*inputs, "--usage-from", url], capsys)
    assert "--usage-from: expected a Prometheus server answering GET /api/v1/query" in err
    assert url in err


def test_a_server_that_is_not_prometheus_is_one_line(inputs: list[str], no_work: None,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    with prometheus(lambda q: (400, {"status": "error", "errorType": "bad_data",
                                     "error": "parse error at char 3"})) as (url, _):
        err = one_line([*inputs, "--usage-from", url], capsys)
    assert "--usage-from: expected a Prometheus server" in err and "parse error" in err
    with prometheus(lambda q: (200, {"status": "success", "data": {"resultType": "matrix",
                                                                   "result": []}})) as (url, _):
        err = one_line([*inputs, "--usage-from", url], capsys)
    assert "not an instant vector" in err


def test_a_file_that_is_not_metrics_is_one_line(inputs: list[str], no_work: None,
                                                tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    services = inputs[inputs.index("--services") + 1]
    err = one_line([*inputs, "--usage-from", services], capsys)
    assert "--usage-from: expected a Prometheus text exposition" in err and services in err
    err = one_line([*inputs, "--usage-from", str(tmp_path / "nowhere.txt")], capsys)
    assert "--usage-from: expected a Prometheus URL (http://...) or a file" in err


def test_a_planned_service_absent_from_the_usage_is_one_line(
        inputs: list[str], no_work: None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "only-classify.txt"
    path.write_text(agent_metrics("n1", [PodUse("classify", "c-0", 13000, 12.0, 428, 40192)]))
    err = one_line([*inputs, "--usage-from", str(path)], capsys)
    assert "--usage-from: expected measured use of every service of the plan" in err
    assert "none of detect (it has classify)" in err


@pytest.mark.parametrize(("extra", "says"), [
    (["--shrink-below", "0.2"], "--shrink-below: expected --usage-from beside it"),
    (["--usage-window", "6h"], "--usage-window: expected --usage-from beside it"),
    (["--usage-from", "http://prom:9090", "--usage-window", "1 day"], "--usage-window: "
     "expected a Prometheus duration"),
    (["--usage-from", "x.txt", "--usage-window", "6h"], "--usage-window: expected "
     "--usage-from URL beside it"),
    (["--usage-from", "x.txt", "--shrink-below", "0.95"], "--shrink-below: expected a fraction "
     "below --grow-above (0.9)"),
    (["--usage-from", "http://", "--usage-window", "1d"], "--usage-from: expected a Prometheus "
     "URL like http://HOST:9090"),
])
def test_usage_options_are_checked_before_any_work(
        inputs: list[str], no_work: None, extra: list[str], says: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert says in one_line([*inputs, *extra], capsys)
