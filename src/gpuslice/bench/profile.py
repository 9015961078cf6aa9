"""``gpuslice profile``: measure a model on the local GPU across slice sizes, batch sizes and
process counts, into the planner's profile CSV (``adapters/profiles/files.py``'s own format).

Slices: MPS thread caps (one MPS control daemon with private pipe and log directories for the
run, quit at the end) and, where MIG is already enabled, the MIG instances that exist (the GPU's
mode is never changed). For each (slice, process count) the workers start together (each loads
its model, says ready, and waits for GO), warm up and measure a fixed window per batch size.
Rows are appended to the CSV as they are measured; a configuration already in the file is
skipped, so an interrupted run resumes where it stopped. ``--fake-timer MODEL@GPU`` replaces the
GPU with the demo's speed model on a virtual clock (CPU tests). A plot of throughput against
slice size per batch (the knee) is written beside the CSV.
"""

from __future__ import annotations

import csv
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from gpuslice.bench.runner import WorkerSpec, check_seconds, find_gpu, run_together
from gpuslice.bench.workloads import check_workload
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.profiles import ProfilePoint
from gpuslice.core.speedmodel import parse_fake_timer

COLUMNS = ("model", "gpu", "slice_kind", "slice_size", "batch", "procs", "throughput_rps",
           "latency_ms", "latency_p99_ms")


@dataclass(frozen=True)
class ProfileOptions:
    workload: str
    out: Path
    model_name: str = ""  # the name in the CSV (default: the workload)
    caps: tuple[int, ...] = (10, 20, 30, 50, 70, 100)
    batches: tuple[int, ...] = (1, 2, 4, 8)
    procs: tuple[int, ...] = (1, 2, 3)
    warmup_s: float = 2.0
    window_s: float = 5.0
    mig: bool = True
    fake_timer: str | None = None  # MODEL@GPU
    device_index: int = 0
    mps_binary: str = "nvidia-cuda-mps-control"

    def __post_init__(self) -> None:
        for name, vals, lo, hi in (("--caps", self.caps, 1, 100), ("--batches", self.batches,
                                                                     1, 4096),
                                   ("--procs", self.procs, 1, 48)):
            if not vals or any(not lo <= v <= hi for v in vals):
                raise ValidationError(name, f"a list of integers from {lo} to {hi}", vals)
        check_seconds("--warmup-s", self.warmup_s, zero_ok=True)
        check_seconds("--window-s", self.window_s, zero_ok=False)
        if self.device_index < 0:
            raise ValidationError("--device", "a GPU index >= 0", self.device_index)
        if self.out.exists() and not self.out.is_file():
            raise ValidationError("--out", "a CSV file (new or one to resume)", str(self.out))
        check_workload(self.workload)
        if self.fake_timer is not None:
            parse_fake_timer(self.fake_timer)


@dataclass(frozen=True)
class Slice:
    kind: str  # "mps" or "mig"
    size: int  # thread % or compute slices
    visible: str  # CUDA_VISIBLE_DEVICES
    label: str


def _gpu(opts: ProfileOptions) -> tuple[str, str, bool, list[Slice]]:
    """(GPU model name, UUID, MIG enabled, MIG slices that exist) of the GPU to profile."""
    if opts.fake_timer:
        return parse_fake_timer(opts.fake_timer)[1], "GPU-fake", False, []
    g = find_gpu(opts.device_index)
    migs = []
    if g.mig_enabled and opts.mig:
        from gpuslice.core import catalog

        model = catalog.lookup(g.model)
        seen = set()
        for m in g.mig:
            if model is None or model.mig is None or m.profile in seen:
                continue
            seen.add(m.profile)
            size = model.mig.profile(m.profile).compute_slices
            migs.append(Slice("mig", size, m.uuid, m.profile))
    return g.model, g.uuid, g.mig_enabled, migs


def _existing(path: Path) -> set[tuple[str, str, str, int, int, int]]:
    """The configurations already in the CSV being resumed; a file that is not a profile CSV
    (of this format) is refused naming it, not appended to."""
    if not path.is_file():
        return set()
    expected = "a profile CSV written by gpuslice profile (to resume) or a new file"
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except UnicodeDecodeError:
        raise ValidationError("--out", expected, f"{path}: not a UTF-8 text file") from None
    except (OSError, csv.Error) as exc:
        raise ValidationError("--out", expected, f"{path}: {exc}") from None
    if not rows:
        return set()  # an empty file: written from its header on
    header = [c.strip() for c in rows[0]]
    missing = [c for c in COLUMNS[:-1] if c not in header]
    if missing:
        raise ValidationError("--out", expected, f"{path}: its header has no column "
                              f"{missing[0]!r}")
    at = {c: header.index(c) for c in COLUMNS[:-1]}
    done = set()
    for row, values in enumerate(rows[1:], start=2):
        if not values:
            continue
        try:
            done.add((values[at["model"]], values[at["gpu"]], values[at["slice_kind"]],
                      int(values[at["slice_size"]]), int(values[at["procs"]]),
                      int(values[at["batch"]])))
        except (IndexError, ValueError):
            raise ValidationError("--out", expected, f"{path}, row {row}: "
                                  f"{','.join(values)[:60]!r}") from None
    return done


def _run_config(opts: ProfileOptions, sl: Slice, procs: int, batches: list[int],
                env: dict[str, str], run_id: str) -> list[dict[str, float]]:
    """Start ``procs`` workers together; per batch, their results."""
    spec = WorkerSpec(opts.workload, tuple(batches), opts.warmup_s, opts.window_s,
                      {**env, "GPUSLICE_FAKE_PROCS": str(procs)}, opts.fake_timer)
    rows = run_together([spec] * procs, run_id)
    return [{k: float(v) for k, v in r.items()
             if isinstance(v, int | float)} for mine in rows for r in mine]


def run_profile(opts: ProfileOptions,
                progress: Callable[[str, int, int], None] | None = None) -> list[ProfilePoint]:
    """Measure every configuration not yet in ``opts.out``; returns the points measured now."""
    done = _existing(opts.out)  # a file that cannot be resumed is said before the GPU
    gpu_model, gpu_uuid, mig_enabled, migs = _gpu(opts)
    name = opts.model_name or opts.workload
    # a MIG-enabled GPU has no whole-GPU device for MPS caps: only its instances are measured
    slices = [] if mig_enabled else [Slice("mps", c, gpu_uuid, f"{c}% threads")
                                     for c in opts.caps]
    slices += migs
    todo = []
    for sl in slices:
        for n in opts.procs:
            batches = [b for b in opts.batches
                       if (name, gpu_model, sl.kind, sl.size, n, b) not in done]
            if batches:
                todo.append((sl, n, batches))
    measured: list[ProfilePoint] = []
    if not todo:
        return measured
    run_id = uuid.uuid4().hex[:12]
    daemon = None
    with tempfile.TemporaryDirectory(prefix="gsp-") as tmp:
        try:
            if not opts.fake_timer and not mig_enabled:
                from gpuslice.adapters.mps import MpsDaemon

                daemon = MpsDaemon(gpu_uuid, Path(tmp) / "pipe", Path(tmp) / "log",
                                   binary=opts.mps_binary)
                daemon.start()
            f = _open_out(opts.out)
            with f:
                out = csv.writer(f)

                def emit(row: Sequence[object]) -> None:
                    try:
                        out.writerow(row)
                        f.flush()  # an interrupted run keeps what it measured
                    except OSError as exc:
                        raise _cannot_write(opts.out, exc) from None

                if f.tell() == 0:
                    emit(COLUMNS)
                for i, (sl, n, batches) in enumerate(todo):
                    if progress is not None:
                        progress(f"{name} {sl.label} x{n}", i, len(todo))
                    env = {"CUDA_VISIBLE_DEVICES": sl.visible}
                    if sl.kind == "mps":
                        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(sl.size)
                        if daemon is not None:
                            env["CUDA_MPS_PIPE_DIRECTORY"] = str(daemon.pipe_dir)
                    rows = _run_config(opts, sl, n, batches, env, run_id)
                    for b in batches:
                        mine = [r for r in rows if int(r["batch"]) == b]
                        if len(mine) != n:
                            raise GpusliceError(f"{sl.label} x{n} batch {b}: {len(mine)} of "
                                                f"{n} workers reported")
                        thr = float(np.mean([r["throughput"] for r in mine]))
                        p50 = float(np.mean([r["p50_ms"] for r in mine]))
                        p99 = float(np.max([r["p99_ms"] for r in mine]))
                        emit([name, gpu_model, sl.kind, sl.size, b, n, f"{thr:.4f}",
                              f"{p50:.4f}", f"{p99:.4f}"])
                        measured.append(ProfilePoint(name, gpu_model, sl.kind, sl.size, b, n,
                                                     thr, p50 / 1000, p99 / 1000))
                if progress is not None:
                    progress("done", len(todo), len(todo))
        finally:
            if daemon is not None:
                daemon.quit()
    return measured


def _open_out(path: Path) -> TextIO:
    """The CSV, opened to append the rows measured now."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a", newline="", encoding="utf-8")
    except OSError as exc:
        raise _cannot_write(path, exc) from None


def _cannot_write(path: Path, exc: OSError) -> ValidationError:
    return ValidationError("--out", "a CSV file that can be written (in a folder that exists "
                           "or can be created)", f"{path}: {exc.strerror or exc}")


def plot_knee(csv_path: Path, png: Path) -> Path:
    """Throughput of the whole slice against its size, one line per batch (procs = 1)."""
    from gpuslice.adapters.optional import pyplot

    plt = pyplot()

    from gpuslice.adapters.profiles.files import read_own_profiles

    pts = [p for p in read_own_profiles(csv_path).points if p.procs == 1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("mps", "mig"), strict=True):
        mine = [p for p in pts if p.slice_kind == kind]
        for model in sorted({p.model for p in mine}):
            for b in sorted({p.batch for p in mine if p.model == model}):
                xs = sorted((p.slice_size, p.instance_throughput) for p in mine
                            if p.model == model and p.batch == b)
                ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o",
                        label=f"{model} batch {b}")
        ax.set_xlabel("MPS active thread %" if kind == "mps" else "MIG compute slices")
        ax.set_ylabel("requests/s")
        ax.set_title(f"{kind.upper()} slices" + ("" if mine else " (none measured)"))
        if mine:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def parse_ints(field: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValidationError(field, "comma-separated integers", text) from None


__all__: Sequence[str] = ("ProfileOptions", "plot_knee", "run_profile")
