"""The node agent's MIG layouts: the per-GPU layouts the reconfiguration controller asks for
in the node's ``gpuslice.io/mig-desired`` annotation, applied on idle GPUs and reported in
``gpuslice.io/mig-layouts``; and the check of the driver's MIG profile table against the
catalogue's. A part of :class:`gpuslice.services.node_agent.NodeAgent`."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from gpuslice.adapters.kube.fake import ApiNotFound, KubePort
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.core.assignment import Assignment
from gpuslice.core.errors import GpusliceError, note_once
from gpuslice.services.device_plugin import DevicePlugin, PluginConfig

# the reconfiguration controller's wish, per GPU (JSON {uuid: "1g.10gb@0,..."}), and what the
# agent reports back (JSON {uuid: {layout, state: success|pending|failed, message}})
MIG_DESIRED = "gpuslice.io/mig-desired"
MIG_LAYOUTS = "gpuslice.io/mig-layouts"


class MigLayouts:
    """The MIG side of the node agent (its attributes are the agent's)."""

    cfg: PluginConfig
    nvml: NvmlPort
    api: KubePort
    plugins: list[DevicePlugin]
    problems: list[str]
    _layout_report: dict[str, dict[str, str]]
    _unpublished: bool

    def publish(self) -> bool:
        raise NotImplementedError  # the agent's

    def live_assignments(self) -> list[Assignment]:
        raise NotImplementedError  # the agent's

    def _holders(self, gpu: str) -> list[str]:
        """The pods (``ns/name``) whose live assignment is on GPU ``gpu``: a pod bound while
        the controller's cordon was reaching the extender, or one still pulling its image or
        loading a model (no CUDA context yet), is not among NVML's processes, and changing
        the layout under it would take its instance away. An unreadable API counts as
        busy."""
        try:
            return [f"{a.namespace}/{a.pod}" for a in self.live_assignments()
                    if gpu in a.gpu_uuids()]
        except GpusliceError as exc:
            return [f"(the node's pods cannot be read: {exc})"]

    def _desired_layouts(self, node: dict[str, Any]) -> dict[str, str]:
        """The layouts the reconfiguration controller asks of this node's GPUs (its
        ``gpuslice.io/mig-desired`` annotation: GPU UUID -> layout text); nothing, noted once,
        when the annotation is not that."""
        meta = node.get("metadata")
        ann = meta.get("annotations") if isinstance(meta, dict) else None
        text = ann.get(MIG_DESIRED) if isinstance(ann, dict) else None
        if not text:
            return {}
        try:
            desired = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            desired = None
        if not isinstance(desired, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in desired.items()):
            note_once(self.problems, f"{MIG_DESIRED}: expected a JSON object of GPU UUID to "
                      f"layout text, got {str(text)[:80]!r}; no layout applied")
            return {}
        return desired

    def reconcile_layouts(self) -> dict[str, dict[str, str]]:
        """Apply the MIG layout the controller wants on each MIG-enabled GPU that has no
        clients, and report every GPU's layout and state on the node (changed reports only).
        A GPU with clients stays ``pending``; a failed change is ``failed`` with NVML's
        message, and the GPU keeps whatever instances exist (the controller rolls back)."""
        from gpuslice.core import catalog
        from gpuslice.core.mig import MigPlacement, layout_changes, parse_layout
        from gpuslice.core.reconfig import layout_text

        node: dict[str, Any] = {}
        if any(g.mig_enabled for g in self.nvml.devices()):  # else no layout to be asked for
            with contextlib.suppress(ApiNotFound):  # its own node (RBAC: nodes get, not list)
                node = self.api.get_node(self.cfg.node)
        desired = self._desired_layouts(node)
        report: dict[str, dict[str, str]] = {}
        changed = False
        for g in self.nvml.devices():
            model = catalog.lookup(g.model)
            if model is None or model.mig is None:
                continue
            if not g.mig_enabled:
                report[g.uuid] = {"layout": "", "state": "disabled", "message":
                                  "MIG mode is disabled on this GPU (enabling it is an "
                                  "administrator's action)"}
                continue
            geo = model.mig
            try:
                current = [MigPlacement(st, geo.profile(p)) for p, st in
                           self.nvml.mig_layout(g.uuid)]
            except (NvmlError, GpusliceError) as exc:
                report[g.uuid] = {"layout": "", "state": "failed", "message": str(exc)}
                continue
            text, state, message = layout_text(current), "success", ""
            want = desired.get(g.uuid)
            if want is not None and want != text:
                busy = self.nvml.clients(g.uuid)
                holders = self._holders(g.uuid)
                if busy or holders:
                    state = "pending"
                    message = (f"{busy} process(es) use the GPU; waiting until it is idle"
                               if busy else f"{len(holders)} pod(s) hold assignments on the "
                               f"GPU ({', '.join(holders[:3])}); waiting until they are gone")
                else:
                    try:
                        for ch in layout_changes(current, parse_layout(geo, want)):
                            pl = ch.placement
                            if ch.action == "destroy":
                                self.nvml.destroy_instance(g.uuid, pl.profile.name, pl.start)
                            else:
                                self.nvml.create_instance(g.uuid, pl.profile.name, pl.start)
                        changed = True
                    except GpusliceError as exc:
                        state, message = "failed", str(exc)
                    text = layout_text([MigPlacement(st, geo.profile(p)) for p, st in
                                        self.nvml.mig_layout(g.uuid)])
            report[g.uuid] = {"layout": text, "state": state, "message": message}
        if changed:
            for plugin in self.plugins:
                plugin.changed()  # MIG strategies list instances: stream the new list
                plugin.write_cdi_spec()  # the new instances' UUIDs, for cdi-* strategies
            # the new instances reach the extender's inventory before the controller reads
            # the layout report and reopens the GPU (MPS slices are placed inside instances):
            # no report while the inventory is not published
            self.publish()
        if report and report != self._layout_report and not self._unpublished:
            self.api.patch_node(self.cfg.node, {}, {MIG_LAYOUTS: json.dumps(report,
                                                                            sort_keys=True)})
            self._layout_report = report
        return report

    def check_mig_tables(self) -> list[str]:
        """MIG geometry comes from the catalogue (the extender and planner use it too): say so
        when this driver's profile table differs for a GPU, or the catalogue lacks one."""
        from gpuslice.core import catalog

        found = []
        for g in self.nvml.devices():
            try:
                reported = self.nvml.mig_profiles(g.uuid)
            except NvmlError as exc:
                found.append(f"GPU {g.index}: MIG profiles unreadable: {exc}")
                continue
            model = catalog.lookup(g.model)
            if not reported:
                continue
            if model is None or model.mig is None:
                found.append(f"GPU {g.index} ({g.name}): the driver lists MIG profiles but the "
                             "catalogue has no MIG table for it; no MIG slice is placed there")
            elif diff := catalog.mig_table_differences(model, reported):
                found.append(f"GPU {g.index} ({g.model}): the driver's MIG table differs from "
                             f"the catalogue's for {', '.join(diff)} (see gpuslice gpus --local)")
        self.problems.extend(found)
        return found

