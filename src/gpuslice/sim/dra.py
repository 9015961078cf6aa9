"""The DRA path of the simulator: the same traces, with every GPU a consumable-capacity device.

Each GPU of the trace's cluster becomes a device with ``allowMultipleAllocations`` and two
capacities, as our DRA driver publishes them: ``compute`` (``units``, 100 by default: a
percentage, the unit of ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``; request policy min 1, step 1) and
``memory`` (bytes; min 0, step 1 MiB, default 0, as the trace asks for no GPU memory). A task of
k GPUs x m milli is a claim for k devices each giving ``ceil(m x units / 1000)`` compute units; a
task without GPUs is a pod without claims.

Modes (run as the policy names ``dra-default``, ``dra-ours`` and ``dra-ours-all``):

* ``dra-default``: kube-scheduler as shipped. Nodes are scored by its default plugins
  (NodeResourcesFit LeastAllocated + BalancedAllocation on CPU and memory) over its window of
  feasible nodes, and the DRA allocator takes the first fitting devices in slice order.
* ``dra-ours``: our claim allocator places every claim with ``frag-strand`` before the
  scheduler sees it; pods without claims are still placed by kube-scheduler's default scoring
  (the allocator only handles claims, as the extender only handles pods with its resources).
* ``dra-ours-all``: ``frag-strand`` places the pods without claims too (what the device-plugin
  path's ``ours`` in this simulator does), to separate the cost of the DRA translation (compute
  rounded to whole units) from the cost of leaving CPU-only pods to the default scheduler.

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
from gpuslice.core.frag import TargetWorkload
from gpuslice.core.model import MILLI, ClusterArrays
from gpuslice.core.policies import make_policy
from gpuslice.core.workload import Tasks
from gpuslice.sim.engine import Recorder, RunTrace, columns

MODES = ("dra-default", "dra-ours", "dra-ours-all")


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
) -> RunTrace:
    """Submit ``tasks`` in order under ``mode`` (see the module doc); the trace has the shape
    of :func:`gpuslice.sim.engine.replay`'s."""
    if mode not in MODES:
        raise ValidationError("DRA mode", f"one of {', '.join(MODES)}", mode)
    ledger = DraLedger(dra_nodes(arrays, units), {}, workload)
    policy = make_policy("frag-strand")
    rank = rng.permutation(arrays.n_nodes)  # the fixed tie order, as replay() draws it
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
        ours = mode == "dra-ours-all" or (mode == "dra-ours" and req is not None)
        if ours:
            dec = ledger.decide(req, policy, rng, cpu_milli=cpu[i], memory_mib=mem[i],
                                rank=rank)
        else:
            dec = ledger.decide_default(req, rng, cpu_milli=cpu[i], memory_mib=mem[i])
        if dec.placement is not None:
            ledger.apply(dec.placement, ledger.slice_request(req, cpu[i], mem[i]))
            alloc_sum += num[i] * milli[i]
        rec.record(i, arr_sum, alloc_sum, float(ledger.state.frag.sum()),
                   dec.placement is not None)
    return rec.trace(mode, seed, arrays)
