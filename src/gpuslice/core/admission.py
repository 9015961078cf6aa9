"""What the admission webhook does to a pod: the policy, pure (the webhook's shell reads the
AdmissionReview and writes the JSON patch; docs/webhook.md is the user's account).

A pod the webhook sees (it opted in: its namespace's label or its own) is one of:

- a pod that asks for no GPU: let through untouched;
- a pod that asks for gpuslice's resources (``gpuslice.io/gpu``, ``gpu-milli``,
  ``gpu-memory``), or a plain GPU request translated into them: ``nvidia.com/gpu: N`` is N
  GPUs, whole unless the pod's annotation ``gpuslice.io/gpu-milli`` (or HAMi's
  ``nvidia.com/gpucores`` resource, in percent) gives a share, with the memory of
  ``gpuslice.io/gpu-memory`` (annotation) or HAMi's ``nvidia.com/gpumem`` (MiB).

For a GPU pod the webhook sets ``schedulerName`` (when it is the default scheduler's), writes
every GPU container's three resources as requests and limits (so that a ResourceQuota on
``requests.gpuslice.io/gpu-milli`` and ``gpu-memory`` counts what the pod gets, and
``kubectl describe`` shows it), and refuses what no GPU could ever take, naming the field:
a share of more than one GPU that is not whole GPUs, memory over the largest GPU's, a MIG
profile no GPU model has, a GPU selection that excludes all it includes. A model no node has
yet is a warning (a node may join). The memory a pod leaves implicit (milli/1000 of its GPU's)
is made explicit from the smallest GPU the pod may land on, so that it fits on every one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError
from gpuslice.core.gpuselect import GpuSelection, contradictions
from gpuslice.core.podrequest import ContainerKind, GpuWant, gpu_shape

GPU = "gpuslice.io/gpu"
GPU_MILLI = "gpuslice.io/gpu-milli"
GPU_MEMORY = "gpuslice.io/gpu-memory"
NVIDIA_GPU = "nvidia.com/gpu"
HAMI_CORES = "nvidia.com/gpucores"  # percent of the GPU's compute
HAMI_MEMORY = "nvidia.com/gpumem"  # MiB
HAMI_MEMORY_PERCENT = "nvidia.com/gpumem-percentage"
# the pod annotations that give a plain nvidia.com/gpu request its share
MILLI_ANNOTATION = GPU_MILLI
MEMORY_ANNOTATION = GPU_MEMORY
MIG_PROFILE_ANNOTATION = "gpuslice.io/mig-profile"
ISOLATION_ANNOTATION = "gpuslice.io/isolation"
# what the webhook changed, on the pod (kubectl describe shows it)
CHANGES_ANNOTATION = "gpuslice.io/webhook-changes"
DEFAULT_SCHEDULER = "default-scheduler"
MILLI = 1000


@dataclass(frozen=True, slots=True)
class ContainerAsk:
    """One container's GPU resources as written (None: not named); ``path`` is its place in
    the pod (``spec.containers[0]``), which refusals name."""

    path: str
    name: str
    kind: ContainerKind
    gpus: int | None = None
    milli: int | None = None
    memory_mib: int | None = None
    nvidia_gpus: int | None = None
    hami_cores: int | None = None
    hami_memory_mib: int | None = None
    hami_memory_percent: int | None = None

    @property
    def gpuslice(self) -> bool:
        return self.gpus is not None or self.milli is not None or self.memory_mib is not None

    @property
    def plain(self) -> bool:
        return self.nvidia_gpus is not None or self.hami_cores is not None or \
            self.hami_memory_mib is not None or self.hami_memory_percent is not None


@dataclass(frozen=True, slots=True)
class PodAsk:
    """What the policy reads of a pod: where it is, its scheduler, its containers' GPU
    resources (pod order: init containers, then app containers) and its annotations."""

    where: str  # "pod ml/server-abc12" (refusals start with it)
    scheduler_name: str
    containers: tuple[ContainerAsk, ...]
    annotations: Mapping[str, str] = field(default_factory=dict)
    selection: GpuSelection = field(default_factory=GpuSelection)
    milli_annotation: int | None = None
    memory_annotation: int | None = None


@dataclass(frozen=True, slots=True)
class FleetModel:
    """A GPU model the cluster's nodes have: its memory (the smallest GPU of it), how many
    GPUs, and their UUIDs (MIG instances' too)."""

    name: str
    memory_mib: int
    gpus: int
    uuids: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Fleet:
    """The GPUs of the cluster, by model (empty: no node agent has published yet)."""

    models: tuple[FleetModel, ...] = ()

    def allowed(self, sel: GpuSelection) -> tuple[FleetModel, ...]:
        out = []
        for m in self.models:
            if not sel.allows_model(m.name):
                continue
            if (sel.uuids or sel.exclude_uuids) and not any(sel.allows_uuid(u)
                                                            for u in m.uuids):
                continue
            out.append(m)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Options:
    scheduler_name: str = "gpuslice-scheduler"
    # translate nvidia.com/gpu (and HAMi's gpucores/gpumem) into gpuslice's resources
    translate_plain: bool = True


@dataclass(frozen=True, slots=True)
class ContainerChange:
    """The container's GPU resources to write (requests and limits alike) and the plain ones
    to take out."""

    path: str
    resources: Mapping[str, int]
    remove: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    """Allowed (with the changes to make and the warnings for the client) or refused, with a
    message that names the field."""

    allowed: bool
    refusal: str = ""
    scheduler_name: str | None = None
    containers: tuple[ContainerChange, ...] = ()
    warnings: tuple[str, ...] = ()
    changes: tuple[str, ...] = ()  # in words, for the pod's CHANGES_ANNOTATION

    @property
    def changed(self) -> bool:
        return bool(self.scheduler_name or self.containers)


def refuse(message: str) -> Decision:
    return Decision(False, message)


@dataclass(frozen=True, slots=True)
class _Want:
    """A container's GPU ask after translation: what the policy judges and writes."""

    ask: ContainerAsk
    gpus: int
    milli: int
    memory_mib: int | None
    remove: tuple[str, ...]


def _translate(c: ContainerAsk, pod: PodAsk, opts: Options) -> _Want | None:
    """The container's ask in gpuslice's resources (None: it asks for no GPU)."""
    at = f"{pod.where}: {c.path}.resources"
    if c.gpuslice and c.plain:
        plain = [n for n, v in ((NVIDIA_GPU, c.nvidia_gpus), (HAMI_CORES, c.hami_cores),
                                (HAMI_MEMORY, c.hami_memory_mib),
                                (HAMI_MEMORY_PERCENT, c.hami_memory_percent)) if v is not None]
        raise ValidationError(f"{at} {', '.join(plain)}", "gpuslice.io/ resources or "
                              "nvidia.com/ ones in one container, not both", "both")
    if c.gpuslice:
        return _Want(c, 1 if c.gpus is None else c.gpus,
                     MILLI if c.milli is None else c.milli, c.memory_mib, ())
    if not c.plain or not opts.translate_plain:
        return None
    if c.hami_memory_percent is not None:
        raise ValidationError(f"{at} {HAMI_MEMORY_PERCENT}", "MiB instead: nvidia.com/gpumem "
                              "or the annotation gpuslice.io/gpu-memory (a percentage of "
                              "memory is not translated)", c.hami_memory_percent)
    if c.nvidia_gpus is None:
        raise ValidationError(f"{at} {NVIDIA_GPU}", "a GPU count beside nvidia.com/gpucores "
                              "or nvidia.com/gpumem", None)
    milli = pod.milli_annotation
    if c.hami_cores is not None:
        if not 1 <= c.hami_cores <= 100:
            raise ValidationError(f"{at} {HAMI_CORES}", "a percentage 1..100", c.hami_cores)
        milli = c.hami_cores * 10
    memory = c.hami_memory_mib if c.hami_memory_mib is not None else pod.memory_annotation
    removed = tuple(n for n, v in ((NVIDIA_GPU, c.nvidia_gpus), (HAMI_CORES, c.hami_cores),
                                   (HAMI_MEMORY, c.hami_memory_mib)) if v is not None)
    return _Want(c, c.nvidia_gpus, MILLI if milli is None else milli, memory, removed)


def _check_want(w: _Want, pod: PodAsk) -> None:
    at = f"{pod.where}: {w.ask.path}.resources"
    if w.gpus < 1:
        raise ValidationError(f"{at} {GPU}", "at least 1 GPU", w.gpus)
    if w.milli > MILLI:
        raise ValidationError(f"{at} {GPU_MILLI}", "at most 1000 per GPU (a share of one GPU); "
                              "more than one GPU is gpuslice.io/gpu: N with whole GPUs (1000)",
                              w.milli)
    if w.milli < 1:
        raise ValidationError(f"{at} {GPU_MILLI}", "1..1000 milli-GPU", w.milli)
    if w.gpus > 1 and w.milli != MILLI:
        raise ValidationError(f"{at} {GPU_MILLI}", f"1000 (whole GPUs) with {w.gpus} GPUs: a "
                              "share is of one GPU", w.milli)
    if w.memory_mib is not None and w.memory_mib < 0:
        raise ValidationError(f"{at} {GPU_MEMORY}", "MiB >= 0", w.memory_mib)


def _mig_problem(pod: PodAsk, fleet: Fleet, candidates: Sequence[FleetModel]) -> str | None:
    profile = pod.annotations.get(MIG_PROFILE_ANNOTATION)
    if profile is None:
        return None
    names = [m.name for m in candidates] or [m.name for m in fleet.models] or \
        [m.name for m in catalog.known_models()]
    for name in names:
        model = catalog.lookup(name)
        if model is not None and model.mig is not None and any(
                p.name == profile for p in model.mig.profiles):
            return None
    return (f"{pod.where}: annotation {MIG_PROFILE_ANNOTATION}: expected a MIG profile of a "
            f"GPU model the pod may use ({', '.join(sorted(set(names)))}), got {profile!r}")


def _mig_memory(milli: int, candidates: Sequence[FleetModel]) -> tuple[int | None, str]:
    """A MIG-isolated pod's memory: the whole instance it gets, the smallest profile with the
    compute slices its milli stands for (the extender's rule: round(milli * 7 / 1000), at
    least 1) on the MIG-capable models it may use; None when none says."""
    slices = max(1, round(milli * 7 / MILLI))
    best: tuple[int, str] | None = None
    for m in candidates:
        model = catalog.lookup(m.name)
        if model is None or model.mig is None:
            continue
        fits = [p for p in model.mig.profiles if p.compute_slices >= slices]
        if fits:
            p = min(fits, key=lambda p: p.memory_mib)
            if best is None or p.memory_mib < best[0]:
                best = (p.memory_mib, f"the MIG instance {p.name} of {m.name}")
    return (None, "") if best is None else best


def _explicit_memory(w: _Want, pod: PodAsk, fleet: Fleet, candidates: Sequence[FleetModel],
                     basis: tuple[int, int, str] | None) -> tuple[int | None, str]:
    """The container's GPU memory as the webhook writes it, and what to say about it: the
    change made (memory set here) or why it stays implicit (a warning); ("" when named)."""
    if w.memory_mib is not None:
        return w.memory_mib, ""
    mig_isolated = pod.annotations.get(ISOLATION_ANNOTATION) == "mig"
    sized_for_mig = bool(pod.annotations.get(MIG_PROFILE_ANNOTATION))
    if mig_isolated:
        memory, said = _mig_memory(w.milli, candidates)
        if memory is not None:
            return memory, f"{w.ask.name}: {GPU_MEMORY}={memory} ({said})"
    elif basis is not None and not sized_for_mig:
        memory = w.milli * basis[0] // MILLI
        return memory, (f"{w.ask.name}: {GPU_MEMORY}={memory} ({w.milli}/1000 of "
                        f"{basis[2]}'s {basis[0]} MiB)")
    why = "a share of a MIG instance" if mig_isolated or sized_for_mig else \
        "no GPU of the cluster matches the pod's selection" if fleet.models else \
        "no node has published its GPUs yet"
    return None, (f"{pod.where}: {w.ask.path}: {GPU_MEMORY} not made explicit ({why}): the "
                  f"node gives the container its share of the GPU's memory, which a "
                  f"ResourceQuota on requests.{GPU_MEMORY} does not count")


def _memory_basis(pod: PodAsk, fleet: Fleet, candidates: Sequence[FleetModel],
                  ) -> tuple[int, int, str] | None:
    """The smallest and the largest GPU memory the pod may land on, and the smallest one's
    model: from the fleet's models it allows, else (no node has published) from the
    catalogue's models the pod names; None when neither says."""
    if candidates:
        small = min(candidates, key=lambda m: m.memory_mib)
        return small.memory_mib, max(m.memory_mib for m in candidates), small.name
    if fleet.models:
        return None
    named = [m for name in pod.selection.models if (m := catalog.lookup(name)) is not None]
    if not named:
        return None
    small_model = min(named, key=lambda m: m.memory_mib)
    return small_model.memory_mib, max(m.memory_mib for m in named), small_model.name


def _selection_warnings(pod: PodAsk, fleet: Fleet,
                        candidates: Sequence[FleetModel]) -> list[str]:
    if not fleet.models or candidates:
        return []
    sel = pod.selection
    if sel.empty:
        return []
    have = ", ".join(f"{m.name} ({m.gpus})" for m in fleet.models)
    return [f"{pod.where}: no GPU of the cluster matches the pod's GPU selection now (the "
            f"nodes have {have}); it waits for a node that has one"]


def admit(pod: PodAsk, fleet: Fleet, opts: Options = Options()) -> Decision:
    """The webhook's decision for ``pod`` (see the module docstring)."""
    try:
        wants = [w for c in pod.containers if (w := _translate(c, pod, opts)) is not None]
        for w in wants:
            _check_want(w, pod)
    except ValidationError as exc:
        return refuse(str(exc))
    if not wants:
        return Decision(True)
    problems = contradictions(pod.selection, pod.where)
    if problems:
        return refuse(problems[0])
    scheduler: str | None = None
    if pod.scheduler_name in ("", DEFAULT_SCHEDULER):
        scheduler = opts.scheduler_name
    elif pod.scheduler_name != opts.scheduler_name:
        return refuse(f"{pod.where}: spec.schedulerName: expected {opts.scheduler_name!r} (or "
                      f"unset) for a pod that asks for a gpuslice GPU share, got "
                      f"{pod.scheduler_name!r}: only gpuslice's scheduler gives it its share")
    candidates = fleet.allowed(pod.selection)
    mig = _mig_problem(pod, fleet, candidates)
    if mig is not None:
        return refuse(mig)
    warnings = _selection_warnings(pod, fleet, candidates)
    basis = _memory_basis(pod, fleet, candidates)
    changes: list[str] = []
    if scheduler is not None:
        changes.append(f"schedulerName={scheduler}")
    out: list[ContainerChange] = []
    done: list[_Want] = []
    for w in wants:
        if basis is not None and w.memory_mib is not None and w.memory_mib > basis[1]:
            return refuse(f"{pod.where}: {w.ask.path}.resources {GPU_MEMORY}: expected at "
                          f"most {basis[1]} MiB (the largest GPU the pod may use), got "
                          f"{w.memory_mib}")
        memory, said = _explicit_memory(w, pod, fleet, candidates, basis)
        if said and memory is not None:
            changes.append(said)
        elif said:
            warnings.append(said)
        done.append(replace(w, memory_mib=memory))
        res = {GPU: w.gpus, GPU_MILLI: w.milli}
        if memory is not None:
            res[GPU_MEMORY] = memory
        if w.remove:
            changes.append(f"{w.ask.name}: {', '.join(w.remove)} -> gpuslice.io/gpu="
                           f"{w.gpus}, gpu-milli={w.milli}")
        if _differs(w.ask, res) or w.remove:
            out.append(ContainerChange(w.ask.path, res, w.remove))
    try:  # the pod as the extender will read it: the effective-request rule
        gpu_shape([GpuWant(w.ask.name, w.ask.kind, w.gpus, w.milli, w.memory_mib or 0)
                   for w in done], pod.where)
    except ValidationError as exc:
        return refuse(str(exc))
    return Decision(True, scheduler_name=scheduler, containers=tuple(out),
                    warnings=tuple(warnings), changes=tuple(changes))


def _differs(c: ContainerAsk, res: Mapping[str, int]) -> bool:
    written = {GPU: c.gpus, GPU_MILLI: c.milli, GPU_MEMORY: c.memory_mib}
    return any(written.get(k) != v for k, v in res.items())


def fleet_of(gpus: Sequence[tuple[str, int, Sequence[str]]]) -> Fleet:
    """A :class:`Fleet` from (model, memory MiB, UUIDs of the GPU and its MIG instances) per
    GPU."""
    by: dict[str, tuple[int, int, set[str]]] = {}
    for model, memory, uuids in gpus:
        mem, count, ids = by.get(model, (memory, 0, set()))
        by[model] = (min(mem, memory), count + 1, ids | set(uuids))
    return Fleet(tuple(FleetModel(m, mem, n, frozenset(ids))
                       for m, (mem, n, ids) in sorted(by.items())))
