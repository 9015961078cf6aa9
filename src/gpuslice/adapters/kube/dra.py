"""resource.k8s.io/v1 objects as the claim allocator sees them (plain JSON in, core types out;
the slices read in .dra_slices, the field readers and the memo in .dra_common).

* ResourceSlices of our driver become :class:`DraNode` (core.dra_placement) devices in the order
  the scheduler's allocator tries them: only node-local slices, only each pool's newest
  generation and only complete pools (``resourceSliceCount`` slices of it), pools sorted by
  name, slices by name, devices in slice order (``GatherPools``, ``buildPool``). Devices that
  consume shared counters (partitionable MIG) or carry a taint other than ours are left out:
  the allocator never gives them.
* A pool is left out whole (and the problem named, in ``problems``) when its newest slices name
  one device twice (upstream ``GatherPools`` marks such a pool invalid and allocates nothing
  from it), or when one of its slices has a field of the wrong type: the API server's
  validation never lets either through, so they come from a broken writer, and one of them
  must not stop the allocator for every other node.
* Allocated claims become :class:`Usage` (core.dra_placement) per device (``foreachAllocatedDevice``
  in the scheduler's allocateddevices.go: a result with a ``shareID`` is a share that consumed
  ``consumedCapacity``; one without took the device; admin access takes nothing).
* A pending claim becomes a :class:`DeviceRequest` (core.dra_placement) when it is a shape we
  place (one ``exactly`` request of a class we know, ExactCount, no selectors, constraints, admin
  access or tolerations); anything else is left to the default allocator.
* A decision becomes ``status.allocation``: the results (with ``shareID`` and
  ``consumedCapacity`` for shares), the class and claim configs for the driver, and a node
  selector on ``metadata.name``, as the scheduler writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from gpuslice.adapters.kube import dra_common, dra_slices
from gpuslice.adapters.kube.dra_common import (
    _dict,
    _int,
    _list,
    _memo,
    _name,
    _whole,
)
from gpuslice.adapters.kube.objects import node_allocatable as _allocatable_of
from gpuslice.adapters.kube.objects import pod_cpu_memory, pod_finished
from gpuslice.core.dra_placement import (
    DeviceRequest,
    DraPlacement,
    Usage,
)
from gpuslice.core.errors import ValidationError, note_once
from gpuslice.core.gpuselect import accepted_models

# our driver's names and the slices' devices, this module's too
DRIVER = dra_common.DRIVER
ALLOCATOR_TAINT = dra_common.ALLOCATOR_TAINT
ALLOCATOR_GATE = dra_common.ALLOCATOR_GATE
MEMO_MAX = dra_common.MEMO_MAX
slice_devices = dra_slices.slice_devices
FINALIZER = "resource.kubernetes.io/delete-protection"
# device class -> the device ``type`` attributes it selects (our DeviceClasses' CEL)
CLASS_KINDS: Mapping[str, frozenset[str]] = {
    "gpu.gpuslice.io": frozenset({"gpu"}),
    "share.gpuslice.io": frozenset({"share"}),
}


def claim_usage(claims: Sequence[Mapping[str, Any]], driver: str = DRIVER,
                problems: list[str] | None = None) -> dict[tuple[str, str], Usage]:
    """What the allocated claims took of each of our devices."""
    usage: dict[tuple[str, str], Usage] = {}
    for c in claims:
        for key, whole, consumed in claim_took(c, driver, problems):
            usage[key] = usage.get(key, Usage()).plus(whole, consumed)
    return usage


Took = tuple[tuple[tuple[str, str], bool, dict[str, int]], ...]


def _allocation(c: Mapping[str, Any]) -> object:
    status = c.get("status")
    return status.get("allocation") if isinstance(status, Mapping) else None


def is_allocated(claim: Mapping[str, Any]) -> bool:
    """Whether the claim has a ``status.allocation`` (whoever wrote it)."""
    return bool(_allocation(claim))


def claim_took(c: Mapping[str, Any], driver: str = DRIVER,
               problems: list[str] | None = None) -> Took:
    """One claim's results on our devices: (pool, device), taken whole, what a share
    consumed; ``()`` while it is not allocated. A result of the wrong shape is noted in
    ``problems``: one that names a device still takes it (whole: what it consumed is not
    known, and a device must not be given twice), any other is passed over."""
    if not _allocation(c):
        return ()
    took, problem = _memo("usage", c, partial(_claim_took, c, driver), driver)
    if problem is not None:
        note_once(problems, problem)
    return took


def _claim_took(c: Mapping[str, Any], driver: str) -> tuple[Took, str | None]:
    where = f"claim {_claim_key(c)}: status.allocation"
    out: list[tuple[tuple[str, str], bool, dict[str, int]]] = []
    problem: str | None = None
    try:
        devices = _dict(_dict(_allocation(c), where).get("devices"), f"{where}.devices")
        results = _list(devices.get("results"), f"{where}.devices.results")
    except ValidationError as exc:
        return (), f"{exc}: its devices are not counted"
    for i, r in enumerate(results):
        at = f"{where}.devices.results[{i}]"
        if not isinstance(r, Mapping):
            problem = problem or f"{at}: expected an object, got {type(r).__name__}: " \
                "not counted"
            continue
        if r.get("driver") != driver or r.get("adminAccess"):
            continue
        pool, device = r.get("pool"), r.get("device")
        if not isinstance(pool, str) or not isinstance(device, str):
            problem = problem or f"{at}: expected a pool and a device name (strings), got " \
                f"{pool!r} and {device!r}: not counted"
            continue
        shared = r.get("shareID") is not None
        try:
            consumed = {_name(str(k), driver): _int(v, f"{at}.consumedCapacity {k}")
                        for k, v in _dict(r.get("consumedCapacity"),
                                          f"{at}.consumedCapacity").items()}
        except ValidationError as exc:  # what the share took is not known: all of it
            problem = problem or f"{exc}: device {pool}/{device} counted as taken whole"
            shared, consumed = False, {}
        out.append(((pool, device), not shared, consumed if shared else {}))
    return tuple(out), problem


def _claim_key(c: Mapping[str, Any]) -> str:
    meta = c.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def pod_needs(pod: Mapping[str, Any]) -> tuple[int, int]:
    """A pod's CPU (milli) and memory (MiB) requests as kube-scheduler counts them
    (objects.pod_cpu_memory: init containers, sidecars, overhead, pod-level requests)."""
    return _memo("pod", pod, lambda: pod_cpu_memory(dict(pod)))


def pod_claim_name(pod: Mapping[str, Any], ref: Mapping[str, Any]) -> str | None:
    """The ResourceClaim a pod's ``spec.resourceClaims`` entry names: its
    ``resourceClaimName``, or for a template the generated name in the pod's status. A
    :class:`ValidationError` names a field of the wrong type."""
    name = ref.get("resourceClaimName")
    if not name:
        status = _dict(pod.get("status"), "status")
        for i, item in enumerate(_list(status.get("resourceClaimStatuses"),
                                       "status.resourceClaimStatuses")):
            st = _dict(item, f"status.resourceClaimStatuses[{i}]")
            if st.get("name") == ref.get("name"):
                name = st.get("resourceClaimName")
    if name and not isinstance(name, str):
        raise ValidationError("resourceClaimName", "a string", name)
    return name or None


def allocated_node(claim: Mapping[str, Any]) -> str | None:
    """The one node an allocated claim is bound to (its ``nodeSelector`` names a single
    ``metadata.name``, as kube-scheduler and we write it), else ``None``. A
    :class:`ValidationError` names a field of the wrong type."""
    try:
        return _allocated_node(claim)
    except ValidationError as exc:
        raise ValidationError(f"claim {_claim_key(claim)}: {exc.field}", exc.expected,
                              exc.got) from None


def _allocated_node(claim: Mapping[str, Any]) -> str | None:
    sel = _dict(_dict(_allocation(claim), "status.allocation").get("nodeSelector"),
                "status.allocation.nodeSelector")
    terms = _list(sel.get("nodeSelectorTerms"), "status.allocation.nodeSelector."
                  "nodeSelectorTerms")
    if len(terms) != 1:
        return None
    term = _dict(terms[0], "status.allocation.nodeSelector.nodeSelectorTerms[0]")
    fields = _list(term.get("matchFields"), "status.allocation.nodeSelector."
                   "nodeSelectorTerms[0].matchFields")
    if len(fields) != 1 or term.get("matchExpressions"):
        return None
    f = _dict(fields[0], "status.allocation.nodeSelector.nodeSelectorTerms[0].matchFields[0]")
    values = _list(f.get("values"), "status.allocation.nodeSelector.nodeSelectorTerms[0]."
                   "matchFields[0].values")
    if f.get("key") == "metadata.name" and f.get("operator") == "In" and len(values) == 1:
        return str(values[0])
    return None


def node_allocatable(node: Mapping[str, Any]) -> tuple[int, int]:
    """A node's allocatable CPU (milli) and memory (MiB)."""
    return _memo("node", node, partial(_allocatable_of, node))




ClaimKey = tuple[str | None, str | None]


def pod_claims(pod: Mapping[str, Any]) -> tuple[ClaimKey, ...]:
    """The (namespace, name) of each claim in the pod's ``spec.resourceClaims``, in order
    (the name ``None`` while a template's claim is not generated yet). A
    :class:`ValidationError` names a field of the wrong type."""
    meta = pod["metadata"]
    ns = meta.get("namespace")
    try:
        refs = _list(_dict(pod.get("spec"), "spec").get("resourceClaims"),
                     "spec.resourceClaims")
        return tuple((ns, pod_claim_name(pod, ref if type(ref) is dict else
                                         _dict(ref, f"spec.resourceClaims[{i}]")))
                     for i, ref in enumerate(refs))
    except ValidationError as exc:
        raise ValidationError(f"pod {ns}/{meta.get('name')}: {exc.field}", exc.expected,
                              exc.got) from None


def pod_node(pod: Mapping[str, Any], claims: Sequence[ClaimKey],
             claim_node: Callable[[ClaimKey], str | None]) -> str | None:
    """The node whose CPU and memory the pod counts on: the one it is bound to; for a pod not
    bound yet (nor being deleted) the node its first allocated claim (``claims``, resolved by
    ``claim_node``) is bound to, as the scheduler will put it there (counting it keeps a
    second claim from being placed on CPU the first pod's bind is about to take); ``None``
    for a finished pod or one with nowhere to go yet."""
    if pod_finished(pod):
        return None
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        return str(node)
    if pod["metadata"].get("deletionTimestamp"):
        return None
    for key in claims:
        node = claim_node(key)
        if node:
            return str(node)
    return None


@dataclass(frozen=True)
class PendingClaim:
    claim: dict[str, Any]
    pod: dict[str, Any]
    request: DeviceRequest
    cpu_milli: int
    memory_mib: int


def claim_request(claim: Mapping[str, Any], driver: str = DRIVER,
                  classes: Mapping[str, frozenset[str]] = CLASS_KINDS,
                  problems: list[str] | None = None) -> DeviceRequest | None:
    """The claim as one device request, or ``None`` when it is a shape we leave to the
    default allocator; a field of the wrong type or value leaves it there too, and is noted
    in ``problems``."""
    kinds = "default" if classes is CLASS_KINDS else \
        tuple(sorted((k, tuple(sorted(v))) for k, v in classes.items()))
    req, problem = _memo("claim", claim, lambda: _claim_request(claim, driver, classes),
                         driver, kinds)
    if problem is not None:
        note_once(problems, problem)
    return req


def _claim_request(claim: Mapping[str, Any], driver: str,
                   classes: Mapping[str, frozenset[str]]) -> \
        tuple[DeviceRequest | None, str | None]:
    where = f"claim {_claim_key(claim)}: spec.devices"
    try:
        devices = _dict(_dict(claim.get("spec"), "claim spec").get("devices"), where)
        reqs = _list(devices.get("requests"), f"{where}.requests")
        if len(reqs) != 1 or devices.get("constraints"):
            return None, None
        req = _dict(reqs[0], f"{where}.requests[0]")
        exactly = _dict(req.get("exactly"), f"{where}.requests[0].exactly")
        cls = exactly.get("deviceClassName")
        if not isinstance(cls, str) or cls not in classes:
            return None, None
        if exactly.get("selectors") or exactly.get("adminAccess") or \
                exactly.get("tolerations"):
            return None, None
        if exactly.get("allocationMode", "ExactCount") != "ExactCount":
            return None, None
        at = f"{where}.requests[0].exactly"
        caps = _dict(_dict(exactly.get("capacity"), f"{at}.capacity").get("requests"),
                     f"{at}.capacity.requests")
        name = req.get("name") or ""
        if not isinstance(name, str):
            raise ValidationError(f"{where}.requests[0].name", "a string", name)
        return DeviceRequest(
            name, _whole(exactly.get("count") or 1, f"{at}.count", 1),
            {_name(str(k), driver): _int(v, f"{at}.capacity.requests {k}")
             for k, v in caps.items()},
            classes[cls]), None
    except ValidationError as exc:
        return None, f"{exc}: claim left to the default allocator"


def pending_claims(pods: Sequence[Mapping[str, Any]], claims: Sequence[Mapping[str, Any]],
                   driver: str = DRIVER,
                   classes: Mapping[str, frozenset[str]] = CLASS_KINDS) -> list[PendingClaim]:
    """Unallocated claims we place, of pods that no scheduler has bound yet (one claim per
    pod; a pod with several claims, or a scheduling gate other than the allocator's own, is
    left alone), oldest pod first."""
    by_name = {(c["metadata"].get("namespace"), c["metadata"]["name"]): c for c in claims}
    out: list[PendingClaim] = []
    for p in sorted(pods, key=lambda p: (str(p["metadata"].get("creationTimestamp") or ""),
                                         str(p["metadata"]["name"]))):
        spec, meta = p.get("spec"), p["metadata"]
        if not isinstance(spec, Mapping) or spec.get("nodeName") \
                or meta.get("deletionTimestamp") or _gated_by_others(spec):
            continue
        try:  # a pod of the wrong shape is left alone (the allocator notes it)
            keys = pod_claims(p)
            if len(keys) != 1:
                continue
            claim = by_name.get(keys[0])
            if claim is None or _allocation(claim) \
                    or claim["metadata"].get("deletionTimestamp"):
                continue
            req = claim_request(claim, driver, classes)
            if req is None:
                continue
            models = accepted_models(meta.get("annotations") or {}, f"pod {keys[0][0]}/"
                                     f"{meta.get('name')}")  # core.gpuselect's rule
            if models:
                req = replace(req, models=models)
            cpu, mem = pod_needs(p)
        except ValidationError:
            continue
        out.append(PendingClaim(dict(claim), dict(p), req, cpu, mem))
    return out


def reservation(pod: Mapping[str, Any]) -> dict[str, str] | None:
    """The ``status.reservedFor`` entry naming ``pod`` (core group, ``pods``, name and UID;
    None for a pod without both). Written with the allocation, kube-scheduler's PreBind
    finds the claim reserved for the pod and writes nothing (``resourceclaim.IsReservedForPod``
    in dynamicresources.go ``PreBind``); its PostFilter still releases a claim reserved for
    that pod alone when the claim's node cannot take it, and kube-controller-manager's
    resourceclaim controller (``syncClaim``) drops the entry, and with it the allocation,
    when the pod is deleted before it runs."""
    meta = pod.get("metadata")
    name, uid = (meta.get("name"), meta.get("uid")) if isinstance(meta, Mapping) else (None,
                                                                                        None)
    if not isinstance(name, str) or not isinstance(uid, str) or not name or not uid:
        return None
    return {"resource": "pods", "name": name, "uid": uid}


def _gated_by_others(spec: Mapping[str, Any]) -> bool:
    """Whether the pod spec carries a scheduling gate other than the allocator's (or gates of
    the wrong shape): someone else holds that pod."""
    items = spec.get("schedulingGates") or []
    return not isinstance(items, list) or any(
        not isinstance(g, Mapping) or g.get("name") != ALLOCATOR_GATE for g in items)


def allocation(claim: Mapping[str, Any], placement: DraPlacement,
               classes: Sequence[Mapping[str, Any]], new_share_id: Callable[[], str],
               driver: str = DRIVER, allocated_at: str | None = None) -> dict[str, Any]:
    """``status.allocation`` for ``placement``: results, configs (class first, then claim,
    as the scheduler orders them), the node selector and ``allocationTimestamp``
    (``allocated_at``, RFC 3339). kube-scheduler 1.36 sets that field on every allocation it
    binds: for a claim allocated without it, its PreBind (``bindClaim``, adding the pod to
    ``reservedFor``) writes the allocation back with a timestamp, which the API server refuses
    ("status.allocation: field is immutable"), and the pod never binds (seen on the dev
    cluster's v1.36.3). A config of the wrong shape (the class's or the claim's) is a
    :class:`ValidationError` naming it: that claim is not allocated."""
    results: list[dict[str, Any]] = []
    for r in placement.results:
        res: dict[str, Any] = {"request": r.request, "driver": driver, "pool": r.pool,
                               "device": r.device}
        if r.shared:
            res["shareID"] = new_share_id()
            res["consumedCapacity"] = {k: str(v) for k, v in r.consumed.items()}
        results.append(res)
    config: list[dict[str, Any]] = []
    where = f"claim {_claim_key(claim)}: spec.devices"
    spec = _dict(_dict(claim.get("spec"), "claim spec").get("devices"), where)
    for i, item in enumerate(_list(spec.get("requests"), f"{where}.requests")):
        req = _dict(item, f"{where}.requests[{i}]")
        cls = _dict(req.get("exactly"), f"{where}.requests[{i}].exactly") \
            .get("deviceClassName")
        for c in classes:
            if c["metadata"]["name"] == cls:
                at = f"deviceclass {cls}: spec.config"
                for j, cfg in enumerate(_list(_dict(c.get("spec"), f"deviceclass {cls}: spec")
                                              .get("config"), at)):
                    config.append({"source": "FromClass", "requests": [req.get("name")],
                                   "opaque": _dict(cfg, f"{at}[{j}]").get("opaque")})
    for j, item in enumerate(_list(spec.get("config"), f"{where}.config")):
        cfg = _dict(item, f"{where}.config[{j}]")
        entry = {"source": "FromClaim", "opaque": cfg.get("opaque")}
        if cfg.get("requests"):
            entry["requests"] = list(_list(cfg["requests"], f"{where}.config[{j}].requests"))
        config.append(entry)
    devices: dict[str, Any] = {"results": results}
    if config:
        devices["config"] = config
    out: dict[str, Any] = {"devices": devices, "nodeSelector": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In",
                          "values": [placement.node]}]}]}}
    if allocated_at is not None:
        out["allocationTimestamp"] = allocated_at
    return out
