"""Slices on the GPUs of one machine (local mode, ``gpuslice up`` and ``gpuslice select``).

:func:`place_local` gives each replica a GPU (or MIG instance), an MPS compute share and a
memory cap. Replicas that state their share are packed best-fit, largest first; replicas that do
not are spread over the GPUs with the most compute left, then share what is left of their GPU
equally. :func:`select_gpu` answers "which GPU has room for this?" from NVML's measured memory
use and utilisation, counting the slices local mode has already handed out (a running replica's
cap is reserved even when it does not use it yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuslice.core.errors import GpusliceError, ValidationError


class NoRoom(GpusliceError):
    """No GPU has room; the message gives each GPU's reason."""


@dataclass(frozen=True, slots=True)
class LocalGpu:
    uuid: str  # GPU or MIG instance UUID: the value for CUDA_VISIBLE_DEVICES
    index: int
    model: str
    memory_mib: int
    used_mib: int = 0  # measured (NVML)
    utilization_pct: int = 0  # measured (NVML)


@dataclass(frozen=True, slots=True)
class SliceWant:
    replica: str
    service: str
    compute_pct: int | None = None  # MPS active thread percentage; None: a fair share
    memory_mib: int | None = None  # pinned memory limit; None: a fair share
    gpu: str | None = None  # pin to this GPU UUID or index


@dataclass(frozen=True, slots=True)
class LocalSlice:
    replica: str
    service: str
    gpu_uuid: str
    gpu_index: int
    compute_pct: int
    memory_mib: int


def _check(w: SliceWant) -> None:
    if w.compute_pct is not None and not 1 <= w.compute_pct <= 100:
        raise ValidationError(f"services[{w.service}].compute", "a percentage from 1 to 100",
                              w.compute_pct)
    if w.memory_mib is not None and w.memory_mib < 1:
        raise ValidationError(f"services[{w.service}].memory", "a positive amount of memory",
                              w.memory_mib)


def _matches(g: LocalGpu, pin: str | None) -> bool:
    return pin is None or pin in (g.uuid, str(g.index))


def place_local(gpus: Sequence[LocalGpu], wants: Sequence[SliceWant]) -> list[LocalSlice]:
    """A slice per replica (in the order of ``wants``), or :class:`NoRoom` naming the replica
    that does not fit and why."""
    if not gpus:
        raise NoRoom("no GPU on this machine to place slices on")
    for w in wants:
        _check(w)
        if w.gpu is not None and not any(_matches(g, w.gpu) for g in gpus):
            raise ValidationError(f"services[{w.service}].gpu",
                                  f"one of {[g.uuid for g in gpus]} or an index", w.gpu)
    compute = {g.uuid: 100 for g in gpus}
    memory = {g.uuid: g.memory_mib for g in gpus}
    chosen: dict[str, LocalGpu] = {}
    sized = sorted((w for w in wants if w.compute_pct is not None),
                   key=lambda w: (-(w.compute_pct or 0), -(w.memory_mib or 0), w.replica))
    for w in sized:
        pct = w.compute_pct or 0
        mem = w.memory_mib or 0
        fits = [g for g in gpus if _matches(g, w.gpu) and compute[g.uuid] >= pct
                and memory[g.uuid] >= mem]
        if not fits:
            raise NoRoom(f"replica {w.replica} ({pct}% compute, {mem} MiB) fits no GPU: " +
                         "; ".join(f"GPU {g.index} has {compute[g.uuid]}% and "
                                   f"{memory[g.uuid]} MiB left" for g in gpus))
        g = min(fits, key=lambda g: (compute[g.uuid] - pct, g.index))  # best fit
        compute[g.uuid] -= pct
        memory[g.uuid] -= mem
        chosen[w.replica] = g
    fair = [w for w in wants if w.compute_pct is None]
    count = {g.uuid: 0 for g in gpus}
    for w in fair:
        fits = [g for g in gpus if _matches(g, w.gpu)]
        g = max(fits, key=lambda g: (compute[g.uuid] / (count[g.uuid] + 1), -g.index))
        count[g.uuid] += 1
        chosen[w.replica] = g
    # memory: capped replicas take their cap; the others share what is left of their GPU
    mem_left = {g.uuid: g.memory_mib for g in gpus}
    uncapped = {g.uuid: 0 for g in gpus}
    for w in wants:
        g = chosen[w.replica]
        if w.memory_mib is not None:
            mem_left[g.uuid] -= w.memory_mib
        else:
            uncapped[g.uuid] += 1
    for g in gpus:
        if mem_left[g.uuid] < 0:
            raise NoRoom(f"the memory caps of the replicas on GPU {g.index} add up to more "
                         f"than its {g.memory_mib} MiB")
    out = []
    for w in wants:
        g = chosen[w.replica]
        pct = w.compute_pct if w.compute_pct is not None else compute[g.uuid] // count[g.uuid]
        mem = w.memory_mib if w.memory_mib is not None else mem_left[g.uuid] // uncapped[g.uuid]
        if pct < 1 or mem < 1:
            raise NoRoom(f"replica {w.replica}: nothing left on GPU {g.index} after the sized "
                         f"replicas ({compute[g.uuid]}% compute, {mem_left[g.uuid]} MiB)")
        out.append(LocalSlice(w.replica, w.service, g.uuid, g.index, pct, mem))
    return out


def select_gpu(gpus: Sequence[LocalGpu], held: Sequence[LocalSlice], memory_mib: int,
               compute_pct: int) -> LocalGpu:
    """The GPU with room for ``memory_mib`` and ``compute_pct`` that keeps the most headroom
    (the larger of its smaller free fraction, compute or memory; ties: lower index);
    :class:`NoRoom` with every GPU's reason otherwise.

    Free memory is the GPU's memory less the larger of what NVML measures in use and the caps
    local mode has handed out on it; free compute is 100 less the larger of the measured
    utilisation and the shares handed out."""
    if memory_mib < 0:
        raise ValidationError("--memory", "an amount of memory >= 0", memory_mib)
    if not 0 <= compute_pct <= 100:
        raise ValidationError("--compute", "a percentage from 0 to 100", compute_pct)
    if not gpus:
        raise NoRoom("no GPU on this machine")
    reasons = []
    best: tuple[tuple[float, int], LocalGpu] | None = None
    for g in gpus:
        mine = [s for s in held if s.gpu_uuid == g.uuid]
        free_mem = g.memory_mib - max(g.used_mib, sum(s.memory_mib for s in mine))
        free_pct = 100 - max(g.utilization_pct, sum(s.compute_pct for s in mine))
        if free_mem < memory_mib or free_pct < compute_pct:
            reasons.append(f"GPU {g.index} ({g.model}) has {free_mem} MiB and {free_pct}% "
                           f"free")
            continue
        key = (min(free_pct / 100, free_mem / max(1, g.memory_mib)), -g.index)
        if best is None or key > best[0]:
            best = (key, g)
    if best is None:
        raise NoRoom(f"no GPU has {memory_mib} MiB and {compute_pct}% free: " +
                     "; ".join(reasons))
    return best[1]


_UNITS = {"": 1, "M": 1, "MI": 1, "MIB": 1, "MB": 1, "G": 1024, "GI": 1024, "GIB": 1024,
          "GB": 1024, "T": 1024 * 1024, "TI": 1024 * 1024, "TIB": 1024 * 1024,
          "TB": 1024 * 1024}


def parse_memory(field: str, value: object) -> int:
    """MiB from ``8192``, ``"8192M"``, ``"8G"``, ``"8Gi"`` or ``"8GiB"`` (G means GiB here, as
    nvidia-smi and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT use it)."""
    if isinstance(value, bool):
        raise ValidationError(field, "an amount of GPU memory such as 8G or 8192M", value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    text = str(value).strip().upper()
    num = text.rstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(num):].strip()
    try:
        n = float(num)
    except ValueError:
        raise ValidationError(field, "an amount of GPU memory such as 8G or 8192M",
                              value) from None
    if unit not in _UNITS or n <= 0:
        raise ValidationError(field, "an amount of GPU memory such as 8G or 8192M", value)
    return int(n * _UNITS[unit])


def parse_percent(field: str, value: object) -> int:
    """1..100 from ``30`` or ``"30%"``."""
    text = str(value).strip().removesuffix("%")
    try:
        n = float(text)
    except ValueError:
        raise ValidationError(field, "a percentage from 1 to 100", value) from None
    if isinstance(value, bool) or not 1 <= n <= 100 or not n.is_integer():
        raise ValidationError(field, "a whole percentage from 1 to 100", value)
    return int(n)
