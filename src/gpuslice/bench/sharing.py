"""``gpuslice bench sharing``: how GPU sharing modes compare, measured side by side.

1. **Throughput**: N replicas of one model at one batch size under exclusive-sequential (one
   replica alone: the replicas would run one after another), time-slicing (N processes, no
   MPS), MPS without limits, and gpuslice slices (MPS, each replica capped at 100/N % of the
   threads and 1/N of the GPU's memory: what the device plugin gives N replicas of a 1/N
   share; a profile sizes only the noisy neighbour's caps). Each mode runs
   ``repeats`` times, the modes interleaved (so a drifting GPU clock moves them alike): total
   throughput (mean over the runs, and each run's), its ratio to time-slicing, the run-to-run
   spread, the coefficient of variation of per-replica throughput (the worst run's) and the
   worst per-replica p99.
2. **Noisy neighbour**: one latency-critical replica (batch 1) next to best-effort ones (large
   batch): its p99 against its p99 alone, and the best-effort throughput against uncapped MPS,
   under time-slicing, uncapped MPS, gpuslice caps alone (sized for an SLO of 1.1 x the solo
   p99) and gpuslice (those caps, and the best-effort replicas at below-normal MPS client
   priority, as the device plugin gives pods marked best-effort).
3. **Memory cap**: replicas under MPS with a pinned memory limit; one allocates past it and
   must get an out-of-memory error while the others' throughput stays as it was.

Each MPS mode runs under its own control daemon with private pipe and log directories, quit
before the command ends. ``--fake-timer`` runs everything on the CPU with the speed model's
stand-in numbers (code paths only, not results).
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuslice.adapters.mps import pinned_mem_limit
from gpuslice.bench.runner import WorkerSpec, check_seconds, find_gpu, run_together
from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError
from gpuslice.core.model import PRIORITIES
from gpuslice.core.profiles import ProfileSet
from gpuslice.core.sizing import Tenant, Unsizable, size_slices
from gpuslice.core.speedmodel import parse_fake_timer


@dataclass(frozen=True)
class SharingOptions:
    workload: str = "resnet50"
    replicas: int = 7
    batch: int = 8
    lc_batch: int = 1
    be_batch: int = 64
    be_replicas: int = 3
    warmup_s: float = 3.0
    window_s: float = 10.0
    profile: ProfileSet | None = None
    gpu: str = ""  # GPU model for the profile lookup
    fake_timer: str | None = None
    mps_binary: str = "nvidia-cuda-mps-control"
    mem_cap_mib: int = 4096
    alloc_mib: int = 6144
    parts: tuple[str, ...] = ("throughput", "noisy", "memory")
    device_index: int = 0  # the GPU (NVML index) every mode runs on
    repeats: int = 1  # runs of each throughput mode
    # noisy neighbour: more (latency-critical %, best-effort %) caps to run gpuslice with
    noisy_splits: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 48:
            raise ValidationError("--replicas", "1 to 48", self.replicas)
        if not 1 <= self.repeats <= 10:
            raise ValidationError("--repeats", "1 to 10", self.repeats)
        # the noisy neighbour runs the latency-critical replica beside the best-effort ones
        if not 1 <= self.be_replicas <= 47:
            raise ValidationError("--be-replicas", "1 to 47 best-effort replicas",
                                  self.be_replicas)
        for flag, batch in (("--batch", self.batch), ("--lc-batch", self.lc_batch),
                            ("--be-batch", self.be_batch)):
            if not 1 <= batch <= 4096:
                raise ValidationError(flag, "a batch size of 1 to 4096", batch)
        check_seconds("--warmup-s", self.warmup_s, zero_ok=True)
        check_seconds("--window-s", self.window_s, zero_ok=False)
        for lc, be in self.noisy_splits:
            # the LC replica's thread % and each BE replica's: MPS caps each client on its
            # own, so they may add up past 100 (BE 60% beside LC 50%: the trade-off curve)
            if not (1 <= lc <= 100 and 1 <= be <= 100):
                raise ValidationError("--noisy-splits", "LC/BE thread percentages of 1 to 100",
                                      f"{lc}/{be}")
        if self.mem_cap_mib < 1:
            raise ValidationError("--mem-cap-mib", "a memory cap of at least 1 MiB",
                                  self.mem_cap_mib)
        if self.alloc_mib <= self.mem_cap_mib:
            raise ValidationError("--alloc-mib", "more than --mem-cap-mib", self.alloc_mib)
        if self.device_index < 0:
            raise ValidationError("--device", "a GPU index >= 0", self.device_index)
        if self.fake_timer is not None:
            parse_fake_timer(self.fake_timer)
        for p in self.parts:
            if p not in ("throughput", "noisy", "memory"):
                raise ValidationError("--parts", "throughput, noisy and/or memory", p)


class _Mps:
    """A private MPS control daemon on the benchmark's GPU for one mode (none with the fake
    timer)."""

    def __init__(self, opts: SharingOptions, root: Path, name: str, gpu_uuid: str) -> None:
        self.daemon: Any = None
        self.gpu = gpu_uuid
        if opts.fake_timer:
            return
        from gpuslice.adapters.mps import MpsDaemon

        self.daemon = MpsDaemon(gpu_uuid, root / name / "pipe", root / name / "log",
                                binary=opts.mps_binary)

    def __enter__(self) -> dict[str, str]:
        if self.daemon is None:
            return {"GPUSLICE_FAKE_MODE": "mps"}
        self.daemon.start()
        return {"CUDA_VISIBLE_DEVICES": self.gpu,
                "CUDA_MPS_PIPE_DIRECTORY": str(self.daemon.pipe_dir),
                "CUDA_MPS_LOG_DIRECTORY": str(self.daemon.log_dir)}

    def __exit__(self, *exc: object) -> None:
        if self.daemon is not None:
            self.daemon.quit()


def _spec(opts: SharingOptions, batch: int, env: dict[str, str], n: int,
          alloc: int = 0) -> WorkerSpec:
    return WorkerSpec(opts.workload, (batch,), opts.warmup_s, opts.window_s,
                      {**env, "GPUSLICE_FAKE_PROCS": str(n)}, opts.fake_timer, alloc)


def _thr(rows: list[list[dict[str, object]]]) -> list[float]:
    return [float(next(r["throughput"] for r in mine if "throughput" in r))  # type: ignore[arg-type]
            for mine in rows]


def _p99(rows: list[dict[str, object]]) -> float:
    return float(next(r["p99_ms"] for r in rows if "p99_ms" in r))  # type: ignore[arg-type]


def _cv(xs: list[float]) -> float:
    """Coefficient of variation (population standard deviation over the mean)."""
    return float(np.std(xs) / np.mean(xs)) if xs and np.mean(xs) > 0 else 0.0


def _spread(xs: list[float]) -> float:
    return float((max(xs) - min(xs)) / np.mean(xs)) if xs and np.mean(xs) > 0 else 0.0


def summarise(runs: dict[str, list[list[list[dict[str, object]]]]]) -> dict[str, Any]:
    """Per mode, from each run's per-worker reports: mean total throughput, each run's total,
    ratios to one replica (``exclusive-sequential``) and to time-slicing, run-to-run spread,
    the worst run's per-replica CV and the worst per-replica p99."""
    totals = {m: [float(np.sum(_thr(r))) for r in rs] for m, rs in runs.items()}
    solo = float(np.mean(totals["exclusive-sequential"]))
    ts = float(np.mean(totals["time-slicing"]))
    out: dict[str, Any] = {}
    for m, rs in runs.items():
        mean = float(np.mean(totals[m]))
        out[m] = {"total_rps": round(mean, 2), "runs_rps": [round(t, 2) for t in totals[m]],
                  "vs_one_replica": round(mean / solo, 3), "vs_time_slicing": round(mean / ts, 3),
                  "run_spread": round(_spread(totals[m]), 4),
                  "cv": round(max(_cv(_thr(r)) for r in rs), 4),
                  "spread": round(max(_spread(_thr(r)) for r in rs), 4),
                  "worst_p99_ms": round(max(_p99(w) for r in rs for w in r), 3),
                  "replicas_rps": [[round(x, 2) for x in _thr(r)] for r in rs]}
    return out


def even_caps(n: int) -> list[int]:
    return [max(1, 100 // n)] * n


def run_sharing(opts: SharingOptions,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda _: None)
    res: dict[str, Any] = {"workload": opts.workload, "replicas": opts.replicas,
                           "batch": opts.batch, "fake_timer": bool(opts.fake_timer)}
    if opts.fake_timer:  # the named GPU's model and memory, as the catalogue has them
        model = catalog.resolve(parse_fake_timer(opts.fake_timer)[1])
        gpu, gpu_mib, res["gpu_name"] = "GPU-fake", model.memory_mib, model.name
    else:
        dev = find_gpu(opts.device_index)
        gpu, gpu_mib = dev.uuid, dev.memory_mib
        res["gpu_name"] = dev.name
    res["gpu"], res["gpu_memory_mib"] = gpu, gpu_mib
    base = {} if opts.fake_timer else {"CUDA_VISIBLE_DEVICES": gpu}  # every mode, one GPU
    with tempfile.TemporaryDirectory(prefix="gsb-") as tmp:
        run = _Parts(opts, say, uuid.uuid4().hex[:12], Path(tmp), gpu, base,
                     {"GPUSLICE_FAKE_MODE": "timeslice"} if opts.fake_timer else base)
        if "throughput" in opts.parts:
            res["throughput"] = run.throughput(gpu_mib)
            res["repeats"] = opts.repeats
        if "noisy" in opts.parts:
            res["noisy"] = run.noisy()
        if "memory" in opts.parts:
            res["memory"] = run.memory()
    return res


@dataclass
class _Parts:
    """The benchmark's parts, each run on one GPU (``gpu``; ``base``: the environment every
    replica gets, ``timeslice``: a time-sliced replica's), MPS daemons under ``root``."""

    opts: SharingOptions
    say: Callable[[str], None]
    run_id: str
    root: Path
    gpu: str
    base: dict[str, str]
    timeslice: dict[str, str]

    def _together(self, specs: list[WorkerSpec], errors_ok: bool = False) \
            -> list[list[dict[str, object]]]:
        return run_together(specs, self.run_id, errors_ok=errors_ok)

    def throughput(self, gpu_mib: int) -> dict[str, Any]:
        """N replicas exclusive one after the other, time-sliced, under MPS without limits
        and as gpuslice's slices (1/N of the threads and of the memory each)."""
        opts, say, n = self.opts, self.say, self.opts.replicas
        caps = even_caps(n)  # what the device plugin gives N replicas of 1/N GPU each
        mem_mib = gpu_mib // n  # each slice's even share of the GPU's memory
        mem_cap = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": pinned_mem_limit(mem_mib)}
        runs: dict[str, list[list[list[dict[str, object]]]]] = {
            m: [] for m in ("exclusive-sequential", "time-slicing", "mps", "gpuslice")}
        for k in range(opts.repeats):
            run = f" (run {k + 1} of {opts.repeats})" if opts.repeats > 1 else ""
            say(f"exclusive: one replica alone{run}")
            runs["exclusive-sequential"].append(
                self._together([_spec(opts, opts.batch, self.base, 1)]))
            say(f"time-slicing: {n} replicas{run}")
            runs["time-slicing"].append(
                self._together([_spec(opts, opts.batch, self.timeslice, n)] * n))
            say(f"MPS without limits: {n} replicas{run}")
            with _Mps(opts, self.root, f"mps-{k}", self.gpu) as env:
                runs["mps"].append(self._together([_spec(opts, opts.batch, env, n)] * n))
            say(f"gpuslice slices: {n} replicas at {caps[0]}% of the threads, {mem_mib} MiB "
                f"each{run}")
            with _Mps(opts, self.root, f"gpuslice-{k}", self.gpu) as env:
                runs["gpuslice"].append(self._together([_spec(opts, opts.batch, {
                    **env, **mem_cap, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(c)}, n)
                    for c in caps]))
        out = summarise(runs)
        out["gpuslice"]["caps"] = caps
        out["gpuslice"]["mem_cap_mib"] = mem_mib
        return out

    def _caps(self, solo_p99: float) -> tuple[int, int, str]:
        """The latency-critical and best-effort thread caps: sized from the profile (the
        LC replica's p99 within 1.1x of alone), else 40% / 20%; and how they were had."""
        opts, k = self.opts, self.opts.be_replicas
        if opts.profile is None:
            return 40, 20, "no profile: the 40% / 20% split"
        try:
            sized = size_slices(
                [Tenant("lc", opts.workload, 1.1 * solo_p99, (opts.lc_batch,))] +
                [Tenant(f"be{i}", opts.workload, None, (opts.be_batch,)) for i in range(k)],
                opts.profile, opts.gpu, step=5)
        except Unsizable as exc:
            sizing = f"the profile gives no caps ({exc}); the 40% / 20% split"
            self.say(sizing)
            return 40, 20, sizing
        return sized[0].thread_pct, min(s.thread_pct for s in sized[1:]), "from the profile"

    def _lc_be(self, env: dict[str, str], lc_pct: int | None = None,
               be_pct: int | None = None, be_priority: bool = False) \
            -> list[list[dict[str, object]]]:
        """The latency-critical replica beside the best-effort ones, each capped when a
        cap is given; ``be_priority``: best-effort work yields to the LC replica's."""
        opts = self.opts
        lc, be = dict(env), dict(env)
        if lc_pct is not None:
            lc["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(lc_pct)
        if be_pct is not None:
            be["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(be_pct)
        if be_priority:
            be["CUDA_MPS_CLIENT_PRIORITY"] = PRIORITIES["best-effort"]
        group = opts.be_replicas + 1
        return self._together([_spec(opts, opts.lc_batch, lc, group)] +
                              [_spec(opts, opts.be_batch, be, group)] * opts.be_replicas)

    def noisy(self) -> dict[str, Any]:
        """The latency-critical replica alone, then beside best-effort ones: time-sliced,
        under MPS without limits, with gpuslice's caps (without and with best-effort at a
        lower client priority) and each split of ``noisy_splits`` (the trade-off curve)."""
        opts, say = self.opts, self.say
        say("noisy neighbour: the latency-critical replica alone")
        solo_p99 = _p99(self._together([_spec(opts, opts.lc_batch, self.base, 1)])[0])
        say("noisy neighbour: time-slicing")
        ts_rows = self._lc_be(self.timeslice)
        say("noisy neighbour: MPS without limits")
        with _Mps(opts, self.root, "noisy-mps", self.gpu) as env:
            mps_rows = self._lc_be(env)
        lc_cap, be_cap, sizing = self._caps(solo_p99)
        say(f"noisy neighbour: gpuslice caps {lc_cap}% / {be_cap}%")
        with _Mps(opts, self.root, "noisy-caps", self.gpu) as env:
            caps_rows = self._lc_be(env, lc_cap, be_cap)
        say(f"noisy neighbour: gpuslice caps {lc_cap}% / {be_cap}%, best-effort at "
            "below-normal MPS client priority")
        with _Mps(opts, self.root, "noisy-gpuslice", self.gpu) as env:
            gs_rows = self._lc_be(env, lc_cap, be_cap, be_priority=True)
        swept = []
        for i, (lc_pct, be_pct) in enumerate(opts.noisy_splits):
            say(f"noisy neighbour: gpuslice caps {lc_pct}% / {be_pct}%, best-effort at "
                "below-normal MPS client priority (the trade-off curve)")
            with _Mps(opts, self.root, f"noisy-split-{i}", self.gpu) as env:
                swept.append(((lc_pct, be_pct), self._lc_be(env, lc_pct, be_pct, True)))
        be_mps = float(np.sum(_thr(mps_rows[1:])))

        def figures(rows: list[list[dict[str, object]]]) -> dict[str, float]:
            return {"lc_p99_ms": round(_p99(rows[0]), 3),
                    "lc_p99_vs_solo": round(_p99(rows[0]) / solo_p99, 3),
                    "be_rps": round(float(np.sum(_thr(rows[1:]))), 2),
                    "be_vs_mps": round(float(np.sum(_thr(rows[1:]))) / be_mps, 3)}

        out: dict[str, Any] = {"solo_p99_ms": round(solo_p99, 3), "caps": [lc_cap, be_cap],
                               "sizing": sizing}
        for name, rows in (("time-slicing", ts_rows), ("mps", mps_rows),
                           ("gpuslice-caps", caps_rows), ("gpuslice", gs_rows)):
            out[name] = figures(rows)
        out["splits"] = [{"caps": [lc_cap, be_cap], **out["gpuslice"]}] + [
            {"caps": list(split), **figures(rows)} for split, rows in swept]
        return out

    def memory(self) -> dict[str, Any]:
        """Three replicas under a memory cap, then one of them allocating past it: what it
        got, and its neighbours' throughput before and after."""
        opts, say = self.opts, self.say
        cap = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": pinned_mem_limit(opts.mem_cap_mib)}
        say("memory cap: three replicas, none over its cap")
        with _Mps(opts, self.root, "mem-a", self.gpu) as env:
            before = _thr(self._together([_spec(opts, opts.batch, {**env, **cap}, 3)] * 3))
        say(f"memory cap: one replica allocates {opts.alloc_mib} MiB past its "
            f"{opts.mem_cap_mib} MiB cap")
        with _Mps(opts, self.root, "mem-b", self.gpu) as env:
            rows = self._together([_spec(opts, opts.batch, {**env, **cap}, 3, opts.alloc_mib)]
                                  + [_spec(opts, opts.batch, {**env, **cap}, 3)] * 2,
                                  errors_ok=True)
        alloc = next((r["alloc"] for r in rows[0] if "alloc" in r), None)
        after = _thr(rows[1:])
        return {"cap_mib": opts.mem_cap_mib, "alloc_mib": opts.alloc_mib, "over_cap": alloc,
                "neighbours_rps_before": [round(x, 2) for x in before[1:]],
                "neighbours_rps_after": [round(x, 2) for x in after],
                "neighbours_ratio": round(float(np.sum(after)) / float(np.sum(before[1:])), 3)}


def plot_sharing(res: dict[str, Any], png: Path) -> Path:
    from gpuslice.adapters.optional import pyplot

    plt = pyplot()

    panels = [part for part in ("throughput", "noisy") if part in res]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.5 * max(1, len(panels)), 4),
                             squeeze=False)
    ax_of = dict(zip(panels, axes[0], strict=False))
    if "throughput" in res:
        ax = ax_of["throughput"]
        modes = list(res["throughput"])
        ax.bar(modes, [res["throughput"][m]["total_rps"] for m in modes],
               label=f"mean of {res.get('repeats', 1)} run(s)")
        for i, m in enumerate(modes):  # each run's total, so the run-to-run spread shows
            runs = res["throughput"][m].get("runs_rps", [])
            ax.plot([i] * len(runs), runs, "k.", markersize=6)
        ax.set_ylabel("requests/s, all replicas")
        ax.set_title(f"{res['replicas']} x {res['workload']} batch {res['batch']}")
        ax.tick_params(axis="x", labelrotation=20)
        ax.legend(fontsize=7, loc="upper left")
    if "noisy" in res:
        ax = ax_of["noisy"]
        modes = [m for m in ("time-slicing", "mps", "gpuslice-caps", "gpuslice")
                 if m in res["noisy"]]
        values = [res["noisy"][m]["lc_p99_vs_solo"] for m in modes]
        for v in res["noisy"].get("splits", [])[1:]:  # the swept caps, LC/BE
            modes.append(f"gpuslice {v['caps'][0]}/{v['caps'][1]}")
            values.append(v["lc_p99_vs_solo"])
        ax.bar(modes, values)
        ax.tick_params(axis="x", labelrotation=20)
        ax.axhline(1.1, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylabel("latency-critical p99 / solo p99")
        ax.set_title("noisy neighbour")
    if res.get("fake_timer"):
        fig.suptitle("fake timer: code path only, not GPU measurements")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
