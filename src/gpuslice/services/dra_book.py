"""The claim allocator's ledger, kept between passes (:class:`DraBook`).

A pass of :class:`~gpuslice.services.dra_allocator.DraAllocator` reads every pod, claim, node
and slice. Rebuilding its :class:`~gpuslice.core.dra_placement.DraLedger` from them each time
cost a walk of every object's fields, the ledger's arrays and the fragmentation tables: 0.3 s
of CPU per pass at 1000 nodes and 5000 claims, which, five passes a second on a busy control
plane, was most of a claim's wait. The book keeps the ledger and what each object contributed
to it, and on each pass applies only the objects whose version (UID and resourceVersion)
changed:

* an allocated claim adds what it took to its devices (:func:`kdra.claim_usage`'s rule:
  a share consumed its ``consumedCapacity``, a result without ``shareID`` took the device);
* a pod adds its CPU and memory to the node :func:`kdra.pod_node` says it counts on (a claim
  that changes moves the pods that name it; a pod without claims that the allocator pinned
  counts on that node until bound: :mod:`gpuslice.adapters.kube.cpu_pods`), and its shape
  to the target workload learned from the live pods
  (:class:`~gpuslice.core.learned.WorkloadEstimator`, the extender's);
* a change to the nodes' devices (a slice, the set of nodes whose devices have settled) or
  to a node's allocatable builds everything again.

An object with a field of the wrong type does not stop the sync: an allocated claim's
malformed result still takes the device it names (whole), a claim of the wrong shape is not
placed, a pod's malformed ``resourceClaims`` name no claim (its CPU and memory still count), and
a node whose allocatable is not a quantity has no room; each is in :meth:`DraBook.problems`
while the object stays so.

What the pass itself decided and :meth:`~DraLedger.apply`-ed is set back from the objects at
the next sync, once the API server has the claim (the allocator's writes are read back
through its lists): the ledger never counts a claim twice. The per-node task counts of the
policies' affinity start from zero at each pass, as in a ledger built for the pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube.cpu_pods import pinned_node
from gpuslice.core.dra_placement import DeviceRequest, DraDevice, DraLedger, DraNode, Usage
from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import Shape
from gpuslice.core.learned import WorkloadEstimator

Key = kdra.ClaimKey  # (namespace, name)
Version = tuple[object, object]
DeviceKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class _Claim:
    version: Version
    obj: dict[str, Any]
    node: str | None  # the node its allocation is bound to
    took: kdra.Took  # what its allocation took of our devices
    request: DeviceRequest | None  # a shape we place (allocated or not)


@dataclass(frozen=True, slots=True)
class _Pod:
    version: Version
    obj: dict[str, Any]
    claims: tuple[kdra.ClaimKey, ...]
    cpu_milli: int
    memory_mib: int
    waiting: bool  # not bound, not being deleted: its claim may be ours to place
    node: str | None = None  # where its CPU and memory count (kdra.pod_node)
    shape: Shape | None = None  # its shape in the learned workload
    broken: bool = False  # of the wrong shape: counts nowhere, no shape (a problem noted)


def _version(obj: Mapping[str, Any]) -> Version | None:
    meta = obj.get("metadata") or {}
    uid, rv = meta.get("uid"), meta.get("resourceVersion")
    return (uid, rv) if uid and rv else None


def _key(obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return meta.get("namespace"), str(meta["name"])


def _diff(objs: Sequence[dict[str, Any]], held: Mapping[Key, _Claim | _Pod]) -> \
        tuple[list[tuple[Key, dict[str, Any], Version | None]], list[Key]]:
    """The listed objects that are new or whose version differs from the one ``held`` (an
    object without UID and resourceVersion always), and the held keys no longer listed."""
    seen: set[Key] = set()
    changed: list[tuple[Key, dict[str, Any], Version | None]] = []
    for o in objs:
        key = _key(o)
        seen.add(key)
        version = _version(o)
        old = held.get(key)
        if old is None or version is None or old.version != version:
            changed.append((key, o, version))
    return changed, [k for k in held if k not in seen]


class DraBook:
    """The ledger of one allocator, synced from its lists each pass (see the module doc)."""

    def __init__(self, driver: str = kdra.DRIVER,
                 classes: Mapping[str, frozenset[str]] = kdra.CLASS_KINDS) -> None:
        self.driver, self.classes = driver, classes
        self.ledger: DraLedger | None = None
        self.rebuilds = 0  # full builds (the first, then each change to devices or nodes)
        self._shape: tuple[object, ...] | None = None
        self._claims: dict[Key, _Claim] = {}
        self._pods: dict[Key, _Pod] = {}
        self._naming: dict[kdra.ClaimKey, set[Key]] = {}  # claim -> pods that name it
        self._usage: dict[DeviceKey, tuple[int, dict[str, int]]] = {}  # whole count, shares
        self._used: dict[str, tuple[int, int]] = {}  # node -> CPU milli, memory MiB
        self._estimator = WorkloadEstimator()
        self._workload_version = -1
        self._dirty_devices: set[DeviceKey] = set()
        self._dirty_nodes: set[str] = set()
        self._unshaped: set[Key] = set()  # pods whose shape is to be (re)done
        # what is wrong with the objects as they are now (dropped when fixed or gone)
        self._bad_claims: dict[Key, str] = {}
        self._bad_pods: dict[Key, str] = {}
        self._bad_nodes: list[str] = []
        self._found: list[str] = []  # what is wrong with the object being read (reused)
        # claims of ours the last sync saw for the first time, not allocated: the allocator
        # puts its finalizer on them early (services.dra_writes)
        self.new_unallocated: list[dict[str, Any]] = []

    # -- the pass's view -------------------------------------------------------------------

    def sync(self, devices: Mapping[str, Sequence[DraDevice]], devices_version: object,
             nodes: Sequence[Mapping[str, Any]], pods: Sequence[dict[str, Any]],
             claims: Sequence[dict[str, Any]]) -> DraLedger:
        """The ledger for this pass over ``devices`` (per node, the usable ones;
        ``devices_version`` changes whenever they may have) and the listed objects."""
        alloc: dict[str, tuple[int, int]] = {}
        self._bad_nodes = []
        for n in nodes:  # every node: pods without claims may go to those without devices
            name = n["metadata"]["name"]
            try:
                alloc[str(name)] = kdra.node_allocatable(n)
            except ValidationError as exc:  # no room on it rather than no allocator
                alloc[str(name)] = (0, 0)
                self._bad_nodes.append(f"{exc}: node counted as having no room")
        shape = (devices_version, frozenset(devices), tuple(sorted(alloc.items())))
        rebuild = self.ledger is None or shape != self._shape
        if rebuild:
            self._reset()
            self._shape = shape
        moved = self._sync_claims(claims)
        self._sync_pods(pods, moved)
        if rebuild:
            self._build(devices, alloc)
        else:
            assert self.ledger is not None
            self._refresh(self.ledger)
        ledger = self.ledger
        assert ledger is not None
        self._sync_shapes(ledger, rebuild)
        workload = self._estimator.current()
        if rebuild or self._estimator.version != self._workload_version:
            self._workload_version = self._estimator.version
            ledger.set_workload(workload)
        ledger.state.affinity[:] = 0
        return ledger

    def problems(self) -> list[str]:
        """What is wrong with the objects of the last sync (each object's fields of the wrong
        type, and what was done instead)."""
        return [*self._bad_nodes, *self._bad_claims.values(), *self._bad_pods.values()]

    def invalidate(self) -> None:
        """Build everything again at the next sync (a pass that failed midway may have left
        the book half-synced)."""
        self.ledger = None
        self._shape = None

    def pending(self) -> list[kdra.PendingClaim]:
        """Unallocated claims we place, of pods not bound yet (:func:`kdra.pending_claims`
        over the waiting pods and the claims they name)."""
        waiting = [p for p in self._pods.values() if p.waiting]
        claims = [c.obj for p in waiting for k in p.claims
                  if (c := self._claims.get(k)) is not None]
        pods = [p.obj for p in waiting]
        return kdra.pending_claims(pods, claims, self.driver, self.classes)

    # -- claims and pods -------------------------------------------------------------------

    def _reset(self) -> None:
        self.ledger = None
        self._claims.clear()
        self._pods.clear()
        self._naming.clear()
        self._usage.clear()
        self._used.clear()
        self._estimator.clear()
        self._dirty_devices.clear()
        self._dirty_nodes.clear()
        self._unshaped.clear()
        self._bad_claims.clear()
        self._bad_pods.clear()

    def _sync_claims(self, claims: Sequence[dict[str, Any]]) -> set[kdra.ClaimKey]:
        """The claims' changes applied to the devices' usage; returns the claims whose node
        or request changed (the pods naming them count again)."""
        moved: set[kdra.ClaimKey] = set()
        changed, gone = _diff(claims, self._claims)
        self.new_unallocated = []
        found = self._found
        found.clear()
        for key, c, version in changed:
            took = kdra.claim_took(c, self.driver, found)
            node = None
            allocated = bool(took) or kdra.is_allocated(c)
            if allocated:
                try:
                    node = kdra.allocated_node(c)
                except ValidationError as exc:  # its pods count on no node
                    found.append(str(exc))
            new = _Claim(version or (None, None), c, node, took,
                         kdra.claim_request(c, self.driver, self.classes, found))
            if found or self._bad_claims:
                self._note(self._bad_claims, key, found)
                found.clear()
            old = self._claims.get(key)
            self._claims[key] = new
            if old is None and new.request is not None and not allocated:
                self.new_unallocated.append(c)
            self._take(old.took if old is not None else (), -1)
            self._take(took, 1)
            if old is None or old.node != new.node or old.request != new.request:
                moved.add(key)
        for key in gone:
            self._take(self._claims.pop(key).took, -1)
            self._bad_claims.pop(key, None)
            moved.add(key)
        return moved

    @staticmethod
    def _note(bad: dict[Key, str], key: Key, found: list[str]) -> None:
        if found:
            bad[key] = "; ".join(found)
        else:
            bad.pop(key, None)

    def _take(self, took: kdra.Took, sign: int) -> None:
        for dev, whole, consumed in took:
            n, shares = self._usage.get(dev, (0, {}))
            shares = dict(shares)
            for name, v in consumed.items():
                shares[name] = shares.get(name, 0) + sign * v
            n += sign * whole
            if n or any(shares.values()):
                self._usage[dev] = (n, {k: v for k, v in shares.items() if v})
            else:
                self._usage.pop(dev, None)
            self._dirty_devices.add(dev)

    def _sync_pods(self, pods: Sequence[dict[str, Any]], moved: set[kdra.ClaimKey]) -> None:
        changed, gone = _diff(pods, self._pods)
        found = self._found
        found.clear()
        for key, p, version in changed:
            spec, meta = p.get("spec") or {}, p["metadata"]
            if not isinstance(spec, dict) or not isinstance(p.get("status") or {}, dict):
                self._bad_pods[key] = f"pod {key[0]}/{key[1]}: spec and status: expected " \
                    "objects: not counted"
                self._count(key, self._pods.get(key),
                            _Pod(version or (None, None), p, (), 0, 0, False, broken=True))
                continue
            try:
                cpu, mem = kdra.pod_needs(p)
            except ValidationError as exc:  # the API server admits no such pod
                cpu, mem = 0, 0
                found.append(f"{exc}: counted as requesting no CPU or memory")
            try:
                claims = kdra.pod_claims(p)
            except ValidationError as exc:
                claims = ()
                found.append(f"{exc}: its claims are not placed")
            if found or self._bad_pods:
                self._note(self._bad_pods, key, found)
                found.clear()
            new = _Pod(version or (None, None), p, claims, cpu, mem,
                       not spec.get("nodeName") and not meta.get("deletionTimestamp"))
            self._count(key, self._pods.get(key), new)
        for key in gone:
            self._count(key, self._pods[key], None)
            self._bad_pods.pop(key, None)
        # unchanged pods that name a claim whose node or request changed count again
        redo = {k for c in moved for k in self._naming.get(c, ())}
        redo.difference_update(k for k, _, _ in changed)
        for key in redo:
            self._count(key, self._pods[key], self._pods[key])

    def _count(self, key: Key, old: _Pod | None, new: _Pod | None) -> None:
        """Move the pod's CPU and memory from where it counted (``old``) to where it counts
        now (``new``; ``None``: gone); its shape is redone in :meth:`_sync_shapes`."""
        if old is not None:
            if old.node is not None:
                self._use(old.node, -old.cpu_milli, -old.memory_mib)
            if old.shape is not None:
                self._estimator.remove(old.shape)
            for c in old.claims:
                pods = self._naming.get(c)
                if pods is not None:
                    pods.discard(key)
                    if not pods:
                        del self._naming[c]
        if new is None:
            self._pods.pop(key, None)
            return
        node = None if new.broken else kdra.pod_node(new.obj, new.claims, self._claim_node)
        if node is None and new.waiting and not new.claims and not new.broken:
            node = pinned_node(new.obj)  # pinned by the allocator, not bound yet
        if node is not None:
            self._use(node, new.cpu_milli, new.memory_mib)
        for c in new.claims:
            self._naming.setdefault(c, set()).add(key)
        self._pods[key] = replace(new, node=node, shape=None)
        self._unshaped.add(key)

    def _claim_node(self, key: kdra.ClaimKey) -> str | None:
        c = self._claims.get(key)
        return None if c is None else c.node

    def _use(self, node: str, cpu: int, mem: int) -> None:
        uc, um = self._used.get(node, (0, 0))
        uc, um = uc + cpu, um + mem
        if uc or um:
            self._used[node] = (uc, um)
        else:
            self._used.pop(node, None)
        self._dirty_nodes.add(node)

    def _sync_shapes(self, ledger: DraLedger, rebuild: bool) -> None:
        """Each counted pod's shape (CPU, GPUs, milli-GPU each: the request in milli-GPU by
        the ledger's devices) into the workload estimator; a claim we do not place, or an
        unknown one, gives no shape."""
        todo = self._pods.keys() if rebuild else self._unshaped
        for key in list(todo):
            pod = self._pods.get(key)
            if pod is None or pod.broken:
                continue
            shape: Shape | None = None
            if not pod.claims:
                shape = Shape(pod.cpu_milli, 0, 0)
            else:
                c = self._claims.get(pod.claims[0])
                sreq = None if c is None or c.request is None else \
                    ledger.slice_request(c.request, pod.cpu_milli, 0)
                if sreq is not None:
                    shape = Shape(pod.cpu_milli, sreq.gpus, sreq.milli)
            if shape is not None:
                self._estimator.add(shape)
            self._pods[key] = replace(pod, shape=shape)
        self._unshaped.clear()

    # -- the ledger --------------------------------------------------------------------------

    def _usage_of(self, dev: DeviceKey) -> Usage | None:
        got = self._usage.get(dev)
        return None if got is None else Usage(got[0] > 0, dict(got[1]))

    def _build(self, devices: Mapping[str, Sequence[DraDevice]],
               alloc: Mapping[str, tuple[int, int]]) -> None:
        nodes = [DraNode(name, alloc[name][0], alloc[name][1], tuple(devices.get(name, ())),
                         *self._used.get(name, (0, 0)))
                 for name in sorted(alloc)]
        usage = {k: u for k in self._usage if (u := self._usage_of(k)) is not None}
        self.ledger = DraLedger(nodes, usage, None)
        self.rebuilds += 1
        self._dirty_devices.clear()
        self._dirty_nodes.clear()

    def _refresh(self, ledger: DraLedger) -> None:
        """Set the devices and nodes that changed (or that the last pass applied decisions
        to) from what the objects say."""
        devs = self._dirty_devices | ledger.applied_devices
        names = self._dirty_nodes | ledger.applied_nodes
        rows: list[int] = []
        for dev in devs:
            row = ledger.set_usage(dev, self._usage_of(dev))
            if row is not None:
                rows.append(row)
        for name in names:
            row = ledger.set_used(name, *self._used.get(name, (0, 0)))
            if row is not None:
                rows.append(row)
        ledger.refresh(rows)
        ledger.applied_devices.clear()
        ledger.applied_nodes.clear()
        self._dirty_devices.clear()
        self._dirty_nodes.clear()
