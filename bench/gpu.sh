#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU and a preinstalled torch + transformers (no venv,
# no network): builds AutoMoE against that torch (CUDA on when nvcc matches), runs the tests, then
# the side-by-side comparison for Qwen3-30B-A3B's layer geometry, writing everything under
# ${OUT:-bench/results/gpu}. Budget: 8 minutes in all.
#   bash bench/gpu.sh                 # preset qwen3-30b-a3b-L4
#   PRESET=qwen3-30b-a3b-L2 bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
PRESET=${PRESET:-qwen3-30b-a3b-L4}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
start=$(date +%s)
step() { echo "== [$(( $(date +%s) - start ))s] $*"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('transformers', transformers.__version__)"
command -v nvcc && nvcc --version | tail -1

# nlohmann-json and GoogleTest may be missing on the GPU machine: scripts/gpu-deps.sh copies them
# into .deps/ here, and the device run carries .deps; CMake falls back to it.
step "configure + build (Release, $(nproc) jobs)"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v $PY)" \
  -DAUTOMOE_PYTHON_OUT="$PWD/build-gpu/python/automoe" > "$OUT/cmake.log" 2>&1 \
  || { tail -30 "$OUT/cmake.log"; exit 1; }
grep "automoe:" "$OUT/cmake.log"
cmake --build build-gpu -j "$(nproc)" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
# The package as the in-tree build lays it out: sources from python/, binaries from build-gpu/.
PKG="$PWD/build-gpu/python"
cp python/automoe/*.py "$PKG/automoe/"
export PYTHONPATH="$PKG"

step "C++ tests (ctest)"
if [ -x build-gpu/automoe_tests ]; then
  (cd build-gpu && ctest --output-on-failure -j 8 > "../$OUT/ctest.log" 2>&1); tail -3 "$OUT/ctest.log"
else
  echo "no GoogleTest on this machine: C++ tests not built"
fi

step "op benchmark: matmul peak on the GPU"
"$PKG/automoe/bin/automoe" bench --peak --device cuda --json "$OUT/peak.json" | tail -12

step "side by side: $PRESET, bf16, fake balanced gate"
timeout 300 $PY bench/compare_hf.py --preset "$PRESET" --device cuda --dtype bfloat16 \
  --batch 1 --seq 4096 --warmup 1 --steps 3 --fake-balanced-gate \
  --automoe "$PKG/automoe/bin/automoe" --timeout 120 --out "$OUT/$PRESET" \
  || echo "compare_hf failed or ran out of time (see above)"
step "done; results under $OUT"
