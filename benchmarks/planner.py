"""Acceptance benchmark for the SLA planner.

1. ParvaGPU's scenarios (A100-80GB profiles in the shared folder): our GPUs beside ParvaGPU's,
   exclusive allocation's and the lower bound, the planning time, and the replay at 100% of the
   rates (worst p99 / SLO, violations).
2. A synthetic 100-service case needing about 1,000 GPUs, planned with the heuristic: time, GPUs,
   and the ratio to the LP-relaxation bound measured in the same run.

    python benchmarks/planner.py
"""

from __future__ import annotations

import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from gpuslice.adapters.profiles.files import read_parva_profiles
from gpuslice.adapters.traces.data import require_data_dir
from gpuslice.core.planner import FleetType, PlanOptions, Service, plan, validate
from gpuslice.planning.run import parva_baseline, run_plan, scenario_services

PROFILES = "profiles/parvagpu-a100-80gb"


def synthetic_services(models: list[str], n: int, seed: int) -> list[Service]:
    """``n`` services over the profiled models with SLOs in the range the scenarios use and
    rates that add up to roughly 1,000 A100s."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        model = models[i % len(models)]
        slo = float(rng.uniform(150, 400)) if model != "bert" else float(rng.uniform(4000, 7000))
        rate = float(rng.lognormal(np.log(22000), 0.6)) if model != "bert" else \
            float(rng.uniform(200, 600))
        out.append(Service(f"svc-{i:03d}-{model}", model, round(rate, 1), round(slo, 1)))
    return out


def main() -> int:
    console = Console(width=max(Console().width, 120))
    folder = require_data_dir() / PROFILES
    profiles = read_parva_profiles(folder)
    fleet = [FleetType("A100-80GB")]
    table = Table(title="ParvaGPU scenarios (A100-80GB): GPUs used")
    for col in ("scenario", "gpuslice", "ParvaGPU", "exclusive", "lower bound", "plan s",
                "replan rounds", "worst p99/SLO", "SLO violations", "valid"):
        table.add_column(col, justify="right")
    gates: list[tuple[str, bool]] = []
    fewer = False
    for sc in range(1, 5):
        services = scenario_services(folder, None, None, sc)
        parva = parva_baseline(folder, sc)
        run = run_plan(profiles, services, fleet, PlanOptions(), baselines={"parvagpu": parva})
        worst = max(r.p99_ms / r.slo_ms for r in run.replay)
        viol = [r.service for r in run.replay if not r.ok]
        n = run.plan.n_gpus
        table.add_row(str(sc), str(n), str(parva), str(run.baselines["exclusive"]),
                      f"{run.plan.lower_bound:.2f}", f"{run.plan_seconds:.2f}", str(run.rounds),
                      f"{worst:.2f}", str(len(viol)), "yes" if not run.errors else "NO")
        gates.append((f"scenario {sc}: {n} GPUs <= ParvaGPU's {parva}", parva is not None
                      and n <= parva))
        gates.append((f"scenario {sc}: zero SLO violations in the replay at 100% rate",
                      not viol))
        gates.append((f"scenario {sc}: plan valid", not run.errors))
        gates.append((f"scenario {sc}: planned in {run.plan_seconds:.2f} s <= 2 s",
                      run.plan_seconds <= 2.0))
        fewer |= parva is not None and n < parva
    gates.append(("strictly fewer GPUs than ParvaGPU in at least one scenario", fewer))
    console.print(table)

    services = synthetic_services(profiles.models(), 100, seed=7)
    start = time.perf_counter()
    big = plan(profiles, services, fleet, PlanOptions(solver="greedy"))
    seconds = time.perf_counter() - start
    errors = validate(big, services)
    ratio = big.n_gpus / big.lower_bound
    console.print(
        f"synthetic: 100 services, heuristic plan {big.n_gpus} GPUs in {seconds:.2f} s; LP bound "
        f"{big.lower_bound:.1f} (ratio {ratio:.3f}); valid: {not errors}", highlight=False)
    gates.append((f"synthetic 100 services planned in {seconds:.2f} s <= 10 s", seconds <= 10))
    gates.append((f"synthetic within 5% of the bound ({ratio:.3f})", ratio <= 1.05))
    gates.append(("synthetic needs about 1,000 GPUs", 800 <= big.n_gpus <= 1300))
    gates.append(("synthetic plan valid", not errors))
    for name, ok in gates:
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {name}")
    return 0 if all(ok for _, ok in gates) else 1


if __name__ == "__main__":
    sys.exit(main())
