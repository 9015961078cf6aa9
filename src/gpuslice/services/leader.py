"""Leader election on a coordination.k8s.io Lease, for the components that run replicas and
let one of them write: the scheduler extender (binds) and the DRA claim allocator. The rules
(when to take, renew or wait) are :mod:`gpuslice.core.lease`'s; this holds the I/O."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound, KubePort, PodLabelPort
from gpuslice.core.errors import GpusliceError
from gpuslice.core.lease import LeaseAction, LeaseState, decide

log = logging.getLogger("gpuslice.leader")


class LeaderElector:
    """Holds (or waits for) the extender's Lease; only the leader binds. Filter and prioritize
    are read-only and every replica follows the same watch, so any replica may answer them;
    every replica that serves is Ready, and the leader marks its own pod
    (:class:`LeaderLabel`) for the Service that sends the scheduler's calls to it.
    :meth:`release` on the way out hands the Lease over."""

    def __init__(self, api: KubePort, namespace: str, name: str, identity: str,
                 clock: Callable[[], float], duration_s: float = 15.0,
                 mono: Callable[[], float] = time.monotonic) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.clock, self.duration_s = clock, duration_s
        # leadership ends on this process's monotonic clock a renew deadline after the start
        # of the last successful renewal (client-go's renewDeadline: 10 s of a 15 s lease),
        # whatever the wall clock does and however long a Lease read hangs: another replica
        # may take the Lease only duration_s after that renewal, so two never lead at once
        self.mono = mono
        self.renew_deadline_s = duration_s * 2 / 3
        self._leader = False
        self._valid_until = float("-inf")
        self.released = False  # set by release(): the Lease was given up on the way out
        self._lock = threading.Lock()  # a step and the release, one at a time
        self._stopped = False  # released: no step takes the lease again

    @property
    def leader(self) -> bool:
        """Whether we lead now: the last renewal succeeded and its renew deadline, on the
        monotonic clock, has not passed (a renewal that hangs ends leadership on time)."""
        return self._leader and self.mono() < self._valid_until

    @leader.setter
    def leader(self, value: bool) -> None:
        self._leader = value

    def step(self) -> bool:
        """One round: create, renew or take the lease, or wait. Returns whether we lead."""
        with self._lock:
            if self._stopped:
                self.leader = False
                return False
            return self._step()

    def _step(self) -> bool:
        from datetime import UTC, datetime

        started = self.mono()  # a renewal counts from before its read: the conservative end
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
            self._leader, self._valid_until = True, started + self.renew_deadline_s
        except (ApiConflict, ApiNotFound):
            self._leader = False  # someone else wrote it first
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


class LeaderLabel:
    """The label on the leader's own pod that a Service selects (its ``spec.selector``), so
    that the Service's one endpoint is the replica that binds while every replica is Ready
    (readiness is health, not leadership), as Patroni and Vault route to their leader.

    :meth:`sync` is called after each election step with whether we lead: it puts the label on
    the pod, or takes it off, when the pod does not carry what leadership asks. What the pod
    carries is read from the API server the first time (a container restarted in the same
    pod finds the label of its previous life: it is not the leader yet, and removes it) and
    every ``refresh_s`` after (someone may have changed it); in between, the last write is
    trusted. A failed read or write is logged and tried again at the next call: the label
    never holds up an election step or a scheduler's call. :meth:`release` takes the label off
    on the way out, and no call puts it back afterwards."""

    def __init__(self, api: PodLabelPort, namespace: str, pod: str, key: str,
                 value: str = "leader", refresh_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.namespace, self.pod, self.key, self.value = api, namespace, pod, key, value
        self.refresh_s, self.clock = refresh_s, clock
        self.marked: bool | None = None  # whether the pod carries the label; None: not known
        self.failures = 0  # failed reads and writes in a row
        self._read_at = 0.0
        self._lock = threading.Lock()  # one sync (or the release) at a time: writes in order
        self._stopped = False

    @property
    def selector(self) -> str:
        return f"{self.key}={self.value}"

    def sync(self, leader: bool) -> bool:
        """Make the pod carry the label if ``leader`` (after :meth:`release`: never), else
        not; returns whether it does (False: the API server did not answer or refused; tried
        again at the next call)."""
        with self._lock:
            return self._sync(leader and not self._stopped)

    def _sync(self, leader: bool) -> bool:
        where = f"pod {self.namespace}/{self.pod}"
        try:
            now = self.clock()
            if self.marked is None or now - self._read_at >= self.refresh_s:
                labels = (self.api.get_pod(self.namespace, self.pod).get("metadata") or {}
                          ).get("labels") or {}
                self.marked, self._read_at = labels.get(self.key) == self.value, now
            if self.marked is not leader:
                self.marked = None  # unknown until the write answers
                self.api.patch_pod_labels(self.namespace, self.pod,
                                          {self.key: self.value if leader else None})
                self.marked = leader
                log.info("%s %s %s", "labelled" if leader else "unlabelled", where,
                         self.selector, extra={"event": "leader-label", "leader": leader})
        except Exception as exc:  # any failure is logged and tried again; serving goes on
            self.failures += 1
            # the first failure of a run is a warning, the rest (every step) quieter
            log.log(logging.WARNING if self.failures == 1 else logging.DEBUG,
                    "%s: cannot %s %s (tried again at the next election step): %s", where,
                    "set" if leader else "remove", self.selector, exc,
                    extra={"event": "leader-label-failed", "leader": leader})
            return False
        if self.failures:
            log.info("%s: %s %s after %d failed tries", where,
                     "carries" if leader else "does not carry", self.selector, self.failures,
                     extra={"event": "leader-label", "leader": leader})
        self.failures = 0
        return True

    def release(self, timeout_s: float = 2.0) -> bool:
        """Take the label off on the way out (after the Lease is given up): the Service has no
        endpoint until the next leader labels its pod, rather than one that no longer binds.
        No :meth:`sync` puts it back afterwards (one under way finishes first, so this write
        is the last). Waits at most ``timeout_s`` for the API server. Returns whether the pod
        is known not to carry the label."""
        done: list[bool] = []

        self._stopped = True  # before the lock: a sync waiting for it writes nothing

        def off() -> None:
            with self._lock:
                done.append(self._sync(False))

        t = threading.Thread(target=off, daemon=True, name="leader-label-release")
        t.start()
        t.join(timeout_s)
        return bool(done and done[0])
