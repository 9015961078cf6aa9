"""A pod's effective request: the one rule kube-scheduler, the kubelet and gpuslice share.

Kubernetes counts a pod's request of a resource (``PodRequests`` in
``k8s.io/component-helpers/resource/helpers.go``) as

    max( sum of the app containers + sum of the restartable (sidecar) init containers,
         max over the regular init containers of (its request + the sidecars started before it) )
    + pod overhead

Init containers run one at a time, before the app containers; a restartable init container
(``restartPolicy: Always``, a sidecar) keeps running from its start on, alongside every init
container declared after it and alongside the app containers. The maximum is taken per
resource. :func:`pod_requests` is that rule over any resource keys (resource names, or
``(GPU UUID, "milli")`` pairs for what one assignment holds of each GPU); every part of gpuslice
that needs a pod's request (extender, planner, simulator admission, router) goes through it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from gpuslice.core.errors import ValidationError

K = TypeVar("K", bound=Hashable)


class ContainerKind(StrEnum):
    """Where a container sits in a pod: an app container, a regular init container, or a
    restartable init container (a sidecar, ``restartPolicy: Always``)."""

    APP = "app"
    INIT = "init"
    SIDECAR = "sidecar"


@dataclass(frozen=True)
class ContainerRequest(Generic[K]):
    """One container's requests, keyed by resource; ``kind`` says how it counts."""

    name: str
    kind: ContainerKind
    requests: Mapping[K, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, value in self.requests.items():
            if value < 0:
                raise ValidationError(f"container {self.name}: {key}", "a request >= 0", value)


def _add(into: dict[K, int], more: Mapping[K, int]) -> None:
    for key, value in more.items():
        into[key] = into.get(key, 0) + value


def _max(into: dict[K, int], other: Mapping[K, int]) -> None:
    for key, value in other.items():
        if key not in into or value > into[key]:
            into[key] = value


def pod_requests(containers: Sequence[ContainerRequest[K]],
                 overhead: Mapping[K, int] | None = None) -> dict[K, int]:
    """The pod's effective request per resource (see the module docstring).

    ``containers`` are in pod order: the init containers in their declared order (kinds INIT
    and SIDECAR), and the app containers (kind APP) anywhere; the order of the app containers
    does not matter, the order of the init containers does."""
    total: dict[K, int] = {}
    for c in containers:
        if c.kind is ContainerKind.APP:
            _add(total, c.requests)
    sidecars: dict[K, int] = {}
    init_peak: dict[K, int] = {}
    for c in containers:
        if c.kind is ContainerKind.APP:
            continue
        if c.kind is ContainerKind.SIDECAR:
            _add(total, c.requests)  # runs alongside the app containers
            _add(sidecars, c.requests)
            running = dict(sidecars)  # itself and the sidecars started before it
        else:
            running = dict(c.requests)
            _add(running, sidecars)  # a regular init container runs beside earlier sidecars
        _max(init_peak, running)
    _max(total, init_peak)
    if overhead:
        _add(total, overhead)
    return total


@dataclass(frozen=True, slots=True)
class GpuWant:
    """What one container asks of gpuslice: ``gpus`` GPUs (devices of ``gpuslice.io/gpu``),
    each giving ``milli`` of its compute and ``memory_mib`` of its memory (0: its share)."""

    name: str
    kind: ContainerKind
    gpus: int
    milli: int
    memory_mib: int = 0


# the most GPUs one container may ask for: more than any node holds (8 or 16 GPUs, up to 7 MIG
# instances each), few enough that a pod's GPU slots are a small tuple
MAX_GPUS = 128


@dataclass(frozen=True, slots=True)
class PodGpuShape:
    """A pod's GPU request by the effective rule: ``gpus`` GPUs of ``milli`` and
    ``memory_mib`` each, and per container the slots (0..gpus-1) of those GPUs it uses."""

    gpus: int
    milli: int
    memory_mib: int
    slots: tuple[tuple[GpuWant, tuple[int, ...]], ...]


def gpu_shape(wants: Sequence[GpuWant], where: str = "pod") -> PodGpuShape | None:
    """The pod's GPUs from its containers' wants (pod order), or None when none asks.

    Whole GPUs (every GPU container asks 1000 milli): the count follows the effective rule,
    and containers that run at the same time get distinct GPUs (an init container reuses
    the GPUs of the app containers, as the kubelet's device manager reuses init devices).
    Shares (every GPU container asks one GPU): all containers share one GPU, whose milli and
    memory follow the effective rule and must fit one GPU."""
    gpu_wants = [w for w in wants if w.gpus > 0]
    if not gpu_wants:
        return None
    many = {w.name: w.gpus for w in gpu_wants if w.gpus > MAX_GPUS}
    if many:
        raise ValidationError(f"{where}: containers {', '.join(many)} gpuslice.io/gpu",
                              f"at most {MAX_GPUS} GPUs per container", list(many.values()))
    if all(w.milli == 1000 for w in gpu_wants):
        slots: list[tuple[GpuWant, tuple[int, ...]]] = []
        started = 0  # slots held by the sidecars started so far
        for w in gpu_wants:
            if w.kind is ContainerKind.APP:
                continue
            slots.append((w, tuple(range(started, started + w.gpus))))
            if w.kind is ContainerKind.SIDECAR:
                started += w.gpus
        nxt = started
        for w in gpu_wants:
            if w.kind is ContainerKind.APP:
                slots.append((w, tuple(range(nxt, nxt + w.gpus))))
                nxt += w.gpus
        count = pod_requests([ContainerRequest(w.name, w.kind, {"gpus": w.gpus})
                              for w in gpu_wants])["gpus"]
        order = {w.name: i for i, w in enumerate(gpu_wants)}
        slots.sort(key=lambda s: order[s[0].name])
        return PodGpuShape(count, 1000, max(w.memory_mib for w in gpu_wants), tuple(slots))
    multi = [w.name for w in gpu_wants if w.gpus != 1]
    if multi:
        raise ValidationError(f"{where}: containers {', '.join(multi)}",
                              "one GPU per container when a container of the pod asks for a "
                              "share (below 1000 milli)", [w.gpus for w in gpu_wants])
    if len({w.memory_mib == 0 for w in gpu_wants}) > 1:
        raise ValidationError(f"{where}: gpuslice.io/gpu-memory",
                              "named in every GPU container of the pod, or in none",
                              {w.name: w.memory_mib for w in gpu_wants})
    eff = pod_requests([ContainerRequest(w.name, w.kind, {"milli": w.milli,
                                                          "mib": w.memory_mib})
                        for w in gpu_wants])
    if eff["milli"] > 1000:
        raise ValidationError(f"{where}: gpuslice.io/gpu-milli",
                              "containers that share one GPU to need at most 1000 milli at "
                              "once (app containers and sidecars add up)", eff["milli"])
    return PodGpuShape(1, eff["milli"], eff["mib"], tuple((w, (0,)) for w in gpu_wants))
