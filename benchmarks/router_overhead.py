"""Router overhead (issue 5 acceptance): added p50 latency at 2,000 requests/s against a no-op
backend, versus calling the backend directly, measured in the same run.

One no-op fake replica process and one router process (policy sed, admission on, metrics on,
access log written to a file as in production) on 127.0.0.1; the load generator (this process)
sends open-loop Poisson arrivals, alternating rounds direct and through the router so both see
the same machine state. Latency is from the actual send to the last byte of the answer.

    python benchmarks/router_overhead.py               # about 1 minute
    python benchmarks/router_overhead.py --access-log off
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from router_common import LoadResult, drive_raw, processes, run_loop, start_backend, start_router

PATH = "/v2/models/m/infer"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=4.0, help="per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--policy", default="sed")
    ap.add_argument("--access-log", default="file", help="file (default) or off")
    args = ap.parse_args()
    console = Console(width=120)
    results: dict[str, list[LoadResult]] = {"direct": [], "router": []}
    with processes() as procs, tempfile.TemporaryDirectory() as tmp:
        b = start_backend("noop", 0.0, "det", 1, 0, ["--raw-noop"])
        procs.append(b)
        log = "off" if args.access_log == "off" else str(Path(tmp) / "access.log")
        cfg = {"services": [{"name": "m", "slo_ms": 1000,
                             "replicas": [{"name": "noop", "url": f"http://127.0.0.1:{b.port}"}]}]}
        r = start_router(cfg, args.policy, access_log=log)
        procs.append(r)
        targets = {"direct": b.port, "router": r.port}
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            bar = progress.add_task("warm-up", total=2 + 2 * args.rounds)
            for name, u in targets.items():
                run_loop(drive_raw("127.0.0.1", u, PATH, args.rate, 1.0, 99))
                progress.update(bar, advance=1, description=f"warm-up {name}")
            for k in range(args.rounds):
                order = ("direct", "router") if k % 2 == 0 else ("router", "direct")
                for name in order:
                    progress.update(bar, description=f"round {k + 1} {name}")
                    res = run_loop(drive_raw("127.0.0.1", targets[name], PATH, args.rate,
                                             args.seconds, k))
                    results[name].append(res)
                    progress.advance(bar)
    table = Table(title=f"{args.rate:.0f} req/s open loop, {args.rounds} x {args.seconds:g} s "
                  f"per path, no-op backend (latency ms, from send)")
    for col in ("path", "requests", "errors", "p50", "p90", "p99", "achieved/s"):
        table.add_column(col, justify="left" if col == "path" else "right")
    p50 = {}
    for name, runs in results.items():
        ok = np.concatenate([x.ok() for x in runs])
        n = sum(len(x.status) for x in runs)
        errs = sum(x.errors() for x in runs)
        rate = np.mean([x.throughput() for x in runs])
        p50[name] = float(np.percentile(ok, 50))
        table.add_row(name, str(n), str(errs), f"{p50[name] * 1e3:.3f}",
                      f"{np.percentile(ok, 90) * 1e3:.3f}", f"{np.percentile(ok, 99) * 1e3:.3f}",
                      f"{rate:.0f}")
    console.print(table)
    added = (p50["router"] - p50["direct"]) * 1e3
    passed = added <= 1.0
    console.print(f"[{'green' if passed else 'red'}]added p50 latency through the router: "
                  f"{added:.3f} ms (p50 {p50['router'] * 1e3:.3f} ms vs direct "
                  f"{p50['direct'] * 1e3:.3f} ms, ratio {p50['router'] / p50['direct']:.2f}x); "
                  f"need <= 1 ms: {'PASS' if passed else 'FAIL'}[/]")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
