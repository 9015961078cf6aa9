"""The GPUs of the cluster as the webhook judges pods against them: every node's inventory
(the node agent's ``gpuslice.io/inventory``), read again every few seconds. The webhook
answers from the last read; a read that fails keeps the last one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from gpuslice.adapters.kube.objects import node_inventory
from gpuslice.core.admission import Fleet, fleet_of
from gpuslice.core.errors import GpusliceError, ValidationError

log = logging.getLogger("gpuslice.webhook")


class NodeLister(Protocol):
    def list_nodes(self) -> list[dict[str, Any]]: ...


def fleet_from_nodes(nodes: list[dict[str, Any]],
                     problems: Callable[[str], None] | None = None) -> Fleet:
    """The fleet of ``nodes``' inventories; a node whose inventory does not read is left
    out (and said to ``problems``)."""
    gpus: list[tuple[str, int, list[str]]] = []
    for n in nodes:
        try:
            inv = node_inventory(n)
        except ValidationError as exc:
            if problems is not None:
                problems(str(exc))
            continue
        for g in inv:
            gpus.append((g.model, g.memory_mib, [g.uuid, *(m.uuid for m in g.mig)]))
    return fleet_of(gpus)


class FleetView:
    """The last fleet read from the API server (empty until the first read)."""

    def __init__(self, api: NodeLister) -> None:
        self.api = api
        self.fleet = Fleet()
        self.reads = 0  # successful reads
        self.failures = 0
        self.last_error = ""
        self.read_at = float("-inf")  # time.monotonic() of the last read tried

    def due(self, min_age_s: float) -> bool:
        """Whether a review should read the nodes again before it is answered: the fleet has
        no GPUs (none published yet, or the last read failed before any) and the last read
        is older than ``min_age_s``. A node's agent publishes its inventory moments before
        its GPUs turn allocatable; a pod created then would otherwise be judged against the
        empty fleet of the last periodic read."""
        return not self.fleet.models and time.monotonic() - self.read_at >= min_age_s

    def refresh(self) -> Fleet:
        """Read every node again (blocking: on a thread); a failure keeps the last fleet."""
        self.read_at = time.monotonic()
        try:
            nodes = self.api.list_nodes()
        except GpusliceError as exc:
            self.failures += 1
            if self.last_error != str(exc):
                log.warning("node list failed (answering from the last one): %s", exc,
                            extra={"event": "nodes-failed"})
            self.last_error = str(exc)
            return self.fleet
        said: set[str] = set()

        def problem(text: str) -> None:
            if text not in said:
                said.add(text)
                log.warning("node left out: %s", text, extra={"event": "bad-inventory"})

        self.fleet = fleet_from_nodes(nodes, problem)
        self.reads += 1
        self.last_error = ""
        return self.fleet

    @property
    def ready(self) -> bool:
        return self.reads > 0
