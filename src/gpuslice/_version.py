"""The version and the git revision gpuslice was built from.

The revision is baked in at build time as ``_build_info.py``: setup.py writes it into every
wheel and sdist built from a git checkout (``pip install .``, ``pip wheel .``: ``git describe``
of the checkout), ``scripts/build-image.sh`` and the Containerfile into the source they build
the image's wheel from. In a git checkout (``pip install -e .`` or running from ``src/``) it is
``git describe`` of that checkout, asked when needed; otherwise ``unknown``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from gpuslice import __version__

__all__ = ["VersionAction", "__version__", "revision", "version_line"]


def revision() -> str:
    try:
        from gpuslice._build_info import REVISION
    except ImportError:
        pass
    else:
        return str(REVISION)
    package = Path(__file__).resolve().parent
    checkout = package.parent.parent
    # only a source checkout (src/gpuslice next to pyproject.toml): an installed copy inside
    # some other repository must not report that repository's revision
    if package.parent.name != "src" or not (checkout / "pyproject.toml").is_file():
        return "unknown"
    try:
        out = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty",
                              "--abbrev=12"], capture_output=True, text=True, timeout=5,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def version_line(prog: str) -> str:
    return f"{prog} {__version__} (revision {revision()})"


class VersionAction(argparse.Action):
    """``--version``: prints :func:`version_line` and exits 0; the revision is looked up only
    when asked (no git process at every start)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS,
                 help: str = "print the version and git revision, then exit") -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        sys.stdout.write(version_line(parser.prog) + "\n")
        parser.exit()
