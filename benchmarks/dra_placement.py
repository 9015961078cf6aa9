"""DRA placement benchmark: default first-fit allocation against our claim allocator.

Issue 21's acceptance figures, measured on one trace: the unallocated GPU share at 100% arrived
workload (FGD's metric) for kube-scheduler's default DRA allocation, for ours, and for our
device-plugin path on the same trace, plus scheduling throughput (claims placed per second)
of the default path and ours. Gates, printed as pass/fail:

* ours within 0.3 percentage points of the device-plugin path;
* ours clearly better than default first fit (at least 1 point, and outside both spreads);
* our throughput at least 50% of the default's.

It is written against :class:`Target`, one trace replay on some cluster:

* ``--sim`` (works today): :class:`SimTarget` replays the trace through the simulator's DRA
  path (``gpuslice.sim.dra``): the default mode models kube-scheduler's node window and scores
  and the allocator's first fit in slice order; ours is the same decision function the
  ``gpuslice dra-allocator`` controller runs. Throughput is decisions per second of the
  placement code alone (no API server), so it bounds what the control plane can reach.
* ``--cluster [--binaries DIR]``: :class:`ClusterTarget` starts the real control plane of
  the cluster tier (kube-apiserver, kube-scheduler with DRAConsumableCapacity and
  DRADeviceTaints, kwok nodes publishing our ResourceSlices) and replays a modest trace on
  it, with kube-scheduler's allocator alone, with ``gpuslice dra-allocator`` running, and
  through the device-plugin path as deployed (the ``gpuslice-scheduler`` profile of
  deploy/base calling ``gpuslice extender``; the simulator's figure for that path is printed
  beside it).
  As FGD's protocol says, tasks are submitted one by one, each decided (bound, or
  unschedulable for SETTLE_S) before the next; throughput is then tasks bound per second of
  their creation-to-bound time (a latency). ``--burst`` creates every task at once instead and
  measures throughput as tasks bound per second of the whole burst; its unallocated figure is
  not FGD's (claim-less pods race our claims for CPU).
  Binaries: ``$GPUSLICE_CLUSTER_BIN`` or ``tools/cluster/build.sh --bin-dir``.

    python benchmarks/dra_placement.py --sim                       # embedded scenario
    python benchmarks/dra_placement.py --sim --variant default --seeds 42-44
    python benchmarks/dra_placement.py --cluster --seeds 42-44     # about 8 min on 2 cores
    python benchmarks/dra_placement.py --cluster --burst --seeds 42-44
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from dra_cluster_target import ClusterTarget
from dra_targets import PATHS, Outcome, SimTarget, Target, kwok_scenario, task_mix
from gpuslice.cli import parse_seeds
from gpuslice.sim.mixes import MIXES
from gpuslice.sim.runner import arrival_gap, load_scenario, scenario_of


def pm(mean: float, se: float) -> str:
    """``+m ± se``, or ``+m (one seed)`` where a standard error cannot be had."""
    return f"{mean:+.2f} (one seed)" if math.isnan(se) else f"{mean:+.2f} ± {se:.2f}"


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of the per-seed differences ``a - b``."""
    d = np.array(a) - np.array(b)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()), se


def quantile(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of sorted ``xs``."""
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def timing(rows: dict[str, list[Outcome]]) -> dict[str, tuple[float, float, float, int]]:
    """Per path with per-pod latencies (the control plane's): the replays' wall time summed
    over the seeds, and the p50 and p99 of every bound GPU pod's created-to-bound seconds
    (all seeds pooled), and how many pods that is (issue 58)."""
    out = {}
    for mode, outs in rows.items():
        lat = sorted(x for o in outs for x in o.latencies)
        if lat:
            out[mode] = (sum(o.wall_s for o in outs), quantile(lat, 0.5), quantile(lat, 0.99),
                         len(lat))
    return out


def print_stages(rows: dict[str, list[Outcome]], labels: dict[str, str],
                 console: Console) -> None:
    """With ``--stages``: per path, when (p50 / p99 ms after its creation) each bound GPU
    pod's claim was seen allocated, the pod seen without a scheduling gate (for a pod created
    without one: seen at all), and the pod seen bound, all seeds pooled."""
    table = Table(title="where a pod's time goes (ms after its creation, p50 / p99, as a "
                  "watch sees it; --stages)")
    for col in ("path", "claim allocated", "pod ungated", "pod bound", "pods"):
        table.add_column(col, justify="right" if col != "path" else "left")
    for mode, outs in rows.items():
        st = [x for o in outs for x in o.stages]
        if not st:
            continue
        cols = [sorted(x[i] for x in st) for i in range(3)]
        table.add_row(labels.get(mode, mode), *(
            f"{quantile(c, 0.5) * 1e3:.0f} / {quantile(c, 0.99) * 1e3:.0f}" for c in cols),
            str(len(st)))
    if table.row_count:
        console.print(table)


def timing_gates(times: dict[str, tuple[float, float, float, int]],
                 labels: dict[str, str]) -> list[tuple[str, bool, str]]:
    """Issue 58's goals: our allocator's created-to-bound p99 and its one-by-one replay's
    wall time each within 1.5x of kube-scheduler's own DRA allocation."""
    if "ours" not in times or "default" not in times:
        return []
    (ow, _, op99, _), (dw, _, dp99, _) = times["ours"], times["default"]
    return [(f"{labels['ours']}: created-to-bound p99 within 1.5x of "
             f"{labels['default']}'s", op99 <= 1.5 * dp99,
             f"{op99 * 1e3:.0f} ms against {dp99 * 1e3:.0f} ({op99 / dp99:.2f}x)"),
            (f"{labels['ours']}: one-by-one replay's wall time within 1.5x of "
             f"{labels['default']}'s", ow <= 1.5 * dw,
             f"{ow:.0f} s against {dw:.0f} ({ow / dw:.2f}x)")]


def with_figures(target: Target, seeds: list[int], tune: float) -> tuple[list[int], list[str]]:
    """The seeds whose tuned task list has a figure at 100% arrived, and a note for each seed
    left out (:func:`gpuslice.sim.runner.arrival_gap`: on a small cluster one multi-GPU task
    can step over the 1% bins around 100%, and then no path has a figure: NaN)."""
    scenario = getattr(target, "scenario", None)
    keep, notes = [], []
    for seed in seeds:
        why = None if scenario is None else arrival_gap(scenario, seed, tune)
        if why is None:
            keep.append(seed)
        else:
            notes.append(f"seed {seed} left out: {why}, so no path has a figure at 100% "
                         "arrived")
    return keep, notes


def replay_seeds(target: Target, rows: dict[str, list[Outcome]], seeds: list[int],
                 notes: list[str], console: Console
                 ) -> tuple[list[int], dict[str, list[Outcome]], list[str]]:
    """Replay every path of ``rows`` on every seed, then leave out each seed some path has no
    figure for (a NaN: for no reason known beyond :func:`with_figures`'), with a note, so that
    no NaN reaches the statistics. Returns the seeds kept, their outcomes and every note."""
    for note in notes:
        console.print(f"[yellow]{note}[/]")
    for seed in seeds:
        for mode, outs in rows.items():
            t0 = time.monotonic()
            outs.append(target.replay(mode, seed))
            console.print(f"seed {seed} {mode}: {outs[-1].unallocated_pct:.2f}% unallocated "
                          f"({time.monotonic() - t0:.0f} s)")
    keep = []
    for i, seed in enumerate(seeds):
        missing = [m for m, outs in rows.items() if math.isnan(outs[i].unallocated_pct)]
        if missing:
            notes = [*notes, f"seed {seed} left out: no figure at 100% arrived from "
                     f"{', '.join(missing)}"]
            console.print(f"[yellow]{notes[-1]}[/]")
        else:
            keep.append(i)
    return ([seeds[i] for i in keep], {m: [outs[i] for i in keep] for m, outs in rows.items()},
            notes)


def run(target: Target, seeds: list[int], console: Console,
        only: list[str] | None = None, json_out: Path | None = None,
        doc: Path | None = None, doc_key: str = "main", tune: float = 1.3) -> int:
    rows: dict[str, list[Outcome]] = {m: [] for m in target.modes if not only or m in only}
    # in the simulator the device-plugin row is frag-strand itself, not the deployed path
    labels = {**LABELS, **getattr(target, "labels", {})}
    seeds, notes = with_figures(target, seeds, tune)
    seeds, rows, notes = replay_seeds(target, rows, seeds, notes, console)
    if not seeds:
        console.print("[red]no seed left with a figure at 100% arrived[/]")
        return 1
    unalloc = {m: [o.unallocated_pct for o in outs] for m, outs in rows.items()}
    if json_out is not None:
        json_out.write_text(json.dumps({"unallocated": {
            m: {str(s): round(v, 4) for s, v in zip(seeds, vals, strict=True)}
            for m, vals in unalloc.items()}, "target": target.name,
            "scenario": getattr(target, "spec", None)}, indent=1) + "\n")
    table = Table(title=f"DRA placement: {target.name}, seeds {seeds[0]}-{seeds[-1]}")
    for col in ("path", "unallocated GPU % at 100% arrived", "tasks placed / s", "vs default"):
        table.add_column(col, justify="right" if col != "path" else "left")
    stats = {}
    for mode, outs in rows.items():
        u = np.array(unalloc[mode])
        rate = float(np.mean([o.per_second for o in outs]))
        stats[mode] = (float(u.mean()), float(u.std()), rate)
    base_rate = stats["default"][2] if "default" in stats else float("nan")
    for mode, (mean, sd, rate) in stats.items():
        table.add_row(labels.get(mode, mode), f"{mean:.2f} ± {sd:.2f}", f"{rate:,.0f}",
                      "-" if math.isnan(base_rate) else f"{rate / base_rate:.2f}x")
    console.print(table)
    times = timing(rows)
    if times:
        ttable = Table(title="time per path (wall time of the replays, all seeds; each bound "
                       "GPU pod's created-to-bound, all seeds pooled)")
        for col in ("path", "wall s", "created-to-bound p50 ms", "p99 ms", "pods"):
            ttable.add_column(col, justify="right" if col != "path" else "left")
        for mode, (wall, p50, p99, n) in times.items():
            ttable.add_row(labels.get(mode, mode), f"{wall:.0f}", f"{p50 * 1e3:.0f}",
                           f"{p99 * 1e3:.0f}", str(n))
        console.print(ttable)
    print_stages(rows, labels, console)
    # the simulator's frag-strand placing every pod: the figure each deployed path should reach
    ref = "device-plugin-sim" if "device-plugin-sim" in unalloc else "device-plugin"
    pairs = [(a, b) for a, b in (("device-plugin", ref), ("ours", ref), ("ours-pinned", ref),
                                 ("device-plugin-model", ref), ("device-plugin",
                                                                "device-plugin-model"),
                                 ("device-plugin-model", "device-plugin-model-every"),
                                 ("default", "default-model"), ("ours", "ours-model"),
                                 ("ours-pinned", "ours-pinned-model"),
                                 ("default", "device-plugin"), ("default", "ours"),
                                 ("default", "ours-pinned"), ("ours", "ours-pinned"))
             if a in unalloc and b in unalloc and a != b]
    ptable = Table(title=f"paired per-seed differences (points of unallocated GPU, "
                   f"{len(seeds)} seeds, mean ± standard error)")
    ptable.add_column("difference")
    ptable.add_column("mean ± SE", justify="right")
    diffs = {}
    for a, b in pairs:
        diffs[(a, b)] = paired(unalloc[a], unalloc[b])
        m, se = diffs[(a, b)]
        ptable.add_row(f"{labels.get(a, a)} - {labels.get(b, b)}", pm(m, se))
    console.print(ptable)
    gates = []
    for path in ("device-plugin", "ours", "ours-pinned"):
        if (path, ref) in diffs:
            m, se = diffs[(path, ref)]
            gates.append((f"{labels[path]} within 0.3 points of the simulator's frag-strand "
                          "(paired mean)", abs(m) <= 0.3, pm(m, se)))
    for path in ("device-plugin", "ours", "ours-pinned"):
        if ("default", path) in diffs:
            m, se = diffs[("default", path)]
            gates.append((f"{labels[path]} better than DRA first fit by more than 2 SE",
                          not math.isnan(se) and m > 2 * se, f"{m:+.2f} (2 SE = {2 * se:.2f})"))
    if "ours" in stats and "default" in stats and not math.isnan(base_rate):
        gates.append(("our DRA throughput >= 50% of the default's",
                      stats["ours"][2] >= 0.5 * base_rate,
                      f"{stats['ours'][2] / base_rate:.2f}x"))
    gates += timing_gates(times, labels)
    for label, ok, value in gates:
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {label}: "
                      f"{value}")
    if doc is not None:
        write_doc(doc, target.name, seeds, unalloc, diffs, gates, doc_key, labels, notes,
                  times)
    return 0 if all(ok for _, ok, _ in gates) else 1


LABELS = {"default": "DRA first fit (kube-scheduler)", "ours": "DRA, our claim allocator",
          "device-plugin": "device-plugin path as deployed",
          "device-plugin-sim": "simulator, frag-strand (every pod)",
          "device-plugin-model": "simulator, deployed model",
          "device-plugin-model-every": "simulator, deployed model, every node scored",
          "default-model": "simulator, DRA first fit", "ours-model": "simulator, claim allocator",
          "ours-pinned": "DRA, our claim allocator pinning CPU-only pods",
          "ours-pinned-model": "simulator, claim allocator pinning CPU-only pods"}
def doc_markers(key: str) -> tuple[str, str]:
    """The comments around a generated section (``--doc-key`` names one of several)."""
    tag = "--doc" if key == "main" else f"--doc {key}"
    return (f"<!-- generated by benchmarks/dra_placement.py {tag}: start -->",
            f"<!-- generated by benchmarks/dra_placement.py {tag}: end -->")


def write_doc(doc: Path, name: str, seeds: list[int], unalloc: dict[str, list[float]],
              diffs: dict[tuple[str, str], tuple[float, float]],
              gates: list[tuple[str, bool, str]], key: str = "main",
              labels: dict[str, str] | None = None, notes: list[str] | None = None,
              times: dict[str, tuple[float, float, float, int]] | None = None) -> None:
    """Replace the generated section ``key`` of ``doc`` (between its markers; appended when
    absent) with this run's per-seed table, paired differences, time per path (``times``:
    :func:`timing`) and gates."""
    start, end = doc_markers(key)
    labels = labels or LABELS
    lines = [start, "", f"Run: {name}; seeds {seeds[0]}-{seeds[-1]} ({len(seeds)}), "
             f"{time.strftime('%Y-%m-%d')}. Unallocated GPU % at 100% arrived, per seed:", "",
             "| path | " + " | ".join(map(str, seeds)) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for m, vals in unalloc.items():
        lines.append(f"| {labels.get(m, m)} | " + " | ".join(f"{v:.2f}" for v in vals)
                     + f" | {np.mean(vals):.2f} |")
    lines += ["", "Paired per-seed differences (same tuned trace per seed for every path):", "",
              "| difference | mean ± standard error |", "|---|---|"]
    for (a, b), (m, se) in diffs.items():
        lines.append(f"| {labels.get(a, a)} - {labels.get(b, b)} | {pm(m, se)} |")
    if times:
        lines += ["", "Time per path: the replays' wall time (all seeds) and each bound GPU "
                  "pod's time from its creation to bound (all seeds pooled):", "",
                  "| path | wall s | created-to-bound p50 ms | p99 ms | pods |",
                  "|---|---|---|---|---|"]
        lines += [f"| {labels.get(m, m)} | {w:.0f} | {p50 * 1e3:.0f} | {p99 * 1e3:.0f} | {n} |"
                  for m, (w, p50, p99, n) in times.items()]
    if gates:
        lines += ["", "| goal | result | measured |", "|---|---|---|"]
    for label, ok, value in gates:
        lines.append(f"| {label} | {'met' if ok else 'missed'} | {value} |")
    if notes:
        lines += ["", *[f"* {n}." for n in notes]]
    lines += ["", end]
    text = doc.read_text() if doc.exists() else ""
    if start in text and end in text:
        text = text[:text.index(start)] + "\n".join(lines) + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    doc.write_text(text)


def sim_target(args: argparse.Namespace) -> SimTarget:
    """The simulator target of ``--sim``: ``--nodes`` nodes of the cluster target's shape,
    ``--variant``'s cluster, or the embedded scenario, with the task list made into
    ``--mix``."""
    target: SimTarget
    if args.nodes is not None:
        if args.nodes < 1 or args.gpus < 1:
            raise SystemExit("dra_placement: --nodes and --gpus must be at least 1")
        _, scenario, mix = kwok_scenario(args.nodes, args.gpus, args.variant, args.mix)
        target = SimTarget(scenario, args.tune, args.nodes_to_score)
        target.name += f", {mix}"
    elif args.variant:
        from gpuslice.adapters.traces.data import variant_paths
        from gpuslice.sim.mixes import scenario_with_mix

        pods, nodes = variant_paths(args.variant)
        scenario = scenario_with_mix(load_scenario(pods, nodes), args.mix or "default")
        target = SimTarget(scenario, args.tune, args.nodes_to_score)
    else:
        from gpuslice.sim.default import default_nodes

        tasks, mix = task_mix(None, args.mix)
        target = SimTarget(scenario_of("embedded-default", default_nodes(), tasks),
                           args.tune, args.nodes_to_score)
        target.name += f", {mix}"
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sim", action="store_true", help="replay through the simulator")
    mode.add_argument("--cluster", action="store_true",
                      help="start the real control plane (issue 19's dev cluster) and replay "
                      "on it")
    ap.add_argument("--binaries", type=Path, default=None,
                    help="cluster binaries (default $GPUSLICE_CLUSTER_BIN, else "
                    "tools/cluster/build.sh --bin-dir)")
    ap.add_argument("--nodes", type=int, default=None,
                    help="--cluster: kwok nodes (default 6); --sim: replay on that many nodes "
                    "of the cluster target's shape instead of the scenario's")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node of --nodes (default 8)")
    ap.add_argument("--variant", default=None, help="trace variant from the shared data "
                    "folder (default: the embedded scenario); with --cluster its task mix on "
                    "the kwok nodes, GPU-model constraints dropped")
    ap.add_argument("--mix", default=None, choices=sorted(MIXES),
                    help="make the task list (embedded, or --variant's) into this mix, as the "
                    "FGD paper's trace variants are made (gpuslice.sim.mixes)")
    ap.add_argument("--burst", action="store_true",
                    help="--cluster: create every task at once and measure throughput (tasks "
                    "bound per second) instead of the FGD protocol's one-by-one replay")
    ap.add_argument("--nodes-to-score", type=int, default=None, metavar="PERCENT",
                    help="the gpuslice-scheduler profile's percentageOfNodesToScore, on the "
                    "cluster and in the device-plugin-model path (default: deploy/'s, 0: "
                    "kube-scheduler's adaptive share; 100: every node)")
    ap.add_argument("--stages", action="store_true",
                    help="on the control plane, also time when each GPU pod's claim is "
                    "allocated and its gate removed (two more watches)")
    ap.add_argument("--seeds", default="42-44")
    ap.add_argument("--only", default=None, metavar="PATH[,PATH]",
                    help=f"replay only these paths ({', '.join(PATHS)}; device-plugin-sim, "
                    "default-model, ours-model and ours-pinned-model only with --cluster: the "
                    "simulator's rows "
                    "are those already)")
    ap.add_argument("--tune", type=float, default=1.3)
    ap.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="write the per-seed figures: {\"unallocated\": {PATH: {SEED: %%}}}")
    ap.add_argument("--doc", type=Path, default=None, metavar="MD",
                    help="write the per-seed table, paired differences and gates into MD "
                    "(between the generated-section markers; e.g. docs/dra-placement.md)")
    ap.add_argument("--doc-key", default="main", metavar="KEY",
                    help="which generated section of --doc this run writes (default main)")
    args = ap.parse_args(argv)
    console = Console()
    seeds = parse_seeds(args.seeds)
    only = args.only.split(",") if args.only else None
    known = set(PATHS) if args.cluster else \
        set(PATHS) - {"device-plugin-sim", "default-model", "ours-model", "ours-pinned-model"}
    if only and not set(only) <= known:
        raise SystemExit(f"dra_placement: --only takes {', '.join(sorted(known))}; got "
                         f"{args.only!r}")
    if args.nodes_to_score is not None and not 0 <= args.nodes_to_score <= 100:
        raise SystemExit("dra_placement: --nodes-to-score takes a percentage, 0..100 (0: "
                         f"kube-scheduler's adaptive share); got {args.nodes_to_score}")
    if args.burst and not args.cluster:
        raise SystemExit("dra_placement: --burst needs --cluster")
    if args.cluster and args.variant:
        from gpuslice.adapters.traces.data import variant_paths

        try:
            variant_paths(args.variant)
        except Exception as exc:
            raise SystemExit(f"dra_placement: --variant {args.variant}: {exc}") from None
    if args.cluster:
        from gpuslice.devcluster import find_bin_dir, missing_binaries

        args.nodes = 6 if args.nodes is None else args.nodes
        if args.nodes < 1 or args.gpus < 1:
            raise SystemExit("dra_placement: --nodes and --gpus must be at least 1")
        bin_dir = args.binaries or find_bin_dir(Path(__file__).resolve().parents[1])
        missing = missing_binaries(bin_dir)
        if missing:
            raise SystemExit(f"dra_placement: {bin_dir} lacks {', '.join(missing)}; build "
                             "them with tools/cluster/build.sh")
        with ClusterTarget(bin_dir, args.nodes, args.gpus, args.tune, console,
                           burst=args.burst, variant=args.variant, mix=args.mix,
                           nodes_to_score=args.nodes_to_score, stages=args.stages) as ct:
            return run(ct, seeds, console, only, args.json, args.doc, args.doc_key,
                       args.tune)
    target = sim_target(args)
    return run(target, seeds, console, only, args.json, args.doc, args.doc_key, args.tune)


if __name__ == "__main__":
    sys.exit(main())
