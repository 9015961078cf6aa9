"""The node agent: discovery, the device plugin, health, and what the node tells the cluster.

``gpuslice node-agent`` wires the NVML port (real, or ``--fake`` YAML, or null when there is no
driver) to the device plugin, publishes the GPU inventory annotation and GPU-feature-discovery
labels on its Node, and follows NVML health events: an XID marks the GPU unhealthy in
ListAndWatch (and drops it from the inventory); after ``quiet_s`` seconds without a new error it
is healthy again, without restarting the agent.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from gpuslice.adapters.kube.fake import KubePort
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.core.devices import inventory, node_labels
from gpuslice.core.errors import GpusliceError
from gpuslice.services.device_plugin import DevicePlugin, PluginConfig, PluginServer

INVENTORY = "gpuslice.io/inventory"
# XIDs that are the application's fault, not the GPU's (NVIDIA's device plugin skips them too)
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class NodeAgent:
    def __init__(self, cfg: PluginConfig, nvml: NvmlPort, api: KubePort, *,
                 quiet_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.nvml, self.api = cfg, nvml, api
        self.quiet_s, self.clock = quiet_s, clock
        self.plugin = DevicePlugin(cfg, nvml, api)
        self.server = PluginServer(self.plugin)
        self._last_error: dict[str, float] = {}
        self._stop = threading.Event()
        self.problems: list[str] = []

    def publish(self) -> None:
        """Inventory annotation (healthy GPUs) and GFD labels on this node."""
        gpus = [g for g in self.nvml.devices() if g.uuid not in self._last_error]
        labels = node_labels(self.nvml.devices(), self.nvml.driver_version())
        self.api.patch_node(self.cfg.node, labels, {INVENTORY: json.dumps(inventory(gpus))})

    def health_step(self, timeout_s: float) -> None:
        """Take NVML events for up to ``timeout_s``; recover GPUs that stayed quiet."""
        try:
            events = self.nvml.events(timeout_s)
        except NvmlError as exc:
            self.problems.append(str(exc))
            events = []
        changed = False
        for ev in events:
            if ev.xid in APPLICATION_XIDS:
                continue
            first = ev.uuid not in self._last_error
            self._last_error[ev.uuid] = self.clock()
            if first:
                self.plugin.set_health(ev.uuid, False)
                changed = True
        now = self.clock()
        for uuid, at in list(self._last_error.items()):
            if now - at >= self.quiet_s:
                del self._last_error[uuid]
                self.plugin.set_health(uuid, True)
                changed = True
        if changed:
            self.publish()

    def run(self) -> None:
        """Serve until :meth:`stop`: the device plugin, the node's labels, health."""
        if not self.nvml.devices():
            self.problems.append(f"no GPU served: {self.nvml.why_empty()}")
        self.server.start()
        self.problems.extend(self.server.errors)
        try:
            self.publish()
        except GpusliceError as exc:
            self.problems.append(f"publishing node labels: {exc}")
        while not self._stop.is_set():
            self.health_step(1.0)

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()
