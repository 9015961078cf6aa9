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
    """Known workload, CPU-only pods by the policy and the replay's tie order: the deployed
    model then makes every decision the plain frag-strand replay makes, seed for seed (the
    composition is the only difference)."""
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
                                cpu_only_by_policy=True, tie_rank=rank)
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
