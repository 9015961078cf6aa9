"""The claim allocator's writes to ResourceClaims, on a pool of writers (issue 58).

A claim is allocated as kube-scheduler's PreBind (``bindClaim``) allocates one: the finalizer
``resource.kubernetes.io/delete-protection`` first (a main-resource update), then
``status.allocation`` (the status subresource), each preconditioned on the resourceVersion just
read. Two things make that shorter for a pod waiting on it:

* The pod is written into ``status.reservedFor`` with the allocation
  (:func:`gpuslice.adapters.kube.dra.reservation`): kube-scheduler's PreBind then finds the
  claim reserved for the pod and writes nothing (dynamicresources.go ``PreBind``,
  ``resourceclaim.IsReservedForPod``).
* The finalizer goes on early (:meth:`ClaimWrites.finalize_early`): on a claim of ours seen
  for the first time unallocated, while a writer is free, before its pod is known or decided
  on. A pod created after its claim, or a claim made from the pod's template while
  kube-controller-manager records its name in the pod's status, then waits for one write, not
  two. The finalizer on a claim never allocated does not keep it: kube-controller-manager's
  resourceclaim controller (controller.go ``syncClaim``) removes it once the claim is being
  deleted and reserved for nobody, allocated or not.

A write past the finalizer is still done by the claim's own write when the early one was not
made (no free writer: a burst) or failed.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube.ports import ApiConflict, ApiNotFound
from gpuslice.core.errors import GpusliceError

Written = tuple[str, dict[str, Any] | None, int]  # write: outcome, the claim, conflicts
EARLY_KEEP_S = 30.0  # an early finalizer's outcome is kept this long for its claim's write


class ClaimApi(Protocol):
    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...
    def update_resource_claim(self, claim: dict[str, Any]) -> dict[str, Any]: ...
    def update_resource_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]: ...


def _uid(claim: Mapping[str, Any]) -> str:
    return str((claim.get("metadata") or {}).get("uid") or "")


def _has_finalizer(claim: Mapping[str, Any]) -> bool:
    return kdra.FINALIZER in ((claim.get("metadata") or {}).get("finalizers") or [])


class ClaimWrites:
    """``writers`` at a time (one: each at once, on the caller's thread). :attr:`free` counts
    the writers not busy: the allocator takes one before it decides a claim, so that the
    claim's write starts as soon as it is decided."""

    def __init__(self, api: ClaimApi, writers: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.clock = api, clock
        self.pool = ThreadPoolExecutor(writers, "dra-allocator-write") if writers > 1 \
            else None
        self.free = threading.Semaphore(writers)
        # claim UID -> the early finalizer's write (the claim after it; None: not made), when
        self._early: dict[str, tuple[Future[dict[str, Any] | None], float]] = {}
        self.early_written = 0  # finalizers written early (for tests and the log)

    def close(self) -> None:
        """Wait for the writes under way and stop the writers."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # -- the finalizer, early ----------------------------------------------------------------

    def finalize_early(self, claims: Iterable[Mapping[str, Any]]) -> None:
        """The finalizer on each of ``claims`` (new to the allocator, unallocated, ours) that
        lacks it, each on a writer free now (none waits for one: in a burst the claims' own
        writes add it). Without a pool of writers nothing is written early."""
        now = self.clock()
        if self._early:
            self._early = {u: (f, t) for u, (f, t) in self._early.items()
                           if not f.done() or now - t < EARLY_KEEP_S}
        if self.pool is None:
            return
        for claim in claims:
            meta = claim.get("metadata") or {}
            uid = _uid(claim)
            if not uid or uid in self._early or _has_finalizer(claim) \
                    or meta.get("deletionTimestamp"):
                continue
            if not self.free.acquire(blocking=False):
                return
            fut = self.pool.submit(self._add_finalizer, dict(claim))
            fut.add_done_callback(lambda _: self.free.release())
            self._early[uid] = (fut, now)

    def _add_finalizer(self, claim: dict[str, Any]) -> dict[str, Any] | None:
        """The claim with our finalizer added, as the API server answered; None when the
        write was refused or failed (the claim's own write adds it then)."""
        body = copy.deepcopy(claim)
        body["metadata"].setdefault("finalizers", []).append(kdra.FINALIZER)
        try:
            out = self.api.update_resource_claim(body)
        except GpusliceError:  # a conflict, the claim gone, the server away: no matter
            return None
        self.early_written += 1
        return out

    def _take_early(self, claim: Mapping[str, Any]) -> Future[dict[str, Any] | None] | None:
        """The early finalizer write of ``claim``, if one went out and ``claim`` (read before
        it landed) does not show it yet; taken off the list on the pass's thread (the only one
        that changes it)."""
        if _has_finalizer(claim):
            return None
        got = self._early.pop(_uid(claim), None)
        return None if got is None else got[0]

    @staticmethod
    def _finalized(claim: dict[str, Any],
                   early: Future[dict[str, Any] | None] | None) -> dict[str, Any]:
        """``claim`` as its ``early`` finalizer write left it, once that is done, when it
        landed; else ``claim``."""
        if early is None:
            return claim
        try:
            after = early.result()
        except Exception:  # a bug in the early write: the claim's own write adds it
            return claim
        return after if after is not None and _has_finalizer(after) else claim

    # -- a claim's allocation ----------------------------------------------------------------

    def submit(self, claim: dict[str, Any], alloc: dict[str, Any],
               reserve: dict[str, str] | None) -> Future[Written]:
        """:meth:`write` of the claim on a writer (taken by the caller from :attr:`free`,
        free again once it is done); at once without a pool."""
        early = self._take_early(claim)

        def run(claim: dict[str, Any], alloc: dict[str, Any],
                reserve: dict[str, str] | None) -> Written:
            return self.write(claim, alloc, reserve, early=early)

        if self.pool is not None:
            out = self.pool.submit(run, claim, alloc, reserve)
            out.add_done_callback(lambda _: self.free.release())
            return out
        fut: Future[Written] = Future()
        try:
            fut.set_result(run(claim, alloc, reserve))
        except Exception as exc:  # handed over as the pool would
            fut.set_exception(exc)
        self.free.release()
        return fut

    def write(self, claim: dict[str, Any], alloc: dict[str, Any],
              reserve: dict[str, str] | None = None, *,
              early: Future[dict[str, Any] | None] | None = None) -> Written:
        """Finalizer (unless it is on, or went on early: ``early``), then ``alloc`` as
        status.allocation with ``reserve``, the pod, as ``status.reservedFor``, each with the
        resourceVersion just read (run on a writer's thread). A conflict re-reads the claim:
        allocated by someone else -> ``taken``; else retry. Returns the outcome, the claim as
        it is now, and the conflicts met."""
        meta = claim["metadata"]
        conflicts = 0
        claim = self._finalized(claim, early)
        for _ in range(3):
            try:
                cur = claim
                if not _has_finalizer(cur):
                    body = copy.deepcopy(cur)
                    body["metadata"].setdefault("finalizers", []).append(kdra.FINALIZER)
                    cur = self.api.update_resource_claim(body)
                body = copy.deepcopy(cur)
                status = body.setdefault("status", {})
                status["allocation"] = copy.deepcopy(alloc)
                if reserve is not None and not status.get("reservedFor"):
                    status["reservedFor"] = [dict(reserve)]
                return "allocated", self.api.update_resource_claim_status(body), conflicts
            except ApiConflict:
                conflicts += 1
                try:
                    claim = self.api.get_resource_claim(meta["namespace"], meta["name"])
                except ApiNotFound:
                    return "gone", None, conflicts
                if (claim.get("status") or {}).get("allocation"):
                    return "taken", claim, conflicts
                if claim["metadata"].get("deletionTimestamp"):
                    return "gone", None, conflicts
            except ApiNotFound:
                return "gone", None, conflicts
        return "conflict", None, conflicts
