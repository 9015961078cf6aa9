#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU (issues 6, 7 and 8), in stages that each fit a 10-minute
# device call: the GPU test tier, model profiles (resumable: a stage run again continues where
# it stopped), and the sharing benchmark. Needs the project installed with PyTorch, torchvision
# and nvidia-ml-py ('pip install ".[gpu]" torch torchvision') and nvidia-cuda-mps-control on
# PATH. Never changes the GPU's mode: MPS daemons get private pipe and log directories and are
# quit before each command ends. Results go to $OUT (default gpu-out/).
#   bash benchmarks/gpu_tier.sh tests                        # about 2 minutes
#   MODELS="resnet50 mobilenet_v3" bash benchmarks/gpu_tier.sh profile   # about 4 min a model
#   MODELS="vit_b_16 encoder" bash benchmarks/gpu_tier.sh profile
#   bash benchmarks/gpu_tier.sh sharing                      # about 5 minutes
set -uo pipefail
OUT=${OUT:-gpu-out}
MODELS=${MODELS:-resnet50 mobilenet_v3 vit_b_16 encoder}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv \
    | tee "$OUT/device.txt"
case "${1:-all}" in
  tests|all)
    python -m pytest -m gpu -s -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tier.log" ;;&
  profile|all)
    for model in $MODELS; do
        gpuslice profile "$model" --out "$OUT/profiles.csv" --caps 10,20,30,50,100 \
            --batches 1,8,16,64 --procs 1,2,3 --warmup-s 1 --window-s 2 2>&1 | tail -3
    done ;;&
  sharing|all)
    gpuslice bench sharing --profile "$OUT/profiles.csv" --out "$OUT" --warmup-s 2 \
        --window-s 6 2>&1 | tee "$OUT/sharing.txt" ;;
esac
