"""The fake nvidia-cuda-mps-control of the tests: the one the demo uses too
(:mod:`gpuslice.adapters.mps.fake`)."""

from __future__ import annotations

from gpuslice.adapters.mps.fake import SCRIPT
from gpuslice.adapters.mps.fake import write_fake_control as write_fake_mps

__all__ = ["SCRIPT", "write_fake_mps"]
