"""The pip command that installs an optional part of gpuslice, as this copy was installed.

gpuslice is not published on a package index: ``pip install 'gpuslice[gpu]'`` would not find
it. A copy installed from a checkout (``pip install .`` or ``-e .``) records the checkout in
its ``direct_url.json`` (PEP 610); a copy run from ``src/`` without installing sits in one.
Either way the command names that folder; only a copy from an index gets the package name."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse


def checkout() -> tuple[Path, bool] | None:
    """The source folder this copy of gpuslice came from and whether it is an editable
    install (None: installed from an index or a wheel file)."""
    try:
        dist = metadata.distribution("gpuslice")
        text = dist.read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        dist, text = None, None
    if text:
        try:
            doc = json.loads(text)
        except ValueError:
            doc = {}
        url = urlparse(str(doc.get("url", "")))
        folder = Path(unquote(url.path))
        if url.scheme == "file" and (folder / "pyproject.toml").is_file():
            return folder, bool((doc.get("dir_info") or {}).get("editable"))
    if dist is None:  # run from a source tree without installing (PYTHONPATH=src)
        folder = Path(__file__).resolve().parents[3]
        if (folder / "pyproject.toml").is_file():
            return folder, False
    return None


def pip_install(extra: str) -> str:
    """``pip install ...`` for ``gpuslice[extra]``, from the checkout when there is one."""
    found = checkout()
    if found is None:
        return f"pip install 'gpuslice[{extra}]'"
    folder, editable = found
    return f"pip install {'-e ' if editable else ''}'{folder}[{extra}]'"
