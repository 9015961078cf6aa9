from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.errors import ValidationError
from gpuslice.services.mig_executor import STATE_LABEL, MigExecutor

INV = """
gpus:
  - model: A100-80GB
    mig: "3g.40gb@0,3g.40gb@4"
  - model: A100-80GB
    mig: "7g.80gb@0"
  - model: A100-80GB
"""
CONFIG = {
    "version": "v1",
    "mig-configs": {
        "all-1g.10gb": [{"devices": "all", "mig-enabled": True,
                         "mig-devices": {"1g.10gb": 7}}],
        "inference": [{"devices": [0], "mig-enabled": True,
                       "mig-placements": ["2g.20gb@0", "2g.20gb@2", "3g.40gb@4"]}],
        "too-big": [{"devices": [0], "mig-enabled": True, "mig-devices": {"4g.40gb": 2}}],
    },
}


@pytest.fixture
def setup(tmp_path: Path) -> tuple[FakeNvml, FakeApiServer, MigExecutor]:
    (tmp_path / "inv.yaml").write_text(INV)
    nvml = FakeNvml.from_yaml(tmp_path / "inv.yaml", node="n1")
    api = FakeApiServer()
    api.add_node({"metadata": {"name": "n1"}})
    return nvml, api, MigExecutor(nvml, api, "n1")


def test_dry_run_shows_the_changes_and_changes_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    nvml, api, ex = setup
    before = [nvml.mig_layout(g.uuid) for g in nvml.devices()[:2]]
    report = ex.apply(CONFIG, "all-1g.10gb", dry_run=True)
    g0, _, g2 = (g.uuid for g in nvml.devices())
    assert [str(c) for c in report.changes[g0]][:2] == ["destroy 3g.40gb@0", "destroy 3g.40gb@4"]
    assert sum(c.action == "create" for c in report.changes[g0]) == 7
    assert "MIG mode is disabled" in report.skipped[g2]
    assert [nvml.mig_layout(g.uuid) for g in nvml.devices()[:2]] == before
    assert STATE_LABEL not in api.list_nodes()[0]["metadata"].get("labels", {})


def test_apply_reaches_the_layout_and_labels_success(setup) -> None:  # type: ignore[no-untyped-def]
    nvml, api, ex = setup
    report = ex.apply(CONFIG, "inference")
    assert report.state == "success" and report.applied
    uuid = nvml.devices()[0].uuid
    assert sorted(nvml.mig_layout(uuid), key=lambda t: t[1]) == \
        [("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)]
    assert api.list_nodes()[0]["metadata"]["labels"][STATE_LABEL] == "success"
    assert ex.apply(CONFIG, "inference").changes == {}  # already there: nothing to do


def test_busy_gpus_are_left_alone_and_the_state_says_failed(setup) -> None:  # type: ignore[no-untyped-def]
    nvml, api, ex = setup
    busy = nvml.devices()[1].uuid
    nvml.set_clients(busy, 2)
    report = ex.apply(CONFIG, "all-1g.10gb")
    assert "2 process(es) use the GPU" in report.skipped[busy]
    assert nvml.mig_layout(busy) == [("7g.80gb", 0)]
    assert len(nvml.mig_layout(nvml.devices()[0].uuid)) == 7  # the idle GPU did change
    assert api.list_nodes()[0]["metadata"]["labels"][STATE_LABEL] == "failed"


def test_bad_configs_name_the_problem(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, _, ex = setup
    with pytest.raises(ValidationError, match="fits one GPU"):
        ex.apply(CONFIG, "too-big")
    with pytest.raises(ValidationError, match="mig config"):
        ex.apply(CONFIG, "nope")
    from gpuslice.services.mig_executor import read_config

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"version": "v1"}))
    with pytest.raises(ValidationError, match="mig-configs"):
        read_config(tmp_path / "c.yaml")


def test_cli_dry_run_and_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpuslice.cli import main

    (tmp_path / "inv.yaml").write_text('gpus:\n  - model: H100-SXM\n    mig: "7g.80gb@0"\n')
    (tmp_path / "mp.yaml").write_text(yaml.safe_dump(CONFIG))
    args = ["mig-apply", str(tmp_path / "mp.yaml"), "--config", "all-1g.10gb", "--fake-gpus",
            str(tmp_path / "inv.yaml")]
    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "destroy 7g.80gb@0" in out and "state: dry-run" in out
    assert main(args) == 0
    assert "state: success" in capsys.readouterr().out
    assert main([*args[:3], "nope", *args[4:]]) == 2
