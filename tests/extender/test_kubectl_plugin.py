from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuslice.adapters.kube.annotation import encode
from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign
from gpuslice.kubectl_plugin import main

KEY = b"plugin-key-0123456789abcdef"


def test_status_shows_allocations_per_gpu(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    a = sign(Assignment("ml", "resnet-0", "u0", "t4-a", (ContainerAssignment(
        "c", Mode.MPS, (GpuShare("GPU-1", 250, 4096),)),), "2026-11-22T18:00:00Z"), KEY)
    forged = Assignment("ml", "sneaky", "u1", "t4-a", (ContainerAssignment(
        "c", Mode.MPS, (GpuShare("GPU-1", 750, 0),)),), "2026-11-22T18:00:00Z")
    cluster = {
        "nodes": [{"metadata": {"name": "t4-a", "annotations": {"gpuslice.io/inventory":
            '[{"uuid": "GPU-1", "index": 0, "model": "T4", "memoryMiB": 15360}]'}}}],
        "pods": [
            {"metadata": {"name": "resnet-0", "namespace": "ml",
                          "annotations": {"gpuslice.io/assignment": encode(a)}}},
            {"metadata": {"name": "sneaky", "namespace": "ml",
                          "annotations": {"gpuslice.io/assignment": encode(forged)}}},
        ],
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    (tmp_path / "key").write_bytes(KEY)
    assert main(["status", "--fake-cluster", str(tmp_path / "c.yaml"), "--key-file",
                 str(tmp_path / "key")]) == 0
    out = capsys.readouterr().out
    assert "ml/resnet-0 (250 mps)" in out and "750" in out  # 250 used, 750 free
    assert "ml/sneaky" not in out
    assert "1 pod(s) carry an assignment that does not verify" in out


def test_status_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--fake-cluster", str(tmp_path / "missing.yaml")]) == 2
    assert "--fake-cluster" in capsys.readouterr().err


def test_status_names_the_mig_instance_of_each_slice(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a = sign(Assignment("ml", "enc-0", "u0", "a100", (ContainerAssignment(
        "c", Mode.MPS, (GpuShare("GPU-m", 200, 8192, "3g.40gb", 4),)),), "t"), KEY)
    inv = ('[{"uuid": "GPU-m", "index": 0, "model": "A100-80GB", "memoryMiB": 81920, "mig": '
           '[{"uuid": "MIG-1", "profile": "3g.40gb", "start": 4, "memoryMiB": 40192}]}]')
    cluster = {"nodes": [{"metadata": {"name": "a100",
                                       "annotations": {"gpuslice.io/inventory": inv}}}],
               "pods": [{"metadata": {"name": "enc-0", "namespace": "ml",
                                      "annotations": {"gpuslice.io/assignment": encode(a)}}}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    (tmp_path / "key").write_bytes(KEY)
    assert main(["status", "--fake-cluster", str(tmp_path / "c.yaml"), "--key-file",
                 str(tmp_path / "key")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "ml/enc-0 (200 mps in 3g.40gb@4)" in out.replace("│ ", "")
