"""Replays of the real Alibaba trace (needs the shared data folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.adapters.traces.data import NODE_LIST, TRACE_DIR
from gpuslice.cli import main
from gpuslice.sim.runner import Job, load_scenario, run_job

pytestmark = pytest.mark.data


@pytest.fixture(scope="module")
def default_scenario(shared_data: Path):  # type: ignore[no-untyped-def]
    d = shared_data / TRACE_DIR
    return load_scenario(d / "openb_pod_list_default.csv", d / NODE_LIST)


def test_trace_loads_with_the_published_inventory(default_scenario) -> None:  # type: ignore[no-untyped-def]
    assert default_scenario.total_gpus == 6212
    assert default_scenario.arrays.n_nodes == 1213
    assert len(default_scenario.tasks) == 8152
    assert len(default_scenario.workload.shapes) == 35


@pytest.mark.parametrize(("policy", "lo", "hi"), [("bestfit", 6.6, 7.6), ("fgd", 4.3, 5.3),
                                                  ("ours", 3.8, 4.5)])
def test_one_seed_lands_near_the_published_figure(default_scenario, policy: str, lo: float,  # type: ignore[no-untyped-def]
                                                  hi: float) -> None:
    r = run_job(default_scenario, Job(policy, 42, 1.3))
    unalloc = 100 - float(r.binned.alloc[100])
    assert lo <= unalloc <= hi


def test_compare_mode_prints_published_numbers(shared_data: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--variant", "default", "--policy", "bestfit", "--seeds", "42",
                 "--compare", "--out", str(tmp_path), "--no-plot"])
    assert code == 0
    out = capsys.readouterr().out
    assert "05-BestFit" in out and "7.14" in out
