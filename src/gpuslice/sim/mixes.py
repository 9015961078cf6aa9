"""Task mixes derived from one task list the way the FGD paper's trace variants are made.

The Alibaba trace's variants (``shared/traces/alibaba-gpu-v2023/SCHEMA.md``, checked against
the files) change one thing of ``default`` at a time, drawing the tasks they add from the
list's own tasks:

* ``cpuNNN``: CPU-only tasks make up NNN/10 % of the task count; the GPU tasks stay. Above the
  list's share, CPU-only tasks drawn from its own are appended; below, random ones are dropped
  (``cpu100`` has 7,853 of ``default``'s 8,152 rows);
* ``gpushareNN``: sharing tasks (one GPU, less than 1000 milli) make up NN % of the GPU
  *demand*; the task count stays. Going up, a random non-sharing GPU task is replaced by a
  sharing task drawn from the list's own, until the share is reached (``gpushare60``: 5,233
  sharing, 1,801 whole and 30 multi-GPU tasks for ``default``'s 3,078, 3,911 and 75); going
  down, a sharing task by a non-sharing GPU task;
* ``multigpuNN``: multi-GPU tasks make up NN % of the GPU demand, by appending multi-GPU tasks
  drawn from the list's own (``multigpu30``: ``default``'s rows plus 356 multi-GPU rows,
  every one a copy of a ``default`` shape).

:data:`MIXES` names the mixes the placement matrix runs (``benchmarks/placement_matrix.py``).
Pure: the generator is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import typical_shapes
from gpuslice.core.model import MILLI
from gpuslice.core.workload import Tasks
from gpuslice.sim.runner import Scenario


def is_sharing(tasks: Tasks) -> np.ndarray:
    return np.asarray((tasks.num_gpu == 1) & (tasks.gpu_milli < MILLI) & (tasks.gpu_milli > 0))


def sharing_share(tasks: Tasks) -> float:
    """The share of the GPU demand that sharing tasks ask for."""
    demand = tasks.total_milli
    total = int(demand.sum())
    return float(demand[is_sharing(tasks)].sum()) / total if total else 0.0


def multi_share(tasks: Tasks) -> float:
    """The share of the GPU demand that multi-GPU tasks ask for."""
    demand = tasks.total_milli
    total = int(demand.sum())
    return float(demand[tasks.num_gpu > 1].sum()) / total if total else 0.0


def cpu_only_share(tasks: Tasks) -> float:
    """The share of the tasks that ask for no GPU."""
    return float((tasks.num_gpu == 0).mean()) if len(tasks) else 0.0


def with_cpu_only(tasks: Tasks, share: float, rng: np.random.Generator) -> Tasks:
    """``cpuNNN``: CPU-only tasks ``share`` of the task count, GPU tasks unchanged."""
    if not 0 <= share < 1:
        raise ValidationError("CPU-only share", "a share in [0, 1)", share)
    cpu = np.flatnonzero(tasks.num_gpu == 0)
    gpu = np.flatnonzero(tasks.num_gpu > 0)
    want = round(len(gpu) * share / (1 - share))
    if want > len(cpu):
        if not len(cpu):
            raise ValidationError("tasks", "a CPU-only task to draw more from", 0)
        extra = cpu[rng.integers(len(cpu), size=want - len(cpu))]
        return tasks.take(np.concatenate([np.arange(len(tasks)), extra]))
    keep = np.ones(len(tasks), dtype=np.bool_)
    keep[rng.choice(cpu, size=len(cpu) - want, replace=False)] = False
    return tasks.take(np.flatnonzero(keep))


def with_sharing(tasks: Tasks, share: float, rng: np.random.Generator) -> Tasks:
    """``gpushareNN``: sharing tasks ``share`` of the GPU demand, by swapping GPU tasks one at
    a time (a random non-sharing one for a sharing one drawn from the list, or the reverse);
    the task count stays."""
    if not 0 <= share <= 1:
        raise ValidationError("sharing share", "a share in [0, 1]", share)
    src_share = np.flatnonzero(is_sharing(tasks))
    src_other = np.flatnonzero((tasks.num_gpu > 0) & ~is_sharing(tasks))
    index = np.arange(len(tasks))
    demand = tasks.total_milli.astype(np.float64)
    sharing = is_sharing(tasks).copy()
    up = sharing_share(tasks) < share
    pool = src_share if up else src_other
    if not len(pool):
        raise ValidationError("tasks", "a task of the kind the mix needs more of", 0)
    victims = list(rng.permutation(np.flatnonzero((tasks.num_gpu > 0) & (sharing != up))))
    shared = float(demand[sharing].sum())
    total = float(demand.sum())
    while victims and ((shared / total < share) if up else (shared / total > share)):
        slot = int(victims.pop())
        pick = int(pool[int(rng.integers(len(pool)))])
        total += demand[pick] - demand[index[slot]]
        shared += demand[pick] if up else -demand[index[slot]]
        index[slot] = pick
    return tasks.take(index)


def with_multi_gpu(tasks: Tasks, share: float, rng: np.random.Generator) -> Tasks:
    """``multigpuNN``: multi-GPU tasks ``share`` of the GPU demand, by appending multi-GPU
    tasks drawn from the list's own."""
    if not 0 <= share < 1:
        raise ValidationError("multi-GPU share", "a share in [0, 1)", share)
    multi = np.flatnonzero(tasks.num_gpu > 1)
    if not len(multi):
        raise ValidationError("tasks", "a multi-GPU task to draw more from", 0)
    demand = tasks.total_milli
    total = float(demand.sum())
    inside = float(demand[multi].sum())
    extra: list[int] = []
    while inside < share * total:
        pick = int(multi[int(rng.integers(len(multi)))])
        extra.append(pick)
        total += float(demand[pick])
        inside += float(demand[pick])
    return tasks.take(np.concatenate([np.arange(len(tasks)), np.array(extra, dtype=np.int64)]))


@dataclass(frozen=True)
class Mix:
    """A named task mix: how it is made from a task list, in the paper's terms."""

    name: str
    variant: str  # the FGD variant it is made like ("" for the list itself)
    make: Callable[[Tasks, np.random.Generator], Tasks]


def _same(tasks: Tasks, rng: np.random.Generator) -> Tasks:
    return tasks


MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("default", "", _same),
    Mix("sharing-heavy", "gpushare80", lambda t, r: with_sharing(t, 0.80, r)),
    Mix("whole-gpu-heavy", "gpushare10", lambda t, r: with_sharing(t, 0.10, r)),
    Mix("multi-gpu-heavy", "multigpu50", lambda t, r: with_multi_gpu(t, 0.50, r)),
    Mix("cpu-heavy", "cpu250", lambda t, r: with_cpu_only(t, 0.25, r)),
)}


def make_mix(name: str, tasks: Tasks, seed: int = 5) -> Tasks:
    """Mix ``name`` of :data:`MIXES` made from ``tasks`` (the same for a given ``seed``)."""
    mix = MIXES.get(name)
    if mix is None:
        raise ValidationError("task mix", f"one of {', '.join(MIXES)}", name)
    return mix.make(tasks, np.random.default_rng(seed))


def scenario_with_mix(scenario: Scenario, name: str, seed: int = 5) -> Scenario:
    """``scenario``'s cluster with its task list made into mix ``name``, and the target
    workload derived from the new list as for any scenario (its typical shapes)."""
    if name == "default":
        return scenario
    tasks = make_mix(name, scenario.tasks, seed)
    return Scenario(f"{scenario.name}, {name} mix", scenario.arrays, tasks,
                    typical_shapes(tasks.shapes(), coverage_pct=95.0, step=1))
