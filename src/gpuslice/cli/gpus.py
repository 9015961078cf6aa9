"""``gpuslice gpus``: the GPU catalogue, or what NVML sees on this machine."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from gpuslice.cli.common import (
    EXIT_FAILED,
    FAKE_GPUS_HELP,
    Sub,
    add_fake_gpus,
    add_output,
    examples,
    local_nvml,
    no_gpu,
    print_json,
)
from gpuslice.core import catalog


def register(sub: Sub) -> None:
    g = sub.add_parser("gpus", help="list the GPU catalogue, or this machine's GPUs (--local)",
                       description="Without options: the catalogue of GPU models the planner and "
                       "extender know. --local: the GPUs NVML reports on this machine, with their "
                       "MIG profiles and placements checked against the catalogue.",
                       epilog=examples("gpuslice gpus -o json", "gpuslice gpus --local"))
    g.add_argument("--local", action="store_true", help="this machine's GPUs, through NVML")
    add_fake_gpus(g, "with --local: " + FAKE_GPUS_HELP)
    add_output(g)
    g.set_defaults(handler=_gpus_command)


def _gpus_command(args: argparse.Namespace, console: Console) -> int:
    if args.fake_gpus and not args.local:
        from gpuslice.core.errors import ValidationError

        raise ValidationError("--fake-gpus", "--local with it (the catalogue has no GPUs "
                              "of its own)", args.fake_gpus)
    if args.output == "json":
        return _local_json(args) if args.local else _catalogue_json()
    return _local_gpus(args, console) if args.local else _gpus(console)


def _catalogue_json() -> int:
    print_json([{
        "model": m.name, "memory_mib": m.memory_mib, "sms": m.sms,
        "fp16_tflops": m.fp16_tflops, "bf16_tflops": m.bf16_tflops,
        "compute_capability": ".".join(map(str, m.compute_capability))
        if m.compute_capability else None, "mps": bool(m.mps_limits),
        "mig_profiles": [p.name for p in m.mig.profiles] if m.mig else []}
        for m in catalog.known_models()])
    return 0


def _local_json(args: argparse.Namespace) -> int:
    nv = local_nvml(args)
    gpus = nv.devices()
    out = []
    for gpu in gpus:
        model = catalog.lookup(gpu.model)
        profiles = nv.mig_profiles(gpu.uuid)
        diff = catalog.mig_table_differences(model, profiles) \
            if model and model.mig and profiles else []
        out.append({
            "index": gpu.index, "uuid": gpu.uuid, "name": gpu.name, "model": gpu.model,
            "memory_mib": gpu.memory_mib, "sms": gpu.sms,
            "compute_capability": ".".join(map(str, gpu.compute_capability))
            if gpu.compute_capability else None,
            "mig_enabled": gpu.mig_enabled,
            "mig_instances": [{"profile": m.profile, "start": m.start, "uuid": m.uuid}
                              for m in gpu.mig],
            "catalogue_differs": diff})
    print_json({"driver": nv.driver_version(), "gpus": out,
                "why_empty": nv.why_empty() if not gpus else None})
    if not gpus:
        raise no_gpu(nv)  # the document above on stdout, the error on stderr, exit 1
    return EXIT_FAILED if any(g["catalogue_differs"] for g in out) else 0


def _gpus(console: Console) -> int:
    table = Table(title="GPU catalogue")
    for col in ("model", "memory MiB", "SMs", "FP16 TFLOPS", "BF16 TFLOPS", "CC", "MPS caps",
                "MIG profiles"):
        table.add_column(col)
    for m in catalog.known_models():
        cc = f"{m.compute_capability[0]}.{m.compute_capability[1]}" if m.compute_capability else "-"
        table.add_row(
            m.name, str(m.memory_mib), str(m.sms or "-"), str(m.fp16_tflops or "-"),
            str(m.bf16_tflops or "-"), cc, "yes" if m.mps_limits else "no",
            ", ".join(p.name for p in m.mig.profiles) if m.mig else "-",
        )
    console.print(table)
    return 0


def _ranges(values: Sequence[int]) -> str:
    """0,1,2,3,4,5,6 -> 0-6; 0,2,4 stays."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and runs[-1][-1] == v - 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def _local_gpus(args: argparse.Namespace, console: Console) -> int:
    """What discovery sees: NVML's devices and MIG tables, and whether the catalogue agrees."""
    nv = local_nvml(args)
    gpus = nv.devices()
    if not gpus:
        raise no_gpu(nv)
    console.print(f"driver {nv.driver_version()}", highlight=False)
    disagree = 0
    for gpu in gpus:
        cc = ".".join(map(str, gpu.compute_capability)) if gpu.compute_capability else "-"
        console.print(f"GPU {gpu.index}: {gpu.name} ({gpu.model}), {gpu.uuid}, "
                      f"{gpu.memory_mib} MiB, {gpu.sms or '?'} SMs, CC {cc}, "
                      f"MIG {'enabled' if gpu.mig_enabled else 'disabled'}", highlight=False)
        for m in gpu.mig:
            console.print(f"  instance {m.profile}@{m.start} {m.uuid}", highlight=False)
        profiles = nv.mig_profiles(gpu.uuid)
        if not profiles:
            continue
        table = Table(title=f"GPU {gpu.index}: MIG profiles as NVML reports them")
        for col in ("profile", "ID", "compute", "memory slices", "MiB", "SMs", "max", "starts"):
            table.add_column(col)
        for p in sorted(profiles, key=lambda p: (p.compute_slices, p.memory_slices, p.name)):
            table.add_row(p.name, str(p.profile_id), str(p.compute_slices),
                          str(p.memory_slices), str(p.memory_mib), str(p.sms),
                          str(p.max_instances), _ranges(p.starts))
        console.print(table)
        model = catalog.lookup(gpu.model)
        diff = catalog.mig_table_differences(model, profiles) if model and model.mig else []
        if model is None or model.mig is None:
            console.print(f"  the catalogue has no MIG table for {gpu.name}: the planner and "
                          "extender will not place MIG slices on it", highlight=False)
        elif diff:
            disagree += 1
            console.print(f"  the catalogue's {gpu.model} table differs for: {', '.join(diff)}",
                          highlight=False)
        else:
            console.print(f"  the catalogue's {gpu.model} table agrees", highlight=False)
    return 1 if disagree else 0
