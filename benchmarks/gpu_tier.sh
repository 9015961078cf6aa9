#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU (issues 6, 7 and 8), in stages that each fit a 10-minute
# call on a lent GPU machine. Never changes the GPU's settings (no MIG or compute-mode change, no
# reset): MPS daemons get private pipe and log directories and are quit before each stage ends.
# Results go to $RESULTS (default gpu-out/); the profile stage is resumable (run it again and it
# continues where it stopped, given the same profiles.csv).
#
# Needs python3 with PyTorch, torchvision and nvidia-ml-py, and nvidia-cuda-mps-control; the
# project runs from src/. A machine without network access gets the missing dependencies as
# wheels: run `bash benchmarks/gpu_wheels.sh` first on a machine with PyPI and bring the .whl/
# folder along; this script installs it into /tmp/site.
#
#   bash benchmarks/gpu_tier.sh check      # what is there, what is missing (seconds)
#   bash benchmarks/gpu_tier.sh tests      # the gpu test tier + the demo on the real GPU (~4 min)
#   bash benchmarks/gpu_tier.sh caps       # MPS caps, a client raising its own, the daemon
#                                          # killed, the agent on NVML (issue 31; ~2 min)
#   bash benchmarks/gpu_tier.sh dra        # the DRA driver's shares on the GPU (issue 33; ~1 min)
#   bash benchmarks/gpu_tier.sh agentcpu   # the node agent's CPU on the real GPU (30 s)
#   MODELS="resnet50 mobilenet_v3" bash benchmarks/gpu_tier.sh profile   # ~4 min a model
#   MODELS="vit_b_16 encoder" bash benchmarks/gpu_tier.sh profile
#   bash benchmarks/gpu_tier.sh sharing    # the sharing benchmark (~5 min)
# Issue 32 (one call of about 7 minutes): resnet50's profile at caps of sevenths, then the
# sharing throughput at 4 and 7 replicas, every mode twice:
#   MODELS=resnet50 PROFILE_CAPS=14,28,43,57,100 PROFILE_BATCHES=1,8,64 PROFILE_PROCS=1 \
#   SHARING_REPLICAS="4 7" SHARING_REPEATS=2 SHARING_PARTS=throughput SHARING_WINDOW_S=5 \
#   bash benchmarks/gpu_tier.sh check profile sharing
# Issue 33 (one call of about 5 minutes): the DRA driver's shares on the GPU, then the noisy
# neighbour with three LC/BE cap splits (the trade-off curve):
#   SHARING_REPLICAS=4 SHARING_PARTS=noisy SHARING_NOISY_SPLITS=40/30,40/45,50/60 \
#   SHARING_WINDOW_S=5 bash benchmarks/gpu_tier.sh check dra sharing
# PACK=FILE.tgz packs $RESULTS into one archive at the end (a lent machine returns few files).
# A 30-minute budget fits three calls: `check tests`, `profile` (two models), then
# `profile sharing` with the other two models and the profiles.csv of the first call (carried
# back as gpu-out/profiles.csv). With this workplace's device tool, which sets OUT to the
# folder that comes back, and carry [".whl"] (plus "gpu-out" for the third call):
#   PACK=$OUT/gpu.tgz bash benchmarks/gpu_tier.sh check tests
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-gpu-out}
MODELS=${MODELS:-resnet50 mobilenet_v3 vit_b_16 encoder}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONUNBUFFERED=1
# the driver's tools live in different places on different images
for d in /usr/local/nvidia/bin /usr/local/cuda/bin; do
    [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH="$PATH:$d" ;; esac
done
export PATH
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the project runs from this checkout (workers and replicas inherit the path)
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
GS=(python3 -m gpuslice.cli)
GPU_TESTS=(tests/nodeagent/test_nvml.py tests/nodeagent/test_mps.py
           tests/nodeagent/test_gpu_tier.py tests/local/test_local_gpu.py
           tests/bench/test_sharing.py)
CAPS_TESTS=(tests/nodeagent/test_gpu_mps_caps.py)
# the DRA driver's shares on the GPU, and the same scenario on the fakes first (issue 33)
DRA_TESTS=(tests/dra/test_gpu_dra_caps.py)
# each stage's limit in seconds (a hung step must not eat a lent machine's whole time)
STAGE_S=${STAGE_S:-300}
# the profile stage's grid and the sharing stage's runs (a run per replica count)
PROFILE_CAPS=${PROFILE_CAPS:-10,20,30,50,100}
PROFILE_BATCHES=${PROFILE_BATCHES:-1,8,16,64}
PROFILE_PROCS=${PROFILE_PROCS:-1,2,3}
SHARING_MODEL=${SHARING_MODEL:-resnet50}
SHARING_REPLICAS=${SHARING_REPLICAS:-7}
SHARING_BATCHES=${SHARING_BATCHES:-8}
SHARING_REPEATS=${SHARING_REPEATS:-1}
SHARING_PARTS=${SHARING_PARTS:-throughput,noisy,memory}
SHARING_WINDOW_S=${SHARING_WINDOW_S:-6}
SHARING_NOISY_SPLITS=${SHARING_NOISY_SPLITS:-}  # e.g. 50/30,60/40: more LC/BE caps to try
# FAKE_GPU=H200 dry-runs the profile and sharing stages on a CPU: the tiny workload timed by
# the speed model as if it were the model on that GPU (stand-in numbers, the real code paths)
as_model() {
    if [ -n "${FAKE_GPU:-}" ]; then printf '%s\n' tiny --fake-timer "$1@$FAKE_GPU"
    else printf '%s\n' "$1"; fi
}
export GPUSLICE_GPU_RESULTS=$RESULTS

check() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current,compute_mode \
        --format=csv | tee "$RESULTS/device.txt"
    python3 - <<'EOF' 2>&1 | tee "$RESULTS/check.txt"
import importlib, shutil, sys
missing = []
for mod in ("torch", "torchvision", "pynvml", "grpc", "google.protobuf", "orjson", "aiohttp",
            "numpy", "scipy", "matplotlib", "rich", "yaml", "prometheus_client", "pytest",
            "pytest_timeout", "hypothesis", "gpuslice"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:18} {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
    except Exception as exc:
        missing.append(f"{mod} ({type(exc).__name__}: {exc})")
try:  # the generated gRPC code checks the grpcio and protobuf versions it was made with
    import gpuslice.adapters.kubelet.deviceplugin_pb2_grpc  # noqa: F401
except Exception as exc:
    missing.append(f"the device plugin's gRPC code ({exc})")
try:
    import torch
    if not torch.cuda.is_available():
        missing.append("a CUDA device for PyTorch")
    else:
        print("cuda", torch.version.cuda, torch.cuda.get_device_name(0))
except ImportError:
    pass
for tool in ("nvidia-smi", "nvidia-cuda-mps-control"):
    where = shutil.which(tool)
    print(f"{tool:18} {where}") if where else missing.append(f"{tool} on PATH")
if missing:
    sys.exit("MISSING: " + "; ".join(missing))
print("ready")
EOF
    local rc=${PIPESTATUS[0]}
    "${GS[@]}" gpus --local 2>&1 | tee "$RESULTS/discovery.txt"
    return "$rc"
}

# packed after every step, so a call stopped at its time limit still returns what was measured
pack() {
    [ -n "${PACK:-}" ] || return 0
    tar czf "$PACK.part" -C "$RESULTS" . && mv "$PACK.part" "$PACK"
}
status=0
trap pack EXIT
for stage in "${@:-check}"; do
    case "$stage" in
      check)
        check || status=1 ;;
      tests)
        timeout "$STAGE_S" python3 -m pytest -m gpu -s -p no:cacheprovider -rs \
            "${GPU_TESTS[@]}" 2>&1 | tee "$RESULTS/gpu-tier.log"
        pack
        timeout "$STAGE_S" "${GS[@]}" demo --short --no-live --out "$RESULTS/demo" 2>&1 \
            | tail -60 | tee "$RESULTS/demo.txt" ;;
      caps)
        timeout "$STAGE_S" python3 -m pytest -m gpu -s -p no:cacheprovider -rs \
            "${CAPS_TESTS[@]}" 2>&1 | tee "$RESULTS/caps.log" ;;
      dra)
        timeout "$STAGE_S" python3 -m pytest -s -p no:cacheprovider -rs \
            "${DRA_TESTS[@]}" 2>&1 | tee "$RESULTS/dra-caps.log" ;;
      agentcpu)
        timeout "$STAGE_S" python3 benchmarks/node_agent_cpu.py --real --seconds 20 2>&1 \
            | tee "$RESULTS/agent-cpu.txt" ;;
      profile)
        for model in $MODELS; do
            mapfile -t as < <(as_model "$model")
            "${GS[@]}" profile "${as[@]}" --name "$model" --out "$RESULTS/profiles.csv" \
                --caps "$PROFILE_CAPS" --batches "$PROFILE_BATCHES" --procs "$PROFILE_PROCS" \
                --warmup-s 1 --window-s 2 2>&1 | tee "$RESULTS/profile-$model.log" | tail -3
            pack
        done ;;
      sharing)
        mapfile -t as < <(as_model "$SHARING_MODEL")
        as[0]=--workload=${as[0]}
        prof=()
        [ -f "$RESULTS/profiles.csv" ] && prof=(--profile "$RESULTS/profiles.csv")
        for b in $SHARING_BATCHES; do
          for n in $SHARING_REPLICAS; do
            "${GS[@]}" bench sharing "${as[@]}" "${prof[@]}" --replicas "$n" --batch "$b" \
                --repeats "$SHARING_REPEATS" --parts "$SHARING_PARTS" --warmup-s 2 \
                --noisy-splits "$SHARING_NOISY_SPLITS" \
                --window-s "$SHARING_WINDOW_S" --out "$RESULTS/sharing-n$n-b$b" 2>&1 \
                | tee "$RESULTS/sharing-n$n-b$b.txt"
            pack
          done
        done ;;
      *)
        echo "unknown stage $stage (check, tests, caps, dra, agentcpu, profile, sharing)" >&2
        status=2 ;;
    esac
    pack
done
exit "$status"
