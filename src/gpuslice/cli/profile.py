"""``gpuslice profile``: model profiles on the local GPU."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gpuslice.cli.common import Sub, examples
from gpuslice.core.errors import ValidationError


def register(sub: Sub) -> None:
    p = sub.add_parser(
        "profile", help="measure a model on the local GPU into the planner's profile format",
        description="Measure a model across MPS thread caps (and the MIG instances that exist "
        "where MIG is already enabled), batch sizes and process counts, with warm-up and fixed "
        "windows; rows go to the CSV as they are measured (an interrupted run resumes), and a "
        "plot of throughput against slice size is written beside it. Workloads: resnet50, "
        "mobilenet_v3, vit_b_16, efficientnet_b0, encoder, tiny, cmd:PROGRAM (RUN <batch> / "
        "OK lines on stdin/stdout) or an http:// URL (POST per batch, X-Batch-Size). "
        "openai:URL measures an OpenAI-compatible server (vLLM, Triton's OpenAI frontend) on a "
        "slice instead: streamed chat completions at a few concurrencies, TTFT, TPOT and "
        "tokens/s, into a generative profile row (plan --gen-profiles).",
        epilog=examples("gpuslice profile resnet50 --out profiles.csv",
                        "gpuslice profile openai:http://10.0.0.7:8000/v1 --model "
                        "Qwen/Qwen2.5-0.5B-Instruct --gpu L4 --slice mps:50 --out gen.csv"))
    p.add_argument("workload", help="what to measure: a built-in model (resnet50, tiny, ...), "
                   "cmd:PROGRAM, an http:// URL or openai:http://HOST:PORT/v1 (see above)")
    p.add_argument("--out", type=Path,
                   help="the profile CSV to write (and resume; default profiles.csv, "
                   "gen-profiles.csv for openai:, where a row replaces one of the same model, "
                   "GPU and slice)")
    p.add_argument("--name", default="", help="model name in the CSV (default: the workload; "
                   "for openai:, --model)")
    p.add_argument("--model", help="openai: the model the requests name (required there)")
    p.add_argument("--gpu", help="openai: the GPU model the server runs on, as the catalogue "
                   "names it (gpuslice gpus; required there)")
    p.add_argument("--slice", help="openai: its slice, KIND:SIZE: mig:3 (compute slices), "
                   "mps:50 (thread %%) or whole:7 (required there)")
    p.add_argument("--concurrency", default="1,4,16",
                   help="openai: streams at once, one level after another (default 1,4,16)")
    p.add_argument("--prompt-tokens", type=_positive_int, default=1000,
                   help="openai: the prompt's length in tokens, about (default 1000)")
    p.add_argument("--output-tokens", type=_positive_int, default=200,
                   help="openai: max_tokens of each request (default 200)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="openai: leave vLLM's ignore_eos out of the requests (a server that "
                   "refuses it); answers may then end early")
    p.add_argument("--caps", default="10,20,30,50,70,100", help="MPS thread percentages")
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes (default 1,2,4,8)")
    p.add_argument("--procs", default="1,2,3", help="processes sharing the slice")
    p.add_argument("--warmup-s", type=float,
                   help="seconds of warm-up before each measurement (default 2; openai: 5)")
    p.add_argument("--window-s", type=float,
                   help="seconds each measurement lasts (default 5; openai: 30)")
    p.add_argument("--device", type=int, default=0, help="GPU index")
    p.add_argument("--no-mig", action="store_true", help="skip the MIG instances")
    p.add_argument("--fake-timer", metavar="MODEL@GPU",
                   help="no GPU: time the tiny workload by the speed model as if it were MODEL "
                   "on GPU (e.g. resnet50@A100-80GB); stand-in numbers, for trying it and CI")
    p.add_argument("--mps-binary", default="nvidia-cuda-mps-control",
                   help="the MPS control program (default nvidia-cuda-mps-control; tests give "
                   "a stand-in)")
    p.set_defaults(handler=_profile)


def _positive_int(text: str) -> int:
    """argparse ``type=``: a whole number >= 1 (tokens)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def check_name(spec: str) -> None:
    """A plain workload name is one of the built-in ones, or another torchvision model that
    only torchvision can vouch for: without it installed, an unknown name is refused here
    with the known ones, before any GPU is looked for (``check_workload`` checks the rest)."""
    import importlib.util

    from gpuslice.bench.workloads import BUILTIN

    if spec in BUILTIN or spec.startswith(("cmd:", "http://", "https://", "timm:", "openai:")):
        return
    if importlib.util.find_spec("torchvision") is None:
        raise ValidationError("workload", f"one of {', '.join(BUILTIN)}, timm:NAME, "
                              "cmd:PROGRAM or http://HOST:PORT/PATH (other torchvision model "
                              "names once torchvision is installed)", spec)


def _profile(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.outputs import check_out_file, write_files
    from gpuslice.bench.profile import ProfileOptions, parse_ints, plot_knee, run_profile

    check_name(args.workload)
    if args.workload.startswith("openai:"):
        from gpuslice.cli.profile_openai import profile_openai

        return profile_openai(args, console)
    args.out = args.out or Path("profiles.csv")
    args.warmup_s = 2.0 if args.warmup_s is None else args.warmup_s
    args.window_s = 5.0 if args.window_s is None else args.window_s
    check_out_file(args.out, "--out")  # before the measurements, not after them
    opts = ProfileOptions(
        workload=args.workload, out=args.out, model_name=args.name,
        caps=parse_ints("--caps", args.caps), batches=parse_ints("--batches", args.batches),
        procs=parse_ints("--procs", args.procs), warmup_s=args.warmup_s,
        window_s=args.window_s, mig=not args.no_mig, fake_timer=args.fake_timer,
        device_index=args.device, mps_binary=args.mps_binary)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("profiling", total=None)

        def progress(label: str, i: int, n: int) -> None:
            bar.update(task, description=label, completed=i, total=n)

        points = run_profile(opts, progress)
    console.print(f"measured {len(points)} configuration(s) into {args.out}"
                  + ("" if points else " (all were there already)"), highlight=False)
    if args.out.is_file():
        png = args.out.with_suffix(".png")
        write_files({png: lambda path: plot_knee(args.out, path)}, "--out")
        console.print(f"wrote {png}", highlight=False)
    return 0
