"""cluster_scale.py --go-profile's reading of kube-scheduler's CPU profile
(benchmarks/go_profile.py): the cumulative shares of the places it names, from the text of
``go tool pprof -top -cum``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from go_profile import WHERE, shares, table_lines

# lines as `go tool pprof -top -cum` prints them for kube-scheduler 1.36 (header kept)
K = "k8s.io/kubernetes/pkg"
NR = "noderesources."
TOP = f"""File: kube-scheduler
Type: cpu
Duration: 15s, Total samples = 9.26s (61.73%)
      flat  flat%   sum%        cum   cum%
     0.03s  0.32%  0.32%      5.71s 61.66%  {K}/scheduler.\
(*Scheduler).findNodesThatPassFilters.func1
     0.01s  0.11%  1.84%      4.52s 48.81%  {K}/scheduler/framework/plugins/\
{NR}(*Fit).Filter
     0.05s  0.54%  1.90%      4.49s 48.49%  {K}/scheduler/framework/plugins/\
{NR}fitsRequest
         0     0%  2.38%      3.66s 39.52%  {K}/apis/core/v1/helper.IsExtendedResourceName
         0     0% 15.44%      1.72s 18.57%  runtime.gcBgMarkWorker
         0     0% 15.50%      1.71s 18.47%  runtime.gcBgMarkWorker.func2
     0.03s  0.32% 33.80%      0.44s  4.75%  {K}/scheduler.(*HTTPExtender).Filter
     0.01s  0.11% 53.56%      0.15s  1.62%  {K}/scheduler.(*Scheduler).bindingCycle
"""


def test_each_place_gets_its_own_functions_cumulative_share() -> None:
    got = dict(shares(TOP))
    assert [w for w, _ in shares(TOP)] == [w for w, _ in WHERE]
    by_start = {w.strip().split(" (")[0]: v for w, v in got.items()}
    assert by_start["filter plugins over the candidate nodes"] == 61.66
    assert by_start["of which NodeResourcesFit"] == 48.49  # fitsRequest, not Fit.Filter
    assert by_start["of which IsExtendedResourceName"] == 39.52
    assert by_start["Go garbage collector"] == 18.57  # not its .func2
    assert by_start["extender filter calls"] == 4.75
    assert by_start["binding cycle"] == 1.62
    assert by_start["score plugins"] == 0.0  # absent from the profile


def test_the_table_gives_ms_per_pod_from_the_share_and_says_why_when_a_profile_is_missing(
        ) -> None:
    ours = shares(TOP)
    lines = table_lines(ours, ours, 6.4, 2.0, 10, 2.0, "")
    fit = next(line for line in lines if "NodeResourcesFit" in line)
    assert "| 48.5 | 3.10 | 48.5 | 0.97 |" in fit
    assert table_lines(None, ours, 6.4, 2.0, 10, 2.0, "refused") == \
        ["kube-scheduler profile: refused"]
