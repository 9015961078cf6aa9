"""The placement benchmarks' own logic: the matrix's paired statistics and goals
(placement_report), and dra_placement's handling of seeds without a figure at 100% arrived
(left out with a note, never a NaN in the statistics)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from dra_placement import run, with_figures
from dra_targets import Outcome
from placement_report import Cell, goals, tables

LABELS = {"ours": "ours", "device-plugin": "dp", "allocator": "alloc", "fgd": "fgd",
          "first-fit": "ff", "packing": "packing"}
PATHS = ["first-fit", "fgd", "ours", "device-plugin", "allocator"]


def _cell(cluster: str, mix: str, ff: list[float], **paths: list[float]) -> Cell:
    values = {"first-fit": np.array(ff)}
    for p in PATHS[1:]:
        values[p] = np.array(paths.get(p.replace("-", "_"), ff))
    nodes = 1213 if cluster == "trace" else int(cluster.partition("x")[0])
    return Cell(cluster, mix, nodes, list(range(len(ff))), values)


def test_paired_differences_and_their_standard_error() -> None:
    c = _cell("16x8", "default", [10, 12, 14, 16], ours=[9, 12, 12, 15])
    m, se = c.diff("ours", "first-fit")
    d = np.array([-1, 0, -2, -1])
    assert m == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / 2)
    one = _cell("16x8", "default", [10.0], ours=[9.0])
    assert math.isnan(one.diff("ours", "first-fit")[1])


def test_goals_name_the_cell_a_deployed_path_loses_by_more_than_two_se() -> None:
    good = _cell("16x8", "default", [10, 12, 14, 16], ours=[9, 11, 13, 15],
                 device_plugin=[9, 11, 13, 15.5], allocator=[9.5, 11.5, 13.5, 15.5],
                 fgd=[11, 13, 15, 17])
    # the allocator 1 point worse on every seed but one: far more than 2 SE
    bad = _cell("64x8", "cpu-heavy", [20, 21, 22, 23], ours=[19, 20, 21, 22],
                device_plugin=[20, 21, 22, 23], allocator=[21, 22, 23, 24.1],
                fgd=[22, 23, 24, 25])
    trace = _cell("trace", "default", [7.2, 7.3, 7.4], ours=[4.1, 4.2, 4.2],
                  device_plugin=[4.4, 4.5, 4.5], allocator=[4.4, 4.4, 4.5],
                  fgd=[4.7, 4.8, 4.7])
    got = {label: (ok, value) for label, ok, value in goals([good, bad, trace], PATHS, LABELS)}
    ok, value = got["alloc: worse than first fit by more than 2 SE in no cell"]
    assert not ok and "64x8 / cpu-heavy" in value
    assert got["dp: worse than first fit by more than 2 SE in no cell"][0]
    assert got["ours: better than first fit on average over the cells"][0]
    assert got["full default trace: the simulator's policy <= 4.3% unallocated"][0]
    # 16-node cell: the allocator 0.5 points from ours, more than 0.3
    ok, value = got["alloc within 0.3 points of the simulator's policy in every 16-node cell"]
    assert not ok and "default +0.50" in value
    rows = tables([good, bad, trace], PATHS)
    losing = next(r for r in rows if r.startswith("| 64x8 | cpu-heavy"))
    assert losing.count("**") == 2 and "**+1.0" in losing  # the losing deployed cell is bold
    assert "**" not in next(r for r in rows if r.startswith("| 16x8 | default"))


class _Target:
    """A target whose seed 43 gives no figure (as a NaN from the binning would)."""

    name = "fake"
    modes = ("default", "ours")

    def replay(self, mode: str, seed: int) -> Outcome:
        value = math.nan if seed == 43 else (10.0 if mode == "default" else 8.0) + seed % 2
        return Outcome(value, 10, 1.0)


def test_a_seed_without_a_figure_is_left_out_with_a_note(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    with (tmp_path / "log").open("w") as log:
        run(_Target(), [42, 43, 44, 45], Console(file=log), doc=doc)
    text = doc.read_text()
    assert "seed 43 left out: no figure at 100% arrived from default, ours" in text
    assert "nan" not in text.lower()
    assert "| 42 | 44 | 45 | mean |" in text
    # no scenario: every seed is kept before the runs
    assert with_figures(_Target(), [1, 2], 1.3) == ([1, 2], [])


def test_control_plane_runs_are_named_by_cluster_and_mix() -> None:
    from placement_report import cluster_sample, sample_name

    head = "real control plane (kube-scheduler v1.36, kwok), 16 nodes x 8 A100-80GB, "
    assert sample_name(head + "sharing-heavy mix (gpushare80-like) of the task mix of trace "
                       "variant default") == "16 x 8 A100-80GB, sharing-heavy"
    assert sample_name(head + "task mix of trace variant default") == \
        "16 x 8 A100-80GB, default"
    assert sample_name("something else") == "something else"
    run = {"target": head + "task mix of trace variant default",
           "unallocated": {"default": {"42": 10.0, "43": 12.0, "44": 11.0},
                           "default-model": {"42": 10.5, "43": 11.0, "44": 11.5},
                           "ours": {"42": 9.0}}}  # no model: no row
    rows = cluster_sample([run])
    assert len(rows) == 3 and rows[2].startswith("| 16 x 8 A100-80GB, default | first fit | 3 |")
    assert "| +0.00 ± 0.50 | yes |" in rows[2]  # paired: -0.5, +1.0, -0.5


def test_the_stages_table_pools_the_seeds_per_path() -> None:
    """``--stages``: per path, p50 / p99 of when each pod's claim was allocated, its gate
    came off and it was bound (ms after its creation), the seeds pooled; a path without
    stages (the simulator's, or a run without the flag) has no row."""
    import io

    from dra_placement import print_stages

    def out(*stages: tuple[float, float, float]) -> Outcome:
        return Outcome(10.0, len(stages), 1.0, stages=stages)

    rows = {"default": [out((0.015, 0.005, 0.018)), out((0.020, 0.004, 0.024))],
            "ours": [out((0.012, 0.017, 0.025))], "default-model": [out()]}
    buf = io.StringIO()
    print_stages(rows, {"default": "first fit", "ours": "allocator"},
                 Console(file=buf, width=200))
    lines = [ln for ln in buf.getvalue().splitlines() if "│" in ln]
    assert any("first fit" in ln and "15 / 20" in ln and "4 / 5" in ln and "18 / 24" in ln
               and ln.rstrip().endswith("2 │") for ln in lines), buf.getvalue()
    assert any("allocator" in ln and "12 / 12" in ln and "17 / 17" in ln for ln in lines)
    assert not any("default-model" in ln for ln in lines)
    quiet = io.StringIO()
    print_stages({"ours": [out()]}, {}, Console(file=quiet))
    assert quiet.getvalue() == ""


def test_a_control_plane_sample_gets_the_simulators_rows_of_today() -> None:
    """placement_matrix.remodel: the simulator's rows of a control-plane sample are replayed
    again (the models move with the code), the control plane's figures stay, and a sample
    that did not record its scenario keeps what it has."""
    from dra_targets import SimTarget, kwok_scenario
    from placement_matrix import remodel

    spec = {"nodes": 2, "gpus": 8, "variant": None, "mix": None, "tune": 1.3,
            "nodes_to_score": None, "burst": False}
    sim = SimTarget(kwok_scenario(2, 8, None)[1], 1.3)
    want = round(sim.replay("default", 42).unallocated_pct, 4)
    stale = {"default": {"42": 50.0}, "default-model": {"42": -1.0}}
    got = remodel({"target": "t", "scenario": spec, "unallocated": stale})
    assert got["unallocated"] == {"default": {"42": 50.0}, "default-model": {"42": want}}
    assert stale["default-model"] == {"42": -1.0}  # the input is not changed in place
    old = {"target": "t", "unallocated": stale}
    assert remodel(old) is old
    assert remodel({**old, "scenario": {**spec, "burst": True}})["unallocated"] == stale
