"""GPU tier: local mode with real NVML, real MPS and real PyTorch models (the example file).
Skips without an NVIDIA GPU, nvidia-cuda-mps-control, or PyTorch with torchvision."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpuslice.adapters.proc import processes_of
from tests.local.test_local_mode import ROOT, cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.usefixtures("gpu_with_mps")
def test_three_models_as_mps_slices_of_one_gpu(tmp_path: Path) -> None:
    text = (ROOT / "examples" / "local" / "services.yaml").read_text()
    services = tmp_path / "services.yaml"
    services.write_text(text.replace("[python,", f"[{sys.executable},"))
    state = tmp_path / "state"
    r = cli("up", str(services), "--state-dir", str(state), "--port", "0", "--detach",
            timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads((state / "state.json").read_text())
    try:
        router = st["router"]["url"]
        for svc in ("resnet50", "mobilenet", "encoder"):
            req = urllib.request.Request(f"{router}/v2/models/{svc}/infer", data=b"{}",
                                         method="POST")
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert json.loads(resp.read())["latency_ms"] > 0
        # status measures throughput while a closed loop per service keeps the slices busy
        stop = threading.Event()

        def load(svc: str) -> None:
            while not stop.is_set():
                req = urllib.request.Request(f"{router}/v2/models/{svc}/infer", data=b"{}",
                                             method="POST")
                try:
                    with urllib.request.urlopen(req, timeout=60) as resp:
                        resp.read()
                except urllib.error.HTTPError as exc:  # 429: the router shed it (SLO)
                    assert exc.code == 429, exc
                    time.sleep(0.05)

        loops = [threading.Thread(target=load, args=(svc,), daemon=True)
                 for svc in ("resnet50", "mobilenet", "encoder")]
        for t in loops:
            t.start()
        time.sleep(2)
        try:
            r = cli("status", "--state-dir", str(state), "-o", "json", "--window", "3")
            table = cli("status", "--state-dir", str(state), "--window", "3")
        finally:
            stop.set()
            for t in loops:
                t.join(timeout=60)
        print(table.stdout)
        reps = json.loads(r.stdout)["replicas"]
        assert {(x["service"], x["compute_pct"], x["memory_mib"]) for x in reps} == \
            {("resnet50", 40, 8192), ("mobilenet", 20, 4096), ("encoder", 30, 6144)}
        if not all(x["throughput_rps"] > 0 for x in reps):  # say why: the router's view
            admin = f"http://127.0.0.1:{st['router']['admin_port']}/metrics"
            with urllib.request.urlopen(admin, timeout=10) as resp:
                said = [line for line in resp.read().decode().splitlines()
                        if "rejects_total" in line or "requests_total" in line]
            raise AssertionError(f"a replica answered nothing: {reps}; router: {said}")
        assert len({x["gpu_uuid"] for x in reps}) == 1
        # the memory cap holds: resnet50's replica (8 GiB cap) cannot take 12 GiB
        port = next(x["port"] for x in reps if x["service"] == "resnet50")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/alloc?mib=12288",
                                    timeout=60) as resp:
            assert json.loads(resp.read())["ok"] is False
    finally:
        r = cli("down", "--state-dir", str(state))
    assert "stopped gpuslice up" in r.stdout
    time.sleep(1)
    assert processes_of(st["run_id"]) == []
    pipes = [Path(m["pipe_dir"]) for m in st["mps"]]
    assert pipes and all(not any(p.glob("control*")) for p in pipes)
