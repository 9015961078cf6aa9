"""``gpuslice profile openai:URL``: a generative profile row of an OpenAI-compatible server."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError

if TYPE_CHECKING:
    from gpuslice.bench.openai_profile import OpenAIProfileOptions

SLICE_KINDS = ("mig", "mps", "whole")


def _options(args: argparse.Namespace) -> OpenAIProfileOptions:
    """The measurement's options from the command line; what is missing or wrong is refused
    naming its option, before any request is sent."""
    from gpuslice.adapters.outputs import check_out_file
    from gpuslice.adapters.profiles.files import SLICE_SIZES, read_generative_profiles
    from gpuslice.bench.openai_profile import OpenAIProfileOptions, parse_url
    from gpuslice.bench.profile import parse_ints

    url = parse_url(args.workload)
    for opt in ("model", "gpu", "slice"):
        if not getattr(args, opt):
            raise ValidationError(f"--{opt}", {
                "model": "the model the requests name (as GET /v1/models lists it)",
                "gpu": "the GPU model the server runs on (gpuslice gpus lists them)",
                "slice": "the server's slice, KIND:SIZE (mig:3, mps:50, whole:7)"}[opt], None)
    gpu = catalog.lookup(args.gpu)
    if gpu is None:
        raise ValidationError("--gpu", "a GPU model of the catalogue (gpuslice gpus lists "
                              "them)", args.gpu)
    kind, _, size_text = args.slice.partition(":")
    lo, hi = SLICE_SIZES.get(kind, (1, 0, ""))[:2]
    if kind not in SLICE_KINDS or not size_text.isdigit() or not lo <= int(size_text) <= hi:
        raise ValidationError("--slice", "KIND:SIZE: mig:1..7 (compute slices), mps:1..100 "
                              "(thread %) or whole:N", args.slice)
    conc = tuple(parse_ints("--concurrency", args.concurrency))
    if not conc or min(conc) < 1:
        raise ValidationError("--concurrency", "whole numbers >= 1", args.concurrency)
    for opt, value in (("--warmup-s", args.warmup_s), ("--window-s", args.window_s)):
        if value is not None and not value >= (0 if opt == "--warmup-s" else 0.1):
            raise ValidationError(opt, "seconds >= 0 (a window of at least 0.1)", value)
    out = args.out or Path("gen-profiles.csv")
    check_out_file(out, "--out")
    if out.is_file() and out.stat().st_size:
        read_generative_profiles(out)  # a batch profile CSV there is refused now, not later
    return OpenAIProfileOptions(
        url=url, model=args.model, gpu=gpu.name, slice_kind=kind, slice_size=int(size_text),
        out=out, name=args.name, concurrency=conc, prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        warmup_s=5.0 if args.warmup_s is None else args.warmup_s,
        window_s=30.0 if args.window_s is None else args.window_s,
        ignore_eos=not args.no_ignore_eos)


def profile_openai(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.bench.openai_profile import run_openai_profile

    opts = _options(args)
    with console.status("measuring") as status:
        def progress(label: str, i: int, n: int) -> None:
            status.update(f"{label} ({i + 1} of {n})")

        point, levels = run_openai_profile(opts, progress)
    table = Table(title=f"{opts.model} on {opts.gpu} {opts.slice_kind}:{opts.slice_size}")
    for col in ("streams", "requests", "prompt tokens", "TTFT p50 ms", "TTFT p99 ms",
                "TPOT ms", "TPOT p99 ms", "output tokens/s"):
        table.add_column(col, justify="right")
    for lv in levels:
        table.add_row(str(lv.concurrency), str(lv.requests), f"{lv.prompt_tokens:.0f}",
                      f"{lv.ttft_p50_ms:.1f}", f"{lv.ttft_p99_ms:.1f}", f"{lv.tpot_ms:.1f}",
                      f"{lv.tpot_p99_ms:.1f}", f"{lv.output_tokens_per_s:.0f}")
    console.print(table)
    console.print(f"wrote {opts.out}: {point.model}, prefill {point.prefill_tokens_per_s:g} "
                  f"tokens/s, decode {point.decode_tokens_per_s:g} tokens/s with "
                  f"{point.max_seqs} sequences", highlight=False)
    return 0
