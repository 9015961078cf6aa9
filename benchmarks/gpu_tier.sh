#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one go (issues 6, 7 and 8): the GPU test tier, four
# model profiles, and the sharing benchmark. Needs the project installed with PyTorch,
# torchvision and nvidia-ml-py ('pip install ".[gpu]" torch torchvision'), and
# nvidia-cuda-mps-control on PATH. Never changes the GPU's mode: MPS daemons use private pipe
# and log directories and are quit before each command ends. Results go to $OUT (default
# gpu-out/): pytest log, profiles.csv and its plot, sharing.json and its plot.
#   bash benchmarks/gpu_tier.sh            # about 25 minutes on an H100 with the defaults
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv \
    | tee "$OUT/device.txt"
python -m pytest -m gpu -s -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tier.log"
for model in resnet50 mobilenet_v3 vit_b_16 encoder; do
    gpuslice profile "$model" --out "$OUT/profiles.csv" --caps 10,20,30,50,70,100 \
        --batches 1,8,16,64 --procs 1,2,3 --warmup-s 2 --window-s 4 2>&1 | tail -3
done
gpuslice bench sharing --profile "$OUT/profiles.csv" --out "$OUT" 2>&1 | tee "$OUT/sharing.txt"
