"""The target workload a scheduler learns from the pods it sees (one estimator for every path).

The simulator knows its target workload in advance (the trace's typical shapes); a scheduler on
a cluster does not. The extender (device-plugin path), the DRA claim allocator and the
simulator's model of the deployed path all learn it the same way, here: the shapes (CPU, GPUs,
milli per GPU, models) of the live pods, plus one whole-GPU pod with their median CPU (a prior:
a GPU left whole is worth keeping before any whole-GPU pod has been seen); then FGD's typical
shapes (95% coverage, one shape at a time). A larger prior (a fifth of the GPU pods seen, as
the DRA allocator once had) cost 0.6 points of unallocated GPU on the embedded trace mix,
whose whole-GPU pods speak for themselves (``sim.deployed``, 16 nodes, seeds 42-51).

:class:`WorkloadEstimator` keeps the counts incrementally and says when the estimate has moved
enough to be worth rebuilding the fragmentation tables for (a new shape among the typical ones,
or the popularities drifting by more than ``drift`` in total): a scheduler then rebuilds its
placement state a few dozen times over a trace instead of once per pod.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np

from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import Shape, TargetWorkload, typical_of_counts

PRIOR_PODS = 1  # whole-GPU pods assumed before any is seen
COVERAGE_PCT = 95.0


def learned_workload(shapes: Mapping[Shape, int] | Iterable[Shape]) -> TargetWorkload:
    """The target workload learned from the live pods' shapes (a list, or shape -> count)."""
    counts = Counter(shapes) if not isinstance(shapes, Mapping) else Counter(dict(shapes))
    gpu = sorted((s.cpu_milli, c) for s, c in counts.items() if s.gpus and c > 0)
    n_gpu = sum(c for _, c in gpu)
    cpu = 0
    if n_gpu:  # the median CPU of the GPU pods seen
        half, seen = n_gpu // 2, 0
        for value, c in gpu:
            seen += c
            if seen > half:
                cpu = value
                break
    counts[Shape(cpu, 1, 1000)] += PRIOR_PODS
    return typical_of_counts(counts, coverage_pct=COVERAGE_PCT, step=1,
                             observed=sum(counts.values()))


class WorkloadEstimator:
    """Live pods' shapes, counted as pods come and go, and the target workload learned from
    them (:func:`learned_workload`), re-estimated when it may have moved.

    ``drift`` is the total popularity change (L1) past which :meth:`current` reports a new
    workload; ``every`` the share of changes to the pod count (at least one pod) between two
    re-estimates. Pure: the caller feeds pods in and decides what to rebuild.
    """

    def __init__(self, *, drift: float = 0.02, every: float = 0.02) -> None:
        if not 0 <= drift <= 2:
            raise ValidationError("workload drift", "a number in [0, 2]", drift)
        if not 0 <= every < 1:
            raise ValidationError("workload re-estimate share", "a number in [0, 1)", every)
        self.drift, self.every = drift, every
        self._counts: Counter[Shape] = Counter()
        self._pods = 0
        self._changes = 0  # pods added or removed since the last estimate
        self._workload: TargetWorkload | None = None
        self._version = 0

    @property
    def pods(self) -> int:
        return self._pods

    @property
    def version(self) -> int:
        """Increases each time :meth:`current` adopts a new workload."""
        return self._version

    def add(self, shape: Shape) -> None:
        self._counts[shape] += 1
        self._pods += 1
        self._changes += 1

    def remove(self, shape: Shape) -> None:
        if self._counts.get(shape, 0) <= 0:
            return
        self._counts[shape] -= 1
        if not self._counts[shape]:
            del self._counts[shape]
        self._pods -= 1
        self._changes += 1

    def clear(self) -> None:
        self._counts.clear()
        self._pods = 0
        self._changes += 1

    def estimate(self) -> TargetWorkload:
        """The workload learned from the pods counted now (no hysteresis)."""
        return learned_workload(self._counts)

    def current(self) -> TargetWorkload:
        """The workload to score with: the last one adopted, replaced by a fresh estimate when
        enough pods changed and the estimate moved past ``drift`` (or its shapes changed)."""
        if self._workload is not None and \
                self._changes < max(1.0, self.every * max(self._pods, 1)):
            return self._workload
        self._changes = 0
        fresh = self.estimate()
        if self._workload is None or _moved(self._workload, fresh, self.drift):
            self._workload = fresh
            self._version += 1
        return self._workload


def _moved(old: TargetWorkload, new: TargetWorkload, drift: float) -> bool:
    if old.shapes != new.shapes:
        return True
    return float(np.abs(old.popularity - new.popularity).sum()) > drift
