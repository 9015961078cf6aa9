"""Lists served from watches, as client-go's informers keep a store: one full list, then the
watch's events applied, so that a caller that reads every object on every pass (the DRA claim
allocator, five times a second) costs the API server one list per resource, not one per pass.

:class:`Mirror` keeps one resource; :class:`MirroredLists` serves the allocator's port (pods,
nodes, ResourceClaims, ResourceSlices) from mirrors and passes everything else, writes
included, to the :class:`~gpuslice.adapters.kube.client.KubeClient`. A claim the allocator
wrote is served as written until the watch brings that very version (or a later change): the
next pass must not see it unallocated and place it again (a pod whose gate it removed, the
same).

Waking (issue 58): with ``wake`` (a :class:`threading.Event`), every watch event that may
give the allocator work sets it, so that a pass runs on the event instead of on a timer:
any slice event; a claim created or deleted, or one whose allocation came or went or whose
deletion began (not a change of its finalizers or ``reservedFor`` alone: kube-scheduler
reserving an allocated claim for its pod, or the echo of our own finalizer, gives no work);
a pod event of a pod not bound yet (created, its gates or claims changed), a pod deleted or
finished (its CPU and claims free up). Nodes (their status heartbeats) and device classes do
not wake it; the allocator's periodic pass reads them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuslice.adapters.kube.client import KubeClient, _Follower
from gpuslice.adapters.kube.ports import WatchEvent
from gpuslice.core.errors import GpusliceError

Key = tuple[str | None, str]
WRITTEN_S = 30.0  # our write served at most this long without the watch bringing it


def _key(obj: dict[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace"), str(meta.get("name"))


def _rv(obj: dict[str, Any]) -> object:
    return (obj.get("metadata") or {}).get("resourceVersion")


def rv_order(a: object, b: object) -> int | None:
    """-1, 0 or 1 as resourceVersion ``a`` is older than, the same as or newer than ``b`` (two
    versions of objects of one resource), as ``CompareResourceVersion`` in
    k8s.io/apimachinery/pkg/util/resourceversion (v0.36) orders them: positive integers
    without leading zeros, a longer one the newer. None when either is not of that form."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return None
    if not all(v and v[0] != "0" and v.isascii() and v.isdigit() for v in (a, b)):
        return None
    if len(a) != len(b):
        return -1 if len(a) < len(b) else 1
    return (a > b) - (a < b)


def _not_older(a: object, b: object) -> bool:
    """Whether version ``a`` is ``b`` or a later one (the same string where they cannot be
    ordered)."""
    order = rv_order(a, b)
    return a == b if order is None else order >= 0


def _pod_wakes(event: WatchEvent) -> bool:
    """Whether a pod's watch event may give the claim allocator work: the pod is not bound
    yet, or it is gone or finished (what it held frees up)."""
    obj = event.obj
    return event.type == "DELETED" or not (obj.get("spec") or {}).get("nodeName") or \
        (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class _ClaimWakes:
    """Whether a claim's watch event may give the claim allocator work: created or deleted,
    or its allocation or deletion changed since the event before (kept per claim; called on
    the watch's one thread)."""

    def __init__(self) -> None:
        self._seen: dict[Key, tuple[bool, bool]] = {}

    def __call__(self, event: WatchEvent) -> bool:
        key = _key(event.obj)
        if event.type == "DELETED":
            self._seen.pop(key, None)
            return True
        status = event.obj.get("status")
        now = (bool(status.get("allocation")) if isinstance(status, dict) else False,
               bool((event.obj.get("metadata") or {}).get("deletionTimestamp")))
        before = self._seen.get(key)
        self._seen[key] = now
        return event.type != "MODIFIED" or before != now


class _WakingQueue(queue.Queue[Any]):
    """The watch's queue: each event put sets ``wake`` when ``wakes`` says it may matter (a
    broken watch always: the list that follows may bring anything)."""

    def __init__(self, wake: threading.Event | None,
                 wakes: Callable[[WatchEvent], bool] | None) -> None:
        super().__init__()
        self.wake, self.wakes = wake, wakes

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        if self.wake is not None and (self.wakes is None or not isinstance(item, WatchEvent)
                                      or self.wakes(item)):
            self.wake.set()


class Mirror:
    """One resource's objects, kept current by a watch from the resourceVersion of a full
    list; a broken watch (410, the server gone) lists again at the next read. ``wake`` is set
    by each event ``wakes`` accepts (every event when ``wakes`` is None; none without
    ``wake``)."""

    def __init__(self, client: KubeClient, list_fn: Any, kind: str,
                 wake: threading.Event | None = None,
                 wakes: Callable[[WatchEvent], bool] | None = None) -> None:
        self.client, self.list_fn, self.kind = client, list_fn, kind
        self.wake, self.wakes = wake, wakes
        self._objects: dict[Key, dict[str, Any]] = {}
        # our writes the watch has not brought yet (and when they were made)
        self._written: dict[Key, tuple[float, dict[str, Any]]] = {}
        self._queue: queue.Queue[WatchEvent | GpusliceError] = _WakingQueue(wake, wakes)
        self._follower: _Follower | None = None
        self._lock = threading.Lock()
        self.lists = 0  # full lists made (1 while the watch holds)

    def items(self) -> list[dict[str, Any]]:
        """Every object as last seen (or as we last wrote it)."""
        with self._lock:
            if self._follower is None:
                self._relist()
            self._drain()
            out = dict(self._objects)
            now = time.monotonic()
            for key, (at, obj) in list(self._written.items()):
                if now - at > WRITTEN_S:  # not brought in time: what the watch has wins
                    del self._written[key]
                else:
                    out[key] = obj
            return list(out.values())

    def wrote(self, obj: dict[str, Any]) -> None:
        """``obj`` is what the API server answered to our write: serve it until the watch
        brings its version or a later change. An answer that comes after one to a later
        write of ours, or after the watch brought that version or a later one, is not
        kept: served instead of them, it would show the object as it was before (a claim
        unallocated again, its devices free to give twice)."""
        key, rv = _key(obj), _rv(obj)
        with self._lock:
            mine = self._written.get(key)
            seen = self._objects.get(key)
            for known in (mine[1] if mine else None, seen):
                order = None if known is None else rv_order(_rv(known), rv)
                if order is not None and order >= 0:
                    return
            self._written[key] = (time.monotonic(), obj)

    def in_flight(self) -> set[Key]:
        """The objects we wrote whose version the watch has not brought yet (the events
        queued so far applied): other watchers of the API server, kube-scheduler's
        informers among them, may not have seen those writes yet either."""
        with self._lock:
            if self._follower is not None:
                self._drain()
            now = time.monotonic()
            return {k for k, (at, _) in self._written.items() if now - at <= WRITTEN_S}

    def close(self) -> None:
        with self._lock:
            if self._follower is not None:
                self._follower.stop.set()
                self._follower = None

    def _relist(self) -> None:
        doc = self.client._json(self.list_fn)
        self.lists += 1
        self._objects = {_key(o): o for o in doc.get("items") or []}
        self._written.clear()
        self._queue = _WakingQueue(self.wake, self.wakes)
        self._follower = _Follower(self.client, self.list_fn, self.kind, self._queue,
                                   since=str(doc["metadata"]["resourceVersion"]))
        self._follower.start()

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, GpusliceError):  # the watch broke: list again
                assert self._follower is not None
                self._follower.stop.set()
                self._relist()
                continue
            key = _key(item.obj)
            mine = self._written.get(key)
            if item.type == "DELETED":
                self._objects.pop(key, None)
                self._written.pop(key, None)
                continue
            self._objects[key] = item.obj
            if mine is not None and _not_older(_rv(item.obj), _rv(mine[1])):
                del self._written[key]  # the watch has caught up with our write (or passed it)


class MirroredLists:
    """The claim allocator's port over ``api``: pods, nodes, ResourceClaims, ResourceSlices
    and DeviceClasses listed from mirrors, the rest (writes, leases, reads of one object)
    passed through. ``wake``: set by the watch events that may give the allocator work (see
    the module doc)."""

    def __init__(self, api: KubeClient, wake: threading.Event | None = None) -> None:
        self.api, self.wake = api, wake
        core, resource = api._api, api._resource
        self.pods = Mirror(api, core.list_pod_for_all_namespaces, "Pod", wake, _pod_wakes)
        self.nodes = Mirror(api, core.list_node, "Node")
        self.claims = Mirror(api, resource.list_resource_claim_for_all_namespaces,
                             "ResourceClaim", wake, _ClaimWakes())
        self.slices = Mirror(api, resource.list_resource_slice, "ResourceSlice", wake)
        self.classes = Mirror(api, resource.list_device_class, "DeviceClass")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def start(self) -> None:
        """List every resource and open its watch now (as an informer's cache sync), not
        at the first pass that reads it: the first claim placed pays no list."""
        for m in (self.pods, self.nodes, self.claims, self.slices, self.classes):
            m.items()

    def list_pods(self, node: str | None = None,
                  timeout_s: float | None = None) -> list[dict[str, Any]]:
        if node is not None or timeout_s is not None:
            return self.api.list_pods(node, timeout_s)
        return self.pods.items()

    def list_nodes(self) -> list[dict[str, Any]]:
        return self.nodes.items()

    def list_device_classes(self) -> list[dict[str, Any]]:
        return self.classes.items()

    def list_resource_claims(self) -> list[dict[str, Any]]:
        return self.claims.items()

    def list_resource_slices(self, driver: str = "", node: str = "") -> list[dict[str, Any]]:
        return [s for s in self.slices.items()
                if (not driver or (s.get("spec") or {}).get("driver") == driver)
                and (not node or (s.get("spec") or {}).get("nodeName") == node)]

    def claims_in_flight(self) -> set[tuple[str | None, str]]:
        """The claims we wrote whose new version our watch has not brought yet
        (:meth:`Mirror.in_flight`): the allocator releases a pod from its gate only once its
        claim's allocation has come back, so kube-scheduler, whose watch of claims runs
        beside ours, finds the claim allocated when it tries the pod."""
        return self.claims.in_flight()

    def update_resource_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        out = self.api.update_resource_claim(claim)
        self.claims.wrote(out)
        return out

    def update_resource_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]:
        out = self.api.update_resource_claim_status(claim)
        self.claims.wrote(out)
        return out

    def remove_pod_scheduling_gate(self, namespace: str, name: str,
                                   ops: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.api.remove_pod_scheduling_gate(namespace, name, ops)
        self.pods.wrote(out)
        return out

    def close(self) -> None:
        for m in (self.pods, self.nodes, self.claims, self.slices, self.classes):
            m.close()
