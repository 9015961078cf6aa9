"""The router's EndpointSlice reader as deploy/examples/router.yaml runs it: in the cluster,
on its service account's mounted token and CA, over HTTPS, allowed only what its Role grants."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import aiohttp
import pytest

from gpuslice.adapters.http import endpointslices
from gpuslice.adapters.http.endpointslices import SliceSource, fetch_slices, replicas_from_slices
from gpuslice.core.errors import ValidationError
from tests.kube.helpers import self_signed
from tests.kube.rest_fake import RestApiServer


def endpoint_slice(service: str, *pods: tuple[str, str, bool]) -> dict[str, object]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{service}-abc12", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready},
                           "targetRef": {"kind": "Pod", "name": pod}, "nodeName": "t4-a"}
                          for pod, ip, ready in pods]}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_the_router_reads_its_services_endpoints_in_cluster_and_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    crt, key = self_signed(tmp_path, "apiserver")
    rest = RestApiServer(tls=(crt, key)).start()
    try:
        rest.endpointslices[("default", "resnet50-fractional")] = [endpoint_slice(
            "resnet50-fractional", ("resnet50-fractional-7d-a", "10.1.0.5", True),
            ("resnet50-fractional-7d-b", "10.1.0.6", True),
            ("resnet50-fractional-7d-c", "10.1.0.7", False))]
        sa = tmp_path / "serviceaccount"
        sa.mkdir()
        (sa / "token").write_text("sa:default:gpuslice-router\n")
        shutil.copy(crt, sa / "ca.crt")
        monkeypatch.setattr(endpointslices, "SA_DIR", sa)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(rest.port))

        async def go(source: str) -> object:
            async with aiohttp.ClientSession() as s:
                return await fetch_slices(s, SliceSource.parse(source, port_name="http"))

        doc = asyncio.run(go("default/resnet50-fractional"))
        replicas = replicas_from_slices(doc, "http")
        assert sorted(r.url for r in replicas) == ["http://10.1.0.5:8000",
                                                    "http://10.1.0.6:8000"]
        assert rest.denied == []
        with pytest.raises(ValidationError, match="403"):  # its Role is in default only
            asyncio.run(go("kube-system/kube-dns"))
        assert rest.denied and "endpointslices" in rest.denied[-1]
    finally:
        rest.stop()
