"""The claim allocator's step for held pods that ask for no device (opt-in, through the
webhook's ``--gate-cpu-only``; the objects in :mod:`gpuslice.adapters.kube.cpu_pods`).

Each pass, after the claims: every pod not bound yet that carries the allocator's gate alone,
names no claim and is one to pin (:func:`~gpuslice.adapters.kube.cpu_pods.why_not_pinned`),
oldest first, is placed by the policy on the ledger (``DraLedger.decide`` with no device
request, over the nodes kube-scheduler's NodeUnschedulable and TaintToleration filters pass
for it), counted there at once (so the next pod is decided without that CPU), and released
with a soft pin to that node in the same patch
(:func:`~gpuslice.adapters.kube.cpu_pods.pin_patch`). A pod no node has room for goes
to kube-scheduler at once, with an Event saying so; one left over when the pass's share of
writes is used up stays held for the next pass. A pin refused (the pod changed, or went)
leaves the pod to the next pass; the ledger is set back from the pods at the next sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube.cpu_pods import admits, pin_patch, tolerations_of, why_not_pinned
from gpuslice.adapters.kube.dra_gate import carries_gate
from gpuslice.core.dra_placement import DraLedger
from gpuslice.core.errors import ValidationError
from gpuslice.core.policies import Policy
from gpuslice.services.dra_gate import GateReleaser

PodKey = tuple[str, str]


@dataclass
class PinPass:
    """What one pass did with the held pods without claims: pinned (pod -> node), left to
    kube-scheduler with why (no room on any node it may go to), queued for the next pass."""

    pinned: dict[PodKey, str] = field(default_factory=dict)
    unplaced: dict[PodKey, str] = field(default_factory=dict)
    queued: set[PodKey] = field(default_factory=set)
    refused: set[PodKey] = field(default_factory=set)  # the patch failed: next pass


def held_plain_pods(pods: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods the step places: not bound or being deleted, carrying the allocator's gate
    and no other, naming no claim, of the kind to pin; oldest first."""
    out = []
    for p in pods:
        spec, meta = p.get("spec"), p.get("metadata") or {}
        if not isinstance(spec, Mapping) or not spec.get("schedulingGates") or \
                spec.get("nodeName") or meta.get("deletionTimestamp"):
            continue
        if carries_gate(p) and why_not_pinned(p) is None:
            out.append(p)
    out.sort(key=lambda p: (str(p["metadata"].get("creationTimestamp") or ""),
                            str(p["metadata"].get("name"))))
    return out


class Pinner:
    """Places the held pods without claims (see the module doc) for one allocator."""

    def __init__(self, gate: GateReleaser, policy: Policy, rng: np.random.Generator) -> None:
        self.gate, self.policy, self.rng = gate, policy, rng

    def run(self, ledger: DraLedger, pods: Sequence[dict[str, Any]],
            nodes: Sequence[Mapping[str, Any]], pool: ThreadPoolExecutor | None,
            limit: int) -> PinPass:
        """One pass over ``pods`` (as listed) on ``ledger``; at most ``limit`` pins, written
        side by side on ``pool`` (``None``: here, one by one)."""
        out = PinPass()
        todo = held_plain_pods(pods)
        if not todo:
            return out
        by_name = {str(n["metadata"]["name"]): n for n in nodes}
        masks: dict[str, np.ndarray[Any, np.dtype[np.bool_]]] = {}
        writes: list[tuple[PodKey, str, dict[str, Any], list[dict[str, Any]]]] = []
        for pod in todo:
            meta = pod["metadata"]
            key = (str(meta.get("namespace")), str(meta.get("name")))
            if len(writes) >= limit:
                out.queued.add(key)
                continue
            try:
                cpu, mem = kdra.pod_needs(pod)
            except ValidationError as exc:
                out.unplaced[key] = str(exc)
                continue
            tkey, tolerations = tolerations_of(pod)
            mask = masks.get(tkey)
            if mask is None:
                mask = masks[tkey] = np.array(
                    [(n := by_name.get(d.name)) is not None and admits(tolerations, n)
                     for d in ledger.nodes], dtype=np.bool_)
            dec = ledger.decide(None, self.policy, self.rng, cpu_milli=cpu, memory_mib=mem,
                                only=mask)
            if dec.placement is None:
                out.unplaced[key] = "no node it may go to has room for its CPU and memory " \
                    f"({dec.message()})"
                continue
            node = dec.placement.node
            ledger.apply(dec.placement, ledger.slice_request(None, cpu, mem))
            writes.append((key, node, pod, pin_patch(pod, node)))
        self._write(writes, pool, out)
        return out

    def _write(self, writes: list[tuple[PodKey, str, dict[str, Any], list[dict[str, Any]]]],
               pool: ThreadPoolExecutor | None, out: PinPass) -> None:
        done: list[Future[dict[str, Any] | None] | None] = [
            pool.submit(self.gate.release, pod, ops=ops)
            if pool is not None and len(writes) > 1 else None for _, _, pod, ops in writes]
        for (key, node, pod, ops), fut in zip(writes, done, strict=True):
            got = fut.result() if fut is not None else self.gate.release(pod, ops=ops)
            if got:
                out.pinned[key] = node
            else:
                out.refused.add(key)
