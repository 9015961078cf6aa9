"""Plots of simulator results (PNG, matplotlib without a display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from gpuslice.sim.engine import BINS
from gpuslice.sim.runner import JobResult


def plot_unallocated(results: Sequence[JobResult], path: Path, title: str,
                     xlim: tuple[int, int] = (75, 130)) -> Path:
    """Unallocated GPU % against arrived workload per policy: the median over seeds with the
    25-75% band, and the ideal curve (like Fig. 9(a) of the FGD paper)."""
    x = np.arange(BINS)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    ideal = np.clip(100 - x, 0, None)
    ax.plot(x, ideal, color="0.6", linestyle=":", label="ideal")
    policies = list(dict.fromkeys(r.job.policy for r in results))
    for p in policies:
        rows = np.array([100 - r.binned.alloc for r in results if r.job.policy == p])
        med = np.nanmedian(rows, axis=0)
        lo, hi = np.nanpercentile(rows, 25, axis=0), np.nanpercentile(rows, 75, axis=0)
        line = ax.plot(x, med, label=f"{p} ({med[100]:.2f}% at 100)")[0]
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xlim(*xlim)
    visible = ideal[xlim[0]:xlim[1] + 1]
    ax.set_ylim(0, max(25.0, float(visible.min()) + 5))
    ax.set_xlabel("arrived workload (% of cluster GPU capacity)")
    ax.set_ylabel("unallocated GPU (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
