"""Where the shared data folder is: ``$GPUSLICE_DATA``, else ``../shared`` beside the checkout
or the working directory."""

from __future__ import annotations

import os
from pathlib import Path

from gpuslice.core.errors import GpusliceError

TRACE_DIR = Path("traces/alibaba-gpu-v2023/csv")
RESULTS_DIR = Path("traces/fgd-atc23-expected-results")
NODE_LIST = "openb_node_list_gpu_node.csv"


# where the trace and the published FGD results come from (neither ships with gpuslice)
TRACE_SOURCE = "https://github.com/alibaba/clusterdata/tree/HEAD/cluster-trace-gpu-v2023"
TRACE_RAW = "https://raw.githubusercontent.com/alibaba/clusterdata/HEAD/cluster-trace-gpu-v2023/csv"
RESULTS_SOURCE = ("https://github.com/hkust-adsl/kubernetes-scheduler-simulator/tree/HEAD/"
                  "experiments/analysis/expected_results")
RESULTS_RAW = ("https://raw.githubusercontent.com/hkust-adsl/kubernetes-scheduler-simulator/"
               "HEAD/experiments/analysis/expected_results")
RESULTS_FILE = "analysis_allo_discrete.csv"


def fetch_hint(variant: str = "default", *, results: bool = False) -> str:
    """Where the trace comes from, its terms, and one shell line that fetches what
    ``--variant VARIANT`` (and ``--compare``, with ``results``) read into a data folder."""
    dest = "$HOME/gpuslice-data"
    files = [NODE_LIST, f"openb_pod_list_{variant}.csv"]
    cmd = (f"mkdir -p {dest}/{TRACE_DIR} && for f in {' '.join(files)}; do curl -fsSLo "
           f"{dest}/{TRACE_DIR}/$f {TRACE_RAW}/$f; done")
    if results:
        cmd += (f" && mkdir -p {dest}/{RESULTS_DIR} && curl -fsSLo {dest}/{RESULTS_DIR}/"
                f"{RESULTS_FILE} {RESULTS_RAW}/{RESULTS_FILE}")
    return (f"the Alibaba GPU-sharing trace (cluster-trace-gpu-v2023, the FGD paper's, USENIX "
            f"ATC '23) does not ship with gpuslice; it is public at {TRACE_SOURCE} (files "
            f"csv/{files[0]} and csv/{files[1]}; the clusterdata README allows research and "
            "study use and asks that the paper be cited)"
            + (f", and the FGD authors' published results at {RESULTS_SOURCE} ({RESULTS_FILE}, "
               "Apache-2.0)" if results else "")
            + f". Fetch them with: {cmd} && export GPUSLICE_DATA={dest}")


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


def require_data_dir(variant: str = "default", *, results: bool = False) -> Path:
    """The data folder, or an error saying where the trace comes from and how to fetch it."""
    found = find_data_dir()
    if found is None or not (found / TRACE_DIR).is_dir():
        where = "no data folder (GPUSLICE_DATA, or ../shared beside the checkout)" \
            if found is None else f"{found}: no {TRACE_DIR} inside"
        raise GpusliceError(f"{where}: {fetch_hint(variant, results=results)}")
    return found


def variant_paths(name: str) -> tuple[Path, Path]:
    """The pod list of trace variant ``name`` (``default``, ``gpushare40``, ...) and the GPU
    node list."""
    data = require_data_dir(name)
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
    """The FGD authors' published allocation results (``simulate --compare``)."""
    path = require_data_dir(results=True) / RESULTS_DIR / RESULTS_FILE
    if not path.is_file():
        raise GpusliceError(f"{path} not found: {fetch_hint(results=True)}")
    return path
