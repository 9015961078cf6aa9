"""The controller behind a Lease: several replicas (or a replacement started beside a pod
being evicted) and only the holder of the coordination.k8s.io Lease acts, as the extender and
the DRA claim allocator lead (:class:`~gpuslice.services.leader.LeaderElector`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpuslice.core.errors import GpusliceError
from gpuslice.services.leader import LeaderElector
from gpuslice.services.reconfig.controller import ReconfigController

log = logging.getLogger("gpuslice.reconfig")


class LeadingController:
    """:meth:`step`: renew (or wait for) the Lease, then one pass of the controller, only
    while leading. A pass is short, and every write it makes is preconditioned on what it
    read (resourceVersion), so a leader that loses its Lease in the middle of one changes
    nothing the new leader decided."""

    def __init__(self, ctl: ReconfigController, elector: LeaderElector | None,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.ctl, self.elector, self.on_change = ctl, elector, on_change
        self.leading: bool | None = None

    def step(self) -> bool:
        """One round; returns whether this replica led (and reconciled)."""
        lead = True
        if self.elector is not None:
            try:
                lead = self.elector.step()
            except GpusliceError as exc:  # the API server away: not leading meanwhile
                log.warning("lease: %s", exc, extra={"event": "lease-failed"})
                lead = False
        if lead != self.leading:
            self.leading = lead
            if self.on_change is not None:
                self.on_change(lead)
        if lead:
            self.ctl.step()
        return lead

    def run(self, stop: threading.Event, every_s: float = 2.0) -> None:
        """A round every ``every_s`` until ``stop`` is set; then the Lease is handed over."""
        while not stop.is_set():
            try:
                self.step()
            except GpusliceError as exc:
                self.ctl._note(f"step: {exc}")
            except Exception:
                log.exception("step")
            stop.wait(every_s)
        if self.elector is not None:
            self.elector.release()
