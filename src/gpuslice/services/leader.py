"""Leader election on a coordination.k8s.io Lease, for the components that run replicas and
let one of them write: the scheduler extender (binds) and the DRA claim allocator. The rules
(when to take, renew or wait) are :mod:`gpuslice.core.lease`'s; this holds the I/O."""

from __future__ import annotations

from collections.abc import Callable

from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound, KubePort
from gpuslice.core.lease import LeaseAction, LeaseState, decide


class LeaderElector:
    """Holds (or waits for) the extender's Lease; only the leader binds. Filter and prioritize
    are read-only and every replica follows the same watch, so any replica may answer them."""

    def __init__(self, api: KubePort, namespace: str, name: str, identity: str,
                 clock: Callable[[], float], duration_s: float = 15.0) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.clock, self.duration_s = clock, duration_s
        self.leader = False

    def step(self) -> bool:
        """One round: create, renew or take the lease, or wait. Returns whether we lead."""
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
