"""Contract tier: ``gpuslice router`` as a real process (signals, file watch, admin port)."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.router.harness import backend, url


def _listening(p: subprocess.Popen[str], timeout_s: float = 30.0) -> dict[str, object]:
    assert p.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stderr, selectors.EVENT_READ)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if sel.select(timeout=0.2):
            line = p.stderr.readline()
            if '"listening"' in line:
                return json.loads(line)  # type: ignore[no-any-return]
            if not line:
                break
    raise AssertionError("router did not start")


def _get(u: str, data: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(u, data=data, method="POST" if data is not None else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, dict(r.headers), r.read()


def _until(check, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def test_router_process_serves_reloads_on_file_change_and_sighup(tmp_path: Path) -> None:
    cfg = tmp_path / "router.toml"
    log = tmp_path / "access.log"
    with backend("a") as (pa, _), backend("b") as (pb, _):
        def write(name: str, port: int) -> None:
            cfg.write_text(f'policy = "sed"\n[[services]]\nname = "m"\n'
                           f'[[services.replicas]]\nname = "{name}"\nurl = "{url(port)}"\n')

        write("a", pa)
        p = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "router", "--config", str(cfg), "--listen",
             "127.0.0.1:0", "--admin", "127.0.0.1:0", "--access-log", str(log),
             "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            info = _listening(p)
            base, admin = url(int(info["port"])), url(int(info["admin_port"]))  # type: ignore[call-overload]
            status, headers, _ = _get(base + "/v2/models/m/infer", b"{}")
            assert (status, headers["X-Gpuslice-Replica"]) == (200, "a")

            def serving(name: str) -> bool:
                return _get(base + "/v2/models/m/infer", b"{}")[1]["X-Gpuslice-Replica"] == name

            write("b", pb)  # the file watch picks it up
            _until(lambda: serving("b"))
            write("a", pa)
            p.send_signal(signal.SIGHUP)
            _until(lambda: serving("a"))
            _, _, metrics = _get(admin + "/metrics")
            assert b"gpuslice_router_request_duration_seconds_count" in metrics
            p.send_signal(signal.SIGTERM)
            assert p.wait(20) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            if p.stderr is not None:
                p.stderr.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines and all(x["status"] == 200 for x in lines)
    assert {x["replica"] for x in lines} == {"a", "b"}
