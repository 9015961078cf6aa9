"""``gpuslice router``: the inference request router."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from gpuslice.cli.common import (
    KUBECONFIG_HELP,
    Sub,
    add_log_format,
    deprecated_alias,
    examples,
    setup_logging,
)
from gpuslice.cli.flagtypes import non_negative_float, parse_hostport, positive_float
from gpuslice.core.errors import ValidationError


def register(sub: Sub) -> None:
    r = sub.add_parser(
        "router", help="HTTP reverse proxy routing inference requests to the replica that will "
        "answer soonest (or --export mesh weights)",
        description="Route each inference request to the replica that will answer it soonest. "
        "Replicas come from --config (JSON or TOML; reloaded when the file changes or on "
        "SIGHUP), the planner's --plan, or Kubernetes --endpointslices NAMESPACE/SERVICE. "
        "The planner's plan.json names slices, not addresses: give it with --endpointslices "
        "(the Service's ready pods are the replicas, the plan gives their weights), or write "
        "a url per replica into it.",
        epilog=examples("gpuslice router --config router.json --listen 0.0.0.0:8080",
                        "gpuslice router --plan plan.json --endpointslices ml/resnet50"))
    src = r.add_mutually_exclusive_group()
    src.add_argument("--config", type=Path, help="router config (JSON or TOML)")
    src.add_argument("--plan", type=Path, help="the planner's JSON plan (weights from it)")
    r.add_argument("--endpointslices", metavar="NS/SERVICE",
                   help="replicas from the EndpointSlices of a Service (weights from "
                   "--plan/--config when given, matched by pod name)")
    r.add_argument("--models", metavar="M1,M2",
                   help="with --endpointslices alone: the model names this router serves "
                   "(others get 404; default: any model)")
    kubeconfig = r.add_argument("--kubeconfig", help="with --endpointslices: "
                                + KUBECONFIG_HELP)
    deprecated_alias(r, "--kube-api", kubeconfig, apply=_kube_api, metavar="URL")
    r.add_argument("--port-name", help="EndpointSlice port name (default: the first port)")
    r.add_argument("--listen", default="0.0.0.0:8080", help="HOST:PORT (default 0.0.0.0:8080)")
    r.add_argument("--admin", default="0.0.0.0:9901",
                   help="HOST:PORT for /metrics, /replicas, /reload, /healthz ('off' to disable)")
    r.add_argument("--policy", help="routing policy for every service (default from the "
                   "config, else sed): round-robin, weighted-round-robin, least-outstanding, "
                   "p2c, sed")
    r.add_argument("--slo-ms", type=positive_float,
                   help="latency SLO for admission control (overrides the services' slo_ms)")
    r.add_argument("--no-admission", action="store_true",
                   help="never answer 429: queue every request")
    r.add_argument("--access-log", default="-", help="'-' stdout (default), a file, or 'off'")
    r.add_argument("--poll", type=positive_float, default=5.0, metavar="SECONDS",
                   help="with --endpointslices: seconds between reads of the EndpointSlices "
                   "and of the pods marked draining (default 5)")
    r.add_argument("--shutdown-delay", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="on SIGTERM, keep accepting this long, every answer closing its "
                   "connection, while the pod's removal from the Service reaches kube-proxy "
                   "and the clients (default 0; deploy/ sets 5)")
    r.add_argument("--shutdown-grace", type=non_negative_float, default=30.0,
                   metavar="SECONDS",
                   help="then stop accepting and give the requests in flight, streams "
                   "included, this long to finish before they are cut (default 30); the pod's "
                   "terminationGracePeriodSeconds must cover delay + grace")
    r.add_argument("--export", choices=("istio", "envoy"),
                   help="print mesh weights and exit: istio (DestinationRule/VirtualService, "
                   "from --plan or --config) or envoy (endpoint weights; needs a url per "
                   "replica, so --config: Envoy's endpoints are addresses, and a plan names "
                   "slices, not addresses)")
    r.add_argument("--namespace", default="default", help="namespace of exported Istio objects")
    add_log_format(r)
    r.set_defaults(handler=_router)


def _router(args: argparse.Namespace, console: Console) -> int:
    import json

    from gpuslice.adapters.http.config import read_config
    from gpuslice.services import mesh_export
    from gpuslice.services.router import ServeOptions, run

    if args.policy is not None:  # checked whatever the command does with it
        from gpuslice.core.routing import make_routing_policy

        try:
            make_routing_policy(args.policy)
        except ValidationError as exc:
            raise ValidationError("--policy", exc.expected, exc.got) from None
    if args.export:
        path = args.plan or args.config
        if path is None:
            raise ValidationError("--export", "--plan or --config: the replicas to weigh",
                                  None)
        cfg = read_config(path, need_urls=False, field="--plan" if args.plan else "--config")
        missing = [f"{s.name}/{r.name}" for s in cfg.services for r in s.replicas
                   if r.url is None]
        if args.export == "envoy" and missing:
            raise ValidationError("--export envoy", "a url per replica (Envoy's endpoints are "
                                  "addresses, and a plan names slices, not addresses): "
                                  "--config with a url per replica, or urls written into "
                                  "the plan; --export istio works from the plan as it is",
                                  f"{len(missing)} replica(s) of {path} without a url "
                                  f"({', '.join(missing[:2])}"
                                  f"{', ...' if len(missing) > 2 else ''})")
        doc = mesh_export.istio(cfg, args.namespace) if args.export == "istio" \
            else mesh_export.envoy(cfg)
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    if args.slo_ms is not None and not args.slo_ms > 0:
        raise ValidationError("--slo-ms", "a positive number of milliseconds", args.slo_ms)
    listen = parse_hostport("--listen", args.listen)
    admin = None if args.admin == "off" else parse_hostport("--admin", args.admin)
    if admin is not None and _same_address(listen, admin):
        raise ValidationError("--admin", "an address other than --listen's (the proxy and the "
                              "admin endpoints each need a port of their own)", args.admin)
    opts = ServeOptions(
        listen=listen, admin=admin,
        policy=args.policy, slo_ms=args.slo_ms, admission=not args.no_admission,
        access_log=args.access_log, config=args.config, plan=args.plan,
        endpointslices=args.endpointslices, kube_api=getattr(args, "kube_api", None),
        kubeconfig=args.kubeconfig, port_name=args.port_name,
        models=tuple(m.strip() for m in (args.models or "").split(",") if m.strip()),
        poll_s=args.poll, shutdown_delay_s=args.shutdown_delay,
        shutdown_grace_s=args.shutdown_grace,
    )
    if opts.config is None and opts.plan is None and opts.endpointslices is None:
        raise ValidationError("--config", "a router config, a --plan or --endpointslices", None)
    if opts.plan is not None and opts.endpointslices is None:
        _plan_has_urls(opts.plan)
    setup_logging(args.log_format, "router")
    try:
        run(opts)
    except OSError as exc:  # the ports it binds, or the access log it opens
        if getattr(exc, "filename", None) == opts.access_log:
            raise ValidationError("--access-log", "a file it can write", str(exc)) from None
        raise ValidationError("--listen/--admin", "free addresses to listen on",
                              str(exc)) from None
    return 0


def _plan_has_urls(path: Path) -> None:
    """A plan without --endpointslices needs a url per replica: say what to add."""
    from gpuslice.adapters.http.config import read_config

    cfg = read_config(path, need_urls=False, field="--plan")
    missing = [f"{s.name}/{r.name}" for s in cfg.services for r in s.replicas if r.url is None]
    if missing:
        first = cfg.services[0].name
        raise ValidationError(
            "--plan", "replicas to send requests to: the plan names its slices but not their "
            f"addresses. Add --endpointslices NAMESPACE/SERVICE (e.g. --endpointslices "
            f"default/{first}) to take the replicas from the Service's ready pods, weighted by "
            "the plan, or give --config with a url per replica",
            f"{len(missing)} replica(s) without a url ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''})")


def _same_address(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two HOST:PORT would take the same port (port 0 picks a free one each time;
    0.0.0.0 and :: take the port on every address, so they clash with any host)."""
    wildcard = ("0.0.0.0", "::", "")
    return a[1] == b[1] != 0 and (a[0] == b[0] or a[0] in wildcard or b[0] in wildcard)


def _kube_api(ns: argparse.Namespace, url: str) -> None:
    """The former ``--kube-api URL``: an API server answering without credentials (a
    ``kubectl proxy``), still read as before."""
    ns.kube_api = url
