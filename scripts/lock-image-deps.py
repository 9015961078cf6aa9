#!/usr/bin/env python3
"""Write deploy/image/requirements.txt: the exact wheels (name, version, sha256) the container
image installs, resolved from pyproject.toml for the image's Python (Debian bookworm: CPython
3.11, glibc 2.36, x86_64).

The image gets the components' runtime: the default dependencies minus the packages of the
``plot`` and ``planner`` extras (no component imports them), plus the ``kube`` and ``gpu``
extras, under deploy/image/constraints.txt. Run it after changing dependencies; the image build
installs only what this file lists, with ``--require-hashes``, so the same file gives the same
image. ``tests/image/test_lock.py`` checks that the file still satisfies pyproject.toml.

Usage: scripts/lock-image-deps.py [--check]   (needs pip and PyPI)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "deploy" / "image" / "requirements.txt"
CONSTRAINTS = ROOT / "deploy" / "image" / "constraints.txt"
LEFT_OUT_EXTRAS = ("plot", "planner")
ADDED_EXTRAS = ("kube", "gpu")
# the image's interpreter and platform (pip download evaluates wheels' tags for it)
# (pip takes each manylinux level it may use: glibc 2.36 runs wheels built for 2.17 to 2.36)
TARGET = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi",
          "cp311", *[a for minor in range(36, 16, -1)
                     for a in ("--platform", f"manylinux_2_{minor}_x86_64")],
          "--platform", "manylinux2014_x86_64"]


def _name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if m is None:
        raise SystemExit(f"cannot read a package name in {req!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def image_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    left_out = {_name(r) for e in LEFT_OUT_EXTRAS for r in extras[e]}
    reqs = [r for r in project["dependencies"] if _name(r) not in left_out]
    return reqs + [r for e in ADDED_EXTRAS for r in extras[e]]


def lock_lines(wheels: Path) -> list[str]:
    lines = []
    for whl in sorted(wheels.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        digest = hashlib.sha256(whl.read_bytes()).hexdigest()
        lines.append(f"{_name(name)}=={version} --hash=sha256:{digest}")
    return sorted(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the lock differs from a fresh resolution (needs PyPI)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuslice-lock-") as tmp:
        req = Path(tmp) / "requirements.in"
        req.write_text("\n".join(image_requirements()) + "\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest",
                        str(Path(tmp) / "wheels"), *TARGET, "-r", str(req),
                        "-c", str(CONSTRAINTS)], check=True,
                       env={k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"})
        body = "\n".join(lock_lines(Path(tmp) / "wheels")) + "\n"
    text = ("# The container image's Python packages, exactly (scripts/lock-image-deps.py wrote "
            "this;\n# do not edit). Installed with --require-hashes --no-index from the wheels "
            "these name.\n" + body)
    if args.check:
        if LOCK.read_text() != text:
            print(f"{LOCK.relative_to(ROOT)} is out of date: run {sys.argv[0]}")
            return 1
        return 0
    LOCK.write_text(text)
    print(f"wrote {LOCK.relative_to(ROOT)} ({len(body.splitlines())} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
