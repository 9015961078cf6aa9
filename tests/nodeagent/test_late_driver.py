"""A node agent that starts before the NVIDIA driver (an operator-managed driver after a
reboot): it serves nothing and says why on ``/readyz``, tries NVML again, and once the driver
answers serves its GPUs without a restart: ListAndWatch streams them, the node's inventory
and totals are published, and it turns ready."""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from gpuslice.adapters.http.probes import serve_metrics
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.nvml.port import FakeNvml, NullNvml, NvmlPort
from gpuslice.adapters.nvml.real import LateNvml
from gpuslice.services.device_plugin import PluginConfig, wait_for
from gpuslice.services.node_agent import NodeAgent
from tests.nodeagent.test_device_plugin import GPUS, KEY, Kubelet


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_an_agent_started_before_the_driver_serves_the_gpus_once_it_answers() -> None:
    driver = {"loaded": False}

    def loader() -> NvmlPort:
        if not driver["loaded"]:
            return NullNvml("libnvidia-ml.so.1 not found (is the NVIDIA driver loaded?)")
        return FakeNvml(list(GPUS))

    nvml = LateNvml(loader)
    api = FakeApiServer()
    api.add_node({"metadata": {"name": "node-1"}})
    with tempfile.TemporaryDirectory(prefix="dp-") as d:
        sock = Path(d)
        kubelet = Kubelet(sock).start()
        agent = NodeAgent(PluginConfig("node-1", sock, KEY, replicas=2), nvml, api)
        server = serve_metrics("127.0.0.1", 0, agent.metrics.registry, agent.readiness)
        base = f"http://127.0.0.1:{server.server_port}"
        try:
            for s in agent.servers:
                s.start()
            agent.publish()
            assert kubelet.registered.wait(5)
            status, why = _get(base + "/readyz")
            assert status == 503 and "libnvidia-ml.so.1 not found" in why
            assert _get(base + "/healthz")[0] == 200
            assert agent.retry_nvml() is False  # not yet
            driver["loaded"] = True
            assert agent.retry_nvml() is True and agent.retry_nvml() is False
            assert wait_for(lambda: bool(kubelet.lists) and len(kubelet.lists[-1]) == 4, 5)
            node = api.get_node("node-1")
            inv = json.loads(node["metadata"]["annotations"]["gpuslice.io/inventory"])
            assert [g["uuid"] for g in inv] == ["GPU-aaa", "GPU-bbb"]
            assert node["status"]["capacity"]["gpuslice.io/gpu-milli"] == "2000"
            status, why = _get(base + "/readyz")
            assert status == 200 and "2 GPU(s)" in why, why
            status, text = _get(base + "/metrics")
            assert status == 200 and "# HELP gpuslice_gpu_healthy" in text
        finally:
            server.shutdown()
            for s in agent.servers:
                s.stop()
            kubelet.stop()


def test_the_mixed_strategy_asks_to_be_started_again() -> None:
    """With ``--mig-strategy mixed`` the plugins are one per MIG profile, made at start: an
    agent that found no GPU then stops with the reason (exit 1: the kubelet starts it again)."""
    from dataclasses import replace

    driver = {"loaded": False}
    nvml = LateNvml(lambda: FakeNvml(list(GPUS)) if driver["loaded"] else NullNvml("no driver"))
    cfg = replace(PluginConfig("node-1", Path("/nonexistent"), KEY), mig_strategy="mixed")
    agent = NodeAgent(cfg, nvml, FakeApiServer())
    driver["loaded"] = True
    assert agent.retry_nvml() is True and "mixed MIG strategy" in agent.restart_needed
    assert agent._stop.is_set()
