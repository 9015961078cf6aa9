"""The extender places as the simulator does: frag-strand against the workload learned from the
pods it sees, with each node's CPU and memory counted, and (narrow, the default) a filter that
keeps only the policy's choice, ties to the first node in a fixed order (by the names' hash)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from gpuslice.adapters.kube.fake import FakeApiServer, WatchEvent
from gpuslice.core.frag import Shape
from gpuslice.core.learned import learned_workload
from gpuslice.core.model import SliceRequest
from gpuslice.core.policies import PlacementState, make_policy, tie_order
from gpuslice.services.extender import ExtenderState

KEY = b"test-key-0123456789abcdef"


def clock() -> str:
    return "2026-11-27T10:00:00.000000Z"


def node(name: str, gpus: int = 8, cpu: str = "96", memory: str = "768Gi",
         model: str = "A100-80GB") -> dict[str, Any]:
    inv = [{"uuid": f"GPU-{name}-{i}", "index": i, "model": model, "memoryMiB": 81920}
           for i in range(gpus)]
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name,
                         "annotations": {"gpuslice.io/inventory": json.dumps(inv)}},
            "status": {"allocatable": {"cpu": cpu, "memory": memory}}}


def pod(name: str, milli: int = 0, gpus: int = 1, cpu: str = "4", memory: str = "8Gi",
        node_name: str = "", init_cpu: str = "") -> dict[str, Any]:
    limits = {} if not milli else {"gpuslice.io/gpu": str(gpus),
                                   "gpuslice.io/gpu-milli": str(milli)}
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": {
        "limits": limits, "requests": {"cpu": cpu, "memory": memory}}}]}
    if init_cpu:
        spec["initContainers"] = [{"name": "init", "resources": {
            "requests": {"cpu": init_cpu}}}]
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": {}},
            "spec": spec}


def bind(state: ExtenderState, api: FakeApiServer, name: str) -> str:
    """Filter then bind ``name`` where the filter sends it; the node."""
    p = api.get_pod("default", name)
    keep, failed = state.filter(p, state.inv.names)
    assert len(keep) == 1, (keep, failed)
    assert state.bind("default", name, p["metadata"]["uid"], keep[0]) == ""
    return keep[0]


def row(state: ExtenderState, name: str) -> int:
    return state.inv.index[name]


def test_node_cpu_and_memory_follow_allocatable_and_the_pods_bound_there() -> None:
    api = FakeApiServer()
    api.add_node(node("a", cpu="96", memory="768Gi"))
    api.add_node(node("b", cpu="32", memory="256Gi"))
    # a CPU-only pod bound by the default scheduler: its init container's 10 CPU is its
    # effective request (max of init and app containers, as kube-scheduler counts it)
    api.add_pod(pod("web", cpu="2", memory="4Gi", node_name="a", init_cpu="10"))
    state = ExtenderState(api, KEY, clock=clock)
    a = state.inv.arrays
    assert int(a.cpu_cap[row(state, "a")]) == 96_000
    assert int(a.cpu_free[row(state, "a")]) == 86_000
    assert int(a.mem_free[row(state, "a")]) == 768 * 1024 - 4096
    assert int(a.cpu_free[row(state, "b")]) == 32_000
    # the watch: a pod bound to b takes CPU there, its deletion gives it back
    late = api.add_pod(pod("late", cpu="6", node_name="b"))
    state.apply(WatchEvent("ADDED", "Pod", late))
    assert int(a.cpu_free[row(state, "b")]) == 26_000
    state.apply(WatchEvent("DELETED", "Pod", late))
    assert int(a.cpu_free[row(state, "b")]) == 32_000
    # a node whose allocatable changes is read again
    changed = node("b", cpu="40")
    api.add_node(changed)
    state.apply(WatchEvent("MODIFIED", "Node", changed))
    assert int(state.inv.arrays.cpu_cap[row(state, "b")]) == 40_000


def test_a_bind_takes_the_pods_cpu_at_once_and_a_refused_one_gives_it_back() -> None:
    api = FakeApiServer()
    api.add_node(node("a", cpu="16"))
    api.add_pod(pod("p", milli=500, cpu="6"))
    state = ExtenderState(api, KEY, clock=clock)
    where = bind(state, api, "p")
    assert int(state.inv.arrays.cpu_free[row(state, where)]) == 10_000
    # a bind whose write fails (the pod is gone) leaves no CPU taken
    q = api.add_pod(pod("q", milli=500, cpu="3"))
    state.filter(q, ["a"])
    state.remember(q)  # as the filter handler does, for the bind's hold
    held = state.hold("default", "q", q["metadata"]["uid"], "a")
    assert held is not None
    assert int(state.inv.arrays.cpu_free[row(state, "a")]) == 7_000
    api.delete_pod("default", "q")
    assert state.bind("default", "q", q["metadata"]["uid"], "a", held) != ""
    assert int(state.inv.arrays.cpu_free[row(state, "a")]) == 10_000


def test_filter_keeps_only_the_policys_choice_and_ties_go_to_a_fixed_node_order() -> None:
    api = FakeApiServer()
    for n in ("n3", "n1", "n2"):
        api.add_node(node(n))
    first = api.add_pod(pod("first", milli=300))
    state = ExtenderState(api, KEY, clock=clock)
    names = ["n1", "n2", "n3"]
    want = names[int(np.argmin(tie_order(names)))]
    for asked in (["n3", "n2", "n1"], ["n1", "n3", "n2"]):  # whatever order is asked
        keep, failed = state.filter(first, asked)
        assert keep == [want] and failed == {}  # every node ties (empty): none is refused
    assert ExtenderState(api, KEY, clock=clock).filter(first, names)[0] == [want]  # restarts
    assert state.bind("default", "first", first["metadata"]["uid"], want) == ""
    # the next share packs next to the first (frag-strand), whatever the order asked in
    nxt = api.add_pod(pod("next", milli=300))
    assert state.filter(nxt, ["n3", "n2", "n1"])[0] == [want]
    # with narrow off every node that fits is kept, and prioritize ranks it highest
    wide = ExtenderState(api, KEY, clock=clock, narrow=False)
    keep, _ = wide.filter(nxt, ["n3", "n2", "n1"])
    assert sorted(keep) == ["n1", "n2", "n3"]
    scores = dict(wide.prioritize(nxt, keep))
    others = [scores[n] for n in names if n != want]
    assert scores[want] == 10 and scores[want] > max(others)


def test_the_narrow_filters_one_pass_choice_is_best_over_every_node_that_fits() -> None:
    """The narrow filter answers in one vectorised pass (``_choose``), with reasons for the
    nodes that do not fit only; it must
    pick what ``best`` picks among the nodes the full per-node filter keeps, whatever the
    fill, the request, the order the names come in and whether they are every node or a few
    (with most nodes asked, the pick among every node is taken when it is a candidate; with
    fewer than half, kube-scheduler's adaptive share, their rows are looked up at once), and
    fall back to the reasons when no node fits."""
    rng = np.random.default_rng(5)
    api = FakeApiServer()
    names = [f"n{i:02d}" for i in range(24)]
    for i, n in enumerate(names):
        api.add_node(node(n, gpus=4 if i % 3 else 8, model="A100-80GB" if i % 5 else "T4"))
    state = ExtenderState(api, KEY, clock=clock)
    wide = ExtenderState(api, KEY, clock=clock, narrow=False)
    elsewhere = 0  # subsets whose pick is not the pick among every node
    for k in range(400):  # about 128 GPUs: full well before
        milli = int(rng.choice([250, 500, 750, 1000]))
        gpus = 2 if milli == 1000 and k % 4 == 0 else 1
        p = api.add_pod(pod(f"p{k}", milli=milli, gpus=gpus))
        few = k % 3 == 0  # a few candidates (kube-scheduler's own filters left out the rest)
        order = [str(n) for n in rng.permutation(names)]
        asked = order[: int(rng.integers(2, 10))] if few else order
        asked.append("unknown-node")
        keep, failed = state.filter(p, asked)
        fit, refused = wide.filter(p, asked)
        if not fit:  # nothing fits: the per-node reasons, as without narrowing
            assert keep == [] and set(failed) == set(asked)
            if few:
                continue
            break
        # the nodes that cannot hold the pod are refused with the same reasons as without
        # narrowing (issue 54); only the feasible ones passed over are left out
        assert failed == refused and "unknown-node" in failed
        assert keep == [state.best(pod_req(p), fit)]
        every, _ = wide.filter(p, names)
        elsewhere += keep[0] != state.best(pod_req(p), every)
        assert state.bind("default", f"p{k}", p["metadata"]["uid"], keep[0]) == ""
        wide.apply(WatchEvent("MODIFIED", "Pod", api.get_pod("default", f"p{k}")))
    else:
        raise AssertionError("the cluster never filled: the no-fit branch was not reached")
    assert elsewhere > 0  # the look-up of the candidates' rows was exercised too


def test_a_node_that_joins_after_scores_were_kept_is_scored_too() -> None:
    """The score cache is per inventory: a re-read with another node set starts a new one (it
    once kept the old size, and the new node's row raised IndexError in the watch loop)."""
    api = FakeApiServer()
    for n in ("a", "b"):
        api.add_node(node(n, gpus=2))
    state = ExtenderState(api, KEY, clock=clock)
    first = api.add_pod(pod("first", milli=500))
    assert state.filter(first, ["a", "b"])[0]  # scores kept for this shape
    api.add_node(node("c", gpus=8))
    state.apply(WatchEvent("ADDED", "Node", api.get_node("c")))  # a re-read
    again = api.add_pod(pod("again", milli=500))
    keep, _ = state.filter(again, ["a", "b", "c"])
    assert keep == [state.best(pod_req(again), ["a", "b", "c"])]


def pod_req(p: dict[str, Any]) -> SliceRequest:
    from gpuslice.adapters.kube.objects import pod_request

    req = pod_request(p)
    assert req is not None
    return req


def test_a_cpu_heavy_gpu_pod_goes_where_cpu_is_left_not_where_gpus_would_strand() -> None:
    """frag-strand's stranding term needs the nodes' CPU: with the CPU of node "a" nearly
    all taken by CPU-only pods, a GPU pod asking for much CPU goes to "b"; bestfit (the old
    default, CPU-blind in the extender) would not see the difference."""
    api = FakeApiServer()
    api.add_node(node("a", cpu="96"))
    api.add_node(node("b", cpu="96"))
    for k in range(8):  # 80 of a's 96 CPUs taken by CPU-only pods
        api.add_pod(pod(f"cpu-{k}", cpu="10", node_name="a"))
    for k in range(6):  # the workload: GPU pods with 12 CPU per GPU
        api.add_pod(pod(f"seen-{k}", milli=1000, cpu="12"))
    heavy = api.add_pod(pod("heavy", milli=1000, cpu="12"))
    state = ExtenderState(api, KEY, clock=clock)
    assert state.filter(heavy, ["a", "b"])[0] == ["b"]


def test_the_gpu_chosen_at_bind_is_the_policys() -> None:
    """A share goes to the GPU frag-strand picks (the one whose leftover still fits the
    learned workload's shapes), not merely the tightest."""
    api = FakeApiServer()
    api.add_node(node("a", gpus=2))
    api.add_pod(pod("x", milli=600))
    api.add_pod(pod("y", milli=300))
    state = ExtenderState(api, KEY, clock=clock)
    bind(state, api, "x")  # GPU 0: 400 left
    bind(state, api, "y")  # where does frag-strand put 300?
    z = api.add_pod(pod("z", milli=400))
    state.filter(z, ["a"])
    req = SliceRequest(1, 400, 4000, 8192)
    st = PlacementState.build(state.inv.arrays.copy(), state.estimator.current())
    want = make_policy("frag-strand").choose_gpus(st, req, row(state, "a"),
                                                  np.random.default_rng(0))
    assert state.bind("default", "z", z["metadata"]["uid"], "a") == ""
    held = state.ledger.owners[("default", "z")]
    assert held.containers[0].gpus[0].uuid == f"GPU-a-{want[0]}"


def test_the_learned_workload_counts_live_pods_and_forgets_deleted_ones() -> None:
    api = FakeApiServer()
    api.add_node(node("a"))
    for k in range(10):
        api.add_pod(pod(f"s{k}", milli=250, cpu="2"))
    state = ExtenderState(api, KEY, clock=clock)
    assert state.estimator.pods == 10
    wl, want = state.estimator.current(), learned_workload([Shape(2000, 1, 250)] * 10)
    assert wl.shapes == want.shapes and wl.popularity.tolist() == want.popularity.tolist()
    gone = api.get_pod("default", "s0")
    state.apply(WatchEvent("DELETED", "Pod", gone))
    assert state.estimator.pods == 9


def test_a_refused_pod_does_not_cost_a_pass_over_every_gpu(monkeypatch: Any) -> None:
    """What preemption cannot help (FailedAndUnresolvableNodes) is judged on the arrays with
    every pod gone, derived once per inventory: filtering a pod that fits nowhere must not
    ask the ledger about each GPU of the cluster again (the regression that tripled the
    extender's filter time at 5,000 nodes)."""
    from gpuslice.core.ledger import Ledger

    api = FakeApiServer()
    for k in range(20):
        api.add_node(node(f"n{k:02d}", gpus=8))
    state = ExtenderState(api, KEY, clock=clock)
    too_big = api.add_pod(pod("too-big", milli=1000, gpus=9))
    calls = [0]
    free = Ledger.free

    def counted(self: Ledger, uuid: str) -> tuple[int, int]:
        calls[0] += 1
        return free(self, uuid)

    monkeypatch.setattr(Ledger, "free", counted)
    for _ in range(5):
        keep, failed = state.filter(too_big, state.inv.names)
        assert keep == [] and len(failed) == 20
        assert state.unresolvable(too_big, list(failed)) == set(failed)
    assert calls[0] < 20 * 8, calls[0]


def test_a_bind_to_a_node_the_pod_no_longer_fits_answers_why_and_does_not_hang() -> None:
    """The scheduler may bind where another bind just took the room (two binds in flight):
    the refusal gives the filter's reason (it once called filter under the state's lock,
    which filter takes too, and hung every later call)."""
    import threading

    api = FakeApiServer()
    api.add_node(node("a", gpus=1))
    api.add_pod(pod("first", milli=800))
    state = ExtenderState(api, KEY, clock=clock)
    bind(state, api, "first")
    late = api.add_pod(pod("late", milli=800))  # not seen by the state yet (no watch here)
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(
        state.bind("default", "late", late["metadata"]["uid"], "a")), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the bind hung"
    assert "200 milli free, pod needs 800" in out[0]
    assert state.filter(late, ["a"])[0] == []  # and the state still answers


def test_narrow_filter_gives_the_reason_for_every_node_that_cannot_hold_the_pod() -> None:
    """Issue 54 (kube-scheduler's extender rules): with ``--filter-keeps best`` a node without
    GPUs, one of another model, one whose agent has not published its GPUs yet and one full
    are each in the failed nodes with a reason; only the feasible node passed over for the
    best one is left out of both lists."""
    api = FakeApiServer()
    for n in ("a", "b"):
        api.add_node(node(n))
    api.add_node(node("cpu-only", gpus=0))
    api.add_node(node("t4", model="T4"))
    api.add_node(node("full", gpus=1))
    fresh = node("fresh")
    del fresh["metadata"]["annotations"]["gpuslice.io/inventory"]  # joined a moment ago
    api.add_node(fresh)
    state = ExtenderState(api, KEY, clock=clock)
    filler = api.add_pod(pod("filler", milli=1000))
    assert state.filter(filler, ["full"])[0] == ["full"]
    assert state.bind("default", "filler", filler["metadata"]["uid"], "full") == ""
    p = api.add_pod(pod("p", milli=500))
    p["metadata"]["annotations"]["gpuslice.io/gpu-model"] = "A100-80GB"
    keep, failed = state.filter(p, ["a", "b", "cpu-only", "t4", "full", "fresh"])
    assert len(keep) == 1 and keep[0] in ("a", "b")
    assert set(failed) == {"cpu-only", "t4", "full", "fresh"}
    assert failed["cpu-only"] == "node has no GPU"
    assert failed["t4"].startswith("node has T4 GPUs, pod accepts A100-80GB")
    assert "milli free" in failed["full"]
    assert failed["fresh"].startswith("node unknown to gpuslice (its node agent has not "
                                      "published its GPUs yet)")
