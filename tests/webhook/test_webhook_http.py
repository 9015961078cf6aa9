"""``gpuslice webhook``'s server over real HTTPS on loopback, as kube-apiserver calls it: POST
/mutate answers an AdmissionReview, /readyz waits for the first read of the nodes, a fault of
its own is a 500 (the API server then applies the failurePolicy) and never takes the server
down, /metrics counts each result, and nodes added later are read at the next resync."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.core.admission import Options
from gpuslice.devcluster.nodes import gpu_node
from gpuslice.services.tls import tls_context
from gpuslice.services.webhook import FleetView, serve
from gpuslice.services.webhook import http as webhook_http
from tests.webhook.test_webhook_review import review, stock_pod

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="openssl CLI not installed")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[Path, Path]]:
    from gpuslice.devcluster.procs import Pki

    pki = Pki(tmp_path_factory.mktemp("webhook-tls"))
    return pki.ca_crt, pki.issue("webhook", "/CN=gpuslice-webhook", server=True)


Call = Callable[[str, str, bytes | None], Awaitable[tuple[int, Any]]]


def run(certs: tuple[Path, tuple[Path, Path]], api: FakeApiServer,
        body: Callable[[Call], Awaitable[None]], resync_s: float = 60.0,
        gate: Any = None) -> None:
    ca, (crt, key) = certs
    ctx = tls_context(str(crt), str(key), None)

    async def main() -> None:
        stop = asyncio.Event()
        port: list[int] = []
        view = FleetView(api)
        task = asyncio.create_task(serve(view, Options(), "127.0.0.1", 0, ctx,
                                         resync_s=resync_s, ready=port.append, stop=stop,
                                         gate=gate))
        while not port:
            await asyncio.sleep(0.01)
        client_ctx = ssl.create_default_context(cafile=str(ca))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_ctx)) as s:

            async def call(method: str, path: str, data: bytes | None) -> tuple[int, Any]:
                async with s.request(method, f"https://127.0.0.1:{port[0]}{path}",
                                     data=data) as r:
                    text = await r.text()
                    try:
                        return r.status, json.loads(text)
                    except ValueError:
                        return r.status, text

            try:
                await body(call)
            finally:
                stop.set()
                await task

    asyncio.run(main())


def test_mutate_ready_metrics_over_https(certs: tuple[Path, tuple[Path, Path]]) -> None:
    api = FakeApiServer()
    api.add_node(gpu_node("a", "L4", 2))

    async def body(call: Call) -> None:
        assert (await call("GET", "/readyz", None))[0] == 200  # read the nodes first
        status, doc = await call("POST", "/mutate", review(
            stock_pod({"gpuslice.io/gpu-milli": "250"})))
        assert status == 200 and doc["response"]["patchType"] == "JSONPatch"
        status, doc = await call("POST", "/mutate", review(
            stock_pod({"gpuslice.io/gpu-milli": "1500"})))
        assert status == 200 and doc["response"]["allowed"] is False
        status, doc = await call("POST", "/mutate", b"not json")
        assert status == 200 and doc["response"]["status"]["code"] == 400
        status, text = await call("GET", "/metrics", None)
        for result, n in (("mutated", 1), ("refused", 1), ("bad-review", 1), ("error", 0)):
            assert f'gpuslice_webhook_reviews_total{{result="{result}"}} {float(n)}' in text
        assert 'gpuslice_webhook_fleet_gpus{model="L4"} 2.0' in text

    run(certs, api, body)


def test_a_fault_of_its_own_is_a_500_and_the_server_goes_on(
        certs: tuple[Path, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    real = webhook_http.review_of
    calls = [0]

    def flaky(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a bug")
        return real(*args)

    monkeypatch.setattr(webhook_http, "review_of", flaky)
    api = FakeApiServer()
    api.add_node(gpu_node("a", "L4", 1))

    async def body(call: Call) -> None:
        raw = review(stock_pod({"gpuslice.io/gpu-milli": "250"}))
        assert (await call("POST", "/mutate", raw))[0] == 500
        status, doc = await call("POST", "/mutate", raw)
        assert status == 200 and doc["response"]["allowed"] is True
        _, text = await call("GET", "/metrics", None)
        assert 'gpuslice_webhook_reviews_total{result="error"} 1.0' in text

    run(certs, api, body)


def test_not_ready_until_the_nodes_are_read_and_new_nodes_are_seen(
        certs: tuple[Path, tuple[Path, Path]]) -> None:
    from gpuslice.core.errors import GpusliceError

    class Down(FakeApiServer):
        down = True

        def list_nodes(self) -> list[dict[str, Any]]:
            if self.down:
                raise GpusliceError("API server unreachable: connection refused")
            return super().list_nodes()

    api = Down()

    async def body(call: Call) -> None:
        status, text = await call("GET", "/readyz", None)
        assert status == 503 and "connection refused" in text
        api.down = False
        api.add_node(gpu_node("b", "A100-80GB", 1))
        for _ in range(200):  # the next read (every 0.05 s here)
            if (await call("GET", "/readyz", None))[0] == 200:
                break
            await asyncio.sleep(0.05)
        _, doc = await call("POST", "/mutate", review(
            stock_pod({"gpuslice.io/gpu-milli": "250"})))
        assert "A100-80GB" in doc["response"]["auditAnnotations"]["changes"]

    run(certs, api, body, resync_s=0.05)


def test_a_review_finding_no_gpus_reads_the_nodes_again(
        certs: tuple[Path, tuple[Path, Path]]) -> None:
    """The webhook came up before any node agent published its GPUs (ready: the read
    succeeded, the fleet is empty). A node publishes, and a pod is created at once, long
    before the next periodic read (60 s here): the review reads the nodes again first, so
    the pod gets its memory made explicit instead of the "no node has published" warning
    (seen on the real node, where the chart's webhook starts beside the node agent)."""
    api = FakeApiServer()

    async def body(call: Call) -> None:
        assert (await call("GET", "/readyz", None))[0] == 200
        await asyncio.sleep(webhook_http.EMPTY_REREAD_S)
        api.add_node(gpu_node("c", "L4", 1))
        _, doc = await call("POST", "/mutate", review(
            stock_pod({"gpuslice.io/gpu-milli": "500"})))
        resp = doc["response"]
        assert "gpuslice.io/gpu-memory=12288" in resp["auditAnnotations"]["changes"], resp
        assert not any("published" in w for w in resp.get("warnings", [])), resp
        _, metrics = await call("GET", "/metrics", None)
        assert 'gpuslice_webhook_fleet_gpus{model="L4"} 1.0' in metrics

    run(certs, api, body, resync_s=60.0)


def _claim_pod(ref: dict[str, str], name: str = "server") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {"resourceClaims": [{"name": "gpu", **ref}],
                     "containers": [{"name": "server", "image": "vllm/vllm-openai",
                                     "resources": {"claims": [{"name": "gpu"}]}}]}}


def _template(name: str, device_class: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": device_class,
                "capacity": {"requests": {"compute": "25"}}}}]}}}}


def test_the_allocators_gate_is_put_on_a_pod_whose_claim_it_places(
        certs: tuple[Path, tuple[Path, Path]]) -> None:
    """A stock DRA pod (a claim template of share.gpuslice.io, no gate written) gets the
    claim allocator's scheduling gate while the allocator's Lease is fresh; a whole-GPU
    claim, a template that does not exist, a stale Lease or an API server that does not
    answer leave it ungated and admitted (kube-scheduler then allocates it itself)."""
    import time as _time
    from datetime import UTC, datetime

    from gpuslice.core.errors import GpusliceError
    from gpuslice.services.webhook.gate import DraGate

    class Api(FakeApiServer):
        down = False

        def get_resource_claim_template(self, namespace: str, name: str,
                                        timeout_s: float | None = None) -> dict[str, Any]:
            if self.down:
                raise GpusliceError("API server unreachable: connection refused")
            return super().get_resource_claim_template(namespace, name, timeout_s)

    api = Api()
    api.add_node(gpu_node("a", "L4", 1))
    api.add_resourceclaimtemplate(_template("quarter", "share.gpuslice.io"))
    api.add_resourceclaimtemplate(_template("whole", "gpu.gpuslice.io"))
    now = {"t": _time.time()}

    def renew(at: float) -> None:
        stamp = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
        old = api.get_lease("gpuslice-system", "gpuslice-dra-allocator")
        api.put_lease("gpuslice-system", "gpuslice-dra-allocator", {
            "holderIdentity": "allocator-0", "leaseDurationSeconds": 15, "renewTime": stamp},
            None if old is None else old["metadata"]["resourceVersion"])

    clock = {"t": 0.0}
    gate = DraGate(api, wall=lambda: now["t"], clock=lambda: clock["t"])

    async def mutate(pod: dict[str, Any]) -> dict[str, Any]:
        status, doc = await call_("POST", "/mutate", review(pod))
        assert status == 200 and doc["response"]["allowed"], doc
        return dict(doc["response"])

    def patch_of(resp: dict[str, Any]) -> list[dict[str, Any]]:
        import base64
        return json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else []

    call_: Call

    async def body(call: Call) -> None:
        nonlocal call_
        call_ = call
        renew(now["t"])
        resp = await mutate(_claim_pod({"resourceClaimTemplateName": "quarter"}))
        ops = patch_of(resp)
        assert {"op": "add", "path": "/spec/schedulingGates",
                "value": [{"name": "gpu.gpuslice.io/allocator"}]} in ops, ops
        assert "spec.schedulingGates: gpu.gpuslice.io/allocator" in \
            resp["auditAnnotations"]["changes"]
        for ref in ({"resourceClaimTemplateName": "whole"},
                    {"resourceClaimTemplateName": "nosuch"}):
            resp = await mutate(_claim_pod(ref))
            assert not any("schedulingGates" in o["path"] for o in patch_of(resp)), resp
        # the Lease goes stale: read again after a second, and the pod goes ungated
        now["t"] += 60
        clock["t"] += 1.0
        resp = await mutate(_claim_pod({"resourceClaimTemplateName": "quarter"}))
        assert not any("schedulingGates" in o["path"] for o in patch_of(resp)), resp
        renew(now["t"])
        clock["t"] += 1.0
        api.down = True  # admitted all the same, ungated, the failure counted
        resp = await mutate(_claim_pod({"resourceClaimTemplateName": "quarter"}))
        assert not any("schedulingGates" in o["path"] for o in patch_of(resp)), resp
        assert gate.failures == 1
        api.down = False
        resp = await mutate(_claim_pod({"resourceClaimTemplateName": "quarter"}))
        assert any("schedulingGates" in o["path"] for o in patch_of(resp)), resp

    run(certs, api, body, gate=gate)


@pytest.mark.parametrize("cpu_only", [True, False])
def test_a_pod_without_claims_is_gated_only_with_gate_cpu_only(
        certs: tuple[Path, tuple[Path, Path]], cpu_only: bool) -> None:
    """``gpuslice webhook --gate-cpu-only``: a pod that names no claim and has no placement
    wishes of its own gets the allocator's gate while its Lease is fresh (the allocator then
    pins it, adapters/kube/cpu_pods.py); one with a node selector does not; without the flag
    none does."""
    import time as _time
    from datetime import UTC, datetime

    from gpuslice.services.webhook.gate import DraGate

    api = FakeApiServer()
    api.add_node(gpu_node("a", "L4", 1))
    stamp = datetime.fromtimestamp(_time.time(), UTC).isoformat().replace("+00:00", "Z")
    api.put_lease("gpuslice-system", "gpuslice-dra-allocator", {
        "holderIdentity": "allocator-0", "leaseDurationSeconds": 15, "renewTime": stamp}, None)
    gate = DraGate(api, cpu_only=cpu_only)
    web = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "ml"},
           "spec": {"containers": [{"name": "web", "image": "nginx",
                                    "resources": {"requests": {"cpu": "2"}}}]}}
    pinned = {**web, "spec": {**web["spec"], "nodeSelector": {"zone": "a"}}}

    async def body(call: Call) -> None:
        for pod, want in ((web, cpu_only), (pinned, False)):
            status, doc = await call("POST", "/mutate", review(pod))
            assert status == 200 and doc["response"]["allowed"], doc
            ops = json.loads(base64.b64decode(doc["response"]["patch"])) \
                if "patch" in doc["response"] else []
            got = {"op": "add", "path": "/spec/schedulingGates",
                   "value": [{"name": "gpu.gpuslice.io/allocator"}]} in ops
            assert got is want, (pod["spec"], ops)

    run(certs, api, body, gate=gate)
