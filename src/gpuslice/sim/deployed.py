"""The device-plugin path as deployed, modelled: what kube-scheduler and ``gpuslice extender``
do together on a cluster, so that the simulator predicts a cluster's figure seed for seed.

Run as the policy name ``deployed``. Per task, in arrival order (the FGD protocol):

* every pod, GPU or not, is seen by the extender as it is created: its shape joins the
  workload it learns (:class:`gpuslice.core.learned.WorkloadEstimator`, the extender's own);
  the metric's fragmentation still counts against the scenario's target workload;
* a pod asking for a GPU goes to the ``gpuslice-scheduler`` profile: kube-scheduler's filters
  (CPU, memory, the GPU count) and the extender's (the GPUs), then the extender's filter keeps
  only ``frag-strand``'s choice (the highest score against the learned workload, ties to the
  first node in its fixed order, :func:`~gpuslice.core.policies.tie_order`), which
  kube-scheduler takes without scoring; the GPU inside the node is the policy's;
* a pod asking for no GPU goes to the default scheduler: NodeResourcesFit (LeastAllocated) plus
  NodeResourcesBalancedAllocation over its window of feasible nodes, ties at random
  (``selectHost``).

What the plain ``ours`` replay does differently: it knows the target workload in advance, places
the CPU-only pods with ``frag-strand`` too, and breaks ties in a random node order drawn per
seed (the extender's order is fixed by the node names' hash).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpuslice.core.dra_default import default_pick
from gpuslice.core.fit import feasible
from gpuslice.core.frag import Shape, TargetWorkload
from gpuslice.core.learned import WorkloadEstimator
from gpuslice.core.model import MILLI, ClusterArrays, SliceRequest
from gpuslice.core.policies import PlacementState, choose, make_policy, tie_order
from gpuslice.core.workload import Tasks
from gpuslice.sim.engine import Recorder, RunTrace, apply, columns

MODE = "deployed"
POLICY = "frag-strand"  # the extender's default


def is_deployed(policy: str) -> bool:
    return policy == MODE


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
) -> RunTrace:
    """Submit ``tasks`` in order as the deployed path places them (see the module doc); the
    trace has the shape of :func:`gpuslice.sim.engine.replay`'s. For taking the gap to the
    plain replay apart: ``learn=False`` scores against ``workload`` (known in advance),
    ``cpu_only_by_policy`` places the CPU-only pods with the policy too, ``tie_rank`` breaks
    ties in another node order than the extender's."""
    policy = make_policy(POLICY)
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
            found = choose(policy, st, req, ok, rng, rank)
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
