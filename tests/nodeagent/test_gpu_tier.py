"""GPU tier of the node agent: two MPS slices allocated by the real device plugin (over gRPC,
on the real NVML) run real CUDA processes with the environment Allocate returned, under the MPS
daemon the agent started. Skipped without an NVIDIA GPU, PyTorch or the MPS control tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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


@pytest.mark.usefixtures("gpu_with_mps")
def test_two_mps_slices_from_the_plugin_run_real_cuda(tmp_path: Path) -> None:
    from gpuslice.adapters.nvml.real import load
    from gpuslice.services.node_agent import NodeAgent

    nv = load()
    gpu = nv.devices()[0]
    with tempfile.TemporaryDirectory(prefix="gt-") as d:
        sock = Path(d)
        api = FakeApiServer()
        kubelet = Kubelet(sock).start()
        cfg = PluginConfig("node-1", sock, KEY, replicas=4, mps_pipe_dir=str(sock / "mps"))
        agent = NodeAgent(cfg, nv, api, mps=True)
        server = PluginServer(agent.plugin)
        server.start()
        try:
            assert kubelet.registered.wait(5) and wait_for(lambda: bool(kubelet.lists), 5)
            assign(api, "s30", [gpu.uuid], milli=300, mem=8192, t="t1")
            assign(api, "s70", [gpu.uuid], milli=700, mem=16384, t="t2")
            stub = kubelet.stub()
            answers = [allocate(stub, f"{gpu.uuid}::{k}") for k in range(2)]
            envs = [dict(a.envs) for a in answers]
            mounts = [a.mounts[0].host_path for a in answers]  # the pipe directory mount
            procs = []
            for env, mount, alloc in zip(envs, mounts, (12288, 0), strict=True):
                e = {**env, "CUDA_MPS_PIPE_DIRECTORY": mount,
                     "CUDA_VISIBLE_DEVICES": env["NVIDIA_VISIBLE_DEVICES"]}
                procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(alloc)],
                                              env={**os.environ, **e},
                                              stdout=subprocess.PIPE, text=True))
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
        finally:
            server.stop()
            kubelet.stop()
            agent.quit_mps()
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
