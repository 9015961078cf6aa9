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
