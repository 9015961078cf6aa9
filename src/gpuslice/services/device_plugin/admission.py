"""Finding the assignment an Allocate executes: the pods waiting for this node's GPUs, the
containers the kubelet will allocate for, and claiming one (one set insertion under a lock)."""

from __future__ import annotations

import time
from typing import Any

from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.objects import PRIORITY_ANNOTATION, PROCESSES_ANNOTATION
from gpuslice.core.assignment import ANNOTATION, Assignment, ContainerAssignment, verify_any
from gpuslice.core.errors import GpusliceError, note_once
from gpuslice.services.device_plugin.state import PluginState, _Admission


def _kubelet_order(w: _Admission) -> tuple[int, int, str, str, str]:
    """The order the kubelet admits waiting pods in: the order their bindings reach it on
    its watch of the node's pods, which is the order of the pods' resourceVersions as the
    Binding wrote them (nothing writes a bound pod before the kubelet admits it). Binds to
    one node may then run concurrently: their commit order, not the extender's bind order,
    decides. Pods whose resourceVersion is not a number (no API server known writes one)
    come after, in bind-time order."""
    if w.resource_version is None:
        return (1, 0, w.a.bind_time, w.a.namespace, w.a.pod)
    return (0, w.resource_version, w.a.bind_time, w.a.namespace, w.a.pod)


class Admissions(PluginState):
    """Matching an Allocate to the assignment it executes, and claiming it."""

    def _pending(self) -> list[Assignment]:
        """Verified assignments for this node not executed yet, oldest first."""
        return [w.a for w in self._waiting()]

    def _pods_here(self) -> list[dict[str, Any]]:
        """The pods bound to this node, asking again (up to ``api_retry_s``, backing off) while
        the API server does not answer: a brief outage must not fail admissions."""
        deadline = time.monotonic() + self.cfg.api_retry_s
        wait_s = 0.1
        with self.api_slots.take() as free:
            if not free:
                raise GpusliceError(f"{self.api_slots.limit} calls are waiting on the API "
                                    "server already; try again")
            while True:
                try:
                    left = max(0.01, deadline - time.monotonic())
                    return self.api.list_pods(node=self.cfg.node, timeout_s=left)
                except GpusliceError as exc:
                    if time.monotonic() + wait_s > deadline:
                        raise GpusliceError(f"the API server is not answering, so the pods "
                                            f"waiting for this node's GPUs cannot be read: "
                                            f"{exc}") from None
                    time.sleep(wait_s)
                    wait_s = min(2.0, 2 * wait_s)

    def _held_by_kubelet(self) -> set[tuple[str, str]]:
        """Pods holding this resource's devices, as the kubelet's PodResources API says (empty
        when it is not configured). Read up to three times over about a second; when it
        still does not answer, fail closed (a GpusliceError, and Allocate answers
        UNAVAILABLE): after an agent restart a pod the kubelet admitted already may still be
        Pending, and without this answer its assignment would look free for the next pod on
        its GPU, two pods on one share."""
        if self.cfg.pod_resources is None:
            return set()
        from gpuslice.adapters.kubelet.podresources import pods_holding

        for attempt in range(3):
            try:
                return set(pods_holding(self.cfg.resource, self.cfg.pod_resources))
            except GpusliceError as exc:
                last = exc
                if attempt < 2:
                    time.sleep(0.25 * (attempt + 1))
        note_once(self.problems, str(last))
        raise GpusliceError(f"{last}: which pods hold devices already is unknown, so no "
                            "assignment is executed (the kubelet's next try may succeed)")

    def _plan(self, pod: dict[str, Any], a: Assignment) -> tuple[ContainerAssignment, ...]:
        """The containers of ``a`` the kubelet will call Allocate for, in its order: the
        init containers in declared order, then the app containers, each only when its
        limits name this plugin's resource (the device manager allocates nothing else)."""
        spec = pod.get("spec") or {}
        order: dict[str, int] = {}
        asks: set[str] = set()
        for field_name in ("initContainers", "containers"):
            listed = spec.get(field_name)
            for c in listed if isinstance(listed, list) else []:
                if not isinstance(c, dict):
                    continue
                name = str(c.get("name") or "")
                order.setdefault(name, len(order))
                res = c.get("resources")
                if isinstance(res, dict) and any(
                        isinstance(res.get(k), dict) and self.cfg.resource in res[k]
                        for k in ("limits", "requests")):
                    asks.add(name)
        ordered = sorted(a.containers, key=lambda c: order.get(c.name, len(order)))
        plan = tuple(c for c in ordered if c.name not in order or c.name in asks)
        return plan or tuple(ordered)

    def _waiting(self, pods: list[dict[str, Any]] | None = None) -> list[_Admission]:
        """Verified assignments for this node not claimed yet, oldest first, each with the
        containers the kubelet will allocate and its pod's priority annotation. ``pods``: the
        node's pods as just read (read here when not given). A pod whose fields are not of
        their types is passed over (noted once): it must not hold up the others."""
        out = []
        held = self._held_by_kubelet()
        for p in self._pods_here() if pods is None else pods:
            try:
                w = self._waiting_one(p, held)
            except (AttributeError, TypeError, ValueError) as exc:
                meta = p.get("metadata") if isinstance(p, dict) else None
                name = (f"{meta.get('namespace')}/{meta.get('name')}"
                        if isinstance(meta, dict) else "?")
                note_once(self.problems, f"pod {name}: passed over, not a pod as the API "
                          f"server holds one ({type(exc).__name__}: {exc})")
                continue
            if w is not None:
                out.append(w)
        return sorted(out, key=_kubelet_order)

    def _waiting_one(self, p: dict[str, Any], held: set[tuple[str, str]]) -> _Admission | None:
        meta = p.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        text = annotations.get(ANNOTATION)
        if not text or not isinstance(text, str):
            return None
        # the kubelet allocates devices while admitting a pod, never for one already running
        # or finished: after an agent restart those are not waiting for Allocate
        status = p.get("status")
        if status and not isinstance(status, dict):  # passed over and noted by _waiting
            raise TypeError(f"status: expected an object, got {type(status).__name__}")
        if not _admitting(p):
            return None
        key = (meta.get("namespace", "default"), meta.get("name"))
        if key in held:
            return None  # the kubelet gave it devices already: executed before a restart
        try:
            a = decode(text)
        except AnnotationError:
            return None
        if a.node != self.cfg.node or not verify_any(a, (self.cfg.key,
                                                         *self.cfg.previous_keys)):
            return None
        if (a.namespace, a.pod, a.pod_uid) != (*key, meta.get("uid")):
            # signed for another pod: a copy of a running pod's annotation must not get
            # that pod's GPUs
            note_once(self.problems, f"pod {key[0]}/{key[1]}: carries the assignment of "
                      f"{a.namespace}/{a.pod} (UID {a.pod_uid}); not executed")
            return None
        if a.pod_uid in self._claimed:
            return None
        priority = str(annotations.get(PRIORITY_ANNOTATION, "normal"))
        rv = str(meta.get("resourceVersion") or "")
        # a resourceVersion is a uint64 in every API server known (etcd's revision)
        return _Admission(a, self._plan(p, a), priority,
                          int(rv) if rv.isascii() and rv.isdigit() and len(rv) <= 20 else None,
                          processes=annotations.get(PROCESSES_ANNOTATION, "1"))

    def _fits_next(self, adm: _Admission, ids: list[str]) -> bool:
        """Whether the devices the kubelet chose can be ``adm``'s next container's: as many
        as it has GPUs, on its GPUs; for whole GPUs any of the pod's own GPUs (the kubelet
        reuses an init container's devices for the app containers in an order of its own)."""
        if adm.done >= len(adm.plan):
            return False
        c = adm.plan[adm.done]
        gpus = self._gpus_of(ids)
        if len(ids) != len(c.gpus):
            return False
        if gpus == {g.uuid for g in c.gpus}:
            return True
        whole = all(g.milli == 1000 and not g.mig_profile for g in c.gpus)
        return adm.done > 0 and whole and len(gpus) == len(ids) and gpus <= adm.a.gpu_uuids()

    def _claim_for(self, ids: list[str]) -> tuple[_Admission | None, list[str]]:
        """The admission these devices belong to, its next container taken: the pod the
        kubelet is admitting (its containers come one Allocate at a time), else the oldest
        waiting assignment whose first container is on these GPUs and can be executed; and
        why older ones were passed over (their MIG instance is gone: a layout changed after
        the bind). One that can never run must not hold up the pods behind it.

        The node's pods are read first: a pod being admitted that is gone or no longer
        pending (deleted, its admission failed) gives up its remaining containers, and what
        was claimed for pods gone from the node is forgotten (a pod made again under the
        same name is another pod, with another UID)."""
        with self._claim_lock:
            seen = self._claim_seq
        pods = self._pods_here()
        pending = set()
        for p in pods:
            meta = p.get("metadata") if isinstance(p, dict) else None
            if isinstance(meta, dict) and isinstance(meta.get("uid"), str) and _admitting(p):
                pending.add(meta["uid"])
        with self._claim_lock:
            self._forget(pending, seen)
            for adm in self._admitting:
                if self._fits_next(adm, ids):
                    adm.done += 1
                    if adm.done >= len(adm.plan):
                        self._admitting.remove(adm)
                    return adm, []
        stale: list[str] = []
        for w in self._waiting(pods):
            if not self._fits_next(w, ids):
                continue
            mig = [g for c in w.a.containers for g in c.gpus if g.mig_profile]
            try:
                for g in mig:
                    self._visible(g)
            except GpusliceError as exc:
                stale.append(f"{w.a.namespace}/{w.a.pod}: {exc}")
                continue
            with self._claim_lock:
                if w.a.pod_uid in self._claimed:
                    continue
                self._claim_seq += 1
                self._claimed[w.a.pod_uid] = self._claim_seq
                self._executed.append(w.a)
                w.done = 1
                # the kubelet admits one pod at a time: another pod's admission left half
                # done ended without its remaining containers (it failed, or was deleted)
                self._admitting.clear()
                if len(w.plan) > 1:
                    self._admitting.append(w)
            return w, stale
        return None, stale

    def _forget(self, pending: set[str], seen: int) -> None:
        """Under ``_claim_lock``: drop the admissions under way of pods not pending on the node
        any more, and the claims of pods gone from it, among those claimed before the read
        that found them gone (sequence <= ``seen``; a claim made since the read is not in
        it)."""
        self._admitting = [adm for adm in self._admitting if adm.a.pod_uid in pending]
        gone = [uid for uid, seq in self._claimed.items()
                if seq <= seen and uid not in pending]
        if not gone:
            return
        for uid in gone:
            del self._claimed[uid]
        dropped = set(gone)
        self._executed = [x for x in self._executed if x.pod_uid not in dropped]

    def _undo(self, adm: _Admission) -> None:
        """Give back the container just taken (and the pod, when it was its first)."""
        with self._claim_lock:
            adm.done -= 1
            if adm.done == 0:
                self._claimed.pop(adm.a.pod_uid, None)
                self._executed = [x for x in self._executed if x.pod_uid != adm.a.pod_uid]
                if adm in self._admitting:
                    self._admitting.remove(adm)
            elif adm not in self._admitting:
                self._admitting.append(adm)

    def _target(self, size: int) -> list[str]:
        """The GPUs the next Allocate of ``size`` devices should be on: the next container
        of the pod being admitted, else the first of the oldest waiting assignment."""
        with self._claim_lock:
            for adm in self._admitting:
                c = adm.plan[min(adm.done, len(adm.plan) - 1)]
                if len(c.gpus) == size:
                    return [g.uuid for g in c.gpus]
        try:
            waiting = self._waiting()
        except GpusliceError:
            return []  # no steer: the kubelet's own choice, and Allocate says what failed
        for w in waiting:
            if len(w.plan[0].gpus) == size:
                return [g.uuid for g in w.plan[0].gpus]
        return []

    def _unclaim(self, a: Assignment) -> None:
        with self._claim_lock:
            self._claimed.pop(a.pod_uid, None)
            self._executed = [x for x in self._executed if x.pod_uid != a.pod_uid]
            self._admitting = [w for w in self._admitting if w.a is not a]


def _admitting(pod: object) -> bool:
    """Whether the kubelet may still be admitting ``pod`` (its phase is Pending, or not yet
    set): it allocates devices then, never for a pod running or finished."""
    status = pod.get("status") if isinstance(pod, dict) else None
    return (status.get("phase") if isinstance(status, dict) else None) in (None, "", "Pending")
