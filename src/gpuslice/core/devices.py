"""What a node agent knows about its GPUs, and what it tells the cluster about them.

:class:`GpuDevice` is the NVML adapters' common answer (real, fake or null). From a list of them
:func:`node_labels` gives labels compatible with NVIDIA GPU feature discovery
(``nvidia.com/gpu.product``, ``gpu.memory``, ``gpu.count``, ``mig.capable``, ...) and
:func:`inventory` the ``gpuslice.io/inventory`` annotation the scheduler extender reads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpuslice.core import catalog


@dataclass(frozen=True, slots=True)
class MigInstance:
    uuid: str
    profile: str
    start: int
    memory_mib: int


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int
    uuid: str
    name: str  # as NVML reports it, e.g. "NVIDIA H100 80GB HBM3"
    model: str  # gpuslice's catalogue name when known, else ``name``
    memory_mib: int
    sms: int | None = None
    compute_capability: tuple[int, int] | None = None
    mig_enabled: bool = False
    mig: tuple[MigInstance, ...] = field(default=())
    healthy: bool = True


def _label_product(name: str) -> str:
    return "-".join(name.replace("NVIDIA ", "").split())


def node_labels(gpus: list[GpuDevice], driver: str = "") -> dict[str, str]:
    """GPU feature discovery compatible labels (the most common model when they differ)."""
    if not gpus:
        return {"nvidia.com/gpu.present": "false"}
    top = Counter(g.name for g in gpus).most_common(1)[0][0]
    first = next(g for g in gpus if g.name == top)
    known = catalog.lookup(first.model)
    labels = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": _label_product(top),
        "nvidia.com/gpu.count": str(len(gpus)),
        "nvidia.com/gpu.memory": str(first.memory_mib),
        "nvidia.com/mig.capable": str(bool(known and known.mig_capable)).lower(),
        "gpuslice.io/gpu-model": first.model,
    }
    if first.compute_capability:
        labels["nvidia.com/gpu.compute.major"] = str(first.compute_capability[0])
        labels["nvidia.com/gpu.compute.minor"] = str(first.compute_capability[1])
    if driver:
        major, _, rest = driver.partition(".")
        minor = rest.split(".")[0] if rest else "0"
        labels["nvidia.com/cuda.driver.major"] = major
        labels["nvidia.com/cuda.driver.minor"] = minor
    if any(g.mig_enabled for g in gpus):
        profiles = Counter(m.profile for g in gpus for m in g.mig)
        labels["nvidia.com/mig.strategy"] = "mixed" if len(profiles) > 1 else "single"
        for prof, n in profiles.items():
            labels[f"nvidia.com/mig-{prof}.count"] = str(n)
    return labels


def inventory(gpus: list[GpuDevice]) -> list[dict[str, Any]]:
    """The ``gpuslice.io/inventory`` annotation: healthy GPUs (MIG instances are listed with
    their GPU), as the extender reads them."""
    out: list[dict[str, Any]] = []
    for g in gpus:
        if not g.healthy:
            continue
        item: dict[str, Any] = {"uuid": g.uuid, "index": g.index, "model": g.model,
                                "memoryMiB": g.memory_mib}
        if g.mig_enabled:
            item["mig"] = [{"uuid": m.uuid, "profile": m.profile, "start": m.start,
                            "memoryMiB": m.memory_mib} for m in g.mig]
        out.append(item)
    return out
