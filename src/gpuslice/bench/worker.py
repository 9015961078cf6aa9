"""One benchmark process: load a workload, wait for ``GO`` on stdin (so that co-located workers
start together), then for each batch size warm up and measure a fixed window; one JSON line per
batch size on stdout (``{"batch", "throughput", "p50_ms", "p99_ms", "batches"}``), then
``{"done": true}``; ``{"error": ...}`` and exit status 1 on a failure.

    python -m gpuslice.bench.worker --workload resnet50 --batches 1,8 --warmup-s 2 --window-s 5

``--fake-timer MODEL@GPU`` runs the tiny NumPy workload but charges each batch the time the
speed model gives (``gpuslice.core.speedmodel``) on a virtual clock, so the whole pipeline runs
on a CPU in a fraction of a second with known numbers to check. The slice is the
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` cap; without one, ``GPUSLICE_FAKE_MODE`` = ``mps`` shares
the GPU evenly among ``GPUSLICE_FAKE_PROCS`` processes and ``timeslice`` gives each the whole
GPU one turn in N; co-running processes slow each other 5% each. These are stand-ins to
exercise the code, not claims about real GPUs.

Workers that share a GPU finish their windows at slightly different times; so that none is
measured running alone at the end, a real (not fake-timer) worker then says
``{"holding": true}`` and keeps running batches of its last size until ``STOP`` arrives on stdin
(the runner sends it once every worker has reported).

``--alloc-mib N`` then tries to allocate N MiB of GPU memory and reports
``{"alloc": {"ok": ..., "error": ...}}`` (the memory-cap check); with the fake timer the limit
is the one in ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np


def measure(run: Callable[[int], float], batch: int, warmup_s: float,
            window_s: float) -> dict[str, float]:
    """``run(batch)`` returns the seconds one batch took; warm up, then a fixed window."""
    spent = 0.0
    while spent < warmup_s:
        spent += run(batch)
    lat: list[float] = []
    spent = 0.0
    while spent < window_s or len(lat) < 3:
        t = run(batch)
        lat.append(t)
        spent += t
    arr = np.array(lat)
    return {"batch": batch, "throughput": batch * len(lat) / float(arr.sum()),
            "p50_ms": float(np.percentile(arr, 50)) * 1000,
            "p99_ms": float(np.percentile(arr, 99)) * 1000, "batches": len(lat)}


def _runner(args: argparse.Namespace) -> tuple[Callable[[int], float], Callable[[], None]]:
    from gpuslice.bench.workloads import make_workload

    if args.fake_timer:
        from gpuslice.bench.workloads import TinyWorkload
        from gpuslice.core.speedmodel import service_time_s

        model, _, gpu = args.fake_timer.partition("@")
        tiny = TinyWorkload()
        procs = int(os.environ.get("GPUSLICE_FAKE_PROCS", "1"))
        mode = os.environ.get("GPUSLICE_FAKE_MODE", "mps")
        cap = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        share, turns = (float(cap) / 100, 1) if cap else \
            ((1.0, procs) if mode == "timeslice" else (1.0 / procs, 1))
        slow = 1 + 0.05 * (procs - 1)

        def fake(batch: int) -> float:
            tiny.run(batch)  # the code path runs; the clock is virtual
            return service_time_s(model, gpu or "H100-SXM", share, batch) * slow * turns

        return fake, tiny.close
    w = make_workload(args.workload, args.device)

    def real(batch: int) -> float:
        t0 = time.perf_counter()
        w.run(batch)
        return time.perf_counter() - t0

    return real, w.close


def allocate(args: argparse.Namespace) -> dict[str, object]:
    """Try to hold ``--alloc-mib`` MiB of GPU memory."""
    mib = args.alloc_mib
    if args.fake_timer:
        raw = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
        limit = int(raw.split("=", 1)[1].rstrip("MG")) if "=" in raw else None
        if limit is not None and mib > limit:
            return {"ok": False, "mib": mib, "error": f"OutOfMemoryError (fake timer: over "
                    f"the pinned limit of {limit} MiB)"}
        return {"ok": True, "mib": mib}
    from gpuslice.bench.workloads import _torch

    torch = _torch()
    try:
        held = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        del held
        return {"ok": True, "mib": mib}
    except torch.OutOfMemoryError as exc:
        return {"ok": False, "mib": mib, "error": f"OutOfMemoryError: {str(exc)[:200]}"}


def hold(run: Callable[[int], float], batch: int) -> int:
    """Keep the GPU as busy as while measuring until the runner says STOP (or goes away);
    the number of batches run meanwhile."""
    stop = threading.Event()

    def wait() -> None:
        sys.stdin.readline()  # STOP, or end of file when the runner is gone
        stop.set()

    threading.Thread(target=wait, daemon=True).start()
    print(json.dumps({"holding": True}), flush=True)
    n = 0
    while not stop.is_set():
        run(batch)
        n += 1
    return n


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one gpuslice benchmark worker")
    ap.add_argument("--workload", default="tiny")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--window-s", type=float, default=5.0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--fake-timer", default=None, metavar="MODEL@GPU")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for GO on stdin")
    ap.add_argument("--alloc-mib", type=int, default=0)
    args = ap.parse_args(argv)
    from gpuslice.core.errors import GpusliceError

    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        run, close = _runner(args)
        print(json.dumps({"ready": True}), flush=True)
        if not args.no_wait and sys.stdin.readline().strip() != "GO":
            return 1
        for b in batches:
            print(json.dumps(measure(run, b, args.warmup_s, args.window_s)), flush=True)
        if args.alloc_mib:
            print(json.dumps({"alloc": allocate(args)}), flush=True)
        held = hold(run, batches[-1]) if not args.no_wait and not args.fake_timer and batches \
            else 0
        close()
    except (GpusliceError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    except Exception as exc:  # a CUDA out-of-memory or a crash in the workload
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"done": True, "held_batches": held}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
