"""Day two of the reconfiguration controller (issue 56), on a scripted cluster with a fake
clock: models that load for minutes, a schedule deleted in the middle of a move, two
controllers at once, and the drain that waits for every router replica."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.services.leader import LeaderElector
from gpuslice.services.reconfig import FINALIZER, PLURAL, LeadingController, ReconfigController
from gpuslice.services.reconfig.cluster import ClusterOps
from tests.reconfig.scripted import BATCH, INFERENCE, Scripted, schedule


def drive(s: Scripted, ctl: Any, until: Callable[[], bool], *, dt: float = 10.0,
          steps: int = 400, each: Callable[[], None] | None = None) -> None:
    """Passes of ``ctl``, the cluster's actors between them, ``dt`` seconds apart."""
    for _ in range(steps):
        ctl.step()
        s.kubelet()
        s.agent()
        if each is not None:
            each()
        if until():
            return
        s.now += dt
    raise AssertionError(f"not reached: {s.status() if s.api.list_custom(PLURAL) else '-'}")


def two_replicas(s: Scripted, owner: str | None = None) -> list[str]:
    labels = {"pod-template-hash": "abc"} if owner else None
    return [s.pod(f"old-{i}", node="src", gpu=s.src[0], start=i, labels=labels,
                  owner=owner)["metadata"]["name"] for i in range(2)]


def names(s: Scripted) -> set[str]:
    return {p["metadata"]["name"] for p in s.api.list_pods()}


def phase(s: Scripted) -> str:
    return str(s.gpu_status().get("phase", ""))


def finalizers(s: Scripted) -> list[str]:
    return list(s.api.get_custom(PLURAL, "gpuslice-system", "nightly")["metadata"]
                .get("finalizers") or [])


# -- slow starters -------------------------------------------------------------------------


def test_replacements_that_load_for_minutes_move_within_the_schedules_limit() -> None:
    """Replacements ready after 5 minutes (a model loading) with readyTimeoutSeconds 600:
    the move goes on (a limit fixed at 120 s in code failed every such move); the finalizer
    is on during the move and off after it."""
    s = Scripted()
    two_replicas(s)
    s.api.replace_custom(PLURAL, schedule(readyTimeoutSeconds=600))
    s.ready_at["old-0-m"] = s.ready_at["old-1-m"] = s.now + 300
    ctl = s.controller()
    seen_finalizer = []
    drive(s, ctl, lambda: phase(s) == "Done",
          each=lambda: seen_finalizer.append(FINALIZER in finalizers(s)))
    assert s.layout() == BATCH and s.cordoned() == []
    assert names(s) == {"old-0-m0", "old-1-m1"}  # moved, nothing left behind
    ctl.step()  # the next pass finds no move under way
    assert any(seen_finalizer) and finalizers(s) == []


def test_replacements_not_ready_in_time_drain_leave_and_the_gpu_reopens() -> None:
    """readyTimeoutSeconds 60: one replacement ready (serving: it drains first, until the
    routers report its last request done), one never ready; both go, the originals keep
    serving untouched, the cordon is lifted, the status says why."""
    s = Scripted()
    two_replicas(s)
    s.api.replace_custom(PLURAL, schedule(readyTimeoutSeconds=60, drainTimeoutSeconds=600))
    s.ready_at["old-1-m"] = s.now + 10**9
    s.routers.in_flight["old-0-m0"] = 1  # a request on the ready replacement, still running
    ctl = s.controller()
    drive(s, ctl, lambda: phase(s) == "Retiring" and s.now > 1_000_000 + 200)
    assert "old-0-m0" in names(s)  # not removed while a router still has a request on it
    s.routers.in_flight["old-0-m0"] = 0
    drive(s, ctl, lambda: phase(s) == "Failed")
    st = s.gpu_status()
    assert "replacements not ready after 60 s (spec.readyTimeoutSeconds)" in st["message"]
    assert names(s) == {"old-0", "old-1"} and s.cordoned() == [] and s.layout() == INFERENCE
    assert not any((p["metadata"].get("annotations") or {}).get("gpuslice.io/draining")
                   for p in s.api.list_pods())
    assert ["old-0-m0"] in s.routers.asked  # the ready one drained through the routers
    ctl.step()
    assert finalizers(s) == []


def test_a_restoring_timeout_hands_the_stand_ins_to_their_replicaset() -> None:
    """The ReplicaSet's new pods stay not ready (a model loading longer than the limit): the
    stand-ins are handed to the ReplicaSet, which adopts them and removes its not-ready
    surplus; no pod is left without an owner, and serving pods never dip below two."""
    s = Scripted()
    two_replicas(s, owner="rs")
    s.api.replace_custom(PLURAL, schedule(readyTimeoutSeconds=120))
    s.ready_at["rs-new"] = s.now + 10**9
    ctl = s.controller()
    lows: list[int] = []

    def each() -> None:
        s.replicaset("rs", 2)
        lows.append(sum(1 for p in s.api.list_pods()
                        if (p.get("status") or {}).get("ready") is True
                        and "gpuslice.io/draining" not in (p["metadata"].get("annotations")
                                                           or {})))

    drive(s, ctl, lambda: phase(s) == "Done", each=each)
    assert min(lows) >= 2, lows
    pods = s.api.list_pods()
    assert len(pods) == 2 and all(p["metadata"].get("ownerReferences") for p in pods)
    # the adopted stand-ins
    assert {p["metadata"]["name"] for p in pods} == {"old-0-m0", "old-1-m1"}
    assert any("handed to them" in line for line in ctl.log), ctl.log
    assert s.layout() == BATCH and s.cordoned() == []


def test_a_stand_in_nobody_adopts_drains_and_leaves() -> None:
    """The ReplicaSet is gone (nothing adopts the stand-ins handed to it): after 30 s they
    drain and leave, and the move goes on; nothing stays ownerless."""
    s = Scripted()
    two_replicas(s, owner="rs")
    s.api.replace_custom(PLURAL, schedule(readyTimeoutSeconds=60))
    drive(s, s.controller(), lambda: phase(s) == "Done")
    assert not s.api.list_pods()


def test_the_old_pods_are_marked_draining_only_once_the_routers_send_to_the_replacements(
        ) -> None:
    """A replacement ready but not yet in the routers' lists (their next EndpointSlice
    read): marking the old pods draining then would leave a router nothing to send to."""
    s = Scripted()
    two_replicas(s)
    s.api.replace_custom(PLURAL, schedule())
    s.routers.unknown = {"old-0-m0"}
    ctl = s.controller()
    for _ in range(20):
        ctl.step()
        s.kubelet()
        s.now += 1
    assert phase(s) == "Moving" and all(
        (p.get("status") or {}).get("ready") for p in s.api.list_pods())
    assert not any("gpuslice.io/draining" in (p["metadata"].get("annotations") or {})
                   for p in s.api.list_pods())
    s.routers.unknown.clear()
    drive(s, ctl, lambda: phase(s) == "Done", dt=1)


@pytest.mark.parametrize("field", ["readyTimeoutSeconds", "drainTimeoutSeconds"])
@pytest.mark.parametrize("value", [0, -5, "600", True, 86401, float("nan")])
def test_a_bad_time_limit_is_refused_naming_its_field(field: str, value: object) -> None:
    s = Scripted()
    s.api.replace_custom(PLURAL, schedule("nightly", **{field: value}))
    s.controller().step()
    ready = next(c for c in s.status()["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "Invalid" and f"spec.{field}" in ready["message"], ready


# -- a schedule deleted mid-move -----------------------------------------------------------


@pytest.mark.parametrize("at", ["Cordoned", "Moving", "Draining", "Applying"])
def test_deleting_a_schedule_mid_move_leaves_nothing_behind(at: str) -> None:
    """Deleted while its GPU is at ``at``: the finalizer holds the object until the move is
    undone (before the replicas moved) or finished short of the layout (after): the cordon
    is lifted, the pods it made are gone or are the moved replicas, no pod stays marked
    draining, a layout not yet applied is withdrawn; then the object goes."""
    s = Scripted()
    two_replicas(s)
    s.api.replace_custom(PLURAL, schedule(readyTimeoutSeconds=600, drainTimeoutSeconds=60))
    s.routers.in_flight["old-0"] = 1  # holds the drain, so Draining lasts a while
    hold_agent = at == "Applying"
    ctl = s.controller()
    for _ in range(200):
        ctl.step()
        s.kubelet()
        if not hold_agent:
            s.agent()
        if phase(s) == at:
            break
        s.now += 1
    assert phase(s) == at and FINALIZER in finalizers(s)
    s.api.delete_custom(PLURAL, "gpuslice-system", "nightly")
    s.routers.in_flight.clear()
    for _ in range(200):
        ctl.step()
        s.kubelet()
        if not s.api.list_custom(PLURAL):
            break
        s.now += 5
    assert not s.api.list_custom(PLURAL)  # the finalizer went
    assert s.cordoned() == [] and s.desired() == {} and s.layout() == INFERENCE
    left = names(s)
    assert left in ({"old-0", "old-1"}, {"old-0-m0", "old-1-m1"}), left  # undone, or moved
    assert not any((p["metadata"].get("annotations") or {}).get("gpuslice.io/draining")
                   for p in s.api.list_pods())
    assert any("Cancelled" in line or "deleted" in line for line in ctl.log), ctl.log


# -- two controllers at once ----------------------------------------------------------------


class RaceAfterRead:
    """The API server as one controller sees it; after its next read of node ``node`` (the
    first half of a read-modify-write), ``other`` runs: another controller's write lands
    between this one's read and write."""

    def __init__(self, api: FakeApiServer, other: Callable[[], None]) -> None:
        self.api, self.other = api, other
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.api, name)
        if name not in ("get_node", "list_nodes") or self.fired:
            return fn

        def read(*a: Any, **kw: Any) -> Any:
            out = fn(*a, **kw)
            self.fired = True
            self.other()
            return out
        return read


@pytest.mark.parametrize("first_on", [True, False])
def test_two_controllers_at_once_do_not_undo_each_others_cordons(first_on: bool) -> None:
    """Controller A cordons (or reopens) GPU 0 while controller B cordons GPU 1 of the same
    node, A's write landing between B's read and B's write: both changes hold (B's write is
    preconditioned on what it read, and redone on the conflict)."""
    s = Scripted()
    s.api.patch_node("dst", {}, {"gpuslice.io/cordoned-gpus": "" if first_on else s.dst[0]})
    a = ClusterOps(s.api)
    b = ClusterOps(RaceAfterRead(s.api, lambda: a.set_cordon("dst", s.dst[0], first_on)))
    b.set_cordon("dst", s.dst[1], True)
    ann = s.api.get_node("dst")["metadata"]["annotations"]["gpuslice.io/cordoned-gpus"]
    assert set(filter(None, ann.split(","))) == ({s.dst[0], s.dst[1]} if first_on
                                                  else {s.dst[1]})


def test_desired_layouts_of_two_writers_both_hold() -> None:
    s = Scripted()
    a = ClusterOps(s.api)
    b = ClusterOps(RaceAfterRead(s.api, lambda: a.set_desired("dst", s.dst[0], BATCH)))
    b.set_desired("dst", s.dst[1], BATCH)
    n = s.api.get_node("dst")["metadata"]["annotations"]["gpuslice.io/mig-desired"]
    assert n == f'{{"{s.dst[0]}": "{BATCH}", "{s.dst[1]}": "{BATCH}"}}'


def test_only_the_lease_holder_acts_and_a_standby_takes_over() -> None:
    """Two controllers on one Lease (a replacement started beside an evicted pod): only the
    holder writes anything; when it stops (its Lease released) the other resumes the move
    where the status says and finishes it."""
    s = Scripted()
    two_replicas(s)
    s.api.replace_custom(PLURAL, schedule())
    writes: dict[str, int] = {"a": 0, "b": 0}

    class Counting:
        def __init__(self, who: str) -> None:
            self.who = who

        def __getattr__(self, name: str) -> Any:
            fn = getattr(s.api, name)
            if name.startswith(("get_", "list_")) or name == "watch":
                return fn

            def write(*a: Any, **kw: Any) -> Any:
                if name not in ("put_lease",):
                    writes[self.who] += 1
                return fn(*a, **kw)
            return write

    def runner(who: str) -> LeadingController:
        api = Counting(who)
        el = LeaderElector(api, "gpuslice-system", "gpuslice-reconfig", who,
                           s.clock, mono=s.clock)
        return LeadingController(ReconfigController(api, router=s.routers,
                                                    clock=s.clock), el)

    a, b = runner("a"), runner("b")
    for _ in range(6):  # a leads; the move starts
        assert a.step() and not b.step()
        s.kubelet()
        s.agent()
        s.now += 1
    assert writes["a"] > 0 and writes["b"] == 0
    assert phase(s) not in ("", "Done")
    assert a.elector is not None and a.elector.release()
    drive(s, b, lambda: phase(s) == "Done", dt=1)
    assert writes["b"] > 0 and names(s) == {"old-0-m0", "old-1-m1"} and s.cordoned() == []


def test_the_controller_reports_every_write_preconditioned() -> None:
    """The node annotations the controller shares are written only with a resourceVersion
    (the fake's unconditional patch_node is used for the progress label alone)."""
    s = Scripted()
    two_replicas(s)
    s.api.replace_custom(PLURAL, schedule())
    calls: list[tuple[str, Any]] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            fn = getattr(s.api, name)
            if name != "patch_node":
                return fn

            def patch(node: str, labels: Any, annotations: Any) -> Any:
                calls.append((node, dict(annotations)))
                return fn(node, labels, annotations)
            return patch

    drive(s, ReconfigController(Spy(), router=s.routers, clock=s.clock),
          lambda: phase(s) == "Done")
    assert calls and all(ann == {} for _, ann in calls), calls
