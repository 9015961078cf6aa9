"""Shared fixtures: the shared data folder (skipped when absent, a failure under CI=true)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslice.adapters.traces.data import TRACE_DIR, find_data_dir

# the stand-in MPS control daemons (gpuslice.adapters.mps.standin) are long-lived processes, as
# the real ones are: one a test leaves behind ends after this many idle seconds (or when its
# pipe directory goes with the test's tmp_path)
os.environ.setdefault("FAKE_MPS_IDLE_EXIT_S", "120")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    found = find_data_dir()
    if found is None or not (found / TRACE_DIR).is_dir():
        reason = ("shared data folder not found (set GPUSLICE_DATA or put it at ../shared); "
                  "the trace tests need the Alibaba openb trace")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason + " -- required under CI=true")
        pytest.skip(reason)
    return found


@pytest.fixture
def gpu_with_mps() -> None:
    """The GPU tier's precondition: nvidia-ml-py, torchvision, an NVIDIA GPU and the MPS
    control tool; skipped (with the missing piece named) otherwise."""
    import shutil

    pytest.importorskip("pynvml")
    pytest.importorskip("torchvision")
    from gpuslice.adapters.nvml.port import NullNvml
    from gpuslice.adapters.nvml.real import load

    nv = load()
    if isinstance(nv, NullNvml) or not nv.devices():
        pytest.skip(f"no NVIDIA GPU here: {nv.why_empty()}")
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
