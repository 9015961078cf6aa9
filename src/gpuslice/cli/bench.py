"""``gpuslice bench``: GPU sharing benchmarks."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuslice.cli.common import EXIT_FAILED, Sub, examples
from gpuslice.core.errors import ValidationError


def register(sub: Sub) -> None:
    b = sub.add_parser("bench", help="GPU sharing benchmarks on the local GPU",
                       description="GPU sharing benchmarks on the local GPU; each prints PASS or "
                       "FAIL per check and exits 1 when a check fails.",
                       epilog=examples("gpuslice bench sharing --profile profiles.csv",
                                       "gpuslice bench sharing --fake-timer resnet50@A100-80GB "
                                       "--workload tiny"))
    bs = b.add_subparsers(dest="bench", required=True, metavar="COMMAND",
                          title="commands (gpuslice bench COMMAND --help for each)")
    s = bs.add_parser(
        "sharing", help="time-slicing vs MPS vs gpuslice slices, noisy neighbour, memory cap",
        description="N replicas under exclusive-sequential, time-slicing, MPS without limits "
        "and gpuslice slices (100/N % of the threads, 1/N of the memory each); a "
        "latency-critical replica next to best-effort ones; a replica allocating past its "
        "memory cap. Prints a "
        "table with the acceptance gates and writes JSON and a plot to --out.",
        epilog=examples("gpuslice bench sharing --profile profiles.csv",
                        "gpuslice bench sharing --fake-timer resnet50@A100-80GB --workload tiny "
                        "--parts throughput"))
    s.add_argument("--workload", default="resnet50",
                   help="the model every replica runs (default resnet50; as gpuslice profile)")
    s.add_argument("--replicas", type=int, default=7,
                   help="replicas sharing the GPU in the throughput part (default 7)")
    s.add_argument("--repeats", type=int, default=1,
                   help="runs of each throughput mode, interleaved, so the run-to-run spread "
                   "is reported (default 1)")
    s.add_argument("--batch", type=int, default=8,
                   help="batch size of those replicas (default 8)")
    s.add_argument("--lc-batch", type=int, default=1,
                   help="noisy neighbour: batch size of the latency-critical replica "
                   "(default 1)")
    s.add_argument("--be-batch", type=int, default=64,
                   help="noisy neighbour: batch size of the best-effort replicas (default 64)")
    s.add_argument("--be-replicas", type=int, default=3,
                   help="noisy neighbour: best-effort replicas (default 3)")
    s.add_argument("--noisy-splits", default="",
                   help="noisy neighbour: more LC/BE thread caps to run gpuslice with, e.g. "
                   "50/30,60/40 (the trade-off between the LC p99 and the BE throughput)")
    s.add_argument("--warmup-s", type=float, default=3.0,
                   help="seconds of warm-up before each measurement (default 3)")
    s.add_argument("--window-s", type=float, default=10.0,
                   help="seconds each measurement lasts (default 10)")
    s.add_argument("--profile", type=Path,
                   help="profile CSV (gpuslice profile) for the noisy neighbour's caps")
    s.add_argument("--gpu", default="", help="GPU model in the profile (default: the only one)")
    s.add_argument("--mem-cap-mib", type=int, default=4096,
                   help="memory part: the replica's MPS memory cap in MiB (default 4096)")
    s.add_argument("--alloc-mib", type=int, default=6144,
                   help="memory part: MiB it then tries to allocate, past the cap "
                   "(default 6144)")
    s.add_argument("--parts", default="throughput,noisy,memory",
                   help="comma-separated parts to run (default throughput,noisy,memory)")
    s.add_argument("--device", type=int, default=0, help="GPU index (NVML) to run on")
    s.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="folder for sharing.json and sharing.png (default bench-out)")
    s.add_argument("--fake-timer", metavar="MODEL@GPU",
                   help="no GPU: run the tiny workload timed by the speed model as if on GPU "
                   "(e.g. resnet50@A100-80GB; MODEL: bert-base, embedder, mobilenet-v3 or "
                   "resnet50; the slices' memory is GPU's); stand-in numbers, for trying it "
                   "and for CI")
    s.add_argument("--mps-binary", default="nvidia-cuda-mps-control",
                   help="the MPS control program (default nvidia-cuda-mps-control; tests give "
                   "a stand-in)")
    s.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace, console: Console) -> int:
    import contextlib
    import json

    from gpuslice.adapters.outputs import check_out_dir, write_files
    from gpuslice.bench.sharing import SharingOptions, plot_sharing, run_sharing

    prof = None
    gpu = args.gpu
    if args.profile is not None:
        from gpuslice.adapters.profiles.files import read_own_profiles

        prof = read_own_profiles(args.profile)
        if not gpu:
            gpus = prof.gpus()
            if len(gpus) != 1:
                raise ValidationError("--gpu", f"one of {gpus}", gpu)
            gpu = gpus[0]
    opts = SharingOptions(
        workload=args.workload, replicas=args.replicas, batch=args.batch,
        lc_batch=args.lc_batch, be_batch=args.be_batch, be_replicas=args.be_replicas,
        warmup_s=args.warmup_s, window_s=args.window_s, profile=prof, gpu=gpu,
        fake_timer=args.fake_timer, mps_binary=args.mps_binary, mem_cap_mib=args.mem_cap_mib,
        alloc_mib=args.alloc_mib, parts=tuple(p.strip() for p in args.parts.split(",")),
        device_index=args.device, repeats=args.repeats,
        noisy_splits=_splits(args.noisy_splits))
    created = not args.out.exists()
    check_out_dir(args.out, ("sharing.json", "sharing.png"), "--out")  # before the runs
    try:
        res = run_sharing(opts, lambda text: console.print(text, style="dim", markup=False))
    except BaseException:  # no result: leave no empty folder behind
        if created:
            with contextlib.suppress(OSError):
                args.out.rmdir()
        raise
    text = json.dumps(res, indent=1)
    write_files({args.out / "sharing.json": lambda path: path.write_text(text),
                 args.out / "sharing.png": lambda path: plot_sharing(res, path)}, "--out")
    gates = _throughput_table(args, res, console) + _noisy_tables(res, console) + \
        _memory_line(res, console)
    for name, ok in gates:
        console.print(f"{'PASS' if ok else 'FAIL'}  {name}", highlight=False)
    if res.get("fake_timer"):
        console.print("fake timer: these are the speed model's stand-in numbers, not a GPU's")
    console.print(f"wrote {args.out / 'sharing.json'} and {args.out / 'sharing.png'}",
                  highlight=False)
    failed = [name for name, ok in gates if not ok]
    if failed:
        console.print(f"{len(failed)} of {len(gates)} checks failed", highlight=False)
        return EXIT_FAILED
    return 0


def _throughput_table(args: argparse.Namespace, res: dict[str, Any],
                      console: Console) -> list[tuple[str, bool]]:
    """The throughput part's table and its goals (none without that part)."""
    if "throughput" not in res:
        return []
    thr = res["throughput"]
    g = thr["gpuslice"]
    t = Table(title=f"{args.replicas} x {args.workload} batch {args.batch}, "
              f"{args.repeats} run(s) each; gpuslice slices {_pcts(g['caps'])} threads, "
              f"{g['mem_cap_mib']} MiB")
    for col in ("mode", "req/s", "each run", "x one replica", "x time-slicing",
                "run spread", "per-replica CV", "worst p99 ms"):
        t.add_column(col, justify="right")
    for m, v in thr.items():
        t.add_row(m, f"{v['total_rps']:.1f}", " / ".join(f"{x:.1f}" for x in v["runs_rps"]),
                  f"{v['vs_one_replica']:.2f}", f"{v['vs_time_slicing']:.2f}",
                  f"{100 * v['run_spread']:.1f}%", f"{100 * v['cv']:.1f}%",
                  f"{v['worst_p99_ms']:.1f}")
    console.print(t)
    return [("gpuslice >= 1.7x time-slicing", g["vs_time_slicing"] >= 1.7),
            ("per-replica CV <= 5%", g["cv"] <= 0.05)]


def _noisy_tables(res: dict[str, Any], console: Console) -> list[tuple[str, bool]]:
    """The noisy-neighbour part's tables (the modes, then the trade-off curve) and its goals,
    met when some split holds both (the caps a user would choose)."""
    if "noisy" not in res:
        return []
    t = Table(title=f"noisy neighbour (solo p99 {res['noisy']['solo_p99_ms']:.2f} ms, "
              f"gpuslice caps {_pcts(res['noisy']['caps'])})")
    for col in ("mode", "LC p99 ms", "x solo", "BE req/s", "BE x MPS"):
        t.add_column(col, justify="right")
    for m in ("time-slicing", "mps", "gpuslice-caps", "gpuslice"):
        v = res["noisy"][m]
        t.add_row(m, f"{v['lc_p99_ms']:.2f}", f"{v['lc_p99_vs_solo']:.2f}",
                  f"{v['be_rps']:.1f}", f"{v['be_vs_mps']:.2f}")
    console.print(t)
    splits = res["noisy"]["splits"]
    if len(splits) > 1:
        t = Table(title="gpuslice's trade-off: LC / BE thread caps (BE at below-normal "
                  "MPS client priority)")
        for col in ("LC / BE caps", "LC p99 ms", "x solo", "BE req/s", "BE x MPS"):
            t.add_column(col, justify="right")
        for v in splits:
            t.add_row(f"{v['caps'][0]}% / {v['caps'][1]}%", f"{v['lc_p99_ms']:.2f}",
                      f"{v['lc_p99_vs_solo']:.2f}", f"{v['be_rps']:.1f}",
                      f"{v['be_vs_mps']:.2f}")
        console.print(t)
    both = [v for v in splits if v["lc_p99_vs_solo"] <= 1.1 and v["be_vs_mps"] >= 0.85]
    g = both[0] if both else res["noisy"]["gpuslice"]
    return [("LC p99 <= 1.1x solo", g["lc_p99_vs_solo"] <= 1.1),
            ("BE keeps >= 85% of uncapped MPS", g["be_vs_mps"] >= 0.85)]


def _memory_line(res: dict[str, Any], console: Console) -> list[tuple[str, bool]]:
    """The memory-cap part's line and its goals."""
    if "memory" not in res:
        return []
    m = res["memory"]
    over = m["over_cap"] or {}
    console.print(f"memory cap {m['cap_mib']} MiB: allocating {m['alloc_mib']} MiB -> "
                  f"{'allowed' if over.get('ok') else over.get('error', 'no answer')}; "
                  f"neighbours at {m['neighbours_ratio']:.2f}x their throughput",
                  highlight=False, soft_wrap=True)
    return [("over-cap allocation fails", over.get("ok") is False),
            ("neighbours unaffected (>= 0.9x)", m["neighbours_ratio"] >= 0.9)]


def _splits(text: str) -> tuple[tuple[int, int], ...]:
    """``--noisy-splits 50/30,60/40``: (LC %, BE %) pairs (their range: SharingOptions)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        lc, sep, be = item.partition("/")
        try:
            out.append((int(lc), int(be)))
        except ValueError:
            raise ValidationError("--noisy-splits", "LC/BE thread percentages such as 50/30",
                                  item) from None
        if not sep:
            raise ValidationError("--noisy-splits", "LC/BE thread percentages such as 50/30",
                                  item)
    return tuple(out)


def _pcts(caps: list[int]) -> str:
    """Thread caps for a title: ``14%`` when they are all alike, ``50%/30%`` else."""
    return f"{caps[0]}%" if len(set(caps)) == 1 else "/".join(f"{c}%" for c in caps)
