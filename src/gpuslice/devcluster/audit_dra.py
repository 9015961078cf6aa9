"""The auditor's rules for the DRA path (see :mod:`.audit`), over what the API server returns:
ResourceSlices (the devices our driver publishes, their consumable capacity and the counter
sets MIG partitions consume) and ResourceClaims (what kube-scheduler or the claim allocator
wrote in ``status.allocation``), and the pods that use them.

* ``dra-double-allocated``: a device without ``allowMultipleAllocations`` in the allocation
  of two live claims;
* ``dra-over-capacity``: the ``consumedCapacity`` of a shareable device's allocations summed
  over the live claims exceeds its capacity, or the devices allocated consume more of a
  shared counter set than it holds (two overlapping MIG placements);
* ``dra-node-mismatch``: a pod bound to another node than its claim's allocation names;
* ``dra-unallocated-bound``: a bound pod whose claim is not allocated, or not reserved for it.

A claim holds what its allocation names until the claim is gone or deallocated (a claim
being deleted still holds: its pod may still run). Only the newest generation of each pool is
read (a driver that republishes its pool bumps the generation)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gpuslice.devcluster.audit import (
    Obj,
    Violation,
    key_of,
    meta_of,
    node_of,
    quantity,
    spec_of,
    status_of,
)

DRIVER = "gpu.gpuslice.io"
ALLOCATOR_TAINT = "gpu.gpuslice.io/allocator"  # core.dra.slices: kube-scheduler leaves these


@dataclass(frozen=True, slots=True)
class Device:
    pool: str
    name: str
    type: str  # its "type" attribute: share, gpu or mig
    capacity: dict[str, Fraction]
    policies: dict[str, Mapping[str, Any]]  # capacity name -> requestPolicy
    multi: bool  # allowMultipleAllocations
    counters: tuple[tuple[str, tuple[tuple[str, Fraction], ...]], ...]  # (set, (name, value))
    tainted: bool  # carries a taint other than the claim allocator's


def _value(v: object) -> Fraction:
    return quantity(v.get("value") if isinstance(v, Mapping) else v)


def _device(pool: str, d: Mapping[str, Any]) -> Device:
    attrs = d.get("attributes") or {}
    kind = attrs.get("type") or attrs.get(f"{DRIVER}/type") or {}
    cap = {str(k): _value(v) for k, v in (d.get("capacity") or {}).items()}
    pol: dict[str, Mapping[str, Any]] = {
        str(k): v["requestPolicy"] for k, v in (d.get("capacity") or {}).items()
        if isinstance(v, Mapping) and isinstance(v.get("requestPolicy"), Mapping)}
    counters = tuple((str(c.get("counterSet")), tuple(
        (str(k), _value(v)) for k, v in (c.get("counters") or {}).items()))
        for c in d.get("consumesCounters") or [])
    taints = [t for t in d.get("taints") or [] if t.get("key") != ALLOCATOR_TAINT]
    return Device(pool, str(d.get("name")), str(kind.get("string") or ""), cap, pol,
                  bool(d.get("allowMultipleAllocations")), counters, bool(taints))


@dataclass
class Pools:
    devices: dict[tuple[str, str], Device] = field(default_factory=dict)
    counters: dict[tuple[str, str], dict[str, Fraction]] = field(default_factory=dict)


def pools(slices: Iterable[Obj], driver: str = DRIVER) -> Pools:
    """Our driver's devices and counter sets, from each pool's newest generation."""
    newest: dict[str, int] = {}
    ours = [s for s in slices if spec_of(s).get("driver") == driver]
    for s in ours:
        pool = spec_of(s).get("pool") or {}
        name, gen = str(pool.get("name")), int(pool.get("generation") or 0)
        newest[name] = max(gen, newest.get(name, gen))
    out = Pools()
    for s in ours:
        pool = spec_of(s).get("pool") or {}
        name = str(pool.get("name"))
        if int(pool.get("generation") or 0) != newest[name]:
            continue
        for d in spec_of(s).get("devices") or []:
            dev = _device(name, d)
            out.devices[(name, dev.name)] = dev
        for cs in spec_of(s).get("sharedCounters") or []:
            out.counters[(name, str(cs.get("name")))] = {
                str(k): _value(v) for k, v in (cs.get("counters") or {}).items()}
    return out


def results(claim: Obj, driver: str = DRIVER) -> list[Mapping[str, Any]]:
    """The allocation's results on our driver's devices ([] while not allocated)."""
    alloc = status_of(claim).get("allocation") or {}
    return [r for r in (alloc.get("devices") or {}).get("results") or []
            if isinstance(r, Mapping) and r.get("driver") == driver]


def allocated(claim: Obj) -> bool:
    return bool(status_of(claim).get("allocation"))


def allocation_node(claim: Obj) -> str | None:
    """The one node the allocation's nodeSelector names (metadata.name In [node])."""
    sel = (status_of(claim).get("allocation") or {}).get("nodeSelector") or {}
    terms = sel.get("nodeSelectorTerms") or []
    if len(terms) != 1:
        return None
    for f in terms[0].get("matchFields") or []:
        if f.get("key") == "metadata.name" and f.get("operator") == "In" and \
                len(f.get("values") or []) == 1:
            return str(f["values"][0])
    return None


@dataclass
class Use:
    """What the live claims take: per device the claims and consumed capacity; per counter
    set what the allocated devices consume."""

    claims: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    consumed: dict[tuple[str, str], dict[str, Fraction]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(Fraction)))
    counters: dict[tuple[str, str], dict[str, Fraction]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(Fraction)))
    counter_users: dict[tuple[str, str], list[str]] = field(
        default_factory=lambda: defaultdict(list))


def use_of(claims: Iterable[Obj], p: Pools) -> Use:
    use = Use()
    for c in claims:
        who = key_of(c)
        for r in results(c):
            dev_key = (str(r.get("pool")), str(r.get("device")))
            use.claims[dev_key].append(who)
            for k, v in (r.get("consumedCapacity") or {}).items():
                use.consumed[dev_key][str(k)] += quantity(v)
            dev = p.devices.get(dev_key)
            for cset, values in dev.counters if dev is not None else ():
                ck = (dev_key[0], cset)
                use.counter_users[ck].append(f"{who} ({dev_key[1]})")
                for name, v in values:
                    use.counters[ck][name] += v
    return use


def audit_claims(claims: Sequence[Obj], slices: Sequence[Obj]) -> list[Violation]:
    """Double allocations and over-capacity over one list of claims (one snapshot)."""
    p = pools(slices)
    use = use_of(claims, p)
    out: list[Violation] = []
    for dev_key, who in sorted(use.claims.items()):
        dev = p.devices.get(dev_key)
        subject = f"device {dev_key[0]}/{dev_key[1]}"
        if dev is None:
            continue  # a pool being republished; its capacity is not known here
        if not dev.multi and len(set(who)) > 1:
            out.append(Violation("dra-double-allocated", subject,
                                 f"allocated to {', '.join(sorted(set(who)))}"))
        for name, total in use.consumed[dev_key].items():
            cap = dev.capacity.get(name)
            if dev.multi and cap is not None and total > cap:
                out.append(Violation("dra-over-capacity", subject,
                                     f"{name}: {float(total):g} of {float(cap):g} consumed by "
                                     f"{', '.join(who)}"))
    for ck, values in sorted(use.counters.items()):
        have = p.counters.get(ck) or {}
        for name, total in values.items():
            if name in have and total > have[name]:
                out.append(Violation("dra-over-capacity", f"counter set {ck[0]}/{ck[1]}",
                                     f"{name}: {float(total):g} of {float(have[name]):g} "
                                     f"consumed by {', '.join(use.counter_users[ck])}"))
    return out


def claim_names(pod: Obj) -> list[str]:
    """The ResourceClaims the pod uses (by name, in its namespace)."""
    names = {str(s.get("name")): str(s.get("resourceClaimName"))
             for s in status_of(pod).get("resourceClaimStatuses") or []
             if s.get("resourceClaimName")}
    for rc in spec_of(pod).get("resourceClaims") or []:
        if rc.get("resourceClaimName"):
            names[str(rc.get("name"))] = str(rc["resourceClaimName"])
    return sorted(names.values())


def uses_claims(pod: Obj) -> bool:
    return bool(spec_of(pod).get("resourceClaims"))


def audit_bound(pods: Sequence[Obj], claims: Sequence[Obj]) -> list[Violation]:
    """Each bound, live pod's claims: allocated, reserved for it, on its node. The pods and
    claims come from two lists: a caller confirms what this finds on fresh reads."""
    by_key = {key_of(c): c for c in claims}
    out: list[Violation] = []
    for pod in pods:
        node = node_of(pod)
        if not node or not uses_claims(pod) or status_of(pod).get("phase") in (
                "Succeeded", "Failed"):
            continue
        ns, uid = meta_of(pod).get("namespace"), meta_of(pod).get("uid")
        for name in claim_names(pod):
            c = by_key.get(f"{ns}/{name}")
            subject = f"pod {key_of(pod)}"
            if c is None or not allocated(c):
                out.append(Violation("dra-unallocated-bound", subject,
                                     f"bound to {node}, claim {name} "
                                     f"{'missing' if c is None else 'not allocated'}"))
                continue
            reserved = {str(r.get("uid")) for r in status_of(c).get("reservedFor") or []}
            if uid not in reserved:
                out.append(Violation("dra-unallocated-bound", subject,
                                     f"bound to {node}, claim {name} not reserved for it "
                                     f"({sorted(reserved)})"))
            at = allocation_node(c)
            if at is not None and at != node:
                out.append(Violation("dra-node-mismatch", subject,
                                     f"bound to {node}, claim {name} allocated on {at}"))
    return out


# -- the auditor's own fit for a pending pod's claim (after the churn) ----------------------


def _rounded(want: Fraction, policy: Mapping[str, Any] | None) -> Fraction:
    """What a request of ``want`` consumes under the device's request policy (a valid range
    rounds up to its step; valid values to the next value)."""
    if not policy:
        return want
    if policy.get("validValues"):
        vals = sorted(quantity(v) for v in policy["validValues"])
        return next((v for v in vals if v >= want), Fraction(10**30))
    rng = policy.get("validRange") or {}
    lo = quantity(rng["min"]) if rng.get("min") is not None else Fraction(0)
    if want <= lo:
        return lo
    step = quantity(rng["step"]) if rng.get("step") else Fraction(0)
    if step:
        k = -((lo - want) // step)
        want = lo + k * step
    return want


def _request(claim: Obj) -> tuple[str, dict[str, Fraction]] | None:
    reqs = ((spec_of(claim).get("devices") or {}).get("requests")) or []
    if len(reqs) != 1:
        return None
    ex = reqs[0].get("exactly") or {}
    if int(ex.get("count") or 1) != 1 or ex.get("selectors"):
        return None
    asked = (ex.get("capacity") or {}).get("requests") or {}
    return str(ex.get("deviceClassName") or ""), {str(k): quantity(v) for k, v in asked.items()}


def claim_fits(claim: Obj, node_ok: set[str], p: Pools, use: Use) -> str:
    """A device of one of ``node_ok``'s pools the unallocated claim fits now, or '' (also for
    claims the auditor does not judge: MIG, selectors, several requests or devices). A share
    fits where every capacity it asks (rounded up by the device's policy) is free; a whole GPU
    where no claim holds it and its counter sets have room."""
    req = _request(claim)
    if req is None or allocated(claim):
        return ""
    cls, asked = req
    kind = {"share.gpuslice.io": "share", "gpu.gpuslice.io": "gpu"}.get(cls)
    for (pool, name), dev in sorted(p.devices.items()):
        if pool not in node_ok or dev.type != kind or dev.tainted:
            continue
        if kind == "gpu":
            if use.claims.get((pool, name)) or not _counters_free(dev, p, use):
                continue
            return f"{pool}/{name}"
        if not dev.multi or (use.claims.get((pool, name)) and not use.consumed.get((pool, name))):
            continue
        ok = True
        for cap_name, cap in dev.capacity.items():
            pol = dev.policies.get(cap_name)
            want = asked.get(cap_name)
            if want is None:
                want = quantity(pol["default"]) if pol and pol.get("default") else cap
            if use.consumed[(pool, name)][cap_name] + _rounded(want, pol) > cap:
                ok = False
        if ok:
            return f"{pool}/{name}"
    return ""


def _counters_free(dev: Device, p: Pools, use: Use) -> bool:
    for cset, values in dev.counters:
        have = p.counters.get((dev.pool, cset), {})
        for name, v in values:
            if use.counters[(dev.pool, cset)][name] + v > have.get(name, Fraction(0)):
                return False
    return True
