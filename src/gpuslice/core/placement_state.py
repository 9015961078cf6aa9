"""The placement state the policies score: a cluster's arrays plus what the policies derive
from them (fragmentation against the target workload, per-node task classes), kept row by row
by its owner (simulator, extender, DRA ledger). Re-exported by :mod:`gpuslice.core.policies`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import (
    FragTables,
    TargetWorkload,
    cpu_demand_error,
    cpu_demand_ratio,
    cpu_per_milli,
    model_pressure,
    node_frag,
    shape_frag,
)
from gpuslice.core.model import ClusterArrays, FloatArray, IntArray, SliceRequest

SHARE_TAG = 0


def task_tag(req: SliceRequest) -> int:
    """GPU-clustering class of a task: 0 for a shared GPU, k for k whole GPUs, -1 CPU-only."""
    if req.gpus == 0:
        return -1
    return SHARE_TAG if req.is_sharing else req.gpus


@dataclass
class PlacementState:
    """A cluster's arrays plus what policies derive from them: fragmentation tables against
    the target workload and, per node, how many tasks of each class it holds.

    The owner (simulator, extender ledger) changes the arrays and then calls :meth:`refresh`
    for the changed node, so the derived values stay exact.
    """

    arrays: ClusterArrays
    workload: TargetWorkload | None
    tables: FragTables | None
    frag: FloatArray
    affinity: IntArray  # (N, 1 + max GPUs): [share, 1-gpu, 2-gpu, ...] task counts
    _pressure: FloatArray | None = None
    _cpu_per_milli: float | None = None
    _demand: tuple[float, float] | None = None
    _cpu_frag: FloatArray | None = None  # F_n(M) with CPU-fed GPUs (shape_frag's cpu_bound)

    @property
    def pressure(self) -> FloatArray:
        """Per model id (last entry: no GPU) the constrained demand pressure, computed once:
        the capacity per model never changes during a placement state's life."""
        if self._pressure is None:
            self._pressure = model_pressure(self.arrays, workload_of(self))
        return self._pressure

    @property
    def cpu_per_milli(self) -> float:
        """CPU the target workload needs per milli-GPU (computed once, see
        :func:`~gpuslice.core.frag.cpu_per_milli`)."""
        if self._cpu_per_milli is None:
            self._cpu_per_milli = cpu_per_milli(self.arrays, workload_of(self))
        return self._cpu_per_milli

    @property
    def demand(self) -> tuple[float, float]:
        """The target workload's CPU demand over the cluster's CPU by the time its GPUs are
        full, and the standard error of that estimate where the workload was measured
        (computed once: :func:`~gpuslice.core.frag.cpu_demand_ratio`,
        :func:`~gpuslice.core.frag.cpu_demand_error`)."""
        if self._demand is None:
            tw = workload_of(self)
            self._demand = (cpu_demand_ratio(self.arrays, tw), cpu_demand_error(self.arrays, tw))
        return self._demand

    @property
    def cpu_frag(self) -> FloatArray:
        """F_n(M) of every node counting the GPUs its CPU cannot feed (``shape_frag``'s
        ``cpu_bound``): built on first use, then kept row by row by :meth:`refresh`."""
        if self._cpu_frag is None:
            self._cpu_frag = node_frag(self.arrays, workload_of(self), tables_of(self),
                                       cpu_bound=True)
        return self._cpu_frag

    @classmethod
    def build(cls, arrays: ClusterArrays, workload: TargetWorkload | None) -> PlacementState:
        width = int(arrays.gpu_present.shape[1]) + 1
        affinity = np.zeros((arrays.n_nodes, width), dtype=np.int64)
        if workload is None:
            return cls(arrays, None, None, np.zeros(arrays.n_nodes), affinity)
        tables = FragTables.build(arrays, workload)
        return cls(arrays, workload, tables, node_frag(arrays, workload, tables), affinity)

    def refresh(self, node: int) -> None:
        if self.workload is None or self.tables is None:
            return
        self.tables.refresh(self.arrays, self.workload, node)
        self.frag[node] = self._row_frag(node, cpu_bound=False)
        if self._cpu_frag is not None:
            self._cpu_frag[node] = self._row_frag(node, cpu_bound=True)

    def _row_frag(self, node: int, *, cpu_bound: bool) -> float:
        assert self.workload is not None and self.tables is not None
        row = slice(node, node + 1)
        per = shape_frag(
            self.arrays.gpu_free[row].sum(axis=1), self.arrays.cpu_free[row],
            self.arrays.mem_free[row], self.tables.access[row], self.tables.count[row],
            self.tables.big[row], self.workload, cpu_bound=cpu_bound,
        )
        return float((per @ self.workload.popularity)[0])


def workload_of(st: PlacementState) -> TargetWorkload:
    if st.workload is None:
        raise ValidationError("placement state", "one built with a target workload", None)
    return st.workload


def tables_of(st: PlacementState) -> FragTables:
    if st.tables is None:
        raise ValidationError("placement state", "one built with a target workload", None)
    return st.tables
