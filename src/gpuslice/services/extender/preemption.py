"""ProcessPreemption on the GPU side: the scheduler's victims checked, more taken where one
GPU needs them, PodDisruptionBudgets counted as kube-scheduler counts them."""

from __future__ import annotations

from typing import Any

from gpuslice.adapters.kube.fake import ApiNotFound, KubePort
from gpuslice.adapters.kube.objects import (
    pod_request,
    selector_matches,
)
from gpuslice.core.assignment import (
    Assignment,
)
from gpuslice.core.errors import GpusliceError
from gpuslice.core.ledger import Conflict, Ledger
from gpuslice.core.model import SliceRequest
from gpuslice.services.extender.placement import PlacementVerbs


class Preemption(PlacementVerbs):
    def preempt(self, pod: dict[str, Any], victims: dict[str, list[str]],
                violations: dict[str, int] | None = None
                ) -> dict[str, tuple[list[str], int]]:
        """ProcessPreemption: the scheduler's candidate victims per node (pod UIDs) checked
        on the GPU side; per node kept, the victims and their PodDisruptionBudget
        violations. kube-scheduler chose its victims for what it counts (CPU, memory, the
        device count); it needs every one, so none is taken off. A node where the pod still
        does not fit the GPUs after they go gets more victims: pods of lower priority that
        hold gpuslice shares there, those whose budget still allows a disruption first, then
        the lowest priority and smallest share, and none that is not needed. Their
        violations are added to the scheduler's count ``violations`` as it counts its own
        (``filterPodsWithPDBViolation``, pkg/scheduler/framework/plugins/defaultpreemption/
        default_preemption.go), since it prefers the node with the fewest
        (``pickOneNodeForPreemption``, pkg/scheduler/framework/preemption/preemption.go),
        and the list stays ordered highest priority first (it reads ``Pods[0]`` as the
        highest). A node where even that does not make room is dropped; a kept node never
        comes back with an empty list (``callExtenders`` refuses it: "expected at least one
        victim pod"). Reads the ledger and the API server; changes nothing."""
        violations = violations or {}
        req = pod_request(pod)
        if req is None:
            return {node: (uids, violations.get(node, 0))
                    for node, uids in victims.items() if uids}
        mine = _priority(pod)
        by_uid = {a.pod_uid: a for a in self.ledger.owners.values()}
        budgets = _Budgets(self.api, self.problems)
        out: dict[str, tuple[list[str], int]] = {}
        for node, uids in victims.items():
            i = self.inv.index.get(node)
            if i is None:
                continue
            led = self.ledger
            for u in uids:
                a = by_uid.get(u)
                if a is not None and a.node == node:
                    led = led.release(a.namespace, a.pod)
            if self._fits_with(i, req, led):
                if uids:
                    out[node] = (list(uids), violations.get(node, 0))
                continue
            left: dict[tuple[str, str], int] = {}
            known: dict[str, int] = {}  # victim UID -> priority, where the ledger knows it
            for u in uids:
                a = by_uid.get(u)
                if a is None or a.node != node:
                    continue
                try:
                    p = self.api.get_pod(a.namespace, a.pod)
                except ApiNotFound:
                    continue
                known[u] = _priority(p)
                budgets.take(p, left)  # the scheduler's victims spend the budgets first
            extra = self._more_victims(i, req, led, node, mine, set(uids), budgets, left)
            if extra is None:
                continue
            added = 0
            chosen = list(uids)
            for uid, p in extra:
                added += budgets.take(p, left)
                prio = _priority(p)
                at = next((k for k, u in enumerate(chosen) if u in known and known[u] < prio),
                          len(chosen))
                chosen.insert(at, uid)
                known[uid] = prio
            out[node] = (chosen, violations.get(node, 0) + added)
        preemptor = (pod.get("metadata") or {}).get("uid")
        if isinstance(preemptor, str) and preemptor and out:  # filter reads them back
            self.remember_offer(preemptor, {node: uids for node, (uids, _) in out.items()})
        return out

    def _more_victims(self, i: int, req: SliceRequest, led: Ledger, node: str, priority: int,
                      already: set[str], budgets: _Budgets, left: dict[tuple[str, str], int]
                      ) -> list[tuple[str, dict[str, Any]]] | None:
        """Pods on ``node`` of lower priority than ``priority`` whose shares, released from
        ``led``, make room for ``req``: as few as will do, those whose disruption budget
        allows it first; (UID, pod) in the order taken. None when they cannot."""
        candidates = []
        for a in led.owners.values():
            if a.node != node or a.pod_uid in already:
                continue
            try:
                p = self.api.get_pod(a.namespace, a.pod)
            except ApiNotFound:
                continue
            if _priority(p) < priority:
                milli = sum(m for m, _ in a.held().values())
                candidates.append((budgets.violates(p, left), _priority(p), milli,
                                   a.namespace, a.pod, a, p))
        candidates.sort(key=lambda c: c[:5])
        taken: list[tuple[Assignment, dict[str, Any]]] = []
        trial = led
        for *_, a, p in candidates:
            trial = trial.release(a.namespace, a.pod)
            taken.append((a, p))
            if self._fits_with(i, req, trial):
                break
        else:
            return None
        for a, p in list(reversed(taken)):  # keep those that turned out not to be needed
            try:
                back = trial.reserve(a)
            except Conflict:
                continue
            if self._fits_with(i, req, back):
                trial = back
                taken.remove((a, p))
        return [(a.pod_uid, p) for a, p in taken]


class _Budgets:
    """PodDisruptionBudgets as preemption counts them: the disruptions each still allows
    (``status.disruptionsAllowed``), read once per namespace per preemption call. ``left``
    maps are the allowances spent on one node (the scheduler counts per node)."""

    def __init__(self, api: KubePort, problems: list[str]) -> None:
        self.api, self.problems = api, problems
        self._by_ns: dict[str, list[dict[str, Any]]] = {}

    def _matching(self, pod: dict[str, Any]) -> list[tuple[tuple[str, str], int]]:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not labels:  # a pod with no labels matches no budget
            return []
        ns = meta.get("namespace", "default")
        if ns not in self._by_ns:
            try:
                self._by_ns[ns] = self.api.list_pod_disruption_budgets(ns)
            except GpusliceError as exc:  # counted as none: the scheduler's own count stays
                self.problems.append(f"preempt: PodDisruptionBudgets of {ns}: {exc}")
                self._by_ns[ns] = []
        out = []
        for pdb in self._by_ns[ns]:
            status = pdb.get("status") or {}
            if not selector_matches((pdb.get("spec") or {}).get("selector"), labels) or \
                    meta.get("name") in (status.get("disruptedPods") or {}):
                continue  # a pod the API server already counts as disrupted is no violation
            allowed = status.get("disruptionsAllowed", 0)
            out.append(((ns, str((pdb.get("metadata") or {}).get("name"))),
                        allowed if isinstance(allowed, int) else 0))
        return out

    def violates(self, pod: dict[str, Any], left: dict[tuple[str, str], int]) -> bool:
        """Whether taking ``pod`` now would overdraw a budget (changes nothing)."""
        return any(left.get(key, allowed) <= 0 for key, allowed in self._matching(pod))

    def take(self, pod: dict[str, Any], left: dict[tuple[str, str], int]) -> int:
        """Spend ``pod``'s budgets in ``left``: 1 if that overdraws one, else 0."""
        over = False
        for key, allowed in self._matching(pod):
            left[key] = left.get(key, allowed) - 1
            over = over or left[key] < 0
        return int(over)


def _priority(pod: dict[str, Any]) -> int:
    """The pod's scheduling priority (``spec.priority``, which admission sets from its
    PriorityClass; 0 without one)."""
    value = (pod.get("spec") or {}).get("priority", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0

