"""A pod's share holds for multi-process servers: MPS caps each client process, so the node
divides a share's pinned memory by the CUDA processes the pod declares
(``gpuslice.io/processes``; the DRA opaque config's ``mps.processes``), holds the server to
that per-process ceiling, and counts each pod's processes to report one running more than it
declared."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kube.objects import declared_processes
from gpuslice.adapters.mps import standin
from gpuslice.adapters.nvml.port import FakeNvml, GpuProcess
from gpuslice.adapters.proc.pods import PodProcess, pod_of
from gpuslice.core.errors import ValidationError
from gpuslice.services.node_agent import NodeAgent
from gpuslice.services.pod_usage import OVER_DECLARED, PodUsage
from tests.fake_mps import write_fake_mps
from tests.nodeagent.test_device_plugin import allocate, assign, env

__all__ = ["env"]  # the fixture, imported for these tests


def _clients(pipe: Path, given: dict[str, str], n: int) -> subprocess.Popen[str]:
    """``n`` stand-in CUDA processes with a container's environment, the pipe directory as
    the host sees it (the container sees it at /run/gpuslice/mps)."""
    return subprocess.Popen([sys.executable, standin.__file__, "client", "--processes", str(n)],
                            env={**os.environ, **given, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _connected(pipe: Path, n: int, timeout_s: float = 10.0) -> list[dict[str, object]]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = json.loads((pipe / "fake-state.json").read_text())
        if len(state.get("clients") or []) == n:
            return list(state["clients"])
        time.sleep(0.05)
    raise AssertionError(f"{n} clients did not connect")


def test_a_four_process_pod_gets_a_quarter_of_its_memory_per_process_and_no_more(
        env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Allocate divides the 8 GiB share among the 4 declared processes, and the daemon's
    server holds each client to that part: 4 processes, one rewriting its own limit to
    64 GiB, together get 8 GiB, the share, not 4 x 8 GiB."""
    kubelet, plugin, _, api, _ = env
    tool = write_fake_mps(tmp_path / "mps-control")
    plugin.cfg.mps_pipe_dir = str(tmp_path / "mps")
    agent = NodeAgent(plugin.cfg, plugin.nvml, api, mps=True, mps_binary=str(tool))
    plugin.ensure_mps = agent.ensure_mps
    assign(api, "vllm", ["GPU-aaa"], milli=500, mem=8192,
           annotations={"gpuslice.io/processes": "4"})
    r = allocate(kubelet.stub(), "GPU-aaa::0")
    assert r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    pipe = tmp_path / "mps" / "GPU-aaa"
    honest = _clients(pipe, dict(r.envs), 3)
    cheat = _clients(pipe, {**r.envs, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=64G"}, 1)
    clients = _connected(pipe, 4)
    assert [c["mem_mib"] for c in clients] == [2048] * 4
    assert sum(int(str(c["mem_mib"])) for c in clients) <= 8192
    for p in (honest, cheat):
        p.send_signal(signal.SIGTERM)
        p.wait(10)
    agent.quit_mps()


@pytest.mark.parametrize("bad", ["0", "many", "49", "-2"])
def test_a_bad_processes_annotation_is_refused_naming_it(env, bad: str) -> None:  # type: ignore[no-untyped-def]
    kubelet, _, _, api, _ = env
    assign(api, "odd", ["GPU-aaa"], milli=250, annotations={"gpuslice.io/processes": bad})
    with pytest.raises(grpc.RpcError) as exc:
        allocate(kubelet.stub(), "GPU-aaa::0")
    assert "gpuslice.io/processes: expected an integer 1..48" in (exc.value.details() or "")
    with pytest.raises(ValidationError, match=r"gpuslice\.io/processes"):
        declared_processes({"gpuslice.io/processes": bad})


def test_the_extender_refuses_a_bad_processes_annotation_at_filter() -> None:
    from gpuslice.adapters.kube.objects import pod_request

    pod = {"metadata": {"name": "p", "namespace": "ml",
                        "annotations": {"gpuslice.io/processes": "zero"}},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {
               "gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "250"}}}]}}
    with pytest.raises(ValidationError, match=r"gpuslice\.io/processes"):
        pod_request(pod)


def test_each_pods_processes_are_counted_and_one_over_its_declared_count_reported() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    api = FakeApiServer()
    pods = {}
    for name, declared in (("one", None), ("four", "4")):
        ann = {"gpuslice.io/processes": declared} if declared else {}
        pods[name] = api.add_pod({"metadata": {"name": name, "namespace": "ml",
                                               "annotations": ann},
                                  "spec": {"nodeName": "n1", "containers": [{"name": "c"}]}})
    nvml = FakeNvml.simulated(1)
    gpu = nvml.devices()[0].uuid
    owner = {101: "one", 102: "one", 103: "four", 104: "four", 105: "four", 999: ""}
    nvml.set_processes(gpu, [GpuProcess(pid) for pid in owner])
    registry = CollectorRegistry()

    def pod_of_pid(pid: int) -> PodProcess | None:
        name = owner.get(pid)
        return PodProcess(pid, pods[name]["metadata"]["uid"], "c1") if name else None

    usage = PodUsage("n1", nvml, api, registry, pod_of_pid=pod_of_pid)
    assert usage.step() == {"ml/one": (2, 1), "ml/four": (3, 4)}
    events = [e for e in api.events if e.get("reason") == OVER_DECLARED]
    assert [e["involvedObject"]["name"] for e in events] == ["one"]
    assert "2 CUDA processes on its GPU share, 1 declared" in events[0]["message"]
    text = generate_latest(registry).decode()
    assert 'gpuslice_pod_gpu_processes_over_declared{namespace="ml",node="n1",pod="one"} 1.0' \
        in text
    assert f'gpuslice_gpu_unattributed_processes{{gpu="{gpu}",node="n1"}} 1.0' in text
    usage.step()  # the same count again: no second event
    assert len([e for e in api.events if e.get("reason") == OVER_DECLARED]) == 1
    nvml.set_processes(gpu, [GpuProcess(103)])  # "one" is gone: its series go with it
    assert usage.step() == {"ml/four": (1, 4)}
    assert 'pod="one"' not in generate_latest(registry).decode()


def test_each_containers_memory_and_sms_are_measured_against_its_share() -> None:
    """Per pod, container and GPU: the memory its processes use (NVML), its share's memory
    (the signed assignment), the headroom, the SMs kept busy and the share of SMs given;
    with the key, an assignment that does not verify gives no cap."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gpuslice.adapters.kube.annotation import encode
    from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign

    key = b"k" * 24
    api = FakeApiServer()
    nvml = FakeNvml.simulated(1)
    gpu = nvml.devices()[0].uuid
    p = api.add_pod({"metadata": {"name": "llm", "namespace": "ml",
                                  "labels": {"gpuslice.io/service": "resnet"}},
                     "spec": {"nodeName": "n1", "containers": [{"name": "server"}]},
                     "status": {"containerStatuses": [
                         {"name": "server", "containerID": "containerd://abc123"}]}})
    a = Assignment("ml", "llm", p["metadata"]["uid"], "n1", (ContainerAssignment(
        "server", Mode.MPS, (GpuShare(gpu, 250, 8192),)),), "t1")
    api.patch_pod_annotations("ml", "llm", {"gpuslice.io/assignment": encode(sign(a, key))},
                              p["metadata"]["resourceVersion"])
    nvml.set_processes(gpu, [GpuProcess(7, 3000, 12.0), GpuProcess(8, 1000, 8.0),
                             GpuProcess(9, 500, None)])
    owner = {7: "abc123", 8: "abc123"}

    def pod_of_pid(pid: int) -> PodProcess | None:
        return PodProcess(pid, p["metadata"]["uid"], owner[pid]) if pid in owner else None

    registry = CollectorRegistry()
    PodUsage("n1", nvml, api, registry, keys=(key,), pod_of_pid=pod_of_pid).step()
    got = _samples(generate_latest(registry).decode())
    labels = {"container": "server", "gpu": gpu, "namespace": "ml", "node": "n1", "pod": "llm",
              "service": "resnet"}

    def value(name: str) -> float:
        return got[(name, frozenset(labels.items()))]

    assert value("gpuslice_pod_gpu_memory_used_bytes") == 4000 * 2**20
    assert value("gpuslice_pod_gpu_memory_cap_bytes") == 8192 * 2**20
    assert value("gpuslice_pod_gpu_memory_headroom_bytes") == 4192 * 2**20
    assert value("gpuslice_pod_gpu_sm_utilization_ratio") == 0.2
    assert value("gpuslice_pod_gpu_sm_share_ratio") == 0.25
    assert value("gpuslice_pod_gpu_processes") == 2
    assert got[("gpuslice_gpu_unattributed_memory_used_bytes",
                frozenset({"gpu": gpu, "node": "n1"}.items()))] == 500 * 2**20
    other = CollectorRegistry()  # another key: the share is not taken on its word
    PodUsage("n1", nvml, api, other, keys=(b"x" * 24,), pod_of_pid=pod_of_pid).step()
    names = {n for n, _ in _samples(generate_latest(other).decode())}
    assert "gpuslice_pod_gpu_memory_used_bytes" in names
    assert "gpuslice_pod_gpu_memory_cap_bytes" not in names


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_process_is_mapped_to_its_pod_by_its_cgroup(tmp_path: Path) -> None:
    uid = "3f2b6c1e-1111-2222-3333-444455556666"
    for pid, text in (
            (10, f"11:memory:/kubepods/besteffort/pod{uid}/0123abcd\n"),
            (11, "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                 f"{uid.replace('-', '_')}.slice/cri-containerd-4567ef.scope\n"),
            (12, "0::/system.slice/containerd.service\n")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    assert pod_of(10, tmp_path) == PodProcess(10, uid, "0123abcd")
    assert pod_of(11, tmp_path) == PodProcess(11, uid, "4567ef")
    assert pod_of(12, tmp_path) is None and pod_of(13, tmp_path) is None
