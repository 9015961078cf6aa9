"""What :mod:`dra_placement` replays a trace on: the :class:`Target` protocol, its
:class:`Outcome`, the simulator's target, and the task mix and nodes of the control-plane target
(:mod:`dra_cluster_target`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from gpuslice.sim.runner import Job, Scenario, load_scenario, run_job, scenario_of

DEVICE_PLUGIN = "ours"  # the device-plugin path's policy in the simulator
# the control-plane target's nodes (the embedded scenario's A100 nodes)
CLUSTER_MODEL, CLUSTER_CPU, CLUSTER_MEM_GIB = "A100-80GB", 96, 768


@dataclass(frozen=True)
class Outcome:
    """One replay: unallocated GPU % at 100% arrived, tasks placed and the seconds they took
    (on the control plane: each bound task's time from creation to bound, summed); the
    replay's wall time and, on the control plane, each bound GPU pod's seconds from its
    creation to bound (issue 58)."""

    unallocated_pct: float
    placed: int
    seconds: float
    wall_s: float = float("nan")
    latencies: tuple[float, ...] = ()
    # with --stages, per bound GPU pod: seconds from its creation until its claim was seen
    # allocated, until the pod was seen without a scheduling gate, and until it was seen bound
    stages: tuple[tuple[float, float, float], ...] = ()

    @property
    def per_second(self) -> float:
        return self.placed / self.seconds if self.seconds > 0 else float("nan")


class Target(Protocol):
    name: str
    modes: tuple[str, ...]

    def replay(self, mode: str, seed: int) -> Outcome:
        """Replay the trace (tuned with ``seed``) with ``mode``: ``default`` (kube-scheduler's
        DRA allocator), ``ours`` (our claim allocator) or ``device-plugin`` (our extender's
        path)."""
        ...


SIM_POLICY = {"default": "dra-default", "ours": "dra-ours", "ours-pinned": "dra-ours-pinned",
              "device-plugin": DEVICE_PLUGIN,
              "device-plugin-model": "deployed", "device-plugin-model-every": "deployed:100"}
PATHS = ("default", "ours", "device-plugin", "device-plugin-sim", "device-plugin-model",
         "device-plugin-model-every", "default-model", "ours-model", "ours-pinned",
         "ours-pinned-model")


class SimTarget:
    """The simulator. ``nodes_to_score``: the ``device-plugin-model`` row's
    ``percentageOfNodesToScore`` (default deploy/'s, kube-scheduler's adaptive share);
    ``device-plugin-model-every`` is that model scoring every node (100)."""

    modes = ("default", "ours", "ours-pinned", "device-plugin", "device-plugin-model",
             "device-plugin-model-every")
    labels: ClassVar[dict[str, str]] = {
        "device-plugin": "device-plugin path, simulator's frag-strand (every pod)"}

    def __init__(self, scenario: Scenario, tune: float = 1.3,
                 nodes_to_score: int | None = None) -> None:
        self.scenario, self.tune = scenario, tune
        self.name = f"simulator, {scenario.name} ({scenario.total_gpus} GPUs)"
        self.policy = dict(SIM_POLICY)
        if nodes_to_score is not None:
            self.policy["device-plugin-model"] = f"deployed:{nodes_to_score}"

    def replay(self, mode: str, seed: int) -> Outcome:
        start = time.perf_counter()
        res = run_job(self.scenario, Job(self.policy[mode], seed, self.tune))
        seconds = time.perf_counter() - start
        return Outcome(100.0 - float(res.binned.alloc[100]), res.tasks - res.binned.failed,
                       seconds, wall_s=seconds)


def kwok_scenario(nodes: int, gpus: int, variant: str | None,
                  mix: str | None = None) -> tuple[list[Any], Scenario, str]:
    """The cluster target's nodes (``nodes`` x ``gpus`` A100s, named as its kwok nodes, so the
    extender's fixed node order is the same), their scenario with the embedded task mix or
    ``variant``'s, made into ``mix`` (:data:`gpuslice.sim.mixes.MIXES`) when one is named, and
    the mix's name."""
    from gpuslice.core.catalog import resolve
    from gpuslice.core.model import Gpu, Node

    mib = resolve(CLUSTER_MODEL).memory_mib
    made = [Node(f"dra-bench-{i:02d}", CLUSTER_CPU * 1000, CLUSTER_MEM_GIB * 1024,
                 tuple(Gpu(j, CLUSTER_MODEL, mib) for j in range(gpus))) for i in range(nodes)]
    tasks, name = task_mix(variant, mix)
    return made, scenario_of(f"{nodes} x {gpus} {CLUSTER_MODEL}", made, tasks), name


def task_mix(variant: str | None, mix: str | None) -> tuple[Any, str]:
    """The embedded task list or trace variant ``variant``'s (GPU-model constraints dropped),
    made into ``mix`` when one is named, and its name for the tables."""
    from gpuslice.sim.default import default_tasks
    from gpuslice.sim.mixes import MIXES, make_mix

    tasks, name = default_tasks(), "embedded task mix"
    if variant:
        tasks, name = variant_tasks(variant), f"task mix of trace variant {variant}"
    if mix and mix != "default":
        like = MIXES[mix].variant if mix in MIXES else ""
        tasks = make_mix(mix, tasks)
        name = f"{mix} mix ({like}-like) of the {name}"
    return tasks, name


def variant_tasks(variant: str) -> Any:
    """The task list of trace variant ``variant`` (found through GPUSLICE_DATA), its GPU-model
    constraints dropped: the benchmark's kwok nodes are all one model."""
    import dataclasses

    from gpuslice.adapters.traces.data import variant_paths

    pods, nodes = variant_paths(variant)
    tasks = load_scenario(pods, nodes).tasks
    return dataclasses.replace(tasks, specs=(frozenset(),) * len(tasks.specs))
