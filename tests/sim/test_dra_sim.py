"""The simulator's DRA path on the embedded scenario: the translation to consumable-capacity
devices is exact when shares are whole percents, and first fit in slice order fragments."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.cli import main
from gpuslice.sim.default import default_nodes, default_tasks
from gpuslice.sim.dra import dra_nodes
from gpuslice.sim.runner import Job, run_job, scenario_of


@pytest.fixture(scope="module")
def scenario():  # type: ignore[no-untyped-def]
    return scenario_of("embedded-default", default_nodes(), default_tasks())


def unallocated(scenario, policy: str, seed: int = 42) -> float:  # type: ignore[no-untyped-def]
    return 100.0 - float(run_job(scenario, Job(policy, seed, 1.3)).binned.alloc[100])


def test_ours_on_dra_devices_matches_the_device_plugin_path(scenario) -> None:  # type: ignore[no-untyped-def]
    # every share of the embedded mix is a whole percent: the same decisions, the same figure
    assert unallocated(scenario, "dra-ours-all") == pytest.approx(unallocated(scenario, "ours"))


def test_default_first_fit_leaves_more_gpu_unallocated(scenario) -> None:  # type: ignore[no-untyped-def]
    default = unallocated(scenario, "dra-default")
    ours = unallocated(scenario, "dra-ours")
    assert default > ours + 2.0, (default, ours)


def test_devices_publish_compute_and_memory_per_gpu(scenario) -> None:  # type: ignore[no-untyped-def]
    nodes = dra_nodes(scenario.arrays)
    assert sum(len(n.devices) for n in nodes) == scenario.total_gpus
    dev = nodes[0].devices[0]
    assert dev.shared and dev.capacity["compute"].value == 100
    assert dev.capacity["memory"].value == 80 * 1024 ** 3  # A100-80GB


def test_cli_runs_the_dra_modes(tmp_path: Path) -> None:
    rc = main(["simulate", "--policy", "", "--dra", "default,ours", "--seeds", "42",
               "--workers", "1", "--no-plot", "--out", str(tmp_path)])
    assert rc == 0
    text = (tmp_path / "allocation.csv").read_text()
    assert ",dra-default," in text and ",dra-ours," in text
    assert main(["simulate", "--dra", "nope", "--out", str(tmp_path)]) == 2


def test_our_allocator_scores_against_the_workload_it_learns_not_the_traces(scenario) -> None:  # type: ignore[no-untyped-def]
    """dra-ours models gpuslice dra-allocator, which cannot know the trace's target workload:
    given another one, it decides exactly as before (the workload only feeds the recorded
    fragmentation); told to use it (learn=False), it decides otherwise."""
    import numpy as np

    from gpuslice.core.frag import Shape, TargetWorkload
    from gpuslice.core.workload import tune
    from gpuslice.sim.dra import replay_dra

    tasks = tune(scenario.tasks, scenario.total_gpus * 1000, 1.3, np.random.default_rng(42))
    other = TargetWorkload.of([Shape(1000, 8, 1000)], [1.0])

    def placed(workload: TargetWorkload, learn: bool = True):  # type: ignore[no-untyped-def]
        run = replay_dra(scenario.arrays, tasks, "dra-ours", workload,
                         np.random.default_rng(42), learn=learn)
        return run.allocated

    learned = placed(scenario.workload)
    assert np.array_equal(learned, placed(other))
    assert not np.array_equal(placed(scenario.workload, learn=False),
                              placed(other, learn=False))


def test_cpu_only_pods_by_the_policy_make_the_allocator_place_as_dra_ours_all(scenario) -> None:  # type: ignore[no-untyped-def]
    """cpu_only_by_policy: dra-ours places the CPU-only pods with the policy too; with the
    workload known and dra-ours-all's tie order that is dra-ours-all, decision for decision;
    without it they go to kube-scheduler's scores and some land elsewhere."""
    import numpy as np

    from gpuslice.core.workload import tune
    from gpuslice.sim.dra import replay_dra

    tasks = tune(scenario.tasks, scenario.total_gpus * 1000, 1.3, np.random.default_rng(43))

    def run(mode: str, **kw: object):  # type: ignore[no-untyped-def]
        return replay_dra(scenario.arrays, tasks, mode, scenario.workload,
                          np.random.default_rng(43), **kw)

    every = run("dra-ours-all")
    drawn = np.random.default_rng(43).permutation(scenario.arrays.n_nodes)  # its tie order
    both = run("dra-ours", learn=False, cpu_only_by_policy=True, tie_rank=drawn)
    assert np.array_equal(both.placed, every.placed)
    assert np.array_equal(both.allocated, every.allocated)
    assert np.allclose(both.frag, every.frag)
    assert not np.allclose(run("dra-ours", learn=False, tie_rank=drawn).frag, every.frag)


def test_the_allocator_model_breaks_ties_in_the_extenders_fixed_order(scenario) -> None:  # type: ignore[no-untyped-def]
    """dra-ours ties as gpuslice dra-allocator does (the ledger's rank: core tie_order of the
    node names, the extender's order), not in the random order dra-ours-all draws."""
    import numpy as np

    from gpuslice.core.dra_placement import DraLedger
    from gpuslice.core.policies import tie_order
    from gpuslice.core.workload import tune
    from gpuslice.sim.dra import dra_nodes, replay_dra

    ledger = DraLedger(dra_nodes(scenario.arrays, 100), {}, None)
    assert np.array_equal(ledger.rank, tie_order([n.name for n in ledger.nodes]))
    tasks = tune(scenario.tasks, scenario.total_gpus * 1000, 1.3, np.random.default_rng(44))

    def run(**kw: object):  # type: ignore[no-untyped-def]
        return replay_dra(scenario.arrays, tasks, "dra-ours", scenario.workload,
                          np.random.default_rng(44), **kw)

    own = run()
    assert np.array_equal(run(tie_rank=ledger.rank).placed, own.placed)
    drawn = np.random.default_rng(44).permutation(scenario.arrays.n_nodes)
    assert not np.allclose(run(tie_rank=drawn).frag, own.frag)
