"""The webhook's wire format and its shell around the policy (core.admission).

An ``admission.k8s.io/v1`` AdmissionReview (k8s.io/api admission/v1 types.go) comes in with a
``request``: ``uid``, ``kind``, ``operation``, ``namespace``, ``object`` (the pod, defaulted,
its name empty when the API server is still to generate it) and ``dryRun``. The answer is an
AdmissionReview of the same apiVersion and kind with a ``response``: ``uid`` (copied),
``allowed``, and for a mutation ``patchType: JSONPatch`` with ``patch``, the RFC 6902
operations as base64 JSON (the API server refuses a patch without its patchType and the
reverse: ``VerifyAdmissionResponse`` in k8s.io/apiserver .../webhook/request/
admissionreview.go); a refusal has ``status: {code, message}``; ``warnings`` reach the client.

A review that cannot be read is answered with a refusal that says why (never an exception).
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpuslice.adapters.kube.dra_gate import ALLOCATOR_GATE, Admission
from gpuslice.adapters.kube.jsonpatch import apply_json_patch, json_pointer
from gpuslice.adapters.kube.objects import pod_containers, pod_request
from gpuslice.adapters.kube.ports import ApiInvalid
from gpuslice.core import admission as policy
from gpuslice.core.admission import ContainerAsk, Decision, Fleet, Options, PodAsk
from gpuslice.core.errors import ValidationError
from gpuslice.core.gpuselect import selection
from gpuslice.core.podrequest import ContainerKind

# the claim allocator's gate at admission: (pod, namespace) -> the patch that adds it, and why
Gate = Callable[[Mapping[str, Any], str], Admission]

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
REFUSED_CODE = 403  # kubectl: "Error from server (Forbidden): admission webhook ... denied"
BAD_REVIEW_CODE = 400
WARNING_MAX = 256  # the API server truncates longer warnings


@dataclass(frozen=True, slots=True)
class Review:
    """The parts of an AdmissionRequest the webhook reads."""

    uid: str
    kind: str
    operation: str
    namespace: str
    pod: dict[str, Any]


class BadReview(ValueError):
    """An AdmissionReview that cannot be read: answered with a refusal (``uid`` when one was
    there) instead of an error."""

    def __init__(self, message: str, uid: str = "") -> None:
        super().__init__(message)
        self.uid = uid


def read_review(doc: object) -> Review:
    """The request of an AdmissionReview v1, checked field by field."""
    if not isinstance(doc, dict):
        raise BadReview("the body is not a JSON object (an AdmissionReview)")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise BadReview(f"apiVersion/kind: expected {API_VERSION} {KIND}, got "
                        f"{doc.get('apiVersion')!r} {doc.get('kind')!r} (admissionReviewVersions"
                        " must list v1)")
    req = doc.get("request")
    if not isinstance(req, dict):
        raise BadReview("request: expected an AdmissionRequest object")
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("request.uid: expected the request's UID")
    kind: dict[str, Any] = req["kind"] if isinstance(req.get("kind"), dict) else {}
    operation = req.get("operation")
    namespace = req.get("namespace") or ""
    pod = req.get("object")
    if not isinstance(operation, str) or not isinstance(namespace, str):
        raise BadReview("request.operation/namespace: expected strings", uid)
    if not isinstance(pod, dict) and operation in ("CREATE", "UPDATE"):
        raise BadReview("request.object: expected the object", uid)
    return Review(uid, str(kind.get("kind", "")), operation, namespace,
                  pod if isinstance(pod, dict) else {})


def _int(value: float | None, field: str) -> int | None:
    if value is None:
        return None
    if value != int(value):
        raise ValidationError(field, "a whole number", value)
    return int(value)


def _annotation_int(ann: Mapping[str, Any], key: str, where: str) -> int | None:
    raw = ann.get(key)
    if raw is None:
        return None
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise ValidationError(f"{where}: annotation {key}", "a whole number", raw)
    return int(text)


def pod_ask(pod: dict[str, Any], namespace: str) -> PodAsk:
    """What the policy reads of ``pod``; a value that is not one is a :class:`ValidationError`
    naming its field."""
    meta: dict[str, Any] = pod["metadata"] if isinstance(pod.get("metadata"), dict) else {}
    name = meta.get("name") or f"{meta.get('generateName') or ''}<generated>"
    where = f"pod {namespace}/{name}"
    # read with the namespace of the request and a name (the API server may not have
    # generated it yet), so that every field a problem names starts with the pod
    pod = {**pod, "metadata": {**meta, "namespace": meta.get("namespace") or namespace,
                               "name": name}}
    ann_raw = meta.get("annotations") or {}
    if not isinstance(ann_raw, dict):
        raise ValidationError(f"{where}: metadata.annotations", "an object",
                              type(ann_raw).__name__)
    ann = {str(k): str(v) for k, v in ann_raw.items()}
    spec: dict[str, Any] = pod["spec"] if isinstance(pod.get("spec"), dict) else {}
    asks = []
    for c in pod_containers(pod):
        path = f"spec.{'containers' if c.kind is ContainerKind.APP else 'initContainers'}" \
            f"[{c.index}]"
        both = {**c.requests, **c.limits}

        def get(key: str, c_path: str = path, got: dict[str, float] = both) -> int | None:
            return _int(got.get(key), f"{where}: {c_path}.resources {key}")

        asks.append(ContainerAsk(
            path, c.name, c.kind, gpus=get(policy.GPU), milli=get(policy.GPU_MILLI),
            memory_mib=get(policy.GPU_MEMORY), nvidia_gpus=get(policy.NVIDIA_GPU),
            hami_cores=get(policy.HAMI_CORES), hami_memory_mib=get(policy.HAMI_MEMORY),
            hami_memory_percent=get(policy.HAMI_MEMORY_PERCENT)))
    return PodAsk(where, str(spec.get("schedulerName") or ""), tuple(asks), ann,
                  selection(ann, where),
                  _annotation_int(ann, policy.MILLI_ANNOTATION, where),
                  _annotation_int(ann, policy.MEMORY_ANNOTATION, where))


def _container(pod: dict[str, Any], path: str) -> tuple[dict[str, Any], list[str]]:
    """The container at ``spec.containers[0]`` and its JSON pointer parts."""
    field, _, index = path.removeprefix("spec.").rstrip("]").partition("[")
    return pod["spec"][field][int(index)], ["spec", field, index]


def patch_ops(pod: dict[str, Any], decision: Decision) -> list[dict[str, Any]]:
    """The RFC 6902 operations that make ``decision``'s changes to ``pod``: each changed
    container's ``resources`` written whole (requests and limits alike for the GPU resources,
    the translated ones taken out), ``schedulerName``, and the changes annotation."""
    ops: list[dict[str, Any]] = []
    for change in decision.containers:
        c, parts = _container(pod, change.path)
        res = copy.deepcopy(c.get("resources") or {})
        for side in ("requests", "limits"):
            values = dict(res.get(side) or {})
            for name in change.remove:
                values.pop(name, None)
            values.update({k: str(v) for k, v in change.resources.items()})
            res[side] = values
        ops.append({"op": "add", "path": json_pointer(*parts, "resources"), "value": res})
    if decision.scheduler_name is not None:
        ops.append({"op": "add", "path": "/spec/schedulerName",
                    "value": decision.scheduler_name})
    if decision.changes:
        text = "; ".join(decision.changes)
        meta = pod.get("metadata") or {}
        if not isinstance(meta.get("annotations"), dict):
            ops.append({"op": "add", "path": "/metadata/annotations",
                        "value": {policy.CHANGES_ANNOTATION: text}})
        else:
            ops.append({"op": "add", "path": json_pointer(
                "metadata", "annotations", policy.CHANGES_ANNOTATION), "value": text})
    return ops


def decide(review: Review, fleet: Fleet, opts: Options, gate: Gate | None = None,
           ) -> tuple[Decision, list[dict[str, Any]]]:
    """The decision for a review and its patch. Only pods being created are judged; the pod
    as patched must read as the extender reads it (adapters.kube.objects.pod_request), or it
    is refused with what the extender would say. ``gate`` (services.webhook.gate.DraGate)
    adds the claim allocator's scheduling gate to a pod whose claim it places."""
    if review.kind != "Pod" or review.operation != "CREATE":
        return Decision(True), []
    try:
        ask = pod_ask(review.pod, review.namespace)
    except ValidationError as exc:
        return policy.refuse(str(exc)), []
    decision = policy.admit(ask, fleet, opts)
    if not decision.allowed:
        return decision, []
    gated: tuple[dict[str, Any], ...] = ()
    if gate is not None:
        admitted = gate(review.pod, review.namespace)
        gated = admitted.ops
        if gated:
            decision = replace(decision, changes=(
                *decision.changes, f"spec.schedulingGates: {ALLOCATOR_GATE} ({admitted.why})"))
    if not decision.changed and not gated:
        return decision, []
    ops = patch_ops(review.pod, decision) + list(gated)
    try:
        patched = apply_json_patch(review.pod, ops)
        meta = patched.setdefault("metadata", {})
        meta.setdefault("namespace", review.namespace)
        pod_request(patched)
    except (ValidationError, ApiInvalid) as exc:
        return policy.refuse(str(exc)), []
    return decision, ops


def answer(uid: str, decision: Decision, ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The AdmissionReview that answers ``uid``."""
    response: dict[str, Any] = {"uid": uid, "allowed": decision.allowed}
    if not decision.allowed:
        response["status"] = {"code": REFUSED_CODE, "reason": "Forbidden",
                              "message": decision.refusal}
    elif ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    if decision.warnings:
        response["warnings"] = [w[:WARNING_MAX] for w in decision.warnings]
    if decision.changes:
        response["auditAnnotations"] = {"changes": "; ".join(decision.changes)[:1024]}
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}


def bad_answer(exc: BadReview) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "response": {
        "uid": exc.uid, "allowed": False,
        "status": {"code": BAD_REVIEW_CODE, "reason": "BadRequest",
                   "message": f"gpuslice webhook: {exc}"}}}


def review_of(body: bytes, fleet: Fleet, opts: Options, gate: Gate | None = None,
              ) -> tuple[dict[str, Any], str]:
    """The answer to a request body, and what happened (``mutated``, ``unchanged``,
    ``refused``, ``bad-review``) for the metrics and the log. With ``gate`` it may read the
    API server: call it on a worker thread."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return bad_answer(BadReview(f"the body is not JSON: {exc}")), "bad-review"
    try:
        review = read_review(doc)
    except BadReview as exc:
        return bad_answer(exc), "bad-review"
    decision, ops = decide(review, fleet, opts, gate)
    result = "refused" if not decision.allowed else "mutated" if ops else "unchanged"
    return answer(review.uid, decision, ops), result
