"""kube-scheduler's default node scores, as the simulator's models of kube-scheduler compute
them (:func:`gpuslice.core.dra_default.default_scores`), against the plugins' rules in
kubernetes v1.36.3, pkg/scheduler/framework/plugins/noderesources:

* least_allocated.go ``leastResourceScorer`` / ``leastRequestedScore``: per resource
  ``(capacity - requested) * 100 / capacity`` in integers, 0 past the capacity, the weighted
  mean (weight 1 each, integer division) over the resources the node has;
* balanced_allocation.go ``balancedResourceScorer`` / ``balancedResourceScore``: ``(1 - std)
  * 100`` truncated, ``std = |f_cpu - f_mem| / 2`` with each fraction capped at 1, scored on the
  change the pod makes: ``50 + (50 + withPod - withoutPod) / 2`` (kubernetes/kubernetes#135573,
  in v1.36; before it the score was ``withPod`` alone, which the simulator's model used and
  which left its first fit 1.4 points optimistic in the CPU-heavy mix on 16 nodes).

The scalar functions below are a transcription of the Go code, written from the source; the
numpy implementation must agree with them on random nodes and pods, and on cases worked by
hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpuslice.core.dra_default import default_pick, default_scores, spread_scores
from gpuslice.core.model import ClusterArrays, Gpu, Node, SliceRequest, build_arrays

MAX = 100


def least_requested_score(requested: int, capacity: int) -> int:
    """least_allocated.go leastRequestedScore."""
    if capacity == 0 or requested > capacity:
        return 0
    return (capacity - requested) * MAX // capacity


def least_resource_scorer(requested: list[int], allocatable: list[int]) -> int:
    """least_allocated.go leastResourceScorer, every resource weight 1."""
    score = weights = 0
    for req, cap in zip(requested, allocatable, strict=True):
        if cap == 0:
            continue
        score += least_requested_score(req, cap)
        weights += 1
    return score // weights if weights else 0


def balanced_resource_score(requested: list[int], allocatable: list[int]) -> int:
    """balanced_allocation.go balancedResourceScore."""
    fractions = [min(r / a, 1.0) for r, a in zip(requested, allocatable, strict=True) if a]
    std = 0.0
    if len(fractions) == 2:
        std = abs((fractions[0] - fractions[1]) / 2)
    elif len(fractions) > 2:
        mean = sum(fractions) / len(fractions)
        std = math.sqrt(sum((f - mean) ** 2 for f in fractions) / len(fractions))
    return int((1 - std) * MAX)


def balanced_resource_scorer(requested: list[int], allocated: list[int],
                             allocatable: list[int]) -> int:
    """balanced_allocation.go balancedResourceScorer (Go's integer division; the operand is
    never negative)."""
    with_pod = balanced_resource_score(requested, allocatable)
    without = balanced_resource_score(allocated, allocatable)
    return MAX // 2 + (MAX // 2 + with_pod - without) // 2


def go_score(cap: tuple[int, int], used: tuple[int, int], pod: tuple[int, int]) -> int:
    """The default profile's two resource scores summed (both plugins weight 1)."""
    requested = [u + p for u, p in zip(used, pod, strict=True)]
    return (least_resource_scorer(requested, list(cap))
            + balanced_resource_scorer(requested, list(used), list(cap)))


def cluster(nodes: list[tuple[int, int, int, int]]) -> ClusterArrays:
    """Nodes of (CPU milli, memory MiB) capacity with (CPU, memory) already requested."""
    arrays = build_arrays([Node(f"n{i}", cpu, mem, (Gpu(0, "A100-80GB", 81920),))
                           for i, (cpu, mem, _, _) in enumerate(nodes)])
    arrays.cpu_free[:] = [cpu - used for cpu, _, used, _ in nodes]
    arrays.mem_free[:] = [mem - used for _, mem, _, used in nodes]
    return arrays


def pod(cpu: int, mem: int) -> SliceRequest:
    return SliceRequest(gpus=0, milli=0, cpu_milli=cpu, memory_mib=mem)


@pytest.mark.parametrize(("node", "req", "want"), [
    # empty node, a pod of half of each: least 50; balance 100 before and after: 75
    ((96_000, 786_432, 0, 0), (48_000, 393_216), 50 + 75),
    # half the CPU taken, the pod takes half the memory: balance 75 -> 100, 50 + 75 / 2 = 87
    ((96_000, 786_432, 48_000, 0), (0, 393_216), 50 + 87),
    # empty node, the pod takes all the CPU and none of the memory: balance 100 -> 50
    ((96_000, 786_432, 0, 0), (96_000, 0), 50 + 50),
    # a pod past the node's free CPU scores 0 on it (and the fraction is capped at 1)
    ((96_000, 786_432, 90_000, 0), (12_000, 0), 50 + 73),
])
def test_worked_cases(node: tuple[int, int, int, int], req: tuple[int, int], want: int) -> None:
    """Cases worked by hand from the two Go functions (see the comments)."""
    assert go_score(node[:2], node[2:], req) == want
    assert int(default_scores(cluster([node]), pod(*req), np.array([0]))[0]) == want


def test_the_numpy_scores_are_the_go_functions_on_random_nodes() -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        nodes = []
        for _ in range(8):
            cpu, mem = int(rng.integers(1, 200)) * 1000, int(rng.integers(1, 2048)) * 1024
            nodes.append((cpu, mem, int(rng.integers(0, cpu + 1)), int(rng.integers(0, mem + 1))))
        req = (int(rng.integers(0, 64_000)), int(rng.integers(0, 512 * 1024)))
        got = default_scores(cluster(nodes), pod(*req), np.arange(len(nodes)))
        want = [go_score(n[:2], n[2:], req) for n in nodes]
        assert got.tolist() == want


def test_the_node_chosen_follows_the_change_in_balance() -> None:
    """Where v1.36's rule and the one before it choose different nodes: a pod of 16 vCPU and
    no memory; node A has 288 GiB of its memory taken and no CPU, node B 12 vCPU and 96 GiB.
    v1.36: A 72 + 79 (balance 81 -> 89, the pod evens A out) = 151 against B 78 + 70 (balance
    100 -> 91) = 148, so A; before it (balance after alone, ``spread_scores``): A 72 + 89 = 161
    against B 78 + 91 = 169, so B."""
    nodes = [(96_000, 786_432, 0, 294_912), (96_000, 786_432, 12_000, 98_304)]
    req = (16_000, 0)
    arrays = cluster(nodes)
    assert [go_score(n[:2], n[2:], req) for n in nodes] == [151, 148]
    assert default_scores(arrays, pod(*req), np.arange(2)).tolist() == [151, 148]
    assert spread_scores(arrays, pod(*req), np.arange(2)).tolist() == [161, 169]
    pick = default_pick(arrays, pod(*req), np.ones(2, dtype=np.bool_), 0,
                        np.random.default_rng(0))
    assert pick is not None and pick.node == 0
