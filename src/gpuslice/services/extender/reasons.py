"""Why a node cannot hold a pod, as the extender's filter says it per node: the facts of
each row of the filter's window read out of the arrays once, as Python values (the reasons are
written for every node that cannot hold the pod: a thousand of 5,000 at 70% allocated, where a
numpy scalar read costs ten times a list's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuslice.core.fit import gpu_ok
from gpuslice.core.model import ClusterArrays, IntArray, SliceRequest


@dataclass(frozen=True, slots=True)
class RowFacts:
    """Per row of a filter's window (by its place ``k``), as Python values: the GPU count,
    whether the node's model is one the pod accepts, the model's name, the GPUs free enough,
    and the best GPU's index, free milli and MiB and memory."""

    count: list[int]
    allowed: list[bool]
    model: list[str]
    n_fit: list[int]
    best: list[int]
    free: list[int]
    mem_free: list[int]
    mem_cap: list[int]

    @classmethod
    def of(cls, a: ClusterArrays, g: SliceRequest, rows: IntArray) -> RowFacts:
        best = np.argmax(np.where(a.gpu_present[rows], a.gpu_free[rows], -1), axis=1)
        at = (rows, best)
        mids = a.model_id[rows].tolist()
        return cls(a.gpu_count[rows].tolist(), a.model_mask(g.models, rows).tolist(),
                   [a.models[m] if m >= 0 else "" for m in mids],
                   gpu_ok(a, g, rows).sum(axis=1).tolist(), best.tolist(),
                   a.gpu_free[at].tolist(), a.gpu_mem_free[at].tolist(),
                   a.gpu_mem_cap[at].tolist())

    def why_not(self, k: int, g: SliceRequest) -> str:
        """Why the node at ``k`` (with GPUs) cannot hold ``g`` whole-GPU."""
        if not self.allowed[k]:
            return f"node has {self.model[k]} GPUs, pod accepts {'|'.join(sorted(g.models))}"
        if g.gpus > 1:
            return f"{self.n_fit[k]} of {self.count[k]} GPUs free enough, pod needs {g.gpus}"
        j = self.best[k]
        if self.free[k] >= g.milli:
            return (f"GPU {j} has {self.mem_free[k]} MiB free, pod needs "
                    f"{g.memory_on(self.mem_cap[k])}")
        return (f"GPU {j} has {self.free[k]} milli free, pod needs {g.milli} (the most free "
                "GPU of the node)")
