"""The extender's state and the decisions behind its verbs: the GPU inventory of every node,
the ledger of shares (rebuilt from the signed assignments of live pods, followed through the
watch), and filter, prioritize, bind and preempt as answers over them plus the one API write a
bind makes (the Binding, carrying the assignment). :mod:`.http` serves them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

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
    pod_finished,
    pod_gpu_shape,
    pod_key,
    pod_request,
    selector_matches,
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
from gpuslice.core.ledger import Conflict, GpuSlot, Ledger
from gpuslice.core.migmps import InstanceRoom
from gpuslice.core.model import ClusterArrays, Gpu, Isolation, Node, SliceRequest, build_arrays
from gpuslice.core.podrequest import GpuWant
from gpuslice.core.policies import PlacementState, best_fit_gpu, exclusive_gpus, make_policy
from gpuslice.services.leader import LeaderElector

# pods remembered from their filter for their bind (see hold): a bind follows its filter within
# the scheduling cycle, so the last few thousand pods filtered are plenty; an older one is read
SEEN_PODS = 2048
STALE_CHECKS = 32  # shares on a nominated node read back from the API server per filter call


def bind_clock() -> str:
    """Now, as an assignment's bind time: RFC 3339 UTC with microseconds (the node's device
    plugin executes waiting assignments in bind order, as the kubelet admits pods in the order
    their binds reach it: seconds would tie a burst and fall back to name order)."""
    from datetime import UTC, datetime

    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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
        # binds whose annotation was written, numbered in the order they completed: a re-read
        # whose pod list started before one completed cannot have seen it, and takes it from
        # here (else its share would be free in the new ledger until the pod's watch event)
        self._bind_seq = 0
        self._recent: dict[tuple[str, str], tuple[Assignment, int]] = {}
        # pods seen by filter (by UID, oldest first) and the container requests
        # of those whose bind reserved on the event loop (hold)
        self._seen: dict[str, dict[str, Any]] = {}
        self._held: dict[tuple[str, str], Any] = {}
        self._busy: set[tuple[str, str]] = set()  # pods a bind thread is working on
        self._mig_use_of: tuple[Ledger, dict[tuple[str, int], tuple[int, int, bool]]] | None = \
            None
        self.elector: LeaderElector | None = None  # set when replicas elect a binder
        self.cordoned: set[str] = set()
        self._node_marks: dict[str, tuple[str, str]] = {}  # what of each node we follow
        self.rebuild()

    # -- state --------------------------------------------------------------------------------

    def rebuild(self) -> None:
        """Read nodes and pods from the API server and derive everything again."""
        seen_up_to = getattr(self, "_bind_seq", 0)  # binds completed before the lists
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
            if a is not None and not pod_finished(p):
                assignments.append(a)
        ledger, problems = Ledger.rebuild(slots, assignments)
        self.problems.extend(problems)
        arrays = build_arrays(nodes)
        inv_ = _Inventory(names, {n: i for i, n in enumerate(names)}, uuids, arrays, migs,
                          frozenset(mig_gpus), frozenset(mig_rows))
        with self._lock:
            recent = getattr(self, "_recent", {})
            for key in [k for k, (_, seq) in recent.items() if seq <= seen_up_to]:
                del recent[key]  # the pod list saw its annotation
            pending = list(getattr(self, "_in_flight", {}).items()) + \
                [(k, a) for k, (a, _) in recent.items()]
            for key, a in pending:
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
        if event.type == "DELETED" or pod_finished(event.obj):
            self.pod_gone(ns, name, (event.obj.get("metadata") or {}).get("uid"))
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

    def pod_gone(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A pod was deleted or finished: give its share back. With ``uid``, only if the
        share is still that pod's (a pod of the same name made since keeps its own)."""
        with self._lock:
            a = self.ledger.owners.get((namespace, name))
            if a is not None and uid and a.pod_uid and a.pod_uid != uid:
                return
            self.ledger = self.ledger.release(namespace, name)
            self._recent.pop((namespace, name), None)
            if a is not None and a.node in self.inv.index:
                self._refresh_row(self.inv.index[a.node])

    # -- the verbs ----------------------------------------------------------------------------

    @staticmethod
    def _gpu_only(req: SliceRequest) -> SliceRequest:
        # CPU and memory are kube-scheduler's own fit; the extender judges GPUs only
        return SliceRequest(req.gpus, req.milli, 0, 0, req.gpu_memory_mib, req.models,
                            req.isolation, req.name, req.memory_share)

    # what the metrics read at scrape time (services.extender.metrics.LedgerSource)
    @property
    def node_gpus(self) -> list[tuple[str, list[str]]]:
        inv = self.inv
        return list(zip(inv.names, inv.uuids, strict=True))

    @property
    def used_milli(self) -> Mapping[str, int]:
        return self.ledger.used_milli

    @property
    def assignments(self) -> int:
        return len(self.ledger.owners)

    @property
    def cordoned_gpus(self) -> int:
        return len(self.cordoned)

    @property
    def problem_count(self) -> int:
        return len(self.problems)

    @property
    def binds_here(self) -> bool:
        return self.elector is None or self.elector.leader

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

    def stale_holders(self, pod: dict[str, Any], names: list[str]) -> list[Assignment]:
        """The shares to check against the API server before filtering ``pod``: those held on
        its nominated node (``status.nominatedNodeName``, where kube-scheduler preempted for
        it) when it does not fit there. The scheduler retries the pod as soon as its cache
        drops the victims; if this ledger has not yet followed their deletion, a refusal
        would make it preempt again on another node (``PodEligibleToPreemptOthers`` in
        pkg/scheduler/framework/plugins/defaultpreemption/default_preemption.go only holds
        back while the scheduler itself still sees victims terminating). At most
        ``STALE_CHECKS`` shares; none when the pod fits or has no nomination."""
        node = (pod.get("status") or {}).get("nominatedNodeName")
        i = self.inv.index.get(node) if isinstance(node, str) else None
        if i is None or node not in names:
            return []
        try:
            req = pod_request(pod)
        except ValidationError:
            return []
        if req is None or self._fits_with(i, req, self.ledger):
            return []
        uid = (pod.get("metadata") or {}).get("uid")
        with self._lock:
            flying = set(self._in_flight)
            held = [a for key, a in self.ledger.owners.items()
                    if a.node == node and a.pod_uid != uid and key not in flying]
        return held[:STALE_CHECKS]

    def verify_held(self, shares: list[Assignment]) -> int:
        """Read each share's pod from the API server and give back the shares of pods that
        are gone (not found, another pod under the name now, or finished). Returns how many
        were given back. Blocking: run off the event loop."""
        freed = 0
        for a in shares:
            try:
                p = self.api.get_pod(a.namespace, a.pod)
            except ApiNotFound:
                p = None
            except GpusliceError:
                continue  # the API server is unreachable: keep the share
            meta = (p or {}).get("metadata") or {}
            if p is None or (a.pod_uid and meta.get("uid") != a.pod_uid) or \
                    pod_finished(p):
                self.pod_gone(a.namespace, a.pod, a.pod_uid or None)
                freed += 1
        return freed

    def unresolvable(self, pod: dict[str, Any], names: list[str]) -> set[str]:
        """Of ``names``, the nodes where the pod would not fit even with no other pod on
        them (unknown, no GPU, another model, too few GPUs, cordoned, no MIG instance large
        enough): preemption cannot help there, so kube-scheduler hears them as
        FailedAndUnresolvableNodes and does not try it."""
        req = pod_request(pod)
        if req is None or not names:
            return set()
        empty = Ledger.empty(self.ledger.inventory.values())
        out: set[str] = set()
        if req.isolation is not Isolation.MIG:
            trial = self.inv.arrays.copy()
            for i, row in enumerate(self.inv.uuids):
                for j, uuid in enumerate(row):
                    trial.gpu_free[i, j], trial.gpu_mem_free[i, j] = \
                        self._open_free(uuid, empty)
            ok_empty = feasible(trial, self._gpu_only(req))
        for n in names:
            at = self.inv.index.get(n)
            if at is None or ((req.isolation is Isolation.MIG or not ok_empty[at]) \
                    and not self._fits_with(at, req, empty)):
                out.add(n)
        return out

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

    def preempt(self, pod: dict[str, Any], victims: dict[str, list[str]],
                violations: dict[str, int] | None = None
                ) -> dict[str, tuple[list[str], int]]:
        """ProcessPreemption: the scheduler's candidate victims per node (pod UIDs) checked
        on the GPU side; per node kept, the victims and their PodDisruptionBudget
        violations. kube-scheduler chose its victims for what it counts (CPU, memory, the
        device count); it needs every one, so none is taken off. A node where the pod still
        does not fit the GPUs after they go gets more victims: pods of lower priority that
        hold gpuslice shares there, those whose budget still allows a disruption first, then
        the lowest priority and smallest share, and none that is not needed. Their
        violations are added to the scheduler's count ``violations`` as it counts its own
        (``filterPodsWithPDBViolation``, pkg/scheduler/framework/plugins/defaultpreemption/
        default_preemption.go), since it prefers the node with the fewest
        (``pickOneNodeForPreemption``, pkg/scheduler/framework/preemption/preemption.go),
        and the list stays ordered highest priority first (it reads ``Pods[0]`` as the
        highest). A node where even that does not make room is dropped; a kept node never
        comes back with an empty list (``callExtenders`` refuses it: "expected at least one
        victim pod"). Reads the ledger and the API server; changes nothing."""
        violations = violations or {}
        req = pod_request(pod)
        if req is None:
            return {node: (uids, violations.get(node, 0))
                    for node, uids in victims.items() if uids}
        mine = _priority(pod)
        by_uid = {a.pod_uid: a for a in self.ledger.owners.values()}
        budgets = _Budgets(self.api, self.problems)
        out: dict[str, tuple[list[str], int]] = {}
        for node, uids in victims.items():
            i = self.inv.index.get(node)
            if i is None:
                continue
            led = self.ledger
            for u in uids:
                a = by_uid.get(u)
                if a is not None and a.node == node:
                    led = led.release(a.namespace, a.pod)
            if self._fits_with(i, req, led):
                if uids:
                    out[node] = (list(uids), violations.get(node, 0))
                continue
            left: dict[tuple[str, str], int] = {}
            known: dict[str, int] = {}  # victim UID -> priority, where the ledger knows it
            for u in uids:
                a = by_uid.get(u)
                if a is None or a.node != node:
                    continue
                try:
                    p = self.api.get_pod(a.namespace, a.pod)
                except ApiNotFound:
                    continue
                known[u] = _priority(p)
                budgets.take(p, left)  # the scheduler's victims spend the budgets first
            extra = self._more_victims(i, req, led, node, mine, set(uids), budgets, left)
            if extra is None:
                continue
            added = 0
            chosen = list(uids)
            for uid, p in extra:
                added += budgets.take(p, left)
                prio = _priority(p)
                at = next((k for k, u in enumerate(chosen) if u in known and known[u] < prio),
                          len(chosen))
                chosen.insert(at, uid)
                known[uid] = prio
            out[node] = (chosen, violations.get(node, 0) + added)
        return out

    def _more_victims(self, i: int, req: SliceRequest, led: Ledger, node: str, priority: int,
                      already: set[str], budgets: _Budgets, left: dict[tuple[str, str], int]
                      ) -> list[tuple[str, dict[str, Any]]] | None:
        """Pods on ``node`` of lower priority than ``priority`` whose shares, released from
        ``led``, make room for ``req``: as few as will do, those whose disruption budget
        allows it first; (UID, pod) in the order taken. None when they cannot."""
        candidates = []
        for a in led.owners.values():
            if a.node != node or a.pod_uid in already:
                continue
            try:
                p = self.api.get_pod(a.namespace, a.pod)
            except ApiNotFound:
                continue
            if _priority(p) < priority:
                milli = sum(m for m, _ in a.held().values())
                candidates.append((budgets.violates(p, left), _priority(p), milli,
                                   a.namespace, a.pod, a, p))
        candidates.sort(key=lambda c: c[:5])
        taken: list[tuple[Assignment, dict[str, Any]]] = []
        trial = led
        for *_, a, p in candidates:
            trial = trial.release(a.namespace, a.pod)
            taken.append((a, p))
            if self._fits_with(i, req, trial):
                break
        else:
            return None
        for a, p in list(reversed(taken)):  # keep those that turned out not to be needed
            try:
                back = trial.reserve(a)
            except Conflict:
                continue
            if self._fits_with(i, req, back):
                trial = back
                taken.remove((a, p))
        return [(a.pod_uid, p) for a, p in taken]

    def remember(self, pod: dict[str, Any]) -> None:
        """Keep the pod a filter call carried (bounded, by UID): its bind can
        then reserve on the event loop, before the next filter, and write off it."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid:
            return
        with self._lock:
            self._seen.pop(uid, None)
            self._seen[uid] = pod
            while len(self._seen) > SEEN_PODS:
                self._seen.pop(next(iter(self._seen)))

    def hold(self, namespace: str, name: str, uid: str, node: str) -> Assignment | None:
        """The first half of a bind, run on the event loop as the bind arrives: place the pod
        as its filter saw it and reserve the share (in flight), so that the scheduler's next
        filter, which comes while this bind writes, sees it taken. ``None`` when the pod was
        not seen, already holds a share, or does not fit: :meth:`bind` then does it all."""
        if self.elector is not None and not self.elector.leader:
            return None
        with self._lock:
            pod = self._seen.pop(uid, None)
        meta = (pod or {}).get("metadata") or {}
        if pod is None or meta.get("namespace", "default") != namespace \
                or meta.get("name") != name or (namespace, name) in self.ledger.owners \
                or self._assignment_of(pod) is not None or (pod.get("spec") or {}).get("nodeName"):
            return None
        i = self.inv.index.get(node)
        try:
            req = pod_request(pod)
        except ValidationError:
            return None
        if i is None or req is None:
            return None
        placed = self._place(pod, req, i, namespace, name, uid, node)
        if isinstance(placed, str):
            return None
        self._held[(namespace, name)] = _container_requests(pod)
        return placed

    def _release(self, namespace: str, name: str, a: Assignment) -> None:
        """Give back the share ``a`` reserved, if it is still the pod's: another bind of the
        pod may have replaced it meanwhile, and that one is not ours to free."""
        key = (namespace, name)
        with self._lock:
            if self._in_flight.get(key) == a:
                del self._in_flight[key]
            if self.ledger.owners.get(key) != a:
                return
            self.ledger = self.ledger.release(namespace, name)
            if key in self._recent and self._recent[key][0] == a:
                del self._recent[key]
            if a.node in self.inv.index:
                self._refresh_row(self.inv.index[a.node])

    def abandon(self, namespace: str, name: str, held: Assignment | None) -> None:
        """A bind that will not run (it waited past the scheduler's timeout): give back what
        :meth:`hold` reserved for it."""
        with self._lock:
            self._held.pop((namespace, name), None)
        if held is not None:
            self._release(namespace, name, held)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API server has it now, or ``None`` when it cannot be read (the
        bind then reads it itself and reports why). Done while a bind waits for its node's
        turn, so that the turn holds only the write."""
        try:
            return self.api.get_pod(namespace, name)
        except GpusliceError:
            return None

    def bind(self, namespace: str, name: str, uid: str, node: str,
             held: Assignment | None = None, pod: dict[str, Any] | None = None) -> str:
        """Bind the pod; returns an error message, or "" on success. ``held``: what
        :meth:`hold` reserved for it; used when the pod read now is the one placed (same UID,
        same requests, no assignment yet), given back otherwise."""
        key = (namespace, name)
        with self._lock:
            seen = self._held.pop(key, None)
            busy = key in self._busy
            if not busy:
                self._busy.add(key)
        if busy:  # the scheduler gave up on an earlier call that is still writing
            if held is not None:
                self._release(namespace, name, held)
            return f"pod {namespace}/{name}: an earlier bind of it is still under way; retry"
        try:
            return self._bind(namespace, name, uid, node, held, seen, pod)
        finally:
            with self._lock:
                self._busy.discard(key)

    def _bind(self, namespace: str, name: str, uid: str, node: str,
              held: Assignment | None, seen: Any, read: dict[str, Any] | None) -> str:
        if self.elector is not None and not self.elector.leader:
            if held is not None:
                self._release(namespace, name, held)
            return f"this extender ({self.elector.identity}) is not the leader; retry"
        try:
            # a read made before this bind's turn: still the base of the writes, which carry
            # its resourceVersion (a pod changed since fails them with a conflict)
            pod = read if read is not None else self.api.get_pod(namespace, name)
        except ApiNotFound as exc:
            if held is not None:
                self._release(namespace, name, held)
            return str(exc)
        except GpusliceError:
            if held is not None:  # nothing was written: the share is not taken
                self._release(namespace, name, held)
            raise
        if held is not None:
            same = ((pod.get("metadata") or {}).get("uid") == uid and held.node == node
                    and self._assignment_of(pod) is None
                    and not (pod.get("spec") or {}).get("nodeName")
                    and seen == _container_requests(pod))
            if same:
                # stamped now, its turn among this node's binds, not when it arrived: a bind
                # placed here (not on the loop) before it takes its time when it runs too
                with self._lock:
                    a = sign(replace(held, bind_time=self.clock()), self.key)
                    self.ledger = self.ledger.release(namespace, name).reserve(a)
                    self._in_flight[(namespace, name)] = a
                return self._write(pod, namespace, name, uid, node, a)
            self._release(namespace, name, held)
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
            return self._create_binding(namespace, name, uid, node)  # a retried bind
        if existing is not None:
            if (pod.get("spec") or {}).get("nodeName"):
                return f"pod {namespace}/{name} is already bound to {existing.node}"
            # an earlier bind wrote its assignment but never created the Binding (the
            # extender died in between); the scheduler chose again: free the old share
            self.pod_gone(namespace, name)
        elif (namespace, name) in self.ledger.owners:
            # an earlier bind whose write failed with its outcome unknown (an API server
            # outage): the pod, read just now, carries no assignment, so that share is not
            # taken; give it back before placing the pod again
            self._in_flight.pop((namespace, name), None)
            self.pod_gone(namespace, name)
        placed = self._place(pod, req, i, namespace, name, uid, node)
        if isinstance(placed, str):
            return placed
        return self._write(pod, namespace, name, uid, node, placed)

    def _place(self, pod: dict[str, Any], req: SliceRequest, i: int, namespace: str,
               name: str, uid: str, node: str) -> Assignment | str:
        """Choose the pod's GPUs on node ``i`` and reserve them in the ledger (in flight);
        the signed assignment, or why it does not fit."""
        g = self._gpu_only(req)
        shape = pod_gpu_shape(pod)
        assert shape is not None  # pod_request said it asks for a GPU
        with self._lock:
            mode = _mode(req)
            if mode is Mode.MIG:
                fits = self._mig_fits(i, _mig_wish(req), self._taken_mig())
                if not fits:
                    return self._filter_mig(_mig_wish(req), [node])[1][node]
                size, gpu, inst = fits[0]
                whole = max(1, 1000 * size // 7)
                # the instance is the pod's; its containers split it as they split the pod's
                # effective milli (one container: the whole instance)
                containers = tuple(ContainerAssignment(w.name, Mode.MIG, (GpuShare(
                    gpu, max(1, whole * w.milli // shape.milli),
                    inst.memory_mib * w.milli // shape.milli, inst.profile, inst.start),),
                    w.kind) for w, _ in shape.slots)
            elif feasible(self.inv.arrays, g)[i]:
                gpus = (best_fit_gpu(self.inv.arrays, g, i) if g.is_sharing
                        else exclusive_gpus(self.inv.arrays, g, i))
                cap = self.inv.arrays.gpu_mem_cap
                containers = tuple(ContainerAssignment(w.name, _container_mode(req, w), tuple(
                    GpuShare(self.inv.uuids[i][gpus[k]], w.milli,
                             w.memory_mib or w.milli * int(cap[i, gpus[k]]) // 1000)
                    for k in slots), w.kind) for w, slots in shape.slots)
            else:  # an MPS slice inside a MIG instance, or nowhere
                planned = str(((pod.get("metadata") or {}).get("annotations") or {})
                              .get(MIG_PROFILE_ANNOTATION, ""))
                room = self._mig_room_for(i, req, planned)
                if room is None:
                    return self.filter(pod, [node])[1].get(node) or \
                        "; ".join(explain(self.inv.arrays, g, i))
                containers = tuple(ContainerAssignment(w.name, Mode.MPS, (GpuShare(
                    room.gpu, w.milli, w.memory_mib or migmps.memory_share(w.milli, room),
                    room.profile, room.start),), w.kind) for w, _ in shape.slots)
            a = sign(Assignment(namespace, name, uid, node, containers, self.clock()), self.key)
            try:
                self.ledger = self.ledger.reserve(a)
            except Conflict as exc:
                return exc.reason
            self._refresh_row(i)
            self._in_flight[(namespace, name)] = a
        return a

    def _write(self, pod: dict[str, Any], namespace: str, name: str, uid: str, node: str,
               a: Assignment) -> str:
        """One write: the Binding, carrying the signed assignment as an annotation (kube-
        apiserver sets a binding's annotations on the pod with its node, in the same update)
        and the pod's UID and the resourceVersion just read as preconditions."""
        try:
            self.api.bind(namespace, name, uid, node, {ANNOTATION: encode(a)},
                          pod["metadata"].get("resourceVersion"))
        except (ApiConflict, ApiNotFound) as exc:
            self._release(namespace, name, a)
            return f"pod {namespace}/{name}: {exc}"
        except GpusliceError as exc:
            # outcome unknown (the API server went away mid-call): the share stays taken
            # (in flight) until a retried bind or a re-read shows whether it was written
            return f"pod {namespace}/{name}: binding: {exc}; retry"
        with self._lock:
            self._in_flight.pop((namespace, name), None)
            self._bind_seq += 1
            self._recent[(namespace, name)] = (a, self._bind_seq)
        return ""

    def _create_binding(self, namespace: str, name: str, uid: str, node: str) -> str:
        """The Binding alone, for a pod already carrying its assignment for ``node``."""
        try:
            self.api.bind(namespace, name, uid, node)
        except (ApiConflict, ApiNotFound) as exc:
            return f"pod {namespace}/{name}: {exc}"
        except GpusliceError as exc:  # outcome unknown: the assignment is written, keep it
            return f"pod {namespace}/{name}: creating the Binding: {exc}; retry"
        return ""


def _container_requests(pod: dict[str, Any]) -> Any:
    """What of a pod decides its share: its containers' and init containers' resources,
    overhead and the annotations gpuslice reads (a pod read at bind is the one placed on the
    loop when these are equal)."""
    spec = pod.get("spec") or {}
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    return ([c.get("resources") for c in spec.get("containers") or []],
            [(c.get("resources"), c.get("restartPolicy"))
             for c in spec.get("initContainers") or []],
            spec.get("overhead"),
            sorted((k, v) for k, v in ann.items() if k.startswith("gpuslice.io/")))


def _memory_wish(req: SliceRequest) -> int | None:
    """MiB an MPS slice asks of a MIG instance: what the pod names, or None for its share of
    the instance's memory (its milli of the instance's)."""
    return None if req.memory_share and not req.gpu_memory_mib else req.gpu_memory_mib


def _mode(req: SliceRequest) -> Mode:
    if req.isolation is Isolation.MIG:
        return Mode.MIG
    if req.isolation is Isolation.TIMESLICE:
        return Mode.TIMESLICE
    if req.milli == 1000 and req.isolation in (Isolation.ANY, Isolation.EXCLUSIVE):
        return Mode.EXCLUSIVE
    return Mode.MPS


class _Budgets:
    """PodDisruptionBudgets as preemption counts them: the disruptions each still allows
    (``status.disruptionsAllowed``), read once per namespace per preemption call. ``left``
    maps are the allowances spent on one node (the scheduler counts per node)."""

    def __init__(self, api: KubePort, problems: list[str]) -> None:
        self.api, self.problems = api, problems
        self._by_ns: dict[str, list[dict[str, Any]]] = {}

    def _matching(self, pod: dict[str, Any]) -> list[tuple[tuple[str, str], int]]:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not labels:  # a pod with no labels matches no budget
            return []
        ns = meta.get("namespace", "default")
        if ns not in self._by_ns:
            try:
                self._by_ns[ns] = self.api.list_pod_disruption_budgets(ns)
            except GpusliceError as exc:  # counted as none: the scheduler's own count stays
                self.problems.append(f"preempt: PodDisruptionBudgets of {ns}: {exc}")
                self._by_ns[ns] = []
        out = []
        for pdb in self._by_ns[ns]:
            status = pdb.get("status") or {}
            if not selector_matches((pdb.get("spec") or {}).get("selector"), labels) or \
                    meta.get("name") in (status.get("disruptedPods") or {}):
                continue  # a pod the API server already counts as disrupted is no violation
            allowed = status.get("disruptionsAllowed", 0)
            out.append(((ns, str((pdb.get("metadata") or {}).get("name"))),
                        allowed if isinstance(allowed, int) else 0))
        return out

    def violates(self, pod: dict[str, Any], left: dict[tuple[str, str], int]) -> bool:
        """Whether taking ``pod`` now would overdraw a budget (changes nothing)."""
        return any(left.get(key, allowed) <= 0 for key, allowed in self._matching(pod))

    def take(self, pod: dict[str, Any], left: dict[tuple[str, str], int]) -> int:
        """Spend ``pod``'s budgets in ``left``: 1 if that overdraws one, else 0."""
        over = False
        for key, allowed in self._matching(pod):
            left[key] = left.get(key, allowed) - 1
            over = over or left[key] < 0
        return int(over)


def _priority(pod: dict[str, Any]) -> int:
    """The pod's scheduling priority (``spec.priority``, which admission sets from its
    PriorityClass; 0 without one)."""
    value = (pod.get("spec") or {}).get("priority", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _container_mode(req: SliceRequest, w: GpuWant) -> Mode:
    """A container's sharing mode: the pod's isolation, with a whole GPU exclusive."""
    if req.isolation is Isolation.TIMESLICE:
        return Mode.TIMESLICE
    if w.milli == 1000 and req.isolation in (Isolation.ANY, Isolation.EXCLUSIVE):
        return Mode.EXCLUSIVE
    return Mode.MPS
