"""Where the shared data folder is: ``$GPUSLICE_DATA``, else ``../shared`` beside the checkout
or the working directory."""

from __future__ import annotations

import os
from pathlib import Path

from gpuslice.core.errors import GpusliceError

TRACE_DIR = Path("traces/alibaba-gpu-v2023/csv")
RESULTS_DIR = Path("traces/fgd-atc23-expected-results")
NODE_LIST = "openb_node_list_gpu_node.csv"


def find_data_dir() -> Path | None:
    """The shared data folder, or None when there is none."""
    env = os.environ.get("GPUSLICE_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    candidates = [Path.cwd() / ".." / "shared", Path.cwd() / "shared"]
    candidates += [p / ".." / "shared" for p in here.parents]
    for cand in candidates:
        if (cand / TRACE_DIR).is_dir():
            return cand.resolve()
    return None


def require_data_dir() -> Path:
    found = find_data_dir()
    if found is None:
        raise GpusliceError(
            "shared data folder not found: set GPUSLICE_DATA to the folder that holds "
            "traces/alibaba-gpu-v2023, or put it at ../shared beside the checkout"
        )
    if not (found / TRACE_DIR).is_dir():
        raise GpusliceError(f"{found}: no {TRACE_DIR} inside (GPUSLICE_DATA points elsewhere?)")
    return found


def variant_paths(name: str) -> tuple[Path, Path]:
    """The pod list of trace variant ``name`` (``default``, ``gpushare40``, ...) and the GPU
    node list."""
    data = require_data_dir()
    pods = data / TRACE_DIR / f"openb_pod_list_{name}.csv"
    if not pods.is_file():
        have = sorted(p.stem.removeprefix("openb_pod_list_")
                      for p in (data / TRACE_DIR).glob("openb_pod_list_*.csv"))
        raise GpusliceError(f"trace variant {name!r} not found; available: {', '.join(have)}")
    return pods, data / TRACE_DIR / NODE_LIST


def trace_variants() -> list[str]:
    """The trace variants of the shared data folder (empty when there is none)."""
    data = find_data_dir()
    if data is None or not (data / TRACE_DIR).is_dir():
        return []
    return sorted(p.stem.removeprefix("openb_pod_list_")
                  for p in (data / TRACE_DIR).glob("openb_pod_list_*.csv"))


def published_results() -> Path:
    return require_data_dir() / RESULTS_DIR / "analysis_allo_discrete.csv"
