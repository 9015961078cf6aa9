"""Our simulator's numbers beside the published FGD results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpuslice.adapters.traces.fgd_results import PublishedRow
from gpuslice.core.policies import ALIASES, PUBLISHED_NAMES
from gpuslice.sim.runner import JobResult, unallocated_at


@dataclass(frozen=True)
class CompareRow:
    policy: str
    published_as: str | None
    ours_mean: float
    ours_sd: float
    published_mean: float | None
    published_sd: float | None
    seconds_per_seed: float

    @property
    def diff(self) -> float | None:
        if self.published_mean is None:
            return None
        return self.ours_mean - self.published_mean


def compare(workload: str, results: Sequence[JobResult], published: Sequence[PublishedRow],
            arrived: int = 100) -> list[CompareRow]:
    """For each policy run, our unallocated GPU % at ``arrived`` next to the published one.

    Our own policy (not in the paper) is set beside the published FGD, the anchor to beat.
    """
    out: list[CompareRow] = []
    for policy in dict.fromkeys(r.job.policy for r in results):
        canonical = ALIASES.get(policy, policy)
        name = PUBLISHED_NAMES.get(canonical, PUBLISHED_NAMES["fgd"])
        vals = unallocated_at(results, policy, arrived)
        pub = [100.0 - float(r.values[arrived]) for r in published
               if r.workload == workload and r.policy == name]
        secs = float(np.mean([r.seconds for r in results if r.job.policy == policy]))
        out.append(CompareRow(
            policy, name if pub else None, float(np.mean(vals)), float(np.std(vals)),
            float(np.mean(pub)) if pub else None, float(np.std(pub)) if pub else None, secs,
        ))
    return out
