"""The stand-in ``nvidia-cuda-mps-control`` as an executable file, for where the real one is
absent (the demo on a machine without the NVIDIA driver, the tests, the real node tier on
stand-in GPUs): :mod:`gpuslice.adapters.mps.standin`'s source behind a ``#!`` line naming
this Python, so that it runs without the gpuslice package on the path (standard library
only). What it mirrors of the real daemon is said there."""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from gpuslice.adapters.mps import standin
from gpuslice.adapters.nvml.port import GpuProcess
from gpuslice.adapters.proc import running

# read as package data: the package may run from a zip (a wheel on sys.path)
SCRIPT = "#!PYTHON\n" + resources.files("gpuslice.adapters.mps").joinpath(
    "standin.py").read_text()


def write_fake_control(path: Path) -> Path:
    """Write the stand-in as an executable script at ``path`` (run by this Python)."""
    path.write_text(SCRIPT.replace("#!PYTHON", f"#!{sys.executable}", 1))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def standin_processes(pipe_root: str | Path) -> Callable[[str], list[GpuProcess]]:
    """What NVML would list on a device served by a stand-in daemon: its connected clients
    (PIDs as the daemon saw them), for :attr:`FakeNvml.process_source`. A daemon that is not
    running has none."""
    root = Path(pipe_root)

    def source(target: str) -> list[GpuProcess]:
        pipe = root / target
        try:
            pid = int((pipe / standin.PID_FILE).read_text().strip())
            state = json.loads((pipe / standin.STATE).read_text())
        except (OSError, ValueError):
            return []
        if not running(pid):
            return []
        return [GpuProcess(int(c["pid"]), int(c.get("use_mib") or 0),
                           float(c.get("sm_pct") or 0.0))
                for c in state.get("clients") or []
                if isinstance(c, dict) and isinstance(c.get("pid"), int)]

    return source
