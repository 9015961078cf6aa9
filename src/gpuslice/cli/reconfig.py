"""``gpuslice reconfig``: re-slice GPUs by SliceSchedule."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from gpuslice.cli.common import (
    KUBECONFIG_HELP,
    Sub,
    add_log_format,
    add_output,
    examples,
    print_json,
    read_yaml,
    setup_logging,
)
from gpuslice.cli.flagtypes import positive_float
from gpuslice.core.errors import ValidationError

if TYPE_CHECKING:
    from gpuslice.adapters.kube.fake import ClusterPort

# what ReconfigController.dry_run says of a GPU whose node agent has not reported its layout
NOT_REPORTED = "(not reported yet)"
MIG_DISABLED = "MIG disabled"


def register(sub: Sub) -> None:
    r = sub.add_parser(
        "reconfig", help="change GPU slicing by SliceSchedule without dropping traffic",
        description="'run' follows SliceSchedule objects and moves each selected GPU to the "
        "layout wanted now, one GPU at a time (cordon, move replicas, drain, apply, reopen); "
        "'plan' shows what a schedule would change now, changing nothing.",
        epilog=examples("gpuslice reconfig plan deploy/examples/day-night.yaml --at 23:00",
                        "gpuslice reconfig run --router-admin http://gpuslice-router:9901"))
    rs = r.add_subparsers(dest="action", required=True, metavar="COMMAND",
                          title="commands (gpuslice reconfig COMMAND --help for each)")
    run = rs.add_parser(
        "run", help="the controller: follow SliceSchedules, one GPU at a time",
        description="Follow the cluster's SliceSchedule objects: move each selected GPU to the "
        "layout wanted now, one GPU at a time (cordon, move replicas, drain, apply, reopen), "
        "its progress in the schedule's status. SIGTERM or Ctrl-C stops it; a move under way "
        "resumes at the next start.",
        epilog=examples("gpuslice reconfig run --router-admin http://gpuslice-router:9901",
                        "gpuslice reconfig run --once --fake-cluster examples/fake-cluster.yaml"))
    plan = rs.add_parser(
        "plan", help="what a schedule would change now, changing nothing",
        description="For a SliceSchedule file (or the cluster's SliceSchedules): the layout "
        "wanted now and, per selected GPU not in it, its current layout (from the node agent's "
        "report, else the GPU inventory kubectl gpuslice status shows), the replicas that "
        "would move and what would block the move.",
        epilog=examples("gpuslice reconfig plan deploy/examples/day-night.yaml --at 23:00 "
                        "--fake-cluster examples/fake-cluster.yaml",
                        "gpuslice reconfig plan -o json"))
    plan.add_argument("schedule", nargs="?", type=Path,
                      help="a SliceSchedule YAML file (default: the cluster's SliceSchedules)")
    for p in (run, plan):
        src = p.add_mutually_exclusive_group()
        src.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
        src.add_argument("--fake-cluster", type=Path,
                         help="nodes, pods and sliceschedules from a YAML file (to try it out)")
        p.add_argument("--context", help="kubeconfig context")
        p.add_argument("--at", metavar="HH:MM",
                       help="as if it were this time of day (UTC; default: now)")
    run.add_argument("--router-admin", help="router admin URL: drain until it reports no "
                     "request in flight (default: wait the schedule's drain timeout)")
    run.add_argument("--every", type=positive_float, default=2.0,
                     help="seconds between passes (default 2)")
    run.add_argument("--once", action="store_true", help="one pass, then exit")
    add_log_format(run)
    add_output(plan, json_alias=True)
    r.set_defaults(handler=_reconfig)


def _reconfig(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.http.router_admin import HttpRouter
    from gpuslice.adapters.kube.fake import load_fake_cluster
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
    router = HttpRouter(args.router_admin) if getattr(args, "router_admin", None) else None
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
    results = [from_inventory(api, ctl.dry_run(o)) for o in objs]
    if args.output == "json":
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


def from_inventory(api: ClusterPort, res: dict[str, Any]) -> dict[str, Any]:
    """A dry run's changes, each GPU's current layout named as kubectl gpuslice status names
    it: where the node agent has not reported the layout (or reports none: MIG disabled), from
    the GPU inventory it published on the node; a GPU already in the target layout by that
    inventory is no change."""
    from gpuslice.adapters.kube.objects import InventoryGpu, node_inventory

    inventory: dict[str, InventoryGpu] = {}
    for n in api.list_nodes():
        try:
            inventory.update((g.uuid, g) for g in node_inventory(n))
        except ValidationError:
            continue  # an unreadable inventory: the controller skips the node too
    changes = []
    for change in res["changes"]:
        g = inventory.get(change["gpu"])
        ch = dict(change)
        if ch["from"] == NOT_REPORTED and g is not None:
            if not g.mig_enabled:
                ch["from"] = MIG_DISABLED
                ch["blocked"] = ch["blocked"] or ("MIG mode is disabled on this GPU (enabling "
                                                  "it is an administrator's action)")
            else:
                layout = ",".join(f"{m.profile}@{m.start}"
                                  for m in sorted(g.mig, key=lambda m: m.start))
                if layout == ch["to"]:
                    continue
                ch["from"] = layout or "(no MIG instance)"
        changes.append(ch)
    return {**res, "changes": changes}
