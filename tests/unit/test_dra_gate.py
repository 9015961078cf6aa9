"""When the claim allocator's scheduling gate comes off a pod (core.dra_gate, issue 58).

Upstream rules the design rests on (kubernetes v1.36.3):

* a gate can only be removed after a pod's creation, never added:
  ``validateOnlyDeletedSchedulingGates`` (pkg/apis/core/validation/validation.go, called by
  ``ValidatePodUpdate``), hence the gate is set at creation and this module only decides its
  removal;
* a gated pod is never tried: the SchedulingGates plugin's ``PreEnqueue``
  (pkg/scheduler/framework/plugins/schedulinggates/scheduling_gates.go) answers
  UnschedulableAndUnresolvable while any gate is left, so a gate that is never removed holds
  its pod for ever, which is why every path here ends in a release.
"""

from __future__ import annotations

import pytest

from gpuslice.core.dra_gate import (
    ALLOCATOR_UNAVAILABLE,
    LEFT_TO_SCHEDULER,
    NOT_PLACED,
    Claims,
    GatedPod,
    keeper_message,
    verdict,
)
from gpuslice.core.errors import ValidationError
from gpuslice.core.lease import LeaseState

HOLD_S = 30.0


@pytest.mark.parametrize(("pod", "release", "reason", "warning"), [
    # its claim allocated: released at once, no Event (kube-scheduler's Scheduled is the note)
    (GatedPod(0.0, Claims.ALLOCATED), True, "", False),
    # another component's gate still on: not ours to release, whatever else holds
    (GatedPod(900.0, Claims.ALLOCATED, ("kueue.x-k8s.io/admission",)), False, "", False),
    (GatedPod(900.0, Claims.UNPLACED, ("x.example/gate",), "no room"), False, "", False),
    # not a claim the allocator places: to kube-scheduler at once, a Normal Event
    (GatedPod(0.0, Claims.NOT_OURS, why="two claims"), True, LEFT_TO_SCHEDULER, False),
    # no room now, or our write refused: at once, a Warning, so kube-scheduler reports it
    (GatedPod(0.0, Claims.UNPLACED, why="no node has room"), True, NOT_PLACED, True),
    (GatedPod(0.0, Claims.REFUSED, why="403"), True, NOT_PLACED, True),
    # no device tainted for the allocator and none settling: kube-scheduler's to allocate
    (GatedPod(0.0, Claims.PENDING, devices=False), True, ALLOCATOR_UNAVAILABLE, True),
    # waiting for something that comes (its claim made, devices settling): held, then not
    (GatedPod(1.0, Claims.MISSING), False, "", False),
    (GatedPod(1.0, Claims.PENDING, devices=False, settling=True), False, "", False),
    (GatedPod(HOLD_S, Claims.MISSING), True, ALLOCATOR_UNAVAILABLE, True),
    (GatedPod(HOLD_S + 1, Claims.PENDING, devices=False, settling=True), True,
     ALLOCATOR_UNAVAILABLE, True),
    (GatedPod(HOLD_S, Claims.PENDING), True, ALLOCATOR_UNAVAILABLE, True),
    # queued behind a burst the allocator is working through: held while it works
    (GatedPod(10 * HOLD_S, Claims.QUEUED), False, "", False),
    (GatedPod(10 * HOLD_S, Claims.QUEUED, devices=False), True, ALLOCATOR_UNAVAILABLE, True),
])
def test_verdict(pod: GatedPod, release: bool, reason: str, warning: bool) -> None:
    v = verdict(pod, HOLD_S)
    assert (v.release, v.reason, v.warning) == (release, reason, warning), v
    if pod.why and release:
        assert pod.why in v.message


def test_a_held_pod_says_when_to_look_again() -> None:
    v = verdict(GatedPod(12.5, Claims.MISSING), HOLD_S)
    assert not v.release and v.recheck_s == pytest.approx(HOLD_S - 12.5)
    assert verdict(GatedPod(0.0, Claims.ALLOCATED, ("other",)), HOLD_S).recheck_s is None


def test_the_hold_names_what_it_waited_for() -> None:
    assert "its claim not created yet" in verdict(GatedPod(40, Claims.MISSING), HOLD_S).message
    assert "settling" in verdict(GatedPod(40, Claims.PENDING, devices=False, settling=True),
                                 HOLD_S).message


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_a_hold_that_is_not_positive_is_refused_naming_it(bad: float) -> None:
    with pytest.raises(ValidationError, match="max_hold_s"):
        verdict(GatedPod(0.0, Claims.PENDING), bad)


LEASE = "gpuslice-system/gpuslice-dra-allocator"


def test_the_keeper_acts_once_the_allocators_lease_is_stale_for_the_grace() -> None:
    """The allocator renews every 2 s a Lease of 15 s; the drivers drop its taint once
    renewTime + duration has passed (services/dra_driver/driver.py, ``_lease_fresh``); the
    keeper releases its pods ``grace`` after that."""
    held = LeaseState("allocator-0", renewed_at=1000.0, duration_s=15.0)
    assert keeper_message(held, 1000.0 + 14.9, 5.0, LEASE) is None  # fresh
    assert keeper_message(held, 1000.0 + 19.9, 5.0, LEASE) is None  # stale, within grace
    note = keeper_message(held, 1000.0 + 20.0, 5.0, LEASE)
    assert note is not None and LEASE in note and "held by allocator-0" in note
    assert "last renewed 20 s ago" in note


def test_a_lease_given_up_counts_from_its_renewal_and_none_at_all_at_once() -> None:
    """A stopping allocator gives its Lease up (holder cleared, as client-go's
    ReleaseOnCancel): no need to wait its duration. No Lease (never installed, deleted):
    nothing will ever release the gate, so at once."""
    given_up = LeaseState("", renewed_at=1000.0, duration_s=1.0)
    assert keeper_message(given_up, 1004.0, 5.0, LEASE) is None
    note = keeper_message(given_up, 1005.0, 5.0, LEASE)
    assert note is not None and "given up" in note
    gone = keeper_message(None, 0.0, 5.0, LEASE)
    assert gone is not None and "does not exist" in gone


def test_a_negative_grace_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match="grace_s"):
        keeper_message(None, 0.0, -1.0, LEASE)
