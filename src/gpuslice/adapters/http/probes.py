"""The metrics port of a node component (the node agent's ``--metrics``), with its probes:
``/metrics`` (Prometheus, the component's registry), ``/healthz`` (the process serves) and
``/readyz`` (200 with what it serves, or 503 with why not: no GPU because the NVIDIA driver
has not answered yet, the kubelet not registered). A small threaded WSGI server, as
prometheus_client's own ``start_http_server`` is, with the two extra paths."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # probes every few seconds: not worth a log line


def serve_metrics(host: str, port: int, registry: CollectorRegistry,
                  ready: Callable[[], tuple[bool, str]]) -> WSGIServer:
    """Serve in a daemon thread; returns the server (``server_port`` tells the port)."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            start("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == "/readyz":
            ok, why = ready()
            start("200 OK" if ok else "503 Service Unavailable",
                  [("Content-Type", "text/plain")])
            return [why.encode() + b"\n"]
        result: Iterable[bytes] = metrics(environ, start)
        return result

    server = make_server(host, port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server
