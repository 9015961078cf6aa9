"""``gpuslice replan``: re-plan from observed load."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpuslice.adapters.profiles import builtin
from gpuslice.cli.common import (
    KUBECONFIG_HELP,
    Sub,
    add_export_dir,
    add_output,
    add_write_json,
    builtin_help,
    builtin_path,
    examples,
    input_path,
    print_json,
)
from gpuslice.cli.flagtypes import non_negative_float, non_negative_int, positive_float
from gpuslice.core.errors import ValidationError


def register(sub: Sub) -> None:
    r = sub.add_parser(
        "replan", help="re-plan from observed request rates: the smallest set of slice changes",
        description="Read the current plan (gpuslice plan --write-json), take each service's "
        "request rate from the router's metrics (or the services file), and propose the "
        "fewest slice changes that restore every SLO or free GPUs, checked by replay; a full "
        "re-plan is shown beside it for comparison. Without --apply nothing changes: "
        "--write-json/--out write the new plan for the usual path (manifests, "
        "SliceSchedule layouts). With "
        "--apply the change is made on the cluster, the safe way: the added slices' "
        "Deployments first, running and ready, then the removed slices' pods drained through "
        "the router and their Deployments deleted.",
        epilog=examples("gpuslice replan --example",
                        "gpuslice replan --current plan.json --profiles profiles.csv --services "
                        "services.yaml --rates-from http://127.0.0.1:9901 --write-json new.json"))
    r.add_argument("--current", type=input_path("plan"),
                   help="the plan in force (JSON, from gpuslice plan --write-json), "
                   + builtin_help("plan"))
    r.add_argument("--profiles", type=input_path("profiles"),
                   help="profiles (folder or CSV), " + builtin_help("profiles"))
    r.add_argument("--services", type=input_path("services"),
                   help="services file (models, SLOs, and rates unless --rates-from), "
                   + builtin_help("services"))
    r.add_argument("--example", action="store_true",
                   help=f"re-plan the example that ships with gpuslice: --current "
                   f"builtin:{builtin.EXAMPLE_PLAN} (builtin:{builtin.EXAMPLE_SERVICES}'s "
                   f"services planned) --profiles builtin:{builtin.EXAMPLE_PROFILES} "
                   f"--services builtin:{builtin.EXAMPLE_OBSERVED} (the same services under "
                   "another load); options given beside it take their place")
    r.add_argument("--rates-from", metavar="URL",
                   help="router admin URL: offered rates measured over --window")
    r.add_argument("--window", type=positive_float, default=10.0,
                   help="with --rates-from: seconds to measure over (default 10)")
    r.add_argument("--fleet", type=input_path("fleet"),
                   help="fleet file (GPU types, counts, costs), " + builtin_help("fleet"))
    r.add_argument("--seed", type=non_negative_int, default=1,
                   help="seed of the replays, a whole number >= 0 (default 1)")
    add_write_json(r, "the new plan")
    add_export_dir(r, " of the new plan")
    r.add_argument("--apply", action="store_true",
                   help="apply the change to the cluster: added slices' Deployments first, "
                   "ready, then the removed slices' pods drained and their Deployments deleted")
    r.add_argument("--namespace", default="default", help="with --apply: the plan's namespace")
    r.add_argument("--image", default="REPLACE-WITH-YOUR-MODEL-SERVER-IMAGE",
                   help="with --apply: the model server image of the Deployments")
    r.add_argument("--router-admin", help="with --apply: ask this router when the removed "
                   "pods have drained (default: wait --drain-s)")
    r.add_argument("--drain-s", type=non_negative_float, default=60.0,
                   help="with --apply: seconds to wait for the removed pods to drain when "
                   "there is no --router-admin to ask, and at most with one: a number >= 0, "
                   "0 not to wait (default 60)")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help="with --apply: " + KUBECONFIG_HELP)
    src.add_argument("--fake-cluster", type=Path,
                     help="with --apply: nodes and pods from a YAML file instead of a cluster "
                     "(to try it out; see examples/fake-cluster.yaml)")
    add_output(r)
    r.set_defaults(handler=_replan)


def _replan(args: argparse.Namespace, console: Console) -> int:
    import asyncio
    from urllib.parse import urlparse

    import numpy as np

    from gpuslice.adapters.http.config import read_document
    from gpuslice.cli.plan import check_files, read_checked_fleet
    from gpuslice.core.planner import FleetType, PlanOptions, Service, validate
    from gpuslice.core.replay import plan_and_check, plan_diff, replan
    from gpuslice.planning.export import write_exports, write_json
    from gpuslice.planning.run import (
        PlanRun,
        fleet_from_json,
        load_profiles,
        plan_from_json,
        read_services,
        to_json,
        with_derived,
    )

    example_defaults(args)
    if args.rates_from:
        url = urlparse(args.rates_from)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValidationError("--rates-from", "the router's admin URL, like "
                                  "http://HOST:PORT", args.rates_from)
    check_files(args)
    current_doc = read_document(args.current, "--current")
    current = plan_from_json(current_doc, str(args.current))
    profiles = load_profiles(args.profiles)
    services = read_services(args.services, positive_rate=False, models=profiles.models())
    if args.rates_from:
        import aiohttp

        from gpuslice.adapters.http.metrics import request_rates

        try:
            seen = asyncio.run(request_rates(args.rates_from, args.window, by="service",
                                             ok_only=False))
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ValidationError("--rates-from", "a router admin URL that answers GET "
                                  "/metrics", f"{args.rates_from}: "
                                  f"{' '.join(str(exc).split()) or type(exc).__name__}") from None
        services = [Service(s.name, s.model, round(seen.get(s.name, 0.0), 3), s.slo_ms)
                    for s in services]
    if args.fleet:
        fleet = read_checked_fleet(args.fleet)
        profiles = with_derived(profiles, fleet, args.fleet)
    else:  # the fleet the plan was made on, or the types of its GPUs
        fleet = fleet_from_json(current_doc) or [
            FleetType(g) for g in sorted({g.gpu for g in current.gpus})]
        profiles = with_derived(profiles, fleet, args.current)
    opts = PlanOptions()
    inc = replan(profiles, current, services, opts, rng=np.random.default_rng(args.seed),
                 fleet=fleet)
    full = plan_and_check(profiles, services, fleet, opts,
                          rng=np.random.default_rng(args.seed + 1)).plan
    say = console if args.output == "table" else Console(stderr=True)
    if args.output == "json":
        print_json({
            "gpus_before": current.n_gpus, "gpus_after": inc.plan.n_gpus,
            "changes": [{"action": ch.action, "gpu": ch.gpu, "gpu_type": ch.gpu_type,
                         "profile": ch.profile, "start": ch.start, "service": ch.service,
                         "throughput_rps": round(ch.throughput, 3)} for ch in inc.changes],
            "replay": [{"service": r.service, "p99_ms": round(r.p99_ms, 3),
                        "slo_ms": r.slo_ms, "ok": r.ok} for r in inc.replay],
            "freed_gpus": list(inc.freed_gpus),
            "full_replan": {"gpus": full.n_gpus, "changes": len(plan_diff(current, full))},
            "rates": {s.name: s.rate for s in services}})
    if args.output == "table":
        t = Table(title=f"re-plan: {len(inc.changes)} slice change(s), GPUs "
                  f"{current.n_gpus} -> {inc.plan.n_gpus}")
        for col in ("action", "GPU", "slice", "service", "req/s"):
            t.add_column(col)
        for ch in inc.changes:
            t.add_row(ch.action, f"{ch.gpu} ({ch.gpu_type})", f"{ch.profile}@{ch.start}",
                      ch.service, f"{ch.throughput:.1f}")
        console.print(t)
        for r in inc.replay:
            console.print(f"{r.service}: replayed p99 {r.p99_ms:.1f} ms (SLO {r.slo_ms:g}) "
                          f"{'ok' if r.ok else 'MISSED'}", highlight=False)
        if inc.freed_gpus:
            console.print(f"frees GPU(s) {', '.join(map(str, inc.freed_gpus))}")
        console.print(f"a full re-plan would use {full.n_gpus} GPUs and change "
                      f"{len(plan_diff(current, full))} slices", highlight=False)
    if args.apply:
        from gpuslice.adapters.http.router_admin import HttpRouter
        from gpuslice.adapters.kube.fake import ClusterPort, load_fake_cluster
        from gpuslice.planning.apply import apply_plan

        if not all(r.ok for r in inc.replay):
            raise ValidationError("--apply", "a re-plan whose replay meets every SLO",
                                  [r.service for r in inc.replay if not r.ok])
        api: ClusterPort
        if args.fake_cluster is not None:
            api = load_fake_cluster(args.fake_cluster)
        else:
            from gpuslice.adapters.kube.client import KubeClient

            api = KubeClient(args.kubeconfig)
        for line in apply_plan(api, current, inc.plan, namespace=args.namespace,
                               image=args.image, drain_timeout_s=args.drain_s,
                               router=HttpRouter(args.router_admin) if args.router_admin
                               else None):
            say.print(line, highlight=False)
    if args.write_json or args.out:
        doc = to_json(PlanRun(inc.plan, list(services), list(inc.replay), 0.0, 0.0, 1, {},
                              validate(inc.plan, services, opts.latency_factor), {}))
        if args.write_json:
            write_json(args.write_json, doc, "--write-json")
            say.print(f"wrote {args.write_json}", highlight=False)
        if args.out:
            for path in write_exports(args.out, inc.plan, doc, field="--out"):
                say.print(f"wrote {path}", highlight=False)
    return 0 if all(r.ok for r in inc.replay) else 1


def example_defaults(args: argparse.Namespace) -> None:
    """``--example``: the shipped plan, profiles and services where no option names others;
    without it, --current, --profiles and --services are required."""
    if args.example:
        for option, kind, name in (("current", "plan", builtin.EXAMPLE_PLAN),
                                   ("profiles", "profiles", builtin.EXAMPLE_PROFILES),
                                   ("services", "services", builtin.EXAMPLE_OBSERVED)):
            if getattr(args, option) is None:
                setattr(args, option, builtin_path(kind, name))
    for option, kind, what in (("current", "plan", "the plan in force (JSON)"),
                               ("profiles", "profiles", "a profile folder or CSV"),
                               ("services", "services", "a services file")):
        if getattr(args, option) is None:
            raise ValidationError(f"--{option}", f"{what}, {builtin.expected(kind)}, or "
                                  "--example", None)
