"""Placement robustness matrix (issue 59): every placement path against DRA first fit and FGD,
on clusters of identical GPU nodes of every size, mixed clusters and the full Alibaba trace,
for every task mix, in the simulator.

Cells are a cluster x a task mix. The task mixes are made from the Alibaba trace's ``default``
task list the way the FGD paper's variants are made (``gpuslice.sim.mixes``: sharing-heavy like
``gpushare80``, whole-GPU-heavy like ``gpushare10``, multi-GPU-heavy like ``multigpu50``,
CPU-heavy like ``cpu250``). In each cell, per seed, the same tuned task list (FGD's protocol,
tune 1.3) goes through every path:

* ``first-fit``: kube-scheduler's DRA allocation (its window and spreading scores, the first
  fitting devices in slice order; ``sim.dra``'s ``dra-default``), the baseline;
* ``fgd``: FGD placing every pod (the published policy, re-implemented);
* ``packing``: ``frag-strand`` as it was before issue 59 (``spread=0``), every pod;
* ``ours``: ``frag-strand`` placing every pod against the trace's target workload (the
  simulator's policy);
* ``device-plugin``: the device-plugin path as deployed (``sim.deployed``: the extender's
  ``frag-strand`` with the workload it learns, kube-scheduler's window, CPU-only pods to the
  default scheduler);
* ``allocator``: the DRA claim allocator (``sim.dra``'s ``dra-ours``: ``frag-strand`` with the
  workload it learns, CPU-only pods to kube-scheduler);
* ``allocator-pinned``: the allocator with the webhook's ``--gate-cpu-only`` (``sim.dra``'s
  ``dra-ours-pinned``: the CPU-only pods placed by it too, and pinned to their node).

It prints, per cell, each path's mean unallocated GPU % at 100% arrived and the paired per-seed
differences (mean ± standard error) to first fit and to FGD, then the issue's goals, and writes
the JSON of every run (``--json``, which ``--resume`` reuses), the tables into a markdown file
(``--doc``, between generated-section markers) and a plot (``--plot``). A seed whose tuned task
list has no figure at 100% arrived (one multi-GPU task stepping over the bins on a small
cluster, ``sim.runner.arrival_gap``) is left out of its cell with a note. ``--cluster-json``
adds a sample from the real control plane (``dra_placement.py --cluster --json``) beside the
simulator's figures for the same cells, its simulator rows replayed again by the simulator as
it is now (``remodel``).

    python benchmarks/placement_matrix.py --json bench-out/matrix.json \\
        --doc docs/dra-placement.md --plot docs/placement-matrix.png     # about 20 min, 2 cores
    python benchmarks/placement_matrix.py --clusters 16x8 --mixes default --seeds 42-45
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gpuslice.cli import parse_seeds
from gpuslice.sim.mixes import MIXES
from gpuslice.sim.runner import Scenario
from placement_report import Cell, report, write_doc, write_plot

# (GPU model, nodes, GPUs a node, vCPU, memory GiB); "trace": the Alibaba trace's 1,213 nodes
NodeGroup = tuple[str, int, int, int, int]
A100 = ("A100-80GB", 8, 96, 768)  # the control-plane target's nodes (dra_targets)
CLUSTERS: dict[str, tuple[NodeGroup, ...] | str] = {
    **{f"{n}x8": ((A100[0], n, A100[1], A100[2], A100[3]),) for n in (8, 16, 64, 256)},
    # two models, 8- and 4-GPU nodes, the same 12 cores a GPU
    "mixed-a": (("A100-80GB", 16, 8, 96, 768), ("T4", 16, 4, 48, 192)),
    # three models, fewer cores a GPU on the big nodes
    "mixed-b": (("H100-SXM", 8, 8, 128, 1024), ("A100-80GB", 16, 8, 96, 768),
                ("V100M32", 16, 4, 48, 368)),
    # CPU-rich 4-GPU nodes beside 8-GPU ones, as the trace's T4 nodes are
    "mixed-c": (("A100-80GB", 16, 8, 96, 768), ("T4", 16, 4, 96, 384)),
    "trace": "trace",
}
SMALL = 16  # clusters of at most this many nodes get --small-seeds (their seeds differ most)


@dataclass(frozen=True)
class PathSpec:
    key: str
    label: str
    policy: str  # a simulator policy name, or "packing"


PATHS = (
    PathSpec("first-fit", "DRA first fit (kube-scheduler)", "dra-default"),
    PathSpec("fgd", "FGD (every pod)", "fgd"),
    PathSpec("packing", "frag-strand before issue 59 (every pod)", "packing"),
    PathSpec("ours", "frag-strand (every pod, the simulator's policy)", "ours"),
    PathSpec("device-plugin", "device-plugin path as deployed (model)", "deployed"),
    PathSpec("allocator", "DRA claim allocator (model)", "dra-ours"),
    PathSpec("allocator-pinned", "DRA claim allocator pinning CPU-only pods (model)",
             "dra-ours-pinned"),
)
BY_KEY = {p.key: p for p in PATHS}


def node_count(cluster: str) -> int:
    spec = CLUSTERS[cluster]
    return 1213 if spec == "trace" else sum(g[1] for g in spec)


# the simulator's rows of a control-plane sample, and the simulator's path each one replays
MODEL_ROWS = {"default-model": "default", "ours-model": "ours",
              "ours-pinned-model": "ours-pinned", "device-plugin-model": "device-plugin-model"}


def remodel(run: dict[str, Any]) -> dict[str, Any]:
    """A control-plane sample (``dra_placement.py --cluster --json``) with its simulator rows
    replayed again by the simulator as it is now, seed for seed: the control plane's figures
    are measurements and stay, the models move with the code. A sample without its
    ``scenario`` (written before it was recorded) or of a burst keeps the rows it has."""
    spec = run.get("scenario")
    if not isinstance(spec, dict) or spec.get("burst"):
        return run
    from dra_targets import SimTarget, kwok_scenario

    _, scen, _ = kwok_scenario(spec["nodes"], spec["gpus"], spec["variant"], spec["mix"])
    sim = SimTarget(scen, spec["tune"], spec["nodes_to_score"])
    got = {row: dict(seeds) for row, seeds in run["unallocated"].items()}
    for row, mode in MODEL_ROWS.items():
        if row in got:
            got[row] = {s: round(sim.replay(mode, int(s)).unallocated_pct, 4) for s in got[row]}
    return {**run, "unallocated": got}


# -- scenarios and runs (in worker processes) ---------------------------------------------

_SCENARIOS: dict[tuple[str, str], Scenario] = {}


def scenario(cluster: str, mix: str) -> Scenario:
    """The cell's scenario (built once per process): the cluster's nodes and the default
    trace's task list made into ``mix``."""
    key = (cluster, mix)
    if key not in _SCENARIOS:
        from gpuslice.adapters.traces.data import variant_paths
        from gpuslice.sim.mixes import scenario_with_mix
        from gpuslice.sim.runner import load_scenario, scenario_of

        base = _SCENARIOS.get(("trace", "default"))
        if base is None:
            base = _SCENARIOS[("trace", "default")] = load_scenario(*variant_paths("default"))
        spec = CLUSTERS[cluster]
        if spec != "trace":
            assert not isinstance(spec, str)
            base = scenario_of(cluster, made_nodes(spec), base.tasks)
        _SCENARIOS[key] = scenario_with_mix(base, mix)
    return _SCENARIOS[key]


def made_nodes(groups: tuple[NodeGroup, ...]) -> list[object]:
    from gpuslice.core.catalog import resolve
    from gpuslice.core.model import Gpu, Node

    out: list[object] = []
    for model, count, gpus, cpu, mem in groups:
        mib = resolve(model).memory_mib
        out += [Node(f"{model.lower()}-{i:03d}", cpu * 1000, mem * 1024,
                     tuple(Gpu(j, model, mib) for j in range(gpus))) for i in range(count)]
    return out


def run_one(job: tuple[str, str, str, int, float]) -> tuple[tuple[str, str, str, int], float,
                                                             float]:
    """One replay: (cluster, mix, path, seed) -> unallocated GPU % at 100% arrived, seconds."""
    cluster, mix, path, seed, tune = job
    sc = scenario(cluster, mix)
    start = time.perf_counter()
    policy = BY_KEY[path].policy
    if policy == "packing":
        from gpuslice.core.policies import FragStrandPolicy
        from gpuslice.core.workload import tune as tuned
        from gpuslice.sim.engine import bin_run, replay

        rng = np.random.default_rng(seed)
        tasks = tuned(sc.tasks, sc.total_gpus * 1000, tune, rng)
        binned = bin_run(replay(sc.arrays, tasks, FragStrandPolicy(spread=0), sc.workload, rng,
                                seed=seed))
    else:
        from gpuslice.sim.runner import Job, run_job

        binned = run_job(sc, Job(policy, seed, tune)).binned
    return (cluster, mix, path, seed), 100.0 - float(binned.alloc[100]), \
        time.perf_counter() - start


def gaps(cluster: str, mix: str, seeds: list[int], tune: float) -> dict[int, str]:
    from gpuslice.sim.runner import arrival_gap

    sc = scenario(cluster, mix)
    out = {}
    for s in seeds:
        why = arrival_gap(sc, s, tune)
        if why is not None:
            out[s] = why
    return out


# -- the run ------------------------------------------------------------------------------

Runs = dict[str, dict[str, dict[str, float]]]  # "cluster/mix" -> path -> str(seed) -> %


def run_all(cells: list[tuple[str, str]], paths: list[str], seeds_of: Callable[[str], list[int]],
            tune: float, workers: int, runs: Runs, save: Callable[[], None],
            console: Console) -> dict[str, dict[int, str]]:
    """Every (cell, path, seed) not in ``runs`` yet, ``workers`` at a time, saved as they
    come; returns the seeds left out per cell, with why."""
    left_out: dict[str, dict[int, str]] = {}
    jobs = []
    for cluster, mix in cells:
        key = f"{cluster}/{mix}"
        seeds = seeds_of(cluster)
        left_out[key] = gaps(cluster, mix, seeds, tune)
        done = runs.setdefault(key, {})
        for p in paths:
            for s in seeds:
                if s not in left_out[key] and str(s) not in done.get(p, {}):
                    jobs.append((cluster, mix, p, s, tune))
    # the slow cells first, so that the two workers finish together
    jobs.sort(key=lambda j: -node_count(j[0]))
    console.print(f"{len(jobs)} replays to run ({workers} worker(s))")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("replays", total=len(jobs))
        last_save = time.monotonic()

        step, count = max(len(jobs) // 50, 1), 0

        def done_one(key: tuple[str, str, str, int], value: float, secs: float) -> None:
            nonlocal last_save, count
            cluster, mix, path, seed = key
            runs[f"{cluster}/{mix}"].setdefault(path, {})[str(seed)] = round(value, 4)
            what = f"{cluster}/{mix} {path} {seed}: {value:.2f}% ({secs:.0f} s)"
            bar.update(task, advance=1, description=what)
            count += 1
            if not console.is_terminal and count % step == 0:  # a log file: a line every 2%
                console.print(f"{count}/{len(jobs)} replays; last {what}")
            if time.monotonic() - last_save > 30:
                save()
                last_save = time.monotonic()

        if workers <= 1:
            for j in jobs:
                done_one(*run_one(j))
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                for fut in as_completed([pool.submit(run_one, j) for j in jobs]):
                    done_one(*fut.result())
    save()
    return left_out


def cells_of(runs: Runs, cells: list[tuple[str, str]], paths: list[str],
             left_out: dict[str, dict[int, str]]) -> list[Cell]:
    out = []
    for cluster, mix in cells:
        key = f"{cluster}/{mix}"
        got = runs.get(key, {})
        seeds = sorted({int(s) for p in paths for s in got.get(p, {})} - set(left_out[key]))
        # a seed some path lacks (an interrupted run), or whose figure is missing, is left out
        notes = dict(left_out[key])
        for s in seeds:
            missing = [p for p in paths if not math.isfinite(got.get(p, {}).get(str(s),
                                                                            math.nan))]
            if missing:
                notes[s] = f"no figure from {', '.join(missing)}"
        seeds = [s for s in seeds if s not in notes]
        values = {p: np.array([got[p][str(s)] for s in seeds]) for p in paths}
        out.append(Cell(cluster, mix, node_count(cluster), seeds, values, notes))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", default=",".join(CLUSTERS),
                    help=f"comma-separated, of {', '.join(CLUSTERS)}")
    ap.add_argument("--mixes", default=",".join(MIXES),
                    help=f"comma-separated, of {', '.join(MIXES)}")
    ap.add_argument("--paths", default=",".join(p.key for p in PATHS),
                    help=f"comma-separated, of {', '.join(p.key for p in PATHS)} (first-fit "
                    "and fgd are the baselines)")
    ap.add_argument("--seeds", default="42-51", help="seeds of the larger clusters")
    ap.add_argument("--small-seeds", default="42-61",
                    help=f"seeds of clusters of at most {SMALL} nodes (their seeds differ by "
                    "10 points: twice the seeds halve the paired standard error's square)")
    ap.add_argument("--tune", type=float, default=1.3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="every replay's figure, written as they come")
    ap.add_argument("--resume", action="store_true",
                    help="keep the figures --json already holds and run only the rest")
    ap.add_argument("--doc", type=Path, default=None, metavar="MD",
                    help="write the tables into MD (between the generated-section markers)")
    ap.add_argument("--plot", type=Path, default=None, metavar="PNG")
    ap.add_argument("--cluster-json", type=Path, action="append", default=[], metavar="FILE",
                    help="a control-plane sample (dra_placement.py --cluster --mix M --json "
                    "FILE) to show beside the simulator's figures; repeatable")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 140))
    clusters = [c for c in args.clusters.split(",") if c]
    mixes = [m for m in args.mixes.split(",") if m]
    paths = [p for p in args.paths.split(",") if p]
    for name, got, known in (("--clusters", clusters, CLUSTERS), ("--mixes", mixes, MIXES),
                             ("--paths", paths, BY_KEY)):
        bad = [x for x in got if x not in known]
        if bad or not got:
            raise SystemExit(f"placement_matrix: {name} takes {', '.join(known)}; got "
                             f"{', '.join(bad) or 'nothing'}")
    for base in ("first-fit", "fgd"):
        if base not in paths:
            raise SystemExit(f"placement_matrix: --paths needs {base}, the baseline")
    if args.resume and args.json is None:
        raise SystemExit("placement_matrix: --resume needs --json")
    seeds, small = parse_seeds(args.seeds), parse_seeds(args.small_seeds)
    from gpuslice.adapters.traces.data import require_data_dir

    require_data_dir()  # the default trace's task list is every cell's
    runs: Runs = {}
    if args.resume and args.json.exists():
        runs = json.loads(args.json.read_text()).get("runs", {})

    def save() -> None:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"tune": args.tune, "runs": runs}, indent=1))

    cells = [(c, m) for c in clusters for m in mixes]
    started = time.monotonic()
    left_out = run_all(cells, paths, lambda c: small if node_count(c) <= SMALL else seeds,
                       args.tune, args.workers, runs, save, console)
    table = cells_of(runs, cells, paths, left_out)
    sample = [remodel(json.loads(f.read_text())) for f in args.cluster_json]
    text, ok = report(table, paths, {p.key: p.label for p in PATHS}, sample, console)
    console.print(f"{time.monotonic() - started:.0f} s")
    if args.doc is not None:
        write_doc(args.doc, text)
    if args.plot is not None:
        write_plot(args.plot, table, paths, {p.key: p.label for p in PATHS})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
