"""The extender's ledger follows the API server: resyncs, pod and node watch events."""

from __future__ import annotations

from gpuslice.adapters.kube.fake import FakeApiServer, WatchEvent
from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import (
    KEY,
    clock,
    node,
    pod,
    small_cluster,
)


def test_deleted_or_finished_pods_give_their_share_back_on_resync() -> None:
    api = small_cluster()
    api.add_pod(pod("done", 700))
    state = ExtenderState(api, KEY, clock=clock)
    for name in ("big", "done"):
        p = api.get_pod("default", name)
        assert state.bind("default", name, p["metadata"]["uid"], "a") == ""
    assert sum(state.ledger.used_milli.values()) == 1400
    api.delete_pod("default", "big")
    finished = api.get_pod("default", "done")
    finished["status"] = {"phase": "Succeeded"}
    api.delete_pod("default", "done")
    api.add_pod(finished)
    state.rebuild()
    assert sum(state.ledger.used_milli.values()) == 0


def test_watch_events_keep_the_ledger_current() -> None:
    api = small_cluster()
    state = ExtenderState(api, KEY, clock=clock)
    _, since = api.watch("", 0.0)
    p = api.get_pod("default", "big")
    assert state.bind("default", "big", p["metadata"]["uid"], "a") == ""
    # a second extender (restarted from the same API server) learns the bind from the watch
    other = ExtenderState(FakeApiServer(), KEY, clock=clock)
    other.api = api
    other.rebuild()
    assert sum(other.ledger.used_milli.values()) == 700
    api.delete_pod("default", "big")
    events, since = api.watch(since, 1.0)
    assert [e.type for e in events][-1] == "DELETED"
    for ev in events:
        state.apply(ev)
        other.apply(ev)
    assert sum(state.ledger.used_milli.values()) == 0
    assert sum(other.ledger.used_milli.values()) == 0
    none, same = api.watch(since, 0.05)  # nothing new: waits, then returns empty
    assert none == [] and same == since


def test_node_events_re_read_only_when_gpu_inventory_or_cordon_change() -> None:
    """The kubelet updates its node's status every few minutes, other controllers patch
    labels: thousands of nodes must not each trigger a full re-read; a node that joins, leaves
    or publishes a new inventory must, once per batch."""
    api = small_cluster()
    state = ExtenderState(api, KEY, clock=clock)
    reads = []
    real = api.list_nodes
    api.list_nodes = lambda: reads.append(1) or real()  # type: ignore[method-assign]
    _, since = api.watch("", 0.0)
    api.patch_node("a", {"topology.kubernetes.io/zone": "z1"}, {"kubelet/heartbeat": "1"})
    events, since = api.watch(since, 1.0)
    state.apply_all(events)
    assert reads == []
    api.add_node(node("c", "H100-SXM", 4))
    api.patch_node("b", {}, {"gpuslice.io/cordoned-gpus": "GPU-b-0"})
    events, since = api.watch(since, 1.0)
    assert [e.kind for e in events] == ["Node", "Node"]
    state.apply_all(events)
    assert len(reads) == 1
    assert "c" in state.inv.index and "GPU-b-0" in state.cordoned
    state.apply(WatchEvent("DELETED", "Node", api.get_node("c")))
    assert len(reads) == 2


def test_pods_with_quantities_no_array_can_hold_are_left_out_not_crashes() -> None:
    """A pod asking for a GPU count, milli, GPU memory or CPU past what an int64 holds (the
    API server keeps such quantities) is left out of what the extender learns, at start and
    through the watch (its filter calls answer why); the pods around it count as before."""
    api = small_cluster()
    for name, limits, cpu in (
            ("milli", {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "9" * 400}, "1"),
            ("count", {"gpuslice.io/gpu": "99999999999999999999"}, "1"),
            ("memory", {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-memory": "1e30"}, "1"),
            ("plain", {}, "9300000000000000")):  # 9.3e15 cores: past int64 milli-CPU
        p = pod(name)
        p["spec"]["containers"][0]["resources"] = {"limits": limits, "requests": {"cpu": cpu}}
        api.add_pod(p)
    state = ExtenderState(api, KEY, clock=clock)  # the start's full read: no OverflowError
    _, since = api.watch("", 0.0)
    late = pod("late")
    late["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "1e19"
    api.add_pod(late)
    events, since = api.watch(since, 1.0)
    state.apply_all(events)  # the watch goes on
    p = api.get_pod("default", "big")
    assert state.bind("default", "big", p["metadata"]["uid"], "a") == ""
    assert sum(state.ledger.used_milli.values()) == 700
