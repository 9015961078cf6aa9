"""Replay a task list against a placement policy (the FGD protocol).

Tasks arrive one at a time and never leave; a task that fits nowhere fails and is not retried.
After every task the run records the arrived GPU demand, the allocated GPU milli and the
fragmentation against the target workload; :func:`bin_run` turns those points into the 1%-bins
of the published result files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpuslice.core.fit import feasible
from gpuslice.core.frag import TargetWorkload
from gpuslice.core.model import MILLI, ClusterArrays, FloatArray, IntArray, SliceRequest
from gpuslice.core.policies import PlacementState, Policy, choose, task_tag
from gpuslice.core.workload import Tasks

BINS = 131  # arrived workload 0..130 %


@dataclass(frozen=True)
class RunTrace:
    """Per task: arrived and allocated GPU milli, fragmentation (milli) and whether it was
    placed."""

    policy: str
    seed: int
    total_gpus: int
    arrived: IntArray
    allocated: IntArray
    frag: FloatArray
    placed: np.ndarray

    @property
    def failed(self) -> int:
        return int((~self.placed).sum())


class Recorder:
    """What a replay records per task (arrived and allocated GPU milli, fragmentation, placed)
    and its progress reports (every 1% of the tasks, the rest at the end): one for every replay
    (plain, DRA, deployed)."""

    def __init__(self, n: int, progress: Callable[[int], None] | None) -> None:
        self.n, self.progress = n, progress
        self.arrived = np.zeros(n, dtype=np.int64)
        self.allocated = np.zeros(n, dtype=np.int64)
        self.frag = np.zeros(n, dtype=np.float64)
        self.placed = np.zeros(n, dtype=np.bool_)
        self.step = max(n // 100, 1)

    def record(self, i: int, arrived: int, allocated: int, frag: float, placed: bool) -> None:
        self.arrived[i], self.allocated[i], self.frag[i] = arrived, allocated, frag
        self.placed[i] = placed
        if self.progress is not None and (i + 1) % self.step == 0:
            self.progress(self.step)

    def trace(self, policy: str, seed: int, arrays: ClusterArrays) -> RunTrace:
        if self.progress is not None and self.n % self.step:
            self.progress(self.n % self.step)
        return RunTrace(policy, seed, int(arrays.gpu_count.sum()), self.arrived,
                        self.allocated, self.frag, self.placed)


def columns(tasks: Tasks) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """A task list's columns as Python lists (fast to index one task at a time): CPU milli,
    memory MiB, GPUs, milli per GPU, allowed-model set id."""
    return (tasks.cpu_milli.tolist(), tasks.memory_mib.tolist(), tasks.num_gpu.tolist(),
            tasks.gpu_milli.tolist(), tasks.spec_id.tolist())


def apply(st: PlacementState, req: SliceRequest, node: int, gpus: tuple[int, ...]) -> None:
    """Take ``req``'s resources on ``node`` (the GPUs given) and refresh the derived state."""
    a = st.arrays
    a.cpu_free[node] -= req.cpu_milli
    a.mem_free[node] -= req.memory_mib
    for g in gpus:
        a.gpu_free[node, g] -= req.milli
        if req.gpu_memory_mib:
            a.gpu_mem_free[node, g] -= req.gpu_memory_mib
    tag = task_tag(req)
    if 0 <= tag < st.affinity.shape[1]:
        st.affinity[node, tag] += 1
    st.refresh(node)


def replay(
    arrays: ClusterArrays,
    tasks: Tasks,
    policy: Policy,
    workload: TargetWorkload,
    rng: np.random.Generator,
    *,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    tie_order: bool = True,
    policy_workload: TargetWorkload | None = None,
) -> RunTrace:
    """Submit ``tasks`` in order to a copy of ``arrays`` under ``policy``.

    ``workload`` is the target workload of the fragmentation metric (and of the policy, unless
    ``policy_workload`` gives the policy its own). Ties go to a fixed random node order drawn
    from ``rng`` (``tie_order``, as the FGD simulator's node naming makes them), or are drawn
    uniformly per decision.
    """
    st = PlacementState.build(arrays.copy(), policy_workload or workload)
    metric = st if policy_workload is None else PlacementState.build(st.arrays, workload)
    rank = rng.permutation(arrays.n_nodes) if tie_order else None
    rec = Recorder(len(tasks), progress)
    arr_sum = 0
    alloc_sum = int((st.arrays.gpu_present * MILLI - st.arrays.gpu_free).sum())
    cpu, mem, num, milli, spec = columns(tasks)
    frag_sum = float(metric.frag.sum())
    for i in range(len(tasks)):
        req = SliceRequest(gpus=num[i], milli=milli[i], cpu_milli=cpu[i], memory_mib=mem[i],
                           models=tasks.specs[spec[i]])
        arr_sum += num[i] * milli[i]
        found = choose(policy, st, req, feasible(st.arrays, req), rng, rank)
        if found is not None:
            old = metric.frag[found.node]
            apply(st, req, found.node, found.gpus)
            if metric is not st:
                metric.refresh(found.node)
            frag_sum += metric.frag[found.node] - old
            alloc_sum += num[i] * milli[i]
        rec.record(i, arr_sum, alloc_sum, frag_sum, found is not None)
    return rec.trace(policy.name, seed, arrays)


@dataclass(frozen=True)
class BinnedRun:
    """One run in 1% bins of arrived workload: allocation %, fragmentation % of all GPUs and
    fragmentation % of idle GPUs (NaN where no point fell near a bin)."""

    policy: str
    seed: int
    total_gpus: int
    alloc: FloatArray
    frag_amount: FloatArray
    frag_ratio: FloatArray
    failed: int


def _bin_mean(keys: IntArray, values: FloatArray) -> FloatArray:
    sums = np.bincount(keys, weights=values, minlength=BINS)[:BINS]
    counts = np.bincount(keys, minlength=BINS)[:BINS]
    out = np.full(BINS, np.nan)
    have = counts > 0
    out[have] = sums[have] / counts[have]
    # an empty bin takes the points of its +-1 neighbours, as the published merge scripts do
    for b in np.flatnonzero(~have):
        lo, hi = max(b - 1, 0), min(b + 2, BINS)
        c = counts[lo:hi].sum()
        if c:
            out[b] = sums[lo:hi].sum() / c
    return out


def bin_run(run: RunTrace) -> BinnedRun:
    """Bin a run the way the FGD authors' merge scripts do (round half to even, mean per bin,
    two decimals)."""
    cap = run.total_gpus * MILLI
    arrive_pct = np.round(run.arrived / run.total_gpus / 10.0)
    keys = arrive_pct.astype(np.int64)
    inside = keys < BINS
    keys, idx = keys[inside], np.flatnonzero(inside)
    alloc_pct = np.round(run.allocated[idx] / run.total_gpus / 10.0, 2)
    idle = (cap - run.allocated[idx]).astype(np.float64)
    frag = run.frag[idx]
    ratio = np.divide(100.0 * frag, idle, out=np.zeros_like(frag), where=idle > 0)
    alloc = np.round(_bin_mean(keys, alloc_pct), 2)
    famount = np.round(100.0 * _bin_mean(keys, frag) / cap, 2)
    fratio = _bin_mean(keys, ratio)
    return BinnedRun(run.policy, run.seed, run.total_gpus, alloc, famount, fratio, run.failed)
