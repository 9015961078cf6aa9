"""The extender's view of the cluster: every node's GPU inventory, CPU and memory, the ledger of
shares (rebuilt from the signed assignments of live pods, followed through the watch), the
target workload learned from the pods seen, and the placement state the policy scores with,
kept up to date row by row as pods come and go. :mod:`.placement`, :mod:`.preemption` and
:mod:`.state` decide over it; the nodes are read by :mod:`.inventory`, the room in MIG
instances is :mod:`.mig`'s, and the pods the filter refused are kept for :mod:`.requeue`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.fake import KubePort, WatchEvent
from gpuslice.adapters.kube.objects import (
    pod_cpu_memory,
    pod_finished,
    pod_key,
    pod_request,
)
from gpuslice.core.assignment import (
    ANNOTATION,
    Assignment,
    verify_any,
)
from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import Shape
from gpuslice.core.gpuselect import GpuSelection, by_uuid, slot_mask
from gpuslice.core.learned import WorkloadEstimator
from gpuslice.core.ledger import Conflict, Ledger
from gpuslice.core.model import (
    BoolArray,
    ClusterArrays,
    IntArray,
    SliceRequest,
)
from gpuslice.core.policies import PlacementState, Scored, make_policy, tie_order
from gpuslice.core.scorecache import ScoreCache
from gpuslice.services.extender.inventory import Inventory, NodeMark, node_mark, read_nodes
from gpuslice.services.extender.mig import MigRooms
from gpuslice.services.extender.requeue import RequeueBook
from gpuslice.services.leader import LeaderElector

# how long, and for how many preemptors, the victims offered by preempt are remembered for
# the filter's stale-share check (placement.stale_holders): the ledger follows a deletion
# within a watch event's delay, seconds at the very worst
OFFER_TTL_S = 60.0
OFFERS_KEPT = 1024


@dataclass
class _PodInfo:
    """What a live pod counts for: its shape in the learned workload, its CPU and memory
    requests, and the node they are taken on (bound there, or held by our bind)."""

    shape: Shape
    cpu_milli: int
    memory_mib: int
    node: str = ""
    bound: bool = False  # the API server says so (else held by a bind in flight)


def pod_info(pod: dict[str, Any]) -> _PodInfo | None:
    """A pod's :class:`_PodInfo` (its node if bound); None for a pod with bad requests."""
    try:
        req = pod_request(pod)  # a GPU pod's request carries its CPU and memory
        cpu, mem = pod_cpu_memory(pod) if req is None else (req.cpu_milli, req.memory_mib)
    except ValidationError:
        return None
    shape = Shape(cpu, 0, 0) if req is None else \
        Shape(cpu, req.gpus, req.milli, req.models)
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    return _PodInfo(shape, cpu, mem, node, bool(node))


DEFAULT_POLICY = "frag-strand"  # the simulator's best on every trace variant


class ClusterView(MigRooms):
    """The extender's view of the cluster: node GPU inventory, CPU and memory, the ledger,
    the live pods' shapes, and the arrays and placement state of the core's fit and
    policies (free GPU milli and memory per node and slot, free CPU and memory per node,
    fragmentation against the learned workload)."""

    def __init__(self, api: KubePort, key: bytes, *, policy: str = DEFAULT_POLICY,
                 clock: Callable[[], str], narrow: bool = True,
                 previous_keys: tuple[bytes, ...] = ()) -> None:
        self.api = api
        self.key = key  # signs; it and previous_keys (a rotation's old key) verify
        self.previous_keys = previous_keys
        self.policy = make_policy(policy)
        self.narrow = narrow  # filter keeps only the best-ranked node (see placement)
        self.clock = clock
        # the target workload, learned from the live pods (core.learned), and the placement
        # state the policy scores with: arrays + fragmentation tables, kept row by row
        self.estimator = WorkloadEstimator()
        self._pods: dict[tuple[str, str], _PodInfo] = {}
        self._st_version = -1
        self._scores: ScoreCache | None = None  # the policy's node scores per request shape
        self.rng = np.random.default_rng(0)  # policies that draw (random) draw from it
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
        # victims the preempt verb last offered per preemptor UID (monotonic time, node ->
        # victim UIDs): filter reads them back while the ledger may lag their deletion
        self._offers: dict[str, tuple[float, dict[str, frozenset[str]]]] = {}
        self._window_misses: dict[str, int] = {}  # placement.outside_window's, per pod UID
        self._mig_use_of = None
        # the arrays with every pod gone, per inventory and cordon (placement.unresolvable)
        self._empty_of: tuple[Inventory, set[str], ClusterArrays] | None = None
        # the GPU slots each selection by UUID opens, per inventory (arrays_for)
        self._slots_of: tuple[Inventory, dict[GpuSelection, BoolArray]] | None = None
        self.elector: LeaderElector | None = None  # set when replicas elect a binder
        self.cordoned = set()
        self._node_marks: dict[str, NodeMark] = {}  # what of each node we follow
        # pods the filter refused, nudged once room is freed for them (.requeue)
        self.requeue = RequeueBook()
        # a full read of nodes and pods has completed (then the watch keeps the view; the
        # extender is Ready from here on, leader or not)
        self.synced = False
        self.rebuild()

    # -- state --------------------------------------------------------------------------------

    def rebuild(self) -> None:
        """Read nodes and pods from the API server and derive everything again."""
        seen_up_to = getattr(self, "_bind_seq", 0)  # binds completed before the lists
        read = read_nodes(self.api.list_nodes(), self.problems)
        assignments = []
        pods: dict[tuple[str, str], _PodInfo] = {}
        for p in self.api.list_pods():
            if pod_finished(p):
                continue
            a = self._assignment_of(p)
            if a is not None:
                assignments.append(a)
            info = pod_info(p)
            if info is not None:
                pods[pod_key(p)] = info
        ledger, problems = Ledger.rebuild(read.slots, assignments)
        self.problems.extend(problems)
        names = read.inv.names
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
            for key, a in pending:  # our binds' holds, not bound in the list yet
                if key in pods and not pods[key].node:
                    pods[key].node = a.node
            self.inv = read.inv
            self._scores = None  # another inventory: scores of its own
            self.ledger = ledger
            self.cordoned = read.cordoned
            self._node_marks = read.marks
            self._rank = tie_order(names)
            self._pods = pods
            self.estimator.clear()
            self._cpu_used = np.zeros(len(names), dtype=np.int64)
            self._mem_used = np.zeros(len(names), dtype=np.int64)
            for info in pods.values():
                self.estimator.add(info.shape)
                self._take(info, 1)
            for i in range(len(names)):
                self._refresh_row(i, derived=False)
            self._st_version = -1
            self._sync_workload_locked()
            self.synced = True
            self.requeue.freed(None)  # room may have been freed anywhere

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
        if not verify_any(a, (self.key, *self.previous_keys)):
            self.problems.append(f"pod {pod_key(pod)}: assignment signature does not verify")
            return None
        return a

    def _open_free(self, uuid: str, led: Ledger) -> tuple[int, int]:
        """(milli, MiB) GPU ``uuid`` offers whole-GPU slices under ledger ``led``: none when it
        is cordoned for reconfiguration, or MIG-enabled (MPS slices go inside its instances:
        :meth:`_mig_rooms`)."""
        return (0, 0) if uuid in self.cordoned or uuid in self.inv.mig_gpus else led.free(uuid)

    def _refresh_row(self, i: int, derived: bool = True) -> None:
        """Node ``i``'s free GPU milli and memory from the ledger, free CPU and memory from
        the pods counted there, and (``derived``) its row of the placement state."""
        a = self.inv.arrays
        for j, uuid in enumerate(self.inv.uuids[i]):
            a.gpu_free[i, j], a.gpu_mem_free[i, j] = self._open_free(uuid, self.ledger)
        a.cpu_free[i] = a.cpu_cap[i] - self._cpu_used[i]
        a.mem_free[i] = a.mem_cap[i] - self._mem_used[i]
        if self._scores is not None:
            self._scores.changed(i)
        if derived:
            self.st.refresh(i)

    # -- CPU, memory and the learned workload ------------------------------------------------

    def _take(self, info: _PodInfo, sign_: int) -> int | None:
        """Count (+1) or uncount (-1) a pod's CPU and memory on its node; the node's row."""
        i = self.inv.index.get(info.node) if info.node else None
        if i is not None:
            self._cpu_used[i] += sign_ * info.cpu_milli
            self._mem_used[i] += sign_ * info.memory_mib
        return i

    def _follow_pod(self, key: tuple[str, str], info: _PodInfo | None) -> None:
        """The pod ``key`` is now ``info`` (None: gone): shapes and node usage follow.
        Called with the lock held; refreshes the rows whose CPU changed."""
        old = self._pods.get(key)
        if old == info:
            return
        rows = set()
        if old is not None:
            self.estimator.remove(old.shape)
            rows.add(self._take(old, -1))
            del self._pods[key]
        if info is not None:
            self.estimator.add(info.shape)
            rows.add(self._take(info, 1))
            self._pods[key] = info
        for i in rows - {None}:
            assert i is not None
            self._refresh_row(i)

    def learn(self, pod: dict[str, Any]) -> None:
        """Count a pod seen by filter that the watch has not shown yet."""
        key = pod_key(pod)
        if key in self._pods:
            return
        info = pod_info(pod)
        if info is not None:
            with self._lock:
                if key not in self._pods:
                    self._follow_pod(key, info)

    def hold_usage(self, key: tuple[str, str], node: str, cpu: int, mem: int,
                   shape: Shape) -> None:
        """Our bind placed pod ``key`` on ``node``: count its CPU and memory there now (the
        watch confirms it when the Binding is written). Lock held."""
        self._follow_pod(key, _PodInfo(shape, cpu, mem, node, False))

    def drop_hold(self, key: tuple[str, str]) -> None:
        """A bind that did not happen: the pod's CPU and memory are free again (lock held)."""
        old = self._pods.get(key)
        if old is not None and not old.bound and old.node:
            self._follow_pod(key, _PodInfo(old.shape, old.cpu_milli, old.memory_mib))

    def _sync_workload_locked(self) -> None:
        """Rebuild the placement state when the learned workload moved (lock held)."""
        wl = self.estimator.current() if self.policy.needs_workload else None
        version = self.estimator.version if wl is not None else 0
        if version != self._st_version:
            self.st = PlacementState.build(self.inv.arrays, wl)
            self._st_version = version

    def sync_workload(self) -> None:
        with self._lock:
            self._sync_workload_locked()

    def scores(self, req: SliceRequest, rows: IntArray) -> Scored:
        """The policy's scores of nodes ``rows`` for ``req`` on the current placement state,
        from the score cache where the policy allows it (core.scorecache: only the rows
        changed since this shape was last scored are computed)."""
        with self._lock:
            return self._scores_locked(req, rows)

    def _scores_locked(self, req: SliceRequest, rows: IntArray) -> Scored:
        self._sync_workload_locked()
        if not ScoreCache.usable(self.policy):
            return self.policy.score(self.st, req, rows)
        return self._score_cache().score(req, rows)

    def _score_cache(self) -> ScoreCache:
        if self._scores is None or self._scores.st is not self.st:
            self._scores = ScoreCache(self.policy, self.st)
        return self._scores

    def cached_choice(self, req: SliceRequest, rows: IntArray | None
                      ) -> tuple[bool, int | None]:
        """(True, ScoreCache.choose's answer for ``rows``, ``None`` for every row), or
        (False, None) when the scores are uncached (or the pod selects GPUs by UUID: the
        cache judges every GPU open to it)."""
        with self._lock:
            self._sync_workload_locked()
            if not ScoreCache.usable(self.policy) or by_uuid(req.models) is not None:
                return False, None
            return True, self._score_cache().choose(req, rows, self._rank)

    def arrays_for(self, req: SliceRequest, base: ClusterArrays | None = None
                   ) -> ClusterArrays:
        """The arrays ``req`` is judged on (``base``: the view's): as they are, or, for a pod
        that selects GPUs by UUID (core.gpuselect), a copy where the others offer nothing."""
        arrays = self.inv.arrays if base is None else base
        sel = by_uuid(req.models)
        if sel is None:
            return arrays
        inv, cached = self.inv, self._slots_of
        if cached is None or cached[0] is not inv:
            cached = self._slots_of = (inv, {})
        if sel not in cached[1]:
            if len(cached[1]) >= 256:  # selections are few; a flood of them is not kept
                cached[1].clear()
            cached[1][sel] = slot_mask(sel, inv.uuids, inv.arrays.gpu_free.shape[1])
        return arrays.closed_except(cached[1][sel])

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
        self.requeue.seen(event.obj, event.type == "DELETED")
        if event.type == "DELETED" or pod_finished(event.obj):
            self.pod_gone(ns, name, (event.obj.get("metadata") or {}).get("uid"))
            return
        info = pod_info(event.obj)
        with self._lock:
            old = self._pods.get((ns, name))
            if old is not None and info is not None and not info.node and old.node and \
                    not old.bound:
                info.node = old.node  # held by our bind, not bound in the API yet
            self._follow_pod((ns, name), info)
        flying = (ns, name) in self._in_flight
        if (ns, name) in self.ledger.owners and not flying:
            return  # held and written already: no need to decode and verify it again
        a = self._assignment_of(event.obj)
        if a is None:
            return
        if flying:  # a bind of ours under way: the pod bound with another share wins
            if bound_with(event.obj, a):
                self.adopt(ns, name, a)
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
        return before != node_mark(event.obj)

    def adopt(self, namespace: str, name: str, a: Assignment) -> None:
        """The pod is bound with ``a``: the ledger holds ``a`` for it instead of the share a
        bind of ours has in flight, whose write must fail (an earlier bind was applied though
        its answer was lost, or the other replica bound it) and whose release then leaves
        ``a`` alone (the chaos soak found a ledger without a live pod's share)."""
        key = (namespace, name)
        with self._lock:
            old = self.ledger.owners.get(key)
            if old == a:
                return
            self._in_flight.pop(key, None)
            if key in self._recent and self._recent[key][0] != a:
                del self._recent[key]
            if old is not None:
                self.ledger = self.ledger.release(namespace, name)
            try:
                self.ledger = self.ledger.reserve(a)
            except Conflict as exc:
                self.problems.append(f"pod {namespace}/{name}: {exc.reason}")
            for node in {a.node, old.node if old is not None else a.node}:
                if node in self.inv.index:
                    self._refresh_row(self.inv.index[node])

    def pod_gone(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A pod was deleted or finished: give its share back. With ``uid``, only if the
        share is still that pod's (a pod of the same name made since keeps its own)."""
        with self._lock:
            a = self.ledger.owners.get((namespace, name))
            if a is not None and uid and a.pod_uid and a.pod_uid != uid:
                return
            self.ledger = self.ledger.release(namespace, name)
            self._recent.pop((namespace, name), None)
            self._follow_pod((namespace, name), None)
            if a is not None and a.node in self.inv.index:
                self._refresh_row(self.inv.index[a.node])
                self.requeue.freed(a.node)

    def remember_offer(self, preemptor_uid: str, victims: dict[str, list[str]]) -> None:
        """Keep the victims the preempt verb offered for ``preemptor_uid`` (per node) for
        ``OFFER_TTL_S``, at most ``OFFERS_KEPT`` preemptors (the oldest forgotten first)."""
        now = time.monotonic()
        with self._lock:
            for uid in [u for u, (t, _) in self._offers.items() if now - t > OFFER_TTL_S]:
                del self._offers[uid]
            self._offers.pop(preemptor_uid, None)
            self._offers[preemptor_uid] = (now, {n: frozenset(v) for n, v in victims.items()})
            while len(self._offers) > OFFERS_KEPT:
                del self._offers[next(iter(self._offers))]

    def _offered_victims(self, preemptor_uid: str) -> dict[str, frozenset[str]]:
        """The victims per node last offered for ``preemptor_uid``, if not expired."""
        with self._lock:
            got = self._offers.get(preemptor_uid)
        if got is None or time.monotonic() - got[0] > OFFER_TTL_S:
            return {}
        return got[1]

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

def bound_with(pod: dict[str, Any], a: Assignment) -> bool:
    """Whether the pod is bound where its assignment ``a`` says."""
    return bool((pod.get("spec") or {}).get("nodeName") == a.node and
                (pod.get("metadata") or {}).get("uid") == a.pod_uid)
