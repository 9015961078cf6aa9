"""Releasing pods held by the claim allocator's scheduling gate (issue 58; the rules in
:mod:`gpuslice.core.dra_gate`, the objects in :mod:`gpuslice.adapters.kube.dra_gate`).

* :class:`GateReleaser` removes the gate from one pod (a JSON patch that tests the gate is
  still where it was read) and records an Event with the reason when there is one. The
  allocator calls it for every pod it holds, once its claim is allocated or once it will not
  place it.
* :class:`GateKeeper` is the fallback for when the allocator is gone: run by the DRA drivers
  (which read the allocator's Lease every 2 s anyway, to put on or take off its device
  taint), it releases every pod still carrying the gate once that Lease has been stale for
  its grace, with a note saying so, so that kube-scheduler's own allocation takes those pods
  exactly when it takes over the devices. One driver does it at a time: the keepers elect one
  on a Lease of their own (:data:`KEEPER_LEASE`), and only while the allocator's is stale,
  so a healthy cluster pays nothing for it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from gpuslice.adapters.kube.dra_gate import ALLOCATOR_GATE, carries_gate, pod_event, removal_patch
from gpuslice.adapters.kube.ports import ApiConflict, ApiInvalid, ApiNotFound, PodGatePort
from gpuslice.core.dra_gate import ALLOCATOR_UNAVAILABLE, keeper_message
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.lease import LeaseState

log = logging.getLogger("gpuslice.dra-gate")

KEEPER_LEASE = "gpuslice-dra-gate-keeper"  # in the allocator Lease's namespace


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class GateReleaser:
    """Removes ``gate`` from pods, each release with a reason noted in an Event on the pod
    (from ``component``); what could not be done is logged and left to the next call. Safe
    to call from several threads (the claim allocator's writers)."""

    def __init__(self, api: PodGatePort, component: str, gate: str = ALLOCATOR_GATE,
                 wall: Callable[[], str] = _now_iso) -> None:
        self.api, self.component, self.gate, self.wall = api, component, gate, wall
        self.released = 0  # pods released so far
        self.events_failed = 0
        self._count = threading.Lock()

    def release(self, pod: Mapping[str, Any], reason: str = "", message: str = "",
                warning: bool = False,
                ops: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """Remove the gate from ``pod`` (as read; ``ops``: a patch that does, and more, e.g.
        :func:`~gpuslice.adapters.kube.cpu_pods.pin_patch`); the pod as patched, or ``None``
        when it no longer carries the gate where it was read, is gone, or the API server
        refused (the next pass reads it again)."""
        meta = pod.get("metadata") or {}
        ns, name = str(meta.get("namespace")), str(meta.get("name"))
        try:
            ops = removal_patch(pod, self.gate) if ops is None else ops
        except ValidationError:
            return None
        try:
            out = self.api.remove_pod_scheduling_gate(ns, name, ops)
        except (ApiNotFound, ApiInvalid, ApiConflict) as exc:  # gone, or its gates changed
            log.debug("pod %s/%s: gate not removed: %s", ns, name, exc)
            return None
        with self._count:
            self.released += 1
        if reason:
            try:
                self.api.create_event(ns, pod_event(pod, reason, message, warning=warning,
                                                    component=self.component, now=self.wall(),
                                                    suffix=uuid.uuid4().hex[:16]))
            except GpusliceError as exc:
                with self._count:
                    self.events_failed += 1
                log.warning("pod %s/%s: released (%s) but the Event was not recorded: %s",
                            ns, name, message, exc)
        return out


def lease_state(lease: Mapping[str, Any]) -> LeaseState:
    """A coordination/v1 Lease as :class:`LeaseState` (a ``renewTime`` that does not parse
    counts as never renewed)."""
    spec = lease.get("spec") or {}
    try:
        at = datetime.fromisoformat(str(spec.get("renewTime")).replace("Z", "+00:00"))
        renewed = at.timestamp()
    except ValueError:
        renewed = 0.0
    try:
        duration = float(spec.get("leaseDurationSeconds") or 0)
    except (TypeError, ValueError):
        duration = 0.0
    return LeaseState(str(spec.get("holderIdentity") or ""), renewed, duration)


def lease_fresh(lease: Mapping[str, Any] | None, wall: float) -> bool:
    """Whether the allocator's Lease (as read; ``None``: there is none) has a holder and was
    renewed within its ``leaseDurationSeconds`` at ``wall`` (seconds since the epoch): the
    one reading for the drivers' taint and the webhook's gate."""
    if lease is None:
        return False
    st = lease_state(lease)
    return bool(st.holder) and st.renewed_at > 0 and wall < st.renewed_at + st.duration_s


class KeeperPort(PodGatePort, Protocol):
    def list_pods(self, node: str | None = None,
                  timeout_s: float | None = None) -> list[dict[str, Any]]: ...


class GateKeeper:
    """Releases the pods still held by the allocator's gate once its Lease (``lease``:
    namespace, name) has been stale for ``grace_s`` (:func:`core.dra_gate.keeper_message`),
    each with an Event saying so. ``elector`` (a :class:`~gpuslice.services.leader.
    LeaderElector` on :data:`KEEPER_LEASE`, or ``None``: always) decides which keeper acts;
    it is stepped only while the allocator's Lease is stale. ``wall``: seconds since the
    epoch (Lease times are wall-clock times)."""

    def __init__(self, api: KeeperPort, lease: tuple[str, str], component: str,
                 wall: Callable[[], float], grace_s: float = 5.0, elector: Any = None) -> None:
        if not grace_s >= 0:
            raise ValidationError("grace_s", "0 or more seconds", grace_s)
        self.api, self.lease, self.wall, self.grace_s = api, lease, wall, grace_s
        self.elector = elector
        self.releaser = GateReleaser(api, component)
        self.active = False  # the last step found the allocator gone and released its pods

    def step(self, lease: Mapping[str, Any] | None) -> int:
        """One round with the allocator's Lease as just read (``None``: there is none); the
        number of pods released."""
        name = "/".join(self.lease)
        note = keeper_message(None if lease is None else lease_state(lease), self.wall(),
                              self.grace_s, name)
        if note is None:
            if self.active:
                log.info("claim allocator Lease %s fresh again: its gate is left to it", name)
            self.active = False
            return 0
        if self.elector is not None and not self.elector.step():
            return 0  # another keeper releases them
        if not self.active:
            log.warning("%s; releasing the pods its gate %s holds", note, ALLOCATOR_GATE)
        self.active = True
        released = 0
        for pod in self.api.list_pods(node=""):  # the pods not bound yet
            if carries_gate(pod) and not (pod.get("metadata") or {}).get(
                    "deletionTimestamp") and \
                    self.releaser.release(pod, ALLOCATOR_UNAVAILABLE, note, warning=True):
                released += 1
        if released:
            log.warning("released %d pod(s) held by %s: %s", released, ALLOCATOR_GATE, note)
        return released
