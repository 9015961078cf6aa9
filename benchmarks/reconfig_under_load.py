"""Latency while the reconfiguration controller re-slices GPUs under load, against the same load
with no reconfiguration, measured in the same run (the figures of docs/reconfiguration.md,
"Measured").

The cluster of tests/reconfig (tests/reconfig/harness.py): 4 nodes x 4 A100-80GB in MIG, the
real node agents on fake NVML, the extender and the router over HTTP, 10 MPS replicas of each of
two services in-process (SLO 300 ms). Each round runs an open-loop load through the router while
the controller switches all 16 GPUs from 7 x 1g to 1 x 7g and back, then the same load for as
long with nothing switching. Rounds alternate which goes first, so both see the machine alike.

    python benchmarks/reconfig_under_load.py              # 2 rounds, about 2 minutes
    python benchmarks/reconfig_under_load.py --rounds 4 --plot docs/reconfig-latency.png
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the harness of tests/reconfig

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402
from tests.reconfig.harness import SwitchRun, switch_under_load  # noqa: E402

SLO_MS = 300.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, default=80.0, help="requests/s per service")
    ap.add_argument("--plot", type=Path, help="also draw the latency distributions here (PNG)")
    args = ap.parse_args()
    if args.rounds < 1 or args.rate <= 0:
        ap.error("--rounds must be >= 1 and --rate > 0")
    logging.getLogger("gpuslice").setLevel(logging.WARNING)
    console = Console(width=120)
    runs: dict[str, list[SwitchRun]] = {"switching": [], "steady": []}
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console) as progress, tempfile.TemporaryDirectory() as tmp:
        bar = progress.add_task("", total=2 * args.rounds)
        for k in range(args.rounds):
            order = ("switching", "steady") if k % 2 == 0 else ("steady", "switching")
            hold = runs["switching"][-1].middle_s if runs["switching"] else 20.0
            for name in order:
                progress.update(bar, description=f"round {k + 1}: {name}")
                run = switch_under_load(Path(tmp) / f"{k}-{name}", name == "switching",
                                        hold_s=hold, rate=args.rate)
                runs[name].append(run)
                if name == "switching":
                    hold = run.middle_s
                progress.advance(bar)
    table = Table(title=f"{2 * args.rate:.0f} req/s open loop through the router, "
                  f"{args.rounds} round(s) per case (latency ms; SLO {SLO_MS:.0f})")
    for col in ("case", "requests", "failed", "p50", "p99 alpha", "p99 beta", "p99 all",
                "moves", "middle s"):
        table.add_column(col, justify="left" if col == "case" else "right")
    p99 = {}
    lat: dict[str, np.ndarray] = {}
    for name, rs in runs.items():
        lat[name] = np.array([x for r in rs for _, x, code in r.samples if code == 200]) * 1e3
        p99[name] = float(np.percentile(lat[name], 99))
        per = {svc: float(np.percentile([x for r in rs for s, x, c in r.samples
                                         if s == svc and c == 200], 99)) * 1e3
               for svc in ("alpha", "beta")}
        table.add_row(name, str(sum(len(r.samples) for r in rs)),
                      str(sum(len(r.failed) for r in rs)),
                      f"{np.percentile(lat[name], 50):.1f}", f"{per['alpha']:.1f}",
                      f"{per['beta']:.1f}", f"{p99[name]:.1f}",
                      str(sum(r.moves for r in rs)),
                      f"{np.mean([r.middle_s for r in rs]):.1f}")
    console.print(table)
    wrong = [w for rs in runs.values() for r in rs for w in r.wrong]
    lost = [r.running for r in runs["switching"] if r.running != {"alpha": 10, "beta": 10}]
    console.print(f"p99 while switching / steady: {p99['switching'] / p99['steady']:.2f}x; "
                  f"p99 while switching is {p99['switching'] / SLO_MS:.2f} of the SLO; "
                  f"failed requests: {sum(len(r.failed) for rs in runs.values() for r in rs)}; "
                  f"replicas lost: {len(lost)}; wrong layouts or cordons left: {len(wrong)}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, xs in lat.items():
            ax.ecdf(xs, label=f"{name} (p99 {p99[name]:.0f} ms)")
        ax.axvline(SLO_MS, color="grey", linestyle=":", label="SLO")
        ax.set_xscale("log")
        ax.set_xlabel("latency through the router (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("16 GPUs re-sliced and back under load vs the same load steady")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        console.print(f"plot: {args.plot}")
    return 1 if wrong or lost or any(r.failed for rs in runs.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
