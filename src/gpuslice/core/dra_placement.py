"""Placement of DRA claims on consumable-capacity GPUs: ours, and the default allocator's.

Kubernetes' structured DRA allocator (``k8s.io/dynamic-resource-allocation/structured``) does no
scoring: on the node it is asked about it walks the pools (sorted by name), their slices (sorted
by name) and the devices in slice order, and takes the first devices that satisfy a claim
(``allocateOne``). Which node is asked first is kube-scheduler's business: it filters a window of
nodes (``numFeasibleNodesToFind``) and picks the best-scored one, and with DRA-only GPU pods the
only scores that differ between nodes are NodeResourcesFit (LeastAllocated) and
NodeResourcesBalancedAllocation, both on CPU and memory. GPUs therefore fill in slice order on
the least-loaded nodes, which fragments them.

This module models that (:meth:`DraLedger.decide_default`) and places a claim with our policies
instead (:meth:`DraLedger.decide`), through the same :class:`~gpuslice.core.policies.Policy`
objects and :class:`~gpuslice.core.model.ClusterArrays` the device-plugin path scores, so the
fragmentation scoring is the one in :mod:`gpuslice.core.policies`, not a copy.

The device rules are the upstream ones (``internal/.../consumable_capacity.go``):

* a device without ``allowMultipleAllocations`` is taken whole, once (``deviceInUse``);
* a device with it is shared: every capacity is consumed, the requested value rounded up by the
  capacity's request policy (``validRange`` min/step, ``validValues``), a capacity the claim
  does not name consumes the policy's default (else the whole value), a request for a capacity
  the device does not have, or one the policy forbids (above ``max``), does not fit, and the sum
  of what all shares consumed may not exceed the capacity (``CmpRequestOverCapacity``);
* a device taken whole by someone is not shared, and a shared one is not taken whole;
* the devices of one request are distinct.

Quantities are integers in the capacity's own unit (bytes for memory, whatever the driver
publishes for compute); the caller converts the API's quantity strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpuslice.core.dra_default import default_pick
from gpuslice.core.errors import ValidationError
from gpuslice.core.fit import feasible
from gpuslice.core.frag import TargetWorkload
from gpuslice.core.gpuselect import allows_gpu
from gpuslice.core.model import (
    MILLI,
    BoolArray,
    ClusterArrays,
    Gpu,
    IntArray,
    Node,
    SliceRequest,
    build_arrays,
)
from gpuslice.core.policies import PlacementState, Policy, choose, task_tag, tie_order

MIB = 1024 * 1024
COMPUTE = "compute"
MEMORY = "memory"

REASON_UNSUPPORTED = "claim shape not handled by gpuslice (left to the default allocator)"
REASON_NO_DEVICE = "no device with the requested capacity free"
REASON_NODE = "node CPU or memory short"


# ---- capacities and their request policies -------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """A capacity's ``requestPolicy``: a default, and either valid values (ascending) or a
    valid range (``min``, optional ``max`` and ``step``)."""

    default: int | None = None
    valid_values: tuple[int, ...] = ()
    min: int | None = None
    max: int | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if self.valid_values and self.min is not None:
            raise ValidationError("requestPolicy", "validValues or validRange, not both",
                                  (self.valid_values, self.min))
        if list(self.valid_values) != sorted(set(self.valid_values)):
            raise ValidationError("requestPolicy.validValues", "distinct ascending values",
                                  self.valid_values)
        if self.step is not None and self.step <= 0:
            raise ValidationError("requestPolicy.validRange.step", "a value > 0", self.step)
        if self.min is None and (self.max is not None or self.step is not None):
            raise ValidationError("requestPolicy.validRange.min", "a minimum with max or step",
                                  None)

    def consumed(self, requested: int | None, capacity: int) -> int:
        """What a share consumes for ``requested`` (``None``: the claim names no value)."""
        if requested is None:
            return capacity if self.default is None else self.default
        if self.min is not None:
            if requested < self.min:
                return self.min
            if self.step is None:
                return requested
            n = -(-(requested - self.min) // self.step)
            return self.min + self.step * n
        for v in self.valid_values:
            if requested <= v:
                return v
        return requested

    def violated_by(self, value: int) -> bool:
        if self.default is not None and value == self.default:
            return False
        if self.min is not None:
            if self.max is not None and value > self.max:
                return True
            return self.step is not None and (value - self.min) % self.step != 0
        if self.valid_values:
            return value not in self.valid_values
        return False


@dataclass(frozen=True, slots=True)
class Capacity:
    value: int
    policy: RequestPolicy | None = None

    def consumed(self, requested: int | None) -> int:
        if self.policy is None:
            return self.value if requested is None else requested
        return self.policy.consumed(requested, self.value)


# ---- the inventory ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DraDevice:
    """One device of a ResourceSlice: its pool and name, what kind it is (the ``type``
    attribute: ``gpu``, ``share``, ``mig``), the GPU model, whether it allows multiple
    allocations, and its capacities."""

    pool: str
    name: str
    kind: str = "gpu"
    model: str = ""
    shared: bool = False
    capacity: Mapping[str, Capacity] = field(default_factory=dict)
    uuid: str = ""  # the ``uuid`` attribute: the GPU's, or a MIG instance's
    gpu_uuid: str = ""  # ``parentUUID``: a MIG device's GPU

    @property
    def key(self) -> tuple[str, str]:
        return (self.pool, self.name)


@dataclass(frozen=True, slots=True)
class DraNode:
    """A node: its allocatable CPU (milli) and memory (MiB), what pods already request, and
    its devices in the order the default allocator tries them (pools and slices by name,
    devices in slice order)."""

    name: str
    cpu_milli: int
    memory_mib: int
    devices: tuple[DraDevice, ...] = ()
    cpu_used: int = 0
    memory_used: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    """What allocated claims took of one device: the whole of it, or shares that consumed
    these capacities in total."""

    whole: bool = False
    consumed: Mapping[str, int] = field(default_factory=dict)

    def plus(self, whole: bool, consumed: Mapping[str, int]) -> Usage:
        total = dict(self.consumed)
        for k, v in consumed.items():
            total[k] = total.get(k, 0) + v
        return Usage(self.whole or whole, total)


def consume(device: DraDevice, usage: Usage | None, capacity: Mapping[str, int]) -> \
        dict[str, int] | None:
    """What a request for ``capacity`` consumes of ``device`` given its ``usage``, or ``None``
    when it does not fit (``CmpRequestOverCapacity`` and the in-use checks of the upstream
    allocator). A device taken whole consumes nothing by capacity (``{}``)."""
    if usage is not None and usage.whole:
        return None
    if any(name not in device.capacity for name in capacity):
        return None
    used = usage.consumed if usage is not None else {}
    out: dict[str, int] = {}
    for name, cap in device.capacity.items():
        want = cap.consumed(capacity.get(name))
        if cap.policy is not None and cap.policy.violated_by(want):
            return None
        if used.get(name, 0) + want > cap.value:
            return None
        out[name] = want
    if not device.shared:
        return None if used else {}
    return out


# ---- claims and decisions --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """One request of a claim: ``count`` distinct devices of the given kinds (and GPU models,
    empty: any), each giving ``capacity`` (shared devices)."""

    name: str
    count: int = 1
    capacity: Mapping[str, int] = field(default_factory=dict)
    kinds: frozenset[str] = frozenset({"gpu"})
    models: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValidationError(f"request {self.name}: count", "a device count >= 1",
                                  self.count)
        for k, v in self.capacity.items():
            if v < 0:
                raise ValidationError(f"request {self.name}: capacity {k}", "a value >= 0", v)

    def accepts(self, device: DraDevice) -> bool:
        return device.kind in self.kinds and (not self.models or allows_gpu(
            self.models, device.model, device.uuid, device.gpu_uuid))


@dataclass(frozen=True, slots=True)
class DeviceResult:
    """One device given to a request; ``consumed`` is set for a share (``shared``)."""

    request: str
    pool: str
    device: str
    shared: bool
    consumed: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DraPlacement:
    node: str
    results: tuple[DeviceResult, ...]
    score: float
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DraDecision:
    """Where a claim goes, or why nowhere (rejected nodes counted by reason)."""

    placement: DraPlacement | None
    policy: str
    feasible_nodes: int
    reasons: Mapping[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.placement is not None

    def message(self) -> str:
        if self.placement is None:
            parts = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items()))
            return f"{self.policy}: no placement ({parts or 'no nodes'})"
        devs = ",".join(f"{r.pool}/{r.device}" for r in self.placement.results)
        why = "; ".join(self.placement.reasons)
        return (f"{self.policy}: node {self.placement.node} devices {devs} "
                f"(score {self.placement.score:.3f}, {self.feasible_nodes} feasible"
                + (f"; {why})" if why else ")"))


# ---- the ledger ------------------------------------------------------------------------------


def _milli_free(device: DraDevice, usage: Usage | None) -> int:
    if usage is not None and usage.whole:
        return 0
    cap = device.capacity.get(COMPUTE)
    used = usage.consumed if usage is not None else {}
    if not device.shared or cap is None or cap.value <= 0:
        return 0 if used else MILLI
    return max(0, (cap.value - used.get(COMPUTE, 0)) * MILLI // cap.value)


def _mem_mib(device: DraDevice, usage: Usage | None) -> tuple[int, int]:
    cap = device.capacity.get(MEMORY)
    if cap is None:
        return 0, 0
    if usage is not None and usage.whole:
        return cap.value // MIB, 0
    used = usage.consumed.get(MEMORY, 0) if usage is not None else 0
    return cap.value // MIB, max(0, cap.value - used) // MIB


class DraLedger:
    """The cluster's DRA devices, what is consumed of them, and the arrays our policies score
    (one row per node, one GPU slot per device in slice order: free milli from the ``compute``
    capacity, free MiB from ``memory``).

    Pure and single-threaded: the owner (the claim allocator, the simulator) asks for a
    decision, writes it where it must, then :meth:`apply` it here.
    """

    def __init__(self, nodes: Sequence[DraNode], usage: Mapping[tuple[str, str], Usage],
                 workload: TargetWorkload | None) -> None:
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ValidationError("nodes", "unique node names", names)
        self.nodes = tuple(nodes)
        self.usage: dict[tuple[str, str], Usage] = dict(usage)
        self.where: dict[tuple[str, str], tuple[int, int]] = {}
        core_nodes: list[Node] = []
        for i, nd in enumerate(self.nodes):
            gpus: list[Gpu] = []
            model = next((d.model for d in nd.devices if d.model), "gpu")
            for j, d in enumerate(nd.devices):
                if d.key in self.where:
                    raise ValidationError(f"node {nd.name}: device", "unique pool/device names",
                                          d.key)
                self.where[d.key] = (i, j)
                u = self.usage.get(d.key)
                cap, free = _mem_mib(d, u)
                gpus.append(Gpu(j, model, cap, _milli_free(d, u), free))
            core_nodes.append(Node(nd.name, nd.cpu_milli, nd.memory_mib, tuple(gpus),
                                   max(0, nd.cpu_milli - nd.cpu_used),
                                   max(0, nd.memory_mib - nd.memory_used)))
        self.arrays: ClusterArrays = build_arrays(core_nodes)
        self.state = PlacementState.build(self.arrays, workload)
        self.next_start = 0  # kube-scheduler's rotating filter start (nextStartNodeIndex)
        self.index = {nd.name: i for i, nd in enumerate(self.nodes)}
        # ties go to a fixed node order by the names' hash, the extender's (core tie_order)
        self.rank = tie_order([nd.name for nd in self.nodes])
        self._kinds: dict[tuple[frozenset[str], frozenset[str]], BoolArray] = {}
        self._sreq: dict[tuple[object, ...], SliceRequest | None] = {}
        # what apply() changed since the owner last set it from its inputs
        self.applied_devices: set[tuple[str, str]] = set()
        self.applied_nodes: set[str] = set()

    def set_workload(self, workload: TargetWorkload | None) -> None:
        """Score against ``workload`` from now on (the placement state rebuilt: a ledger made
        without one can first turn the pods' requests into shapes to learn it from)."""
        self.state = PlacementState.build(self.arrays, workload)

    # -- the request as the policies see it --------------------------------------------------

    def slice_request(self, req: DeviceRequest | None, cpu_milli: int, memory_mib: int) -> \
            SliceRequest | None:
        """The request in milli-GPU and MiB, from what it consumes of the first device that
        could take it (``None``: no device of the cluster could, or a shape the milli-GPU
        model does not express: several devices each sharing a fraction). No request: a pod
        without devices."""
        if req is None:
            return SliceRequest(cpu_milli=cpu_milli, memory_mib=memory_mib)
        key = (req.count, tuple(sorted(req.capacity.items())), req.kinds, req.models)
        if key not in self._sreq:
            self._sreq[key] = self._device_share(req)
        got = self._sreq[key]
        if got is None:
            return None
        return SliceRequest(gpus=got.gpus, milli=got.milli, cpu_milli=cpu_milli,
                            memory_mib=memory_mib, gpu_memory_mib=got.gpu_memory_mib,
                            name=req.name)

    def _device_share(self, req: DeviceRequest) -> SliceRequest | None:
        for nd in self.nodes:
            for d in nd.devices:
                if not req.accepts(d):
                    continue
                got = consume(d, None, req.capacity)
                if got is None:
                    continue
                if d.shared and COMPUTE in d.capacity and d.capacity[COMPUTE].value > 0:
                    cap = d.capacity[COMPUTE].value
                    milli = min(MILLI, -(-got[COMPUTE] * MILLI // cap))
                else:
                    milli = MILLI
                mem = -(-got.get(MEMORY, 0) // MIB) if d.shared else 0
                if req.count > 1 and milli != MILLI:
                    return None
                return SliceRequest(gpus=req.count, milli=max(1, milli), gpu_memory_mib=mem)
        return None

    def _kind_ok(self, req: DeviceRequest) -> BoolArray:
        """Per node and slot: is the device of a kind and model the request accepts?"""
        key = (req.kinds, req.models)
        if key not in self._kinds:
            ok = np.zeros(self.arrays.gpu_present.shape, dtype=np.bool_)
            for i, nd in enumerate(self.nodes):
                for j, d in enumerate(nd.devices):
                    ok[i, j] = req.accepts(d)
            self._kinds[key] = ok
        return self._kinds[key]

    def _exact(self, node: int, slots: Sequence[int], req: DeviceRequest) -> \
            tuple[DeviceResult, ...] | None:
        nd = self.nodes[node]
        out: list[DeviceResult] = []
        for j in slots:
            d = nd.devices[j]
            if not req.accepts(d):
                return None
            got = consume(d, self.usage.get(d.key), req.capacity)
            if got is None:
                return None
            out.append(DeviceResult(req.name, d.pool, d.name, d.shared, got))
        if len({(r.pool, r.device) for r in out}) != len(out):
            return None
        return tuple(out)

    def _first_fit(self, node: int, req: DeviceRequest) -> tuple[DeviceResult, ...] | None:
        """The default allocator on one node: the first ``count`` devices in slice order."""
        nd = self.nodes[node]
        out: list[DeviceResult] = []
        for d in nd.devices:
            if not req.accepts(d):
                continue
            got = consume(d, self.usage.get(d.key), req.capacity)
            if got is None:
                continue
            out.append(DeviceResult(req.name, d.pool, d.name, d.shared, got))
            if len(out) == req.count:
                return tuple(out)
        return None

    def _candidates(self, sreq: SliceRequest, kind_ok: BoolArray) -> BoolArray:
        a = self.arrays
        ok = a.gpu_present & kind_ok & (a.gpu_free >= sreq.milli)
        if sreq.gpu_memory_mib:
            ok &= a.gpu_mem_free >= sreq.gpu_memory_mib
        nodes = (a.cpu_free >= sreq.cpu_milli) & (a.mem_free >= sreq.memory_mib)
        return np.asarray(nodes & (ok.sum(axis=1) >= sreq.gpus))

    # -- decisions -----------------------------------------------------------------------------

    def _eligible(self, req: DeviceRequest | None, sreq: SliceRequest) -> BoolArray:
        if req is None:
            return np.asarray(feasible(self.arrays, sreq))
        return np.asarray(self._candidates(sreq, self._kind_ok(req))
                          & feasible(self.arrays, sreq))

    def decide(self, req: DeviceRequest | None, policy: Policy, rng: np.random.Generator, *,
               cpu_milli: int = 0, memory_mib: int = 0, rank: IntArray | None = None,
               only: BoolArray | None = None) -> DraDecision:
        """Our placement: the policy picks the node and the devices among those where the
        claim fits (and the pod's CPU and memory), scored on the same arrays as the device
        plugin path; the devices it picks are then checked by the exact DRA rule. ``req``
        None: a pod without devices, placed by the policy all the same; ``only``: the nodes
        it may go to (by row). Ties go to the node of lowest ``rank`` (default :attr:`rank`:
        the names' hash order the extender breaks ties in, so both paths tie alike)."""
        sreq = self.slice_request(req, cpu_milli, memory_mib)
        if sreq is None:
            return DraDecision(None, policy.name, 0, {REASON_UNSUPPORTED: len(self.nodes)})
        ok = self._eligible(req, sreq) if only is None else self._eligible(req, sreq) & only
        n_ok = int(ok.sum())
        # the policy scores every slot; one of a kind the request does not accept (a node
        # mixing kinds) fails the exact check below and the node's first fit is taken instead
        for _ in range(4):
            found = choose(policy, self.state, sreq, ok, rng,
                           self.rank if rank is None else rank)
            if found is None:
                break
            results: tuple[DeviceResult, ...] | None = ()
            if req is not None:
                results = self._exact(found.node, found.gpus, req)
                if results is None:  # rounding differs from the device the milli came from
                    results = self._first_fit(found.node, req)
            if results is not None:
                why = self._why(found.node, found.gpus, sreq)
                return DraDecision(DraPlacement(self.nodes[found.node].name, results,
                                                float(found.score), why), policy.name, n_ok)
            ok[found.node] = False
        return DraDecision(None, policy.name, 0, self._reasons(req, sreq))

    def decide_default(self, req: DeviceRequest | None, rng: np.random.Generator, *,
                       cpu_milli: int = 0, memory_mib: int = 0,
                       percentage: int = 0) -> DraDecision:
        """kube-scheduler with its default score plugins and the DRA allocator: filter nodes
        from a rotating start until enough feasible ones are found (``percentage`` 0: the
        adaptive share), score them by NodeResourcesFit (LeastAllocated) plus
        NodeResourcesBalancedAllocation on CPU and memory, pick the best (ties at random), and
        take the first fitting devices in slice order there."""
        name = "dra-default"
        sreq = self.slice_request(req, cpu_milli, memory_mib)
        if sreq is None:
            return DraDecision(None, name, 0, {REASON_UNSUPPORTED: len(self.nodes)})
        ok = self._eligible(req, sreq)
        pick = default_pick(self.arrays, sreq, ok, self.next_start, rng, percentage)
        if pick is None:
            return DraDecision(None, name, 0, self._reasons(req, sreq))
        node = pick.node
        self.next_start = pick.next_start
        results: tuple[DeviceResult, ...] | None = ()
        if req is not None:
            results = self._first_fit(node, req)
        if results is None:  # the arrays said yes; the exact rule is the judge
            return DraDecision(None, name, 0, {REASON_NO_DEVICE: 1})
        return DraDecision(
            DraPlacement(self.nodes[node].name, results, pick.score,
                         ("highest NodeResourcesFit + BalancedAllocation score",
                          "first fitting devices in slice order")), name, pick.scored)

    def _why(self, node: int, slots: Sequence[int], sreq: SliceRequest) -> tuple[str, ...]:
        a = self.arrays
        frees = ", ".join(f"{self.nodes[node].devices[j].name} {int(a.gpu_free[node, j])} "
                          "milli free" for j in slots)
        out = [f"{frees} before; {sreq.milli} milli asked"]
        if self.state.workload is not None:
            out.append(f"node fragmentation {self.state.frag[node]:.0f} milli before")
        return tuple(out)

    def _reasons(self, req: DeviceRequest | None, sreq: SliceRequest) -> dict[str, int]:
        a = self.arrays
        node_ok = (a.cpu_free >= sreq.cpu_milli) & (a.mem_free >= sreq.memory_mib)
        if req is None:
            dev = np.ones(a.n_nodes, dtype=np.bool_)
        else:
            bare = SliceRequest(sreq.gpus, sreq.milli, 0, 0, sreq.gpu_memory_mib)
            dev = self._candidates(bare, self._kind_ok(req))
        out: dict[str, int] = {}
        if int((~dev).sum()):
            out[REASON_NO_DEVICE] = int((~dev).sum())
        if int((dev & ~node_ok).sum()):
            out[REASON_NODE] = int((dev & ~node_ok).sum())
        return out

    # -- applying ------------------------------------------------------------------------------

    def apply(self, placement: DraPlacement, sreq: SliceRequest | None = None) -> None:
        """Record ``placement`` as allocated, with the pod's CPU and memory (``sreq``, as
        :meth:`slice_request` gave it) on its node, and refresh that node's arrays and
        fragmentation. Results for devices this ledger does not know are ignored. The devices
        and node are noted in :attr:`applied` (an owner keeping the ledger sets them from
        what the API server says once the claim comes back: :meth:`set_usage`)."""
        i = self.index.get(placement.node)
        if i is not None:
            self.applied_nodes.add(placement.node)
        for r in placement.results:
            key = (r.pool, r.device)
            if key not in self.where:
                continue
            self.applied_devices.add(key)
            row, j = self.where[key]
            u = self.usage.get(key, Usage()).plus(not r.shared, r.consumed)
            self.usage[key] = u
            d = self.nodes[row].devices[j]
            self.arrays.gpu_free[row, j] = _milli_free(d, u)
            self.arrays.gpu_mem_free[row, j] = _mem_mib(d, u)[1]
            if row != i:
                self.state.refresh(row)
        if i is None:
            return
        if sreq is not None:
            self.arrays.cpu_free[i] -= sreq.cpu_milli
            self.arrays.mem_free[i] -= sreq.memory_mib
            tag = task_tag(sreq)
            if 0 <= tag < self.state.affinity.shape[1]:
                self.state.affinity[i, tag] += 1
        self.state.refresh(i)

    # -- kept between passes -------------------------------------------------------------------

    def set_usage(self, key: tuple[str, str], usage: Usage | None) -> int | None:
        """What allocated claims took of device ``key`` is now ``usage`` (``None``: nothing);
        its slot's free milli and memory follow. Returns the device's node row for
        :meth:`refresh` (``None``: a device this ledger does not know)."""
        where = self.where.get(key)
        if where is None:
            return None
        row, j = where
        if usage is None:
            self.usage.pop(key, None)
        else:
            self.usage[key] = usage
        d = self.nodes[row].devices[j]
        self.arrays.gpu_free[row, j] = _milli_free(d, usage)
        self.arrays.gpu_mem_free[row, j] = _mem_mib(d, usage)[1]
        return row

    def set_used(self, node: str, cpu_used: int, memory_used: int) -> int | None:
        """What pods request of ``node``'s CPU (milli) and memory (MiB) is now this. Returns
        its row for :meth:`refresh` (``None``: a node this ledger does not hold)."""
        i = self.index.get(node)
        if i is None:
            return None
        nd = self.nodes[i]
        self.arrays.cpu_free[i] = max(0, nd.cpu_milli - cpu_used)
        self.arrays.mem_free[i] = max(0, nd.memory_mib - memory_used)
        return i

    def refresh(self, rows: Iterable[int]) -> None:
        """Re-derive the policies' per-node values (fragmentation) of the rows changed by
        :meth:`set_usage` and :meth:`set_used`."""
        for i in set(rows):
            self.state.refresh(i)
