"""cluster_scale.py's own checks: the baseline runs' over-allocation (the pods' extended
resources summed per node against its allocatable) and how a burst's binds spread over time."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from cluster_scale import in_use, over_node_totals
from first_seen import SHARES, burst_quantiles, burst_rate
from gpuslice.adapters.kube.annotation import encode
from gpuslice.core.assignment import (
    ANNOTATION,
    Assignment,
    ContainerAssignment,
    GpuShare,
    Mode,
)


def _pod(node: str | None, limits: dict[str, str]) -> dict[str, Any]:
    return {"spec": {"nodeName": node, "containers": [{"resources": {"limits": limits}}]}}


def _node(name: str, allocatable: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"allocatable": allocatable}}


FRACTIONAL = {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "500",
              "gpuslice.io/gpu-memory": "8192"}


def test_pods_within_every_node_total_are_not_over_allocated() -> None:
    nodes = [_node("a", {"nvidia.com/gpu": "2", "gpuslice.io/gpu-milli": "1000",
                         "gpuslice.io/gpu": "2", "gpuslice.io/gpu-memory": "16384",
                         "cpu": "64", "memory": "256Gi"})]
    pods = [_pod("a", FRACTIONAL), _pod("a", FRACTIONAL), _pod("a", {"nvidia.com/gpu": "2"}),
            _pod(None, FRACTIONAL)]  # not bound: not counted
    assert over_node_totals(pods, nodes) == 0


def test_quantities_are_read_as_the_api_server_writes_them_back() -> None:
    # 8000 milli comes back "8k"; 16 pods of 500 fill it, a 17th is over
    nodes = [_node("a", {"gpuslice.io/gpu-milli": "8k", "gpuslice.io/gpu": "80",
                         "gpuslice.io/gpu-memory": "640Ki"})]
    pods = [_pod("a", FRACTIONAL) for _ in range(16)]
    assert over_node_totals(pods, nodes) == 0
    assert over_node_totals([*pods, _pod("a", {"gpuslice.io/gpu-milli": "1k"})], nodes) == 1


def test_one_resource_past_a_nodes_total_counts_that_node_once() -> None:
    nodes = [_node("a", {"gpuslice.io/gpu-milli": "1000", "gpuslice.io/gpu": "8",
                         "gpuslice.io/gpu-memory": "81920"}),
             _node("b", {"nvidia.com/gpu": "1"})]
    pods = [_pod("a", FRACTIONAL) for _ in range(3)]  # 1500 milli of 1000
    pods += [_pod("b", {"nvidia.com/gpu": "1"}), _pod("b", {"nvidia.com/gpu": "1"})]
    assert over_node_totals(pods, nodes) == 2


def test_a_resource_the_node_does_not_have_is_over_allocated() -> None:
    assert over_node_totals([_pod("a", {"nvidia.com/gpu": "1"})],
                            [_node("a", {"cpu": "8"})]) == 1


def test_a_burst_spread_is_read_from_its_first_bind() -> None:
    times = [10.0 + i for i in range(100)]  # one a second
    assert burst_quantiles(times) == [24.0, 49.0, 74.0, 89.0, 99.0]
    assert len(burst_quantiles(times)) == len(SHARES) + 1
    assert burst_rate(times) == 1.0
    assert burst_quantiles([5.0]) == []
    # a flood at the end: half the binds in the last tenth of the burst
    flood = [float(i) for i in range(50)] + [50.0 + i / 10 for i in range(50)]
    q = burst_quantiles(flood)
    assert q[0] == 24.0 and q[1] == 49.0 and q[-1] == 54.9


def _assigned(name: str, node: str, *shares: tuple[str, int]) -> dict[str, Any]:
    a = Assignment("bench", name, f"uid-{name}", node, (ContainerAssignment(
        "m", Mode.MPS, tuple(GpuShare(u, m, 8192) for u, m in shares)),),
        "2026-11-28T00:00:00Z")
    return {"metadata": {"name": name, "annotations": {ANNOTATION: encode(a)}},
            "spec": {"nodeName": node}}


def test_packing_counts_gpus_and_nodes_holding_a_share_and_the_fewest_the_milli_fills() -> None:
    pods = [_assigned("a", "n1", ("GPU-1", 500)), _assigned("b", "n1", ("GPU-1", 250)),
            _assigned("c", "n2", ("GPU-2", 750)),
            {"metadata": {"name": "pending"}, "spec": {}}]  # no assignment: not counted
    assert in_use(pods) == (2, 2, 2)  # 1500 milli fill at least 2 GPUs
    assert in_use(pods[:2]) == (1, 1, 1)
    assert in_use([]) == (0, 0, 0)
