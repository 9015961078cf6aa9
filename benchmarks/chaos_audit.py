"""The chaos soak's auditor loop (benchmarks/chaos.py): every few seconds it lists what the
API server holds (pods, nodes; ResourceClaims and ResourceSlices on the DRA path; events when a
pending pod has no condition) with its own client and applies the rules of
:mod:`gpuslice.devcluster.audit` and :mod:`gpuslice.devcluster.audit_dra`. Nothing is asked
of a gpuslice component.

Eventual consistency: the capacity rules read one LIST (one resourceVersion: a consistent
snapshot of the pods, or of the claims), so they need no second look; the rules that join two
lists (a bound pod and its claims) are confirmed on fresh reads of the pod and its claims
before they count. A pending pod's age leaves out the seconds the auditor could not read the
API server (a frozen kube-apiserver schedules nothing). Each violation is counted once per
(rule, object) and printed when first seen."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos_parts import Api
from gpuslice.devcluster import audit as A
from gpuslice.devcluster import audit_dra as D

RESOURCE = "/apis/resource.k8s.io/v1"


@dataclass
class Snapshot:
    pods: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    claims: list[dict[str, Any]]
    slices: list[dict[str, Any]]
    at: float


@dataclass
class Auditor:
    api: Api
    ns: str
    key: bytes
    dra: bool
    grace_s: float = 60.0  # a pending pod's time to get the scheduler's verdict
    reason_max_age_s: float = 300.0  # a FailedScheduling event older than this is stale
    every_s: float = 3.0
    emit: Callable[[str], None] = print
    t0: float = field(default_factory=time.monotonic)
    found: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    outages: list[tuple[float, float]] = field(default_factory=list)  # wall-clock spans
    rounds: int = 0
    failed_rounds: int = 0
    bound_uids: set[str] = field(default_factory=set)
    bound_kinds: dict[str, int] = field(default_factory=dict)  # pods bound, by kind label
    peak: dict[str, float] = field(default_factory=dict)  # the fullest the GPUs were
    last: Snapshot | None = None
    _down_since: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def violations(self) -> int:
        return len(self.found)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set():
            self.round()
            self._stop.wait(self.every_s)

    def snapshot(self) -> Snapshot:
        pods = self.api.pods(self.ns)
        nodes = self.api.items("/api/v1/nodes")
        claims = slices = []
        if self.dra:
            claims = self.api.items(f"{RESOURCE}/namespaces/{self.ns}/resourceclaims")
            slices = self.api.items(f"{RESOURCE}/resourceslices")
        return Snapshot(pods, nodes, claims, slices, time.time())

    def round(self) -> Snapshot | None:
        """One pass over the rules; None when the API server did not answer."""
        try:
            snap = self.snapshot()
        except Exception:
            self.failed_rounds += 1
            if self._down_since is None:
                self._down_since = time.time()
            return None
        if self._down_since is not None:
            self.outages.append((self._down_since, snap.at))
            self._down_since = None
        self.rounds += 1
        self.last = snap
        self.count(snap)
        for v in self.check(snap):
            self.report(v)
        return snap

    def count(self, snap: Snapshot) -> None:
        """Pods seen bound (by kind), and how full the GPUs were at the fullest."""
        for p in snap.pods:
            uid = p["metadata"]["uid"]
            if A.node_of(p) and uid not in self.bound_uids:
                self.bound_uids.add(uid)
                kind = (p["metadata"].get("labels") or {}).get("chaos.gpuslice.io/kind", "?")
                self.bound_kinds[kind] = self.bound_kinds.get(kind, 0) + 1
        inv, _ = A.inventories(snap.nodes)
        held, _ = A.held_by_pods(snap.pods, inv, self.key)
        total = 1000 * sum(len(g) for g in inv.values())
        if total:
            share = sum(held.milli.values()) / total
            self.peak["gpu_milli"] = max(self.peak.get("gpu_milli", 0.0), share)
        if self.dra:
            n = sum(1 for c in snap.claims if D.allocated(c))
            self.peak["claims_allocated"] = max(self.peak.get("claims_allocated", 0), n)

    def check(self, snap: Snapshot) -> list[A.Violation]:
        out = A.audit_pods(snap.pods, snap.nodes, self.key)
        if self.dra:
            out += D.audit_claims(snap.claims, snap.slices)
            out += self._confirmed(D.audit_bound(snap.pods, snap.claims))
        out += self.pending(snap)
        return out

    def pending(self, snap: Snapshot, grace_s: float | None = None) -> list[A.Violation]:
        grace = self.grace_s if grace_s is None else grace_s
        wanting = [p for p in snap.pods if A.pending(p) and not A.reason_of(p)
                   and self.age(p, snap.at) >= grace]
        events: dict[str, float] = {}
        if wanting:
            try:
                events = A.failed_scheduling(self.api.items(
                    f"/api/v1/namespaces/{self.ns}/events"))
            except Exception:
                return []  # not judged this round
        return A.audit_pending(wanting, lambda p: self.age(p, snap.at), grace, events,
                               snap.at - self.reason_max_age_s)

    def age(self, pod: A.Obj, now: float) -> float:
        """Seconds since the pod's creation, less those the API server was away."""
        born = A.parse_time(A.meta_of(pod).get("creationTimestamp")) or now
        away = sum(max(0.0, min(b, now) - max(a, born)) for a, b in self.outages)
        return now - born - away

    def _confirmed(self, found: list[A.Violation]) -> list[A.Violation]:
        """Re-read each pod and its claims: a violation that a pod deleted (or bound)
        between the two lists made up does not count."""
        out = []
        for v in found:
            name = v.subject.removeprefix("pod ").split("/", 1)[1]
            try:
                pod = self.api.call("GET", f"/api/v1/namespaces/{self.ns}/pods/{name}")
                claims = [self.api.call("GET", f"{RESOURCE}/namespaces/{self.ns}/"
                                        f"resourceclaims/{c}") for c in D.claim_names(pod)]
            except Exception:
                continue  # gone, or the API server away: not confirmed
            again = D.audit_bound([pod], claims)
            out += [w for w in again if w.rule == v.rule]
        return out

    def report(self, v: A.Violation) -> None:
        k = (v.rule, v.subject)
        if k in self.found:
            self.found[k]["seen"] += 1
            return
        self.found[k] = {"at_s": round(time.monotonic() - self.t0, 1), "rule": v.rule,
                         "object": v.subject, "detail": v.detail, "seen": 1}
        self.emit(v.line())

    # -- after the churn ------------------------------------------------------------------

    def fitting_pending(self, snap: Snapshot) -> dict[str, str]:
        """Pending pods the auditor's own fit places now: pod -> where."""
        inv, _ = A.inventories(snap.nodes)
        held, _ = A.held_by_pods(snap.pods, inv, self.key)
        dp_nodes = [n for n in snap.nodes if n["metadata"]["name"] in inv]
        out: dict[str, str] = {}
        claims = {c["metadata"]["name"]: c for c in snap.claims}
        pools = D.pools(snap.slices) if self.dra else D.Pools()
        use = D.use_of(snap.claims, pools)
        for p in snap.pods:
            if not A.pending(p):
                continue
            if D.uses_claims(p):
                sel = (p.get("spec") or {}).get("nodeSelector") or {}
                ok = {n["metadata"]["name"] for n in snap.nodes if all(
                    (n["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())}
                for name in D.claim_names(p):
                    c = claims.get(name)
                    where = D.claim_fits(c, ok, pools, use) if c is not None else ""
                    if where:
                        out[A.key_of(p)] = f"claim {name} fits device {where}"
            else:
                where = A.fits_now(p, dp_nodes, held, inv)
                if where:
                    out[A.key_of(p)] = f"fits {where}"
        return out
