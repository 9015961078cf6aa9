"""The extender's state and the decisions behind its verbs: the GPU inventory of every node,
the ledger of shares (rebuilt from the signed assignments of live pods, followed through the
watch), and filter, prioritize, bind and preempt as answers over them plus the one API write a
bind makes (the Binding, carrying the assignment). :mod:`.http` serves them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from gpuslice.adapters.kube.annotation import encode
from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound
from gpuslice.adapters.kube.objects import (
    pod_request,
)
from gpuslice.core.assignment import (
    ANNOTATION,
    Assignment,
    sign,
)
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.services.extender.preemption import Preemption
from gpuslice.services.extender.view import bound_with

# pods remembered from their filter for their bind (see hold): a bind follows its filter within
# the scheduling cycle, so the last few thousand pods filtered are plenty; an older one is read
SEEN_PODS = 2048

def bind_clock() -> str:
    """Now, as an assignment's bind time: RFC 3339 UTC with microseconds (the device plugin
    orders waiting assignments by their pods' resourceVersions, and by this where a
    resourceVersion is not a number: seconds would tie a burst and fall back to name order)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class BindWrite:
    """A bind's one write, prepared on the event loop (:meth:`ExtenderState.start_held`):
    the Binding of the pod to ``node`` carrying ``assignment``, with the pod's UID and the
    resourceVersion its filter saw as preconditions."""

    namespace: str
    name: str
    uid: str
    node: str
    assignment: Assignment
    resource_version: str | None

    def annotations(self) -> dict[str, str]:
        return {ANNOTATION: encode(self.assignment)}


class ExtenderState(Preemption):
    """The extender: its view of the cluster (:mod:`.view`), filter and prioritize
    (:mod:`.placement`), preemption (:mod:`.preemption`) and, here, the bind protocol: a
    share held on the event loop as the bind arrives, then one API write."""

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
        self._held[(namespace, name)] = (_container_requests(pod), pod)
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
            self.drop_hold(key)
            if a.node in self.inv.index:
                self._refresh_row(self.inv.index[a.node])

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API server has it now, or ``None`` when it cannot be read (the
        bind then reads it itself and reports why): for a bind whose pod no filter carried."""
        try:
            return self.api.get_pod(namespace, name)
        except GpusliceError:
            return None

    def held_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod :meth:`hold` placed, as the scheduler's filter call carried it: a bind of
        it writes without reading the pod again (its UID and resourceVersion are the
        Binding's preconditions, so a pod changed since makes the write fail, not go
        wrong)."""
        with self._lock:
            held = self._held.get((namespace, name))
        return None if held is None else held[1]

    def start_held(self, namespace: str, name: str, uid: str, node: str,
                   held: Assignment) -> BindWrite | None:
        """The write of a bind whose share :meth:`hold` reserved from the pod its filter
        carried, made ready on the event loop (the share stamped and signed, the pod marked
        busy): the caller writes it (on the loop) and hands the outcome to
        :meth:`finish_held`. Called right after :meth:`hold` returned ``held``. ``None`` when
        the bind is not that simple (the hold taken by another bind's thread, the pod busy
        with another bind, not the leader, the share given back meanwhile): :meth:`bind`
        does it all then, on a thread."""
        key = (namespace, name)
        if self.elector is not None and not self.elector.leader:
            return None
        with self._lock:
            # hold() put the filter's copy of this pod here a moment ago, with no await in
            # between: its UID, node and requests are the held share's by construction
            entry = self._held.get(key)
            if entry is None or key in self._busy or self.ledger.owners.get(key) != held:
                return None
            del self._held[key]
            self._busy.add(key)
            a = self._stamp_locked(key, held)
        meta = entry[1].get("metadata") or {}
        return BindWrite(namespace, name, uid, node, a, meta.get("resourceVersion"))

    def _stamp_locked(self, key: tuple[str, str], held: Assignment) -> Assignment:
        """The held share stamped with its bind time as it is written (not when the bind
        arrived), signed, in the ledger and in flight. Under ``_lock``."""
        a = sign(replace(held, bind_time=self.clock()), self.key)
        self.ledger = self.ledger.restamp(a)
        self._in_flight[key] = a
        return a

    def finish_held(self, w: BindWrite, error: GpusliceError | None) -> str | None:
        """After :meth:`start_held`'s write: "" when it bound the pod, an error message, or
        ``None`` when the filter's copy of the pod was older than the API server's (a 409):
        the caller then binds through :meth:`bind`, which reads the pod first."""
        try:
            return self._written(w.namespace, w.name, w.assignment, error, stale_ok=True)
        finally:
            with self._lock:
                self._busy.discard((w.namespace, w.name))

    def bind(self, namespace: str, name: str, uid: str, node: str,
             held: Assignment | None = None, pod: dict[str, Any] | None = None,
             from_filter: bool = False) -> str:
        """Bind the pod; returns an error message, or "" on success. ``held``: what
        :meth:`hold` reserved for it; used when the pod read now is the one placed (same UID,
        same requests, no assignment yet), given back otherwise."""
        key = (namespace, name)
        with self._lock:
            seen = self._held.pop(key, (None, None))[0]
            busy = key in self._busy
            if not busy:
                self._busy.add(key)
        if busy:  # the scheduler gave up on an earlier call that is still writing
            if held is not None:
                self._release(namespace, name, held)
            return f"pod {namespace}/{name}: an earlier bind of it is still under way; retry"
        try:
            return self._bind(namespace, name, uid, node, held, seen, pod, from_filter)
        finally:
            with self._lock:
                self._busy.discard(key)

    def _bind(self, namespace: str, name: str, uid: str, node: str,
              held: Assignment | None, seen: Any, read: dict[str, Any] | None,
              from_filter: bool = False, reread: bool = True) -> str:
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
                with self._lock:
                    a = self._stamp_locked((namespace, name), held)
                out = self._write(pod, namespace, name, uid, node, a, stale_ok=from_filter)
                if out is not None:
                    return out
                # the filter's copy of the pod was older than the API server's (kube-
                # scheduler requeues its copy, then writes the pod's status: its next try
                # carries the stale resourceVersion again): read the pod, place it as read
                return self._bind(namespace, name, uid, node, None, seen, None)
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
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if existing is not None and bound_with(pod, existing):
            self.adopt(namespace, name, existing)  # what the pod is bound with is held
        if existing is not None and existing.node == node:
            if bound_to == node:  # a retried bind of a pod bound since: done as asked
                return ""
            return self._create_binding(namespace, name, uid, node)  # a retried bind
        if existing is not None:
            if bound_to:
                return f"pod {namespace}/{name} is already bound to {existing.node}"
            # an earlier bind wrote its assignment but never created the Binding (the
            # extender died in between); the scheduler chose again: free the old share
            self.pod_gone(namespace, name)
        elif (namespace, name) in self.ledger.owners:
            with self._lock:
                unknown = (namespace, name) in self._in_flight
            if not unknown:
                # the share is written (another bind of the pod ended while this one read
                # it, or the watch saw the pod bound): this read is older than that write.
                # Read the pod again rather than give a written share back
                if reread:
                    return self._bind(namespace, name, uid, node, None, seen, None,
                                      reread=False)
                return (f"pod {namespace}/{name}: its share is written but the pod read "
                        "back carries no assignment; retry")
            # an earlier bind whose write failed with its outcome unknown (an API server
            # outage): the pod, read just now, carries no assignment, so that share is not
            # taken; give it back before placing the pod again
            self._in_flight.pop((namespace, name), None)
            self.pod_gone(namespace, name)
        placed = self._place(pod, req, i, namespace, name, uid, node)
        if isinstance(placed, str):
            return placed
        return self._write(pod, namespace, name, uid, node, placed) or ""

    def _write(self, pod: dict[str, Any], namespace: str, name: str, uid: str, node: str,
               a: Assignment, stale_ok: bool = False) -> str | None:
        """One write: the Binding, carrying the signed assignment as an annotation (kube-
        apiserver sets a binding's annotations on the pod with its node, in the same update)
        and the pod's UID and the resourceVersion just read as preconditions."""
        try:
            self.api.bind(namespace, name, uid, node, {ANNOTATION: encode(a)},
                          pod["metadata"].get("resourceVersion"))
        except GpusliceError as exc:
            return self._written(namespace, name, a, exc, stale_ok)
        return self._written(namespace, name, a, None, stale_ok)

    def _written(self, namespace: str, name: str, a: Assignment, error: GpusliceError | None,
                 stale_ok: bool = False) -> str | None:
        """The ledger after a Binding write of ``a`` ended with ``error`` (``None``: written):
        "" or an error message; ``None`` for a 409 when ``stale_ok`` (the pod was not read
        but carried by the filter: the caller reads it and tries again)."""
        if isinstance(error, ApiConflict):
            self._release(namespace, name, a)
            return None if stale_ok else f"pod {namespace}/{name}: {error}"
        if isinstance(error, ApiNotFound):
            self._release(namespace, name, a)
            return f"pod {namespace}/{name}: {error}"
        if error is not None:
            # outcome unknown (the API server went away mid-call): the share stays taken
            # (in flight) until a retried bind or a re-read shows whether it was written
            return f"pod {namespace}/{name}: binding: {error}; retry"
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

