"""GPU tier of the node agent: two MPS slices allocated by the real device plugin (over gRPC,
on the real NVML) run real CUDA processes with the environment Allocate returned, under the MPS
daemon the agent started. Skipped without an NVIDIA GPU, PyTorch or the MPS control tool."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.services.device_plugin import PluginConfig, PluginServer, wait_for
from tests.nodeagent.test_device_plugin import KEY, Kubelet, allocate, assign

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

WORKER = r'''
import json, os, sys, time
import torch
props = torch.cuda.get_device_properties(0)
out = {"sms": props.multi_processor_count}
alloc = int(sys.argv[1])
if alloc:
    try:
        held = torch.empty(alloc * 1024 * 1024, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        out["alloc"] = "ok"
    except torch.OutOfMemoryError as exc:
        out["alloc"] = "OutOfMemoryError"
x = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
end, n = time.time() + 3, 0
while time.time() < end:
    x = torch.tanh(x @ x) ; n += 1
torch.cuda.synchronize()
out["iterations"] = n
print(json.dumps(out), flush=True)
'''


@contextlib.contextmanager
def agent_serving(nv: Any, sock: Path, pipe_root: Path) -> Iterator[tuple[FakeApiServer, Any,
                                                                           Any]]:
    """The node agent on ``nv`` with MPS on (daemons under ``pipe_root``), its device plugin
    registered with a test kubelet on ``sock``: (API server, agent, the kubelet's stub to the
    plugin). Stopped, its MPS daemons quit, on the way out."""
    from gpuslice.services.node_agent import NodeAgent

    api = FakeApiServer()
    kubelet = Kubelet(sock).start()
    cfg = PluginConfig("node-1", sock, KEY, replicas=4, mps_pipe_dir=str(pipe_root))
    agent = NodeAgent(cfg, nv, api, mps=True)
    server = PluginServer(agent.plugin)
    server.start()
    try:
        assert kubelet.registered.wait(5) and wait_for(lambda: bool(kubelet.lists), 5)
        yield api, agent, kubelet.stub()
    finally:
        server.stop()
        kubelet.stop()
        agent.quit_mps()


def mps_env(answer: Any) -> dict[str, str]:
    """What a container of this Allocate answer sees: its env, the pipe mount's host path."""
    env = dict(answer.envs)
    env["CUDA_MPS_PIPE_DIRECTORY"] = answer.mounts[0].host_path
    env["CUDA_VISIBLE_DEVICES"] = env["NVIDIA_VISIBLE_DEVICES"]
    return env


@pytest.mark.usefixtures("gpu_with_mps")
def test_two_mps_slices_from_the_plugin_run_real_cuda(tmp_path: Path) -> None:
    from gpuslice.adapters.nvml.real import load

    nv = load()
    gpu = nv.devices()[0]
    with tempfile.TemporaryDirectory(prefix="gt-") as d:
        sock = Path(d)
        with agent_serving(nv, sock, sock / "mps") as (api, _, stub):
            assign(api, "s30", [gpu.uuid], milli=300, mem=8192, t="t1")
            assign(api, "s70", [gpu.uuid], milli=700, mem=16384, t="t2")
            answers = [allocate(stub, f"{gpu.uuid}::{k}") for k in range(2)]
            envs = [dict(a.envs) for a in answers]
            procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(alloc)],
                                      env={**os.environ, **mps_env(a)},
                                      stdout=subprocess.PIPE, text=True)
                     for a, alloc in zip(answers, (12288, 0), strict=True)]
            res = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])
                   for p in procs]
            print(json.dumps({"gpu": gpu.name, "sms": gpu.sms, "slices": res,
                              "envs": envs}, indent=1))
            total = gpu.sms or 0
            assert envs[0]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
            assert envs[1]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
            if total:
                assert abs(res[0]["sms"] - 0.3 * total) <= 0.05 * total
                assert abs(res[1]["sms"] - 0.7 * total) <= 0.05 * total
            assert res[0]["alloc"] == "OutOfMemoryError"  # 12 GiB past its 8 GiB cap
            assert res[1]["iterations"] > 0 and res[0]["iterations"] > 0
    assert not any((sock / "mps").glob("*/control*"))


@pytest.mark.usefixtures("gpu_with_mps")
def test_an_uninstalled_agent_quits_a_real_mps_daemon_and_removes_its_folders() -> None:
    """Issue 27 on the real MPS control tool: a daemon started by one agent, then the
    uninstall path of a restarted agent that never used it (it finds it by its folder)."""
    from gpuslice.adapters.mps import MpsDaemon
    from gpuslice.adapters.nvml.real import load
    from gpuslice.services.node_agent import NodeAgent

    nv = load()
    gpu = nv.devices()[0]
    with tempfile.TemporaryDirectory(prefix="gu-") as d:
        pipe = Path(d) / "mps"
        cfg = PluginConfig("node-1", Path(d), KEY, replicas=2, mps_pipe_dir=str(pipe),
                           mps_shm_dir="")
        first = NodeAgent(cfg, nv, FakeApiServer(), mps=True)
        first.ensure_mps(gpu.uuid)
        daemon = MpsDaemon(gpu.uuid, pipe / gpu.uuid, pipe / f"{gpu.uuid}.log")
        try:
            assert daemon.healthy()
            again = NodeAgent(cfg, nv, FakeApiServer(), mps=True)
            removed = again.remove_mps_state(timeout_s=10.0)
            assert not daemon.healthy(), again.problems
            assert str(pipe / gpu.uuid) in removed and not pipe.exists(), removed
        finally:
            if daemon.healthy():
                daemon.quit()
