"""``gpuslice plan``: the SLA planner."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from gpuslice.adapters.profiles import builtin
from gpuslice.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    Sub,
    add_export_dir,
    add_output,
    add_write_json,
    builtin_help,
    builtin_path,
    examples,
    input_path,
    print_json,
    read_yaml,
    writable_dir,
    writable_file,
)
from gpuslice.cli.flagtypes import fraction, non_negative_int, positive_float
from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError

if TYPE_CHECKING:
    from gpuslice.core.planner import FleetType, Plan, Service
    from gpuslice.core.profiles import ProfileSet
    from gpuslice.planning.run import GenerativePlan

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123 label

def register(sub: Sub) -> None:
    p = sub.add_parser(
        "plan", help="SLA planner: the fewest (or cheapest) GPU slices that meet every SLO",
        description="Plan MIG slices (with MPS processes inside) for services with request "
        "rates and latency SLOs, from measured profiles; check the plan by replaying Poisson "
        "arrivals through it; optionally export mig-parted configs and Kubernetes manifests.",
        epilog=examples("gpuslice plan --example --objective cost --out out/",
                        "gpuslice plan --profiles profiles.csv --services services.yaml "
                        "--write-json plan.json"))
    p.add_argument("--profiles", type=input_path("profiles"),
                   help="ParvaGPU folder (with prof_data/) or a gpuslice profile CSV (required "
                   "unless --example), "
                   + builtin_help("profiles"))
    p.add_argument("--gen-profiles", type=input_path("gen-profiles"),
                   help="generative profile CSV (model, gpu, slice_kind, slice_size, "
                   "prefill_tokens_per_s, decode_tokens_per_s, max_seqs) for the services that "
                   "give slo_ttft_ms and slo_tpot_ms (docs/planner.md), "
                   + builtin_help("gen-profiles"))
    p.add_argument("--slo-rate", type=Path, help="ParvaGPU SLO_req_rate.csv (default: "
                   "PROFILES/SLO/SLO_req_rate.csv)")
    p.add_argument("--slo-latency", type=Path, help="ParvaGPU SLO_latency.csv (default: "
                   "PROFILES/SLO/SLO_latency.csv)")
    p.add_argument("--scenario", type=int, help="scenario (row) of the SLO files, from 1 "
                   "(instead of --services)")
    p.add_argument("--services", type=input_path("services"),
                   help="services YAML/JSON: [{name, model, rate, slo_ms}], or generative "
                   "ones with slo_ttft_ms, slo_tpot_ms, prompt_tokens, output_tokens in place "
                   "of slo_ms (instead of SLO files), " + builtin_help("services"))
    p.add_argument("--fleet", type=input_path("fleet"),
                   help="fleet YAML/JSON: [{gpu, count, cost_per_hour (dollars),"
                   " profiles_from (a profiled GPU standing in for an unprofiled one)}] "
                   "(default: unlimited GPUs of every profiled type), " + builtin_help("fleet"))
    p.add_argument("--example", action="store_true",
                   help=f"plan the example that ships with gpuslice: --profiles "
                   f"builtin:{builtin.EXAMPLE_PROFILES} --services builtin:"
                   f"{builtin.EXAMPLE_SERVICES} --fleet builtin:{builtin.EXAMPLE_FLEET} "
                   "(options given beside it take their place)")
    p.add_argument("--objective", choices=("gpus", "cost"), default="gpus",
                   help="minimise the number of GPUs (default) or their cost per hour (the "
                   "fleet's cost_per_hour); the report gives the cost and the lower bound in "
                   "$/h")
    p.add_argument("--solver", choices=("auto", "milp", "greedy"), default="auto",
                   help="milp (exact, within --time-limit), greedy, or auto (default: milp up "
                   "to 60 services, greedy above)")
    p.add_argument("--latency-factor", type=fraction, default=0.45,
                   help="a configuration serves a model only if its batch latency <= this x "
                   "SLO: a fraction, more than 0 and at most 1 (default 0.45, ParvaGPU's "
                   "rule)")
    p.add_argument("--no-mix", action="store_true",
                   help="one service per MIG instance (no MPS sharing between services)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the replay-driven re-planning (the final replay still runs)")
    p.add_argument("--time-limit", type=positive_float, default=1.0,
                   help="solver seconds per planning round (default 1.0)")
    add_write_json(p, "the plan")
    add_export_dir(p, "")
    p.add_argument("--namespace", default="default",
                   help="with --out: the namespace of the manifests (default default)")
    p.add_argument("--image", default="REPLACE-WITH-YOUR-MODEL-SERVER-IMAGE",
                   help="with --out: the model server image the Deployments run")
    p.add_argument("--port", type=int, default=8000,
                   help="with --out: the port the model server listens on, the container's "
                   "'http' port that each service's Service (port 80) sends to (default 8000)")
    p.add_argument("--seed", type=non_negative_int, default=1,
                   help="seed of the replay, a whole number >= 0 (default 1)")
    add_output(p)
    p.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.core.planner import PlanOptions
    from gpuslice.core.profiles import ProfileSet
    from gpuslice.planning.run import (
        load_profiles,
        parva_baseline,
        run_plan,
        scenario_services,
        to_json,
        with_derived,
    )

    example_defaults(args)
    check_files(args)
    opts = PlanOptions(latency_factor=args.latency_factor, objective=args.objective,
                       solver=args.solver, time_limit_s=args.time_limit, mix=not args.no_mix)
    profiles = load_profiles(args.profiles) if args.profiles is not None else ProfileSet(())
    baselines: dict[str, int | None] = {}
    generative: dict[str, GenerativePlan] = {}
    if args.services is not None:
        services, profiles, generative = _read_services(args, profiles, opts.latency_factor)
    elif args.scenario is not None:
        if args.profiles is None:
            raise ValidationError("--profiles", "a ParvaGPU profile folder, whose SLO/ files "
                                  "--scenario reads", None)
        services = scenario_services(args.profiles, args.slo_rate, args.slo_latency,
                                     args.scenario)
        if args.profiles.is_dir():
            baselines["parvagpu"] = parva_baseline(args.profiles, args.scenario)
    else:
        raise ValidationError("--scenario", "a scenario number, or --services FILE", None)
    if args.fleet:
        fleet = read_checked_fleet(args.fleet)
        profiles = with_derived(profiles, fleet, args.fleet)
    else:
        fleet = default_fleet(args.profiles or args.gen_profiles, profiles)
    run = run_plan(profiles, services, fleet, opts, seed=args.seed, check=not args.no_check,
                   baselines=baselines, priced=args.fleet is not None)
    doc = to_json(run, generative)
    status = EXIT_OK if not doc["errors"] and not doc["problems"] else EXIT_FAILED
    if args.output == "json":
        _write(args, run.plan, doc, console)
        print_json(doc)
        return status
    _print_plan(doc, console)
    _write(args, run.plan, doc, console)
    return status


def _read_services(args: argparse.Namespace, profiles: ProfileSet, latency_factor: float
                   ) -> tuple[list[Service], ProfileSet, dict[str, GenerativePlan]]:
    """``--services``, its generative services (if any) turned into the planner's services and
    profile points from ``--gen-profiles``; ``profiles`` with those points added; how the
    generative ones were sized."""
    from gpuslice.adapters.profiles.files import read_generative_profiles
    from gpuslice.core.profiles import ProfileSet
    from gpuslice.planning.run import plannable, read_plan_services

    points = [] if args.gen_profiles is None else \
        read_generative_profiles(args.gen_profiles, catalogue_gpus=True)
    items = read_plan_services(args.services, models=profiles.models(),
                               gen_models=sorted({p.model for p in points}))
    services, extra, sized = plannable(args.services, items, points, latency_factor)
    return services, ProfileSet.of([*profiles.points, *extra]) if extra else profiles, sized


def money(x: float) -> str:
    """A cost per hour as the report prints it: ``$4.10/h``."""
    return f"${x:,.2f}/h"


def headline(doc: dict[str, Any]) -> str:
    """The title of the plan's table: the GPUs by type, their cost per hour at the fleet's
    prices, the solver and its bound in the objective's own unit (GPUs, or $/h)."""
    n = doc["gpus"]
    what = f"{n} GPU{'' if n == 1 else 's'}"
    parts = [f"{k} x {g}" for g, k in sorted(doc["gpus_by_type"].items())]
    if doc.get("cost_per_hour") is not None:
        parts.append(money(doc["cost_per_hour"]))
    if parts:
        what += f" ({', '.join(parts)})"
    bound = doc["lower_bound"]
    floor = money(bound) if doc["objective"] == "cost" else f"{bound:.2f} GPUs"
    return (f"plan: {what}; {doc['solver']}, lower bound {floor}, planned in "
            f"{doc['seconds']['plan']:.2f} s")


def _print_plan(doc: dict[str, Any], console: Console) -> None:
    table = Table(title=headline(doc))
    for col in ("service", "rate", "SLO ms", "capacity", "slices", "replayed p99 ms", "SLO met"):
        table.add_column(col, justify="right")
    for s in doc["services"]:
        slices = ", ".join(f"{x['profile']}@{x['start']}/g{x['gpu']} b{x['batch']}x{x['procs']}"
                           for x in s["segments"])
        table.add_row(s["name"], f"{s['rate_rps']:g}", f"{s['slo_ms']:g}",
                      f"{s['capacity_rps']:.0f}", slices or "-",
                      "-" if s["replayed_p99_ms"] is None else f"{s['replayed_p99_ms']:.1f}",
                      "-" if s["slo_met"] is None else ("yes" if s["slo_met"] else "NO"))
    console.print(table)
    base = doc["baselines"]
    gpus_bound = "" if doc["objective"] == "cost" else \
        f" | lower bound {doc['lower_bound']:.2f}"
    console.print(
        f"GPUs: gpuslice {doc['gpus']} | ParvaGPU {base.get('parvagpu') or '-'} | exclusive "
        f"{base.get('exclusive')}{gpus_bound}", highlight=False)
    if doc.get("cost_per_hour") is not None:
        line = f"cost: {money(doc['cost_per_hour'])} at the fleet's prices"
        if doc["objective"] == "cost":
            line += f" (lower bound {money(doc['lower_bound'])})"
        else:
            line += " (--objective cost minimises it)"
        if doc["single_type_cost"] and len(doc["gpus_by_type"]) > 1:
            best = min(doc["single_type_cost"].items(), key=lambda kv: kv[1])
            if best[1] > 0:
                line += (f"; the cheapest single GPU type, {best[0]}, costs {money(best[1])}: "
                         f"{100 * (1 - doc['cost_per_hour'] / best[1]):.1f}% saved")
        console.print(line, highlight=False)
    for pr in doc["problems"]:
        console.print(f"[yellow]not planned[/] {pr['service']}: {pr['reason']}")
    for e in doc["errors"]:
        console.print(f"[red]invalid[/] {e}")


def example_defaults(args: argparse.Namespace) -> None:
    """``--example``: the shipped profiles, services and fleet where no option names others;
    without it, ``--profiles`` is required."""
    if args.example:
        if args.profiles is None:
            args.profiles = builtin_path("profiles", builtin.EXAMPLE_PROFILES)
        if args.services is None and args.scenario is None:
            args.services = builtin_path("services", builtin.EXAMPLE_SERVICES)
        if args.fleet is None:
            args.fleet = builtin_path("fleet", builtin.EXAMPLE_FLEET)
    if args.profiles is None and getattr(args, "gen_profiles", None) is None:
        raise ValidationError("--profiles", "a profile folder or CSV, "
                              f"{builtin.expected('profiles')}, or --example", None)


def _no_mig(gpu: str) -> str | None:
    """Why the planner, which packs MIG slices, cannot plan on ``gpu``; None if it can."""
    model = catalog.lookup(gpu)
    if model is None:
        return "not in the catalogue"
    return "a GPU without MIG" if model.mig is None else None


def read_checked_fleet(path: Path) -> list[FleetType]:
    """``--fleet FILE``, each GPU a MIG-capable model of the catalogue: one that is not is
    refused naming the file, entry and field (the planner's own error cannot name them)."""
    from gpuslice.adapters.traces.alibaba import InputError
    from gpuslice.planning.run import read_fleet

    fleet = read_fleet(path)
    for row, ft in enumerate(fleet, start=1):
        why = _no_mig(ft.gpu)
        if why:
            known = ", ".join(m.name for m in catalog.known_models() if m.mig is not None)
            raise InputError(path, row, "gpu", f"expected a MIG-capable GPU model of the "
                             f"catalogue ({known}; gpuslice gpus lists them), got {ft.gpu!r} "
                             f"({why})")
    return fleet


def default_fleet(profiles_path: Path, profiles: ProfileSet) -> list[FleetType]:
    """Without ``--fleet``: unlimited GPUs of every profiled type, each of which must have MIG;
    one without is refused naming the profile file and the first row of it."""
    from gpuslice.adapters.profiles.files import gpu_row
    from gpuslice.adapters.traces.alibaba import InputError
    from gpuslice.core.planner import FleetType

    for gpu in profiles.gpus():
        why = _no_mig(gpu)
        if why:
            raise InputError(profiles_path, gpu_row(profiles_path, gpu), "gpu",
                             "expected a MIG-capable GPU (without --fleet the plan uses every "
                             "GPU type profiled; --fleet FILE names the ones to plan on), got "
                             f"{gpu!r} ({why})")
    return [FleetType(g) for g in profiles.gpus()]


def check_files(args: argparse.Namespace) -> None:
    """What can be said before planning: the outputs can be written and the YAML inputs
    parse (one line naming the file and the line, not PyYAML's several)."""
    if args.write_json is not None:
        writable_file(args.write_json, "--write-json")
    port, image = getattr(args, "port", 8000), getattr(args, "image", "x")  # plan's alone
    if not 1 <= port <= 65535:
        raise ValidationError("--port", "a port 1..65535", port)
    if not image.strip():
        raise ValidationError("--image", "an image reference", image)
    namespace = getattr(args, "namespace", "default")
    if not _NAMESPACE.fullmatch(namespace):
        raise ValidationError("--namespace", "a namespace name (lower-case letters, digits and "
                              "'-', at most 63)", namespace)
    if args.out is not None:
        from gpuslice.planning.export import check_export_dir

        writable_dir(args.out, "--out")
        check_export_dir(args.out, "--out")
    for path, field in ((args.services, "--services"), (args.fleet, "--fleet")):
        if path is not None and path.is_file():
            read_yaml(path, field)


def _write(args: argparse.Namespace, plan: Plan, doc: dict[str, Any], console: Console) -> None:
    """--write-json and --out files (each written whole or not at all); with -o json
    their names go to stderr."""
    from gpuslice.planning.export import write_exports, write_json

    say = console if args.output == "table" else Console(stderr=True)
    if args.write_json:
        write_json(args.write_json, doc, "--write-json")
        say.print(f"wrote {args.write_json}", highlight=False)
    if args.out:
        extra = {k: getattr(args, k) for k in ("namespace", "image", "port")
                 if hasattr(args, k)}
        for path in write_exports(args.out, plan, doc, field="--out", **extra):
            say.print(f"wrote {path}", highlight=False)

