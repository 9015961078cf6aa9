"""``gpuslice router`` where the pieces connect (issue 54): Envoy weights need addresses, so
from a plan they are refused saying so (the help says it too); ``--policy`` is checked with
``--export`` as without it; one port for ``--listen`` and ``--admin``, or an admin port that is
taken, is one line with nothing after it (no unclosed client session)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice.cli import main
from tests.cli.test_bad_input import run
from tests.router.test_router_first_contact import plan_json  # noqa: F401 (a fixture)


def test_envoy_from_a_plan_is_refused_naming_config(plan_json: Path,  # noqa: F811
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["router", "--plan", str(plan_json), "--export", "envoy"], capsys)
    assert code == 2
    assert err.startswith("gpuslice: error: --export envoy: expected a url per replica "
                          "(Envoy's endpoints are addresses"), err
    assert "--config with a url per replica" in err and "--export istio works from the plan" \
        in err and "replica(s) of" in err


def test_router_help_says_envoy_needs_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["router", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "envoy (endpoint weights; needs a url per replica, so --config" in text


def test_istio_export_with_an_unknown_policy_is_refused(
        plan_json: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    code, err = run(["router", "--plan", str(plan_json), "--export", "istio", "--policy",
                     "nosuch"], capsys)
    assert code == 2
    assert err.startswith("gpuslice: error: --policy: expected a routing policy"), err


def _router(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "r.json"
    cfg.write_text('{"services": [{"name": "m", "replicas": [{"name": "a", "url": '
                   '"http://127.0.0.1:9"}]}]}')
    return subprocess.run([sys.executable, "-m", "gpuslice.cli", "router", "--config", str(cfg),
                           "--access-log", "off", *argv], check=False, capture_output=True,
                          text=True, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_one_port_for_listen_and_admin_is_one_line(tmp_path: Path) -> None:
    port = _free_port()
    res = _router(tmp_path, "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{port}")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"gpuslice: error: --admin: expected an address other than --listen's (the proxy and "
        f"the admin endpoints each need a port of their own), got '127.0.0.1:{port}'"]


def test_an_admin_port_taken_closes_the_client_session(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        res = _router(tmp_path, "--listen", f"127.0.0.1:{_free_port()}", "--admin",
                      f"127.0.0.1:{busy}")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "address already in use" in lines[0], lines
    assert "Unclosed" not in res.stderr


def test_kubeconfig_reads_endpointslices_as_every_component_does(tmp_path: Path) -> None:
    """``router --kubeconfig`` (the spelling of every other command; ``--kube-api URL`` stays,
    hidden): the slices come from the API server the kubeconfig names."""
    import asyncio
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlparse

    import aiohttp

    from gpuslice.adapters.http.endpointslices import SliceSource, slice_fetcher

    asked: list[tuple[str, dict[str, list[str]]]] = []

    class Api(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            asked.append((url.path, parse_qs(url.query)))
            body = json.dumps({"kind": "EndpointSliceList", "items": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    api = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": f"http://127.0.0.1:{api.server_port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))

    async def fetch() -> object:
        async with aiohttp.ClientSession() as session:
            return await slice_fetcher(SliceSource("ml", "v"), str(kubeconfig))(session)

    try:
        assert asyncio.run(fetch()) == {"kind": "EndpointSliceList", "items": []}
    finally:
        api.shutdown()
    assert asked == [("/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices",
                      {"labelSelector": ["kubernetes.io/service-name=v"]})]


def test_kube_api_is_hidden_from_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["router", "--help"])
    assert "--kube-api" not in capsys.readouterr().out
