"""Helpers shared by the tests over the REST API."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from gpuslice.adapters.kube.client import KubeClient
from tests.kube.rest_fake import RestApiServer

EXTENDER = "sa:gpuslice-system:gpuslice-extender"
NODE_AGENT = "sa:gpuslice-system:gpuslice-node-agent"
RECONFIG = "sa:gpuslice-system:gpuslice-reconfig"


def kube_client(rest: RestApiServer, folder: Path, token: str = "admin") -> KubeClient:
    """A client of ``rest`` with ``token`` (``admin``, or ``sa:<namespace>:<name>``)."""
    path = rest.kubeconfig(folder / f"kubeconfig-{token.replace(':', '-')}", token)
    api = KubeClient(str(path))
    rest.on_stop.append(api.close)  # its background watches end with the test
    return api


def post_json(url: str, doc: object) -> Any:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A throw-away certificate for 127.0.0.1 and its key (the openssl command line)."""
    import subprocess

    crt, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True)
    return crt, key
