"""Where a pod goes: filter (with a reason per node refused), prioritize, what preemption
cannot help, and the GPUs chosen at bind, decided over :class:`.view.ClusterView` with the
core policy."""

from __future__ import annotations

import time
from operator import itemgetter
from typing import Any

import numpy as np

from gpuslice.adapters.kube.fake import ApiNotFound
from gpuslice.adapters.kube.objects import (
    MIG_PROFILE_ANNOTATION,
    pod_finished,
    pod_gpu_shape,
    pod_request,
)
from gpuslice.core import migmps
from gpuslice.core.assignment import (
    Assignment,
    ContainerAssignment,
    GpuShare,
    Mode,
    sign,
)
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.fit import explain, feasible, feasible_at, gpu_ok
from gpuslice.core.frag import Shape
from gpuslice.core.gpuselect import by_uuid
from gpuslice.core.ledger import Conflict, Ledger
from gpuslice.core.model import ClusterArrays, IntArray, Isolation, SliceRequest
from gpuslice.core.podrequest import GpuWant
from gpuslice.core.policies import best_fit_gpu, exclusive_gpus, top_ranked
from gpuslice.core.scorecache import ScoreCache
from gpuslice.services.extender.mig import MigWish, memory_wish, mig_wish, mode_of
from gpuslice.services.extender.reasons import RowFacts
from gpuslice.services.extender.requeue import Refused
from gpuslice.services.extender.view import ClusterView

# a node whose node agent has not written its GPU inventory yet (one that joined a moment ago)
NOT_PUBLISHED = "node unknown to gpuslice (its node agent has not published its GPUs yet)"
STALE_CHECKS = 32  # shares on a nominated node read back from the API server per filter call
# kube-scheduler's smallest window of feasible nodes (minFeasibleNodesToFind in
# pkg/scheduler/schedule_one.go): a filter asked about fewer nodes was sent every feasible one
WINDOW_MIN = 100
# filters in a row that spare a pod's preemption because it fits outside the window, before
# the next one lets kube-scheduler try it after all (a node whose GPUs are free here may be one
# kube-scheduler's own filters refuse: a taint, CPU, affinity)
WINDOW_MISSES = 3
WINDOW_PODS = 10_000  # pods whose misses are counted at most (the oldest forgotten)
OUTSIDE = ("the pod fits a node outside the nodes kube-scheduler sent (its window of "
           "feasible nodes): tried again with the next, no preemption")


class PlacementVerbs(ClusterView):
    def filter(self, pod: dict[str, Any], names: list[str]) -> tuple[list[str], dict[str, str]]:
        """The nodes of ``names`` where the pod fits the GPUs, and why each other one does
        not. With ``narrow`` (the default), only the best-ranked of those that fit is kept:
        the policy's choice, as the simulator makes it (the highest score, ties to a fixed
        node order by the names' hash, core.policies.tie_order), which kube-scheduler then
        takes without scoring (one feasible node).
        Only the feasible nodes passed over for that choice are in neither list (the pod is
        schedulable, so no preemption follows); a node that cannot hold the pod is in the
        failed ones with its reason, as without ``narrow``: kube-scheduler keeps a status
        only for the nodes an extender names (findNodesThatPassExtenders in schedule_one.go),
        so a node dropped silently would be missing from the pod's diagnosis."""
        req = pod_request(pod)
        if req is None:
            return names, {}
        self.learn(pod)
        if self.narrow and req.isolation is not Isolation.MIG:
            # the common case in one vectorised pass: where some node fits a whole-GPU slice,
            # the policy's choice among them is the answer; the reasons are written only for
            # the nodes that do not fit (usually few: kube-scheduler sends the nodes whose
            # gpuslice.io/gpu and gpuslice.io/gpu-milli have room)
            chosen = self._choose(req, names)
            if chosen is not None:
                return [chosen], self._refusals(pod, req, names)
        keep, failed = self._fit(pod, req, names)
        if self.narrow and len(keep) > 1:
            keep = [self.best(req, keep)]
        return keep, failed

    def outside_window(self, pod: dict[str, Any], names: list[str]) -> bool:
        """For a filter that found no node among ``names``: whether to tell kube-scheduler
        that preemption cannot help. ``names`` may be a window of the feasible nodes
        (percentageOfNodesToScore: at least :data:`WINDOW_MIN` from a rotating start), and
        where the pod's GPUs fit a node outside it as they are, evicting pods inside it would
        be needless: the pod is tried again with the next window. Said at most
        :data:`WINDOW_MISSES` times in a row for one pod; MIG requests are left to
        preemption as before."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        req = pod_request(pod)
        if len(names) < WINDOW_MIN or not uid or req is None \
                or req.isolation is Isolation.MIG:
            return False
        outside = feasible(self.arrays_for(req), req, node_resources=False)  # a fresh array
        outside[self._rows_of(names)] = False
        misses = self._window_misses
        n = misses.pop(uid, 0) + 1
        if not outside.any() or n > WINDOW_MISSES:
            return False  # preemption may help now; the count starts again
        misses[uid] = n
        while len(misses) > WINDOW_PODS:
            misses.pop(next(iter(misses)))
        return True

    def window_hit(self, pod: dict[str, Any]) -> None:
        """A filter found the pod a node: its misses (:meth:`outside_window`) start again."""
        if self._window_misses:
            self._window_misses.pop(str((pod.get("metadata") or {}).get("uid") or ""), None)

    # -- a refused pod tried again once room is freed for it (.requeue) --------------------

    def requeue_note(self, pod: dict[str, Any], names: list[str], kept: bool) -> None:
        """After a filter of ``pod`` over ``names``: remember it when no node was kept (on
        those nodes; on any when they may be a window of kube-scheduler's feasible nodes,
        :data:`WINDOW_MIN`), forget it otherwise."""
        if kept:
            self.requeue.forget(str((pod.get("metadata") or {}).get("uid") or ""))
            return
        try:
            req = pod_request(pod)
        except ValidationError:
            return
        if req is not None:
            nodes = frozenset(names) if len(names) < WINDOW_MIN else None
            self.requeue.refused(pod, req, nodes, time.monotonic())

    def requeue_due(self, now: float) -> list[Refused]:
        """The refused pods to nudge now (:class:`.requeue.RequeueBook`): none but the
        leader's."""
        if not len(self.requeue):
            return []
        if not self.binds_here:
            self.requeue.stand_by()
            return []
        with self._lock:
            self.requeue.schedule(self.fits_on, now)
        return self.requeue.take_due(now)

    def fits_on(self, req: SliceRequest, names: list[str] | None) -> list[str]:
        """The nodes of ``names`` (None: every node) where ``req`` fits the GPUs now: a
        whole-GPU slice, a free MIG instance, or an MPS slice inside one."""
        rows = np.arange(len(self.inv.names), dtype=np.int64) if names is None else \
            self._rows_of(names)
        if req.isolation is Isolation.MIG:
            wish, taken = mig_wish(req), self._taken_mig()
            ok = np.array([bool(self._mig_fits(int(i), wish, taken)) for i in rows.tolist()],
                          dtype=np.bool_)
        else:
            ok = feasible(self.arrays_for(req), self._gpu_only(req), node_resources=False,
                          rows=rows)
            if self.inv.mig_rows and req.gpus == 1 and mode_of(req) is Mode.MPS:
                for k in np.flatnonzero(~ok).tolist():
                    i = int(rows[k])
                    ok[k] = i in self.inv.mig_rows and self._mig_room_for(i, req) is not None
        return [self.inv.names[int(i)] for i in rows[ok].tolist()]

    def _choose(self, req: SliceRequest, names: list[str]) -> str | None:
        """The policy's choice (:meth:`best`) among the nodes of ``names`` that fit ``req`` as
        a whole-GPU slice, or ``None`` when none does; arrays over the nodes, no per-node
        Python, and with a cacheable policy only the rows changed since this request shape
        was last asked are judged again."""
        if 2 * len(names) >= len(self.inv.names):  # most nodes asked (every one, or nearly)
            cached, at = self.cached_choice(req, None)
            if cached:
                if at is None:  # no node's GPUs fit the shape, so none of these
                    return None
                best = self.inv.names[at]
                # the pick among every node is a candidate, so it is the pick among the
                # candidates (the same scores and total order): no look-up of each name (a
                # hash of every fresh string kube-scheduler sent, which grew with the
                # cluster)
                if best in names:
                    return best
        # else (a window: deploy/'s 100 nodes, or the adaptive share, 42% of 1000) the pick
        # among every node is mostly not among these: straight to their rows
        rows = self._rows_of(names)
        cached, at = self.cached_choice(req, rows)
        if cached:
            return None if at is None else self.inv.names[int(rows[at])]
        ok = feasible(self.arrays_for(req), req, node_resources=False)[rows]
        if not ok.any():
            return None
        rows = rows[ok]
        raw = np.asarray(self.scores(req, rows).scores, dtype=np.float64)
        return self.inv.names[int(rows[top_ranked(raw, self._rank[rows])])]

    def _refusals(self, pod: dict[str, Any], req: SliceRequest,
                  names: list[str]) -> dict[str, str]:
        """Why each node of ``names`` where ``req`` does not fit is refused (the feasible ones,
        a whole-GPU slice or inside a MIG instance, are left out)."""
        rows = self._rows_of(names)
        # judged on the window's rows alone: the whole cluster's arrays would make every
        # filter's cost grow with the node count
        ok = feasible(self.arrays_for(req), req, node_resources=False, rows=rows)
        if len(rows) == len(names):  # every name known (the common case): in arrays
            unfit = [names[j] for j in np.flatnonzero(~ok).tolist()]
        else:
            index = self.inv.index
            fits = {int(r) for r, f in zip(rows.tolist(), ok.tolist(), strict=True) if f}
            unfit = [n for n in names if (i := index.get(n)) is None or i not in fits]
        return self._fit(pod, req, unfit, unfit=True)[1] if unfit else {}

    def _rows_of(self, names: list[str]) -> IntArray:
        """The inventory rows of the known nodes among ``names`` (in their order)."""
        index = self.inv.index
        try:  # every name known (the common case): the look-ups in C
            return np.array(itemgetter(*names)(index) if len(names) > 1 else
                            [index[n] for n in names], dtype=np.int64)
        except KeyError:
            rows = np.fromiter((index.get(n, -1) for n in names), dtype=np.int64,
                               count=len(names))
            return rows[rows >= 0]

    def _fit(self, pod: dict[str, Any], req: SliceRequest, names: list[str],
             unfit: bool = False) -> tuple[list[str], dict[str, str]]:
        """The nodes of ``names`` that can hold ``req``, and why each other one cannot
        (``unfit``: ``names`` are known not to hold it whole-GPU, judged already)."""
        if req.isolation is Isolation.MIG:
            return self._filter_mig(mig_wish(req), names)
        g = self._gpu_only(req)
        a = self.arrays_for(req)
        # one vectorised pass over the rows of ``names`` alone (not the whole cluster's: the
        # cost stays flat in the node count) for the verdicts and the facts the reasons
        # quote (the best GPU of each node), read out as Python lists: the loop below runs
        # for every node that cannot hold the pod, a thousand of 5,000 at 70% allocated, and
        # a numpy scalar read costs what a list's does ten times over
        index = self.inv.index
        rows = self._rows_of(names)
        pos = {r: k for k, r in enumerate(rows.tolist())}  # row -> its place in ``rows``
        ok = [False] * len(rows) if unfit else \
            feasible(a, g, node_resources=False, rows=rows).tolist()
        facts = RowFacts.of(a, g, rows)
        sel = by_uuid(g.models)
        mig_mps = mode_of(req) is Mode.MPS
        keep: list[str] = []
        failed: dict[str, str] = {}
        for n in names:
            i = index.get(n)
            if i is None:
                failed[n] = "node unknown to gpuslice (no GPU inventory yet)"
                continue
            k = pos[i]
            if ok[k]:
                keep.append(n)
                continue
            why = facts.why_not(k, g) if facts.count[k] else (
                NOT_PUBLISHED if i in self.inv.unpublished else "node has no GPU")
            if facts.count[k] and facts.allowed[k] and sel is not None and not any(
                    sel.allows_uuid(u) for u in self.inv.uuids[i]):
                why = (f"the pod's GPU selection by UUID allows none of the node's GPUs "
                       f"({'|'.join(sorted(g.models))})")
            if i in self.inv.mig_rows:
                if mig_mps and self._mig_room_for(i, req) is not None:
                    keep.append(n)
                    continue
                why += self._mig_note(i, req, mig_mps)
            if self.cordoned:
                c = sum(u in self.cordoned for u in self.inv.uuids[i])
                if c:
                    why += f"; {c} GPU(s) cordoned for reconfiguration"
            failed[n] = why
        return keep, failed

    def _mig_note(self, i: int, req: SliceRequest, mps: bool) -> str:
        """What a node with MIG-enabled GPUs adds to the reason it cannot hold ``req``."""
        if not mps:
            k = sum(u in self.inv.mig_gpus for u in self.inv.uuids[i])
            return (f"; {k} GPU(s) MIG-enabled: no whole-GPU {mode_of(req).value} slice "
                    "there, only MPS slices inside their instances")
        if req.gpus != 1:
            return "; MPS inside MIG takes one GPU per pod"
        rooms = self._mig_rooms(i, req.models)
        wish = memory_wish(req)
        mem = "its share of the memory" if wish is None else f"{wish} MiB"
        return (f"; MPS inside MIG instances: none has {req.milli} milli and {mem} free"
                + (f" ({', '.join(map(str, rooms))})" if rooms else ""))

    def stale_holders(self, pod: dict[str, Any], names: list[str]) -> list[Assignment]:
        """The shares to check against the API server before filtering ``pod``: those held on
        its nominated node (``status.nominatedNodeName``, where kube-scheduler preempted for
        it) when it does not fit there, and those of the victims this extender's preempt
        last offered for the pod (:meth:`.preemption.Preemption.preempt` remembers them) on
        nodes where it does not fit. The scheduler retries the pod as soon as its cache
        drops the victims; if this ledger has not yet followed their deletion, a refusal
        would make it preempt again on another node (``PodEligibleToPreemptOthers`` in
        pkg/scheduler/framework/plugins/defaultpreemption/default_preemption.go only holds
        back while the scheduler itself still sees victims terminating), and there, with
        the node it preempted on no longer a candidate (no victim left in its cache), take
        the very pods a PodDisruptionBudget protects. The pod the scheduler sends need not
        carry its nomination yet: ``handleSchedulingFailure`` (pkg/scheduler/schedule_one.go)
        requeues the informer's copy and patches ``nominatedNodeName`` afterwards ("there
        would be a race condition between the next scheduling cycle and the time the
        scheduler receives a Pod Update for the nominated pod"), and with asynchronous
        preemption the pod is retried once the victims' deletions return, possibly before
        that update; hence the remembered victims (issue 29). At most ``STALE_CHECKS``
        shares; none when the pod fits or has neither a nomination nor remembered victims."""
        uid = (pod.get("metadata") or {}).get("uid")
        node = (pod.get("status") or {}).get("nominatedNodeName")
        offered = self._offered_victims(uid) if isinstance(uid, str) and uid else {}
        nodes = {n for n in offered if n in names}
        if isinstance(node, str) and node in names:
            nodes.add(node)
        nodes = {n for n in nodes if n in self.inv.index}
        if not nodes:
            return []
        try:
            req = pod_request(pod)
        except ValidationError:
            return []
        if req is None:
            return []
        nodes = {n for n in nodes if not self._fits_with(self.inv.index[n], req, self.ledger)}
        if not nodes:
            return []
        with self._lock:
            flying = set(self._in_flight)
            held = [a for key, a in self.ledger.owners.items()
                    if a.node in nodes and a.pod_uid != uid and key not in flying and
                    (a.node == node or a.pod_uid in offered.get(a.node, ()))]
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
        if not names:
            return set()
        req = pod_request(pod)
        if req is None:
            return set()
        empty: Ledger | None = None  # built only if a node needs the exact check
        out: set[str] = set()
        if req.isolation is not Isolation.MIG:
            ok_empty = feasible(self.arrays_for(req, self._empty_arrays()), self._gpu_only(req),
                                node_resources=False)
        for n in names:
            at = self.inv.index.get(n)
            if at is None:
                out.add(n)
                continue
            if req.isolation is not Isolation.MIG and ok_empty[at]:
                continue
            if req.isolation is not Isolation.MIG and at not in self.inv.mig_rows:
                out.add(n)  # the exact check would repeat the arrays' answer
                continue
            if empty is None:  # MIG instances: the exact check against an empty ledger
                empty = Ledger.empty(self.ledger.inventory.values())
            if not self._fits_with(at, req, empty):
                out.add(n)
        return out

    def _empty_arrays(self) -> ClusterArrays:
        """The arrays with no pod anywhere (cordoned and MIG-enabled GPUs still closed to
        whole-GPU slices), derived once per inventory: it depends on nothing else, and was
        rebuilt GPU by GPU in Python on every filter call (16 ms per pod at 5,000 nodes)."""
        inv, cordoned = self.inv, self.cordoned
        cached = self._empty_of
        if cached is not None and cached[0] is inv and cached[1] is cordoned:
            return cached[2]
        a = inv.arrays
        trial = a.copy()
        trial.gpu_free[...] = np.where(a.gpu_present, 1000, 0)
        trial.gpu_mem_free[...] = np.where(a.gpu_present, a.gpu_mem_cap, 0)
        closed = cordoned | inv.mig_gpus
        if closed:
            for i, row in enumerate(inv.uuids):
                for j, uuid in enumerate(row):
                    if uuid in closed:
                        trial.gpu_free[i, j] = trial.gpu_mem_free[i, j] = 0
        self._empty_of = (inv, cordoned, trial)
        return trial

    def _filter_mig(self, wish: MigWish, names: list[str]
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

    def _ranked(self, req: SliceRequest, known: list[str]) -> tuple[list[str], np.ndarray,
                                                                     dict[str, int]]:
        """The policy's raw scores of the nodes of ``known`` where the pod fits a whole-GPU
        slice (those nodes, their scores), and the 1..10 scores of the nodes where it fits
        only inside a MIG instance (the tighter the instance, the higher)."""
        rows = np.array([self.inv.index[n] for n in known], dtype=np.int64)
        ok = feasible(self.arrays_for(req), req, node_resources=False)[rows]
        in_mig: dict[str, int] = {}  # nodes that fit the pod only inside a MIG instance
        if self.inv.mig_rows and req.gpus == 1 and mode_of(req) is Mode.MPS:
            for k in np.flatnonzero(~ok):
                room = self._mig_room_for(int(rows[k]), req)
                if room is not None:
                    in_mig[known[k]] = max(1, 10 - round(10 * (room.free_milli - req.milli)
                                                         / room.capacity_milli))
        fit = [known[k] for k in np.flatnonzero(ok)]
        if not fit:
            return [], np.zeros(0), in_mig
        self.sync_workload()
        scored = self.policy.score(self.st, req, rows[ok])
        return fit, np.asarray(scored.scores, dtype=np.float64), in_mig

    def _mig_scores(self, req: SliceRequest, names: list[str]) -> list[int]:
        """MIG-isolated pods: the tightest free instance scores highest (0..10)."""
        wish, taken = mig_wish(req), self._taken_mig()
        out = []
        for n in names:
            i = self.inv.index.get(n)
            fits = self._mig_fits(i, wish, taken) if i is not None else []
            out.append(max(0, 10 - (fits[0][0] - wish.slices)) if fits else 0)
        return out

    def _first(self, names: list[str]) -> str:
        """Of ``names``, the first in the extender's fixed node order (core tie_order)."""
        return min(names, key=lambda n: int(self._rank[self.inv.index[n]]))

    def best(self, req: SliceRequest, names: list[str]) -> str:
        """The policy's choice among ``names`` (all known, all fitting): the highest score,
        ties to the first in the fixed node order; a node where the pod fits only inside a
        MIG instance only when no node fits it whole-GPU."""
        if req.isolation is Isolation.MIG:
            scores = self._mig_scores(req, names)
            return self._first([n for n, v in zip(names, scores, strict=True)
                                if v == max(scores)])
        fit, raw, in_mig = self._ranked(req, names)
        if fit:
            top = float(raw.max())
            return self._first([n for n, v in zip(fit, raw.tolist(), strict=True)
                                if v == top])
        top_mig = max(in_mig.values())
        return self._first([n for n, v in in_mig.items() if v == top_mig])

    def prioritize(self, pod: dict[str, Any], names: list[str]) -> list[tuple[str, int]]:
        """Scores 0..10 of ``names``: the policy's scores scaled between the lowest and the
        highest (kube-scheduler multiplies them by the extender's weight and adds them to its
        own plugins' scores; with ``narrow`` it asks only when the filter kept several)."""
        req = pod_request(pod)
        known = [n for n in names if n in self.inv.index]
        if req is None or not known:
            return [(n, 0) for n in names]
        if req.isolation is Isolation.MIG:
            return list(zip(names, self._mig_scores(req, names), strict=True))
        fit, raw, in_mig = self._ranked(req, known)
        by_name: dict[str, int] = dict(in_mig)
        if fit:
            lo, hi = float(raw.min()), float(raw.max())
            scaled = np.round(10 * (raw - lo) / (hi - lo)) if hi > lo else \
                np.full(len(raw), 10.0)
            by_name.update(zip(fit, scaled.astype(int).tolist(), strict=True))
        return [(n, by_name.get(n, 0)) for n in names]

    def _fits_with(self, i: int, req: SliceRequest, led: Ledger) -> bool:
        """Whether ``req`` fits node ``i``'s GPUs if the ledger were ``led``."""
        mode = mode_of(req)
        if mode is Mode.MIG:
            taken = {(g.uuid, g.mig_start) for a in led.owners.values() for c in a.containers
                     for g in c.gpus if g.mig_profile}
            return bool(self._mig_fits(i, mig_wish(req), taken))
        trial = self.inv.arrays.copy()
        for j, uuid in enumerate(self.inv.uuids[i]):
            trial.gpu_free[i, j], trial.gpu_mem_free[i, j] = self._open_free(uuid, led)
        if feasible_at(self.arrays_for(req, trial), self._gpu_only(req), i,
                       node_resources=False):
            return True
        if mode is Mode.MPS and req.gpus == 1 and i in self.inv.mig_rows:
            rooms = self._mig_rooms(i, req.models, migmps.usage(led.owners.values()))
            return migmps.best_instance(rooms, req.milli, memory_wish(req)) is not None
        return False

    def _place(self, pod: dict[str, Any], req: SliceRequest, i: int, namespace: str,
               name: str, uid: str, node: str) -> Assignment | str:
        """Choose the pod's GPUs on node ``i`` and reserve them in the ledger (in flight);
        the signed assignment, or why it does not fit."""
        g = self._gpu_only(req)
        shape = pod_gpu_shape(pod)
        assert shape is not None  # pod_request said it asks for a GPU
        self.sync_workload()
        with self._lock:
            mode = mode_of(req)
            if mode is Mode.MIG:
                fits = self._mig_fits(i, mig_wish(req), self._taken_mig())
                if not fits:
                    return self._filter_mig(mig_wish(req), [node])[1][node]
                size, gpu, inst = fits[0]
                whole = max(1, 1000 * size // 7)
                # the instance is the pod's; its containers split it as they split the pod's
                # effective milli (one container: the whole instance)
                containers = tuple(ContainerAssignment(w.name, Mode.MIG, (GpuShare(
                    gpu, max(1, whole * w.milli // shape.milli),
                    inst.memory_mib * w.milli // shape.milli, inst.profile, inst.start),),
                    w.kind) for w, _ in shape.slots)
            elif feasible_at(self.arrays_for(req), g, i, node_resources=False):
                gpus = self._gpus_at(req, i)
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
                    # why, as filter says it (its fit alone: filter's learning takes the
                    # lock held here)
                    return self._fit(pod, req, [node])[1].get(node) or \
                        "; ".join(explain(self.arrays_for(req), g, i))
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
            self.hold_usage((namespace, name), node, req.cpu_milli, req.memory_mib,
                            Shape(req.cpu_milli, req.gpus, req.milli, req.models))
        return a

    def _gpus_at(self, req: SliceRequest, i: int) -> tuple[int, ...]:
        """The GPUs of node ``i`` for a pod that fits there whole-GPU: a one-GPU share where
        the policy would put it (frag-strand: the GPU that leaves the least fragmentation,
        the lowest index on ties), else the first free whole GPUs. Lock held."""
        g, a = self._gpu_only(req), self.arrays_for(req)
        if g.is_sharing and req.gpus == 1:
            got: tuple[int, ...]
            if ScoreCache.usable(self.policy):
                # the GPU the node's score was made with (kept since filter scored it)
                best = self._scores_locked(req, np.array([i], dtype=np.int64)).gpu
                got = (int(best[0]),) if best is not None else ()
            else:
                got = self.policy.choose_gpus(self.st, req, i, self.rng)
            if got and got[0] >= 0 and gpu_ok(a, g, i)[got[0]]:
                return got
            return best_fit_gpu(a, g, i)
        return exclusive_gpus(a, g, i)


def _container_mode(req: SliceRequest, w: GpuWant) -> Mode:
    """A container's sharing mode: the pod's isolation, with a whole GPU exclusive."""
    if req.isolation is Isolation.TIMESLICE:
        return Mode.TIMESLICE
    if w.milli == 1000 and req.isolation in (Isolation.ANY, Isolation.EXCLUSIVE):
        return Mode.EXCLUSIVE
    return Mode.MPS
