"""Readers for inference profiles and SLO scenarios.

Two profile formats:

* ParvaGPU's folder (``prof_data/MODEL.csv`` with ``Mig instance, Batch size, Workload Number,
  Throughput, Latency``; measured on one GPU type, A100-80GB unless told otherwise).
* gpuslice's own CSV, one row per measured configuration::

      model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms,latency_p99_ms
      resnet50,A100-80GB,mig,3,64,2,1012.5,61.0,66.2

  ``slice_kind`` is ``mig`` (size = compute slices), ``mps`` (size = thread %) or ``whole``;
  ``throughput_rps`` is per process; ``latency_p99_ms`` may be empty.

Generative profiles (``gpuslice plan --gen-profiles``, ``gpuslice profile openai:URL``), one row
per (model, GPU, slice)::

      model,gpu,slice_kind,slice_size,prefill_tokens_per_s,decode_tokens_per_s,max_seqs
      llama-3.2-3b,A100-80GB,mig,3,10286,2222,64

  ``prefill_tokens_per_s``: prompt tokens per second one replica prefills;
  ``decode_tokens_per_s``: output tokens per second of the whole replica with ``max_seqs``
  sequences running (``core/generative.py``).

SLO scenarios (ParvaGPU's ``SLO_req_rate.csv`` / ``SLO_latency.csv``): a header of model names and
one row per scenario; ``N/A`` means the model is not deployed in that scenario.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from gpuslice.adapters.traces.alibaba import InputError
from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError
from gpuslice.core.generative import GenerativePoint
from gpuslice.core.profiles import ProfilePoint, ProfileSet

PARVA_COLUMNS = ("Mig instance", "Batch size", "Workload Number", "Throughput", "Latency")
OWN_COLUMNS = ("model", "gpu", "slice_kind", "slice_size", "batch", "procs", "throughput_rps",
               "latency_ms")


def _num(path: Path, row: int, field: str, raw: str | None, kind: type = float) -> float:
    """A finite number (``kind`` int: a whole one); NaN and infinities are refused."""
    text = (raw or "").strip()
    try:
        value = float(text)
    except ValueError:
        raise InputError(path, row, field, f"expected a number, got {_cut(text)}") from None
    if not math.isfinite(value):
        raise InputError(path, row, field, f"expected a finite number, got {_cut(text)}")
    if kind is int and not value.is_integer():
        raise InputError(path, row, field, f"expected an integer, got {_cut(text)}")
    return value


def _cut(text: str) -> str:
    """``text`` quoted for a message, a long one cut short."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"


def _lines(path: Path) -> list[list[str]]:
    """The rows of a CSV file; one line naming the file when it cannot be read."""
    if not path.is_file():
        raise InputError(path, None, None, "file not found")
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            return list(csv.reader(fh))
    except UnicodeDecodeError:
        raise InputError(path, None, None, "not a UTF-8 text CSV file") from None
    except csv.Error as exc:
        raise InputError(path, None, None, f"not a valid CSV file: {exc}") from None
    except OSError as exc:
        raise InputError(path, None, None, f"cannot be read: {exc.strerror or exc}") from None


def _csv(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    lines = _lines(path)
    cols = [c.strip() for c in lines[0]] if lines else []
    if not cols:
        raise InputError(path, None, None, "file is empty, expected a CSV header line")
    missing = [c for c in required if c not in cols]
    if missing:
        raise InputError(path, 1, missing[0], f"missing column; the header has "
                         f"{', '.join(cols)}")
    rows: list[tuple[int, dict[str, str]]] = []
    for row, values in enumerate(lines[1:], start=2):
        if not values:  # a blank line
            continue
        # a short row may leave out optional columns at the end, not required ones; extra
        # values past the header's columns must be empty (a trailing comma)
        short = any(cols.index(c) >= len(values) for c in required)
        if short or any(v.strip() for v in values[len(cols):]):
            raise InputError(path, row, None, f"has {len(values)} values for the "
                             f"{len(cols)} columns of the header ({', '.join(cols)})")
        rows.append((row, dict(zip(cols, values, strict=False))))
    if not rows:
        raise InputError(path, None, None, "has a header but no rows")
    return rows


def read_parva_profiles(folder: Path | str, gpu: str = "A100-80GB") -> ProfileSet:
    """Read ParvaGPU's ``prof_data`` folder (or its parent)."""
    base = Path(folder)
    if (base / "prof_data").is_dir():
        base = base / "prof_data"
    files = sorted(base.glob("*.csv")) if base.is_dir() else []
    if not files:
        raise InputError(base, None, None, "no profile CSV files (expected prof_data/MODEL.csv)")
    points: list[ProfilePoint] = []
    for f in files:
        for row, rec in _csv(f, PARVA_COLUMNS):
            try:
                points.append(ProfilePoint(
                    model=f.stem, gpu=gpu, slice_kind="mig",
                    slice_size=_mig_instance(f, row, rec["Mig instance"]),
                    batch=int(_num(f, row, "Batch size", rec["Batch size"], int)),
                    procs=int(_num(f, row, "Workload Number", rec["Workload Number"], int)),
                    throughput=_num(f, row, "Throughput", rec["Throughput"]),
                    latency_s=_num(f, row, "Latency", rec["Latency"]),
                ))
            except ValidationError as exc:
                raise InputError(f, row, exc.field, str(exc)) from None
    return ProfileSet.of(points)


def _mig_instance(path: Path, row: int, raw: str | None) -> int:
    size = int(_num(path, row, "Mig instance", raw, int))
    lo, hi, what = SLICE_SIZES["mig"]
    if not lo <= size <= hi:
        raise InputError(path, row, "Mig instance", f"expected {what} of {lo} to {hi}, got "
                         f"{size}")
    return size


def read_own_profiles(path: Path | str, *, catalogue_gpus: bool = False) -> ProfileSet:
    """Read gpuslice's profile CSV (see the module docstring). ``catalogue_gpus``: refuse a
    ``gpu`` the GPU catalogue does not know (the planner needs its MIG geometry; ``gpuslice
    profile`` writes whatever GPU it measured on)."""
    p = Path(path)
    points: list[ProfilePoint] = []
    for row, rec in _csv(p, OWN_COLUMNS):
        kind = rec["slice_kind"].strip()
        if kind not in ("mig", "mps", "whole"):
            raise InputError(p, row, "slice_kind", f"expected mig, mps or whole, got {kind!r}")
        p99 = (rec.get("latency_p99_ms") or "").strip()
        for col in ("model", "gpu"):
            if not rec[col].strip():
                raise InputError(p, row, col, f"expected a {col} name, got ''")
        if catalogue_gpus and catalog.lookup(rec["gpu"]) is None:
            known = ", ".join(m.name for m in catalog.known_models())
            raise InputError(p, row, "gpu", f"expected a GPU model of the catalogue ({known}; "
                             f"gpuslice gpus lists them), got {rec['gpu'].strip()!r}")
        size = _slice_size(p, row, kind, rec["slice_size"])
        try:
            points.append(ProfilePoint(
                model=rec["model"].strip(), gpu=rec["gpu"].strip(), slice_kind=kind,
                slice_size=size,
                batch=int(_num(p, row, "batch", rec["batch"], int)),
                procs=int(_num(p, row, "procs", rec["procs"], int)),
                throughput=_num(p, row, "throughput_rps", rec["throughput_rps"]),
                latency_s=_num(p, row, "latency_ms", rec["latency_ms"]) / 1000.0,
                latency_p99_s=(_num(p, row, "latency_p99_ms", p99) / 1000.0) if p99 else None,
            ))
        except ValidationError as exc:
            raise InputError(p, row, exc.field, str(exc)) from None
    return ProfileSet.of(points)


GEN_COLUMNS = ("model", "gpu", "slice_kind", "slice_size", "prefill_tokens_per_s",
               "decode_tokens_per_s", "max_seqs")


def read_generative_profiles(path: Path | str, *, catalogue_gpus: bool = False
                             ) -> list[GenerativePoint]:
    """Read a generative profile CSV (see the module docstring): one row per model, GPU and
    slice; ``catalogue_gpus`` as :func:`read_own_profiles`."""
    p = Path(path)
    out: list[GenerativePoint] = []
    seen: dict[tuple[str, str, str, int], int] = {}
    for row, rec in _csv(p, GEN_COLUMNS):
        kind = rec["slice_kind"].strip()
        if kind not in ("mig", "mps", "whole"):
            raise InputError(p, row, "slice_kind", f"expected mig, mps or whole, got {kind!r}")
        for col in ("model", "gpu"):
            if not rec[col].strip():
                raise InputError(p, row, col, f"expected a {col} name, got ''")
        gpu = rec["gpu"].strip()
        if catalogue_gpus and catalog.lookup(gpu) is None:
            known = ", ".join(m.name for m in catalog.known_models())
            raise InputError(p, row, "gpu", f"expected a GPU model of the catalogue ({known}; "
                             f"gpuslice gpus lists them), got {gpu!r}")
        size = _slice_size(p, row, kind, rec["slice_size"])
        key = (rec["model"].strip(), gpu, kind, size)
        try:
            out.append(GenerativePoint(
                key[0], gpu, kind, size,
                _num(p, row, "prefill_tokens_per_s", rec["prefill_tokens_per_s"]),
                _num(p, row, "decode_tokens_per_s", rec["decode_tokens_per_s"]),
                int(_num(p, row, "max_seqs", rec["max_seqs"], int))))
        except ValidationError as exc:
            raise InputError(p, row, exc.field.rpartition(": ")[2], str(exc)) from None
        if key in seen:
            raise InputError(p, row, "slice_size", f"expected one row per model, GPU and "
                             f"slice; {'/'.join(map(str, key))} is on row {seen[key]} too")
        seen[key] = row
    return out


# slice_size by slice_kind: MIG compute slices (7 on the largest GPUs), MPS thread %
SLICE_SIZES = {"mig": (1, 7, "MIG compute slices"), "mps": (1, 100, "an MPS thread %"),
               "whole": (1, 1000, "the GPU's compute slices")}


def _slice_size(path: Path, row: int, kind: str, raw: str | None) -> int:
    size = int(_num(path, row, "slice_size", raw, int))
    lo, hi, what = SLICE_SIZES[kind]
    if not lo <= size <= hi:
        raise InputError(path, row, "slice_size", f"expected {what} of {lo} to {hi} for "
                         f"slice_kind {kind}, got {size}")
    return size


def gpu_row(path: Path | str, gpu: str) -> int | None:
    """The row of the profile CSV ``path`` where ``gpu`` first appears (None for a ParvaGPU
    folder, or where it does not): to name the row of a GPU found wanting after reading."""
    p = Path(path)
    if p.is_dir():
        return None
    return next((row for row, rec in _csv(p, ("gpu",)) if rec["gpu"].strip() == gpu), None)


def read_profiles(path: Path | str, *, catalogue_gpus: bool = False) -> ProfileSet:
    """A ParvaGPU folder, or a gpuslice profile CSV (``catalogue_gpus``: its GPUs must be
    catalogue models, :func:`read_own_profiles`)."""
    p = Path(path)
    if p.is_dir():
        return read_parva_profiles(p)
    return read_own_profiles(p, catalogue_gpus=catalogue_gpus)


@dataclass(frozen=True)
class ServiceSpec:
    """A service to plan: model, request rate (req/s) and latency SLO (ms)."""

    name: str
    model: str
    rate: float
    slo_ms: float


def read_scenario(rate_csv: Path | str, latency_csv: Path | str,
                  scenario: int) -> list[ServiceSpec]:
    """Scenario ``scenario`` (1-based row) of ParvaGPU's SLO files. Values are not validated
    here (a negative rate is reported per service by the planner)."""
    rates = _scenario_row(Path(rate_csv), scenario)
    lats = _scenario_row(Path(latency_csv), scenario)
    out: list[ServiceSpec] = []
    for model, raw_rate in rates.items():
        raw_lat = lats.get(model)
        if raw_rate is None:
            continue
        if raw_lat is None:
            raise InputError(latency_csv, scenario + 1, model,
                             "no latency SLO for a model that has a rate")
        out.append(ServiceSpec(model, model, raw_rate, raw_lat))
    return out


def _scenario_row(path: Path, scenario: int) -> dict[str, float | None]:
    rows = _lines(path)
    if not rows:
        raise InputError(path, None, None, "file is empty")
    header = [h.strip() for h in rows[0]]
    body = rows[1:]
    if header and all(_is_number(h) or h.upper() == "N/A" for h in header):
        # ParvaGPU's files have no header: the columns are the 11 models in alphabetical order
        body = rows
        header = PARVA_MODELS
    if not 1 <= scenario <= len(body):
        raise InputError(path, None, "scenario", f"expected 1..{len(body)}, got {scenario}")
    row = scenario + len(rows) - len(body)  # the line of the file
    line = body[scenario - 1]
    if len(line) != len(header):
        raise InputError(path, row, None, f"has {len(line)} values for {len(header)} models")
    out: dict[str, float | None] = {}
    for model, raw in zip(header, line, strict=True):
        text = raw.strip()
        if text.upper() in ("N/A", ""):
            out[model] = None
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):  # NaN and infinities too: the planner needs numbers
            raise InputError(path, row, model, f"expected a finite number or N/A, got "
                             f"{_cut(text)}")
        out[model] = value
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


PARVA_MODELS = ["bert", "densenet121", "densenet169", "densenet201", "inceptionv3",
                "mobilenetv2", "resnet101", "resnet152", "resnet50", "vgg16", "vgg19"]


def read_parva_deployment(path: Path | str) -> int:
    """Number of GPUs (distinct node/GPU pairs) a ParvaGPU deployment CSV uses."""
    p = Path(path)
    rows = _csv(p, ("Num instance", "Num GPU"))
    return len({(r["Num instance"].strip(), r["Num GPU"].strip()) for _, r in rows})
