"""The DRA claim allocator: places our driver's pending claims with our policy before
kube-scheduler allocates them first-fit (composition root; the decision is
:meth:`gpuslice.core.dra_placement.DraLedger.decide`).

Each pass reads slices, claims, pods and nodes (from watches: adapters.kube.mirror), brings
the ledger kept between passes up to date with what changed (services.dra_book: what every
allocated claim consumed, whoever allocated it, and what the pods request of each node), and for
each unallocated claim of an unbound pod that is a shape we place, writes ``status.allocation``
with the pod in ``status.reservedFor`` (after the scheduler's finalizer, as the scheduler does;
the finalizer goes on early, when a writer is free as the claim is first seen), each write
preconditioned on the claim's resourceVersion (services.dra_writes). kube-scheduler then only
checks that the pod's node can reach the claim, finds it reserved for the pod, and binds. The
Lease is renewed every ``elect_every_s`` (2 s), not every pass.

Safety (docs/dra-placement.md):

* Only devices that carry our allocator taint are used (``require_taint``), and only once they
  have carried it for ``settle_s`` seconds: kube-scheduler does not allocate tainted devices, and
  anything it allocated before the taint appeared has been written by then. Our drivers publish
  the taint only while this allocator's Lease is fresh, so when the allocator is down the taint
  goes and the default allocator takes over.
* A claim someone else allocated meanwhile fails our write (409); we re-read it, leave it alone,
  and count what it took.
* A claim we allocated that comes back unallocated (kube-scheduler's PostFilter releases a claim
  whose node cannot take the pod) is placed again from fresh state: at once up to
  ``max_attempts`` times, then after a delay doubling from ``backoff_s`` up to
  ``max_backoff_s``. Never given up: while our taint is on, nobody else would place it.
* Pods not bound yet whose claim is allocated count on their node's CPU and memory, so the
  next claim does not go to CPU that pod's bind is about to take.
* A pod may carry the allocator's scheduling gate (``gpu.gpuslice.io/allocator``, issue 58):
  kube-scheduler then does not try it until the allocator has written its claim's allocation
  and removed the gate, so the pod is scheduled once, with no failed attempt and no backoff.
  The gate comes off once the allocation has come back through the allocator's own watch
  (:meth:`DraAllocator._await_echo`): kube-scheduler's watch of claims may lag its watch of
  pods (tests/cluster/test_dra_gate.py). A held pod the allocator will not place (not
  its shape, no room now, its write refused, no device tainted for it) is released at once
  with an Event saying why; one still waiting (its claim not created yet, devices settling)
  at most ``max_hold_s`` (:func:`gpuslice.core.dra_gate.verdict`). When the allocator is
  gone, the DRA drivers release what it held once its Lease is stale
  (:class:`gpuslice.services.dra_gate.GateKeeper`).
* A held pod that names no claim (gated by the webhook's ``--gate-cpu-only``, or by its
  template) is placed by the same policy on the same ledger, over every node (those without
  devices too), and released pinned softly to its node: a preferred node-affinity term of
  weight 100, written with the gate's removal (:mod:`gpuslice.services.dra_pins`,
  :mod:`gpuslice.adapters.kube.cpu_pods`); it counts on that node until bound.
* Passes run on the watch events of claims, pods and slices (``wake``: coalesced for
  ``coalesce_s``, so a burst is one pass), and at the latest every ``interval_s`` and when
  something timed is due (a node's devices settled, a released claim's retry, a held pod's
  deadline, the Lease's renewal): :meth:`DraAllocator.run`.
* One bad object never stops the allocator: an invalid pool (a device name twice, as upstream's
  ``GatherPools`` marks it) or a slice with a field of the wrong type leaves its pool out, a
  claim, pod or node of the wrong shape is passed over as :mod:`~gpuslice.services.dra_book`
  says, each noted once in :attr:`DraAllocator.problems` while it stays so; any other error
  fails that pass only (logged, the ledger built again) and the next pass runs.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import numpy as np

from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube.dra_gate import gates, why_not_placed
from gpuslice.adapters.kube.fake import (
    DraApiPort,
    KubePort,
    PodGatePort,
)
from gpuslice.core.dra_gate import Claims, GatedPod, verdict
from gpuslice.core.dra_placement import DeviceResult, DraDevice, DraLedger, DraPlacement
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.policies import Policy, make_policy
from gpuslice.services.dra_book import DraBook
from gpuslice.services.dra_gate import GateReleaser
from gpuslice.services.dra_pins import Pinner
from gpuslice.services.dra_writes import ClaimWrites, Written

log = logging.getLogger("gpuslice.dra-allocator")


class AllocatorPort(KubePort, DraApiPort, PodGatePort, Protocol):
    """The API the allocator needs: pods (read; their gate removed), nodes, leases, Events
    and resource.k8s.io/v1."""


PodKey = tuple[str, str]
Write = tuple[kdra.PendingClaim, DraPlacement, PodKey, Future[Written]]


@dataclass
class PassReport:
    """What one pass did: claims allocated (``ns/name`` -> node and devices), claims someone
    else allocated first, claims that fit nowhere, conflicts retried, pods released from the
    gate (``ns/name`` -> the Event's reason, ``allocated`` when none), pods without claims
    released pinned to a node (``ns/name`` -> node), whether we lead, and
    when (on the allocator's clock) the next pass is due at the latest for something timed
    (``None``: nothing)."""

    leading: bool = True
    allocated: dict[str, str] = field(default_factory=dict)
    taken: list[str] = field(default_factory=list)
    unplaced: dict[str, str] = field(default_factory=dict)
    conflicts: int = 0
    nodes: int = 0
    released: dict[str, str] = field(default_factory=dict)
    pinned: dict[str, str] = field(default_factory=dict)
    next_due: float | None = None

    def due(self, at: float) -> None:
        self.next_due = at if self.next_due is None else min(self.next_due, at)


def _pod_key(pc: kdra.PendingClaim) -> PodKey:
    return str(pc.pod["metadata"].get("namespace")), str(pc.pod["metadata"]["name"])


def _key(obj: Mapping[str, Any]) -> str:
    return f"{obj['metadata'].get('namespace', 'default')}/{obj['metadata']['name']}"


class DraAllocator:
    def __init__(self, api: AllocatorPort, *, driver: str = kdra.DRIVER,
                 classes: Mapping[str, frozenset[str]] = kdra.CLASS_KINDS,
                 policy: str = "frag-strand", require_taint: bool = True,
                 settle_s: float = 10.0, max_attempts: int = 3, backoff_s: float = 2.0,
                 max_backoff_s: float = 60.0, max_hold_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 new_share_id: Callable[[], str] = lambda: str(uuid.uuid4()),
                 elector: Any = None, seed: int = 0, elect_every_s: float = 2.0,
                 writers: int = 4, max_writes_per_pass: int = 128,
                 wall_clock: Callable[[], str] = lambda: datetime.now(UTC).strftime(
                     "%Y-%m-%dT%H:%M:%SZ")) -> None:
        if not max_hold_s > 0:
            raise ValidationError("max_hold_s", "a positive number of seconds", max_hold_s)
        if writers < 1:
            raise ValidationError("writers", "at least 1", writers)
        if max_writes_per_pass < 1:
            raise ValidationError("max_writes_per_pass", "at least 1", max_writes_per_pass)
        # a pass places at most this many claims: in a burst of gated pods the gates come
        # off every few hundred milliseconds, not once the whole burst is allocated
        self.max_writes_per_pass = max_writes_per_pass
        self.api = api
        self.driver, self.classes = driver, classes
        self.policy: Policy = make_policy(policy)
        self.require_taint, self.settle_s = require_taint, settle_s
        # a claim the scheduler releases (PostFilter: the node we chose could not take the
        # pod) is placed again at once up to max_attempts times, then after a doubling delay;
        # never given up, as our devices' taint keeps the default allocator away from it
        self.max_attempts, self.backoff_s = max_attempts, backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_hold_s = max_hold_s  # the longest a pod waits behind our gate (issue 58)
        self.clock, self.new_share_id = clock, new_share_id
        self.wall_clock = wall_clock  # allocationTimestamp (RFC 3339)
        self.elector = elector  # a LeaderElector (services.leader) or None: always lead
        self.rng = np.random.default_rng(seed)
        self.gate = GateReleaser(api, "gpuslice-dra-allocator")
        # held pods without claims (the webhook's --gate-cpu-only): placed by the policy too
        self.pinner = Pinner(self.gate, self.policy, self.rng)
        self._pinned_now: set[PodKey] = set()  # pinned (or their pin refused) this pass
        # a pass decides its claims one after the other (each on the ledger the ones before
        # it left) but writes them ``writers`` at a time: in a burst the writes' round trips,
        # not the decisions, were the allocator's pace. A claim is decided once a writer is
        # free, so its write starts at once, within the Lease's window checked just before
        # (none waits in a queue past it)
        self.writes = ClaimWrites(api, writers)
        self._seen_since: dict[str, float] = {}  # node -> when its devices were first usable
        self._attempts: dict[str, int] = {}  # claim UID -> allocations we wrote
        self._retry_at: dict[str, float] = {}  # claim UID -> no new try before (clock)
        self._held: dict[str, float] = {}  # pod UID -> since when our gate is its only one
        self.problems: list[str] = []
        # the Lease is renewed every elect_every_s; claims are written only within
        # write_within_s of the last renewal (a third of the lease's 15 s), so none lands
        # after the lease could have lapsed and our drivers dropped the taint
        self.elect_every_s, self.write_within_s = elect_every_s, 5.0
        self._elected_at = float("-inf")
        self._renew_after = False  # the Lease renewed at the end of this pass
        self.book = DraBook(driver, classes)
        self._slices_version: tuple[tuple[object, object], ...] | None = None
        self._devices: dict[str, list[DraDevice]] = {}
        self._slice_problems: list[str] = []  # what is wrong with the slices read last
        self._pass = 0
        self._noted: dict[str, int] = {}  # problem -> the last pass it was found in

    # -- one pass ------------------------------------------------------------------------------

    def _note(self, text: str) -> bool:
        """Add ``text`` to :attr:`problems` unless it was found in the previous pass too (a
        bad object, a refused claim, found pass after pass, is noted once while it lasts);
        whether it was added."""
        last = self._noted.get(text)
        self._noted[text] = self._pass
        if last is not None and last >= self._pass - 1:
            return False
        self.problems.append(text)
        return True

    def run_once(self) -> PassReport:
        self._pass += 1
        if self._noted:
            self._noted = {t: n for t, n in self._noted.items() if n >= self._pass - 1}
        report = PassReport()
        if not self._leading():
            report.leading = False
            return report
        if self.elector is not None:
            report.due(self._elected_at + self.elect_every_s)
        api = self.api
        slices = api.list_resource_slices()
        claims, pods, nodes = api.list_resource_claims(), api.list_pods(), api.list_nodes()
        version = self._read_devices(slices)
        devices = self._devices
        now = self.clock()
        self._seen_since = {n: self._seen_since.get(n, now) for n in devices}
        ready = {n: d for n, d in devices.items()
                 if not self.require_taint or now - self._seen_since[n] >= self.settle_s}
        for n in devices.keys() - ready.keys():  # devices settling: a pass when they are
            report.due(self._seen_since[n] + self.settle_s)
        if len(self._attempts) > len(claims):  # some are of claims gone: forget them
            live = {str(c["metadata"].get("uid")) for c in claims}
            self._attempts = {u: n for u, n in self._attempts.items() if u in live}
            self._retry_at = {u: t for u, t in self._retry_at.items() if u in live}
        report.nodes = len(ready)
        usable = any(ready.values())  # a node whose devices carry our taint and settled
        outcome: dict[PodKey, tuple[Claims, str]] = {}  # the held pods this pass decided on
        if usable:
            # the ledger kept between passes (services.dra_book), synced with what changed
            try:
                ledger = self.book.sync(ready, version, nodes, pods, claims)
            except BaseException:  # half-synced: built again from the next lists
                self.book.invalidate()
                raise
            for problem in self.book.problems():
                self._note(problem)
            self.writes.finalize_early(self.book.new_unallocated)
            self._place(ledger, report, outcome, now)
            self._pin(ledger, pods, nodes, report, outcome, now)
            self._await_echo(report, pods)
        self._release_held(pods, claims, report, outcome, usable,
                           not usable and any(devices.values()), now)
        if self._renew_after:
            self._renew_after = False
            at = self.clock()
            if self.elector.step():
                self._elected_at = at
        return report

    def _pin(self, ledger: DraLedger, pods: list[dict[str, Any]], nodes: list[dict[str, Any]],
             report: PassReport, outcome: dict[PodKey, tuple[Claims, str]],
             now: float) -> None:
        """The held pods without claims, placed by the policy and released pinned to their
        node (:mod:`gpuslice.services.dra_pins`); what is left goes to :meth:`_release_held`
        through ``outcome``."""
        pins = self.pinner.run(ledger, pods, nodes, self.writes.pool, self.max_writes_per_pass)
        self._pinned_now = set(pins.pinned) | pins.refused  # not released again this pass
        for key, node in pins.pinned.items():
            report.pinned["/".join(key)] = node
        for key in pins.queued | pins.refused:
            outcome[key] = (Claims.QUEUED, "")
            report.due(now)
        for key, why in pins.unplaced.items():
            outcome[key] = (Claims.NOT_OURS, why)

    def _read_devices(self, slices: list[dict[str, Any]]) -> tuple[tuple[object, object], ...]:
        """Our usable devices per node (:attr:`_devices`), parsed again only when a slice
        changed; returns the slices' version."""
        version = tuple(((s.get("metadata") or {}).get("uid"),
                         (s.get("metadata") or {}).get("resourceVersion")) for s in slices)
        if version != self._slices_version or None in (v for pair in version for v in pair):
            found: list[str] = []
            self._devices = kdra.slice_devices(slices, self.driver,
                                               require_taint=self.require_taint,
                                               problems=found)
            self._slices_version, self._slice_problems = version, found
        for problem in self._slice_problems:
            self._note(problem)
        return version

    def _place(self, ledger: DraLedger, report: PassReport,
               outcome: dict[PodKey, tuple[Claims, str]], now: float) -> None:
        """Decide and write each pending claim, oldest pod first, noting in ``outcome``
        what became of each pod's claim (:meth:`_release_held` decides on its gate)."""
        pending = self.book.pending()
        if not pending:
            return
        classes = self.api.list_device_classes()  # their configs go into the allocations
        writes: list[Write] = []
        for i, pc in enumerate(pending):
            if len(writes) >= self.max_writes_per_pass:  # the rest in the next pass, right
                report.due(now)  # after this one has taken its pods' gates off
                self._hold(pending[i:], outcome)
                break
            self.writes.free.acquire()  # released when its write is done, or here
            write: Write | None = None
            try:
                stop, write = self._decide_and_submit(pc, ledger, classes, report, outcome,
                                                      now)
            finally:
                if write is None:
                    self.writes.free.release()
            if stop:
                self._hold(pending[i + 1:], outcome)
                break
            if write is not None:
                writes.append(write)
        for pc, placement, pod_key, fut in writes:
            self._written(pc, placement, pod_key, fut, ledger, report, outcome, now)

    @staticmethod
    def _hold(rest: list[kdra.PendingClaim], outcome: dict[PodKey, tuple[Claims, str]]) -> None:
        """Claims this pass leaves to the next: their pods keep the gate (not released as
        claims the allocator would not place)."""
        for pc in rest:
            outcome.setdefault(_pod_key(pc), (Claims.QUEUED, ""))

    def _decide_and_submit(self, pc: kdra.PendingClaim, ledger: DraLedger,
                           classes: list[dict[str, Any]], report: PassReport,
                           outcome: dict[PodKey, tuple[Claims, str]], now: float) -> \
            tuple[bool, Write | None]:
        """One claim decided and its write handed to a free writer: whether the Lease's
        window is over (the next pass renews it first), and the write (claim, placement,
        pod, future; ``None`` when nothing is written)."""
        pod_key = _pod_key(pc)
        if self.elector is not None and \
                self.clock() - self._elected_at > self.write_within_s:
            outcome[pod_key] = (Claims.QUEUED, "")
            return True, None  # a long pass: renew the Lease (next pass) before writing more
        uid = str(pc.claim["metadata"].get("uid"))
        name = _key(pc.claim)
        if now < self._retry_at.get(uid, now):
            report.due(self._retry_at[uid])
            outcome[pod_key] = (Claims.PENDING, "")
            return False, None  # released by the scheduler too often: backing off
        dec = ledger.decide(pc.request, self.policy, self.rng, cpu_milli=pc.cpu_milli,
                            memory_mib=pc.memory_mib)
        if dec.placement is None:
            report.unplaced[name] = dec.message()
            outcome[pod_key] = (Claims.UNPLACED, f"claim {name}: {dec.message()}")
            return False, None
        try:  # its share IDs drawn here, in the order the claims were decided
            alloc = kdra.allocation(pc.claim, dec.placement, classes, self.new_share_id,
                                    self.driver, allocated_at=self.wall_clock())
        except GpusliceError as exc:  # a config of the wrong shape: this claim only
            self._note(f"claim {name}: not allocated: {exc}")
            outcome[pod_key] = (Claims.REFUSED, f"claim {name}: {exc}")
            return False, None
        # counted at once, so the next claim is decided without these devices; a write
        # that fails leaves them counted until the next pass's sync sets the ledger back
        # from the claims (services.dra_book): never a device given twice
        ledger.apply(dec.placement,
                     ledger.slice_request(pc.request, pc.cpu_milli, pc.memory_mib))
        return False, (pc, dec.placement, pod_key, self.writes.submit(
            pc.claim, alloc, kdra.reservation(pc.pod)))

    def _written(self, pc: kdra.PendingClaim, placement: DraPlacement, pod_key: PodKey,
                 fut: Future[Written], ledger: DraLedger,
                 report: PassReport, outcome: dict[PodKey, tuple[Claims, str]],
                 now: float) -> None:
        """What became of one claim's write (in the order the claims were decided)."""
        uid = str(pc.claim["metadata"].get("uid"))
        name = _key(pc.claim)
        try:
            result, claim, conflicts = fut.result()
        except GpusliceError as exc:  # refused (403, 422): this claim only
            self._note(f"claim {name}: not allocated: {exc}")
            outcome[pod_key] = (Claims.REFUSED, f"claim {name}: {exc}")
            return
        report.conflicts += conflicts
        if result == "allocated":
            tries = self._attempts[uid] = self._attempts.get(uid, 0) + 1
            if tries >= self.max_attempts:  # the next release waits before a new try
                self._retry_at[uid] = now + min(
                    self.max_backoff_s, self.backoff_s * 2 ** (tries - self.max_attempts))
            devs = ",".join(r.device for r in placement.results)
            report.allocated[name] = f"{placement.node}: {devs}"
            # a held pod is released by _release_held, once the claim's allocation has
            # come back through the watch (this pass, or the one its event wakes)
            outcome[pod_key] = (Claims.ALLOCATED, "")
        elif result == "taken" and claim is not None:
            report.taken.append(name)
            ledger.apply(self._as_placement(claim))
            outcome[pod_key] = (Claims.ALLOCATED, "")

    def _await_echo(self, report: PassReport, pods: list[dict[str, Any]],
                    within_s: float = 0.05) -> None:
        """Wait (at most ``within_s``) for the claims this pass allocated for pods behind our
        gate to come back through the watch, so that this pass releases them rather than the
        pass their watch events would wake (a lone pod spared a pass and its wait)."""
        if not report.allocated:
            return
        wrote = {(ns, name) for ns, _, name in (k.partition("/") for k in report.allocated)}
        waiting: set[tuple[str | None, str]] = set()
        for pod in pods:
            spec = pod.get("spec")
            if not isinstance(spec, dict) or not spec.get("schedulingGates") or \
                    spec.get("nodeName"):
                continue
            try:
                if kdra.ALLOCATOR_GATE in gates(pod):
                    waiting.update((ns, name) for ns, name in kdra.pod_claims(pod)
                                   if name is not None and (ns, name) in wrote)
            except ValidationError:
                continue
        deadline = time.monotonic() + within_s
        while waiting & self._claims_in_flight() and time.monotonic() < deadline:
            time.sleep(0.001)

    def _release_held(self, pods: list[dict[str, Any]], claims: list[dict[str, Any]],
                      report: PassReport, outcome: dict[PodKey, tuple[Claims, str]],
                      devices: bool, settling: bool, now: float) -> None:
        """Every pod not bound yet that carries our gate: released when its claims are
        allocated or the allocator will not place them, else held (at most max_hold_s)."""
        held: dict[str, float] = {}
        releases: list[tuple[dict[str, Any], PodKey, str, Any]] = []
        by_key: dict[PodKey, dict[str, Any]] | None = None
        flight: set[tuple[str | None, str]] | None = None
        for pod in pods:
            spec, meta = pod.get("spec"), pod.get("metadata") or {}
            if not isinstance(spec, dict) or not spec.get("schedulingGates") or \
                    spec.get("nodeName") or meta.get("deletionTimestamp"):
                continue
            key = (str(meta.get("namespace")), str(meta.get("name")))
            if key in self._pinned_now:
                continue
            try:
                names = gates(pod)
            except ValidationError:
                continue
            if kdra.ALLOCATOR_GATE not in names:
                continue
            others = tuple(n for n in names if n != kdra.ALLOCATOR_GATE)
            uid = str(meta.get("uid") or "/".join(key))
            since = held[uid] = now if others else self._held.get(uid, now)
            if key in outcome:
                state, why = outcome[key]
            else:
                if by_key is None:
                    by_key = {(str(c["metadata"].get("namespace")), str(c["metadata"]["name"])): c
                              for c in claims}
                state, why = self._claims_state(pod, by_key, devices)
            if state is Claims.ALLOCATED:
                if flight is None:
                    flight = self._claims_in_flight()
                if flight and any(k in flight for k in kdra.pod_claims(pod)):
                    state = Claims.PENDING  # our write not back through the watch yet
            v = verdict(GatedPod(now - since, state, others, why, devices, settling),
                        self.max_hold_s)
            if not v.release:
                if v.recheck_s is not None:
                    report.due(now + v.recheck_s)
                continue
            releases.append((pod, key, uid, v))
        # the patches side by side on the writers (a burst's pods are released together)
        pool = self.writes.pool
        done = [pool.submit(self.gate.release, pod, v.reason, v.message, v.warning)
                if pool is not None and len(releases) > 1 else None
                for pod, _, _, v in releases]
        for (pod, key, uid, v), fut in zip(releases, done, strict=True):
            out = fut.result() if fut is not None else \
                self.gate.release(pod, v.reason, v.message, v.warning)
            if out:
                report.released["/".join(key)] = v.reason or "allocated"
                held.pop(uid, None)
        self._held = held
        self._pinned_now = set()

    def _claims_in_flight(self) -> set[tuple[str | None, str]]:
        """The claims we wrote that our watch has not brought back yet (``api``'s
        ``claims_in_flight``, :class:`~gpuslice.adapters.kube.mirror.MirroredLists`'; none for
        an API read afresh every pass, where what we read is what everyone sees)."""
        in_flight = getattr(self.api, "claims_in_flight", None)
        return set(in_flight()) if callable(in_flight) else set()

    def _claims_state(self, pod: dict[str, Any], by_key: Mapping[PodKey, dict[str, Any]],
                      devices: bool) -> tuple[Claims, str]:
        """What a held pod's claims are, when this pass did not decide on them."""
        try:
            keys = kdra.pod_claims(pod)
        except ValidationError as exc:
            return Claims.NOT_OURS, str(exc)
        got = [by_key.get((str(ns), str(name))) if name else None for ns, name in keys]
        if not keys:
            return Claims.NOT_OURS, "the pod names no ResourceClaim"
        if any(c is None for c in got):
            return Claims.MISSING, ""
        if all(kdra.is_allocated(c) for c in got if c is not None):
            return Claims.ALLOCATED, ""
        if not devices:  # nothing was placed this pass: its claim waits for the devices
            return Claims.PENDING, ""
        return Claims.NOT_OURS, why_not_placed(pod, got, self.driver, self.classes)

    def _leading(self) -> bool:
        """Whether we lead: an election step (the Lease read, then renewed or taken) at most
        every ``elect_every_s`` while we lead, as client-go's leader renews every RetryPeriod
        (2 s) of a 15 s lease, at the end of the pass while the last renewal is less than
        ``write_within_s`` old; every pass while we do not."""
        if self.elector is None:
            return True
        now = self.clock()
        if self.elector.leader and now - self._elected_at < self.elect_every_s:
            return True
        if self.elector.leader and now - self._elected_at < self.write_within_s:
            self._renew_after = True  # this pass's work first (a pod waits for no Lease
            return True  # write), then the renewal: writes stay within the window
        leading = bool(self.elector.step())
        if leading:
            self._elected_at = now
        return leading

    def _as_placement(self, claim: Mapping[str, Any]) -> DraPlacement:
        """Someone else's allocation of a claim, to count in the ledger (its node's CPU is
        counted when its pod is bound, at the next pass; a problem with it is noted then)."""
        out: list[DeviceResult] = []
        for (pool, device), u in kdra.claim_usage([claim], self.driver, []).items():
            out.append(DeviceResult("", pool, device, not u.whole, dict(u.consumed)))
        return DraPlacement("", tuple(out), 0.0)

    # -- the loop ------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the writes under way and stop the writers."""
        self.writes.close()

    def _pass_safely(self) -> PassReport:
        """:meth:`run_once`; a failure fails that pass only (an empty report, its problem)."""
        try:
            return self.run_once()
        except GpusliceError as exc:  # the API server away: try again next pass
            self.problems.append(str(exc))
        except Exception as exc:  # a bug, an object of a shape nobody foresaw: this pass
            # only; the ledger and the slices' devices are built afresh from the next lists
            self.book.invalidate()
            self._slices_version = None
            if self._note(f"pass failed: {type(exc).__name__}: {exc}"):
                log.exception("allocator pass failed; the next pass builds its ledger "
                              "again", extra={"event": "pass-failed"})
        return PassReport(leading=self.elector is None or self.elector.leader)

    def run(self, stop: threading.Event, interval_s: float = 1.0,
            on_pass: Callable[[PassReport], None] | None = None,
            wake: threading.Event | None = None, coalesce_s: float = 0.002) -> None:
        """Pass after pass until ``stop`` is set; ``on_pass`` sees every pass's report, and
        :attr:`problems` (a failed pass leaves an empty report and its problem). A pass runs
        when ``wake`` is set (by the watches: :class:`~gpuslice.adapters.kube.mirror.
        MirroredLists`): at once after a quiet spell (a lone pod waits for no timer), else
        no sooner than ``coalesce_s`` after the last pass ended, nor sooner than the CPU time
        that pass took (at most 50 ms: a large cluster's passes do not take a core back to
        back), so that the events of a burst that come during a pass and just after it are
        one pass; else when the last report's ``next_due`` comes, and at the latest
        ``interval_s`` after the last pass (without ``wake``: every ``interval_s``)."""
        while not stop.is_set():
            if wake is not None:
                wake.clear()  # events from here on are the next pass's
            started = time.thread_time()  # the CPU of this thread: a pass's API waits
            # (its writes' round trips) do not hold the next pass back
            report = self._pass_safely()
            took = time.thread_time() - started
            ended = time.monotonic()
            if on_pass is not None:
                on_pass(report)
            now = self.clock()
            wait = interval_s if report.next_due is None else \
                max(0.0, min(interval_s, report.next_due - now))
            if wake is None:
                stop.wait(wait)
                continue
            deadline = time.monotonic() + wait
            while not stop.is_set() and not wake.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wake.wait(min(left, 0.25))  # stop is looked at four times a second
            if wake.is_set():  # spaced from the last pass: coalesce_s, or its own CPU time
                rest = ended + max(coalesce_s, min(took, 0.05)) - time.monotonic()
                if rest > 0:
                    stop.wait(rest)
