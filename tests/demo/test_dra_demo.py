"""``gpuslice demo --dra``: the DRA path end to end (driver over gRPC on unix sockets, gpuslice's
claim allocator, prepare and unprepare of four claims) as a subprocess, its table, its clean
up, and a clear failure when a step fails."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.core import dra
from gpuslice.core.devices import GpuDevice
from gpuslice.demo.dra import manifests
from gpuslice.demo.dra_first_fit import DraDemoFailed, first_fit_counters

ROOT = Path(__file__).resolve().parents[2]


def _run(env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuslice.cli", "demo", "--dra"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "COLUMNS": "400", **(env or {})})


def _rows(out: str) -> dict[str, str]:
    """The table's rows by claim name: each row's text (a cell may span several lines)."""
    rows: dict[str, str] = {}
    block: list[str] = []
    for line in [*out.splitlines(), "└"]:
        if line.startswith(("├", "└", "┡")):
            if block:
                cells = [c.strip() for c in block[0].strip("│").split("│")]
                rows[cells[0]] = "\n".join(block)
            block = []
        elif line.startswith("│"):
            block.append(line)
    return rows


def _cell_env(row: str) -> dict[str, str]:
    env = {}
    for line in row.splitlines():
        last = line.strip().strip("│").split("│")[-1].strip()
        if "=" in last and not last.startswith("mount "):
            k, v = last.split("=", 1)
            env[k] = v
    return env


def _no_pipe_mps(tmp_path: Path) -> dict[str, str]:
    """A PATH without nvidia-cuda-mps-control (the stand-in is then used)."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not (Path(d) / "nvidia-cuda-mps-control").exists()]
    return {"PATH": os.pathsep.join([str(Path(sys.executable).parent), *keep])}


def test_the_dra_demo_prepares_four_claims_over_grpc_and_leaves_nothing(
        tmp_path: Path) -> None:
    p = _run(_no_pipe_mps(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    rows = _rows(p.stdout)
    assert len(rows) == 4, out
    by_model: dict[str, list[tuple[str, dict[str, str]]]] = {}
    for claim, text in rows.items():
        cells = [c.strip() for c in text.splitlines()[0].strip("│").split("│")]
        by_model.setdefault(cells[1], []).append((claim, _cell_env(text)))
    # two shares of one GPU, each with its own MPS limits, and its pipe directory
    (qa, ea), (qb, eb) = sorted(by_model["share"])
    assert qa.startswith("default/embedder-share") and qb.startswith("default/inference-quart")
    assert ea["CUDA_VISIBLE_DEVICES"] == eb["CUDA_VISIBLE_DEVICES"] == "GPU-dra-node-00"
    assert (eb["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], eb["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) \
        == ("25", "0=20480M")
    assert (ea["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], ea["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) \
        == ("40", "0=8192M")
    assert ea["CUDA_MPS_PIPE_DIRECTORY"] == eb["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpuslice/mps"
    assert "25% SMs, 20 GiB" in rows[qb] and "40% SMs, 8 GiB" in rows[qa]
    ((mig, em),) = by_model["mig"]
    assert em["CUDA_VISIBLE_DEVICES"] == "MIG-GPU-dra-node-01-0"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in em and "MIG 3g.40gb" in rows[mig]
    ((whole, ew),) = by_model["whole"]
    assert ew["CUDA_VISIBLE_DEVICES"] == "GPU-dra-node-02" and "TimeSlicing" in rows[whole]
    # every claim's CDI device id is in its row, and its spec was written, then removed
    assert all("k8s.gpu.gpuslice.io/claim=" in text for text in rows.values())
    written = re.findall(r"prepared (\S+) over gRPC: CDI spec (\S+\.json) written", out)
    removed = re.findall(r"unprepared (\S+): CDI spec (\S+\.json) removed", out)
    assert sorted(written) == sorted(removed) and sorted(c for c, _ in written) == sorted(rows)
    assert out.index(written[-1][1] + " written") < out.index(removed[0][1] + " removed")
    assert "MPS: stand-in" in out
    # nothing left: the work directory (sockets, specs, checkpoint, MPS pipes) is gone
    (workdir,) = set(re.findall(r"(/tmp/gpuslice-dra-\w+)", out))
    assert f"removed {workdir}" in out
    assert not Path(workdir).exists()


def test_a_failing_step_exits_non_zero_naming_it_and_still_cleans_up(tmp_path: Path) -> None:
    """An MPS control program that cannot start a daemon: the share's prepare fails; the demo
    says where and why, exits 1 and removes its directory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    broken = bin_dir / "nvidia-cuda-mps-control"
    broken.write_text("#!/bin/sh\necho 'cannot start: no NVIDIA driver' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    env = _no_pipe_mps(tmp_path)
    p = _run({"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"})
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "DRA demo failed" in out and "NodePrepareResources default/inference-quarter" in out
    assert "MPS daemon" in out and "Traceback" not in out
    (workdir,) = set(re.findall(r"(/tmp/gpuslice-dra-\w+)", out))
    assert not Path(workdir).exists()


def test_the_demo_reads_the_manifests_of_deploy_dra() -> None:
    """The demo's DeviceClasses and example templates are deploy/dra's, read from there (a
    checkout here; a wheel's copy is tested in tests/unit/test_packaging.py), and setup.py
    copies into a wheel the files the demo reads."""
    import ast

    from gpuslice.demo.dra import DEPLOY_FILES

    deploy = {f"{d['kind']}/{d['metadata']['name']}": d
              for f in ("deviceclasses.yaml", "examples/claims.yaml")
              for d in yaml.safe_load_all((ROOT / "deploy" / "dra" / f).read_text()) if d}
    mine = manifests()
    assert set(mine) == {k for k in deploy if not k.startswith("Pod/")}
    assert {k for k in mine if k.startswith("ResourceClaimTemplate/")} == \
        {"ResourceClaimTemplate/gpu-quarter", "ResourceClaimTemplate/mig-3g",
         "ResourceClaimTemplate/whole-gpu"}
    for key, doc in mine.items():
        assert doc == deploy[key], key
    setup = ast.parse((ROOT / "setup.py").read_text())
    copied = next(ast.literal_eval(n.value) for n in setup.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "DEMO_DEPLOY_FILES")
    assert copied == DEPLOY_FILES


def _mig_slices() -> list[dict[str, Any]]:
    """The slices our driver publishes for one A100 in MIG mode (partitionable devices)."""
    gpu = GpuDevice(0, "GPU-a", "NVIDIA A100-80GB", "A100-80GB", 81920, 108, (8, 0), True, ())
    plan = dra.pool_slices([dra.GpuFacts(gpu)], {"GPU-a": dra.MIG}, "580.95.05",
                           dra.Features())
    return [{"metadata": {"name": f"n-{i}"}, "spec": {
        "driver": dra.DRIVER, "nodeName": "n", "pool": {"name": "n", "generation": 1,
                                                       "resourceSliceCount": len(plan.slices)},
        **s}} for i, s in enumerate(plan.slices)]


def _mig_claim(name: str, selector: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"devices": {"requests": [{
        "name": "mig", "exactly": {"deviceClassName": "mig.gpuslice.io",
                                   "selectors": [{"cel": {"expression": selector}}]}}]}}}


def test_the_kube_scheduler_stand_in_honours_the_shared_counters() -> None:
    """structured allocator (k8s.io/dynamic-resource-allocation structured, allocateOne and
    its counter check): two 3g instances fit an A100 (placements 0 and 4), a third does not,
    and a 4g no longer fits beside them."""
    slices = _mig_slices()
    sel = "device.attributes['gpu.gpuslice.io'].migProfile.startsWith('3g.')"
    claims: list[dict[str, Any]] = []
    got = []
    for i in range(2):
        p = first_fit_counters(_mig_claim(f"c{i}", sel), slices, claims, "n")
        got.append(p.results[0].device)
        claims.append({"status": {"allocation": {"devices": {"results": [
            {"driver": dra.DRIVER, "pool": "n", "device": p.results[0].device}]}}}})
    assert got == ["gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"]
    with pytest.raises(DraDemoFailed, match="no mig device on n fits"):
        first_fit_counters(_mig_claim("c2", sel), slices, claims, "n")
    with pytest.raises(DraDemoFailed, match="no mig device"):
        first_fit_counters(_mig_claim("c3", sel.replace("3g.", "4g.")), slices, claims, "n")
    # an empty GPU takes the 4g; a selector the stand-in cannot evaluate is refused
    assert first_fit_counters(_mig_claim("c4", sel.replace("3g.", "4g.")), slices, [],
                              "n").results[0].device.startswith("gpu-0-mig-4g40gb-")
    with pytest.raises(DraDemoFailed, match=r"selectors\[0\]"):
        first_fit_counters(_mig_claim("c5", "device.attributes['x'].y == 1"), slices, [], "n")
