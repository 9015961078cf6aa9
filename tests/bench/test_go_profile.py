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


# kube-apiserver 1.36's names, as `go tool pprof -top -cum` prints them
A = "k8s.io/apiserver/pkg"
API_TOP = f"""File: kube-apiserver
Type: cpu
      flat  flat%   sum%        cum   cum%
         0     0%     0%      0.75s 13.30%  runtime.gcBgMarkWorker
         0     0%     0%      0.65s 11.52%  {A}/storage/etcd3.(*store).GuaranteedUpdate
         0     0%     0%      0.13s  2.30%  {A}/storage/etcd3.(*store).Create
         0     0%     0%      0.41s  7.27%  k8s.io/apimachinery/pkg/runtime/serializer/\
versioning.(*codec).Decode
         0     0%     0%      0.41s  7.27%  {A}/endpoints/handlers.handleWatch
         0     0%     0%      0.06s  1.06%  k8s.io/client-go/tools/cache.handleWatch
         0     0%     0%      0.27s  4.79%  k8s.io/apimachinery/pkg/runtime/serializer/\
json.(*Serializer).Encode
         0     0%     0%      0.15s  2.66%  k8s.io/apimachinery/pkg/runtime/serializer/\
json.(*Serializer).Decode
         0     0%     0%      0.31s  5.50%  k8s.io/kubernetes/pkg/registry/core/pod/storage.\
(*BindingREST).Create
         0     0%     0%      0.27s  4.79%  {A}/authentication/request/x509.\
(*Authenticator).AuthenticateRequest
"""


def test_the_apiserver_rows_take_their_own_functions_and_the_larger_of_two_alternatives(
        ) -> None:
    from go_profile import APISERVER_WHERE

    got = {w.strip().split(" (")[0]: v for w, v in shares(API_TOP, APISERVER_WHERE)}
    assert got["Bindings"] == 5.50
    assert got["writes to etcd"] == 11.52  # GuaranteedUpdate, the larger of the two
    assert got["watches served"] == 7.27  # the API server's handleWatch, not client-go's
    assert got["of which JSON encoding of the objects"] == 4.79
    assert got["of which JSON"] == 2.66  # the decoding row's: json Decode, not Encode
    assert got["client certificates checked"] == 4.79
    assert got["TLS handshakes"] == 0.0
    lines = table_lines(shares(API_TOP, APISERVER_WHERE), shares(API_TOP, APISERVER_WHERE),
                        4.0, 2.0, 10, 2.0, "", "kube-apiserver")
    assert lines[0].startswith("kube-apiserver's CPU by where it went")
    assert "| Bindings (BindingREST.Create) | 5.5 | 0.22 | 5.5 | 0.11 |" in lines
