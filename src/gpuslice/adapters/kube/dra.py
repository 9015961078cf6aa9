"""resource.k8s.io/v1 objects as the claim allocator sees them (plain JSON in, core types out).

* ResourceSlices of our driver become :class:`DraNode` (core.dra_placement) devices in the order
  the scheduler's allocator tries them: only node-local slices, only each pool's newest
  generation and only complete pools (``resourceSliceCount`` slices of it), pools sorted by
  name, slices by name, devices in slice order (``GatherPools``, ``buildPool``). Devices that
  consume shared counters (partitionable MIG) or carry a taint other than ours are left out:
  the allocator never gives them.
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

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from gpuslice.adapters.kube.objects import node_allocatable as _allocatable_of
from gpuslice.adapters.kube.objects import pod_cpu_memory, pod_finished, quantity
from gpuslice.core.dra_placement import (
    Capacity,
    DeviceRequest,
    DraDevice,
    DraPlacement,
    RequestPolicy,
    Usage,
)
from gpuslice.core.errors import ValidationError

DRIVER = "gpu.gpuslice.io"
FINALIZER = "resource.kubernetes.io/delete-protection"
# the taint our drivers put on their devices while the allocator's lease is fresh (see
# docs/dra-placement.md): kube-scheduler then leaves those devices to us
ALLOCATOR_TAINT = "gpu.gpuslice.io/allocator"
# device class -> the device ``type`` attributes it selects (our DeviceClasses' CEL)
CLASS_KINDS: Mapping[str, frozenset[str]] = {
    "gpu.gpuslice.io": frozenset({"gpu"}),
    "share.gpuslice.io": frozenset({"share"}),
}


T = TypeVar("T")
_MEMO: dict[tuple[Any, ...], Any] = {}
MEMO_MAX = 1 << 16  # entries kept; the oldest quarter goes when full


def _memo(kind: str, obj: Mapping[str, Any], make: Callable[[], T], *extra: Any) -> T:
    """``make()``, kept per object version (UID and resourceVersion: an object the API
    server returns with the same version has the same content), so that the allocator's
    passes parse again only what changed. Objects without both are parsed every time; what
    is kept is never changed by its users (frozen core types, tuples)."""
    meta = obj.get("metadata") or {}
    uid, rv = meta.get("uid"), meta.get("resourceVersion")
    if not uid or not rv:
        return make()
    key = (kind, uid, rv, *extra)
    try:
        return _MEMO[key]  # type: ignore[no-any-return]
    except KeyError:
        pass
    value = make()
    _MEMO[key] = value
    if len(_MEMO) > MEMO_MAX:
        for old in list(itertools.islice(_MEMO, MEMO_MAX // 4)):
            _MEMO.pop(old, None)
    return value


def _int(value: object, field: str) -> int:
    return round(quantity(value, field))


def _name(name: str, driver: str) -> str:
    """A capacity or attribute name without our driver's domain (unprefixed names are the
    driver's own)."""
    return name[len(driver) + 1:] if name.startswith(driver + "/") else name


def _policy(doc: Mapping[str, Any] | None, field: str) -> RequestPolicy | None:
    if not doc:
        return None
    rng = doc.get("validRange") or {}
    default = doc.get("default")
    return RequestPolicy(
        default=None if default is None else _int(default, f"{field}.default"),
        valid_values=tuple(_int(v, f"{field}.validValues") for v in doc.get("validValues")
                           or ()),
        min=None if rng.get("min") is None else _int(rng["min"], f"{field}.validRange.min"),
        max=None if rng.get("max") is None else _int(rng["max"], f"{field}.validRange.max"),
        step=None if rng.get("step") is None else _int(rng["step"],
                                                       f"{field}.validRange.step"))


def _attr(device: Mapping[str, Any], name: str, driver: str) -> str:
    for key, val in (device.get("attributes") or {}).items():
        if _name(key, driver) == name and isinstance(val, dict):
            return str(val.get("string") or val.get("version") or val.get("int") or "")
    return ""


def _usable(device: Mapping[str, Any], require_taint: bool) -> bool:
    if device.get("consumesCounters"):
        return False
    ours = False
    for taint in device.get("taints") or []:
        if taint.get("key") == ALLOCATOR_TAINT:
            ours = True
        elif taint.get("effect") in ("NoSchedule", "NoExecute"):
            return False
    return ours or not require_taint


def slice_devices(slices: Sequence[Mapping[str, Any]], driver: str = DRIVER, *,
                  require_taint: bool = True) -> dict[str, list[DraDevice]]:
    """Per node, our devices in the allocator's order (see the module doc). With
    ``require_taint`` only devices carrying :data:`ALLOCATOR_TAINT` are kept: the ones
    kube-scheduler will not allocate behind our back."""
    pools: dict[str, list[Mapping[str, Any]]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != driver or not spec.get("nodeName"):
            continue
        pool = (spec.get("pool") or {}).get("name") or ""
        pools.setdefault(pool, []).append(s)
    out: dict[str, list[DraDevice]] = {}
    for pool in sorted(pools):
        group = pools[pool]
        gen = max(int((s["spec"].get("pool") or {}).get("generation") or 0) for s in group)
        newest = [s for s in group
                  if int((s["spec"].get("pool") or {}).get("generation") or 0) == gen]
        want = int((newest[0]["spec"].get("pool") or {}).get("resourceSliceCount") or 1)
        if len(newest) < want:
            continue  # incomplete pool: the allocator does not use it either
        for s in sorted(newest, key=lambda s: str(s["metadata"]["name"])):
            node = str(s["spec"]["nodeName"])
            out.setdefault(node, []).extend(_memo(
                "slice", s, partial(_devices_of, s, pool, driver, require_taint),
                pool, driver, require_taint))
    return out


def _devices_of(s: Mapping[str, Any], pool: str, driver: str,
                require_taint: bool) -> tuple[DraDevice, ...]:
    """One slice's usable devices (:func:`slice_devices`)."""
    out: list[DraDevice] = []
    for i, d in enumerate(s["spec"].get("devices") or []):
        if not _usable(d, require_taint):
            continue
        where = f"resourceslice {s['metadata']['name']} device[{i}]"
        caps = {
            _name(k, driver): Capacity(
                _int((v or {}).get("value"), f"{where} capacity {k}"),
                _policy((v or {}).get("requestPolicy"), f"{where} capacity {k}"))
            for k, v in (d.get("capacity") or {}).items()}
        out.append(DraDevice(
            pool, str(d["name"]), _attr(d, "type", driver) or "gpu",
            _attr(d, "productName", driver), bool(d.get("allowMultipleAllocations")), caps))
    return tuple(out)


def claim_usage(claims: Sequence[Mapping[str, Any]], driver: str = DRIVER) -> \
        dict[tuple[str, str], Usage]:
    """What the allocated claims took of each of our devices."""
    usage: dict[tuple[str, str], Usage] = {}
    for c in claims:
        for key, whole, consumed in claim_took(c, driver):
            usage[key] = usage.get(key, Usage()).plus(whole, consumed)
    return usage


Took = tuple[tuple[tuple[str, str], bool, dict[str, int]], ...]


def claim_took(c: Mapping[str, Any], driver: str = DRIVER) -> Took:
    """One claim's results on our devices: (pool, device), taken whole, what a share
    consumed; ``()`` while it is not allocated."""
    if not (c.get("status") or {}).get("allocation"):
        return ()
    return _memo("usage", c, partial(_claim_took, c, driver), driver)


def _claim_took(c: Mapping[str, Any], driver: str) -> Took:
    out = []
    for r in (c["status"]["allocation"].get("devices") or {}).get("results") or []:
        if r.get("driver") != driver or r.get("adminAccess"):
            continue
        consumed = {_name(k, driver): _int(v, f"claim {c['metadata'].get('name')} "
                                          f"consumedCapacity {k}")
                    for k, v in (r.get("consumedCapacity") or {}).items()}
        shared = r.get("shareID") is not None
        out.append(((str(r.get("pool")), str(r.get("device"))), not shared,
                    consumed if shared else {}))
    return tuple(out)


def pod_needs(pod: Mapping[str, Any]) -> tuple[int, int]:
    """A pod's CPU (milli) and memory (MiB) requests as kube-scheduler counts them
    (objects.pod_cpu_memory: init containers, sidecars, overhead, pod-level requests)."""
    return _memo("pod", pod, lambda: pod_cpu_memory(dict(pod)))


def pod_claim_name(pod: Mapping[str, Any], ref: Mapping[str, Any]) -> str | None:
    """The ResourceClaim a pod's ``spec.resourceClaims`` entry names: its
    ``resourceClaimName``, or for a template the generated name in the pod's status."""
    name = ref.get("resourceClaimName")
    if not name:
        for st in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if st.get("name") == ref.get("name"):
                name = st.get("resourceClaimName")
    return str(name) if name else None


def allocated_node(claim: Mapping[str, Any]) -> str | None:
    """The one node an allocated claim is bound to (its ``nodeSelector`` names a single
    ``metadata.name``, as kube-scheduler and we write it), else ``None``."""
    sel = (((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {})
    terms = sel.get("nodeSelectorTerms") or []
    if len(terms) != 1:
        return None
    fields = terms[0].get("matchFields") or []
    if len(fields) != 1 or terms[0].get("matchExpressions"):
        return None
    f = fields[0]
    values = f.get("values") or []
    if f.get("key") == "metadata.name" and f.get("operator") == "In" and len(values) == 1:
        return str(values[0])
    return None


def node_allocatable(node: Mapping[str, Any]) -> tuple[int, int]:
    """A node's allocatable CPU (milli) and memory (MiB)."""
    return _memo("node", node, partial(_allocatable_of, node))




ClaimKey = tuple[str | None, str | None]


def pod_claims(pod: Mapping[str, Any]) -> tuple[ClaimKey, ...]:
    """The (namespace, name) of each claim in the pod's ``spec.resourceClaims``, in order
    (the name ``None`` while a template's claim is not generated yet)."""
    ns = pod["metadata"].get("namespace")
    return tuple((ns, pod_claim_name(pod, ref))
                 for ref in (pod.get("spec") or {}).get("resourceClaims") or [])


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
                  classes: Mapping[str, frozenset[str]] = CLASS_KINDS) -> DeviceRequest | None:
    """The claim as one device request, or ``None`` when it is a shape we leave to the
    default allocator."""
    kinds = "default" if classes is CLASS_KINDS else \
        tuple(sorted((k, tuple(sorted(v))) for k, v in classes.items()))
    return _memo("claim", claim, lambda: _claim_request(claim, driver, classes), driver, kinds)


def _claim_request(claim: Mapping[str, Any], driver: str,
                   classes: Mapping[str, frozenset[str]]) -> DeviceRequest | None:
    devices = (claim.get("spec") or {}).get("devices") or {}
    reqs = devices.get("requests") or []
    if len(reqs) != 1 or devices.get("constraints"):
        return None
    exactly = reqs[0].get("exactly")
    if not exactly or exactly.get("deviceClassName") not in classes:
        return None
    if exactly.get("selectors") or exactly.get("adminAccess") or exactly.get("tolerations"):
        return None
    if exactly.get("allocationMode", "ExactCount") != "ExactCount":
        return None
    caps = ((exactly.get("capacity") or {}).get("requests")) or {}
    name = str(claim["metadata"].get("name"))
    try:
        return DeviceRequest(
            str(reqs[0].get("name") or ""), int(exactly.get("count") or 1),
            {_name(k, driver): _int(v, f"claim {name} capacity {k}") for k, v in caps.items()},
            classes[exactly["deviceClassName"]])
    except ValidationError:
        return None


def pending_claims(pods: Sequence[Mapping[str, Any]], claims: Sequence[Mapping[str, Any]],
                   driver: str = DRIVER,
                   classes: Mapping[str, frozenset[str]] = CLASS_KINDS) -> list[PendingClaim]:
    """Unallocated claims we place, of pods that no scheduler has bound yet (one claim per
    pod; a pod with several claims, or a scheduling gate, is left alone), oldest pod first."""
    by_name = {(c["metadata"].get("namespace"), c["metadata"]["name"]): c for c in claims}
    out: list[PendingClaim] = []
    for p in sorted(pods, key=lambda p: (str(p["metadata"].get("creationTimestamp") or ""),
                                         str(p["metadata"]["name"]))):
        spec, meta = p.get("spec") or {}, p["metadata"]
        if spec.get("nodeName") or meta.get("deletionTimestamp") or spec.get("schedulingGates"):
            continue
        refs = spec.get("resourceClaims") or []
        if len(refs) != 1:
            continue
        claim = by_name.get((meta.get("namespace"), pod_claim_name(p, refs[0])))
        if claim is None or (claim.get("status") or {}).get("allocation") \
                or claim["metadata"].get("deletionTimestamp"):
            continue
        req = claim_request(claim, driver, classes)
        if req is None:
            continue
        cpu, mem = pod_needs(p)
        out.append(PendingClaim(dict(claim), dict(p), req, cpu, mem))
    return out


def allocation(claim: Mapping[str, Any], placement: DraPlacement,
               classes: Sequence[Mapping[str, Any]], new_share_id: Callable[[], str],
               driver: str = DRIVER, allocated_at: str | None = None) -> dict[str, Any]:
    """``status.allocation`` for ``placement``: results, configs (class first, then claim,
    as the scheduler orders them), the node selector and ``allocationTimestamp``
    (``allocated_at``, RFC 3339). kube-scheduler 1.36 sets that field on every allocation it
    binds: for a claim allocated without it, its PreBind (``bindClaim``, adding the pod to
    ``reservedFor``) writes the allocation back with a timestamp, which the API server refuses
    ("status.allocation: field is immutable"), and the pod never binds (seen on the dev
    cluster's v1.36.3)."""
    results: list[dict[str, Any]] = []
    for r in placement.results:
        res: dict[str, Any] = {"request": r.request, "driver": driver, "pool": r.pool,
                               "device": r.device}
        if r.shared:
            res["shareID"] = new_share_id()
            res["consumedCapacity"] = {k: str(v) for k, v in r.consumed.items()}
        results.append(res)
    config: list[dict[str, Any]] = []
    spec = (claim.get("spec") or {}).get("devices") or {}
    for req in spec.get("requests") or []:
        cls = (req.get("exactly") or {}).get("deviceClassName")
        for c in classes:
            if c["metadata"]["name"] == cls:
                for cfg in (c.get("spec") or {}).get("config") or []:
                    config.append({"source": "FromClass", "requests": [req["name"]],
                                   "opaque": cfg.get("opaque")})
    for cfg in spec.get("config") or []:
        entry = {"source": "FromClaim", "opaque": cfg.get("opaque")}
        if cfg.get("requests"):
            entry["requests"] = list(cfg["requests"])
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
