"""``gpuslice mig`` (MIG geometry) and ``gpuslice mig-apply`` (apply a mig-parted config)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from gpuslice.cli.common import (
    EXIT_FAILED,
    FAKE_INVENTORY_HELP,
    KUBECONFIG_HELP,
    Sub,
    add_fake_gpus,
    add_output,
    examples,
    local_nvml,
    no_gpu,
    print_json,
)
from gpuslice.core import catalog, mig
from gpuslice.core.errors import ValidationError

if TYPE_CHECKING:
    from gpuslice.adapters.nvml.port import NvmlPort


def register(sub: Sub) -> None:
    m = sub.add_parser("mig", help="MIG geometry of a GPU model: maximal layouts, or check one",
                       description="MIG geometry from the catalogue: every maximal layout of a "
                       "GPU model, whether a layout is legal (--layout), or what still fits "
                       "next to a partly used GPU (--used). Exit 1 when a layout is invalid.",
                       epilog=examples("gpuslice mig H100-SXM --layout "
                                       "3g.40gb@0,2g.20gb@4,1g.10gb@6",
                                       "gpuslice mig A30 --used 2g.12gb@0"))
    m.add_argument("model", help="GPU model, e.g. A100-80GB, H100-SXM, A30")
    m.add_argument("--layout", help="check a layout such as '3g.40gb@0,2g.20gb@4,1g.10gb@6'")
    m.add_argument("--used", help="partly used GPU: list what still fits next to this layout")
    add_output(m)
    m.set_defaults(handler=_mig)
    ma = sub.add_parser(
        "mig-apply", help="apply a MIG layout from a mig-parted config (only on idle GPUs)",
        description="Apply one config of an NVIDIA mig-parted file (mig-devices counts, or "
        "gpuslice's mig-placements) to this node's MIG-enabled GPUs; never changes MIG mode; "
        "--dry-run prints what would change.",
        epilog=examples("gpuslice mig-apply mig-parted.yaml --config all-1g.10gb --dry-run",
                        "gpuslice mig-apply mig-parted.yaml --config all-1g.10gb --fake-gpus "
                        "inventory.yaml"))
    ma.add_argument("file", type=Path, help="mig-parted YAML (version v1, mig-configs)")
    ma.add_argument("--config", required=True, help="the config name inside the file")
    ma.add_argument("--dry-run", action="store_true", help="show the changes, change nothing")
    add_fake_gpus(ma, FAKE_INVENTORY_HELP, old_fake=True)
    ma.add_argument("--node", help="label this node with the progress (in-cluster access, "
                    "--kubeconfig or --fake-cluster)")
    msrc = ma.add_mutually_exclusive_group()
    msrc.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    msrc.add_argument("--fake-cluster", type=Path, help="YAML with 'nodes' (for trying it out)")
    ma.set_defaults(handler=_mig_apply)


def _mig(args: argparse.Namespace, console: Console) -> int:
    model = catalog.resolve(args.model)
    if model.mig is None:
        raise ValidationError("model", "a MIG-capable GPU model (A30, A100, H100, H200)",
                              args.model)
    geo = model.mig
    as_json = args.output == "json"
    if args.layout:
        layout = mig.parse_layout(geo, args.layout)
        problems = mig.layout_problems(geo, layout)
        if as_json:
            print_json({"model": model.name, "layout": [str(p) for p in layout],
                        "valid": not problems, "problems": problems})
            return EXIT_FAILED if problems else 0
        if problems:
            for p in problems:
                console.print(f"invalid: {p}", highlight=False)
            return 1
        console.print(f"valid: {', '.join(str(p) for p in layout)}", highlight=False)
        return 0
    if args.used is not None:
        used = mig.parse_layout(geo, args.used)
        problems = mig.layout_problems(geo, used)
        if problems:
            raise ValidationError("--used", "a valid layout", "; ".join(problems))
        fits = mig.fitting_placements(geo, used)
        if as_json:
            print_json({"model": model.name, "used": [str(p) for p in used],
                        "fits": [str(p) for p in fits]})
            return 0
        console.print(f"still fits next to {args.used or 'nothing'}:", highlight=False)
        for pl in fits:
            console.print(f"  {pl}", highlight=False)
        return 0
    layouts = mig.maximal_layouts(geo)
    if as_json:
        print_json({"model": model.name,
                    "maximal_layouts": [[str(p) for p in lay] for lay in layouts]})
        return 0
    console.print(f"{model.name}: {len(layouts)} maximal layouts", highlight=False)
    for lay in layouts:
        console.print("  " + ", ".join(str(p) for p in lay), highlight=False)
    return 0


def _mig_apply(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import KubePort, load_fake_cluster
    from gpuslice.services.mig_executor import MigExecutor, read_config

    config = read_config(args.file)  # the file first: a bad one is bad input with or without GPUs
    if args.config not in config["mig-configs"]:
        raise ValidationError("--config", f"one of {', '.join(config['mig-configs'])}",
                              args.config)
    nvml: NvmlPort = local_nvml(args, args.node or "node")
    if not nvml.devices():
        raise no_gpu(nvml, "to apply a MIG layout to")
    api: KubePort | None = None
    if args.node:
        api = (load_fake_cluster(args.fake_cluster) if args.fake_cluster
               else KubeClient(args.kubeconfig))
    report = MigExecutor(nvml, api, args.node or "").apply(config, args.config,
                                                          dry_run=args.dry_run,
                                                          source=str(args.file))
    for uuid, changes in report.changes.items():
        what = ", ".join(str(c) for c in changes)
        if uuid in report.skipped:
            console.print(f"{uuid}: not applied: {report.skipped[uuid]}; then: {what}",
                          highlight=False, soft_wrap=True)
        else:
            verb = "would" if args.dry_run else "changed:"
            console.print(f"{uuid}: {verb} {what}", highlight=False, soft_wrap=True)
    for uuid, why in report.skipped.items():
        if uuid not in report.changes:
            console.print(f"{uuid}: not applied: {why}", highlight=False, soft_wrap=True)
    if not report.changes and not report.skipped:
        console.print("nothing to change: every GPU has the layout already", highlight=False)
    console.print(f"state: {report.state}", highlight=False)
    # a GPU the config cannot be applied to (as it stands) is a failure, dry run or not
    return 0 if report.state in ("success", "dry-run") and not report.skipped else 1
