"""``kubectl gpuslice top``: what each pod uses of its share, read from the node agents'
metrics port over HTTP (the API server's pod proxy stands between them in a cluster:
tests/node/test_upgrade.py reads it through the real one)."""

from __future__ import annotations

import io
import json
import urllib.request
from contextlib import redirect_stdout
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console

from gpuslice.adapters.http.probes import serve_metrics
from gpuslice.adapters.kube.annotation import encode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.nvml.port import FakeNvml, GpuProcess
from gpuslice.adapters.proc.pods import PodProcess
from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign
from gpuslice.core.errors import GpusliceError
from gpuslice.kubectl_plugin import AGENT_SELECTOR, DRIVER_SELECTOR, top, usage_rows
from gpuslice.services.pod_usage import PodUsage

KEY = b"k" * 24


class Agents:
    """The agents' and drivers' pods as the API server lists them, and GET through its pod
    proxy: here to their metrics servers on this host (``ports``: agent pod -> its port, 0
    for one that does not answer; ``drivers``: the same for DRA driver pods)."""

    def __init__(self, ports: dict[str, int], drivers: dict[str, int] | None = None) -> None:
        self.pods = {AGENT_SELECTOR: ports, DRIVER_SELECTOR: drivers or {}}
        self.ports = {**ports, **(drivers or {})}
        self.asked: list[tuple[str, str]] = []
        self.proxied: list[tuple[str, int]] = []

    def list_namespaced_pods(self, namespace: str, label_selector: str) -> Any:
        self.asked.append((namespace, label_selector))
        return {"items": [{"metadata": {"name": n, "namespace": namespace},
                           "status": {"phase": "Running"}}
                          for n in sorted(self.pods[label_selector])]}

    def pod_proxy_get(self, namespace: str, name: str, port: int, path: str) -> str:
        self.proxied.append((name, port))
        if not self.ports[name]:
            raise GpusliceError("API server: 503 error trying to reach service: dial tcp: "
                                "connection refused")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[name]}/{path}",
                                    timeout=5) as r:
            return r.read().decode()


def _agent(node: str) -> int:
    """A node agent's usage on ``node``: pod ``llm`` with 2 processes on an MPS share of
    250 milli and 8 GiB, one process of no pod; served on a metrics port."""
    api = FakeApiServer()
    nvml = FakeNvml.simulated(1)
    gpu = nvml.devices()[0].uuid
    p = api.add_pod({"metadata": {"name": "llm", "namespace": "ml"},
                     "spec": {"nodeName": node, "containers": [{"name": "server"}]},
                     "status": {"containerStatuses": [
                         {"name": "server", "containerID": "containerd://abc"}]}})
    a = Assignment("ml", "llm", p["metadata"]["uid"], node, (ContainerAssignment(
        "server", Mode.MPS, (GpuShare(gpu, 250, 8192),)),), "t1")
    api.patch_pod_annotations("ml", "llm", {"gpuslice.io/assignment": encode(sign(a, KEY))},
                              p["metadata"]["resourceVersion"])
    nvml.set_processes(gpu, [GpuProcess(7, 3000, 12.0), GpuProcess(8, 1000, 8.0),
                             GpuProcess(9, 500, None)])
    registry = CollectorRegistry()
    PodUsage(node, nvml, api, registry, keys=(KEY,), pod_of_pid=lambda pid: PodProcess(
        pid, p["metadata"]["uid"], "abc") if pid in (7, 8) else None).step()
    server = serve_metrics("127.0.0.1", 0, registry, lambda: (True, "ok"))
    return int(server.server_port)


def test_top_reads_each_agent_and_shows_use_against_the_share() -> None:
    agents = Agents({"agent-a": _agent("n1"), "agent-b": _agent("n2"), "agent-c": 0},
                    drivers={"driver-a": _agent("n3")})
    out = io.StringIO()
    with redirect_stdout(out):
        assert top(agents, "gpuslice-system", 9402, Console(), "json", dra_port=9403) == 0
    doc = json.loads(out.getvalue())
    assert agents.asked == [("gpuslice-system", "app.kubernetes.io/name=gpuslice-node-agent"),
                            ("gpuslice-system", "app=gpuslice-dra-driver")]
    assert ("agent-a", 9402) in agents.proxied and ("driver-a", 9403) in agents.proxied
    llm = [r for r in doc["usage"] if r["pod"] == "ml/llm"]
    assert [r["node"] for r in llm] == ["n1", "n2", "n3"]
    assert {k: llm[0][k] for k in ("container", "used_mib", "cap_mib", "sm_pct", "share_pct",
                                   "processes")} == {
        "container": "server", "used_mib": 4000, "cap_mib": 8192, "sm_pct": 20,
        "share_pct": 25, "processes": 2}
    stray = [r for r in doc["usage"] if r["pod"] == "(no pod)"]
    assert [(r["node"], r["processes"]) for r in stray] == [("n1", 1), ("n2", 1), ("n3", 1)]
    assert len(doc["unreachable_agents"]) == 1
    assert doc["unreachable_agents"][0].startswith("agent-c: ")
    table = Console(width=200, record=True)
    with redirect_stdout(io.StringIO()):
        top(agents, "gpuslice-system", 9402, table)
    text = table.export_text()
    assert "4000 / 8192" in text and "20 / 25" in text, text
    assert "not read: agent-c" in text


def test_top_says_when_no_agent_runs_there() -> None:
    with pytest.raises(GpusliceError, match=r"no running node agent .* or DRA driver .* pod "
                       r"in namespace gs"):
        top(Agents({}), "gs", 9402, Console())


def test_usage_rows_skip_other_metrics() -> None:
    text = ("# TYPE gpuslice_gpu_free_milli gauge\n"
            'gpuslice_gpu_free_milli{node="n1",gpu="G"} 500.0\n')
    assert usage_rows({"a": text}) == []
