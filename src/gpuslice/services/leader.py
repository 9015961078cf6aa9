"""Leader election on a coordination.k8s.io Lease, for the components that run replicas and
let one of them write: the scheduler extender (binds) and the DRA claim allocator. The rules
(when to take, renew or wait) are :mod:`gpuslice.core.lease`'s; this holds the I/O."""

from __future__ import annotations

import threading
from collections.abc import Callable

from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound, KubePort
from gpuslice.core.errors import GpusliceError
from gpuslice.core.lease import LeaseAction, LeaseState, decide


class LeaderElector:
    """Holds (or waits for) the extender's Lease; only the leader binds. Filter and prioritize
    are read-only and every replica follows the same watch, so any replica may answer them;
    the extender reports Ready (``/readyz``) only while it leads, so the Service sends the
    scheduler's calls to the leader. :meth:`release` on the way out hands the Lease over."""

    def __init__(self, api: KubePort, namespace: str, name: str, identity: str,
                 clock: Callable[[], float], duration_s: float = 15.0) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.clock, self.duration_s = clock, duration_s
        self.leader = False
        self.released = False  # set by release(): the Lease was given up on the way out
        self._lock = threading.Lock()  # a step and the release, one at a time
        self._stopped = False  # released: no step takes the lease again

    def step(self) -> bool:
        """One round: create, renew or take the lease, or wait. Returns whether we lead."""
        with self._lock:
            if self._stopped:
                self.leader = False
                return False
            return self._step()

    def _step(self) -> bool:
        from datetime import UTC, datetime

        lease = self.api.get_lease(self.namespace, self.name)
        state = None
        rv = None
        if lease is not None:
            spec = lease.get("spec") or {}
            renewed = spec.get("renewTime")
            try:
                at = datetime.fromisoformat(str(renewed).replace("Z", "+00:00")).timestamp()
            except ValueError:
                at = 0.0
            state = LeaseState(str(spec.get("holderIdentity") or ""), at,
                               float(spec.get("leaseDurationSeconds") or self.duration_s),
                               int(spec.get("leaseTransitions") or 0))
            rv = lease["metadata"]["resourceVersion"]
        now = self.clock()
        action = decide(state, self.identity, now)
        if action is LeaseAction.WAIT:
            self.leader = False
            return False
        transitions = (state.transitions if state else 0) + (action is LeaseAction.TAKE)
        stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.duration_s),
                "renewTime": stamp, "leaseTransitions": transitions}
        if action is not LeaseAction.RENEW:
            spec["acquireTime"] = stamp
        try:
            self.api.put_lease(self.namespace, self.name, spec, rv)
            self.leader = True
        except (ApiConflict, ApiNotFound):
            self.leader = False  # someone else wrote it first
        return self.leader

    def release(self, timeout_s: float = 2.0) -> bool:
        """Give the Lease up on the way out, if we hold it: the holder is cleared and the
        duration set to 1 s (as client-go's ``ReleaseOnCancel``), so a standby takes it at its
        next step instead of after ``duration_s``. No step takes it again afterwards (one
        still under way on another thread finishes first: the lease it just wrote is the one
        given up). Written with the lease's resourceVersion: a lease someone else took
        meanwhile is left alone. Waits at most ``timeout_s`` for the API server (a stopping
        component must not hang on it). Returns whether it released."""
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(self._release()), daemon=True,
                             name="lease-release")
        t.start()
        t.join(timeout_s)
        self.leader = False
        self.released = bool(done and done[0])
        return self.released

    def _release(self) -> bool:
        from datetime import UTC, datetime

        with self._lock:
            self._stopped = True
            try:
                lease = self.api.get_lease(self.namespace, self.name)
                spec = dict((lease or {}).get("spec") or {})
                if lease is None or spec.get("holderIdentity") != self.identity:
                    return False
                stamp = datetime.fromtimestamp(self.clock(), UTC).strftime(
                    "%Y-%m-%dT%H:%M:%S.%fZ")
                spec.update(holderIdentity="", leaseDurationSeconds=1, renewTime=stamp)
                self.api.put_lease(self.namespace, self.name, spec,
                                   lease["metadata"]["resourceVersion"])
                return True
            except GpusliceError:  # taken meanwhile (409), gone (404), or the API server away
                return False
