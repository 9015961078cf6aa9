"""``--fake-cluster`` (issue 18, first contact): the example file works with every command
that takes it, and a wrong file is refused with the reason instead of being read as an
empty cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice import kubectl_plugin
from gpuslice.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fake-cluster.yaml"


def test_the_example_is_a_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.main(["status", "--fake-cluster", str(EXAMPLE), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {(g["node"], g["model"]) for g in doc["gpus"]} == {
        ("gpu-node-a", "A100-80GB"), ("gpu-node-b", "T4")}
    assert [g["mig"] for g in doc["gpus"] if g["uuid"] == "GPU-a-1"] == [
        ["3g.40gb@0", "3g.40gb@4"]]
    assert main(["reconfig", "plan", str(ROOT / "deploy/examples/day-night.yaml"),
                 "--fake-cluster", str(EXAMPLE), "-o", "json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)
    assert res["gpus"] == 2  # the day-night schedule selects the two A100s


@pytest.mark.parametrize(("text", "reason"), [
    ("services:\n  - {name: a, model: m, rate: 1, slo_ms: 1}\n",
     "only the keys nodes, pods, sliceschedules"),
    ("- {name: a}\n", "a mapping with 'nodes'"),
    ("apiVersion: v1\nkind: Config\nclusters: []\n", "keys ['apiVersion', 'clusters', 'kind']"),
    ("{}\n", "none of them"),
    ("nodes: {name: a}\n", "nodes: expected a list"),
    ("nodes:\n  - {name: a}\n", "nodes[0].metadata.name"),
    ("pods:\n  - metadata: {name: p}\n", "pods[0].metadata.namespace"),
    ("nodes:\n  - metadata:\n      name: a\n      annotations: {gpuslice.io/inventory: '[{}]'}\n",
     "node a: inventory[0]"),
])
def test_a_wrong_file_is_refused_with_the_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, reason: str) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text(text)
    (tmp_path / "key").write_text("test-key-0123456789abcdef")
    assert main(["extender", "--key-file", str(tmp_path / "key"), "--fake-cluster",
                 str(bad), "--listen", "127.0.0.1:0", "--insecure-no-client-auth"]) == 2
    err = capsys.readouterr().err
    assert f"--fake-cluster {bad}" in err and reason in err, err
    assert kubectl_plugin.main(["status", "--fake-cluster", str(bad)]) == 2
    assert reason in capsys.readouterr().err
