"""The kube-scheduler extender: filter, prioritize and bind over HTTP with GPU-level accounting.

kube-scheduler only counts extended resources per node. The extender decides per GPU: filter
drops nodes where no GPU (or not enough GPUs) has the share a pod asks for, with a reason per
node; prioritize scores the rest 0..10 with a core placement policy; bind chooses the GPUs, takes
them in the ledger (a compare-and-swap of an immutable value, no node-wide lock), writes the
signed assignment on the pod with the pod's resourceVersion (optimistic concurrency), then
creates the Binding. Everything is rebuilt from the API server on start: the ledger from the
assignments of live pods, so a restart loses nothing and doubles nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gpuslice.adapters.kube.annotation import AnnotationError, decode, encode
from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound, KubePort, WatchEvent
from gpuslice.adapters.kube.objects import (
    CORDONED_ANNOTATION as CORDONED,
)
from gpuslice.adapters.kube.objects import (
    INVENTORY_ANNOTATION,
    MIG_PROFILE_ANNOTATION,
    InventoryMig,
    node_inventory,
    pod_key,
    pod_request,
)
from gpuslice.core import catalog, migmps
from gpuslice.core.assignment import (
    ANNOTATION,
    Assignment,
    ContainerAssignment,
    GpuShare,
    Mode,
    sign,
    verify,
)
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.fit import explain, feasible, gpu_ok
from gpuslice.core.lease import LeaseAction, LeaseState, decide
from gpuslice.core.ledger import Conflict, GpuSlot, Ledger
from gpuslice.core.migmps import InstanceRoom
from gpuslice.core.model import ClusterArrays, Gpu, Isolation, Node, SliceRequest, build_arrays
from gpuslice.core.policies import PlacementState, best_fit_gpu, exclusive_gpus, make_policy
from gpuslice.services.extender_metrics import ExtenderMetrics

MAX_BODY = 8 * 1024 * 1024


def bind_clock() -> str:
    """Now, as an assignment's bind time: RFC 3339 UTC with microseconds (the node's device
    plugin executes waiting assignments in bind order, as the kubelet admits pods in the order
    their binds reach it: seconds would tie a burst and fall back to name order)."""
    from datetime import UTC, datetime

    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Holds (or waits for) the extender's Lease; only the leader binds. Filter and prioritize
    are read-only and every replica follows the same watch, so any replica may answer them."""

    def __init__(self, api: KubePort, namespace: str, name: str, identity: str,
                 clock: Callable[[], float], duration_s: float = 15.0) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.clock, self.duration_s = clock, duration_s
        self.leader = False

    def step(self) -> bool:
        """One round: create, renew or take the lease, or wait. Returns whether we lead."""
        from datetime import UTC, datetime

        lease = self.api.get_lease(self.namespace, self.name)
        state = None
        rv = None
        if lease is not None:
            spec = lease.get("spec") or {}
            renewed = spec.get("renewTime")
            try:
                at = datetime.fromisoformat(str(renewed).replace("Z", "+00:00")).timestamp()
            except ValueError:
                at = 0.0
            state = LeaseState(str(spec.get("holderIdentity") or ""), at,
                               float(spec.get("leaseDurationSeconds") or self.duration_s),
                               int(spec.get("leaseTransitions") or 0))
            rv = lease["metadata"]["resourceVersion"]
        now = self.clock()
        action = decide(state, self.identity, now)
        if action is LeaseAction.WAIT:
            self.leader = False
            return False
        transitions = (state.transitions if state else 0) + (action is LeaseAction.TAKE)
        stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.duration_s),
                "renewTime": stamp, "leaseTransitions": transitions}
        if action is not LeaseAction.RENEW:
            spec["acquireTime"] = stamp
        try:
            self.api.put_lease(self.namespace, self.name, spec, rv)
            self.leader = True
        except (ApiConflict, ApiNotFound):
            self.leader = False  # someone else wrote it first
        return self.leader


def _node_mark(node: dict[str, Any]) -> tuple[str, str]:
    """What of a node the extender follows: its GPU inventory and its cordoned GPUs."""
    ann = (node.get("metadata") or {}).get("annotations") or {}
    return (str(ann.get(INVENTORY_ANNOTATION, "")), str(ann.get(CORDONED, "")))


@dataclass(frozen=True)
class _Inventory:
    names: list[str]
    index: dict[str, int]
    uuids: list[list[str]]  # per node, GPU UUID by slot
    arrays: ClusterArrays
    # per node: the MIG instances of its MIG-enabled GPUs, (GPU UUID, GPU model, instance)
    mig: list[list[tuple[str, str, InventoryMig]]]
    # MIG-enabled GPUs: no whole-GPU slice; MPS slices go inside their instances
    mig_gpus: frozenset[str] = frozenset()
    mig_rows: frozenset[int] = frozenset()  # nodes with a MIG-enabled GPU


@dataclass(frozen=True)
class _MigWish:
    slices: int  # compute slices at least
    memory_mib: int
    models: frozenset[str]


def _mig_wish(req: SliceRequest) -> _MigWish:
    """A MIG-isolated request: the compute slices its milli stands for (3g for 429), memory."""
    return _MigWish(max(1, round(req.milli * 7 / 1000)), req.gpu_memory_mib, req.models)


class ExtenderState:
    """The extender's view of the cluster: node GPU inventory, the ledger, and arrays for the
    core's fit and policies (GPU free milli and memory per node and slot)."""

    def __init__(self, api: KubePort, key: bytes, *, policy: str = "bestfit",
                 clock: Callable[[], str]) -> None:
        self.api = api
        self.key = key
        self.policy = make_policy(policy)
        if self.policy.needs_workload:
            raise ValidationError("extender policy", "a policy that needs no target workload",
                                  policy)
        self.clock = clock
        self._lock = threading.Lock()  # guards the ledger reference and the arrays' GPU rows
        self.problems: list[str] = []
        # binds reserved in the ledger whose annotation may not be visible in a re-list yet
        self._in_flight: dict[tuple[str, str], Assignment] = {}
        self._mig_use_of: tuple[Ledger, dict[tuple[str, int], tuple[int, int, bool]]] | None = \
            None
        self.elector: LeaderElector | None = None  # set when replicas elect a binder
        self.cordoned: set[str] = set()
        self._node_marks: dict[str, tuple[str, str]] = {}  # what of each node we follow
        self.rebuild()

    # -- state --------------------------------------------------------------------------------

    def rebuild(self) -> None:
        """Read nodes and pods from the API server and derive everything again."""
        names: list[str] = []
        uuids: list[list[str]] = []
        nodes: list[Node] = []
        slots: list[GpuSlot] = []
        cordoned: set[str] = set()
        migs: list[list[tuple[str, str, InventoryMig]]] = []
        mig_gpus: set[str] = set()
        mig_rows: set[int] = set()
        marks: dict[str, tuple[str, str]] = {}
        for n in self.api.list_nodes():
            name = n["metadata"]["name"]
            marks[name] = _node_mark(n)
            raw = ((n["metadata"].get("annotations") or {}).get(CORDONED) or "")
            cordoned.update(u.strip() for u in raw.split(",") if u.strip())
            try:
                inv = sorted(node_inventory(n), key=lambda g: g.index)
            except ValidationError as exc:
                self.problems.append(str(exc))
                inv = []
            names.append(name)
            uuids.append([g.uuid for g in inv])
            migs.append([(g.uuid, g.model, m) for g in inv for m in g.mig])
            mig_gpus.update(g.uuid for g in inv if g.mig_enabled)
            if any(g.mig_enabled for g in inv):
                mig_rows.add(len(names) - 1)
            nodes.append(Node(name, 0, 0, tuple(Gpu(j, g.model, g.memory_mib)
                                                for j, g in enumerate(inv))))
            slots.extend(GpuSlot(g.uuid, name, g.memory_mib) for g in inv)
        assignments = []
        for p in self.api.list_pods():
            a = self._assignment_of(p)
            phase = (p.get("status") or {}).get("phase")
            if a is not None and phase not in ("Succeeded", "Failed"):
                assignments.append(a)
        ledger, problems = Ledger.rebuild(slots, assignments)
        self.problems.extend(problems)
        arrays = build_arrays(nodes)
        inv_ = _Inventory(names, {n: i for i, n in enumerate(names)}, uuids, arrays, migs,
                          frozenset(mig_gpus), frozenset(mig_rows))
        with self._lock:
            for key, a in list(getattr(self, "_in_flight", {}).items()):
                if key not in ledger.owners:
                    try:
                        ledger = ledger.reserve(a)
                    except Conflict as exc:
                        self.problems.append(f"in-flight bind {key}: {exc.reason}")
            self.inv = inv_
            self.ledger = ledger
            self.cordoned = cordoned
            self._node_marks = marks
            for i in range(len(names)):
                self._refresh_row(i)

    def _assignment_of(self, pod: dict[str, Any]) -> Assignment | None:
        ann = (pod.get("metadata") or {}).get("annotations") or {}
        text = ann.get(ANNOTATION)
        if not text:
            return None
        try:
            a = decode(text)
        except AnnotationError as exc:
            self.problems.append(f"pod {pod_key(pod)}: {exc}")
            return None
        if not verify(a, self.key):
            self.problems.append(f"pod {pod_key(pod)}: assignment signature does not verify")
            return None
        return a

    def _open_free(self, uuid: str, led: Ledger) -> tuple[int, int]:
        """(milli, MiB) GPU ``uuid`` offers whole-GPU slices under ledger ``led``: none when it
        is cordoned for reconfiguration, or MIG-enabled (MPS slices go inside its instances:
        :meth:`_mig_rooms`)."""
        return (0, 0) if uuid in self.cordoned or uuid in self.inv.mig_gpus else led.free(uuid)

    def _refresh_row(self, i: int) -> None:
        a = self.inv.arrays
        for j, uuid in enumerate(self.inv.uuids[i]):
            a.gpu_free[i, j], a.gpu_mem_free[i, j] = self._open_free(uuid, self.ledger)

    def apply(self, event: WatchEvent) -> None:
        """Follow a watch event: a node that joins, leaves, or changes its GPU inventory or
        cordon re-reads everything (other node changes, the kubelet's status updates above all,
        are passed over); a pod that is deleted or finished gives its share back; a verified
        assignment seen on a pod (written by another extender replica, or before a restart) is
        taken if the ledger does not hold it yet."""
        if event.kind == "Node":
            if self._node_changed(event):
                self.rebuild()
            return
        ns, name = pod_key(event.obj)
        phase = (event.obj.get("status") or {}).get("phase")
        if event.type == "DELETED" or phase in ("Succeeded", "Failed"):
            self.pod_gone(ns, name)
            return
        a = self._assignment_of(event.obj)
        if a is None or (ns, name) in self.ledger.owners or (ns, name) in self._in_flight:
            return
        with self._lock:
            try:
                self.ledger = self.ledger.reserve(a)
            except Conflict as exc:
                self.problems.append(f"pod {ns}/{name}: {exc.reason}")
                return
            if a.node in self.inv.index:
                self._refresh_row(self.inv.index[a.node])

    def apply_all(self, events: list[WatchEvent]) -> None:
        """:meth:`apply` for a batch: at most one re-read, whatever the number of nodes that
        changed, then the pod events."""
        if any(ev.kind == "Node" and self._node_changed(ev) for ev in events):
            self.rebuild()
        for ev in events:
            if ev.kind != "Node":
                self.apply(ev)

    def _node_changed(self, event: WatchEvent) -> bool:
        name = str((event.obj.get("metadata") or {}).get("name", ""))
        before = self._node_marks.get(name)
        if event.type == "DELETED":
            return before is not None
        return before != _node_mark(event.obj)

    def pod_gone(self, namespace: str, name: str) -> None:
        """A pod was deleted or finished: give its share back."""
        with self._lock:
            a = self.ledger.owners.get((namespace, name))
            self.ledger = self.ledger.release(namespace, name)
            if a is not None and a.node in self.inv.index:
                self._refresh_row(self.inv.index[a.node])

    # -- the verbs ----------------------------------------------------------------------------

    @staticmethod
    def _gpu_only(req: SliceRequest) -> SliceRequest:
        # CPU and memory are kube-scheduler's own fit; the extender judges GPUs only
        return SliceRequest(req.gpus, req.milli, 0, 0, req.gpu_memory_mib, req.models,
                            req.isolation, req.name, req.memory_share)

    def filter(self, pod: dict[str, Any], names: list[str]) -> tuple[list[str], dict[str, str]]:
        req = pod_request(pod)
        if req is None:
            return names, {}
        if req.isolation is Isolation.MIG:
            return self._filter_mig(_mig_wish(req), names)
        g = self._gpu_only(req)
        a = self.inv.arrays
        ok = feasible(a, g)
        # one vectorised pass for the reasons: the best GPU of each node and why it falls short
        fits = gpu_ok(a, g)
        n_fit = fits.sum(axis=1)
        best = np.argmax(np.where(a.gpu_present, a.gpu_free, -1), axis=1)
        allowed = a.model_mask(g.models)
        mode = _mode(req)
        keep: list[str] = []
        failed: dict[str, str] = {}
        for n in names:
            i = self.inv.index.get(n)
            if i is None:
                failed[n] = "node unknown to gpuslice (no GPU inventory yet)"
            elif ok[i]:
                keep.append(n)
            elif a.gpu_count[i] == 0:
                failed[n] = "node has no GPU"
            elif not allowed[i]:
                failed[n] = (f"node has {a.models[a.model_id[i]]} GPUs, pod accepts "
                             f"{'|'.join(sorted(g.models))}")
            elif g.gpus > 1:
                failed[n] = f"{n_fit[i]} of {a.gpu_count[i]} GPUs free enough, pod needs {g.gpus}"
            else:
                j = int(best[i])
                if a.gpu_free[i, j] >= g.milli:
                    failed[n] = (f"GPU {j} has {a.gpu_mem_free[i, j]} MiB free, pod needs "
                                 f"{g.memory_on(int(a.gpu_mem_cap[i, j]))}")
                else:
                    failed[n] = (f"GPU {j} has {a.gpu_free[i, j]} milli free, pod needs "
                                 f"{g.milli} (the most free GPU of the node)")
            if n in failed and i is not None and i in self.inv.mig_rows and mode is Mode.MPS:
                if self._mig_room_for(i, req) is not None:
                    del failed[n]
                    keep.append(n)
                    continue
                rooms = self._mig_rooms(i, req.models)
                wish = _memory_wish(req)
                mem = "its share of the memory" if wish is None else f"{wish} MiB"
                failed[n] += (f"; MPS inside MIG instances: none has {req.milli} milli and "
                              f"{mem} free"
                              + (f" ({', '.join(map(str, rooms))})" if rooms else "")
                              if req.gpus == 1 else "; MPS inside MIG takes one GPU per pod")
            if n in failed and i is not None and i in self.inv.mig_rows and mode is not Mode.MPS:
                k = sum(u in self.inv.mig_gpus for u in self.inv.uuids[i])
                failed[n] += (f"; {k} GPU(s) MIG-enabled: no whole-GPU {mode.value} slice "
                              "there, only MPS slices inside their instances")
            if n in failed and i is not None:
                k = sum(u in self.cordoned for u in self.inv.uuids[i])
                if k:
                    failed[n] += f"; {k} GPU(s) cordoned for reconfiguration"
        return keep, failed

    # -- MPS slices inside MIG instances ----------------------------------------------------

    def _mig_use(self) -> dict[tuple[str, int], tuple[int, int, bool]]:
        """What assignments hold of each MIG instance, from the ledger (which holds in-flight
        binds too); derived once per ledger value, which a bind or a pod's end replaces."""
        led = self.ledger
        cached = self._mig_use_of
        if cached is None or cached[0] is not led:
            cached = self._mig_use_of = (led, migmps.usage(led.owners.values()))
        return cached[1]

    def _mig_rooms(self, i: int, models: frozenset[str],
                   use: dict[tuple[str, int], tuple[int, int, bool]] | None = None
                   ) -> list[InstanceRoom]:
        """The MIG instances of node ``i`` with what live assignments (or ``use``) hold."""
        if not self.inv.mig[i]:
            return []
        use = self._mig_use() if use is None else use
        out = []
        for gpu, model, m in self.inv.mig[i]:
            known = catalog.lookup(model)
            if known is None or known.mig is None or gpu in self.cordoned \
                    or (models and model not in models):
                continue
            try:
                slices = known.mig.profile(m.profile).compute_slices
            except ValidationError:  # a profile the catalogue does not know
                continue
            milli, mib, whole = use.get((gpu, m.start), (0, 0, False))
            out.append(InstanceRoom(gpu, m.profile, m.start,
                                    migmps.capacity_milli(slices, known.mig.compute_slices),
                                    m.memory_mib, milli, mib, whole))
        return out

    def _mig_room_for(self, i: int, req: SliceRequest,
                      profile: str = "") -> InstanceRoom | None:
        """The instance of node ``i`` for an MPS slice: the tightest of the planned
        ``profile`` when one has room, else the tightest of any profile."""
        if req.gpus != 1 or _mode(req) is not Mode.MPS:
            return None
        rooms = self._mig_rooms(i, req.models)
        planned = [r for r in rooms if r.profile == profile]
        return migmps.best_instance(planned, req.milli, _memory_wish(req)) or \
            migmps.best_instance(rooms, req.milli, _memory_wish(req))

    # -- MIG instances named in assignments ------------------------------------------------

    def _taken_mig(self) -> set[tuple[str, int]]:
        """(GPU UUID, start) of the MIG instances that live assignments hold."""
        held = list(self.ledger.owners.values()) + list(self._in_flight.values())
        return {(g.uuid, g.mig_start) for a in held for c in a.containers for g in c.gpus
                if g.mig_profile}

    def _mig_fits(self, i: int, wish: _MigWish,
                  taken: set[tuple[str, int]]) -> list[tuple[int, str, InventoryMig]]:
        """Free instances of node ``i`` big enough for ``wish``: (compute slices, GPU, inst)."""
        out = []
        for gpu, model, m in self.inv.mig[i]:
            known = catalog.lookup(model)
            if known is None or known.mig is None or (gpu, m.start) in taken \
                    or gpu in self.cordoned:
                continue
            if wish.models and model not in wish.models:
                continue
            size = known.mig.profile(m.profile).compute_slices
            if size >= wish.slices and m.memory_mib >= wish.memory_mib:
                out.append((size, gpu, m))
        return sorted(out, key=lambda x: (x[0], x[2].memory_mib, x[1], x[2].start))

    def _filter_mig(self, wish: _MigWish, names: list[str]
                    ) -> tuple[list[str], dict[str, str]]:
        taken = self._taken_mig()
        keep: list[str] = []
        failed: dict[str, str] = {}
        for n in names:
            i = self.inv.index.get(n)
            if i is None:
                failed[n] = "node unknown to gpuslice (no GPU inventory yet)"
            elif not self.inv.mig[i]:
                failed[n] = "node has no MIG instance (no MIG-enabled GPU)"
            elif self._mig_fits(i, wish, taken):
                keep.append(n)
            else:
                free = [m.profile for g, _, m in self.inv.mig[i] if (g, m.start) not in taken]
                failed[n] = (f"no free MIG instance of >= {wish.slices}g with "
                             f"{wish.memory_mib} MiB (free: {', '.join(free) or 'none'})")
        return keep, failed

    def prioritize(self, pod: dict[str, Any], names: list[str]) -> list[tuple[str, int]]:
        req = pod_request(pod)
        known = [n for n in names if n in self.inv.index]
        if req is None or not known:
            return [(n, 0) for n in names]
        if req.isolation is Isolation.MIG:  # the tightest free instance scores highest
            wish, taken = _mig_wish(req), self._taken_mig()
            out = []
            for n in names:
                fits = self._mig_fits(self.inv.index[n], wish, taken) if n in known else []
                out.append((n, max(0, 10 - (fits[0][0] - wish.slices)) if fits else 0))
            return out
        rows = np.array([self.inv.index[n] for n in known], dtype=np.int64)
        st = PlacementState.build(self.inv.arrays, None)
        ok = feasible(self.inv.arrays, self._gpu_only(req))[rows]
        in_mig: dict[str, int] = {}  # nodes that fit the pod only inside a MIG instance
        if self.inv.mig_rows and req.gpus == 1 and _mode(req) is Mode.MPS:
            for k in np.flatnonzero(~ok):
                room = self._mig_room_for(int(rows[k]), req)
                if room is not None:  # the tighter the instance, the higher
                    in_mig[known[k]] = max(1, 10 - round(10 * (room.free_milli - req.milli)
                                                         / room.capacity_milli))
        scores = np.zeros(len(known))
        if ok.any():
            scored = self.policy.score(st, self._gpu_only(req), rows[ok])
            lo, hi = float(scored.scores.min()), float(scored.scores.max())
            scaled = np.round(10 * (scored.scores - lo) / (hi - lo)) if hi > lo else \
                np.full(len(scored.scores), 10.0)
            scores[np.flatnonzero(ok)] = scaled
        by_name = {**dict(zip(known, scores.astype(int).tolist(), strict=True)), **in_mig}
        return [(n, by_name.get(n, 0)) for n in names]

    # -- preemption ---------------------------------------------------------------------------

    def _fits_with(self, i: int, req: SliceRequest, led: Ledger) -> bool:
        """Whether ``req`` fits node ``i``'s GPUs if the ledger were ``led``."""
        mode = _mode(req)
        if mode is Mode.MIG:
            taken = {(g.uuid, g.mig_start) for a in led.owners.values() for c in a.containers
                     for g in c.gpus if g.mig_profile}
            return bool(self._mig_fits(i, _mig_wish(req), taken))
        trial = self.inv.arrays.copy()
        for j, uuid in enumerate(self.inv.uuids[i]):
            trial.gpu_free[i, j], trial.gpu_mem_free[i, j] = self._open_free(uuid, led)
        if feasible(trial, self._gpu_only(req))[i]:
            return True
        if mode is Mode.MPS and req.gpus == 1 and i in self.inv.mig_rows:
            rooms = self._mig_rooms(i, req.models, migmps.usage(led.owners.values()))
            return migmps.best_instance(rooms, req.milli, _memory_wish(req)) is not None
        return False

    def preempt(self, pod: dict[str, Any],
                victims: dict[str, list[str]]) -> dict[str, list[str]]:
        """The scheduler's candidate victims per node (pod UIDs), cut to what the pod needs on
        the GPU side: a node where even all its victims free too little GPU share is dropped;
        elsewhere victims that hold no gpuslice share stay (the scheduler chose them for CPU
        or memory), and of those that do, as few go as will make room (the smallest shares
        are spared first). Reads the ledger; changes nothing."""
        req = pod_request(pod)
        if req is None:
            return victims
        by_uid = {a.pod_uid: a for a in self.ledger.owners.values()}
        out: dict[str, list[str]] = {}
        for node, uids in victims.items():
            i = self.inv.index.get(node)
            if i is None:
                continue
            on_gpu = [by_uid[u] for u in uids if u in by_uid and by_uid[u].node == node]
            led = self.ledger
            for a in on_gpu:
                led = led.release(a.namespace, a.pod)
            if not self._fits_with(i, req, led):
                continue
            spared: set[str] = set()
            for a in sorted(on_gpu, key=lambda a: (sum(g.milli for c in a.containers
                                                       for g in c.gpus), a.pod)):
                try:
                    kept = led.reserve(a)
                except Conflict:
                    continue
                if self._fits_with(i, req, kept):
                    led = kept
                    spared.add(a.pod_uid)
            out[node] = [u for u in uids if u not in spared]
        return out

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Bind the pod; returns an error message, or "" on success."""
        if self.elector is not None and not self.elector.leader:
            return f"this extender ({self.elector.identity}) is not the leader; retry"
        try:
            pod = self.api.get_pod(namespace, name)
        except ApiNotFound as exc:
            return str(exc)
        if (pod.get("metadata") or {}).get("uid") != uid:
            return f"pod {namespace}/{name}: UID {uid} does not match"
        try:
            req = pod_request(pod)
        except ValidationError as exc:
            return str(exc)
        if req is None:
            return f"pod {namespace}/{name} asks for no gpuslice resource"

        i = self.inv.index.get(node)
        if i is None:
            return f"node {node} is unknown to gpuslice"
        existing = self._assignment_of(pod)
        if existing is not None and existing.node == node:
            return self._create_binding(namespace, name, uid, node, None)  # a retried bind
        if existing is not None:
            if (pod.get("spec") or {}).get("nodeName"):
                return f"pod {namespace}/{name} is already bound to {existing.node}"
            # an earlier bind wrote its assignment but never created the Binding (the
            # extender died in between); the scheduler chose again: free the old share
            self.pod_gone(namespace, name)
        g = self._gpu_only(req)
        with self._lock:
            mode = _mode(req)
            if mode is Mode.MIG:
                fits = self._mig_fits(i, _mig_wish(req), self._taken_mig())
                if not fits:
                    return self._filter_mig(_mig_wish(req), [node])[1][node]
                size, gpu, inst = fits[0]
                shares: tuple[GpuShare, ...] = (GpuShare(
                    gpu, max(1, 1000 * size // 7), inst.memory_mib, inst.profile,
                    inst.start),)
            elif feasible(self.inv.arrays, g)[i]:
                gpus = (best_fit_gpu(self.inv.arrays, g, i) if g.is_sharing
                        else exclusive_gpus(self.inv.arrays, g, i))
                cap = self.inv.arrays.gpu_mem_cap
                shares = tuple(GpuShare(self.inv.uuids[i][j], req.milli,
                                        req.memory_on(int(cap[i, j]))) for j in gpus)
            else:  # an MPS slice inside a MIG instance, or nowhere
                planned = str(((pod.get("metadata") or {}).get("annotations") or {})
                              .get(MIG_PROFILE_ANNOTATION, ""))
                room = self._mig_room_for(i, req, planned)
                if room is None:
                    return self.filter(pod, [node])[1].get(node) or \
                        "; ".join(explain(self.inv.arrays, g, i))
                shares = (GpuShare(room.gpu, req.milli, _memory_in(req, room), room.profile,
                                   room.start),)
            containers = tuple(ContainerAssignment(c, mode, shares) for c in _gpu_containers(pod))
            a = sign(Assignment(namespace, name, uid, node, containers, self.clock()), self.key)
            try:
                self.ledger = self.ledger.reserve(a)
            except Conflict as exc:
                return exc.reason
            self._refresh_row(i)
            self._in_flight[(namespace, name)] = a
        try:
            self.api.patch_pod_annotations(namespace, name, {ANNOTATION: encode(a)},
                                           pod["metadata"]["resourceVersion"])
        except (ApiConflict, ApiNotFound) as exc:
            self._in_flight.pop((namespace, name), None)
            self.pod_gone(namespace, name)
            return f"pod {namespace}/{name}: {exc}"
        self._in_flight.pop((namespace, name), None)
        return self._create_binding(namespace, name, uid, node, a)

    def _create_binding(self, namespace: str, name: str, uid: str, node: str,
                        taken: Assignment | None) -> str:
        try:
            self.api.bind(namespace, name, uid, node)
        except (ApiConflict, ApiNotFound) as exc:
            if taken is not None:
                self.pod_gone(namespace, name)
            return f"pod {namespace}/{name}: {exc}"
        return ""


def _memory_wish(req: SliceRequest) -> int | None:
    """MiB an MPS slice asks of a MIG instance: what the pod names, or None for its share of
    the instance's memory (its milli of the instance's)."""
    return None if req.memory_share and not req.gpu_memory_mib else req.gpu_memory_mib


def _memory_in(req: SliceRequest, room: InstanceRoom) -> int:
    """MiB an MPS slice takes inside ``room``."""
    wish = _memory_wish(req)
    return migmps.memory_share(req.milli, room) if wish is None else wish


def _mode(req: SliceRequest) -> Mode:
    if req.isolation is Isolation.MIG:
        return Mode.MIG
    if req.isolation is Isolation.TIMESLICE:
        return Mode.TIMESLICE
    if req.milli == 1000 and req.isolation in (Isolation.ANY, Isolation.EXCLUSIVE):
        return Mode.EXCLUSIVE
    return Mode.MPS


def _gpu_containers(pod: dict[str, Any]) -> list[str]:
    out = []
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        keys = {**(res.get("requests") or {}), **(res.get("limits") or {})}
        if any(k.startswith("gpuslice.io/") for k in keys):
            out.append(str(c.get("name") or "main"))
    return out or ["main"]


# -- HTTP ------------------------------------------------------------------------------------


def _answer(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def _bad(message: str, status: int = 400) -> web.Response:
    return _answer({"Error": message}, status)


async def _json(request: web.Request) -> dict[str, Any]:
    body = await request.read()
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise web.HTTPBadRequest(text="request body: expected a JSON object")
    return doc


def _names(args: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, Any]] | None]:
    """The candidate node names, and the node objects when the scheduler sent them."""
    if args.get("NodeNames") is not None:
        names = args["NodeNames"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValidationError("NodeNames", "a list of node names", type(names).__name__)
        return names, None
    nodes = args.get("Nodes") or {}
    items = nodes.get("items") if isinstance(nodes, dict) else None
    if not isinstance(items, list):
        raise ValidationError("Nodes.items", "a NodeList", type(items).__name__)
    by_name = {}
    for n in items:
        if not isinstance(n, dict) or not isinstance((n.get("metadata") or {}).get("name"), str):
            raise ValidationError("Nodes.items[].metadata.name", "a node name", n)
        by_name[n["metadata"]["name"]] = n
    return list(by_name), by_name


def _victims(args: dict[str, Any]) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Victim pod UIDs per node and the PDB violations counted for them, from either form the
    scheduler sends (``NodeNameToMetaVictims`` with UIDs, or ``NodeNameToVictims`` with pods)."""
    meta = args.get("NodeNameToMetaVictims")
    full = args.get("NodeNameToVictims")
    raw, key = (meta, "NodeNameToMetaVictims") if meta is not None else \
        (full, "NodeNameToVictims")
    if not isinstance(raw, dict):
        raise ValidationError(key, "a map of node name to victims", type(raw).__name__)
    victims: dict[str, list[str]] = {}
    pdb: dict[str, int] = {}
    for node, v in raw.items():
        pods = v.get("Pods") if isinstance(v, dict) else None
        if not isinstance(pods, list):
            raise ValidationError(f"{key}.{node}.Pods", "a list of pods", type(pods).__name__)
        uids = []
        for p in pods:
            uid = (p.get("UID") if meta is not None else (p.get("metadata") or {}).get("uid")) \
                if isinstance(p, dict) else None
            if not isinstance(uid, str) or not uid:
                raise ValidationError(f"{key}.{node}.Pods[]", "pods with their UID", p)
            uids.append(uid)
        victims[node] = uids
        n = v.get("NumPDBViolations", 0)
        pdb[node] = n if isinstance(n, int) and not isinstance(n, bool) else 0
    return victims, pdb


def _pod(args: dict[str, Any]) -> dict[str, Any]:
    pod = args.get("Pod")
    if not isinstance(pod, dict):
        raise ValidationError("Pod", "a Pod object", type(pod).__name__)
    return pod


def make_app(state: ExtenderState, metrics: ExtenderMetrics | None = None) -> web.Application:
    m = metrics or ExtenderMetrics(state)

    @web.middleware
    async def timed(request: web.Request, handler: Any) -> web.StreamResponse:
        verb = request.path.strip("/")
        if verb not in ("filter", "prioritize", "bind", "preempt"):
            return await handler(request)  # type: ignore[no-any-return]
        t0 = time.perf_counter()
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except web.HTTPBadRequest:
            m.errors.labels(verb).inc()
            raise
        finally:
            m.seconds.labels(verb).observe(time.perf_counter() - t0)

    async def filter_(request: web.Request) -> web.Response:
        args = await _json(request)
        try:
            names, objects = _names(args)
            keep, failed = state.filter(_pod(args), names)
            m.filtered(len(keep), failed)
        except GpusliceError as exc:
            m.errors.labels("filter").inc()
            return _answer({"Nodes": None, "NodeNames": None, "FailedNodes": {},
                            "FailedAndUnresolvableNodes": {}, "Error": str(exc)})
        result: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": {},
                                  "Error": ""}
        if objects is None:
            result.update(NodeNames=keep, Nodes=None)
        else:
            result.update(NodeNames=None,
                          Nodes={"apiVersion": "v1", "kind": "NodeList",
                                 "items": [objects[n] for n in keep]})
        return _answer(result)

    async def prioritize(request: web.Request) -> web.Response:
        args = await _json(request)
        try:
            names, _ = _names(args)
            scores = state.prioritize(_pod(args), names)
        except GpusliceError as exc:
            m.errors.labels("prioritize").inc()
            return _bad(str(exc))
        return _answer([{"Host": h, "Score": s} for h, s in scores])

    async def bind(request: web.Request) -> web.Response:
        args = await _json(request)
        fields = {}
        for key in ("PodName", "PodNamespace", "PodUID", "Node"):
            value = args.get(key)
            if not isinstance(value, str) or not value:
                m.errors.labels("bind").inc()
                return _answer({"Error": f"{key}: expected a string"})
            fields[key] = value
        error = state.bind(fields["PodNamespace"], fields["PodName"], fields["PodUID"],
                           fields["Node"])
        m.binds.labels("refused" if error else "bound").inc()
        return _answer({"Error": error})

    async def preempt(request: web.Request) -> web.Response:
        args = await _json(request)
        try:
            victims, pdb = _victims(args)
            kept = state.preempt(_pod(args), victims)
        except GpusliceError as exc:
            m.errors.labels("preempt").inc()
            return _bad(str(exc))
        return _answer({"NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb.get(node, 0)}
            for node, uids in kept.items()}})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics_(_: web.Request) -> web.Response:
        return web.Response(body=m.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=MAX_BODY, middlewares=[timed])
    app.router.add_post("/filter", filter_)
    app.router.add_post("/prioritize", prioritize)
    app.router.add_post("/bind", bind)
    app.router.add_post("/preempt", preempt)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_)
    return app


def tls_context(cert: str | None, key: str | None, client_ca: str | None) -> Any:
    """The server's TLS context (None for plain HTTP); with ``client_ca``, clients must present
    a certificate signed by it (kube-scheduler's ``tlsConfig.certFile``)."""
    import ssl

    if cert is None and key is None:
        if client_ca is not None:
            raise ValidationError("--client-ca", "--tls-cert and --tls-key as well", client_ca)
        return None
    if cert is None or key is None:
        raise ValidationError("--tls-cert/--tls-key", "both a certificate and its key",
                              (cert, key))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
        if client_ca is not None:
            ctx.load_verify_locations(client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ValidationError("--tls-cert/--tls-key/--client-ca", "readable PEM files",
                              str(exc)) from None
    return ctx


async def serve(state: ExtenderState, host: str, port: int, ssl_context: Any = None,
                resync_s: float = 300.0, ready: Callable[[int], None] | None = None) -> None:
    """Serve until cancelled, following the API server's watch of pods and nodes, with a full
    re-read every ``resync_s`` as a safety net."""
    import asyncio
    import time

    runner = web.AppRunner(make_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    if ready is not None:
        addresses = runner.addresses
        ready(int(addresses[0][1]) if addresses else port)
    loop = asyncio.get_running_loop()

    async def elect() -> None:
        assert state.elector is not None
        while True:
            try:
                await loop.run_in_executor(None, state.elector.step)
            except GpusliceError as exc:
                state.elector.leader = False
                state.problems.append(f"leader election: {exc}")
            await asyncio.sleep(state.elector.duration_s / 3)

    electing = asyncio.create_task(elect()) if state.elector is not None else None
    since = ""
    stale = False  # events were missed (a broken watch): re-read before following again
    last = time.monotonic()
    backoff_s = 1.0
    try:
        while True:
            # an outage of the API server leaves filter and prioritize answering from the
            # last view (binds fail on their own); the loop retries with backoff, never exits
            try:
                events, since = await loop.run_in_executor(
                    None, state.api.watch, since, 0.0 if stale else 5.0)
                if stale or time.monotonic() - last >= resync_s:
                    await loop.run_in_executor(None, state.rebuild)
                    stale, last = False, time.monotonic()
                if events:  # a node change re-reads: off the loop, as the rebuild above
                    await loop.run_in_executor(None, state.apply_all, events)
                backoff_s = 1.0
            except GpusliceError as exc:  # start the watch again, then re-read everything
                state.problems.append(f"watch: {exc}")
                since, stale = "", True
                await asyncio.sleep(backoff_s)
                backoff_s = min(30.0, 2 * backoff_s)
    finally:
        if electing is not None:
            electing.cancel()
        close = getattr(state.api, "close", None)  # the real client's background watches
        if callable(close):
            close()
        await runner.cleanup()
