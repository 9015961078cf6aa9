"""``gpuslice replan``: re-plan from observed load."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

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
from gpuslice.cli.flagtypes import (
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
)
from gpuslice.core.errors import ValidationError

if TYPE_CHECKING:
    from gpuslice.core.planner import FleetType, Plan, Service
    from gpuslice.core.profiles import ProfileSet
    from gpuslice.core.replay import Replanned
    from gpuslice.core.resize import Resize, ServiceUsage

# --usage-from's rule (core/resize.py: ResizeRule), as the help gives them
USAGE_DEFAULTS = {"usage_window": "1d", "shrink_below": 1 / 3, "grow_above": 0.9,
                  "resize_fill": 0.8}


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
        "the router and their Deployments deleted. With --usage-from, each service's "
        "measured use of its share resizes its slices first: smaller ones where its pods "
        "used under --shrink-below of their share, larger ones (or more) at --grow-above or "
        "more, a smaller one proposed only where the replay holds the SLO.",
        epilog=examples("gpuslice replan --example",
                        "gpuslice replan --current plan.json --profiles profiles.csv --services "
                        "services.yaml --rates-from http://127.0.0.1:9901 --usage-from "
                        "http://prometheus:9090 --write-json new.json"))
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
    _usage_options(r)
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


def _usage_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("--usage-from", metavar="URL|FILE",
                   help="measured use of each service's share: a Prometheus server that "
                   "scrapes the node agents (http://HOST:9090), or a file of their /metrics "
                   "(one or more agents, concatenated); each service's slices are resized by "
                   "it before the re-plan (every planned service must be in it)")
    r.add_argument("--usage-window", metavar="DURATION",
                   help="with --usage-from URL: the window the peak use is taken over, a "
                   "Prometheus duration (default 1d)")
    r.add_argument("--shrink-below", type=fraction, metavar="FRACTION",
                   help="with --usage-from: a service whose pods' peak use stayed under this "
                   "fraction of their share gets smaller slices (default 1/3)")
    r.add_argument("--grow-above", type=fraction, metavar="FRACTION",
                   help="with --usage-from: one whose peak reached this fraction gets larger "
                   "slices, or more where its GPU has no room (default 0.9)")
    r.add_argument("--resize-fill", type=fraction, metavar="FRACTION",
                   help="with --usage-from: how full a resized slice may be at the measured "
                   "peak, memory and SMs alike (default 0.8)")


def _check_sources(args: argparse.Namespace) -> None:
    """--rates-from and --usage-from's values and their companions, before any work."""
    from urllib.parse import urlparse

    from gpuslice.planning.usage import check_window, is_url

    if args.rates_from:
        url = urlparse(args.rates_from)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValidationError("--rates-from", "the router's admin URL, like "
                                  "http://HOST:PORT", args.rates_from)
    if args.usage_window is not None and args.usage_from and not is_url(args.usage_from):
        raise ValidationError("--usage-window", "--usage-from URL beside it (a file's samples "
                              "are those it holds)", args.usage_window)
    for key, default in USAGE_DEFAULTS.items():
        if getattr(args, key) is not None and not args.usage_from:
            raise ValidationError(f"--{key.replace('_', '-')}", "--usage-from beside it",
                                  getattr(args, key))
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.usage_from is None:
        return
    check_window(args.usage_window)
    if is_url(args.usage_from) and not urlparse(args.usage_from).hostname:
        raise ValidationError("--usage-from", "a Prometheus URL like http://HOST:9090, or a "
                              "metrics file", args.usage_from)
    if args.shrink_below >= args.grow_above:
        raise ValidationError("--shrink-below", f"a fraction below --grow-above "
                              f"({args.grow_above:g})", args.shrink_below)


def _replan(args: argparse.Namespace, console: Console) -> int:
    import numpy as np

    from gpuslice.adapters.http.config import read_document
    from gpuslice.cli.plan import check_files
    from gpuslice.core.planner import PlanOptions
    from gpuslice.core.replay import plan_and_check, replan
    from gpuslice.planning.run import load_profiles, plan_from_json, read_services

    example_defaults(args)
    _check_sources(args)
    check_files(args)
    current_doc = read_document(args.current, "--current")
    current = plan_from_json(current_doc, str(args.current))
    profiles = load_profiles(args.profiles)
    services = read_services(args.services, positive_rate=False, models=profiles.models())
    usage = _read_usage(args, current, services) if args.usage_from else None
    if args.rates_from:
        services = _measured_rates(args.rates_from, args.window, services)
    fleet, profiles = _fleet(args, current_doc, current, profiles)
    opts = PlanOptions()
    rng = np.random.default_rng(args.seed)
    resizes: tuple[Resize, ...] = ()
    if usage is None:
        inc = replan(profiles, current, services, opts, rng=rng, fleet=fleet)
    else:
        from gpuslice.core.resize import ResizeRule, replan_by_usage

        rule = ResizeRule(args.shrink_below, args.grow_above, args.resize_fill)
        both = replan_by_usage(profiles, current, services, usage, rule, opts, rng=rng,
                               fleet=fleet)
        inc, resizes = both.replanned, both.resizes
    full = plan_and_check(profiles, services, fleet, opts,
                          rng=np.random.default_rng(args.seed + 1)).plan
    say = console if args.output == "table" else Console(stderr=True)
    if args.output == "json":
        print_json(_json(current, inc, full, services, resizes))
    else:
        _table(console, current, inc, full, resizes)
    if args.apply:
        _apply(args, say, current, inc)
    if args.write_json or args.out:
        _write(args, say, inc, services, opts.latency_factor)
    return 0 if all(r.ok for r in inc.replay) else 1


def _read_usage(args: argparse.Namespace, current: Plan,
                services: Sequence[Service]) -> dict[str, ServiceUsage]:
    """--usage-from's use per service; every service of the plan must have some."""
    from gpuslice.planning.usage import read_usage

    usage = read_usage(args.usage_from, args.usage_window)
    missing = [s.name for s in services if current.segments(s.name) and s.name not in usage]
    if missing:
        raise ValidationError("--usage-from", "measured use of every service of the plan "
                              "(the service label of the gpuslice_pod_gpu_* series, from its "
                              "pods' gpuslice.io/service label)",
                              f"{args.usage_from}: none of {', '.join(missing)} (it has "
                              f"{', '.join(usage)})")
    return usage


def _measured_rates(url: str, window: float, services: Sequence[Service]) -> list[Service]:
    """The services at the offered rates the router at ``url`` counts over ``window``."""
    import asyncio

    import aiohttp

    from gpuslice.adapters.http.metrics import request_rates
    from gpuslice.core.planner import Service

    try:
        seen = asyncio.run(request_rates(url, window, by="service", ok_only=False))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise ValidationError("--rates-from", "a router admin URL that answers GET "
                              "/metrics", f"{url}: "
                              f"{' '.join(str(exc).split()) or type(exc).__name__}") from None
    return [Service(s.name, s.model, round(seen.get(s.name, 0.0), 3), s.slo_ms)
            for s in services]


def _fleet(args: argparse.Namespace, current_doc: object, current: Plan,
           profiles: ProfileSet) -> tuple[list[FleetType], ProfileSet]:
    """--fleet, else the fleet the plan was made on (or the types of its GPUs); the profiles
    with those its fleet derives."""
    from gpuslice.cli.plan import read_checked_fleet
    from gpuslice.core.planner import FleetType
    from gpuslice.planning.run import fleet_from_json, with_derived

    if args.fleet:
        fleet = read_checked_fleet(args.fleet)
        return fleet, with_derived(profiles, fleet, args.fleet)
    fleet = fleet_from_json(current_doc) or [
        FleetType(g) for g in sorted({g.gpu for g in current.gpus})]
    return fleet, with_derived(profiles, fleet, args.current)


def _json(current: Plan, inc: Replanned, full: Plan, services: Sequence[Service],
          resizes: Sequence[Resize]) -> dict[str, object]:
    from gpuslice.core.replay import plan_diff

    doc: dict[str, object] = {
        "gpus_before": current.n_gpus, "gpus_after": inc.plan.n_gpus,
        "changes": [{"action": ch.action, "gpu": ch.gpu, "gpu_type": ch.gpu_type,
                     "profile": ch.profile, "start": ch.start, "service": ch.service,
                     "throughput_rps": round(ch.throughput, 3)} for ch in inc.changes],
        "replay": [{"service": r.service, "p99_ms": round(r.p99_ms, 3),
                    "slo_ms": r.slo_ms, "ok": r.ok} for r in inc.replay],
        "freed_gpus": list(inc.freed_gpus),
        "full_replan": {"gpus": full.n_gpus, "changes": len(plan_diff(current, full))},
        "rates": {s.name: s.rate for s in services}}
    if resizes:
        doc["usage"] = [{
            "service": r.service, "action": r.action, "before": list(r.before),
            "after": list(r.after), "reason": r.reason,
            "memory": None if r.usage is None else round(r.usage.memory, 4),
            "sm": None if r.usage is None or r.usage.sm is None else round(r.usage.sm, 4),
        } for r in resizes]
    return doc


def _slices(profiles: Sequence[str]) -> str:
    """``3g.40gb x2, 1g.10gb``: a service's slices, alike ones counted."""
    from collections import Counter

    return ", ".join(p if n == 1 else f"{p} x{n}" for p, n in Counter(profiles).items())


def _table(console: Console, current: Plan, inc: Replanned, full: Plan,
           resizes: Sequence[Resize]) -> None:
    from gpuslice.core.replay import plan_diff

    if resizes:
        u = Table(title="measured use (peak fraction of the share) and the slices it asks for")
        for col in ("service", "memory", "SMs", "proposal", "slices before", "after", "why"):
            u.add_column(col)
        for r in resizes:
            m = r.usage
            u.add_row(r.service, "-" if m is None else f"{m.memory:.0%}",
                      "-" if m is None else "no samples" if m.sm is None else f"{m.sm:.0%}",
                      r.action, _slices(r.before),
                      _slices(r.after) if r.after != r.before else "same", r.reason)
        console.print(u)
    t = Table(title=f"re-plan: {len(inc.changes)} slice change(s), GPUs "
              f"{current.n_gpus} -> {inc.plan.n_gpus}")
    for col in ("action", "GPU", "slice", "service", "req/s"):
        t.add_column(col)
    for ch in inc.changes:
        t.add_row(ch.action, f"{ch.gpu} ({ch.gpu_type})", f"{ch.profile}@{ch.start}",
                  ch.service, f"{ch.throughput:.1f}")
    console.print(t)
    for x in inc.replay:
        console.print(f"{x.service}: replayed p99 {x.p99_ms:.1f} ms (SLO {x.slo_ms:g}) "
                      f"{'ok' if x.ok else 'MISSED'}", highlight=False)
    if inc.freed_gpus:
        console.print(f"frees GPU(s) {', '.join(map(str, inc.freed_gpus))}")
    console.print(f"a full re-plan would use {full.n_gpus} GPUs and change "
                  f"{len(plan_diff(current, full))} slices", highlight=False)


def _apply(args: argparse.Namespace, say: Console, current: Plan, inc: Replanned) -> None:
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


def _write(args: argparse.Namespace, say: Console, inc: Replanned,
           services: Sequence[Service], latency_factor: float) -> None:
    from gpuslice.core.planner import validate
    from gpuslice.planning.export import write_exports, write_json
    from gpuslice.planning.run import PlanRun, to_json

    doc = to_json(PlanRun(inc.plan, list(services), list(inc.replay), 0.0, 0.0, 1, {},
                          validate(inc.plan, services, latency_factor), {}))
    if args.write_json:
        write_json(args.write_json, doc, "--write-json")
        say.print(f"wrote {args.write_json}", highlight=False)
    if args.out:
        for path in write_exports(args.out, inc.plan, doc, field="--out"):
            say.print(f"wrote {path}", highlight=False)


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
