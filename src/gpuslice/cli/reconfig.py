"""``gpuslice reconfig``: re-slice GPUs by SliceSchedule."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuslice.cli.common import (
    KUBECONFIG_HELP,
    Sub,
    add_log_format,
    add_output,
    print_json,
    read_yaml,
    setup_logging,
)
from gpuslice.core.errors import ValidationError


def register(sub: Sub) -> None:
    r = sub.add_parser(
        "reconfig", help="change GPU slicing by SliceSchedule without dropping traffic",
        description="'run' follows SliceSchedule objects and moves each selected GPU to the "
        "layout wanted now, one GPU at a time (cordon, move replicas, drain, apply, reopen); "
        "'plan' shows what a schedule would change now, changing nothing.")
    r.add_argument("action", choices=("run", "plan"))
    r.add_argument("schedule", nargs="?", type=Path,
                   help="with plan: a SliceSchedule YAML file (default: the cluster's)")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    src.add_argument("--fake-cluster", type=Path,
                     help="nodes, pods and sliceschedules from a YAML file (to try it out)")
    r.add_argument("--context", help="kubeconfig context")
    r.add_argument("--router-admin", help="router admin URL: drain until it reports no "
                   "request in flight (default: wait the schedule's drain timeout)")
    r.add_argument("--every", type=float, default=2.0, help="seconds between passes")
    r.add_argument("--once", action="store_true", help="run: one pass, then exit")
    r.add_argument("--at", help="plan: as if it were this time of day (HH:MM, UTC)")
    r.add_argument("--json", action="store_true", help="plan: the same as -o json")
    add_output(r)
    add_log_format(r)
    r.set_defaults(handler=_reconfig)


def _reconfig(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.http.router_admin import HttpRouter
    from gpuslice.adapters.kube.fake import ClusterPort, load_fake_cluster
    from gpuslice.services.reconfig import PLURAL, ReconfigController

    schedule: dict[str, Any] | None = None  # a file's, read before anything else is done
    if args.action == "plan" and args.schedule is not None:
        doc = read_yaml(args.schedule, "schedule")
        if not isinstance(doc, dict):
            raise ValidationError(str(args.schedule), "a SliceSchedule (a YAML mapping with "
                                  "kind, metadata and spec)",
                                  "an empty document" if doc is None else type(doc).__name__)
        schedule = doc
    api: ClusterPort
    if args.fake_cluster is not None:
        api = load_fake_cluster(args.fake_cluster)
    else:
        from gpuslice.adapters.kube.client import KubeClient

        api = KubeClient(args.kubeconfig, args.context)
    minute = None
    if args.at is not None:
        from gpuslice.core.reconfig import minutes_of_day

        at = minutes_of_day("--at", args.at)
        minute = lambda: at  # noqa: E731
    router = HttpRouter(args.router_admin) if args.router_admin else None
    ctl = ReconfigController(api, router=router, minute_of_day=minute)
    if args.action == "run":
        if args.every <= 0:
            raise ValidationError("--every", "a positive number of seconds", args.every)
        from gpuslice.adapters.signals import StopSignals

        log = setup_logging(args.log_format, "reconfig")  # each step's line, as it happens
        log.info("following SliceSchedules every %g s%s", args.every,
                 f", draining through the router at {args.router_admin}"
                 if args.router_admin else "",
                 extra={"event": "starting", "every_s": args.every,
                        "router_admin": args.router_admin})
        with StopSignals() as signals:  # SIGTERM (the pod deleted) or Ctrl-C: stop, exit 0
            if args.once:
                ctl.step()
            else:
                ctl.run(signals.event, args.every)
        log.info("%s", signals.stopped_line("a move under way resumes at the next start"),
                 extra={"event": "stopped"})
        return 0
    objs = [schedule] if schedule is not None else api.list_custom(PLURAL)
    results = [ctl.dry_run(o) for o in objs]
    if args.json or args.output == "json":
        print_json(results)
        return 0
    for res in results:
        console.print(f"{res['schedule']}: target layout {res['target']}; "
                      f"{len(res['changes'])} of {res['gpus']} GPUs would change")
        t = Table()
        for col in ("node", "GPU", "from", "to", "replicas to move", "blocked"):
            t.add_column(col)
        for ch in res["changes"]:
            t.add_row(ch["node"], ch["gpu"], ch["from"], ch["to"],
                      str(len(ch["moves"])), ch["blocked"] or "-")
        console.print(t)
    return 0
