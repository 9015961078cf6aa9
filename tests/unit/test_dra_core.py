"""core/dra: the upstream DRA capacity rules, the default allocator's model, our placement.

Rules checked against kubernetes/dynamic-resource-allocation (release-1.36),
structured/internal/experimental/consumable_capacity.go (``calculateConsumedCapacity``,
``roundUpRange``, ``roundUpValidValues``, ``fillEmptyRequest``, ``violatesPolicy``,
``CmpRequestOverCapacity``) and allocator_experimental.go (``allocateOne``: devices tried in
slice order, distinct devices per request, ``deviceInUse``); kube-scheduler's
``numFeasibleNodesToFind`` in pkg/scheduler/schedule_one.go.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpuslice.core.dra_default import nodes_to_find, window
from gpuslice.core.dra_placement import (
    COMPUTE,
    MEMORY,
    MIB,
    REASON_UNSUPPORTED,
    Capacity,
    DeviceRequest,
    DeviceResult,
    DraDevice,
    DraLedger,
    DraNode,
    RequestPolicy,
    Usage,
    consume,
)
from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import Shape, TargetWorkload
from gpuslice.core.policies import make_policy

GIB = 1024 * MIB


def share_gpu(pool: str, name: str, model: str = "A100", mem_gib: int = 80) -> DraDevice:
    mem = mem_gib * GIB
    return DraDevice(pool, name, "gpu", model, True, {
        COMPUTE: Capacity(100, RequestPolicy(default=100, min=1, max=100, step=1)),
        MEMORY: Capacity(mem, RequestPolicy(default=0, min=0, max=mem, step=GIB)),
    })


def node(name: str, n: int = 4, cpu: int = 64_000, mem: int = 256 * 1024,
         **kw: int) -> DraNode:
    return DraNode(name, cpu, mem, tuple(share_gpu(name, f"gpu-{j}") for j in range(n)), **kw)


def workload() -> TargetWorkload:
    return TargetWorkload.of([Shape(4000, 1, 500), Shape(8000, 1, 1000), Shape(2000, 1, 250)],
                             [0.4, 0.4, 0.2])


def share(percent: int, mem_gib: int | None = None, count: int = 1) -> DeviceRequest:
    caps = {COMPUTE: percent}
    if mem_gib is not None:
        caps[MEMORY] = mem_gib * GIB
    return DeviceRequest("gpu", count, caps)


# ---- request policies (consumable_capacity.go) -----------------------------------------------


@pytest.mark.parametrize(("policy", "requested", "consumed"), [
    (RequestPolicy(min=1 * GIB, step=GIB), 1, GIB),  # roundUpRange: below min -> min
    (RequestPolicy(min=1 * GIB, step=GIB), 3 * GIB + 1, 4 * GIB),  # up to the next step
    (RequestPolicy(min=10, step=5), 12, 15),
    (RequestPolicy(min=10), 12, 12),  # no step: as asked
    (RequestPolicy(valid_values=(10, 20, 50)), 11, 20),  # roundUpValidValues
    (RequestPolicy(valid_values=(10, 20, 50)), 60, 60),  # none larger: as asked
    (RequestPolicy(default=7, min=1, step=1), None, 7),  # fillEmptyRequest: the default
    (RequestPolicy(min=1, step=1), None, 100),  # no default: the whole capacity
])
def test_request_policy_rounds_as_upstream(policy: RequestPolicy, requested: int | None,
                                           consumed: int) -> None:
    assert policy.consumed(requested, 100) == consumed


def test_request_policy_violations_and_validation() -> None:
    pol = RequestPolicy(min=0, max=50, step=10)
    assert pol.violated_by(60)  # above max: the device is not eligible
    assert not pol.violated_by(50)
    assert RequestPolicy(valid_values=(1, 2)).violated_by(3)
    assert not RequestPolicy(default=3, valid_values=(1, 2)).violated_by(3)
    with pytest.raises(ValidationError, match="validValues"):
        RequestPolicy(valid_values=(2, 1))
    with pytest.raises(ValidationError, match="step"):
        RequestPolicy(min=0, step=0)


def test_consume_sums_shares_and_refuses_over_capacity() -> None:
    d = share_gpu("n1", "gpu-0")
    first = consume(d, None, {COMPUTE: 60, MEMORY: 10 * GIB})
    assert first == {COMPUTE: 60, MEMORY: 10 * GIB}
    used = Usage().plus(False, first)
    assert consume(d, used, {COMPUTE: 40}) == {COMPUTE: 40, MEMORY: 0}
    assert consume(d, used, {COMPUTE: 41}) is None  # 101 of 100
    assert consume(d, used, {"shares": 1}) is None  # a capacity the device lacks
    assert consume(d, used, {}) is None  # no compute named: the default, all of it


def test_a_whole_device_is_taken_once_and_never_shared() -> None:
    whole = DraDevice("n1", "gpu-0", "gpu", "A100", False, {MEMORY: Capacity(80 * GIB)})
    assert consume(whole, None, {}) == {}
    assert consume(whole, Usage(whole=True), {}) is None
    assert consume(whole, None, {MEMORY: 81 * GIB}) is None  # asks more than it has
    shared = share_gpu("n1", "gpu-1")
    assert consume(shared, Usage(whole=True), {COMPUTE: 1}) is None


def test_nodes_to_find_is_kube_schedulers() -> None:
    assert nodes_to_find(50) == 50
    assert nodes_to_find(1213) == 1213 * 41 // 100
    assert nodes_to_find(10_000) == 500  # the 5% floor
    assert nodes_to_find(150, percentage=10) == 100  # at least 100
    assert nodes_to_find(1213, percentage=100) == 1213


def test_the_window_is_kube_schedulers_search_from_its_rotating_start() -> None:
    """pkg/scheduler/schedule_one.go, findNodesThatPassFilters and schedulePod: the nodes are
    judged from nextStartNodeIndex on, wrapping, until numFeasibleNodesToFind pass; the next
    search starts after the nodes judged (passed or not). Fewer feasible than wanted: every
    node is judged, so the start comes back where it was."""
    every = np.ones(300, dtype=np.bool_)  # 300 nodes: 48% of them, 144
    nodes, nxt = window(every, 250)
    assert nodes.tolist() == list(range(250, 300)) + list(range(94)) and nxt == 94
    even = np.arange(300) % 2 == 0
    nodes, nxt = window(even, 0)
    assert nodes.tolist() == list(range(0, 288, 2)) and nxt == 287  # judged 0..286
    few = np.zeros(300, dtype=np.bool_)
    few[[5, 7, 290]] = True
    nodes, nxt = window(few, 100)
    assert nodes.tolist() == [290, 5, 7] and nxt == 100
    nodes, nxt = window(np.zeros(300, dtype=np.bool_), 17)
    assert nodes.size == 0 and nxt == 17
    assert window(every, 3, percentage=100)[0].size == 300
    assert window(np.ones(60, dtype=np.bool_), 3)[0].size == 60  # below 100 nodes: all


# ---- the default allocator: first fit in slice order ------------------------------------------


def test_default_takes_the_first_fitting_devices_in_slice_order() -> None:
    led = DraLedger([node("n1")], {("n1", "gpu-0"): Usage(consumed={COMPUTE: 70})}, None)
    rng = np.random.default_rng(0)
    dec = led.decide_default(share(50), rng)
    assert dec.placement is not None
    assert [r.device for r in dec.placement.results] == ["gpu-1"]  # gpu-0 has 30 left
    assert dec.placement.results[0].consumed == {COMPUTE: 50, MEMORY: 0}
    two = led.decide_default(share(100, count=2), rng)
    assert two.placement is not None
    assert [r.device for r in two.placement.results] == ["gpu-1", "gpu-2"]  # distinct


def test_default_node_is_the_least_allocated_by_cpu_and_memory() -> None:
    busy = node("a", cpu_used=48_000, memory_used=128 * 1024)
    idle = node("b")
    led = DraLedger([busy, idle], {}, None)
    dec = led.decide_default(share(25), np.random.default_rng(0), cpu_milli=1000,
                             memory_mib=1024)
    assert dec.placement is not None and dec.placement.node == "b"


# ---- ours ------------------------------------------------------------------------------------


def test_ours_fills_a_partly_used_gpu_where_the_default_opens_a_new_one() -> None:
    usage = {("n1", "gpu-2"): Usage(consumed={COMPUTE: 50})}
    led = DraLedger([node("n1")], usage, workload())
    rng = np.random.default_rng(0)
    ours = led.decide(share(50), make_policy("frag-strand"), rng, cpu_milli=4000)
    default = led.decide_default(share(50), rng, cpu_milli=4000)
    assert ours.placement is not None and default.placement is not None
    assert [r.device for r in ours.placement.results] == ["gpu-2"]
    assert [r.device for r in default.placement.results] == ["gpu-0"]
    assert ours.placement.reasons and "milli" in ours.placement.reasons[0]
    assert "frag-strand: node n1 devices n1/gpu-2" in ours.message()


def test_ours_never_picks_what_others_allocated() -> None:
    # gpu-0 taken whole by another claim, gpu-1 nearly full: a 40% share goes elsewhere
    usage = {("n1", "gpu-0"): Usage(whole=True), ("n1", "gpu-1"): Usage(consumed={COMPUTE: 90})}
    led = DraLedger([node("n1", n=2), node("n2", n=1)], usage, workload())
    dec = led.decide(share(40), make_policy("frag-strand"), np.random.default_rng(0))
    assert dec.placement is not None
    assert (dec.placement.node, dec.placement.results[0].device) == ("n2", "gpu-0")


def test_apply_updates_the_arrays_and_a_full_cluster_says_why() -> None:
    led = DraLedger([node("n1", n=1)], {}, workload())
    rng = np.random.default_rng(0)
    pol = make_policy("frag-strand")
    for _ in range(2):
        dec = led.decide(share(50), pol, rng, cpu_milli=1000)
        assert dec.placement is not None
        led.apply(dec.placement, led.slice_request(share(50), 1000, 0))
    assert int(led.arrays.gpu_free[0, 0]) == 0
    assert led.usage[("n1", "gpu-0")].consumed[COMPUTE] == 100
    assert int(led.arrays.cpu_free[0]) == 62_000
    full = led.decide(share(1), pol, rng)
    assert not full.ok and "no device" in full.message()


def test_apply_ignores_devices_it_does_not_know() -> None:
    led = DraLedger([node("n1", n=1)], {}, None)
    dec = led.decide_default(share(10), np.random.default_rng(0))
    assert dec.placement is not None
    other = type(dec.placement)("n1", (DeviceResult("gpu", "elsewhere", "x", True, {}),), 0.0)
    led.apply(other)
    assert int(led.arrays.gpu_free[0, 0]) == 1000


def test_fractions_on_several_devices_are_left_to_the_default_allocator() -> None:
    led = DraLedger([node("n1")], {}, workload())
    dec = led.decide(share(50, count=2), make_policy("frag-strand"), np.random.default_rng(0))
    assert dec.reasons == {REASON_UNSUPPORTED: 1}


def test_model_constraint_is_respected() -> None:
    t4 = DraNode("t4", 32_000, 64 * 1024, (share_gpu("t4", "gpu-0", "T4", 16),))
    led = DraLedger([node("n1", n=1), t4], {}, workload())
    req = DeviceRequest("gpu", 1, {COMPUTE: 10}, models=frozenset({"T4"}))
    dec = led.decide(req, make_policy("frag-strand"), np.random.default_rng(0))
    assert dec.placement is not None and dec.placement.node == "t4"
