"""``gpuslice simulate``: replay a cluster trace against placement policies."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuslice.cli.common import Sub, add_output, examples, print_json
from gpuslice.cli.flagtypes import parse_policies, parse_seeds
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.policies import ALIASES, policy_names

if TYPE_CHECKING:
    from gpuslice.sim.compare import CompareRow
    from gpuslice.sim.runner import Scenario

EMBEDDED = "embedded"  # --variant: the scenario of sim/default.py, which ships in the package
DEFAULT_POLICIES = ("random", "dotprod", "gpu-clustering", "gpu-packing", "bestfit", "fgd",
                    "ours")


def register(sub: Sub) -> None:
    sim = sub.add_parser(
        "simulate",
        help="replay a cluster trace against placement policies (FGD protocol)",
        description="Replay a task trace against placement policies: tasks arrive one by one "
        "and never leave; metrics in 1% bins of arrived GPU demand. With no --trace it runs "
        "an embedded generated scenario.",
        epilog=examples("gpuslice simulate --variant embedded --policy fgd,ours --out out/",
                        "gpuslice simulate --variant default --seeds 42-51 --compare"))
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="pod list CSV (Alibaba openb format)")
    src.add_argument("--variant", help=f"{EMBEDDED} (the generated scenario shipped with "
                     "gpuslice, as with no --trace) or a variant of the Alibaba GPU trace "
                     "(default, gpushare40, ...: csv/openb_pod_list_VARIANT.csv of "
                     "github.com/alibaba/clusterdata, cluster-trace-gpu-v2023, fetched into "
                     "$GPUSLICE_DATA/traces/alibaba-gpu-v2023/csv; without it the error says "
                     "how)")
    sim.add_argument("--nodes", type=Path, help="node list CSV (with --trace)")
    sim.add_argument("--policy", default=",".join(DEFAULT_POLICIES),
                     help=f"comma-separated policies (default: all); known: "
                     f"{', '.join(n for n in policy_names() if n not in ALIASES)} "
                     f"(and {', '.join(f'{a} = {b}' for a, b in ALIASES.items())}: one policy, "
                     "one row)")
    sim.add_argument("--dra", default=None, metavar="MODES",
                     help="also replay the DRA path: comma-separated default (kube-scheduler's "
                     "allocator, first fit in slice order), ours (our claim allocator), "
                     "ours-pinned (it pinning the pods without claims too: the webhook's "
                     "--gate-cpu-only), ours-all (the policy placing every pod, the workload "
                     "known); run as policies dra-<mode>")
    sim.add_argument("--deployed", action="store_true",
                     help="also replay the device-plugin path as a cluster runs it (policy "
                     "'deployed': the extender's frag-strand with the workload it learns, its "
                     "one-node filter, CPU-only pods on the default scheduler's scores)")
    sim.add_argument("--seeds", default=None, help="seeds, e.g. 42-51 (default: 42-51 for a "
                     f"trace, 42-44 for the embedded scenario; at most {MAX_SEEDS})")
    sim.add_argument("--tune", type=float, default=1.3,
                     help="resize the task list to this multiple of GPU capacity, more than 0 "
                     f"and at most {TUNE_MAX:g} (default 1.3; the metrics stop at 130%% "
                     "arrived)")
    sim.add_argument("--out", type=Path, default=Path("gpuslice-sim"),
                     help="output folder (default ./gpuslice-sim)")
    sim.add_argument("--workers", type=int, default=0, help="processes (default: CPU count)")
    sim.add_argument("--ties", choices=("order", "random"), default="order",
                     help="break score ties by a fixed random node order per seed (as the FGD "
                     "simulator does; default) or uniformly per decision")
    sim.add_argument("--compare", nargs="?", const="auto", default=None, metavar="CSV",
                     help="print the published FGD results beside ours (default: "
                     "analysis_allo_discrete.csv of hkust-adsl/kubernetes-scheduler-simulator "
                     "in $GPUSLICE_DATA/traces/fgd-atc23-expected-results)")
    sim.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    add_output(sim)

    sim.set_defaults(handler=_simulate)


TUNE_MAX = 10.0  # --tune: a few times the capacity is already past the last bin (130%)
MAX_SEEDS = 1000  # --seeds: each one is a replay per policy


def check_tune(x: float) -> float:
    """``--tune``: a finite ratio in (0, TUNE_MAX]: the task list is grown to it, so a huge
    one would never end."""
    if not (math.isfinite(x) and 0 < x <= TUNE_MAX):
        raise ValidationError("--tune", f"a multiple of GPU capacity more than 0 and at most "
                              f"{TUNE_MAX:g}", x)
    return x


def seeds_of(text: str) -> list[int]:
    """``--seeds``, counted before :func:`parse_seeds` makes the list (``1-999999999`` would
    fill the memory first): at most :data:`MAX_SEEDS` seeds."""
    count = 0
    for part in (p.strip() for p in text.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            count += int(hi) - int(lo) + 1 if sep else 1
        except ValueError:
            continue  # parse_seeds says what is wrong with it
        if count > MAX_SEEDS:
            raise ValidationError("--seeds", f"at most {MAX_SEEDS} seeds, like 42-51", text)
    return parse_seeds(text)


def _simulate(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.traces.data import published_results
    from gpuslice.adapters.traces.fgd_results import read_published
    from gpuslice.sim.compare import compare
    from gpuslice.sim.runner import (
        Experiment,
        JobResult,
        check_out_dir,
        run_experiment,
        write_results,
    )

    policies = _policies(args)
    if not args.no_plot:  # a missing matplotlib is said before the replay, not after it
        from gpuslice.adapters.optional import pyplot

        pyplot()
    check_tune(args.tune)  # before the trace is read
    if args.workers < 0:
        raise ValidationError("--workers", "0 (CPU count) or more", args.workers)
    embedded = args.variant in (EMBEDDED, f"builtin:{EMBEDDED}")
    scenario = _scenario(args, embedded)
    from_trace = bool(args.trace or (args.variant and not embedded))
    seeds = seeds_of(args.seeds or ("42-51" if from_trace else "42-44"))
    check_out_dir(args.out, "--out")  # before the replays, not after them
    published = []  # read before the replays: a missing data folder fails at once
    if args.compare is not None:
        path = published_results() if args.compare == "auto" else Path(args.compare)
        published = read_published(path)
    if args.output == "json":  # progress and file names on stderr, the result on stdout
        console = Console(stderr=True)
    exp = Experiment(scenario, policies, seeds, args.tune, args.ties == "order")
    if args.workers:
        exp.workers = args.workers
    console.print(
        f"[bold]{scenario.name}[/]: {scenario.arrays.n_nodes} nodes, {scenario.total_gpus} GPUs, "
        f"{len(scenario.tasks)} tasks, {len(scenario.workload.shapes)} target shapes; "
        f"{len(policies)} policies x {len(seeds)} seeds, tune {args.tune}"
    )
    results: list[JobResult] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        bar = progress.add_task("replaying", total=len(exp.jobs()))

        def done(res: JobResult) -> None:
            results.append(res)
            progress.update(bar, advance=1, description=f"{res.job.policy} seed {res.job.seed}")

        ordered = run_experiment(exp, on_done=done)
    also: dict[str, Callable[[Path], object]] = {}
    if not args.no_plot:
        from gpuslice.sim.plot import plot_unallocated

        title = f"{scenario.name}: unallocated GPU vs arrived workload"
        also["unallocated.png"] = lambda path: plot_unallocated(ordered, path, title)
    written = write_results(args.out, scenario.name, ordered, also, "--out")
    _report(args, console, scenario.name, seeds, compare(scenario.name, ordered, published),
            written)
    return 0


def _policies(args: argparse.Namespace) -> list[str]:
    """The policies to replay: ``--policy``'s, then ``--dra``'s modes, then ``deployed``."""
    policies = parse_policies(args.policy) if args.policy else []
    if args.dra:
        from gpuslice.sim.dra import MODES

        for mode in (m.strip() for m in args.dra.split(",") if m.strip()):
            if f"dra-{mode}" not in MODES:
                raise ValidationError("--dra", "modes from " + ", ".join(
                    m.removeprefix("dra-") for m in MODES), mode)
            policies.append(f"dra-{mode}")
    if args.deployed:
        policies.append("deployed")
    if not policies:
        raise ValidationError("--policy", "at least one policy or a --dra mode", args.policy)
    return policies


def _report(args: argparse.Namespace, console: Console, name: str, seeds: list[int],
            rows: list[CompareRow], written: list[Path]) -> None:
    """The comparison as JSON on stdout (``-o json``) or a table, then the files written."""
    if args.output == "json":
        print_json({"scenario": name, "seeds": seeds, "tune": args.tune,
                    "statistic": "unallocated GPU % at 100% arrived workload, mean and sd "
                    "over seeds",
                    "policies": [{
                        "policy": r.policy, "mean": r.ours_mean,
                        "sd": r.ours_sd, "published_as": r.published_as,
                        "published_mean": r.published_mean, "published_sd": r.published_sd,
                        "diff": r.diff, "seconds_per_seed": round(r.seconds_per_seed, 3)}
                        for r in rows],
                    "files": [str(p) for p in written]})
        for path in written:
            console.print(f"wrote {path}", highlight=False)
        return
    table = Table(title=f"unallocated GPU % at 100% arrived ({len(seeds)} seeds)")
    table.add_column("policy")
    table.add_column("measured mean ± sd", justify="right")  # every policy, run here
    if args.compare is not None:
        table.add_column("published", justify="right")
        table.add_column("published mean ± sd", justify="right")
        table.add_column("diff", justify="right")
    table.add_column("s/seed", justify="right")
    for r in rows:
        cells = [r.policy, f"{r.ours_mean:.2f} ± {r.ours_sd:.2f}"]
        if args.compare is not None:
            if r.published_mean is None or r.published_sd is None or r.diff is None:
                cells += [r.published_as or "-", "-", "-"]
            else:
                cells += [r.published_as or "-", f"{r.published_mean:.2f} ± {r.published_sd:.2f}",
                          f"{r.diff:+.2f}"]
        cells.append(f"{r.seconds_per_seed:.1f}")
        table.add_row(*cells)
    console.print(table)
    for path in written:
        console.print(f"wrote {path}", highlight=False)


def _scenario(args: argparse.Namespace, embedded: bool) -> Scenario:
    """What ``--variant``, ``--trace``/``--nodes`` or neither ask to replay; the files given
    are checked in the order a reader gives them (a missing trace before a missing node list),
    and a variant with no trace here says where the trace comes from."""
    from gpuslice.adapters.traces.data import fetch_hint, trace_variants, variant_paths
    from gpuslice.sim.default import default_nodes, default_tasks
    from gpuslice.sim.runner import load_scenario, scenario_of

    if args.variant and not embedded:
        have = trace_variants()
        if not have:  # no trace here: where it comes from, and how to fetch it
            raise GpusliceError(f"--variant {args.variant}: {fetch_hint(args.variant)} (or "
                                f"--variant {EMBEDDED}: the generated scenario that ships)")
        if args.variant not in have:
            raise ValidationError("--variant", f"{EMBEDDED} (shipped with gpuslice) or the "
                                  f"data folder's {', '.join(have)}", args.variant)
        pods, nodes = variant_paths(args.variant)
        return load_scenario(pods, args.nodes or nodes)
    if args.trace:
        if not args.trace.is_file():  # the file given first, then the one missing
            raise ValidationError("--trace", "a pod list CSV file (Alibaba openb format)",
                                  f"{args.trace}: no such file")
        if args.nodes is None:
            raise ValidationError("--nodes", "a node list CSV to go with --trace", None)
        return load_scenario(args.trace, args.nodes)
    if args.nodes is not None and embedded:
        raise ValidationError("--nodes", f"no node list with --variant {EMBEDDED} (its "
                              "cluster is generated)", str(args.nodes))
    if args.nodes is not None:
        raise ValidationError("--trace", "a pod list CSV to go with --nodes", None)
    return scenario_of("embedded-default", default_nodes(), default_tasks())
