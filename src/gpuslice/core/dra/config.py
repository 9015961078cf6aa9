"""The opaque ``gpuslice.io/v1alpha1`` configuration of a claim, decoded strictly
(:func:`decode_config`), and a share's consumed capacity as MPS caps (:func:`share_caps`,
:func:`share_problems`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuslice.core.dra.quantity import parse_quantity
from gpuslice.core.dra.slices import CONFIG_API_VERSION
from gpuslice.core.errors import ValidationError

# -- the opaque configuration (gpuslice.io/v1alpha1) -----------------------------------------

MAX_PROCESSES = 48  # client CUDA contexts per device under Volta+ MPS


@dataclass(frozen=True)
class MpsSettings:
    active_thread_percentage: int | None = None
    pinned_memory_mib: int | None = None
    # the CUDA processes the claim's containers run on it (vLLM's workers, torchrun): MPS
    # caps each client, so each gets 1/processes of the memory and the total stays within
    processes: int = 1

    def per_process_mib(self, mib: int) -> int:
        return max(1, mib // self.processes)


@dataclass(frozen=True)
class GpuConfig:
    """A whole GPU: exclusive (default), time-sliced between the claim's pods, or MPS with
    these defaults for its clients."""

    strategy: str = "Exclusive"  # Exclusive | TimeSlicing | MPS
    interval: str = "Default"  # time-slice: Default | Short | Medium | Long
    mps: MpsSettings = MpsSettings()


@dataclass(frozen=True)
class MigConfig:
    """A MIG device: exclusive (default) or MPS inside the instance."""

    strategy: str = "Exclusive"  # Exclusive | MPS
    mps: MpsSettings = MpsSettings()


@dataclass(frozen=True)
class MpsConfig:
    """A share: caps at most the share's consumed capacity (lower ones tighten it)."""

    mps: MpsSettings = MpsSettings()


Config = GpuConfig | MigConfig | MpsConfig
CONFIG_KINDS = ("GpuConfig", "MigConfig", "MpsConfig")
INTERVALS = ("Default", "Short", "Medium", "Long")


def _only(obj: object, where: str, allowed: Sequence[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValidationError(where, "an object", type(obj).__name__)
    for k in obj:
        if k not in allowed:
            raise ValidationError(f"{where}.{k}", f"no such field (known: "
                                  f"{', '.join(allowed)})", obj[k])
    return obj


def _mps(obj: object, where: str) -> MpsSettings:
    d = _only(obj, where, ("activeThreadPercentage", "pinnedMemoryLimit", "processes"))
    pct = d.get("activeThreadPercentage")
    if pct is not None and (isinstance(pct, bool) or not isinstance(pct, int)
                            or not 1 <= pct <= 100):
        raise ValidationError(f"{where}.activeThreadPercentage", "an integer 1..100", pct)
    mem = d.get("pinnedMemoryLimit")
    mib = None
    if mem is not None:
        q = parse_quantity(mem, f"{where}.pinnedMemoryLimit")
        if q < 2 ** 20:
            raise ValidationError(f"{where}.pinnedMemoryLimit", "at least 1Mi", mem)
        mib = int(q // 2 ** 20)
    procs = d.get("processes", 1)
    if isinstance(procs, bool) or not isinstance(procs, int) or not 1 <= procs <= MAX_PROCESSES:
        raise ValidationError(f"{where}.processes", f"an integer 1..{MAX_PROCESSES} (the CUDA "
                              "processes sharing the caps)", procs)
    return MpsSettings(pct, mib, procs)


def decode_config(params: object, where: str = "parameters") -> Config:
    """Decode one opaque ``gpuslice.io/v1alpha1`` config strictly: an unknown field, kind or
    bad value is a :class:`ValidationError` naming it."""
    d = _only(params, where, ("apiVersion", "kind", "sharing", "mps"))
    if d.get("apiVersion") != CONFIG_API_VERSION:
        raise ValidationError(f"{where}.apiVersion", CONFIG_API_VERSION, d.get("apiVersion"))
    kind = d.get("kind")
    if kind == "MpsConfig":
        _only(d, where, ("apiVersion", "kind", "mps"))
        return MpsConfig(_mps(d.get("mps") or {}, f"{where}.mps"))
    if kind not in ("GpuConfig", "MigConfig"):
        raise ValidationError(f"{where}.kind", " | ".join(CONFIG_KINDS), kind)
    _only(d, where, ("apiVersion", "kind", "sharing"))
    strategies = ("Exclusive", "TimeSlicing", "MPS") if kind == "GpuConfig" \
        else ("Exclusive", "MPS")
    sharing = _only(d.get("sharing") or {}, f"{where}.sharing",
                    ("strategy", "timeSlicing", "mps"))
    strategy = sharing.get("strategy", "Exclusive")
    if strategy not in strategies:
        raise ValidationError(f"{where}.sharing.strategy", " | ".join(strategies), strategy)
    mps = _mps(sharing.get("mps") or {}, f"{where}.sharing.mps")
    if sharing.get("mps") is not None and strategy != "MPS":
        raise ValidationError(f"{where}.sharing.mps", "only with strategy MPS", strategy)
    if kind == "MigConfig":
        if "timeSlicing" in sharing:
            raise ValidationError(f"{where}.sharing.timeSlicing", "no such field for "
                                  "MigConfig (known: strategy, mps)", sharing["timeSlicing"])
        return MigConfig(strategy, mps)
    ts = _only(sharing.get("timeSlicing") or {}, f"{where}.sharing.timeSlicing", ("interval",))
    interval = ts.get("interval", "Default")
    if interval not in INTERVALS:
        raise ValidationError(f"{where}.sharing.timeSlicing.interval", " | ".join(INTERVALS),
                              interval)
    if sharing.get("timeSlicing") is not None and strategy != "TimeSlicing":
        raise ValidationError(f"{where}.sharing.timeSlicing", "only with strategy "
                              "TimeSlicing", strategy)
    return GpuConfig(strategy, interval, mps)


def config_for(configs: Sequence[tuple[Sequence[str], Config]], request: str) -> list[Config]:
    """The configs that apply to the result of ``request`` (``main`` or ``main/sub``), in
    order (class configs first, then the claim's: later ones win)."""
    parent = request.split("/", 1)[0]
    return [c for reqs, c in configs if not reqs or request in reqs or parent in reqs]


# -- shares -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShareCaps:
    """One share's MPS caps on its GPU: SM percentage and pinned device memory (MiB)."""

    thread_pct: int
    memory_mib: int


def share_caps(consumed: Mapping[str, object], gpu_memory_mib: int,
               mps: MpsSettings = MpsSettings(), where: str = "consumedCapacity") -> ShareCaps:
    """The caps of a share from its result's ``consumedCapacity`` (``compute`` in percent,
    ``memory`` a quantity); an MpsConfig may lower them, never raise them."""
    unknown = sorted(set(consumed) - {"compute", "memory"})
    if unknown:
        raise ValidationError(f"{where}.{unknown[0]}", "compute or memory", consumed[unknown[0]])
    compute = parse_quantity(consumed.get("compute", 100), f"{where}.compute")
    memory = parse_quantity(consumed.get("memory", f"{gpu_memory_mib}Mi"), f"{where}.memory")
    pct = int(-(-compute // 1))  # ceil
    if not 1 <= pct <= 100:
        raise ValidationError(f"{where}.compute", "1..100 (percent of the GPU's SMs)",
                              consumed.get("compute"))
    mib = int(memory // 2 ** 20)
    if not 1 <= mib <= gpu_memory_mib:
        raise ValidationError(f"{where}.memory", f"1Mi..{gpu_memory_mib}Mi", consumed.get(
            "memory"))
    if mps.active_thread_percentage is not None:
        if mps.active_thread_percentage > pct:
            raise ValidationError("MpsConfig.mps.activeThreadPercentage",
                                  f"at most the share's compute ({pct})",
                                  mps.active_thread_percentage)
        pct = mps.active_thread_percentage
    if mps.pinned_memory_mib is not None:
        if mps.pinned_memory_mib > mib:
            raise ValidationError("MpsConfig.mps.pinnedMemoryLimit",
                                  f"at most the share's memory ({mib}Mi)",
                                  f"{mps.pinned_memory_mib}Mi")
        mib = mps.pinned_memory_mib
    return ShareCaps(pct, mib)


def share_problems(held: Iterable[ShareCaps], new: ShareCaps, gpu_memory_mib: int) -> list[str]:
    """Why ``new`` cannot join the shares ``held`` on one GPU (empty when it can): the
    compute percentages and the memory must each fit the GPU."""
    held = list(held)
    pct = sum(s.thread_pct for s in held) + new.thread_pct
    mib = sum(s.memory_mib for s in held) + new.memory_mib
    out = []
    if pct > 100:
        out.append(f"compute would be over-committed: {pct}% of the GPU's SMs with this share "
                   f"({new.thread_pct}%) and {len(held)} held")
    if mib > gpu_memory_mib:
        out.append(f"memory would be over-committed: {mib} MiB of {gpu_memory_mib} MiB with "
                   f"this share ({new.memory_mib} MiB) and {len(held)} held")
    return out
