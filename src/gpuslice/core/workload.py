"""Task lists as arrays, and the Monte-Carlo workload tuning of the FGD protocol.

Tuning is pure: the generator is passed in, so the same seed gives the same task order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import Shape
from gpuslice.core.model import IntArray, SliceRequest


@dataclass(frozen=True)
class Tasks:
    """Tasks as columns; ``spec_id`` indexes ``specs``, the allowed-model sets (empty: any)."""

    cpu_milli: IntArray
    memory_mib: IntArray
    num_gpu: IntArray
    gpu_milli: IntArray
    spec_id: IntArray
    specs: tuple[frozenset[str], ...]

    def __post_init__(self) -> None:
        n = len(self.cpu_milli)
        for name in ("memory_mib", "num_gpu", "gpu_milli", "spec_id"):
            if len(getattr(self, name)) != n:
                raise ValidationError(f"tasks.{name}", f"{n} values", len(getattr(self, name)))

    def __len__(self) -> int:
        return len(self.cpu_milli)

    @property
    def total_milli(self) -> IntArray:
        return np.asarray(self.num_gpu * self.gpu_milli)

    def take(self, index: IntArray) -> Tasks:
        idx = np.asarray(index, dtype=np.int64)
        return Tasks(
            self.cpu_milli[idx], self.memory_mib[idx], self.num_gpu[idx], self.gpu_milli[idx],
            self.spec_id[idx], self.specs,
        )

    def request(self, i: int) -> SliceRequest:
        return SliceRequest(
            gpus=int(self.num_gpu[i]),
            milli=int(self.gpu_milli[i]),
            cpu_milli=int(self.cpu_milli[i]),
            memory_mib=int(self.memory_mib[i]),
            models=self.specs[int(self.spec_id[i])],
        )

    def shapes(self) -> list[Shape]:
        """The FGD shape (CPU, GPU count, milli, models) of every task; memory is ignored."""
        return [
            Shape(int(c), int(k), int(g), self.specs[int(s)])
            for c, k, g, s in zip(
                self.cpu_milli.tolist(), self.num_gpu.tolist(), self.gpu_milli.tolist(),
                self.spec_id.tolist(), strict=True,
            )
        ]


def tune(tasks: Tasks, capacity_milli: int, ratio: float, rng: np.random.Generator) -> Tasks:
    """Shuffle ``tasks`` and resize them to ``ratio`` x ``capacity_milli`` of GPU demand.

    Short of the target, tasks drawn uniformly with replacement are appended until the first
    draw that would pass it; over the target, random tasks are dropped until the demand fits
    (FGD's ``-tune``). As in the FGD simulator, the stop test adds the draw's milli *per GPU*
    (so a multi-GPU draw may overshoot by up to its other GPUs, and CPU-only draws never stop
    it). The order of the result is the arrival order.
    """
    if ratio <= 0:
        raise ValidationError("tune", "a positive ratio of GPU capacity", ratio)
    if len(tasks) == 0:
        raise ValidationError("tasks", "at least one task", 0)
    if int(tasks.total_milli.sum()) == 0:
        raise ValidationError("tasks", "at least one task that asks for a GPU", 0)
    order = rng.permutation(len(tasks))
    demand = tasks.total_milli
    target = ratio * capacity_milli
    total = int(demand.sum())
    if total < target:
        extra: list[int] = []
        while True:
            pick = int(rng.integers(len(tasks)))
            if total + int(tasks.gpu_milli[pick]) > target:
                break
            total += int(demand[pick])
            extra.append(pick)
        order = np.concatenate([order, np.array(extra, dtype=np.int64)])
    elif total > target:
        keep = np.ones(len(order), dtype=np.bool_)
        while total > target:
            drop = int(rng.integers(len(order)))
            if not keep[drop]:
                continue
            keep[drop] = False
            total -= int(demand[order[drop]])
        order = order[keep]
    return tasks.take(order)
