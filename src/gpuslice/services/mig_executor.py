"""Apply declarative MIG layouts on a node (NVIDIA mig-parted's config format).

A config names, per set of GPUs (``devices: all`` or a list of indices), the MIG devices wanted
(``mig-devices: {"3g.40gb": 2}``), or, as gpuslice's extension, exact placements
(``mig-placements: ["3g.40gb@0", "3g.40gb@4"]``). The executor never changes a GPU's MIG mode
(an administrator's action) and touches only GPUs with no running clients; it reports progress
as the node label ``nvidia.com/mig.config.state`` = pending / success / failed, as NVIDIA's
mig-manager does. ``dry_run`` returns what would change without changing anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice.adapters.kube.fake import KubePort
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.adapters.yamlfile import read_yaml
from gpuslice.core import catalog
from gpuslice.core.catalog import MigGeometry
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.mig import (
    MigChange,
    MigPlacement,
    check_layout,
    layout_changes,
    layout_for_counts,
    layout_problems,
    parse_layout,
)

STATE_LABEL = "nvidia.com/mig.config.state"
CONFIG_LABEL = "nvidia.com/mig.config"


@dataclass
class MigReport:
    config: str
    changes: dict[str, list[MigChange]] = field(default_factory=dict)  # GPU UUID -> changes
    skipped: dict[str, str] = field(default_factory=dict)  # GPU UUID -> why
    applied: bool = False
    state: str = "pending"


def read_config(path: Path | str) -> dict[str, Any]:
    """A mig-parted config file (``version: v1``, ``mig-configs``), every config checked for
    its form (:func:`check_entry`); errors name the file and the field."""
    p = Path(path)
    doc = read_yaml(p, str(p), "a mig-parted YAML config")
    if not isinstance(doc, dict):
        raise ValidationError(str(p), "a mig-parted config: a mapping with 'version: v1' and "
                              "'mig-configs'",
                              "an empty file" if doc is None else type(doc).__name__)
    configs = doc.get("mig-configs")
    if not isinstance(configs, dict) or not configs:
        raise ValidationError(f"{p}: mig-configs", "a mapping of config names to lists of "
                              "entries (devices, mig-enabled, mig-devices)", _short(configs))
    if doc.get("version") != "v1":
        raise ValidationError(f"{p}: version", "v1 (mig-parted's config format)",
                              _short(doc.get("version")))
    for name, entries in configs.items():
        if not isinstance(entries, list):
            raise ValidationError(f"{p}: mig-configs.{name}", "a list of entries (devices, "
                                  "mig-enabled, mig-devices)", _short(entries))
        for i, entry in enumerate(entries):
            check_entry(entry, f"{p}: mig-configs.{name}[{i}]")
    return doc


def check_entry(entry: object, where: str) -> dict[str, Any]:
    """One entry of a mig-parted config, checked for its form: ``devices`` (``all`` or a
    list of GPU indices), ``mig-enabled`` (a bool), ``mig-devices`` (profile name -> whole
    count) or gpuslice's ``mig-placements`` (a list of ``profile@start``)."""
    if not isinstance(entry, dict):
        raise ValidationError(where, "a mapping with devices, mig-enabled and mig-devices",
                              _short(entry))
    devices = entry.get("devices", "all")
    if devices != "all" and not (isinstance(devices, list)
                                 and all(_index(d) for d in devices)):
        raise ValidationError(f"{where}.devices", "all or a list of GPU indices (whole "
                              "numbers >= 0)", _short(devices))
    if not isinstance(entry.get("mig-enabled", True), bool):
        raise ValidationError(f"{where}.mig-enabled", "true or false",
                              _short(entry["mig-enabled"]))
    counts = entry.get("mig-devices")
    if counts is not None:
        if not isinstance(counts, dict):
            raise ValidationError(f"{where}.mig-devices", "a mapping of MIG profile to count "
                                  "such as {1g.10gb: 7}", _short(counts))
        for name, n in counts.items():
            if not _index(n):
                raise ValidationError(f"{where}.mig-devices[{name}]", "a whole number of "
                                      "instances >= 0", _short(n))
    if "mig-placements" in entry:
        placements = entry["mig-placements"]
        if not (isinstance(placements, list) and all(isinstance(x, str) for x in placements)):
            raise ValidationError(f"{where}.mig-placements", "a list of placements such as "
                                  "['3g.40gb@0', '3g.40gb@4']", _short(placements))
    return entry


def _index(value: object) -> bool:
    """Whether ``value`` is a whole number >= 0 (a GPU index or an instance count), not a bool,
    a float or text."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: object) -> object:
    """``value`` for an error message: its text cut short when it is long."""
    text = repr(value)
    return value if len(text) <= 80 else f"{text[:77]}..."


class MigExecutor:
    def __init__(self, nvml: NvmlPort, api: KubePort | None = None, node: str = "") -> None:
        self.nvml, self.api, self.node = nvml, api, node

    def _label(self, config: str, state: str) -> None:
        if self.api is not None and self.node:
            self.api.patch_node(self.node, {CONFIG_LABEL: config, STATE_LABEL: state}, {})

    def desired(self, doc: dict[str, Any], config: str, *,
                source: str = "") -> dict[str, list[MigPlacement]]:
        """The layout ``config`` of the mig-parted config ``doc`` asks of each GPU it
        touches, by UUID. ``source`` (the file) prefixes the field of every error."""
        prefix = f"{source}: " if source else ""
        configs = doc.get("mig-configs")
        entries = configs.get(config) if isinstance(configs, dict) else None
        if not isinstance(entries, list):
            raise ValidationError(f"{prefix}mig config",
                                  f"one of {', '.join(map(str, configs or {}))}", config)
        gpus = self.nvml.devices()
        indices = {g.index for g in gpus}
        out: dict[str, list[MigPlacement]] = {}
        for i, raw in enumerate(entries):
            where = f"{prefix}mig-configs.{config}[{i}]"
            entry = check_entry(raw, where)
            devices = entry.get("devices", "all")
            if devices != "all":
                missing = [d for d in devices if d not in indices]
                if missing:
                    known = ", ".join(str(g.index) for g in gpus) or "none"
                    raise ValidationError(f"{where}.devices", f"indices of this node's GPUs "
                                          f"({known})", _short(missing[0]))
            chosen = gpus if devices == "all" else [g for g in gpus if g.index in devices]
            if entry.get("mig-enabled") is False:
                continue
            for g in chosen:
                model = catalog.lookup(g.model)
                if model is None or model.mig is None:
                    raise ValidationError(f"{where}: GPU {g.index}", "a MIG-capable GPU",
                                          g.model)
                out[g.uuid] = self._layout(model.mig, entry, where)
        return out

    @staticmethod
    def _layout(geo: MigGeometry, entry: dict[str, Any], where: str) -> list[MigPlacement]:
        """The layout one (checked) entry asks of a GPU of geometry ``geo``; a layout no GPU
        can hold is refused here, before any GPU is touched."""
        if "mig-placements" in entry:
            field_name = f"{where}.mig-placements"
            try:
                return check_layout(geo, parse_layout(geo, ",".join(entry["mig-placements"])),
                                    field_name)
            except ValidationError as exc:
                if exc.field == field_name:
                    raise
                raise ValidationError(field_name, exc.expected, exc.got) from None
        counts = {str(k): v for k, v in (entry.get("mig-devices") or {}).items()}
        try:
            return layout_for_counts(geo, counts)
        except ValidationError as exc:
            # "mig-devices 1g.10gb" (a count), "mig-devices" (the sum), "mig profile"
            name = exc.field.removeprefix("mig-devices").strip()
            field_name = f"{where}.mig-devices" + (f"[{name}]" if name and
                                                   exc.field.startswith("mig-devices") else "")
            raise ValidationError(field_name, exc.expected, exc.got) from None

    def apply(self, doc: dict[str, Any], config: str, *, dry_run: bool = False,
              source: str = "") -> MigReport:
        report = MigReport(config)
        want = self.desired(doc, config, source=source)
        if not dry_run:
            self._label(config, "pending")
        by_uuid = {g.uuid: g for g in self.nvml.devices()}
        for uuid, layout in want.items():
            model = catalog.lookup(by_uuid[uuid].model)
            assert model is not None and model.mig is not None
            if not by_uuid[uuid].mig_enabled:  # what it would take, and what to do first
                report.changes[uuid] = layout_changes([], layout)
                report.skipped[uuid] = (
                    "MIG mode is disabled on this GPU and the config asks for MIG: enable it "
                    f"first (sudo nvidia-smi -i {by_uuid[uuid].index} -mig 1, with no process "
                    "on the GPU; some GPUs need a reset after it), then apply again")
                continue
            try:
                current = [MigPlacement(s, model.mig.profile(p))
                           for p, s in self.nvml.mig_layout(uuid)]
            except NvmlError as exc:
                report.skipped[uuid] = str(exc)
                continue
            changes = layout_changes(current, layout)
            if not changes:
                continue
            report.changes[uuid] = changes
            if self.nvml.clients(uuid):
                report.skipped[uuid] = (f"{self.nvml.clients(uuid)} process(es) use the GPU; "
                                        "MIG changes wait until it is idle")
        if dry_run:
            report.state = "dry-run"
            return report
        try:
            for uuid, changes in report.changes.items():
                if uuid in report.skipped:
                    continue
                for ch in changes:
                    p = ch.placement
                    if ch.action == "destroy":
                        self.nvml.destroy_instance(uuid, p.profile.name, p.start)
                    else:
                        self.nvml.create_instance(uuid, p.profile.name, p.start)
        except GpusliceError as exc:
            report.state = "failed"
            report.skipped.setdefault("*", str(exc))
            self._label(config, "failed")
            return report
        report.applied = True
        report.state = "failed" if report.skipped else "success"
        self._label(config, report.state)
        return report

    # -- one instance at a time (the DRA driver prepares one MIG device per claim result) ---

    def ensure_instance(self, uuid: str, profile: str, start: int) -> bool:
        """The GPU instance ``profile@start`` exists on GPU ``uuid`` (created when missing;
        True when it was). Refused, naming the conflict, when it cannot exist next to the
        instances there (the GPU's MIG geometry from the catalogue)."""
        geo = self._geometry(uuid)
        want = MigPlacement(start, geo.profile(profile))
        current = [MigPlacement(s, geo.profile(p)) for p, s in self.nvml.mig_layout(uuid)]
        if any((c.start, c.profile.profile_id) == (start, want.profile.profile_id)
               for c in current):
            return False
        problems = layout_problems(geo, [*current, want])
        if problems:
            raise GpusliceError(f"GPU {uuid}: cannot create {want}: {problems[0]}")
        self.nvml.create_instance(uuid, want.profile.name, start)
        return True

    def remove_instance(self, uuid: str, profile: str, start: int) -> bool:
        """Destroy ``profile@start`` on GPU ``uuid`` (True), or find it gone (False)."""
        geo = self._geometry(uuid)
        name = geo.profile(profile).name
        if (name, start) not in {(p, s) for p, s in self.nvml.mig_layout(uuid)}:
            return False
        self.nvml.destroy_instance(uuid, name, start)
        return True

    def _geometry(self, uuid: str) -> MigGeometry:
        g = next((g for g in self.nvml.devices() if g.uuid == uuid), None)
        if g is None:
            raise GpusliceError(f"no GPU {uuid} on this node")
        model = catalog.lookup(g.model)
        if model is None or model.mig is None:
            raise GpusliceError(f"GPU {uuid} ({g.model}) is not MIG-capable")
        if not g.mig_enabled:
            raise GpusliceError(f"MIG mode is disabled on GPU {uuid} (an administrator's "
                                "action)")
        return model.mig
