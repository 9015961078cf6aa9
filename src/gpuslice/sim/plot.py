"""Plots of simulator results (PNG, matplotlib without a display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpuslice.adapters.optional import pyplot
from gpuslice.sim.engine import BINS
from gpuslice.sim.runner import JobResult, unallocated_at


def plot_unallocated(results: Sequence[JobResult], path: Path, title: str,
                     xlim: tuple[int, int] = (75, 130)) -> Path:
    """Unallocated GPU % against arrived workload per policy: the mean over seeds with a
    band of one standard deviation, and the ideal curve (like Fig. 9(a) of the FGD paper).
    The legend gives the mean ± sd at 100% arrived, the statistic of ``simulate``'s table."""
    plt = pyplot()
    x = np.arange(BINS)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    ideal = np.clip(100 - x, 0, None)
    ax.plot(x, ideal, color="0.6", linestyle=":", label="ideal")
    policies = list(dict.fromkeys(r.job.policy for r in results))
    seeds = len({r.job.seed for r in results})
    labels = []
    for p in policies:
        rows = np.array([100 - r.binned.alloc for r in results if r.job.policy == p])
        mean, sd = np.nanmean(rows, axis=0), np.nanstd(rows, axis=0)
        at = unallocated_at(results, p, 100)
        labels.append(f"{p}: {np.mean(at):.2f} ± {np.std(at):.2f}% at 100%")
        line = ax.plot(x, mean, label=labels[-1])[0]
        ax.fill_between(x, mean - sd, mean + sd, color=line.get_color(), alpha=0.2)
    ax.set_xlim(*xlim)
    visible = ideal[xlim[0]:xlim[1] + 1]
    ax.set_ylim(0, max(25.0, float(visible.min()) + 5))
    ax.set_xlabel("arrived workload (% of cluster GPU capacity)")
    ax.set_ylabel("unallocated GPU (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title=f"mean ± sd over {seeds} seed(s), band ± sd",
              title_fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # the legend, also as the PNG's description (what it says, for tools and tests)
    fig.savefig(path, metadata={"Description": "; ".join(labels)})
    plt.close(fig)
    return path
