"""Planner inputs that ship inside the package, reachable by name as ``builtin:NAME``.

A ``pip install`` has no ``../shared`` data folder, so the small files ``gpuslice plan``,
``replan`` and their examples need live in ``data/`` next to this module (sources and licences
in ``data/README.md``), read with :mod:`importlib.resources`:

- profiles: ``data/profiles/NAME/``, ParvaGPU folders (prof_data/, SLO/, deployment/):
  ``--profiles builtin:a100-80gb``
- services: ``data/services/NAME.yaml``: ``--services builtin:example``
- fleet: ``data/fleets/NAME.yaml``: ``--fleet builtin:example``
- plan: ``data/plans/NAME.json`` (written by ``gpuslice plan --json``):
  ``replan --current builtin:example``
- generative profiles: ``data/gen-profiles/NAME.csv``: ``--gen-profiles builtin:llm-a100-80gb``

The large inputs (cluster traces, published results) are not shipped: they stay in the shared
data folder (``adapters/traces/data.py``).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from gpuslice.core.errors import ValidationError

PREFIX = "builtin:"

# kind -> folder under data/
KINDS: dict[str, str] = {"profiles": "profiles", "services": "services", "fleet": "fleets",
                         "plan": "plans", "gen-profiles": "gen-profiles"}
_SUFFIXES = (".yaml", ".yml", ".json", ".csv")

# what ``plan --example`` and ``replan --example`` use
EXAMPLE_PROFILES = "a100-80gb"
EXAMPLE_SERVICES = "example"
EXAMPLE_FLEET = "example"
EXAMPLE_PLAN = "example"  # builtin:example's services planned on builtin:example's fleet
EXAMPLE_OBSERVED = "example-busier"  # the same services under another load, for replan


def _folder(kind: str) -> Traversable:
    if kind not in KINDS:
        raise ValueError(f"unknown kind of builtin input {kind!r}; known: {', '.join(KINDS)}")
    return resources.files(__package__ or "gpuslice.adapters.profiles") / "data" / KINDS[kind]


def _entries(kind: str) -> dict[str, Traversable]:
    out: dict[str, Traversable] = {}
    folder = _folder(kind)
    if not folder.is_dir():
        return out
    for entry in folder.iterdir():
        if entry.name.startswith((".", "_")):
            continue
        if kind == "profiles":
            if entry.is_dir():
                out[entry.name] = entry
        elif entry.is_file():
            stem, dot, ext = entry.name.rpartition(".")
            if dot and f".{ext}" in _SUFFIXES:
                out[stem] = entry
    return out


def names(kind: str) -> list[str]:
    """The builtin names of one kind (``profiles``, ``services``, ``fleet``, ``plan``)."""
    return sorted(_entries(kind))


def is_builtin(text: str) -> bool:
    return text.startswith(PREFIX)


def expected(kind: str) -> str:
    """What a builtin name of ``kind`` may be, for error messages and help texts."""
    have = names(kind)
    listed = ", ".join(PREFIX + n for n in have) if have else "none shipped"
    return f"{listed} (shipped with gpuslice)"


def resolve(kind: str, text: str, field: str) -> Path:
    """The file (or folder) of ``builtin:NAME`` (``NAME`` alone is accepted too); an unknown
    name is a :class:`ValidationError` on ``field`` that lists the known ones."""
    name = text.removeprefix(PREFIX).strip()
    entry = _entries(kind).get(name)
    if entry is None:
        raise ValidationError(field, expected(kind), text)
    return _as_path(entry)


def _as_path(entry: Traversable) -> Path:
    """A real path for the entry: itself when the package is installed as files (the usual
    case), else a copy in a temporary folder removed at exit (a zipped package)."""
    if isinstance(entry, Path):
        return entry
    tmp = Path(tempfile.mkdtemp(prefix="gpuslice-builtin-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    target = tmp / entry.name
    _copy(entry, target)
    return target


def _copy(entry: Traversable, target: Path) -> None:
    if entry.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        for child in entry.iterdir():
            _copy(child, target / child.name)
    else:
        target.write_bytes(entry.read_bytes())
