"""An auditor of gpuslice's placements that reads only what the API server returns: pods,
nodes, events (and, in :mod:`.audit_dra`, ResourceClaims and ResourceSlices). It never asks a
gpuslice component what it thinks; it is given the assignment HMAC key, which is a secret of
the installation, not state, to tell a signed assignment from a forged one.

The rules (each violation is one :class:`Violation`, printed as one line naming the object and
the rule):

* ``gpu-over-capacity``: per GPU, the milli and MiB the live pods' assignments hold (each
  pod's effective request, init containers reused, sidecars and app containers added) exceed
  1000 or the GPU's memory from the node's ``gpuslice.io/inventory`` annotation; per MIG
  instance, the MPS slices in it exceed the instance's share of the GPU (its compute slices
  of the GPU's) or its memory.
* ``double-booked``: a whole GPU (an exclusive container) or a MIG instance held by a
  MIG-isolated container is held by another live pod too.
* ``unverified-assignment``: a bound, not finished pod that asks for ``gpuslice.io/``
  resources carries no assignment, one that does not decode, does not verify under the key,
  or names another pod or node than the one it is bound to.
* ``unknown-device``: an assignment names a GPU or MIG instance its node does not publish, or
  a whole-GPU share of a MIG-enabled GPU.
* ``pending-without-reason``: a pod waiting for a node longer than the grace period without a
  reason: no ``PodScheduled=False`` condition with a message, and no ``FailedScheduling``
  event about it newer than the bound given.
* ``pending-but-fits`` (:func:`fits_now`, used once the churn has stopped): a pending pod
  that the auditor's own, deliberately conservative, first fit places on a GPU nobody holds
  enough of.

A pod is live until it is gone from the API server: a terminating pod (``deletionTimestamp``
set) still holds its GPUs, as its containers may still run; only ``Succeeded`` and ``Failed``
pods hold nothing. Every function here is pure (objects in, violations out), so the rules are
tested on hand-written objects (tests/unit/test_chaos_audit.py)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction
from typing import Any

from gpuslice.adapters.kube.annotation import decode
from gpuslice.core import catalog
from gpuslice.core.assignment import ANNOTATION, Assignment, Mode, verify
from gpuslice.core.errors import GpusliceError

INVENTORY = "gpuslice.io/inventory"
PREFIX = "gpuslice.io/"
MILLI, MEMORY, COUNT = "gpuslice.io/gpu-milli", "gpuslice.io/gpu-memory", "gpuslice.io/gpu"
GPU_MODEL, ISOLATION = "gpuslice.io/gpu-model", "gpuslice.io/isolation"
Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    subject: str  # the object: pod ns/name, node/GPU, pool/device
    detail: str

    def line(self) -> str:
        return f"violation {self.rule}: {self.subject}: {self.detail}"


# -- reading objects -----------------------------------------------------------------------


def key_of(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


def meta_of(obj: Obj) -> Mapping[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, Mapping) else {}


def spec_of(obj: Obj) -> Mapping[str, Any]:
    s = obj.get("spec")
    return s if isinstance(s, Mapping) else {}


def status_of(obj: Obj) -> Mapping[str, Any]:
    s = obj.get("status")
    return s if isinstance(s, Mapping) else {}


def node_of(pod: Obj) -> str:
    return str(spec_of(pod).get("nodeName") or "")


def finished(pod: Obj) -> bool:
    return status_of(pod).get("phase") in ("Succeeded", "Failed")


def terminating(pod: Obj) -> bool:
    return bool(meta_of(pod).get("deletionTimestamp"))


def pending(pod: Obj) -> bool:
    """Waiting for a node: not bound, not being deleted, not finished."""
    return not node_of(pod) and not terminating(pod) and not finished(pod)


def parse_time(text: object) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _containers(pod: Obj) -> list[Mapping[str, Any]]:
    spec = spec_of(pod)
    return [c for k in ("initContainers", "containers") for c in spec.get(k) or []
            if isinstance(c, Mapping)]


def _limits(c: Mapping[str, Any]) -> dict[str, str]:
    res = c.get("resources") or {}
    out = {str(k): str(v) for k, v in (res.get("requests") or {}).items()}
    out.update({str(k): str(v) for k, v in (res.get("limits") or {}).items()})
    return out


def asks_gpuslice(pod: Obj) -> bool:
    """Whether a container asks for one of gpuslice's extended resources."""
    return any(k.startswith(PREFIX) for c in _containers(pod) for k in _limits(c))


_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(text: object) -> Fraction:
    """A Kubernetes quantity ("25", "20Gi", "100m", "1.5", "1e3", "1k") as an exact
    fraction; :class:`ValueError` for anything else."""
    s = str(text).strip()
    if s.endswith("m") and s[:-1].replace(".", "", 1).isdigit():
        return Fraction(s[:-1]) / 1000
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if suffix and s.endswith(suffix):
            return Fraction(s[:-len(suffix)]) * _SUFFIX[suffix]
    return Fraction(s)


# -- the nodes' GPUs, as their inventory annotation publishes them ---------------------------


@dataclass(frozen=True, slots=True)
class MigInstance:
    uuid: str
    profile: str
    start: int
    memory_mib: int
    slices: int  # compute slices (0: a profile the catalogue does not know)
    capacity_milli: int  # its compute slices of the GPU's, in milli of the GPU


@dataclass(frozen=True, slots=True)
class Gpu:
    uuid: str
    model: str
    memory_mib: int
    mig: dict[int, MigInstance] = field(default_factory=dict)  # by start slice


def _instance(model: str, m: Mapping[str, Any]) -> MigInstance:
    """One MIG instance of the inventory; its share of the GPU from the model's MIG geometry
    (a hardware fact of the catalogue: 3 of an A100's 7 compute slices is 428 milli)."""
    known = catalog.lookup(model)
    slices, cap = 0, 1000
    if known is not None and known.mig is not None:
        try:
            slices = known.mig.profile(str(m["profile"])).compute_slices
            cap = 1000 * slices // known.mig.compute_slices
        except GpusliceError:
            slices, cap = 0, 1000
    return MigInstance(str(m["uuid"]), str(m["profile"]), int(m["start"]),
                       int(m["memoryMiB"]), slices, cap)


def inventories(nodes: Iterable[Obj]) -> tuple[dict[str, dict[str, Gpu]], list[Violation]]:
    """node -> GPU UUID -> :class:`Gpu` from each node's inventory annotation; a node whose
    annotation is not the agent's format is a violation (``bad-inventory``) and has no GPU."""
    out: dict[str, dict[str, Gpu]] = {}
    bad: list[Violation] = []
    for n in nodes:
        name = str(meta_of(n).get("name"))
        text = (meta_of(n).get("annotations") or {}).get(INVENTORY)
        if text is None:
            continue
        try:
            gpus = {}
            for g in json.loads(text):
                model = str(g["model"])
                migs = [_instance(model, m) for m in g.get("mig") or []]
                gpus[str(g["uuid"])] = Gpu(str(g["uuid"]), model, int(g["memoryMiB"]),
                                           {m.start: m for m in migs})
            out[name] = gpus
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            bad.append(Violation("bad-inventory", f"node {name}", f"{INVENTORY}: {exc}"))
    return out, bad


# -- assignments ---------------------------------------------------------------------------


def check_assignment(pod: Obj, key: bytes) -> tuple[Assignment | None, str]:
    """The pod's assignment when it decodes, verifies and names this pod and its node;
    else (None, why)."""
    text = (meta_of(pod).get("annotations") or {}).get(ANNOTATION)
    if text is None:
        return None, f"bound to {node_of(pod)} without a {ANNOTATION} annotation"
    try:
        a = decode(str(text))
    except GpusliceError as exc:
        return None, f"{ANNOTATION} does not decode: {exc}"
    if not verify(a, key):
        return None, f"{ANNOTATION} does not verify under the assignment key (forged?)"
    meta = meta_of(pod)
    if (a.namespace, a.pod) != (meta.get("namespace"), meta.get("name")):
        return None, f"the assignment is {a.namespace}/{a.pod}'s"
    if a.pod_uid != meta.get("uid"):
        return None, f"the assignment is of pod UID {a.pod_uid}, not {meta.get('uid')}"
    if a.node != node_of(pod):
        return None, f"bound to {node_of(pod)}, the assignment names {a.node}"
    return a, ""


@dataclass
class Held:
    """What live pods hold, per GPU and per MIG instance."""

    milli: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    mib: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    holders: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    whole: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # (GPU, start) -> MPS slices' (milli, MiB) and holders; MIG-isolated holders
    inst_milli: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    inst_mib: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    inst_holders: dict[tuple[str, int], list[str]] = field(
        default_factory=lambda: defaultdict(list))
    inst_whole: dict[tuple[str, int], list[str]] = field(
        default_factory=lambda: defaultdict(list))


def _hold(held: Held, who: str, a: Assignment) -> None:
    for uuid, (milli, mib) in a.held().items():
        held.milli[uuid] += milli
        held.mib[uuid] += mib
        held.holders[uuid].append(who)
    seen: set[tuple[str, int]] = set()
    for c in a.containers:
        for g in c.gpus:
            if not g.mig_profile:
                if c.mode is Mode.EXCLUSIVE and who not in held.whole[g.uuid]:
                    held.whole[g.uuid].append(who)
                continue
            inst = (g.uuid, g.mig_start)
            if c.mode is Mode.MIG:
                if who not in held.inst_whole[inst]:
                    held.inst_whole[inst].append(who)
            elif inst not in seen:
                seen.add(inst)
                held.inst_holders[inst].append(who)
            if c.mode is not Mode.MIG:
                held.inst_milli[inst] += g.milli
                held.inst_mib[inst] += g.memory_mib


def _unknown(a: Assignment, gpus: Mapping[str, Gpu]) -> str:
    for c in a.containers:
        for g in c.gpus:
            gpu = gpus.get(g.uuid)
            if gpu is None:
                return f"GPU {g.uuid} is not published by node {a.node}"
            if g.mig_profile:
                inst = gpu.mig.get(g.mig_start)
                if inst is None or inst.profile != g.mig_profile:
                    return f"MIG instance {g.mig_profile}@{g.mig_start} of {g.uuid} is not " \
                           f"published by node {a.node}"
            elif gpu.mig:
                return f"a whole-GPU share of MIG-enabled GPU {g.uuid}"
    return ""


def held_by_pods(pods: Iterable[Obj], inv: Mapping[str, Mapping[str, Gpu]], key: bytes,
                 ) -> tuple[Held, list[Violation]]:
    """What the live pods' verified assignments hold, and the assignment violations."""
    held, out = Held(), []
    for p in pods:
        node = node_of(p)
        if not node or finished(p) or not asks_gpuslice(p):
            continue
        a, why = check_assignment(p, key)
        if a is None:
            out.append(Violation("unverified-assignment", f"pod {key_of(p)}", why))
            continue
        unknown = _unknown(a, inv.get(node, {}))
        if unknown:
            out.append(Violation("unknown-device", f"pod {key_of(p)}", unknown))
        _hold(held, f"{key_of(p)}{' (terminating)' if terminating(p) else ''}", a)
    return held, out


def capacity_violations(held: Held, inv: Mapping[str, Mapping[str, Gpu]]) -> list[Violation]:
    gpus = {u: (n, g) for n, gs in inv.items() for u, g in gs.items()}
    out: list[Violation] = []
    for uuid, milli in sorted(held.milli.items()):
        node, gpu = gpus.get(uuid, ("?", None))
        who = ", ".join(held.holders[uuid])
        if milli > 1000:
            out.append(Violation("gpu-over-capacity", f"{node}/{uuid}",
                                 f"{milli} milli of 1000 held by {who}"))
        if gpu is not None and held.mib[uuid] > gpu.memory_mib:
            out.append(Violation("gpu-over-capacity", f"{node}/{uuid}",
                                 f"{held.mib[uuid]} MiB of {gpu.memory_mib} held by {who}"))
        if held.whole.get(uuid) and len(set(held.holders[uuid])) > 1:
            out.append(Violation("double-booked", f"{node}/{uuid}",
                                 f"whole GPU of {', '.join(held.whole[uuid])} also held by "
                                 f"{who}"))
    for inst, whole in sorted(held.inst_whole.items()):
        others = [h for h in held.inst_holders.get(inst, []) if h not in whole]
        if len(whole) > 1 or others:
            out.append(Violation("double-booked", f"{gpus.get(inst[0], ('?',))[0]}/{inst[0]}"
                                 f"@{inst[1]}", f"MIG instance held by {', '.join(whole)}"
                                 + (f" and MPS slices of {', '.join(others)}" if others else "")))
    for inst, milli in sorted(held.inst_milli.items()):
        node, gpu = gpus.get(inst[0], ("?", None))
        m = gpu.mig.get(inst[1]) if gpu is not None else None
        if m is None:
            continue
        who = ", ".join(held.inst_holders[inst])
        if milli > m.capacity_milli or held.inst_mib[inst] > m.memory_mib:
            out.append(Violation("gpu-over-capacity", f"{node}/{inst[0]}@{inst[1]}",
                                 f"MPS slices of {milli} milli / {held.inst_mib[inst]} MiB in "
                                 f"MIG instance {m.profile} ({m.capacity_milli} milli, "
                                 f"{m.memory_mib} MiB) held by {who}"))
    return out


def audit_pods(pods: Sequence[Obj], nodes: Sequence[Obj], key: bytes) -> list[Violation]:
    """The device-plugin path's rules over one list of pods (one consistent snapshot: a
    LIST is served at one resourceVersion) and the nodes."""
    inv, bad = inventories(nodes)
    held, out = held_by_pods(pods, inv, key)
    return bad + out + capacity_violations(held, inv)


# -- pending pods --------------------------------------------------------------------------


def scheduled_condition(pod: Obj) -> Mapping[str, Any] | None:
    for c in status_of(pod).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == "PodScheduled":
            return c
    return None


def reason_of(pod: Obj) -> str:
    """The scheduler's verdict on a pending pod: its PodScheduled=False message, or ''."""
    c = scheduled_condition(pod)
    if c is None or c.get("status") != "False":
        return ""
    return str(c.get("message") or "").strip()


def event_time(e: Obj) -> float | None:
    series = e.get("series") or {}
    for t in (series.get("lastObservedTime"), e.get("lastTimestamp"), e.get("eventTime"),
              e.get("deprecatedLastTimestamp"), meta_of(e).get("creationTimestamp")):
        at = parse_time(t)
        if at is not None:
            return at
    return None


def failed_scheduling(events: Iterable[Obj]) -> dict[str, float]:
    """Pod UID -> the newest FailedScheduling event about it (core/v1 or events.k8s.io)."""
    out: dict[str, float] = {}
    for e in events:
        if e.get("reason") != "FailedScheduling":
            continue
        ref = e.get("involvedObject") or e.get("regarding") or {}
        uid, at = str(ref.get("uid") or ""), event_time(e)
        if uid and at is not None:
            out[uid] = max(at, out.get(uid, at))
    return out


def audit_pending(pods: Iterable[Obj], age_of: Callable[[Obj], float], grace_s: float,
                  events: Mapping[str, float], newer_than: float) -> list[Violation]:
    """Pods pending for longer than ``grace_s`` (``age_of``: the pod's age as the caller
    counts it, e.g. without the seconds the API server was away) need a current reason:
    PodScheduled=False with a message, or a FailedScheduling event newer than
    ``newer_than`` (``events``: :func:`failed_scheduling`)."""
    out = []
    for p in pods:
        if not pending(p) or age_of(p) < grace_s or reason_of(p):
            continue
        if events.get(str(meta_of(p).get("uid") or ""), float("-inf")) >= newer_than:
            continue
        c = scheduled_condition(p)
        state = "no PodScheduled condition" if c is None else \
            f"PodScheduled={c.get('status')} reason={c.get('reason')!r} message=" \
            f"{c.get('message')!r}"
        out.append(Violation("pending-without-reason", f"pod {key_of(p)}",
                             f"pending for {age_of(p):.0f} s with {state} and no recent "
                             "FailedScheduling event"))
    return out


# -- the auditor's own, conservative fit (after the churn) ----------------------------------


@dataclass(frozen=True, slots=True)
class Want:
    gpus: int
    milli: int
    memory_mib: int | None  # None: the share of the GPU's memory
    models: frozenset[str]
    mig: bool


def want_of(pod: Obj) -> Want | None:
    """What the pod asks of each GPU (app containers added; init containers and sidecars
    make the shape ambiguous: None, not judged)."""
    spec = spec_of(pod)
    if spec.get("initContainers"):
        return None
    gpus = milli = mib = 0
    named_mib = False
    for c in spec.get("containers") or []:
        lim = _limits(c)
        if not any(k.startswith(PREFIX) for k in lim):
            continue
        n = int(quantity(lim.get(COUNT, "1")))
        if gpus and n != gpus:
            return None
        gpus = n
        milli += int(quantity(lim.get(MILLI, "1000")))
        if MEMORY in lim:
            named_mib = True
            mib += int(quantity(lim[MEMORY]))
    if not gpus:
        return None
    ann = meta_of(pod).get("annotations") or {}
    models = frozenset(m for m in str(ann.get(GPU_MODEL) or "").split("|") if m)
    return Want(gpus, min(milli, 1000), mib if named_mib else None, models,
                ann.get(ISOLATION) == "mig")


def _selects(pod: Obj, node: Obj) -> bool:
    labels = meta_of(node).get("labels") or {}
    return all(labels.get(k) == v for k, v in (spec_of(pod).get("nodeSelector") or {}).items())


def fits_now(pod: Obj, nodes: Sequence[Obj], held: Held,
             inv: Mapping[str, Mapping[str, Gpu]]) -> str:
    """Where the pod fits now by the auditor's first fit, or '' (also for shapes it does not
    judge). Conservative: fractional and whole pods only on GPUs without MIG, MIG pods only
    on an instance nobody holds of the compute slices the pod's milli stands for; node CPU,
    memory and taints are not judged (the tier's pods ask none, and tolerate all)."""
    w = want_of(pod)
    if w is None:
        return ""
    for n in nodes:
        name = str(meta_of(n).get("name"))
        if not _selects(pod, n):
            continue
        gpus = [g for g in inv.get(name, {}).values() if not w.models or g.model in w.models]
        if w.mig:
            need = max(1, round(w.milli * 7 / 1000))
            for g in gpus:
                for m in g.mig.values():
                    key = (g.uuid, m.start)
                    if m.slices >= need and (w.memory_mib or 0) <= m.memory_mib and \
                            not held.inst_whole.get(key) and not held.inst_holders.get(key):
                        return f"{name}/{g.uuid} MIG {m.profile}@{m.start}"
            continue
        room = []
        for g in gpus:
            if g.mig:
                continue
            mib = w.memory_mib if w.memory_mib is not None else g.memory_mib * w.milli // 1000
            if held.milli.get(g.uuid, 0) + w.milli <= 1000 and \
                    held.mib.get(g.uuid, 0) + mib <= g.memory_mib and \
                    not (w.milli == 1000 and held.holders.get(g.uuid)):
                room.append(g.uuid)
        if len(room) >= w.gpus:
            return f"{name}/{','.join(room[:w.gpus])}"
    return ""
