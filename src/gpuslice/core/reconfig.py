"""Slice-profile schedules and the decisions of a safe reconfiguration (pure).

A :class:`SliceSchedule` names, for a set of nodes and/or GPU models, the layouts it may use
(a MIG layout in mig-parted form: ``mig-devices`` counts or exact ``mig-placements``) and when:
cron-like daily windows (``08:00-20:00``, wrapping past midnight allowed), a default, and an
on-demand ``override``. :func:`target_layout` is the layout wanted at a minute of the day.

:func:`room_for` answers whether the replicas on a GPU can be placed elsewhere (first fit
decreasing over the other GPUs' free share, with each pod's GPU-model constraint), the check the
controller runs before it touches a GPU: when there is no room it waits and says why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuslice.core import catalog
from gpuslice.core.catalog import GpuModel, MigGeometry
from gpuslice.core.errors import ValidationError
from gpuslice.core.mig import MigPlacement, check_layout, layout_for_counts, parse_layout

PHASES = ("Waiting", "Cordoned", "Moving", "Draining", "Restoring", "Applying", "RollingBack",
          "Retiring", "Done", "Failed", "Cancelled")
_TIME = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")
MAX_DRAIN_S = 86400  # spec.drainTimeoutSeconds: at most a day
MAX_READY_S = 86400  # spec.readyTimeoutSeconds: at most a day (a large model loads for minutes)
DEFAULT_READY_S = 120


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    name: str
    devices: Mapping[str, int] = field(default_factory=dict)  # mig-devices: profile -> count
    placements: tuple[str, ...] = ()  # mig-placements: "1g.10gb@0", ...

    @property
    def path(self) -> str:
        """Where the layout is in a ``SliceSchedule`` (what its errors name)."""
        kind = "mig-placements" if self.placements else "mig-devices"
        return f"spec.layouts.{self.name}.mig.{kind}"

    def for_model(self, gpu_model: str) -> tuple[MigPlacement, ...]:
        """The MIG layout on a GPU of ``gpu_model``; a :class:`ValidationError` naming the
        layout's field when such a GPU cannot hold it."""
        model = catalog.lookup(gpu_model)
        if model is None or model.mig is None:
            raise ValidationError(f"spec.layouts.{self.name}", "MIG-capable GPUs", gpu_model)
        try:
            return self.on(model.mig)
        except ValidationError as exc:
            raise ValidationError(exc.field, f"{exc.expected} (on the {model.name})",
                                  exc.got) from None

    def on(self, geometry: MigGeometry) -> tuple[MigPlacement, ...]:
        """The layout on a GPU of ``geometry`` (errors name the layout's field)."""
        where = self.path
        if self.placements:
            try:
                layout = parse_layout(geometry, ",".join(self.placements))
            except ValidationError as exc:
                what = (f"a MIG profile, {exc.expected}" if exc.field == "mig profile"
                        else exc.expected)
                raise ValidationError(where, what, exc.got) from None
            return tuple(check_layout(geometry, layout, where))
        for prof in self.devices:
            try:
                geometry.profile(prof)
            except ValidationError as exc:
                raise ValidationError(f"{where}.{prof}", f"a MIG profile, {exc.expected}",
                                      prof) from None
        try:
            return tuple(layout_for_counts(geometry, dict(self.devices)))
        except ValidationError as exc:  # "mig-devices" or "mig-devices <profile>"
            rest = exc.field.removeprefix("mig-devices").strip()
            raise ValidationError(f"{where}.{rest}" if rest else where, exc.expected,
                                  exc.got) from None

    def profile_names(self) -> tuple[str, ...]:
        """The profile names (or IDs) the layout uses."""
        if self.placements:
            return tuple(item.partition("@")[0].strip() for text in self.placements
                         for item in text.split(",") if item.strip())
        return tuple(self.devices)


def _knows(geometry: MigGeometry, key: str) -> bool:
    return any(key in (p.name, str(p.profile_id)) for p in geometry.profiles)


def check_layouts(layouts: Mapping[str, LayoutSpec], gpu_models: Sequence[str]) -> None:
    """Every layout can exist on at least one of the MIG-capable ``gpu_models`` (none: on one
    MIG-capable model of the catalogue); else a :class:`ValidationError` naming the layout's
    field (the reason given is that of a model that offers every profile the layout names,
    when there is one). The GPUs a schedule selects are checked again as they are met."""
    if gpu_models:
        found = [catalog.lookup(m) for m in gpu_models]
        models = list({m.name: m for m in found if m is not None and m.mig is not None}
                      .values())
        if not models:
            raise ValidationError("spec.selector.gpuModels", "at least one MIG-capable GPU "
                                  "model of the catalogue", list(gpu_models))
    else:
        models = [m for m in catalog.known_models() if m.mig is not None]
    for spec in layouts.values():
        errors: list[tuple[GpuModel, ValidationError]] = []
        for m in models:
            assert m.mig is not None
            try:
                spec.on(m.mig)
                break
            except ValidationError as exc:
                errors.append((m, exc))
        else:
            names = ", ".join(m.name for m in models)
            model, err = next(((m, e) for m, e in errors if m.mig is not None and all(
                _knows(m.mig, k) for k in spec.profile_names())), errors[0])
            if len(models) == 1:
                raise ValidationError(err.field, f"{err.expected} (on the {model.name})",
                                      err.got)
            raise ValidationError(err.field, f"a layout one of {names} can hold "
                                  f"(on the {model.name}: {err.expected})", err.got)


@dataclass(frozen=True, slots=True)
class Window:
    layout: str
    start_min: int
    end_min: int

    def contains(self, minute: int) -> bool:
        if self.start_min <= self.end_min:
            return self.start_min <= minute < self.end_min
        return minute >= self.start_min or minute < self.end_min  # wraps past midnight


@dataclass(frozen=True)
class SliceSchedule:
    namespace: str
    name: str
    layouts: Mapping[str, LayoutSpec]
    default: str
    windows: tuple[Window, ...] = ()
    override: str | None = None
    nodes: tuple[str, ...] = ()  # empty: every node
    gpu_models: tuple[str, ...] = ()  # empty: every MIG-capable model
    drain_timeout_s: float = 60.0
    # how long replacements and stand-ins may take to become ready (a model's load time)
    ready_timeout_s: float = float(DEFAULT_READY_S)

    def selects(self, node: str, gpu_model: str) -> bool:
        """Whether the schedule manages a GPU of ``gpu_model`` on ``node``."""
        if self.nodes and node not in self.nodes:
            return False
        if self.gpu_models:
            return _canon(gpu_model) in {_canon(m) for m in self.gpu_models}
        known = catalog.lookup(gpu_model)
        return known is not None and known.mig is not None


def _canon(model: str) -> str:
    known = catalog.lookup(model)
    return known.name if known is not None else model


def minutes_of_day(where: str, text: object) -> int:
    """``HH:MM`` as minutes since midnight; errors name ``where``."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise ValidationError(where, "a time of day HH:MM", text)
    return int(m.group(1)) * 60 + int(m.group(2))


def _strings(where: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValidationError(where, "a list of names", value)
    return tuple(value)


def parse_schedule(obj: Mapping[str, object]) -> SliceSchedule:
    """A ``SliceSchedule`` object (the CRD, or the same mapping from a file)."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    name = str(meta.get("name", ""))
    ns = str(meta.get("namespace", "default"))
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise ValidationError(f"SliceSchedule {name}: spec", "a mapping", spec)
    raw_layouts = spec.get("layouts")
    if not isinstance(raw_layouts, Mapping) or not raw_layouts:
        raise ValidationError("spec.layouts", "a mapping of layout names to MIG layouts",
                              raw_layouts)
    layouts: dict[str, LayoutSpec] = {}
    for lname, raw in raw_layouts.items():
        where = f"spec.layouts.{lname}"
        if not isinstance(raw, Mapping):
            raise ValidationError(where, "a mapping with mig-devices or mig-placements", raw)
        mig = raw.get("mig", raw)
        if not isinstance(mig, Mapping):
            raise ValidationError(f"{where}.mig", "a mapping", mig)
        devices = mig.get("mig-devices") or {}
        placements = _strings(f"{where}.mig.mig-placements", mig.get("mig-placements"))
        if not isinstance(devices, Mapping) or not (devices or placements):
            raise ValidationError(f"{where}.mig", "mig-devices counts or mig-placements", mig)
        counts: dict[str, int] = {}
        for prof, n in devices.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValidationError(f"{where}.mig.mig-devices.{prof}", "a count >= 0",
                                      _shown(n))
            counts[str(prof)] = n
        layouts[str(lname)] = LayoutSpec(str(lname), counts, placements)
    windows = []
    raw_windows = spec.get("windows") or []
    if not isinstance(raw_windows, list):
        raise ValidationError("spec.windows", "a list of {layout, start, end}", raw_windows)
    for i, w in enumerate(raw_windows):
        where = f"spec.windows[{i}]"
        if not isinstance(w, Mapping) or w.get("layout") not in layouts:
            raise ValidationError(f"{where}.layout", f"one of {sorted(layouts)}",
                                  w.get("layout") if isinstance(w, Mapping) else w)
        windows.append(Window(str(w["layout"]), minutes_of_day(f"{where}.start", w.get("start")),
                              minutes_of_day(f"{where}.end", w.get("end"))))
    default = spec.get("default", next(iter(layouts)))
    if default not in layouts:
        raise ValidationError("spec.default", f"one of {sorted(layouts)}", default)
    override = spec.get("override")
    if override is not None and override not in layouts:
        raise ValidationError("spec.override", f"one of {sorted(layouts)} or null", override)
    sel = spec.get("selector") or {}
    if not isinstance(sel, Mapping):
        raise ValidationError("spec.selector", "a mapping with nodes and/or gpuModels", sel)
    drain = _seconds(spec, "drainTimeoutSeconds", 60, MAX_DRAIN_S)
    ready = _seconds(spec, "readyTimeoutSeconds", DEFAULT_READY_S, MAX_READY_S)
    nodes = _strings("spec.selector.nodes", sel.get("nodes"))
    gpu_models = _strings("spec.selector.gpuModels", sel.get("gpuModels"))
    check_layouts(layouts, gpu_models)
    return SliceSchedule(ns, name, layouts, str(default), tuple(windows),
                         None if override is None else str(override), nodes, gpu_models,
                         drain, ready)


def _seconds(spec: Mapping[str, object], key: str, default: int, most: int) -> float:
    """``spec.<key>``: a positive number of seconds, at most ``most``; errors name the
    field."""
    value = spec.get(key, default)
    # `not 0 < x <= max` also refuses NaN; a huge int is compared, never made a float
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0 < value <= most):
        raise ValidationError(f"spec.{key}", f"a positive number of seconds, at most {most} "
                              "(a day)", _shown(value))
    return float(value)


def _shown(value: object) -> object:
    """``value`` as an error shows it: an integer too long to print is described."""
    if isinstance(value, int) and not -10**18 < value < 10**18:
        return f"an integer of {value.bit_length()} bits"
    return value


def target_layout(s: SliceSchedule, minute_of_day: int) -> str:
    """The override, else the first window containing the minute, else the default."""
    if s.override is not None:
        return s.override
    for w in s.windows:
        if w.contains(minute_of_day):
            return w.layout
    return s.default


def layout_text(layout: Sequence[MigPlacement]) -> str:
    """Canonical text of a layout (sorted by start): how it is compared and published."""
    return ",".join(str(p) for p in sorted(layout, key=lambda p: p.key))


# ---- room for the replicas of a GPU -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodNeed:
    pod: str  # namespace/name
    milli: int
    memory_mib: int
    models: frozenset[str] = frozenset()  # allowed GPU models (empty: any)


@dataclass(frozen=True, slots=True)
class GpuRoom:
    uuid: str
    node: str
    model: str
    free_milli: int
    free_memory_mib: int


def room_for(needs: Sequence[PodNeed], gpus: Sequence[GpuRoom]) -> str | None:
    """None when every pod in ``needs`` fits on ``gpus`` (first fit decreasing, best GPU
    first); else why not, naming the first pod that does not fit."""
    free = {g.uuid: [g.free_milli, g.free_memory_mib] for g in gpus}
    for n in sorted(needs, key=lambda n: (-n.milli, -n.memory_mib, n.pod)):
        fits = [g for g in gpus if (not n.models or g.model in n.models)
                and free[g.uuid][0] >= n.milli and free[g.uuid][1] >= n.memory_mib]
        if not fits:
            total = sum(v[0] for v in free.values())
            return (f"no room elsewhere for {n.pod} ({n.milli} milli, {n.memory_mib} MiB"
                    f"{', ' + '|'.join(sorted(n.models)) if n.models else ''}): the other "
                    f"open GPUs have {total} milli free in all, at most "
                    f"{max((v[0] for v in free.values()), default=0)} on one")
        g = min(fits, key=lambda g: (free[g.uuid][0] - n.milli, g.uuid))
        free[g.uuid][0] -= n.milli
        free[g.uuid][1] -= n.memory_mib
    return None
