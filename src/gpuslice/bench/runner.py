"""Benchmark workers started together: each loads its workload and says ready; then all get GO
at once (so co-located workers overlap), each one's JSON lines are collected, and workers that
finished first keep running (``holding``) until all have reported, then get STOP."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field

from gpuslice.adapters.install import pip_install
from gpuslice.adapters.proc import spawn, terminate
from gpuslice.core.devices import GpuDevice
from gpuslice.core.errors import GpusliceError, Unavailable, ValidationError

MAX_SECONDS = 3600.0  # --warmup-s, --window-s: an hour per measurement at most


def check_seconds(flag: str, secs: float, *, zero_ok: bool) -> float:
    """A warm-up (``zero_ok``) or a measurement window: finite, at most :data:`MAX_SECONDS`."""
    low_ok = secs >= 0 if zero_ok else secs > 0
    if not (math.isfinite(secs) and low_ok and secs <= MAX_SECONDS):
        raise ValidationError(flag, f"seconds, {'0 or more' if zero_ok else 'more than 0'} "
                              f"and at most {MAX_SECONDS:g}", secs)
    return secs


@dataclass(frozen=True)
class WorkerSpec:
    workload: str
    batches: tuple[int, ...]
    warmup_s: float
    window_s: float
    env: dict[str, str] = field(default_factory=dict)
    fake_timer: str | None = None
    alloc_mib: int = 0  # after measuring, try to allocate this much GPU memory

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "gpuslice.bench.worker", "--workload", self.workload,
                "--batches", ",".join(map(str, self.batches)), "--warmup-s",
                str(self.warmup_s), "--window-s", str(self.window_s)]
        if self.fake_timer:
            args += ["--fake-timer", self.fake_timer]
        if self.alloc_mib:
            args += ["--alloc-mib", str(self.alloc_mib)]
        return args


def _read(w: subprocess.Popen[str]) -> dict[str, object]:
    assert w.stdout is not None
    line = w.stdout.readline()
    if not line:
        raise GpusliceError(f"a benchmark worker exited with status {w.wait()} before "
                            "reporting")
    try:
        doc = json.loads(line)
    except ValueError:
        raise GpusliceError(f"a benchmark worker said {line.strip()!r}") from None
    if not isinstance(doc, dict):
        raise GpusliceError(f"a benchmark worker said {line.strip()!r}")
    return doc


def run_together(specs: list[WorkerSpec], run_id: str,
                 errors_ok: bool = False) -> list[list[dict[str, object]]]:
    """Each worker's reports (one per batch size, plus ``alloc`` when asked). A worker's
    ``error`` raises, unless ``errors_ok`` (then it is one of its reports)."""
    workers = [spawn(s.argv(), run_id, env=s.env, stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE) for s in specs]
    try:
        for w in workers:
            doc = _read(w)
            if "error" in doc:
                raise GpusliceError(f"benchmark worker: {doc['error']}")
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("GO\n")
            w.stdin.flush()
        out: list[list[dict[str, object]]] = []
        holding = []
        for w in workers:  # a worker done measuring keeps its load on while the others finish
            mine: list[dict[str, object]] = []
            while True:
                doc = _read(w)
                if doc.get("done"):
                    break
                if doc.get("holding"):
                    holding.append(w)
                    break
                if "error" in doc and not errors_ok:
                    raise GpusliceError(f"benchmark worker: {doc['error']}")
                mine.append(doc)
                if "error" in doc:
                    break
            out.append(mine)
        for w in holding:
            assert w.stdin is not None
            w.stdin.write("STOP\n")
            w.stdin.flush()
        for w in holding:
            while not _read(w).get("done"):
                pass
        return out
    finally:
        for w in workers:
            terminate(w)


def find_gpu(index: int) -> GpuDevice:
    """The local GPU of NVML index ``index``, or a clear error (no nvidia-ml-py, no GPU, no
    such index)."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        raise Unavailable("nvidia-ml-py is not installed: " + pip_install("gpu")) \
            from None
    from gpuslice.adapters.nvml.port import NullNvml
    from gpuslice.adapters.nvml.real import load

    nvml = load()
    if isinstance(nvml, NullNvml) or not nvml.devices():
        raise Unavailable(f"no NVIDIA GPU here: {nvml.why_empty()}")
    found = [g for g in nvml.devices() if g.index == index]
    if not found:
        raise ValidationError("--device", f"a GPU index of {[g.index for g in nvml.devices()]}",
                              index)
    return found[0]
