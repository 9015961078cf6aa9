"""kube-scheduler's own node choice for a pod, as the default DRA path makes it: the window of
feasible nodes it filters from a rotating start (``numFeasibleNodesToFind`` in
pkg/scheduler/schedule_one.go) and its default scores on CPU and memory (NodeResourcesFit with
LeastAllocated, NodeResourcesBalancedAllocation). Used by
:meth:`gpuslice.core.dra_placement.DraLedger.decide_default` and the simulator's model of the
deployed path."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuslice.core.model import BoolArray, ClusterArrays, FloatArray, IntArray, SliceRequest

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


def default_scores(arrays: ClusterArrays, req: SliceRequest, nodes: IntArray) -> FloatArray:
    """NodeResourcesFit with the LeastAllocated strategy plus NodeResourcesBalancedAllocation
    (both weight 1, CPU and memory weight 1), as integers like the plugins'."""
    cap = np.stack([arrays.cpu_cap[nodes], arrays.mem_cap[nodes]], axis=1).astype(np.int64)
    used = cap - np.stack([arrays.cpu_free[nodes], arrays.mem_free[nodes]], axis=1)
    after = used + np.array([req.cpu_milli, req.memory_mib], dtype=np.int64)
    safe = np.maximum(cap, 1)
    least = np.where(after > cap, 0, (cap - after) * MAX_NODE_SCORE // safe)
    least = np.where(cap == 0, 0, least).sum(axis=1) // 2
    frac = np.minimum(after / safe, 1.0)
    std = np.abs(frac[:, 0] - frac[:, 1]) / 2.0
    balanced = np.trunc((1.0 - std) * MAX_NODE_SCORE)
    return np.asarray(least + balanced, dtype=np.float64)
