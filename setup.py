"""Build hook: the gRPC modules of the kubelet APIs are compiled from the .proto files in
``src/gpuslice/adapters/kubelet`` with grpcio-tools (a build requirement) whenever gpuslice is
built: ``pip install .`` and wheels get them in the build tree, ``pip install -e .`` writes them
next to the .proto files (git ignores them). Everything else is in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SRC = ROOT / "src"
PROTO_PACKAGE = Path("gpuslice") / "adapters" / "kubelet"


def compile_protos(out_root: Path) -> list[Path]:
    """Compile every .proto of the kubelet adapter into ``out_root``/gpuslice/...; the
    generated modules import each other by their absolute package path."""
    from grpc_tools import protoc

    import grpc_tools

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


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        # editable installs import from src/: the modules go next to their .proto files
        target = SRC if self.editable_mode else Path(self.build_lib)
        compile_protos(target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            base = Path(self.build_lib) / PROTO_PACKAGE
            for proto in (SRC / PROTO_PACKAGE).glob("*.proto"):
                for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                    outs.append(str(base / f"{proto.stem}{suffix}"))
        return outs


setup(cmdclass={"build_py": BuildPyWithProtos})
