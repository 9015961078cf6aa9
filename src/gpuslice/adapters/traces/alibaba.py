"""Readers for the Alibaba GPU-sharing trace (``openb``) node and pod CSV files.

Every problem in a file is reported as an :class:`InputError` that names the file, the row (1 is
the header) and the field, in one line. Nothing is half-loaded: a reader returns a whole table or
raises.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuslice.core import catalog
from gpuslice.core.errors import GpusliceError
from gpuslice.core.model import MILLI, Gpu, IntArray, Node

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
POD_OPTIONAL = ("gpu_spec",)


class InputError(GpusliceError):
    """A problem in an input file, located by file, row and field."""

    def __init__(self, path: Path | str, row: int | None, field: str | None, problem: str):
        self.path = str(path)
        self.row = row
        self.field = field
        where = self.path
        if row is not None:
            where += f", row {row}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class PodTable:
    """The tasks of a trace as columns. ``spec_id`` indexes ``specs`` (the allowed-model sets;
    an empty set means any model)."""

    path: str
    names: tuple[str, ...]
    cpu_milli: IntArray
    memory_mib: IntArray
    num_gpu: IntArray
    gpu_milli: IntArray
    spec_id: IntArray
    specs: tuple[frozenset[str], ...]

    def __len__(self) -> int:
        return len(self.names)

    @property
    def total_gpu_milli(self) -> IntArray:
        return np.asarray(self.num_gpu * self.gpu_milli)

    def take(self, index: IntArray) -> PodTable:
        """The tasks at ``index`` (repeats allowed), in that order."""
        idx = np.asarray(index, dtype=np.int64)
        return PodTable(
            self.path,
            tuple(self.names[i] for i in idx.tolist()),
            self.cpu_milli[idx],
            self.memory_mib[idx],
            self.num_gpu[idx],
            self.gpu_milli[idx],
            self.spec_id[idx],
            self.specs,
        )


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    if not path.exists():
        raise InputError(path, None, None, "file not found")
    if path.is_dir():
        raise InputError(path, None, None, "is a directory, expected a CSV file")
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames
        if not header:
            raise InputError(path, None, None, "file is empty, expected a CSV header line")
        cols = [c.strip() for c in header]
        missing = [c for c in required if c not in cols]
        if missing:
            raise InputError(
                path, 1, missing[0],
                f"missing column; the header has {', '.join(cols)}; "
                f"expected at least {', '.join(required)}",
            )
        reader.fieldnames = cols
        any_row = False
        for i, row in enumerate(reader, start=2):
            any_row = True
            if None in row:
                raise InputError(path, i, None, f"has {len(cols) + len(row[None])} fields, "
                                 f"the header has {len(cols)}")
            yield i, row
        if not any_row:
            raise InputError(path, None, None, "has a header but no rows")


def _int(path: Path, row: int, rec: Mapping[str, str | None], name: str, *, lo: int = 0,
         hi: int | None = None, blank: int | None = None) -> int:
    raw = (rec.get(name) or "").strip()
    if raw == "" and blank is not None:
        return blank
    try:
        value = int(raw)
    except ValueError:
        try:
            fval = float(raw)
        except ValueError:
            raise InputError(path, row, name, f"expected an integer, got {raw!r}") from None
        if not fval.is_integer():
            raise InputError(path, row, name, f"expected an integer, got {raw!r}") from None
        value = int(fval)
    if value < lo:
        raise InputError(path, row, name, f"expected a value >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InputError(path, row, name, f"expected a value <= {hi}, got {value}")
    return value


def read_nodes(path: Path | str, gpu_memory: Mapping[str, int] | None = None) -> list[Node]:
    """Read an ``openb_node_list_*.csv`` file into core nodes.

    GPU models the catalogue knows get their memory from it; others (``G2``, ``G3``) are opaque,
    with the memory given in ``gpu_memory`` or 0 (unknown) when none is given.
    """
    p = Path(path)
    nodes: list[Node] = []
    seen: set[str] = set()
    memory = dict(gpu_memory or {})
    for row, rec in _rows(p, NODE_COLUMNS):
        name = (rec.get("sn") or "").strip()
        if not name:
            raise InputError(p, row, "sn", "expected a node name, got an empty value")
        if name in seen:
            raise InputError(p, row, "sn", f"node {name!r} appears twice")
        seen.add(name)
        cpu = _int(p, row, rec, "cpu_milli")
        mem = _int(p, row, rec, "memory_mib")
        count = _int(p, row, rec, "gpu", hi=64)
        model = (rec.get("model") or "").strip()
        if count > 0 and not model:
            raise InputError(p, row, "model", f"node has {count} GPUs but no GPU model")
        gpus: tuple[Gpu, ...] = ()
        if count > 0:
            known = catalog.lookup(model)
            mib = known.memory_mib if known is not None else memory.get(model, 0)
            gpus = tuple(Gpu(index=j, model=model, memory_mib=mib) for j in range(count))
        nodes.append(Node(name=name, cpu_milli=cpu, memory_mib=mem, gpus=gpus))
    return nodes


def read_pods(path: Path | str, known_models: frozenset[str] | None = None) -> PodTable:
    """Read an ``openb_pod_list_*.csv`` file.

    ``known_models`` (the models of the node list) makes a ``gpu_spec`` naming any other model an
    error, so a typo does not silently make a task unschedulable.
    """
    p = Path(path)
    names: list[str] = []
    cols: dict[str, list[int]] = {k: [] for k in ("cpu", "mem", "num", "milli", "spec")}
    specs: list[frozenset[str]] = [frozenset()]
    spec_index: dict[str, int] = {"": 0}
    for row, rec in _rows(p, POD_COLUMNS):
        name = (rec.get("name") or "").strip() or f"row-{row}"
        cpu = _int(p, row, rec, "cpu_milli")
        mem = _int(p, row, rec, "memory_mib")
        num = _int(p, row, rec, "num_gpu", hi=64)
        milli = _int(p, row, rec, "gpu_milli", hi=MILLI)
        if num == 0 and milli != 0:
            raise InputError(p, row, "gpu_milli", f"expected 0 when num_gpu is 0, got {milli}")
        if num > 0 and milli == 0:
            raise InputError(p, row, "gpu_milli", f"expected 1..1000 for {num} GPU(s), got 0")
        if num > 1 and milli != MILLI:
            raise InputError(
                p, row, "gpu_milli", f"expected 1000 for a {num}-GPU task, got {milli}"
            )
        raw_spec = (rec.get("gpu_spec") or "").strip()
        if raw_spec not in spec_index:
            models = frozenset(s.strip() for s in raw_spec.split("|") if s.strip())
            if known_models is not None:
                unknown = sorted(models - known_models)
                if unknown:
                    raise InputError(
                        p, row, "gpu_spec",
                        f"unknown GPU model {unknown[0]!r}; the cluster has "
                        f"{', '.join(sorted(known_models))}",
                    )
            spec_index[raw_spec] = len(specs)
            specs.append(models)
        names.append(name)
        cols["cpu"].append(cpu)
        cols["mem"].append(mem)
        cols["num"].append(num)
        cols["milli"].append(milli)
        cols["spec"].append(spec_index[raw_spec])
    return PodTable(
        path=str(p),
        names=tuple(names),
        cpu_milli=np.array(cols["cpu"], dtype=np.int64),
        memory_mib=np.array(cols["mem"], dtype=np.int64),
        num_gpu=np.array(cols["num"], dtype=np.int64),
        gpu_milli=np.array(cols["milli"], dtype=np.int64),
        spec_id=np.array(cols["spec"], dtype=np.int64),
        specs=tuple(specs),
    )
