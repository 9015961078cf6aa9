"""Experiments: load a trace, run policies x seeds (in parallel), write the result files.

The output files have the shape of the FGD authors' published ones (``analysis_allo_discrete.csv``
and friends): one row per (workload, policy, seed) with the columns ``workload, sc_policy, tune,
seed, total_gpus, 0..130``.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpuslice.adapters import outputs
from gpuslice.adapters.traces.alibaba import PodTable, read_nodes, read_pods
from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import TargetWorkload, typical_shapes
from gpuslice.core.model import ClusterArrays, Node, build_arrays
from gpuslice.core.policies import make_policy
from gpuslice.core.workload import Tasks, tune
from gpuslice.sim.engine import BINS, BinnedRun, bin_run, replay


@dataclass(frozen=True)
class Scenario:
    """A cluster, its task list and the target workload derived from the untuned tasks."""

    name: str
    arrays: ClusterArrays
    tasks: Tasks
    workload: TargetWorkload

    @property
    def total_gpus(self) -> int:
        return int(self.arrays.gpu_count.sum())


def tasks_from_table(table: PodTable) -> Tasks:
    return Tasks(table.cpu_milli, table.memory_mib, table.num_gpu, table.gpu_milli,
                 table.spec_id, table.specs)


def scenario_of(name: str, nodes: Sequence[Node], tasks: Tasks) -> Scenario:
    arrays = build_arrays(nodes)
    if int(arrays.gpu_count.sum()) == 0:
        raise ValidationError("nodes", "at least one node with GPUs", 0)
    if int(tasks.total_milli.sum()) == 0:
        raise ValidationError("tasks", "at least one task that asks for a GPU", 0)
    workload = typical_shapes(tasks.shapes(), coverage_pct=95.0, step=1)
    return Scenario(name, arrays, tasks, workload)


def load_scenario(pods: Path, nodes: Path) -> Scenario:
    """Read a pod list and a node list (Alibaba ``openb`` CSV format)."""
    node_list = read_nodes(nodes)
    models = frozenset(nd.model for nd in node_list if nd.model)
    table = read_pods(pods, known_models=models)
    return scenario_of(pods.stem, node_list, tasks_from_table(table))


@dataclass(frozen=True)
class Job:
    policy: str
    seed: int
    tune: float
    tie_order: bool = True


@dataclass(frozen=True)
class JobResult:
    job: Job
    binned: BinnedRun
    seconds: float
    tasks: int


def run_job(scenario: Scenario, job: Job,
            progress: Callable[[int], None] | None = None) -> JobResult:
    """One replay: tune the task list with the seed, submit it under the policy, bin it.
    A DRA mode (:data:`gpuslice.sim.dra.MODES`) replays the DRA path,
    ``deployed`` the device-plugin path as a cluster runs it (:mod:`gpuslice.sim.deployed`;
    ``deployed:P`` with the profile's percentageOfNodesToScore P)."""
    from gpuslice.sim.deployed import is_deployed, nodes_to_score, replay_deployed
    from gpuslice.sim.dra import is_dra, replay_dra

    rng = np.random.default_rng(job.seed)
    tasks = tune(scenario.tasks, scenario.total_gpus * 1000, job.tune, rng)
    start = time.perf_counter()
    if is_dra(job.policy):
        trace = replay_dra(scenario.arrays, tasks, job.policy, scenario.workload, rng,
                           seed=job.seed, progress=progress)
    elif is_deployed(job.policy):
        trace = replay_deployed(scenario.arrays, tasks, scenario.workload, rng,
                                seed=job.seed, progress=progress,
                                percentage=nodes_to_score(job.policy))
    else:
        trace = replay(scenario.arrays, tasks, make_policy(job.policy), scenario.workload,
                       rng, seed=job.seed, progress=progress, tie_order=job.tie_order)
    seconds = time.perf_counter() - start
    return JobResult(job, bin_run(trace), seconds, len(tasks))


def arrival_gap(scenario: Scenario, seed: int, tune_ratio: float, arrived: int = 100) -> \
        str | None:
    """Why a run of ``scenario`` with ``seed`` has no figure at ``arrived`` % of the GPUs
    arrived (its 1% bin and both neighbours empty: :func:`gpuslice.sim.engine.bin_run`), in
    words; ``None`` when it has one. The bins depend on the tuned task list alone, so every
    policy's run of that seed has the gap. On a small cluster one multi-GPU task can step over
    all three bins (8 GPUs of 128 are 6.25%)."""
    tasks = tune(scenario.tasks, scenario.total_gpus * 1000, tune_ratio,
                 np.random.default_rng(seed))
    pct = np.cumsum(tasks.total_milli) / scenario.total_gpus / 10.0
    keys = np.round(pct)
    if (np.abs(keys - arrived) <= 1).any():
        return None
    after = np.flatnonzero(pct > arrived)
    if not len(after):
        return f"its tuned task list ends at {pct[-1]:.1f}% of the GPUs arrived"
    i = int(after[0])
    before = float(pct[i - 1]) if i else 0.0
    k = int(tasks.num_gpu[i])
    return (f"no task arrives between {arrived - 1.5:g}% and {arrived + 1.5:g}% of the GPUs: "
            f"a task of {k} GPU{'s' if k != 1 else ''} takes the arrived demand from "
            f"{before:.1f}% to {float(pct[i]):.1f}%")


_WORKER_SCENARIO: Scenario | None = None


def _init_worker(scenario: Scenario) -> None:
    global _WORKER_SCENARIO  # noqa: PLW0603 - one scenario per worker process
    _WORKER_SCENARIO = scenario


def _worker(job: Job) -> JobResult:
    assert _WORKER_SCENARIO is not None
    return run_job(_WORKER_SCENARIO, job)


@dataclass
class Experiment:
    scenario: Scenario
    policies: Sequence[str]
    seeds: Sequence[int]
    tune: float = 1.3
    tie_order: bool = True
    workers: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))

    def jobs(self) -> list[Job]:
        from gpuslice.sim.deployed import is_deployed, nodes_to_score
        from gpuslice.sim.dra import is_dra

        for p in self.policies:  # validate every name before any work starts
            if is_deployed(p):
                nodes_to_score(p)
            elif not is_dra(p):
                make_policy(p)
        return [Job(p, s, self.tune, self.tie_order) for p in self.policies for s in self.seeds]


def run_experiment(exp: Experiment,
                   on_done: Callable[[JobResult], None] | None = None) -> list[JobResult]:
    """Run every (policy, seed); results come back in job order."""
    jobs = exp.jobs()
    results: dict[Job, JobResult] = {}
    if exp.workers <= 1 or len(jobs) == 1:
        for job in jobs:
            res = run_job(exp.scenario, job)
            results[job] = res
            if on_done:
                on_done(res)
    else:
        with ProcessPoolExecutor(max_workers=min(exp.workers, len(jobs)),
                                 initializer=_init_worker, initargs=(exp.scenario,)) as pool:
            futures = {pool.submit(_worker, job): job for job in jobs}
            for fut in as_completed(futures):
                res = fut.result()
                results[res.job] = res
                if on_done:
                    on_done(res)
    return [results[j] for j in jobs]


HEADER = ["workload", "sc_policy", "tune", "seed", "total_gpus", *[str(b) for b in range(BINS)]]


def _fmt(x: float) -> str:
    return "" if np.isnan(x) else f"{x:.2f}"


def write_results(out: Path, workload: str, results: Sequence[JobResult],
                  also: Mapping[str, Callable[[Path], object]] | None = None,
                  field: str = "--out") -> list[Path]:
    """Write allocation.csv, frag.csv, frag_ratio.csv and summary.json into ``out``, and the
    files of ``also`` (name -> a function writing that file at the path it is given: the
    plot), all or none (:func:`gpuslice.adapters.outputs.write_files`)."""
    files: dict[str, Callable[[BinnedRun], np.ndarray]] = {
        "allocation.csv": lambda b: b.alloc,
        "frag.csv": lambda b: b.frag_amount,
        "frag_ratio.csv": lambda b: b.frag_ratio,
    }

    def table(column: Callable[[BinnedRun], np.ndarray]) -> Callable[[Path], object]:
        def write(path: Path) -> None:
            with path.open("w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(HEADER)
                for r in results:
                    b = r.binned
                    w.writerow([workload, r.job.policy, r.job.tune, r.job.seed, b.total_gpus,
                                *[_fmt(float(v)) for v in column(b)]])
        return write

    summary = json.dumps(summarize(workload, results), indent=2)
    writers: dict[Path, Callable[[Path], object]] = {
        out / name: table(column) for name, column in files.items()}
    writers[out / "summary.json"] = lambda path: path.write_text(summary)
    writers.update({out / name: write for name, write in (also or {}).items()})
    return outputs.write_files(writers, field)


def check_out_dir(out: Path, field: str = "--out") -> Path:
    """Before the replays: ``out`` a folder the result files can be written in
    (:func:`gpuslice.adapters.outputs.check_out_dir`)."""
    return outputs.check_out_dir(out, RESULT_FILES, field)


RESULT_FILES = ("allocation.csv", "frag.csv", "frag_ratio.csv", "summary.json",
                "unallocated.png")


def unallocated_at(results: Sequence[JobResult], policy: str, arrived: int = 100) -> list[float]:
    return [100.0 - float(r.binned.alloc[arrived]) for r in results if r.job.policy == policy]


def summarize(workload: str, results: Sequence[JobResult]) -> dict[str, object]:
    policies = list(dict.fromkeys(r.job.policy for r in results))
    out: dict[str, object] = {"workload": workload, "policies": {}}
    table: dict[str, object] = {}
    for p in policies:
        vals = unallocated_at(results, p)
        secs = [r.seconds for r in results if r.job.policy == p]
        fails = [r.binned.failed for r in results if r.job.policy == p]
        table[p] = {
            "unallocated_pct_at_100": {"mean": float(np.mean(vals)), "sd": float(np.std(vals)),
                                       "per_seed": vals},
            "seconds_per_seed": float(np.mean(secs)),
            "failed_tasks_mean": float(np.mean(fails)),
        }
    out["policies"] = table
    return out
