"""The device-plugin path as deployed, modelled: what kube-scheduler and ``gpuslice extender``
do together on a cluster, so that the simulator predicts a cluster's figure seed for seed.

Run as the policy name ``deployed``. Per task, in arrival order (the FGD protocol):

* every pod, GPU or not, is seen by the extender as it is created: its shape joins the
  workload it learns (:class:`gpuslice.core.learned.WorkloadEstimator`, the extender's own);
  the metric's fragmentation still counts against the scenario's target workload;
* a pod asking for a GPU goes to the ``gpuslice-scheduler`` profile: kube-scheduler's filters
  (CPU, memory, the node totals of ``gpuslice.io/gpu-milli``) and the extender's (the GPUs),
  then the extender's filter keeps only ``frag-strand``'s choice (the highest score against
  the learned workload, ties to the first node in its fixed order,
  :func:`~gpuslice.core.policies.tie_order`), which kube-scheduler takes without scoring; the
  GPU inside the node is the policy's. The profile's ``percentageOfNodesToScore``
  (``percentage``; deploy/'s by default, ``deployed:P`` as a policy name): below 100,
  kube-scheduler sends the extender only the window of nodes its filters pass from its
  rotating start (:func:`gpuslice.core.dra_default.window`), and the extender chooses among
  those; a window with no node whose GPUs fit fails the attempt, and the pod is tried again
  with the next window (as the scheduler's queue retries it) until it fits or every node has
  been in one;
* a pod asking for no GPU goes to the default scheduler: NodeResourcesFit (LeastAllocated) plus
  NodeResourcesBalancedAllocation over its window of feasible nodes, ties at random
  (``selectHost``). Both profiles share one rotating start, as they do in one kube-scheduler
  process (the dev cluster's; deploy/ runs the ``gpuslice-scheduler`` as a second one).

What the plain ``ours`` replay does differently: it knows the target workload in advance, places
the CPU-only pods with ``frag-strand`` too, and breaks ties in a random node order drawn per
seed (the extender's order is fixed by the node names' hash).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpuslice.core.dra_default import default_pick, window
from gpuslice.core.fit import feasible
from gpuslice.core.frag import Shape, TargetWorkload
from gpuslice.core.learned import WorkloadEstimator
from gpuslice.core.model import MILLI, BoolArray, ClusterArrays, SliceRequest
from gpuslice.core.policies import (
    Choice,
    PlacementState,
    Policy,
    choose,
    make_policy,
    tie_order,
)
from gpuslice.core.workload import Tasks
from gpuslice.sim.engine import Recorder, RunTrace, apply, columns

MODE = "deployed"
POLICY = "frag-strand"  # the extender's default
# the gpuslice-scheduler profile's percentageOfNodesToScore in deploy/ (1: kube-scheduler's
# smallest window, 100 feasible nodes; 0 would be its adaptive share; tests/deploy checks that
# the two agree)
NODES_TO_SCORE = 1


def is_deployed(policy: str) -> bool:
    return policy == MODE or policy.startswith(f"{MODE}:")


def nodes_to_score(policy: str) -> int:
    """The ``percentageOfNodesToScore`` a ``deployed`` policy name gives: ``deployed``
    deploy/'s (:data:`NODES_TO_SCORE`), ``deployed:P`` P (0: kube-scheduler's adaptive
    share)."""
    if policy == MODE:
        return NODES_TO_SCORE
    text = policy.removeprefix(f"{MODE}:")
    if not text.isdigit() or int(text) > 100:
        raise ValueError(f"policy {policy!r}: expected {MODE}:P with P a percentage 0..100")
    return int(text)


def scheduler_fit(arrays: ClusterArrays, req: SliceRequest) -> BoolArray:
    """Where kube-scheduler's own filters pass a GPU pod of the gpuslice-scheduler profile:
    CPU and memory, and the node totals of the GPU share it counts (NodeResourcesFit on
    ``gpuslice.io/gpu-milli``: the node's free milli summed over its GPUs), which GPU it
    does not judge (the extender does)."""
    # a slot past a node's GPU count has no free milli (ClusterArrays), and a node without
    # GPUs none at all: the sum alone says both
    free = arrays.gpu_free.sum(axis=1)
    return np.asarray((free >= max(req.gpus * req.milli, 1))
                      & (arrays.cpu_free >= req.cpu_milli) & (arrays.mem_free >= req.memory_mib))


def replay_deployed(
    arrays: ClusterArrays,
    tasks: Tasks,
    workload: TargetWorkload,
    rng: np.random.Generator,
    *,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    learn: bool = True,
    cpu_only_by_policy: bool = False,
    tie_rank: np.ndarray | None = None,
    percentage: int = NODES_TO_SCORE,
    policy: Policy | None = None,
) -> RunTrace:
    """Submit ``tasks`` in order as the deployed path places them (see the module doc); the
    trace has the shape of :func:`gpuslice.sim.engine.replay`'s. For taking the gap to the
    plain replay apart: ``learn=False`` scores against ``workload`` (known in advance),
    ``cpu_only_by_policy`` places the CPU-only pods with the policy too, ``tie_rank`` breaks
    ties in another node order than the extender's. ``percentage``: the profile's
    ``percentageOfNodesToScore`` (see the module doc). ``policy``: another than the
    extender's default (``frag-strand`` as configured)."""
    policy = policy or make_policy(POLICY)
    estimator = WorkloadEstimator()
    work = arrays.copy()
    metric = PlacementState.build(work, workload)
    st: PlacementState | None = None
    version = -1
    rank = tie_order(work.names) if tie_rank is None else tie_rank  # the extender's order
    start = 0  # the default scheduler's rotating first node (nextStartNodeIndex)
    rec = Recorder(len(tasks), progress)
    cpu, mem, num, milli, spec = columns(tasks)
    arr_sum = 0
    alloc_sum = int((work.gpu_present * MILLI - work.gpu_free).sum())
    frag_sum = float(metric.frag.sum())
    for i in range(len(tasks)):
        models = tasks.specs[spec[i]]
        req = SliceRequest(gpus=num[i], milli=milli[i], cpu_milli=cpu[i], memory_mib=mem[i],
                           models=models)
        arr_sum += num[i] * milli[i]
        estimator.add(Shape(cpu[i], num[i], milli[i] if num[i] else 0, models))
        ok = feasible(work, req)
        node: int | None = None
        gpus: tuple[int, ...] = ()
        if num[i] > 0 or cpu_only_by_policy:
            wl = estimator.current() if learn else workload
            if st is None or (learn and estimator.version != version):
                st = PlacementState.build(work, wl)
                version = estimator.version
            if percentage >= 100:
                found = choose(policy, st, req, ok, rng, rank)
            else:
                found, start = windowed_choice(policy, st, req, ok, scheduler_fit(work, req),
                                               start, percentage, rng, rank)
            if found is not None:
                node, gpus = found.node, found.gpus
        else:
            pick = default_pick(work, req, ok, start, rng)
            if pick is not None:
                node, start = pick.node, pick.next_start
        if node is not None:
            old = metric.frag[node]
            apply(metric, req, node, gpus)  # the arrays are shared: one update for both
            if st is not None:
                st.refresh(node)
                st.affinity[node] = metric.affinity[node]
            frag_sum += metric.frag[node] - old
            alloc_sum += num[i] * milli[i]
        rec.record(i, arr_sum, alloc_sum, frag_sum, node is not None)
    return rec.trace(MODE, seed, arrays)


def windowed_choice(policy: Policy, st: PlacementState, req: SliceRequest, ok: BoolArray,
                    fit: BoolArray, start: int, percentage: int, rng: np.random.Generator,
                    rank: np.ndarray) -> tuple[Choice | None, int]:
    """The policy's choice among the nodes of kube-scheduler's window (``fit``: its filters)
    whose GPUs fit (``ok``), the next window after a miss, and where the next pod's search
    starts."""
    judged = 0
    n = len(ok)
    while judged < n:
        nodes, after = window(fit, start, percentage)
        if not len(nodes):
            return None, start
        judged += (after - start) % n or n
        start = after
        mask = np.zeros(n, dtype=np.bool_)
        mask[nodes] = True
        found = choose(policy, st, req, ok & mask, rng, rank)
        if found is not None:
            return found, start
    return None, start
