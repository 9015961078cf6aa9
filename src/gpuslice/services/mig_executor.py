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
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValidationError(str(p), "a readable mig-parted YAML config", str(exc)) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("mig-configs"), dict):
        raise ValidationError(f"{p}: mig-configs", "a mapping of config names", doc)
    return doc


class MigExecutor:
    def __init__(self, nvml: NvmlPort, api: KubePort | None = None, node: str = "") -> None:
        self.nvml, self.api, self.node = nvml, api, node

    def _label(self, config: str, state: str) -> None:
        if self.api is not None and self.node:
            self.api.patch_node(self.node, {CONFIG_LABEL: config, STATE_LABEL: state}, {})

    def desired(self, doc: dict[str, Any], config: str) -> dict[str, list[MigPlacement]]:
        entries = doc["mig-configs"].get(config)
        if not isinstance(entries, list):
            raise ValidationError("mig config", f"one of {', '.join(doc['mig-configs'])}",
                                  config)
        gpus = self.nvml.devices()
        out: dict[str, list[MigPlacement]] = {}
        for i, entry in enumerate(entries):
            where = f"mig-configs.{config}[{i}]"
            devices = entry.get("devices", "all")
            chosen = gpus if devices == "all" else [g for g in gpus if g.index in devices]
            if devices != "all" and not isinstance(devices, list):
                raise ValidationError(f"{where}.devices", "all or a list of GPU indices",
                                      devices)
            if entry.get("mig-enabled") is False:
                continue
            for g in chosen:
                model = catalog.lookup(g.model)
                if model is None or model.mig is None:
                    raise ValidationError(f"{where}: GPU {g.index}", "a MIG-capable GPU",
                                          g.model)
                if "mig-placements" in entry:
                    # a layout no GPU can hold is refused here, before any GPU is touched
                    layout = check_layout(model.mig, parse_layout(
                        model.mig, ",".join(entry["mig-placements"])),
                        f"{where}.mig-placements")
                else:
                    counts = {str(k): int(v) for k, v in (entry.get("mig-devices") or {}).items()}
                    layout = layout_for_counts(model.mig, counts)
                out[g.uuid] = layout
        return out

    def apply(self, doc: dict[str, Any], config: str, *, dry_run: bool = False) -> MigReport:
        report = MigReport(config)
        want = self.desired(doc, config)
        if not dry_run:
            self._label(config, "pending")
        by_uuid = {g.uuid: g for g in self.nvml.devices()}
        for uuid, layout in want.items():
            model = catalog.lookup(by_uuid[uuid].model)
            assert model is not None and model.mig is not None
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
