"""GPU fragmentation against a target workload (FGD, USENIX ATC '23).

The target workload M is the popularity distribution of task shapes (CPU, GPU count, milli per
GPU, allowed models). For a node n and a shape m, the fragment F_n(m) is the idle GPU milli that m
could not use: all of it when m does not fit (or is CPU-only, or may not use n's model), else the
idle milli of the GPUs whose leftover is smaller than m's share. F_n(M) = sum_m p_m F_n(m).

The tables here let a policy evaluate F for every node, and for every candidate placement of a
sharing task, with a few vectorised numpy operations instead of a loop over nodes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpuslice.core.errors import ValidationError
from gpuslice.core.model import BoolArray, ClusterArrays, FloatArray, IntArray


@dataclass(frozen=True, slots=True)
class Shape:
    """A task shape of the target workload."""

    cpu_milli: int
    gpus: int
    milli: int
    models: frozenset[str] = frozenset()
    memory_mib: int = 0


@dataclass(frozen=True)
class TargetWorkload:
    """Shapes with their popularity (summing to 1), as arrays for vectorised use.
    ``observed``: how many tasks the popularity was estimated from (0: known in advance, as
    the simulator knows its trace's), so a policy can tell a measured share from noise."""

    shapes: tuple[Shape, ...]
    popularity: FloatArray
    cpu: IntArray
    gpus: IntArray
    milli: IntArray
    memory: IntArray
    observed: int = 0

    @classmethod
    def of(cls, shapes: Sequence[Shape], popularity: Sequence[float], *,
           observed: int = 0) -> TargetWorkload:
        if len(shapes) != len(popularity) or not shapes:
            raise ValidationError(
                "target workload", "one popularity per shape, at least one shape",
                (len(shapes), len(popularity)),
            )
        p = np.asarray(popularity, dtype=np.float64)
        if (p < 0).any() or abs(float(p.sum()) - 1.0) > 1e-6:
            raise ValidationError("target workload popularity", "shares >= 0 summing to 1", p)
        if observed < 0:
            raise ValidationError("target workload observed", "a task count >= 0", observed)
        return cls(
            tuple(shapes),
            p,
            np.array([s.cpu_milli for s in shapes], dtype=np.int64),
            np.array([s.gpus for s in shapes], dtype=np.int64),
            np.array([s.milli for s in shapes], dtype=np.int64),
            np.array([s.memory_mib for s in shapes], dtype=np.int64),
            observed,
        )

    def with_memory(self, memory_mib: Sequence[int]) -> TargetWorkload:
        """The same shapes, each also needing ``memory_mib`` of node memory to fit."""
        if len(memory_mib) != len(self.shapes):
            raise ValidationError("shape memory", f"{len(self.shapes)} values", len(memory_mib))
        shapes = [
            Shape(s.cpu_milli, s.gpus, s.milli, s.models, int(m))
            for s, m in zip(self.shapes, memory_mib, strict=True)
        ]
        return TargetWorkload.of(shapes, self.popularity.tolist(), observed=self.observed)

    def model_access(self, models: Sequence[str]) -> BoolArray:
        """(n_models + 1, M): may shape m use GPU model i? The last row (model id -1, no GPU) is
        all False."""
        acc = np.zeros((len(models) + 1, len(self.shapes)), dtype=np.bool_)
        for i, name in enumerate(models):
            for k, s in enumerate(self.shapes):
                acc[i, k] = not s.models or name in s.models
        return acc


def typical_shapes(
    shapes: Sequence[Shape], *, coverage_pct: float = 95.0, step: int = 10
) -> TargetWorkload:
    """The most popular shapes of a task list, up to ``coverage_pct`` of the tasks.

    Shapes are taken in decreasing count, ``step`` at a time, until the taken ones cover the
    percentage; their shares are then renormalised to sum to 1 (FGD's ``GetTypicalPods``). Ties
    in count are broken by larger CPU, then larger milli, more GPUs, and model names.
    """
    return typical_of_counts(Counter(shapes), coverage_pct=coverage_pct, step=step)


def typical_of_counts(
    counts: Mapping[Shape, int], *, coverage_pct: float = 95.0, step: int = 10,
    observed: int = 0,
) -> TargetWorkload:
    """:func:`typical_shapes` of a task list given as shape -> number of tasks (``observed``:
    see :class:`TargetWorkload`)."""
    total = float(sum(counts.values()))
    if total <= 0:
        raise ValidationError("task list", "at least one task to derive a target workload", 0)
    if not 0 < coverage_pct <= 100:
        raise ValidationError("coverage_pct", "a percentage in (0, 100]", coverage_pct)

    def order(item: tuple[Shape, int]) -> tuple[int, int, int, int, tuple[str, ...]]:
        s, c = item
        return (c, s.cpu_milli, s.milli, s.gpus, tuple(sorted(s.models)))

    ranked = sorted(((s, c) for s, c in counts.items() if c > 0), key=order, reverse=True)
    want = coverage_pct * total / 100.0
    taken = 0
    cum = 0.0
    while cum < want and taken < len(ranked):
        upto = min(taken + max(step, 1), len(ranked))
        for _, c in ranked[taken:upto]:
            cum += c
        taken = upto
    chosen = ranked[:taken]
    weight = float(sum(c for _, c in chosen))
    return TargetWorkload.of([s for s, _ in chosen], [c / weight for _, c in chosen],
                             observed=observed)


@dataclass
class FragTables:
    """Per node and shape: how many GPUs have at least the shape's share free (``count``) and
    how much milli those GPUs hold (``big``). Derived from the arrays; refresh rows with
    :meth:`refresh` after a node changes."""

    access: BoolArray  # (N, M)
    count: IntArray  # (N, M)
    big: IntArray  # (N, M)

    @classmethod
    def build(cls, arrays: ClusterArrays, tw: TargetWorkload) -> FragTables:
        acc = tw.model_access(arrays.models)[arrays.model_id]  # model_id -1 -> last row
        count, big = _count_big(arrays.gpu_free, tw.milli)
        return cls(acc, count, big)

    def refresh(self, arrays: ClusterArrays, tw: TargetWorkload, node: int) -> None:
        count, big = _count_big(arrays.gpu_free[node : node + 1], tw.milli)
        self.count[node] = count[0]
        self.big[node] = big[0]


def _count_big(gpu_free: IntArray, milli: IntArray) -> tuple[IntArray, IntArray]:
    ge = gpu_free[:, :, None] >= milli[None, None, :]  # (N, G, M)
    count = ge.sum(axis=1)
    big = (gpu_free[:, :, None] * ge).sum(axis=1)
    return np.asarray(count, dtype=np.int64), np.asarray(big, dtype=np.int64)


def shape_frag(
    total_free: IntArray, cpu_free: IntArray, mem_free: IntArray, access: BoolArray,
    count: IntArray, big: IntArray, tw: TargetWorkload, *, cpu_bound: bool = False,
) -> FloatArray:
    """F(m) for each row and shape: rows may be nodes or candidate placements.

    ``cpu_bound``: the GPU a shape can use on a row is also capped by the tasks of that shape
    its free CPU can host (``cpu_free // cpu_m`` tasks of ``gpus_m x milli_m`` each), so GPUs
    that the node's CPU cannot feed count as fragmented even while one task still fits (FGD
    counts them only once not a single task fits)."""
    fits = (
        access
        & (cpu_free[:, None] >= tw.cpu[None, :])
        & (count >= tw.gpus[None, :])
        & (tw.gpus[None, :] > 0)
    )
    if tw.memory.any():
        fits &= mem_free[:, None] >= tw.memory[None, :]
    usable = np.where(fits, big, 0)
    if cpu_bound:
        tasks = cpu_free[:, None] // np.maximum(tw.cpu, 1)[None, :]
        fed = np.where(tw.cpu[None, :] > 0, tasks * (tw.gpus * tw.milli)[None, :], usable)
        usable = np.minimum(usable, fed)
    return np.asarray(total_free[:, None] - usable, dtype=np.float64)


def node_frag(arrays: ClusterArrays, tw: TargetWorkload, tables: FragTables, *,
              cpu_bound: bool = False) -> FloatArray:
    """F_n(M) for every node, in milli-GPU (``cpu_bound``: see :func:`shape_frag`)."""
    total = arrays.gpu_free.sum(axis=1)
    per_shape = shape_frag(
        total, arrays.cpu_free, arrays.mem_free, tables.access, tables.count, tables.big, tw,
        cpu_bound=cpu_bound,
    )
    return np.asarray(per_shape @ tw.popularity)


def cluster_frag(arrays: ClusterArrays, tw: TargetWorkload) -> float:
    """F(M) of the whole cluster, in milli-GPU."""
    return float(node_frag(arrays, tw, FragTables.build(arrays, tw)).sum())


def model_pressure(arrays: ClusterArrays, tw: TargetWorkload) -> FloatArray:
    """How much of each GPU model the *model-constrained* part of the target workload needs,
    relative to the cluster's average demand per GPU (index ``-1``, no GPU, is 0).

    Each constrained shape's GPU demand is spread over the models it accepts in proportion to
    their capacity. A model only some tasks may use (for example the only P100s, when 10% of
    tasks insist on P100) gets a high pressure; with no constrained shapes every model gets 0.
    """
    n_models = len(arrays.models)
    cap = np.zeros(n_models)
    for i in range(n_models):
        cap[i] = float(arrays.gpu_count[arrays.model_id == i].sum()) * 1000.0
    demand = np.zeros(n_models)
    for shape, p in zip(tw.shapes, tw.popularity.tolist(), strict=True):
        if shape.gpus == 0 or not shape.models:
            continue
        allowed = np.array([m in shape.models for m in arrays.models], dtype=np.bool_)
        reach = float((cap * allowed).sum())
        if reach <= 0:
            continue
        demand += p * shape.gpus * shape.milli * cap * allowed / reach
    total_demand = float((tw.popularity * tw.gpus * tw.milli).sum())
    total_cap = float(cap.sum())
    out = np.zeros(n_models + 1)
    if total_demand > 0 and total_cap > 0:
        out[:n_models] = np.divide(demand, cap, out=np.zeros(n_models), where=cap > 0) / (
            total_demand / total_cap
        )
    return out


def cpu_demand_ratio(arrays: ClusterArrays, tw: TargetWorkload) -> float:
    """The CPU the target workload needs by the time the cluster's GPUs are full, over the CPU
    the cluster has: expected CPU per milli-GPU of all tasks (CPU-only ones included) x GPU
    capacity / CPU capacity. Above 1 the CPU runs out before the GPUs do. 0 when the workload
    asks for no GPU or the cluster has no CPU."""
    demand = float((tw.popularity * tw.gpus * tw.milli).sum())
    cpu_capacity = float(arrays.cpu_cap.sum())
    if demand <= 0 or cpu_capacity <= 0:
        return 0.0
    all_tasks = float((tw.popularity * tw.cpu).sum()) / demand
    return all_tasks * float((arrays.gpu_count * 1000).sum()) / cpu_capacity


def cpu_demand_error(arrays: ClusterArrays, tw: TargetWorkload) -> float:
    """The standard error of :func:`cpu_demand_ratio` where the workload was measured
    (``tw.observed`` tasks: the ratio estimator's delta-method variance,
    ``sum_m p_m (c_m - R g_m)^2 / (sum_m p_m g_m)^2 / n``, R the CPU per milli-GPU, c and g
    a shape's CPU and GPU milli); 0 for a workload known in advance."""
    g = (tw.gpus * tw.milli).astype(np.float64)
    mean_g = float((tw.popularity * g).sum())
    cpu_capacity = float(arrays.cpu_cap.sum())
    if tw.observed <= 0 or mean_g <= 0 or cpu_capacity <= 0:
        return 0.0
    per_milli = float((tw.popularity * tw.cpu).sum()) / mean_g
    var = float((tw.popularity * (tw.cpu - per_milli * g) ** 2).sum()) / mean_g**2 / tw.observed
    return float(np.sqrt(var)) * float((arrays.gpu_count * 1000).sum()) / cpu_capacity


def cpu_per_milli(arrays: ClusterArrays, tw: TargetWorkload) -> float:
    """CPU (milli) the target workload needs per milli-GPU, for judging stranded GPUs.

    Normally only the GPU tasks count: CPU-only tasks can run anywhere, including next to GPUs
    that are already taken. But when the workload needs more CPU than the cluster has by the
    time its GPUs are full (:func:`cpu_demand_ratio` >= 1), every core counts, and so does the
    CPU of CPU-only tasks. Returns 0 when the workload asks for no GPU.
    """
    gpu = tw.gpus > 0
    demand = float((tw.popularity * tw.gpus * tw.milli).sum())
    if demand <= 0:
        return 0.0
    if cpu_demand_ratio(arrays, tw) >= 1:
        return float((tw.popularity * tw.cpu).sum()) / demand
    return float((tw.popularity[gpu] * tw.cpu[gpu]).sum()) / demand
