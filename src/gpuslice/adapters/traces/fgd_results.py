"""Reader for the FGD authors' published result files (``analysis_allo_discrete.csv``)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuslice.adapters.traces.alibaba import InputError


@dataclass(frozen=True)
class PublishedRow:
    workload: str
    policy: str
    tune: float
    seed: int
    total_gpus: int
    values: np.ndarray  # columns 0..130


def read_published(path: Path | str) -> list[PublishedRow]:
    """Rows of a published ``analysis_*_discrete.csv`` file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(p, None, None, "file not found")
    rows: list[PublishedRow] = []
    with p.open(newline="") as fh:
        reader = csv.DictReader(fh)
        cols = reader.fieldnames or []
        for need in ("workload", "sc_policy", "tune", "seed", "total_gpus", "100"):
            if need not in cols:
                raise InputError(p, 1, need, "missing column")
        bins = [c for c in cols if c.isdigit()]
        for i, rec in enumerate(reader, start=2):
            try:
                values = np.array([float(rec[b]) if rec[b] else np.nan for b in bins])
                rows.append(PublishedRow(rec["workload"], rec["sc_policy"], float(rec["tune"]),
                                         int(rec["seed"]), int(rec["total_gpus"]), values))
            except ValueError as exc:
                raise InputError(p, i, None, f"not a number: {exc}") from None
    return rows
