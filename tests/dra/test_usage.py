"""What each pod uses of its share on a DRA node: the node agent's measurement
(services/pod_usage.py, one process-to-pod mapping) with each container's share read from
the claims the driver prepared (services/dra_driver/usage.py), on the driver's metrics port."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client import CollectorRegistry

from gpuslice.adapters.http.probes import serve_metrics
from gpuslice.adapters.nvml.port import GpuProcess
from gpuslice.adapters.proc.pods import PodProcess
from gpuslice.services.dra_driver.usage import claims_of
from tests.dra.conftest import Node, claim
from tests.dra.test_shares import share
from tests.nodeagent.test_processes import _samples


def _pod(node: Node, name: str, claims: dict[str, dict[str, str]], cid: str,
         made: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod whose container ``server`` uses ``claims`` (pod claim name -> its source)."""
    return node.api.add_pod({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeName": node.cfg.node,
                 "resourceClaims": [{"name": k, **v} for k, v in claims.items()],
                 "containers": [{"name": "server", "resources": {
                     "claims": [{"name": k} for k in claims]}}]},
        "status": {"containerStatuses": [{"name": "server",
                                          "containerID": f"containerd://{cid}"}],
                   "resourceClaimStatuses": [{"name": k, "resourceClaimName": v}
                                             for k, v in (made or {}).items()]}})


def test_a_claims_share_whole_gpu_and_mig_instance_are_measured_against_what_was_prepared(
        node: Node) -> None:
    client = node.serve()
    refs = [node.add(share("quarter", "5f0a-aaaa", "25", "20Gi")),
            node.add(claim("whole", [{"request": "gpu", "device": "gpu-2"}])),
            node.add(claim("part", [{"request": "mig", "device": "gpu-1-mig-3g40gb-0"}]))]
    assert all(r.error == "" for r in client.prepare(refs).values())
    gpus = node.nvml.devices()
    [mig] = [m for m in gpus[1].mig if (m.profile, m.start) == ("3g.40gb", 0)]
    pods = {"c1": _pod(node, "llm", {"gpu": {"resourceClaimName": "quarter"}}, "c1"),
            "c2": _pod(node, "big", {"g": {"resourceClaimTemplateName": "t"}}, "c2",
                       made={"g": "whole"}),
            "c3": _pod(node, "slice", {"m": {"resourceClaimName": "part"}}, "c3")}
    owner = {11: "c1", 12: "c2", 13: "c3"}
    node.nvml.set_processes(gpus[0].uuid, [GpuProcess(11, 5000, 10.0), GpuProcess(99, 300)])
    node.nvml.set_processes(gpus[2].uuid, [GpuProcess(12, 1000, 50.0)])
    node.nvml.set_processes(mig.uuid, [GpuProcess(13, 2000, None)])
    registry = CollectorRegistry()
    node.driver.measure_usage(registry, node.api, pod_of_pid=lambda pid: PodProcess(
        pid, pods[owner[pid]]["metadata"]["uid"], owner[pid]) if pid in owner else None)
    node.driver.tick(0.01)  # the usage is due at the first round
    port = serve_metrics("127.0.0.1", 0, registry, lambda: (True, "ok")).server_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        got = _samples(r.read().decode())

    def value(metric: str, pod: str, gpu: str) -> float:
        labels = {"node": node.cfg.node, "namespace": "default", "pod": pod,
                  "container": "server", "gpu": gpu, "service": ""}
        return got[(metric, frozenset(labels.items()))]

    mib = 2**20
    for pod, gpu, used, cap, share_ratio in (
            ("llm", gpus[0].uuid, 5000, 20480, 0.25),
            ("big", gpus[2].uuid, 1000, gpus[2].memory_mib, 1.0),
            ("slice", mig.uuid, 2000, mig.memory_mib, 3 * 1000 // 7 / 1000)):
        assert value("gpuslice_pod_gpu_memory_used_bytes", pod, gpu) == used * mib
        assert value("gpuslice_pod_gpu_memory_cap_bytes", pod, gpu) == cap * mib, pod
        assert value("gpuslice_pod_gpu_sm_share_ratio", pod, gpu) == share_ratio, pod
        assert value("gpuslice_pod_gpu_processes", pod, gpu) == 1
    assert value("gpuslice_pod_gpu_sm_utilization_ratio", "llm", gpus[0].uuid) == 0.1
    assert got[("gpuslice_gpu_unattributed_processes",
                frozenset({"node": node.cfg.node, "gpu": gpus[0].uuid}.items()))] == 1
    # unprepared: the claim's share is gone, the process is still measured, without a cap
    assert client.unprepare([refs[0]]) == {refs[0][1]: ""}
    node.driver.usage.step()  # type: ignore[union-attr]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        got = _samples(r.read().decode())
    assert value("gpuslice_pod_gpu_memory_used_bytes", "llm", gpus[0].uuid) == 5000 * mib
    assert ("gpuslice_pod_gpu_memory_cap_bytes", frozenset({
        "node": node.cfg.node, "namespace": "default", "pod": "llm", "container": "server",
        "gpu": gpus[0].uuid, "service": ""}.items())) not in got


def test_a_containers_claims_follow_the_pods_claims_and_their_requests() -> None:
    pod = {"spec": {"resourceClaims": [{"name": "a", "resourceClaimName": "shared"},
                                       {"name": "b", "resourceClaimTemplateName": "t"},
                                       {"name": "c", "resourceClaimTemplateName": "t"}],
                    "containers": [{"name": "x", "resources": {"claims": [
                        {"name": "a", "request": "gpu"}, {"name": "b"}, {"name": "c"}]}},
                        {"name": "y"}]},
           "status": {"resourceClaimStatuses": [{"name": "b", "resourceClaimName": "b-123"}]}}
    # c's claim is not made yet: left out
    assert claims_of(pod, "x") == {"shared": "gpu", "b-123": ""}
    assert claims_of(pod, "y") == {} and claims_of(pod, "z") == {}
