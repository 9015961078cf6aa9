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
    add_lease,
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
    from gpuslice.adapters.http.router_admin import RouterPort
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
                        "gpuslice reconfig run --routers default/gpuslice-router --leader-elect"))
    rs = r.add_subparsers(dest="action", required=True, metavar="COMMAND",
                          title="commands (gpuslice reconfig COMMAND --help for each)")
    run = rs.add_parser(
        "run", help="the controller: follow SliceSchedules, one GPU at a time",
        description="Follow the cluster's SliceSchedule objects: move each selected GPU to the "
        "layout wanted now, one GPU at a time (cordon, move replicas, drain, apply, reopen), "
        "its progress in the schedule's status. SIGTERM or Ctrl-C stops it; a move under way "
        "resumes at the next start.",
        epilog=examples("gpuslice reconfig run --routers default/gpuslice-router "
                        "--leader-elect --lease gpuslice-system/gpuslice-reconfig",
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
    run.add_argument("--routers", action="append", default=[], metavar="NAMESPACE/SERVICE",
                     help="the Service of a router Deployment (repeatable): every replica "
                     "behind it (its EndpointSlices' addresses, on the port named by "
                     "--router-admin-port) is asked until none has a request in flight on "
                     "the draining pods (default: wait the schedule's drain timeout)")
    run.add_argument("--router-admin-port", default="admin", metavar="NAME",
                     help="the router Service's port (name or number) of the routers' admin "
                     "API (default admin)")
    run.add_argument("--router-admin", help="one router's admin URL, asked as --routers "
                     "asks each replica (a router outside Kubernetes)")
    run.add_argument("--leader-elect", action="store_true",
                     help="several replicas: only the holder of the Lease acts")
    add_lease(run, "gpuslice-system/gpuslice-reconfig", "the Lease the acting replica holds")
    run.add_argument("--identity", default=None, help="lease holder identity (default: "
                     "$POD_NAME or the host name)")
    run.add_argument("--every", type=positive_float, default=2.0,
                     help="seconds between passes (default 2)")
    run.add_argument("--once", action="store_true", help="one pass, then exit")
    add_log_format(run)
    add_output(plan, json_alias=True)
    r.set_defaults(handler=_reconfig)


def _routers(args: argparse.Namespace, api: Any) -> RouterPort | None:
    """The routers to ask while draining: each --routers Service's replicas, --router-admin."""
    from gpuslice.adapters.http.router_admin import HttpRouter, Routers, ServiceRouters

    parts: list[RouterPort] = []
    for text in getattr(args, "routers", None) or []:
        ns, sep, svc = text.partition("/")
        if not sep or not ns or not svc or "/" in svc:
            raise ValidationError("--routers", "NAMESPACE/SERVICE (a router's Service)", text)
        if not hasattr(api, "list_endpoint_slices"):
            raise ValidationError("--routers", "a cluster (--kubeconfig or in-cluster): "
                                  "--fake-cluster has no EndpointSlices", text)
        parts.append(ServiceRouters(api, ns, svc, args.router_admin_port))
    if getattr(args, "router_admin", None):
        parts.append(HttpRouter(args.router_admin))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Routers(parts)


def _reconfig(args: argparse.Namespace, console: Console) -> int:
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
    router = _routers(args, api) if args.action == "run" else None
    ctl = ReconfigController(api, router=router, minute_of_day=minute)
    if args.action == "run":
        return _run(args, api, ctl)
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


def _run(args: argparse.Namespace, api: ClusterPort, ctl: Any) -> int:
    import os
    import socket
    import time

    from gpuslice.adapters.signals import StopSignals
    from gpuslice.cli.flagtypes import parse_lease
    from gpuslice.services.leader import LeaderElector
    from gpuslice.services.reconfig import LeadingController

    if args.every <= 0:
        raise ValidationError("--every", "a positive number of seconds", args.every)
    elector = None
    if args.leader_elect:
        ns, name = parse_lease(args.lease)
        identity = args.identity or os.environ.get("POD_NAME") or socket.gethostname()
        elector = LeaderElector(api, ns, name, identity, time.time)
    log = setup_logging(args.log_format, "reconfig")  # each step's line, as it happens
    routers = [*args.routers, *([args.router_admin] if args.router_admin else [])]
    log.info("following SliceSchedules every %g s%s%s", args.every,
             f", draining through the routers of {', '.join(routers)}" if routers else
             ", draining for each schedule's drain timeout (no --routers)",
             f"; leader election on Lease {args.lease}" if elector else "",
             extra={"event": "starting", "every_s": args.every, "routers": routers,
                    "lease": args.lease if elector else None})

    def changed(leading: bool) -> None:
        if elector is not None:
            log.info("%s the Lease %s", "holding" if leading else "waiting for", args.lease,
                     extra={"event": "leading" if leading else "following"})

    runner = LeadingController(ctl, elector, changed)
    with StopSignals() as signals:  # SIGTERM (the pod deleted) or Ctrl-C: stop, exit 0
        if args.once:
            runner.step()
            if elector is not None:
                elector.release()
        else:
            runner.run(signals.event, args.every)
    log.info("%s", signals.stopped_line("a move under way resumes at the next start"),
             extra={"event": "stopped"})
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
