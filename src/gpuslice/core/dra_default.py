"""kube-scheduler's own node choice for a pod, as the default DRA path makes it: the window of
feasible nodes it filters from a rotating start (``numFeasibleNodesToFind`` in
pkg/scheduler/schedule_one.go) and its default scores on CPU and memory (NodeResourcesFit with
LeastAllocated, NodeResourcesBalancedAllocation). Used by
:meth:`gpuslice.core.dra_placement.DraLedger.decide_default` and the simulator's model of the
deployed path."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuslice.core.model import BoolArray, ClusterArrays, IntArray, SliceRequest

# kube-scheduler's defaults (pkg/scheduler/schedule_one.go)
MIN_FEASIBLE_NODES_TO_FIND = 100
MIN_FEASIBLE_NODES_PERCENTAGE = 5
MAX_NODE_SCORE = 100


def nodes_to_find(n_nodes: int, percentage: int = 0) -> int:
    """kube-scheduler's ``numFeasibleNodesToFind``: all nodes below 100; else ``percentage``
    of them (0: adaptive, 50 - n/125, at least 5%), at least 100."""
    if n_nodes < MIN_FEASIBLE_NODES_TO_FIND or percentage >= 100:
        return n_nodes
    pct = percentage
    if pct <= 0:
        pct = max(50 - n_nodes // 125, MIN_FEASIBLE_NODES_PERCENTAGE)
    return max(n_nodes * pct // 100, MIN_FEASIBLE_NODES_TO_FIND)


@dataclass(frozen=True, slots=True)
class DefaultPick:
    node: int
    next_start: int  # where the next pick starts looking
    scored: int  # feasible nodes scored
    score: float


def default_pick(arrays: ClusterArrays, req: SliceRequest, ok: BoolArray, start: int,
                 rng: np.random.Generator, percentage: int = 0) -> DefaultPick | None:
    """kube-scheduler's node choice with its default scores: feasible nodes (``ok``) found
    from the rotating ``start`` (``nextStartNodeIndex``) until :func:`nodes_to_find` of them,
    scored by :func:`default_scores`, the best taken with ties at random (``selectHost``).
    None when no node is feasible (the start does not move then)."""
    nodes, next_start = window(ok, start, percentage)
    if len(nodes) == 0:
        return None
    scores = default_scores(arrays, req, nodes)
    top = np.flatnonzero(scores == scores.max())
    return DefaultPick(int(nodes[top[int(rng.integers(len(top)))]]), next_start, len(nodes),
                       float(scores.max()))


def window(ok: BoolArray, start: int, percentage: int = 0) -> tuple[IntArray, int]:
    """The feasible nodes (``ok``) kube-scheduler's filters find for one pod, in the order
    it finds them, and where the next pod's search starts: from the rotating ``start``
    (``nextStartNodeIndex``) until :func:`nodes_to_find` feasible ones are found, every node
    when fewer are (``findNodesThatPassFilters``; the start then moves by the nodes it
    judged). No node found: an empty window, the start unmoved."""
    n = len(ok)
    want = nodes_to_find(n, percentage)
    order = (np.arange(n) + start) % n
    hits = np.flatnonzero(ok[order])
    if len(hits) == 0:
        return hits, start
    taken = hits[:want]
    processed = int(taken[-1]) + 1 if len(hits) >= want else n
    return order[taken], (start + processed) % n


def default_scores(arrays: ClusterArrays, req: SliceRequest, nodes: IntArray) -> IntArray:
    """kube-scheduler v1.36's default scores for ``req`` on ``nodes``: NodeResourcesFit with
    the LeastAllocated strategy plus NodeResourcesBalancedAllocation, both weight 1, CPU and
    memory weight 1, in the plugins' integer arithmetic. BalancedAllocation scores the change
    to the node's balance (``balancedResourceScorer`` in
    pkg/scheduler/framework/plugins/noderesources/balanced_allocation.go, since
    kubernetes/kubernetes#135573): ``50 + (50 + with - without) / 2``, 75 when the pod leaves
    the balance as it was."""
    cap, used, after = _requested(arrays, req, nodes)
    with_pod, without = _balance(after, cap), _balance(used, cap)
    half = MAX_NODE_SCORE // 2
    return _least_allocated(after, cap) + half + (half + with_pod - without) // 2


def spread_scores(arrays: ClusterArrays, req: SliceRequest, nodes: IntArray) -> IntArray:
    """The spreading scores ``frag-strand`` breaks its bands' ties with (issue 59): LeastAllocated
    plus the balance of CPU and memory once the pod is placed, as kube-scheduler's
    BalancedAllocation scored it up to v1.35 (the balance after the pod alone). Measured as the
    policy's (docs/dra-placement.md); :func:`default_scores` is kube-scheduler's own now."""
    cap, _, after = _requested(arrays, req, nodes)
    return _least_allocated(after, cap) + _balance(after, cap)


def _requested(arrays: ClusterArrays, req: SliceRequest,
               nodes: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """Per node (rows) and resource (CPU, memory): allocatable, requested without the pod and
    with it."""
    cap = np.stack([arrays.cpu_cap[nodes], arrays.mem_cap[nodes]], axis=1).astype(np.int64)
    used = cap - np.stack([arrays.cpu_free[nodes], arrays.mem_free[nodes]], axis=1)
    return cap, used, used + np.array([req.cpu_milli, req.memory_mib], dtype=np.int64)


def _least_allocated(requested: IntArray, cap: IntArray) -> IntArray:
    """``leastResourceScorer`` (least_allocated.go): per resource ``(cap - requested) * 100 /
    cap``, 0 past the capacity, averaged over the resources a node has (integer division)."""
    has = cap > 0
    per = np.where(requested > cap, 0,
                   (cap - requested) * MAX_NODE_SCORE // np.maximum(cap, 1))
    per = np.where(has, per, 0)
    return np.asarray(per.sum(axis=1) // np.maximum(has.sum(axis=1), 1), dtype=np.int64)


def _balance(requested: IntArray, cap: IntArray) -> IntArray:
    """``balancedResourceScore`` (balanced_allocation.go) for CPU and memory: ``(1 - std) *
    100`` truncated, ``std`` half the difference of the two fractions (each capped at 1); a
    node lacking one of them scores 100 (one fraction, no spread)."""
    frac = np.minimum(requested / np.maximum(cap, 1), 1.0)
    both = (cap > 0).all(axis=1)
    std = np.where(both, np.abs(frac[:, 0] - frac[:, 1]) / 2.0, 0.0)
    return np.asarray(np.trunc((1.0 - std) * MAX_NODE_SCORE), dtype=np.int64)
