"""``gpuslice demo``: every component on one machine."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from gpuslice.cli.common import Sub, examples, writable_dir
from gpuslice.cli.flagtypes import non_negative_int
from gpuslice.core.errors import ValidationError


def register(sub: Sub) -> None:
    d = sub.add_parser(
        "demo", help="every gpuslice component on this machine, on a simulated cluster",
        description="Bring up the real node agents (device plugin over gRPC), extender, "
        "planner and router on this machine, with the API server, kubelet, scheduler and GPUs "
        "simulated; run a scripted scenario (plan, deploy, serve load, crash a replica, re-slice "
        "a GPU under load, add a node) and write a one-page HTML report.",
        epilog=examples("gpuslice demo --short --out demo-report", "gpuslice demo --dra"))
    # --out and --seed default to None so that --dra can refuse them when given
    d.add_argument("--out", type=Path,
                   help="folder for index.html, summary.json and the plots (default "
                   "demo-report; not with --dra)")
    d.add_argument("--short", action="store_true",
                   help="a shortened scenario (about 35 s; not with --dra)")
    d.add_argument("--seed", type=non_negative_int,
                   help="seed of the scenario's load (a whole number >= 0; default 1; not "
                   "with --dra)")
    d.add_argument("--no-live", action="store_true",
                   help="print events line by line instead of a live display (the DRA "
                   "demo always does)")
    d.add_argument("--no-local-gpus", action="store_true",
                   help="do not add this machine's NVIDIA GPUs (real NVML and MPS) as a node "
                   "(with --dra: the MPS stand-in even where nvidia-cuda-mps-control is on "
                   "PATH)")
    d.add_argument("--dra", action="store_true",
                   help="instead: the DRA path end to end (the DRA driver over gRPC on unix "
                   "sockets, gpuslice's claim allocator, four claims prepared and unprepared "
                   "on fake GPUs) and a table of what each container gets; no cluster "
                   "binaries, no GPU, nothing left behind")
    d.set_defaults(handler=_demo)


def _dra(console: Console, local_gpus: bool = True) -> int:
    import logging

    from rich.table import Table

    from gpuslice.cli.common import EXIT_FAILED
    from gpuslice.demo.dra import run_dra_demo
    from gpuslice.demo.dra_first_fit import DraDemoFailed

    def say(line: str) -> None:
        console.print(f"[green]\u2713[/green] {line}", highlight=False, markup=True,
                      soft_wrap=True)

    # the driver's and the allocator's own warnings, marked as theirs
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("  %(name)s %(levelname)s: %(message)s"))
    log = logging.getLogger("gpuslice")
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    console.print("[bold]gpuslice DRA demo[/bold]: the DRA driver, gpuslice's claim allocator "
                  "and a kubelet stand-in on fake GPUs", highlight=False)
    try:
        # no local GPUs: nothing of this machine's, so no real MPS either ("": the stand-in)
        result = run_dra_demo(say, mps_binary=None if local_gpus else "")
    except DraDemoFailed as exc:
        console.print(f"[red]\u2717 DRA demo failed[/red] at {exc}", highlight=False,
                      soft_wrap=True)
        return EXIT_FAILED
    table = Table(title="Prepared claims: what each container gets (from its CDI spec)",
                  show_lines=True)
    for col in ("claim", "model", "device", "limits", "CDI device id", "env"):
        table.add_column(col, overflow="fold")
    for r in result.rows:
        env = [f"{k}={v}" for k, v in sorted(r.env.items())]
        env += [f"mount {m}" for m in r.mounts]
        table.add_row(r.claim, r.model, r.device, r.limits, r.cdi_id, "\n".join(env))
    console.print(table)
    console.print(f"{len(result.rows)} claims prepared and unprepared over gRPC; "
                  f"{len(result.removed)} CDI specs removed; MPS: {result.mps}; "
                  "nothing left behind.", highlight=False)
    return 0


def _demo(args: argparse.Namespace, console: Console) -> int:
    import signal

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if args.dra:
        for option, value in (("--out", args.out), ("--seed", args.seed)):
            if value is not None:
                raise ValidationError(option, "no --out or --seed with --dra: they are the "
                                      "scenario demo's (without --dra); the DRA demo writes "
                                      "no files and draws no random load", str(value))
        # --no-live and --no-local-gpus hold here too (the DRA demo always prints lines, and
        # _dra makes no local GPUs mean no real MPS); --short has nothing to shorten
        if args.short:
            raise ValidationError("--short", "no --short with --dra: it shortens the scenario "
                                  "demo (without --dra); the DRA demo has no scenario and runs "
                                  "in about a second", "--short")
    signal.signal(signal.SIGTERM, on_term)  # stop everything the demo started, as on Ctrl-C
    if args.dra:
        return _dra(console, local_gpus=not args.no_local_gpus)

    from gpuslice.adapters.optional import pyplot
    from gpuslice.demo.report import summary_lines
    from gpuslice.demo.scenario import DemoOptions, run_demo

    given = {k: v for k, v in (("out", args.out), ("seed", args.seed)) if v is not None}
    opts = DemoOptions(short=args.short, live=False if args.no_live else None,
                       local_gpus=not args.no_local_gpus, **given)
    # what the report needs is checked before the scenario runs, not after it
    writable_dir(opts.out, "--out")
    pyplot()
    result = run_demo(opts)
    for line in summary_lines(result):
        console.print(line)
    return 0
