"""Local mode's services file (``gpuslice up services.yaml``, described in
:mod:`gpuslice.services.local`): read and checked, every error naming the file and the field."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice.adapters.yamlfile import read_yaml
from gpuslice.core.errors import ValidationError
from gpuslice.core.local import (
    SliceWant,
    parse_memory,
    parse_percent,
)
from gpuslice.core.model import PRIORITIES
from gpuslice.core.reconfig import Window, minutes_of_day


@dataclass(frozen=True)
class LocalService:
    name: str
    command: tuple[str, ...]
    replicas: int = 1
    model: str = ""
    slo_ms: float | None = None
    compute_pct: int | None = None
    memory_mib: int | None = None
    gpu: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    priority: str = "normal"  # best-effort: below-normal MPS client priority


@dataclass(frozen=True)
class LocalConfig:
    services: tuple[LocalService, ...]
    health_path: str = "/v2/health/ready"
    ready_timeout_s: float = 180.0
    # local mode's slice profiles: layout -> service -> (compute %, memory MiB), with windows
    layouts: Mapping[str, Mapping[str, tuple[int | None, int | None]]] = field(
        default_factory=dict)
    windows: tuple[Window, ...] = ()
    default_layout: str | None = None

    def wants(self, layout: str | None) -> list[SliceWant]:
        """A slice request per replica, with ``layout``'s caps where it sets them."""
        over = self.layouts.get(layout or "", {})
        out: list[SliceWant] = []
        for s in self.services:
            pct, mem = over.get(s.name, (None, None))
            out.extend(SliceWant(f"{s.name}-{i}", s.name,
                                 pct if pct is not None else s.compute_pct,
                                 mem if mem is not None else s.memory_mib, s.gpu)
                       for i in range(s.replicas))
        return out

    def layout_at(self, minute_of_day: int, override: str | None) -> str | None:
        if not self.layouts:
            return None
        if override is not None:
            return override
        for w in self.windows:
            if w.contains(minute_of_day):
                return w.layout
        return self.default_layout


def read_local_services(path: Path) -> LocalConfig:
    """The services file (YAML or JSON); every error names the file and the field."""
    if not path.exists():
        raise ValidationError("services file", "an existing file", str(path))
    # the reader of every YAML input: its problem in one line, with line and column
    doc = read_yaml(path, str(path), "valid YAML")
    items = doc.get("services") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise ValidationError(f"{path}: services", "a non-empty list of services", items)
    out = []
    for i, raw in enumerate(items):
        where = f"{path}: services[{i}]"
        if not isinstance(raw, dict):
            raise ValidationError(where, "a mapping with name and command", raw)
        name = raw.get("name", raw.get("model"))
        if not isinstance(name, str) or not name or "/" in name:
            raise ValidationError(f"{where}.name", "a service name without '/'", name)
        where = f"{path}: services[{name}]"
        cmd = raw.get("command")
        if isinstance(cmd, str):
            try:
                cmd = shlex.split(cmd)
            except ValueError as exc:  # an unbalanced quote
                raise ValidationError(f"{where}.command", "a command line with balanced quotes "
                                      f"({exc})", cmd) from None
        if not isinstance(cmd, list) or not cmd or not all(isinstance(c, str | int | float)
                                                           for c in cmd):
            raise ValidationError(f"{where}.command", "a command line (string or list)", cmd)
        replicas = raw.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= 64:
            raise ValidationError(f"{where}.replicas", "an integer from 1 to 64", replicas)
        slo = raw.get("slo_ms")
        if slo is not None and (isinstance(slo, bool) or not isinstance(slo, int | float)
                                or slo <= 0):
            raise ValidationError(f"{where}.slo_ms", "a positive number of milliseconds", slo)
        env = raw.get("env") or {}
        if not isinstance(env, dict):
            raise ValidationError(f"{where}.env", "a mapping of variable names to values", env)
        for k, v in env.items():
            if not isinstance(v, str | int | float):
                raise ValidationError(f"{where}.env.{k}", "a string or number", v)
        priority = raw.get("priority", "normal")
        if not isinstance(priority, str) or priority not in PRIORITIES:
            raise ValidationError(f"{where}.priority", f"one of {', '.join(PRIORITIES)}",
                                  priority)
        gpu = raw.get("gpu")
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, str | int)):
            raise ValidationError(f"{where}.gpu", "a GPU index or UUID", gpu)
        out.append(LocalService(
            name=name, command=tuple(str(c) for c in cmd), replicas=replicas,
            model=str(raw.get("model", name)),
            slo_ms=None if slo is None else float(slo),
            compute_pct=None if raw.get("compute") is None
            else parse_percent(f"{where}.compute", raw["compute"]),
            memory_mib=None if raw.get("memory") is None
            else parse_memory(f"{where}.memory", raw["memory"]),
            gpu=None if gpu is None else str(gpu),
            env={str(k): str(v) for k, v in env.items()}, priority=priority))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValidationError(f"{path}: services", "distinct service names", names)
    health = doc.get("health_path", "/v2/health/ready") if isinstance(doc, dict) else \
        "/v2/health/ready"
    if not isinstance(health, str) or not health.startswith("/"):
        raise ValidationError(f"{path}: health_path", "a path starting with /", health)
    layouts, windows, default = _read_layouts(path, doc if isinstance(doc, dict) else {},
                                              set(names))
    return LocalConfig(tuple(out), health, layouts=layouts, windows=windows,
                       default_layout=default)


def _read_layouts(path: Path, doc: dict[str, Any], services: set[str]) -> tuple[
        dict[str, dict[str, tuple[int | None, int | None]]], tuple[Window, ...], str | None]:
    """``layouts: {NAME: {SERVICE: {compute, memory}}}``, ``windows: [{layout, start, end}]``
    and ``default``: the same schedule as a SliceSchedule, with MPS caps for local mode."""
    raw = doc.get("layouts")
    if raw is None:
        return {}, (), None
    if not isinstance(raw, dict) or not raw:
        raise ValidationError(f"{path}: layouts", "a mapping of layout names", raw)
    layouts: dict[str, dict[str, tuple[int | None, int | None]]] = {}
    for lname, per in raw.items():
        where = f"{path}: layouts.{lname}"
        if not isinstance(per, dict):
            raise ValidationError(where, "a mapping of service names to compute/memory", per)
        layouts[str(lname)] = {}
        for svc, caps in per.items():
            if svc not in services:
                raise ValidationError(f"{where}.{svc}", f"one of {sorted(services)}", svc)
            if not isinstance(caps, dict):
                raise ValidationError(f"{where}.{svc}", "a mapping with compute and/or memory",
                                      caps)
            layouts[str(lname)][svc] = (
                None if caps.get("compute") is None
                else parse_percent(f"{where}.{svc}.compute", caps["compute"]),
                None if caps.get("memory") is None
                else parse_memory(f"{where}.{svc}.memory", caps["memory"]))
    raw_windows = doc.get("windows")
    if raw_windows is None:
        raw_windows = []
    if not isinstance(raw_windows, list):
        raise ValidationError(f"{path}: windows", "a list of {layout, start, end}", raw_windows)
    windows = []
    for i, w in enumerate(raw_windows):
        where = f"{path}: windows[{i}]"
        if not isinstance(w, dict):
            raise ValidationError(where, "a mapping with layout, start and end", w)
        if not isinstance(w.get("layout"), str) or w["layout"] not in layouts:
            raise ValidationError(f"{where}.layout", f"one of {sorted(layouts)}", w.get("layout"))
        windows.append(Window(str(w["layout"]), minutes_of_day(f"{where}.start", w.get("start")),
                              minutes_of_day(f"{where}.end", w.get("end"))))
    default = doc.get("default", next(iter(layouts)))
    if not isinstance(default, str) or default not in layouts:
        raise ValidationError(f"{path}: default", f"one of {sorted(layouts)}", default)
    return layouts, tuple(windows), str(default)
