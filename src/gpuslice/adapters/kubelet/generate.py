"""Regenerate the gRPC code from deviceplugin.proto and podresources.proto (needs grpcio-tools;
the generated modules are committed so that installing gpuslice needs no code generator)."""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    from grpc_tools import protoc

    here = Path(__file__).resolve().parent
    code = 0
    for name in ("deviceplugin", "podresources"):
        code |= protoc.main(["protoc", f"-I{here}", f"--python_out={here}", f"--pyi_out={here}",
                             f"--grpc_python_out={here}", str(here / f"{name}.proto")])
        grpc_file = here / f"{name}_pb2_grpc.py"
        text = grpc_file.read_text().replace(
            f"import {name}_pb2 as", f"from gpuslice.adapters.kubelet import {name}_pb2 as")
        grpc_file.write_text(text)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
