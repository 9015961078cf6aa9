#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels a GPU machine without network access needs to run
# benchmarks/gpu_tier.sh: those of the project's dependencies that such a machine's image may
# lack or hold in too old a version (the project itself runs from src/, so a wheel of it can
# never be stale) (the gRPC code is generated for grpcio and
# protobuf at least the versions pinned in pyproject.toml). Everything else the GPU tier uses
# (PyTorch, torchvision, nvidia-ml-py, NumPy, aiohttp, pytest, ...) is expected there; the
# `check` stage of gpu_tier.sh says what is missing.
#   bash benchmarks/gpu_wheels.sh            # wheels for CPython 3.12 into .whl/ (about 8 MB)
#   PYVER=3.11 bash benchmarks/gpu_wheels.sh # for another Python
# gpu_tier.sh installs .whl/*.whl into /tmp/site (first on PYTHONPATH) when the folder exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=.whl
rm -rf "$OUT" && mkdir -p "$OUT"
# the versions this checkout is tested with (its venv's), so the GPU run matches CI
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for pkg in orjson grpcio protobuf; do pins+=("$pkg==$(version "$pkg")"); done
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_34_x86_64; do platforms+=(--platform "$p"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" -d "$OUT" "${pins[@]}"
ls -1 "$OUT"
du -sh "$OUT"
