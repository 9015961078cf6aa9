"""Pods that ask for no device, placed by the claim allocator's policy (opt-in).

On the DRA path kube-scheduler places every pod that asks for CPU and memory only, by its own
scores (LeastAllocated and BalancedAllocation), and those pods take the CPU and memory that
GPU pods will need on GPU nodes: in the simulator that is 0.4-1.7 points of fragmentation in
the 16-node cells (docs/dra-placement.md, "Why the allocator is behind the simulator's
policy"). With the webhook's ``--gate-cpu-only``, such a pod is created behind the allocator's
gate too; the allocator picks its node with the policy and, in one patch, removes the gate and
adds a *preferred* node-affinity term of weight 100 for that node (a soft pin):

* A gated pod's node affinity may be changed (``validateNodeAffinityMutation`` in kubernetes
  pkg/apis/core/validation/validation.go, called by ``ValidatePodUpdate`` while the old pod
  has scheduling gates: the required terms may only be narrowed, the preferred ones are free).
* In kube-scheduler's default profile NodeAffinity's score has weight 2 and is normalized to
  0..100, so the pinned node gets 200 more than any other, more than NodeResourcesFit and
  NodeResourcesBalancedAllocation (weight 1 each) can set apart; when the pinned node no
  longer fits (its Filter fails) the pod still goes where kube-scheduler would have put it:
  a pin never leaves a pod pending.

Which pods: not bound, on the default scheduler, with no node selector, node affinity, pod
(anti-)affinity or topology spread constraints (a soft pin would outweigh those wishes), no
claim, and not gated by anyone else. Which nodes: those kube-scheduler's NodeUnschedulable
and TaintToleration filters pass for the pod and that carry no PreferNoSchedule taint it does
not tolerate (TaintToleration's score, weight 3, would outweigh the pin) (:func:`admits`),
read at the source: ``(*Toleration).ToleratesTaint`` in k8s.io/api core/v1/toleration.go,
the taint effects of ``Filter`` and ``Score`` in
pkg/scheduler/framework/plugins/tainttoleration/taint_toleration.go.
The pod's node until it is bound, for the allocator's ledger: :data:`PINNED_TO`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpuslice.adapters.kube.dra_common import ALLOCATOR_GATE
from gpuslice.adapters.kube.dra_gate import Admission, gate_op, gates, removal_patch
from gpuslice.core.errors import ValidationError

# the node the allocator pinned a pod to (an annotation, set with the pin): the allocator
# counts the pod's CPU and memory there until it is bound
PINNED_TO = "gpu.gpuslice.io/pinned-to"
PIN_WEIGHT = 100  # the highest weight a preferred term may have (validation: 1-100)
# TaintToleration's Filter looks at NoSchedule and NoExecute taints; its Score (weight 3 in the
# default profile, more than the pin's 2) counts the PreferNoSchedule ones a pod does not
# tolerate: a pin to such a node could lose, so the allocator does not pin there either
AVOIDED_EFFECTS = frozenset({"NoSchedule", "NoExecute", "PreferNoSchedule"})
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"  # NodeUnschedulable's toleration
DEFAULT_SCHEDULER = "default-scheduler"


def why_not_pinned(pod: Mapping[str, Any]) -> str | None:
    """Why a pod is not one the allocator places without a claim (``None``: it is)."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return "the pod has no spec"
    if spec.get("resourceClaims"):
        return "the pod names a ResourceClaim"
    if spec.get("nodeName"):
        return "the pod names its node"
    if spec.get("schedulerName") not in (None, "", DEFAULT_SCHEDULER):
        return f"the pod is for scheduler {spec.get('schedulerName')!r}"
    if spec.get("nodeSelector"):
        return "the pod has a node selector"
    affinity = spec.get("affinity")
    if isinstance(affinity, Mapping) and any(affinity.get(k) for k in (
            "nodeAffinity", "podAffinity", "podAntiAffinity")):
        return "the pod has affinity rules (a pin would outweigh them)"
    if affinity is not None and not isinstance(affinity, Mapping):
        return "spec.affinity: expected an object"
    if spec.get("topologySpreadConstraints"):
        return "the pod has topology spread constraints (a pin would outweigh them)"
    try:
        names = gates(pod)
    except ValidationError as exc:
        return str(exc)
    if any(n != ALLOCATOR_GATE for n in names):
        return "the pod carries another scheduling gate"
    return None


def cpu_only_admission(pod: Mapping[str, Any], *, lease_fresh: bool) -> Admission:
    """The webhook's answer for a pod CREATE that names no claim, with ``--gate-cpu-only``:
    the allocator's gate when the pod is one it places (:func:`why_not_pinned`) and its Lease
    is fresh."""
    why = why_not_pinned(pod)
    if why is not None:
        return Admission((), why)
    names = gates(pod)
    if ALLOCATOR_GATE in names:
        return Admission((), "the pod carries the gate already")
    if not lease_fresh:
        return Admission((), "the allocator's Lease is stale: the pod goes to kube-scheduler")
    return Admission((gate_op(names),), "gated until the allocator has chosen its node")


def pin_patch(pod: Mapping[str, Any], node: str) -> list[dict[str, Any]]:
    """The JSON patch that removes the allocator's gate from ``pod`` (as read: refused if its
    gates changed) and, in the same write, pins it softly to ``node``: a preferred
    node-affinity term of weight 100 on ``metadata.name`` and the :data:`PINNED_TO`
    annotation. A :class:`ValidationError` for a pod that is not one to pin."""
    why = why_not_pinned(pod)
    if why is not None:
        raise ValidationError("pod", "a pod the allocator places without a claim", why)
    ops = removal_patch(pod, ALLOCATOR_GATE)
    term = {"weight": PIN_WEIGHT, "preference": {"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [node]}]}}
    node_affinity = {"preferredDuringSchedulingIgnoredDuringExecution": [term]}
    spec = pod.get("spec") or {}
    if isinstance(spec.get("affinity"), Mapping):
        ops.append({"op": "add", "path": "/spec/affinity/nodeAffinity",
                    "value": node_affinity})
    else:
        ops.append({"op": "add", "path": "/spec/affinity",
                    "value": {"nodeAffinity": node_affinity}})
    meta = pod.get("metadata") or {}
    if isinstance(meta.get("annotations"), Mapping):
        ops.append({"op": "add", "path": "/metadata/annotations/" +
                    PINNED_TO.replace("~", "~0").replace("/", "~1"), "value": node})
    else:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {PINNED_TO: node}})
    return ops


def pinned_node(pod: Mapping[str, Any]) -> str | None:
    """The node the allocator pinned a pod to (its :data:`PINNED_TO` annotation), if any."""
    annotations = (pod.get("metadata") or {}).get("annotations")
    node = annotations.get(PINNED_TO) if isinstance(annotations, Mapping) else None
    return node if isinstance(node, str) and node else None


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """``(*Toleration).ToleratesTaint`` (k8s.io/api core/v1/toleration.go): an empty effect
    matches every effect, an empty key every key (with Exists), Exists every value, Equal
    (or no operator) the same value. The numeric operators (Lt, Gt: behind a feature gate)
    are not matched here: a node they would open is one the allocator does not pin to."""
    effect, key = toleration.get("effect") or "", toleration.get("key") or ""
    if effect and effect != taint.get("effect"):
        return False
    if key and key != taint.get("key"):
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Exists":
        return True
    if op == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def admits(tolerations: Sequence[Mapping[str, Any]], node: Mapping[str, Any]) -> bool:
    """Whether the allocator may pin a pod with ``tolerations`` to ``node``: kube-scheduler's
    NodeUnschedulable and TaintToleration filters pass it there (the node is not cordoned,
    or the pod tolerates ``node.kubernetes.io/unschedulable:NoSchedule``; every NoSchedule
    and NoExecute taint is tolerated) and no PreferNoSchedule taint it does not tolerate
    would outweigh the pin. A field of the wrong type counts as not admitting."""
    spec = node.get("spec") or {}
    if not isinstance(spec, Mapping):
        return False
    if spec.get("unschedulable") and not any(
            tolerates(t, {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
            for t in tolerations):
        return False
    taints = spec.get("taints") or []
    if not isinstance(taints, list):
        return False
    for taint in taints:
        if not isinstance(taint, Mapping):
            return False
        if taint.get("effect") in AVOIDED_EFFECTS and \
                not any(tolerates(t, taint) for t in tolerations):
            return False
    return True


def tolerations_of(pod: Mapping[str, Any]) -> tuple[str, list[Mapping[str, Any]]]:
    """The pod's ``spec.tolerations`` and a key for them (pods with the same tolerations pass
    the same nodes); entries of the wrong type are dropped (they tolerate nothing)."""
    items = (pod.get("spec") or {}).get("tolerations") or []
    if not isinstance(items, list):
        items = []
    kept = [t for t in items if isinstance(t, Mapping)]
    return json.dumps(kept, sort_keys=True, default=str), kept
