"""``gpuslice router`` as a new user meets it (issue 18, first contact): the planner's plan.json,
which names slices but no addresses, either fails saying what to add or, with
--endpointslices, starts with the Service's ready pods as replicas; a router of one service
refuses another model with 404 naming it. Everything over real HTTP on loopback: the router
process, a replica process, and an API server stand-in answering the EndpointSlice list (as
``kubectl proxy`` would, unauthenticated)."""

from __future__ import annotations

import json
import re
import selectors
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from gpuslice.cli import main

PROFILE = ("model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms\n"
           "vgg19,A100-80GB,mig,1,4,1,200,20\nvgg19,A100-80GB,mig,7,4,1,1400,3\n")


@pytest.fixture
def plan_json(tmp_path: Path) -> Path:
    (tmp_path / "p.csv").write_text(PROFILE)
    (tmp_path / "s.yaml").write_text("- {name: v, model: vgg19, rate: 100, slo_ms: 200}\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "--profiles", str(tmp_path / "p.csv"), "--services",
                 str(tmp_path / "s.yaml"), "--write-json", str(out), "-o", "json"]) == 0
    return out


def test_a_plan_without_urls_says_what_to_add(plan_json: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--plan", str(plan_json)]) == 2
    err = capsys.readouterr().err
    assert "--plan" in err and "--endpointslices NAMESPACE/SERVICE" in err
    assert "--endpointslices default/v" in err and "without a url (v/v-g0-1g-10gb-" in err


class _Api(BaseHTTPRequestHandler):
    slices: ClassVar[dict[str, object]] = {}
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.asked.append(self.path)
        body = json.dumps(self.slices).encode()
        ok = self.path.startswith("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
                                  "?labelSelector=kubernetes.io/service-name%3Dv")
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def replica() -> Iterator[int]:
    p = subprocess.Popen([sys.executable, "-m", "gpuslice.adapters.http.fake_replica",
                          "--port", "0", "--service-ms", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("ready"), line
        yield int(line.split()[1])
    finally:
        p.terminate()
        p.wait(10)


def _wait_line(p: subprocess.Popen[str], pattern: str, timeout_s: float = 30) -> str:
    assert p.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stderr, selectors.EVENT_READ)
    end = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < end:
        if sel.select(timeout=0.2):
            line = p.stderr.readline()
            if not line:
                break
            seen.append(line)
            if re.search(pattern, line):
                return line
    raise AssertionError(f"no line like {pattern!r}: {''.join(seen)}")


def _post(url: str) -> tuple[int, str]:
    req = urllib.request.Request(url, data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_plan_with_endpointslices_serves_and_refuses_other_models(
        plan_json: Path, replica: int) -> None:
    _Api.slices = {"kind": "EndpointSliceList", "items": [{
        "metadata": {"name": "v-abc12", "labels": {"kubernetes.io/service-name": "v"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": replica}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": "v-g0-1g-10gb-6-5d8f-x"}}]}]}
    api = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    router = subprocess.Popen(
        [sys.executable, "-m", "gpuslice.cli", "router", "--plan", str(plan_json),
         "--endpointslices", "default/v", "--kube-api", f"http://127.0.0.1:{api.server_port}",
         "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--access-log", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # the default log format is text: one line, the event's fields as key=value
        line = _wait_line(router, r"INFO +router: listening on")
        port = int(re.search(r" port=(\d+)", line).group(1))  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        # the plan's service answers to its name and its model
        assert _post(f"{base}/v2/models/vgg19/infer")[0] == 200
        assert _post(f"{base}/v2/models/v/infer")[0] == 200
        # another model is refused, named, and never reaches the replica
        code, body = _post(f"{base}/v2/models/resnet50/infer")
        assert code == 404 and "resnet50" in body, body
        assert _post(f"{base}/v1/models/bert:predict")[0] == 404
        assert any("service-name%3Dv" in a for a in _Api.asked)
    finally:
        router.terminate()
        router.wait(10)
        api.shutdown()


def test_one_service_config_refuses_another_model(tmp_path: Path, replica: int) -> None:
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"services": [{"name": "resnet50", "replicas": [
        {"name": "a", "url": f"http://127.0.0.1:{replica}"}]}]}))
    router = subprocess.Popen(
        [sys.executable, "-m", "gpuslice.cli", "router", "--config", str(cfg), "--listen",
         "127.0.0.1:0", "--admin", "off", "--access-log", "off", "--log-format", "json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        doc = json.loads(_wait_line(router, '"event": "listening"'))
        assert doc["level"] == "info" and doc["component"] == "router"
        base = f"http://127.0.0.1:{doc['port']}"
        assert _post(f"{base}/v2/models/resnet50/infer")[0] == 200
        code, body = _post(f"{base}/v2/models/bert/infer")
        assert code == 404 and "no service serves model 'bert'" in body, body
    finally:
        router.terminate()
        router.wait(10)


def readme_commands(prog: str) -> list[list[str]]:
    """Every ``gpuslice <prog>`` command of the code blocks of README.md and the docs/ pages,
    continuation lines joined, comments and redirections dropped."""
    import shlex

    root = Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted(
        (root / "docs").glob("*.md"))] if p.name != "index.md")
    out: list[list[str]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            cmd = line.split(" #")[0].split(" > ")[0].strip()
            if cmd.startswith(f"gpuslice {prog} "):
                out.append(shlex.split(cmd)[1:])
    return out


def test_every_router_command_of_the_readme_parses_and_has_replicas() -> None:
    from gpuslice.cli import _build_parser

    cmds = readme_commands("router")
    assert len(cmds) >= 5
    for argv in cmds:
        args = _build_parser().parse_args(argv)  # exits (fails the test) on a bad flag
        # the planner's plan has no replica URLs: as printed, it must come with EndpointSlices
        # (or be an export, which needs none)
        assert args.plan is None or args.endpointslices or args.export, argv
