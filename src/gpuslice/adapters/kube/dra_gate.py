"""The claim allocator's scheduling gate on pods, as Kubernetes objects (issue 58): reading
it, the JSON patch that removes it, the one that adds it at admission, and the Event that notes
a release. When a gate comes off is :mod:`gpuslice.core.dra_gate`'s decision.

Who puts the gate on: a pod can only be created with it (``validateOnlyDeletedSchedulingGates``
in kubernetes pkg/apis/core/validation/validation.go: "only deletion is allowed, but found new
scheduling gate"), so either the pod's template carries it (``spec.schedulingGates: [{name:
gpu.gpuslice.io/allocator}]``, which works with no other component) or an admission webhook
adds it on CREATE with :func:`admission_patch`, which gates a pod only when its claim is one the
allocator places and the allocator's Lease is fresh, so that pods created while the allocator
is down go straight to kube-scheduler's own allocation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuslice.adapters.kube.dra import CLASS_KINDS, claim_request
from gpuslice.adapters.kube.dra_common import ALLOCATOR_GATE, DRIVER
from gpuslice.core.errors import ValidationError

__all__ = ["ALLOCATOR_GATE", "GATED_CLASSES", "Admission", "admission_patch", "carries_gate",
           "gate_op", "gates", "pod_event", "removal_patch", "why_not_placed"]
# the classes whose claims the allocator places on devices tainted for it (shares): a pod
# with such a claim is worth gating; whole GPUs and MIG are left to kube-scheduler
GATED_CLASSES: Mapping[str, frozenset[str]] = {"share.gpuslice.io": frozenset({"share"})}


def gates(pod: Mapping[str, Any]) -> list[str]:
    """The names in the pod's ``spec.schedulingGates``, in order (a :class:`ValidationError`
    names a field of the wrong type; the API server admits none)."""
    meta = pod.get("metadata") or {}
    where = f"pod {meta.get('namespace')}/{meta.get('name')}: spec.schedulingGates"
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise ValidationError(f"pod {meta.get('namespace')}/{meta.get('name')}: spec",
                              "an object", spec)
    items = spec.get("schedulingGates") or []
    if not isinstance(items, list):
        raise ValidationError(where, "a list", items)
    out = []
    for i, g in enumerate(items):
        name = g.get("name") if isinstance(g, Mapping) else None
        if not isinstance(name, str):
            raise ValidationError(f"{where}[{i}].name", "a string", name)
        out.append(name)
    return out


def carries_gate(pod: Mapping[str, Any], gate: str = ALLOCATOR_GATE) -> bool:
    """Whether the pod carries ``gate`` (a pod of the wrong shape: no)."""
    try:
        return gate in gates(pod)
    except ValidationError:
        return False


def removal_patch(pod: Mapping[str, Any], gate: str = ALLOCATOR_GATE) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that removes ``gate`` from the pod as it was read: a ``test``
    that the gate is still at its index, then the ``remove``, so a pod whose gates changed
    meanwhile is refused (422) rather than losing another gate."""
    names = gates(pod)
    if gate not in names:
        raise ValidationError("spec.schedulingGates", f"a list holding {gate}", names)
    i = names.index(gate)
    return [{"op": "test", "path": f"/spec/schedulingGates/{i}/name", "value": gate},
            {"op": "remove", "path": f"/spec/schedulingGates/{i}"}]


@dataclass(frozen=True, slots=True)
class Admission:
    """An admission webhook's answer for a pod CREATE: the JSON patch operations (empty:
    leave the pod as it is) and why."""

    ops: tuple[dict[str, Any], ...]
    why: str


def admission_patch(pod: Mapping[str, Any], claim_specs: Sequence[Mapping[str, Any] | None],
                    *, lease_fresh: bool, driver: str = DRIVER,
                    classes: Mapping[str, frozenset[str]] = GATED_CLASSES) -> Admission:
    """The hook an admission webhook calls on a pod CREATE: add the allocator's gate when
    the pod is not bound, names exactly one claim and that claim's spec (``claim_specs[0]``:
    the ResourceClaim's ``spec``, or a ResourceClaimTemplate's ``spec.spec``, which the
    webhook reads; ``None`` if it does not exist) is one request the allocator places on
    devices tainted for it (``classes``), and the allocator's Lease is fresh
    (``lease_fresh``: renewed within its duration; a stale one means pods go to
    kube-scheduler's own allocation, ungated). Never fails the pod: what it cannot read is a
    reason to leave the pod alone."""
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        return Admission((), "the pod has no spec")
    if spec.get("nodeName"):
        return Admission((), "the pod names its node (a gated pod may not)")
    try:
        names = gates(pod)
    except ValidationError as exc:
        return Admission((), str(exc))
    if ALLOCATOR_GATE in names:
        return Admission((), "the pod carries the gate already")
    refs = spec.get("resourceClaims") or []
    if not isinstance(refs, list) or len(refs) != 1 or len(claim_specs) != 1:
        return Admission((), "the allocator places pods with exactly one claim")
    if claim_specs[0] is None:
        return Admission((), "the pod's claim (or its template) does not exist")
    claim = {"metadata": {"namespace": (pod.get("metadata") or {}).get("namespace"),
                          "name": "admission"}, "spec": dict(claim_specs[0])}
    if claim_request(claim, driver, classes) is None:
        return Admission((), f"the claim is not a shape the allocator places "
                         f"({_shapes(classes)})")
    if not lease_fresh:
        return Admission((), "the allocator's Lease is stale: the pod goes to kube-scheduler's "
                         "own allocation")
    return Admission((gate_op(names),), "gated until the allocator has allocated its claim")


def gate_op(names: Sequence[str]) -> dict[str, Any]:
    """The JSON patch operation that adds the allocator's gate to a pod whose gates are
    ``names`` (as :func:`gates` read them): appended, or the list made."""
    gate = {"name": ALLOCATOR_GATE}
    return {"op": "add", "path": "/spec/schedulingGates/-", "value": gate} if names else \
        {"op": "add", "path": "/spec/schedulingGates", "value": [gate]}


def _shapes(classes: Mapping[str, frozenset[str]]) -> str:
    return (f"one request of {' or '.join(sorted(classes))}, ExactCount, no selectors, "
            "constraints, admin access or tolerations")


def why_not_placed(pod: Mapping[str, Any], claims: Sequence[Mapping[str, Any] | None],
                   driver: str = DRIVER,
                   classes: Mapping[str, frozenset[str]] = CLASS_KINDS) -> str:
    """Why the allocator leaves the pod's ``claims`` (as the pod names them; ``None``: not
    there) to kube-scheduler's own allocation, in words for an Event."""
    if len(claims) != 1:
        return f"the pod names {len(claims)} ResourceClaims (the allocator places pods " \
            "with one)"
    claim = claims[0]
    if claim is None:
        return "its ResourceClaim does not exist"
    meta = claim.get("metadata") or {}
    name = f"{meta.get('namespace')}/{meta.get('name')}"
    if meta.get("deletionTimestamp"):
        return f"claim {name} is being deleted"
    if claim_request(claim, driver, classes) is None:
        return f"claim {name} is not a shape the allocator places ({_shapes(classes)})"
    return f"claim {name} is not placed by the allocator"


def pod_event(pod: Mapping[str, Any], reason: str, message: str, *, warning: bool,
              component: str, now: str, suffix: str) -> dict[str, Any]:
    """A core/v1 Event on ``pod`` (what ``kubectl describe pod`` shows): ``now`` an RFC 3339
    time, ``suffix`` what makes its name unique."""
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{suffix}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid", "")},
            "reason": reason, "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": component}, "firstTimestamp": now, "lastTimestamp": now,
            "count": 1}
