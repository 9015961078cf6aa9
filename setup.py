"""Build hooks.

- The gRPC modules of the kubelet APIs are compiled from the .proto files in
  ``src/gpuslice/adapters/kubelet`` with grpcio-tools (a build requirement) whenever gpuslice is
  built: ``pip install .`` and wheels get them in the build tree, ``pip install -e .`` writes them
  next to the .proto files (git ignores them).
- The git revision is recorded at build time: a wheel (``pip install .``, ``pip wheel .``) or an
  sdist built from a git checkout gets ``gpuslice/_build_info.py`` with ``git describe`` of the
  checkout, which ``gpuslice --version`` prints (an editable install asks git at run time
  instead). A source that carries its own ``_build_info.py`` (scripts/build-image.sh, the
  Containerfile, an sdist) keeps it.
- deploy/dra's DeviceClasses and example claims, which ``gpuslice demo --dra`` reads, go into
  a wheel as ``gpuslice/demo/deploy/dra/...`` (deploy/ is not a package; an editable install
  reads the checkout's own) and into an sdist as they are. A source without them (the image
  build copies only what the image runs) builds without them.

Everything else is in pyproject.toml."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
SRC = ROOT / "src"
PROTO_PACKAGE = Path("gpuslice") / "adapters" / "kubelet"
BUILD_INFO = Path("gpuslice") / "_build_info.py"
# deploy/dra's files the DRA demo reads (gpuslice.demo.dra.DEPLOY_FILES), and where a wheel has them
DEMO_DEPLOY_FILES = ("dra/deviceclasses.yaml", "dra/examples/claims.yaml")
DEMO_DEPLOY = Path("gpuslice") / "demo" / "deploy"


def compile_protos(out_root: Path) -> list[Path]:
    """Compile every .proto of the kubelet adapter into ``out_root``/gpuslice/...; the
    generated modules import each other by their absolute package path."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    protos = sorted((SRC / PROTO_PACKAGE).glob("*.proto"))
    out_root.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for proto in protos:
        rel = proto.relative_to(SRC)
        code = protoc.main(["grpc_tools.protoc", f"-I{SRC}", f"-I{well_known}",
                            f"--python_out={out_root}", f"--pyi_out={out_root}",
                            f"--grpc_python_out={out_root}", str(rel)])
        if code != 0:
            raise SystemExit(f"protoc failed on {rel} (exit {code})")
        stem = out_root / rel.with_suffix("")
        written += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return written


@functools.cache
def git_revision() -> str | None:
    """``git describe --always --dirty --abbrev=12`` of the checkout being built (what
    gpuslice._version reports from a checkout), None when this source is not a git checkout
    (an unpacked sdist, the image build's copy) or git is missing. Only this directory's own
    repository: a source tree inside another repository must not take its revision."""
    if not (ROOT / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty",
                              "--abbrev=12"], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    revision = out.stdout.strip()
    return revision if out.returncode == 0 and revision else None


def write_build_info(out_root: Path) -> Path | None:
    """``out_root``/gpuslice/_build_info.py with the checkout's revision; nothing when the
    source has its own (the build copied it) or the revision is unknown (a stale one from an
    earlier build in the same build tree is removed). The path written, or None."""
    if (SRC / BUILD_INFO).exists():
        return None
    target = out_root / BUILD_INFO
    revision = git_revision()
    if revision is None:
        target.unlink(missing_ok=True)
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f'"""Written by setup.py at build time."""\n\nREVISION = "{revision}"\n')
    return target


def demo_deploy_files() -> list[Path]:
    """The deploy/ files the DRA demo reads that this source has (relative to deploy/)."""
    return [Path(f) for f in DEMO_DEPLOY_FILES if (ROOT / "deploy" / f).is_file()]


def copy_demo_deploy(dest: Path) -> list[Path]:
    """deploy/dra's files the DRA demo reads, into ``dest`` by their paths under deploy/ (a
    wheel's ``gpuslice/demo/deploy/``, an sdist's ``deploy/``); the paths written."""
    written = []
    for rel in demo_deploy_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / "deploy" / rel).read_bytes())
        written.append(target)
    return written


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        # editable installs import from src/: the modules go next to their .proto files
        target = SRC if self.editable_mode else Path(self.build_lib)
        compile_protos(target)
        if not self.editable_mode:  # an editable install asks git when asked its revision
            write_build_info(target)
            copy_demo_deploy(target / DEMO_DEPLOY)  # an editable install reads deploy/ itself

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            base = Path(self.build_lib) / PROTO_PACKAGE
            for proto in (SRC / PROTO_PACKAGE).glob("*.proto"):
                for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                    outs.append(str(base / f"{proto.stem}{suffix}"))
            if not (SRC / BUILD_INFO).exists() and git_revision() is not None:
                outs.append(str(Path(self.build_lib) / BUILD_INFO))
            outs += [str(Path(self.build_lib) / DEMO_DEPLOY / f) for f in demo_deploy_files()]
        return outs


class SdistWithRevision(sdist):
    """An sdist from a git checkout carries the revision (its unpacked tree has no .git)."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        write_build_info(Path(base_dir) / "src")
        copy_demo_deploy(Path(base_dir) / "deploy")  # the wheel built from the sdist takes them


setup(cmdclass={"build_py": BuildPyWithProtos, "sdist": SdistWithRevision})
