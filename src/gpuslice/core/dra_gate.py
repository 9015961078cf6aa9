"""When a pod held by the claim allocator's scheduling gate goes to kube-scheduler (issue 58).

A pod whose claim the allocator places may carry the gate ``gpu.gpuslice.io/allocator``
(``spec.schedulingGates``): kube-scheduler does not try a gated pod at all (the
SchedulingGates plugin's PreEnqueue keeps it out of the active queue), so it is tried once,
after the allocator has written its claim's allocation and removed the gate, instead of
failing first on devices tainted for the allocator and being requeued. Gates can only be
removed after a pod's creation, never added (``validateOnlyDeletedSchedulingGates`` in
kubernetes pkg/apis/core/validation/validation.go), so the gate is set when the pod is
created (a pod template, or an admission webhook through
:func:`gpuslice.adapters.kube.dra_gate.admission_patch`), and the one rule that matters is
when it comes off. This module decides that, as pure functions:

* :func:`verdict`: the allocator's decision for one pod it holds, pass after pass;
* :func:`keeper_message`: the fallback's, for a component that outlives the allocator (the
  DRA drivers, :class:`gpuslice.services.dra_gate.GateKeeper`): a gate that outlives the
  allocator's Lease is released, with a note, so a pod is never stuck behind a component
  that is gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpuslice.core.errors import ValidationError
from gpuslice.core.lease import LeaseState

# Event reasons (core/v1 Events on the pod; what ``kubectl describe pod`` shows)
LEFT_TO_SCHEDULER = "ClaimLeftToScheduler"  # Normal: not a claim the allocator places
NOT_PLACED = "ClaimNotPlaced"  # Warning: no node has room for it now, or our write was refused
ALLOCATOR_UNAVAILABLE = "AllocatorUnavailable"  # Warning: the allocator cannot place it


class Claims(StrEnum):
    """What the allocator knows of a held pod's claims in this pass."""

    ALLOCATED = "allocated"  # every claim of the pod is allocated (by us or anyone)
    PENDING = "pending"  # one claim we place, not written yet (a later pass writes it)
    # one claim we place, left to the next passes of an allocator working through a burst
    # (a pass's share of claims, or the Lease's window, was used up): held while it works
    QUEUED = "queued"
    UNPLACED = "unplaced"  # one claim we place, and no node has room for it now
    REFUSED = "refused"  # the API server refused our write of its allocation
    NOT_OURS = "not-ours"  # claims the allocator leaves to kube-scheduler's own allocation
    MISSING = "missing"  # a claim the pod names does not exist yet (a template's, being made)


@dataclass(frozen=True, slots=True)
class GatedPod:
    """A pod not bound yet that carries the allocator's gate, as one pass sees it.
    ``held_s``: how long the gate has been the pod's only one (other gates are someone
    else's: while one is left, the pod is not ours to release); ``why``: the reason for
    UNPLACED, REFUSED and NOT_OURS; ``devices``: whether any node's devices are usable by
    the allocator now (tainted for it and settled), ``settling``: whether some are tainted
    and still settling (usable soon)."""

    held_s: float
    claims: Claims
    other_gates: tuple[str, ...] = ()
    why: str = ""
    devices: bool = True
    settling: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """Release the gate or hold the pod. A release with a ``reason`` gets an Event of that
    reason (``warning``: type Warning, else Normal); the normal release (its claims
    allocated) gets none. A hold says when to look again (``recheck_s`` from now; ``None``:
    when something changes)."""

    release: bool
    reason: str = ""
    message: str = ""
    warning: bool = False
    recheck_s: float | None = None


HOLD = Verdict(False)
RELEASE = Verdict(True)


def verdict(pod: GatedPod, max_hold_s: float) -> Verdict:
    """Whether the allocator releases ``pod`` now. A pod whose claims are allocated goes at
    once; one the allocator will not place (not its shape, no room now, its write refused,
    no device tainted for it) goes at once with an Event saying why, so kube-scheduler reports
    it (Unschedulable, or allocates it itself); one still waiting (its claim not created yet,
    devices settling, a write left to the next pass) is held at most ``max_hold_s``; one
    queued behind a burst the allocator is working through, as long as it works (when it
    stops, the DRA drivers release it once its Lease is stale: :func:`keeper_message`)."""
    if not max_hold_s > 0:
        raise ValidationError("max_hold_s", "a positive number of seconds", max_hold_s)
    if pod.other_gates:  # not ours yet: the other gates' owners decide first
        return HOLD
    if pod.claims is Claims.ALLOCATED:
        return RELEASE
    if pod.claims is Claims.NOT_OURS:
        return Verdict(True, LEFT_TO_SCHEDULER, f"released to kube-scheduler's own "
                       f"allocation: {pod.why}")
    if pod.claims in (Claims.UNPLACED, Claims.REFUSED):
        then = " (the allocator places the claim when room frees)" \
            if pod.claims is Claims.UNPLACED else ""
        return Verdict(True, NOT_PLACED, f"not allocated: {pod.why}; released to "
                       f"kube-scheduler{then}", warning=True)
    if not pod.devices and not pod.settling:
        return Verdict(True, ALLOCATOR_UNAVAILABLE, "no device carries the allocator's taint "
                       "(the DRA drivers put it on while the allocator's Lease is fresh): "
                       "released to kube-scheduler's own allocation", warning=True)
    if pod.claims is Claims.QUEUED:
        return HOLD  # its pass is due at once
    if pod.held_s >= max_hold_s:
        what = "its claim not created yet" if pod.claims is Claims.MISSING else \
            "the allocator's devices still settling" if not pod.devices else \
            "its claim not allocated"
        return Verdict(True, ALLOCATOR_UNAVAILABLE, f"held {pod.held_s:.0f} s by the claim "
                       f"allocator's gate ({what}): released to kube-scheduler", warning=True)
    return Verdict(False, recheck_s=max_hold_s - pod.held_s)


def keeper_message(lease: LeaseState | None, now: float, grace_s: float,
                   name: str) -> str | None:
    """The note for gates released because the allocator is gone, or ``None`` while it is
    not: its Lease ``name`` (``None``: there is none; one that cannot be read is no news, and
    the allocator itself releases what it holds when no device is tainted for it) has not been
    renewed for its duration plus ``grace_s`` (the time the allocator's own passes had to
    release what they hold), or its holder gave it up (empty holder) ``grace_s`` ago. The
    same staleness the DRA drivers drop the allocator's taint on, so pods go to
    kube-scheduler's own allocation exactly when it takes over the devices."""
    if not grace_s >= 0:
        raise ValidationError("grace_s", "0 or more seconds", grace_s)
    if lease is None:
        return (f"the claim allocator's Lease {name} does not exist: "
                "released to kube-scheduler's own allocation")
    ends = lease.renewed_at + (lease.duration_s if lease.holder else 0.0)
    if now < ends + grace_s:
        return None
    who = f"held by {lease.holder}, " if lease.holder else "given up, "
    return (f"the claim allocator's Lease {name} is stale ({who}last renewed "
            f"{now - lease.renewed_at:.0f} s ago): released to kube-scheduler's own "
            "allocation")
