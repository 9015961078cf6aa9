"""The simulator's model of the device-plugin path as deployed (sim/deployed.py)."""

from __future__ import annotations

import numpy as np

from gpuslice.core.workload import tune
from gpuslice.sim.default import default_nodes, default_tasks
from gpuslice.sim.deployed import replay_deployed
from gpuslice.sim.engine import bin_run, replay
from gpuslice.sim.runner import Job, run_job, scenario_of


def scenario():  # type: ignore[no-untyped-def]
    return scenario_of("embedded", default_nodes(), default_tasks())


def test_with_the_simulators_assumptions_it_is_exactly_the_plain_replay() -> None:
    """Known workload, CPU-only pods by the policy, the replay's tie order and every node
    scored: the deployed model then makes every decision the plain frag-strand replay makes,
    seed for seed (the composition is the only difference)."""
    from gpuslice.core.policies import make_policy

    sc = scenario()
    for seed in (42, 43):
        rng = np.random.default_rng(seed)
        tasks = tune(sc.tasks, sc.total_gpus * 1000, 1.3, rng)
        state = rng.bit_generator.state
        plain = replay(sc.arrays, tasks, make_policy("frag-strand"), sc.workload, rng,
                       seed=seed)
        rng.bit_generator.state = state
        rank = rng.permutation(sc.arrays.n_nodes)  # what replay() drew first
        model = replay_deployed(sc.arrays, tasks, sc.workload, rng, seed=seed, learn=False,
                                cpu_only_by_policy=True, tie_rank=rank, percentage=100)
        assert (model.placed == plain.placed).all()
        assert (model.allocated == plain.allocated).all()
        assert np.allclose(model.frag, plain.frag)


def test_as_deployed_it_runs_from_the_cli_name_and_never_beats_the_simulator_by_chance(
) -> None:
    """``deployed`` through the runner (as ``gpuslice simulate --deployed`` runs it): a full
    replay with every figure in range, and CPU-only pods left to LeastAllocated cost GPUs on
    the embedded heterogeneous cluster (mean over seeds, as docs/dra-placement.md measures)."""
    sc = scenario()
    ours, deployed = [], []
    for seed in (42, 43, 44, 45):
        a = run_job(sc, Job("ours", seed, 1.3))
        b = run_job(sc, Job("deployed", seed, 1.3))
        assert b.binned.policy == "deployed" and b.tasks == a.tasks
        ours.append(100 - a.binned.alloc[100])
        deployed.append(100 - b.binned.alloc[100])
        assert 0 <= deployed[-1] <= 100
    assert np.mean(deployed) > np.mean(ours)


def test_the_binned_trace_has_the_published_shape() -> None:
    sc = scenario()
    rng = np.random.default_rng(7)
    tasks = tune(sc.tasks, sc.total_gpus * 1000, 1.3, rng)
    binned = bin_run(replay_deployed(sc.arrays, tasks, sc.workload, rng, seed=7))
    assert len(binned.alloc) == 131 and binned.failed >= 0


def test_the_profiles_share_of_nodes_is_part_of_the_policy_name() -> None:
    import pytest

    from gpuslice.sim.deployed import nodes_to_score

    assert nodes_to_score("deployed") == 1  # deploy/'s (tests/deploy)
    assert nodes_to_score("deployed:100") == 100 and nodes_to_score("deployed:35") == 35
    for bad in ("deployed:", "deployed:101", "deployed:-1", "deployed:x"):
        with pytest.raises(ValueError, match="deployed:P"):
            nodes_to_score(bad)
    sc = _uniform(200)  # 100 nodes or more: the share is a window, not every node
    as_deployed = run_job(sc, Job("deployed", 42, 1.3))
    spelled = run_job(sc, Job("deployed:1", 42, 1.3))
    every = run_job(sc, Job("deployed:100", 42, 1.3))
    assert (as_deployed.binned.alloc == spelled.binned.alloc).all()
    assert (as_deployed.binned.alloc != every.binned.alloc).any()


def _uniform(n: int):  # type: ignore[no-untyped-def]
    from gpuslice.core.catalog import resolve
    from gpuslice.core.model import Gpu, Node

    mib = resolve("A100-80GB").memory_mib
    return scenario_of("uniform", [Node(f"n-{i:03d}", 96_000, 768 * 1024, tuple(
        Gpu(j, "A100-80GB", mib) for j in range(8))) for i in range(n)], default_tasks())


def test_below_every_node_the_extender_chooses_inside_kube_schedulers_window() -> None:
    """With percentageOfNodesToScore below 100 kube-scheduler sends the extender only the
    nodes its filters found from its rotating start (200 nodes: 100 of them), so on empty
    identical nodes the choice is the first in the extender's order among those, not among
    all; the next pod's window starts after them."""
    from gpuslice.core.fit import feasible
    from gpuslice.core.model import SliceRequest
    from gpuslice.core.policies import PlacementState, make_policy, tie_order
    from gpuslice.sim.deployed import scheduler_fit, windowed_choice

    sc = _uniform(200)
    st = PlacementState.build(sc.arrays.copy(), sc.workload)
    req = SliceRequest(gpus=1, milli=500, cpu_milli=1000, memory_mib=1024)
    rank = tie_order(st.arrays.names)
    ok, fit = feasible(st.arrays, req), scheduler_fit(st.arrays, req)
    rng = np.random.default_rng(0)
    policy = make_policy("frag-strand")
    found, nxt = windowed_choice(policy, st, req, ok, fit, 0, 0, rng, rank)
    assert found is not None and found.node == int(np.argmin(rank[:100])) and nxt == 100
    found, nxt = windowed_choice(policy, st, req, ok, fit, 0, 100, rng, rank)
    assert found is not None and found.node == int(np.argmin(rank)) and nxt == 0


def test_a_window_whose_gpus_do_not_fit_is_retried_with_the_next() -> None:
    """kube-scheduler counts a node's GPU share as one total, the extender per GPU: where the
    first window's nodes have the milli in total but on no one GPU, the attempt fails there
    and the pod is placed from the next window (as the scheduler's queue tries it again);
    where no node fits at all, the search ends after every node was judged."""
    from gpuslice.core.fit import feasible
    from gpuslice.core.model import SliceRequest
    from gpuslice.core.policies import PlacementState, make_policy, tie_order
    from gpuslice.sim.deployed import scheduler_fit, windowed_choice

    sc = _uniform(200)
    arrays = sc.arrays.copy()
    arrays.gpu_free[:100] = np.where(arrays.gpu_present[:100], 600, 0)  # 4800 milli, 600 a GPU
    st = PlacementState.build(arrays, sc.workload)
    req = SliceRequest(gpus=1, milli=700, cpu_milli=1000, memory_mib=1024)
    ok, fit = feasible(arrays, req), scheduler_fit(arrays, req)
    assert fit[:100].all() and not ok[:100].any()
    rng = np.random.default_rng(0)
    rank = tie_order(arrays.names)
    found, nxt = windowed_choice(make_policy("frag-strand"), st, req, ok, fit, 0, 0, rng, rank)
    assert found is not None and found.node >= 100 and nxt == 0
    big = SliceRequest(gpus=1, milli=700, cpu_milli=200_000, memory_mib=1024)  # no CPU room
    none = scheduler_fit(arrays, big)
    assert not none.any()
    assert windowed_choice(make_policy("frag-strand"), st, big, feasible(arrays, big), none,
                           42, 0, rng, rank) == (None, 42)
    hollow = fit.copy()  # kube-scheduler passes nodes whose GPUs never fit: ends all the same
    found, _ = windowed_choice(make_policy("frag-strand"), st, req, ok & (np.arange(200) < 100),
                               hollow, 0, 0, rng, rank)
    assert found is None
