"""The DRA path of the simulator: the same traces, with every GPU a consumable-capacity device.

Each GPU of the trace's cluster becomes a device with ``allowMultipleAllocations`` and two
capacities, as our DRA driver publishes them: ``compute`` (``units``, 100 by default: a
percentage, the unit of ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``; request policy min 1, step 1) and
``memory`` (bytes; min 0, step 1 MiB, default 0, as the trace asks for no GPU memory). A task of
k GPUs x m milli is a claim for k devices each giving ``ceil(m x units / 1000)`` compute units; a
task without GPUs is a pod without claims.

Modes (run as the policy names ``dra-default``, ``dra-ours``, ``dra-ours-pinned`` and
``dra-ours-all``):

* ``dra-default``: kube-scheduler as shipped. Nodes are scored by its default plugins
  (NodeResourcesFit LeastAllocated + BalancedAllocation on CPU and memory) over its window of
  feasible nodes, and the DRA allocator takes the first fitting devices in slice order.
* ``dra-ours``: our claim allocator places every claim with ``frag-strand`` before the
  scheduler sees it; pods without claims are still placed by kube-scheduler's default scoring
  (the allocator only handles claims, as the extender only handles pods with its resources).
  As ``gpuslice dra-allocator`` does (``services/dra_book.py``), it scores against the target
  workload learned from the pods seen so far (every pod as it arrives, its claim's request in
  milli-GPU of the devices: :class:`~gpuslice.core.learned.WorkloadEstimator`), not the
  trace's, which it cannot know; the fragmentation recorded is still against the trace's.
* ``dra-ours-pinned``: ``dra-ours`` with the webhook's ``--gate-cpu-only``: the allocator
  places the pods without claims too, by the same policy on the same learned workload, and
  pins each to its node (:mod:`gpuslice.services.dra_pins`); the model takes the pin as
  kube-scheduler does when the node fits, which it does here (the ledger said so).
* ``dra-ours-all``: ``frag-strand`` places the pods without claims too (what the device-plugin
  path's ``ours`` in this simulator does, against the trace's target workload), to separate
  the cost of the DRA translation (compute rounded to whole units) from the cost of leaving
  CPU-only pods to the default scheduler and of learning the workload.

The allocated GPU share counts what tasks asked for (milli), so rounding up to whole compute
units shows as unallocated GPU, which is what it is.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpuslice.core.dra_placement import (
    COMPUTE,
    MEMORY,
    MIB,
    Capacity,
    DeviceRequest,
    DraLedger,
    DraNode,
    RequestPolicy,
)
from gpuslice.core.dra_placement import DraDevice as Device
from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import Shape, TargetWorkload
from gpuslice.core.learned import WorkloadEstimator
from gpuslice.core.model import MILLI, ClusterArrays, IntArray
from gpuslice.core.policies import PlacementState, Policy, make_policy
from gpuslice.core.workload import Tasks
from gpuslice.sim.engine import Recorder, RunTrace, columns

MODES = ("dra-default", "dra-ours", "dra-ours-pinned", "dra-ours-all")


def is_dra(policy: str) -> bool:
    return policy in MODES


def dra_nodes(arrays: ClusterArrays, units: int = 100) -> list[DraNode]:
    """The trace's nodes with one consumable-capacity device per GPU, in GPU order (one pool
    per node, one slice, as a node-local driver publishes)."""
    if units < 1:
        raise ValidationError("compute units", "a positive number of units per GPU", units)
    compute = Capacity(units, RequestPolicy(default=units, min=1, max=units, step=1))
    out: list[DraNode] = []
    for i, name in enumerate(arrays.names):
        mid = int(arrays.model_id[i])
        model = arrays.models[mid] if mid >= 0 else ""
        devices = []
        for j in range(int(arrays.gpu_count[i])):
            mem = int(arrays.gpu_mem_cap[i, j]) * MIB
            caps = {COMPUTE: compute,
                    MEMORY: Capacity(mem, RequestPolicy(default=0, min=0, max=mem, step=MIB))}
            devices.append(Device(name, f"gpu-{j}", "gpu", model, True, caps))
        cpu_used = int(arrays.cpu_cap[i] - arrays.cpu_free[i])
        mem_used = int(arrays.mem_cap[i] - arrays.mem_free[i])
        out.append(DraNode(name, int(arrays.cpu_cap[i]), int(arrays.mem_cap[i]),
                           tuple(devices), cpu_used, mem_used))
    return out


def replay_dra(
    arrays: ClusterArrays,
    tasks: Tasks,
    mode: str,
    workload: TargetWorkload,
    rng: np.random.Generator,
    *,
    seed: int = 0,
    units: int = 100,
    progress: Callable[[int], None] | None = None,
    learn: bool = True,
    policy: Policy | None = None,
    cpu_only_by_policy: bool = False,
    tie_rank: IntArray | None = None,
) -> RunTrace:
    """Submit ``tasks`` in order under ``mode`` (see the module doc); the trace has the shape
    of :func:`gpuslice.sim.engine.replay`'s. ``learn=False``: ``dra-ours`` scores against
    ``workload`` (known in advance) instead of the one learned from the pods seen.
    ``policy``: our modes' policy, another than the allocator's default (``frag-strand``).
    ``cpu_only_by_policy``: ``dra-ours`` places the CPU-only pods with the policy too (what
    the allocator would add by placing them; ``dra-ours-all`` is that with the workload
    known). Ties: ``dra-ours`` breaks them as the allocator does, in the fixed order of the
    node names' hash (:func:`~gpuslice.core.policies.tie_order`), ``dra-ours-all`` in a
    random order drawn per seed, as the plain replay does; ``tie_rank``: another order."""
    if mode not in MODES:
        raise ValidationError("DRA mode", f"one of {', '.join(MODES)}", mode)
    label = mode
    if mode == "dra-ours-pinned":  # the allocator pinning the pods without claims too
        mode, cpu_only_by_policy = "dra-ours", True
    learning = learn and mode == "dra-ours"
    ledger = DraLedger(dra_nodes(arrays, units), {}, None if learning else workload)
    metric = ledger.state if not learning else PlacementState.build(ledger.arrays, workload)
    estimator, version = WorkloadEstimator(), -1
    policy = policy or make_policy("frag-strand")
    # drawn in every mode (then replaced by the ledger's for dra-ours) so that the random
    # stream after it, kube-scheduler's tie draws for the pods it places, is the same in
    # every mode: the paired tables compare modes seed by seed
    rank = rng.permutation(arrays.n_nodes)  # the fixed tie order, as replay() draws it
    if tie_rank is not None:
        rank = tie_rank
    elif mode == "dra-ours":  # the allocator's: the ledger's own (the names' hash)
        rank = ledger.rank
    rec = Recorder(len(tasks), progress)
    cpu, mem, num, milli, spec = columns(tasks)
    arr_sum = alloc_sum = 0
    for i in range(len(tasks)):
        arr_sum += num[i] * milli[i]
        req = None
        if num[i] > 0:
            want = -(-milli[i] * units // MILLI)
            req = DeviceRequest("gpu", num[i], {COMPUTE: want},
                                models=tasks.specs[spec[i]])
        sreq = ledger.slice_request(req, cpu[i], mem[i])
        if learning and sreq is not None:  # the allocator sees the pod (dra_book's shape)
            estimator.add(Shape(cpu[i], sreq.gpus, sreq.milli if sreq.gpus else 0))
        ours = mode == "dra-ours-all" or (mode == "dra-ours"
                                          and (req is not None or cpu_only_by_policy))
        if ours:
            if learning:
                learned = estimator.current()
                if estimator.version != version:
                    version = estimator.version
                    ledger.set_workload(learned)
            dec = ledger.decide(req, policy, rng, cpu_milli=cpu[i], memory_mib=mem[i],
                                rank=rank)
        else:
            dec = ledger.decide_default(req, rng, cpu_milli=cpu[i], memory_mib=mem[i])
        if dec.placement is not None:
            ledger.apply(dec.placement, sreq)
            if metric is not ledger.state:
                metric.refresh(ledger.index[dec.placement.node])
            alloc_sum += num[i] * milli[i]
        rec.record(i, arr_sum, alloc_sum, float(metric.frag.sum()),
                   dec.placement is not None)
    return rec.trace(label, seed, arrays)
