"""Acceptance benchmark for the simulator and our policy, on the real Alibaba trace.

For every trace variant that has published results in the shared data folder, runs the six
published policies and ours over seeds 42-51 (inflation 1.3) and prints:

* faithfulness: our re-implementation's unallocated GPU % at 100% arrived next to the published
  mean (the gate is 0.5 points on ``default``, 1.0 on the other variants);
* our policy against the published FGD mean (mean and standard deviation);
* speed: one seed of ``default`` with our policy, and the whole 10-seed comparison of all policies
  on ``default``, each also as a ratio to FGD measured in the same run.

Writes ``bench-out/fgd_compare.json``, one CSV set and one plot per variant.

    python benchmarks/fgd_compare.py                  # every variant with published results
    python benchmarks/fgd_compare.py --variants default --seeds 42-44
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuslice.adapters.traces.data import published_results, variant_paths
from gpuslice.adapters.traces.fgd_results import read_published
from gpuslice.cli import parse_seeds
from gpuslice.sim.compare import compare
from gpuslice.sim.plot import plot_unallocated
from gpuslice.sim.runner import (
    Experiment,
    Job,
    load_scenario,
    run_experiment,
    run_job,
    write_results,
)

PUBLISHED_POLICIES = ["random", "dotprod", "gpu-clustering", "gpu-packing", "bestfit", "fgd"]
OURS = "ours"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="", help="comma-separated (default: all published)")
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    console = Console(width=max(Console().width, 150))
    published = read_published(published_results())
    available = sorted({r.workload.removeprefix("openb_pod_list_") for r in published})
    variants = [v for v in args.variants.split(",") if v] or available
    if "default" in variants:
        variants = ["default", *[v for v in variants if v != "default"]]
    seeds = parse_seeds(args.seeds)
    policies = [*PUBLISHED_POLICIES, OURS]
    report: dict[str, object] = {"seeds": seeds, "variants": {}}

    # speed, measured first on a quiet machine: one seed of default, ours and FGD, one process
    pods, nodes = variant_paths("default")
    scenario = load_scenario(pods, nodes)
    one = {p: run_job(scenario, Job(p, seeds[0], 1.3)).seconds for p in ("fgd", OURS)}

    gates: list[tuple[str, bool]] = []
    rows_out = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        for variant in variants:
            pods, nodes = variant_paths(variant)
            scenario = load_scenario(pods, nodes)
            exp = Experiment(scenario, policies, seeds, 1.3)
            bar = progress.add_task(variant, total=len(exp.jobs()))
            start = time.perf_counter()
            results = run_experiment(exp, on_done=lambda _r, b=bar: progress.advance(b))
            wall = time.perf_counter() - start
            write_results(args.out / variant, scenario.name, results)
            plot_unallocated(results, args.out / variant / "unallocated.png",
                             f"{variant}: unallocated GPU vs arrived workload")
            cmp = compare(scenario.name, results, published)
            tol = 0.5 if variant == "default" else 1.0
            entry: dict[str, object] = {"wall_seconds_all_policies": wall, "policies": {}}
            fgd_pub = next(r.published_mean for r in cmp if r.policy == "fgd")
            for r in cmp:
                entry["policies"][r.policy] = {  # type: ignore[index]
                    "mean": r.ours_mean, "sd": r.ours_sd, "published_mean": r.published_mean,
                    "published_sd": r.published_sd, "seconds_per_seed": r.seconds_per_seed,
                }
                if r.policy in PUBLISHED_POLICIES and r.diff is not None:
                    ok = abs(r.diff) <= tol
                    gates.append((f"{variant}: {r.policy} within {tol} of published", ok))
                if r.policy == OURS and fgd_pub is not None:
                    limit = 4.3 if variant == "default" else fgd_pub
                    ok = r.ours_mean <= limit if variant == "default" else r.ours_mean < limit
                    gates.append((f"{variant}: ours {r.ours_mean:.2f} vs limit {limit:.2f}", ok))
            report["variants"][variant] = entry  # type: ignore[index]
            rows_out.append((variant, cmp, wall))

    table = Table(title=f"unallocated GPU % at 100% arrived, mean ± sd over {len(seeds)} seeds: "
                  "our simulator | published (for ours: published FGD)")
    table.add_column("variant")
    for p in policies:
        table.add_column(p, justify="right")
    md = ["| variant | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
    for variant, cmp, _wall in rows_out:
        by = {r.policy: r for r in cmp}
        cells = []
        for p in policies:
            r = by[p]
            pub = "-" if r.published_mean is None else f"{r.published_mean:.2f}"
            cells.append(f"{r.ours_mean:.2f} ± {r.ours_sd:.2f} ({pub})")
        table.add_row(variant, *cells)
        md.append(f"| {variant} | " + " | ".join(cells) + " |")
    console.print(table)

    default = report["variants"].get("default")  # type: ignore[attr-defined]
    speed = {
        "one_seed_default_ours_s": one[OURS],
        "one_seed_default_fgd_s": one["fgd"],
        "ours_over_fgd_one_seed": one[OURS] / one["fgd"],
    }
    if default is not None:
        pols = default["policies"]
        speed["all_policies_default_wall_s"] = default["wall_seconds_all_policies"]
        fgd_share = pols["fgd"]["seconds_per_seed"] * len(seeds)
        speed["all_policies_over_fgd_alone"] = default["wall_seconds_all_policies"] / fgd_share
        gates.append((f"one seed of default with ours in {one[OURS]:.1f} s <= 20 s",
                      one[OURS] <= 20))
        gates.append((f"all policies x {len(seeds)} seeds on default in "
                      f"{default['wall_seconds_all_policies']:.0f} s <= 600 s",
                      default["wall_seconds_all_policies"] <= 600))
    report["speed"] = speed
    console.print(
        f"speed: one seed of default, ours {one[OURS]:.1f} s, fgd {one['fgd']:.1f} s "
        f"(ratio {speed['ours_over_fgd_one_seed']:.2f}); "
        + (f"all {len(policies)} policies x {len(seeds)} seeds on default "
           f"{speed['all_policies_default_wall_s']:.0f} s wall "
           f"({speed['all_policies_over_fgd_alone']:.2f}x the CPU time of FGD's seeds alone)"
           if default is not None else "")
    )
    for name, ok in gates:
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {name}")
    report["gates"] = [{"name": n, "ok": ok} for n, ok in gates]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fgd_compare.md").write_text("\n".join(md) + "\n")
    (args.out / "fgd_compare.json").write_text(json.dumps(report, indent=2, default=float))
    console.print(f"wrote {args.out / 'fgd_compare.json'}")
    return 0 if all(ok for _, ok in gates) else 1


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
