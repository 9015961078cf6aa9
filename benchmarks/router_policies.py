"""Routing policies under open-loop Poisson load on heterogeneous replicas (issue 5 acceptance).

Four fake replicas run as real processes on 127.0.0.1: one fast replica with 3x the capacity of
each of three slow ones (same concurrency, 3x shorter service time; every replica is an exact
M/G/c queue), with deterministic and with exponential service times. For each service-time
distribution and policy, one router process is started and driven at 70%, 85% and 95% of the
aggregate capacity; p50/p99 latency (from the scheduled send time, so queueing in the client
counts), throughput and rejects are printed per policy, then the acceptance check at 85%:
shortest-expected-delay p99 at least 1.5x lower than p2c and round-robin, round-robin
overloaded. Policies see what a mesh would: round-robin, least-outstanding and p2c get equal
weights, weighted-round-robin gets the plan's capability weights (3:1:1:1), sed gets no
weights and learns service times online.

    python benchmarks/router_policies.py                 # about 4.5 minutes on 2 cores
    python benchmarks/router_policies.py --duration 3    # quicker, noisier
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from router_common import LoadResult, drive, processes, run_loop, start_backend, start_router

POLICIES = ("round-robin", "weighted-round-robin", "least-outstanding", "p2c", "sed")
LOADS = (0.70, 0.85, 0.95)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of load per level")
    ap.add_argument("--slow-ms", type=float, default=10.0, help="slow replica mean service ms")
    ap.add_argument("--concurrency", type=int, default=1, help="slots per replica")
    ap.add_argument("--fast-by", choices=("speed", "slots"), default="speed",
                    help="the fast replica's 3x capacity: 3x shorter service time (default) or "
                    "3x the concurrency slots at the same service time")
    ap.add_argument("--dists", default="det,exp")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    console = Console(width=150)
    slow_s = args.slow_ms / 1e3
    fast_ms = args.slow_ms / 3 if args.fast_by == "speed" else args.slow_ms
    fast_conc = args.concurrency if args.fast_by == "speed" else 3 * args.concurrency
    cap_slow = args.concurrency / slow_s
    capacity = 3 * cap_slow + 3 * cap_slow
    policies = args.policies.split(",")
    dists = args.dists.split(",")
    console.print(f"replicas: fast {fast_ms:.2f} ms x{fast_conc} slots "
                  f"({3 * cap_slow:.0f} req/s), 3 x slow {args.slow_ms:.2f} ms x"
                  f"{args.concurrency} ({cap_slow:.0f} req/s each); aggregate {capacity:.0f} "
                  f"req/s; {args.duration:g} s per load level, first 10% not counted")
    results: dict[tuple[str, str, float], LoadResult] = {}
    total = len(dists) * len(policies) * len(LOADS)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("starting", total=total)
        for dist in dists:
            with processes() as procs:
                specs = [("fast", fast_ms, 3.0, fast_conc)] + [
                    (f"slow-{i}", args.slow_ms, 1.0, args.concurrency) for i in range(3)]
                backends = []
                for i, (name, ms, _, conc) in enumerate(specs):
                    b = start_backend(name, ms, dist, conc, args.seed + i)
                    procs.append(b)
                    backends.append(b)
                for policy in policies:
                    weighted = policy == "weighted-round-robin"
                    cfg = {"policy": policy, "services": [{"name": "m", "replicas": [
                        {"name": name, "url": f"http://127.0.0.1:{b.port}",
                         "weight": w if weighted else 1.0, "concurrency": conc}
                        for (name, _, w, conc), b in zip(specs, backends, strict=True)]}],
                        "health": {"interval_s": 5.0}}
                    router = start_router(cfg, extra=["--no-admission"])
                    try:
                        for load in LOADS:
                            progress.update(bar, description=f"{dist} {policy} {load:.0%}")
                            res = run_loop(drive(
                                f"http://127.0.0.1:{router.port}/v2/models/m/infer",
                                load * capacity, args.duration, args.seed))
                            results[(dist, policy, load)] = res
                            progress.advance(bar)
                    finally:
                        router.stop()
    ok = True
    for dist in dists:
        table = Table(title=f"{dist} service times: latency from scheduled send (ms)")
        for col in ("policy", "load", "offered/s", "p50", "p99", "throughput/s", "rejects",
                    "errors", "p99 / sed p99", "state"):
            table.add_column(col, justify="right" if col not in ("policy", "state") else "left")
        for load in LOADS:
            sed = results.get((dist, "sed", load))
            for policy in policies:
                r = results[(dist, policy, load)]
                ratio = (r.pct(99) / sed.pct(99)) if sed is not None else float("nan")
                table.add_row(policy, f"{load:.0%}", f"{r.offered_rps:.0f}",
                              f"{r.pct(50) * 1e3:.1f}", f"{r.pct(99) * 1e3:.1f}",
                              f"{r.throughput():.0f}", str(r.rejects()), str(r.errors()),
                              f"{ratio:.2f}x", "overloaded" if r.overloaded() else "stable")
            table.add_section()
        console.print(table)
        if "sed" in policies:
            sed = results[(dist, "sed", 0.85)]
            for base in ("p2c", "round-robin"):
                if base not in policies:
                    continue
                r = results[(dist, base, 0.85)]
                ratio = r.pct(99) / sed.pct(99)
                passed = ratio >= 1.5
                ok &= passed
                console.print(f"[{'green' if passed else 'red'}]{dist} @85%: {base} p99 "
                              f"{r.pct(99) * 1e3:.1f} ms / sed p99 {sed.pct(99) * 1e3:.1f} ms = "
                              f"{ratio:.2f}x (need >= 1.5x) {'PASS' if passed else 'FAIL'}[/]")
            if "round-robin" in policies:
                rr = results[(dist, "round-robin", 0.85)]
                over = rr.overloaded()
                ok &= over
                console.print(f"[{'green' if over else 'red'}]{dist} @85%: round-robin "
                              f"{'overloaded' if over else 'NOT overloaded'} (throughput "
                              f"{rr.throughput():.0f}/s of {rr.offered_rps:.0f}/s offered)[/]")
    console.print("[bold green]acceptance: PASS[/]" if ok else "[bold red]acceptance: FAIL[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
