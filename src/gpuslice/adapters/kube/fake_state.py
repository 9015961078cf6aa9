"""The state of the in-memory API server fake: its stores, the cluster-wide
``resourceVersion`` and the watch event log (see :mod:`gpuslice.adapters.kube.fake`)."""

from __future__ import annotations

import copy
import threading
import uuid
from typing import Any

from gpuslice.adapters.kube.ports import WatchEvent
from gpuslice.adapters.kube.slice_strategy import GATED_FIELDS


def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeState:
    """The stores every part of :class:`~gpuslice.adapters.kube.fake.FakeApiServer` shares,
    under one lock; every write bumps the resourceVersion and logs a watch event."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._events: list[tuple[int, WatchEvent]] = []
        self._rv = 0
        # in each UID, as a real API server's UIDs are unique across servers: the allocator
        # keeps what it parsed per UID and resourceVersion (adapters/kube/dra_common.py), and
        # two fakes in one process would otherwise hand it the same version of different claims
        self.uid_token = uuid.uuid4().hex[:8]
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._leases: dict[tuple[str, str], dict[str, Any]] = {}
        self._custom: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._deployments: dict[tuple[str, str], dict[str, Any]] = {}
        self._daemonsets: dict[tuple[str, str], dict[str, Any]] = {}
        self._claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._templates: dict[tuple[str, str], dict[str, Any]] = {}
        self._slices: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []  # core/v1 Events created
        # the DRA feature gates this API server has on (1.36 defaults: all three beta, on)
        self.dra_gates: set[str] = set(GATED_FIELDS)
        self._classes: dict[str, dict[str, Any]] = {}
        self._pdbs: dict[tuple[str, str], dict[str, Any]] = {}

    def _bump(self, obj: dict[str, Any], event: str = "MODIFIED") -> None:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        kind = str(obj.get("kind", "Pod"))
        self._events.append((self._rv, WatchEvent(event, kind, copy.deepcopy(obj))))
        self._changed.notify_all()

    def watch(self, since: str, timeout_s: float) -> tuple[list[WatchEvent], str]:
        with self._changed:
            start = int(since) if since else self._rv
            if not any(rv > start for rv, _ in self._events[-1:]):
                self._changed.wait(timeout_s)
            out = [ev for rv, ev in self._events if rv > start]
            return out, str(self._rv)
