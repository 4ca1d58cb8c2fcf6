#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU and a preinstalled torch + transformers (no venv,
# no network): builds AutoMoE against that torch (CUDA on when nvcc matches), runs the tests (the
# op-test harness on CUDA first), the op benchmark at Qwen3-30B-A3B's layer and cpu-small, then the
# side-by-side comparison for Qwen3-30B-A3B's layer geometry, a short `automoe train` run and the
# memory plan against measured runs,
# writing everything under ${OUT:-bench/results/gpu}. Budget: about 10 minutes in all.
#   bash bench/gpu.sh                 # preset qwen3-30b-a3b-L4
#   PRESET=qwen3-30b-a3b-L2 bash bench/gpu.sh
#   DEVICE=cpu PRESET=cpu-small SEQ=128 bash bench/gpu.sh     # dry run of the script without a GPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
PRESET=${PRESET:-qwen3-30b-a3b-L4}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-1}
SEQ=${SEQ:-4096}
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
  ctest --test-dir build-gpu --output-on-failure -j 8 > "$OUT/ctest.log" 2>&1; tail -3 "$OUT/ctest.log"
else
  echo "no GoogleTest on this machine: C++ tests not built"
fi

step "CUDA op tests (tests/python/test_ops.py: every op on cpu and cuda vs float64 references)"
# Our CUDA kernels are not the default until they have passed here (ops/cuda_status.h): run them.
AUTOMOE_CUDA_KERNELS=all timeout 240 $PY -m pytest -q -p no:cacheprovider tests/python/test_ops.py \
  --junitxml "$OUT/test_ops.xml" > "$OUT/test_ops.log" 2>&1
tail -15 "$OUT/test_ops.log"

step "op benchmark: fused ops vs references, qwen3-30b-a3b layer and cpu-small, bf16 on $DEVICE"
AUTOMOE_CUDA_KERNELS=all timeout 200 $PY bench/ops_bench.py --preset qwen3-30b-a3b --dtype bf16 --device "$DEVICE" \
  --reps 5 --quick-refs --json "$OUT/ops-qwen3-30b-a3b.json" --markdown "$OUT/ops-qwen3-30b-a3b.md" | tail -25 \
  || echo "ops_bench (qwen3-30b-a3b) failed or ran out of time"
AUTOMOE_CUDA_KERNELS=all timeout 60 $PY bench/ops_bench.py --preset cpu-small --dtype bf16 --device "$DEVICE" \
  --reps 5 --json "$OUT/ops-cpu-small.json" --markdown "$OUT/ops-cpu-small.md" | tail -20 \
  || echo "ops_bench (cpu-small) failed or ran out of time"

step "CUDA kernels table (docs/ops.md): harness results and speed against ATen, per kernel"
$PY bench/cuda_kernels.py --junit "$OUT/test_ops.xml" --ops "$OUT/ops-qwen3-30b-a3b.json" \
  --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo "$DEVICE")" \
  --json "$OUT/cuda_kernels.json" | tee "$OUT/cuda_kernels.md" || echo "cuda_kernels.py failed"

step "engine matmul peak on $DEVICE"
"$PKG/automoe/bin/automoe" bench --peak --device "$DEVICE" --json "$OUT/peak.json" | tail -12

step "side by side: $PRESET, bf16, batch $BATCH x seq $SEQ, fake balanced gate"
# Each side gets 90 s; results are written after every side, so the outer limit loses nothing.
timeout 420 $PY bench/compare_hf.py --preset "$PRESET" --device "$DEVICE" --dtype bfloat16 \
  --batch "$BATCH" --seq "$SEQ" --warmup 1 --steps 3 --fake-balanced-gate \
  --automoe "$PKG/automoe/bin/automoe" --timeout 90 --out "$OUT/$PRESET" \
  || echo "compare_hf failed or ran out of time (see above)"
step "side by side on another native family: DeepSeek-V3 (MLA, group routing; bench/configs), bf16"
timeout 100 $PY bench/compare_hf.py --config bench/configs/deepseek_v3-cpu-small.json --device "$DEVICE" \
  --dtype bfloat16 --batch 4 --seq 1024 --warmup 1 --steps 3 --impls grouped_mm \
  --automoe "$PKG/automoe/bin/automoe" --timeout 40 --out "$OUT/deepseek_v3-cpu-small" \
  || echo "compare_hf (deepseek_v3) failed or ran out of time (see above)"
step "side by side on the hybrid family: Nemotron 3 Nano's geometry (4 blocks MEM*, real vocabulary), bf16"
timeout 150 $PY bench/compare_hf.py --config bench/configs/nemotron_h-nano-L4.json --device "$DEVICE" \
  --dtype bfloat16 --batch 2 --seq 1024 --warmup 1 --steps 3 --impls grouped_mm \
  --automoe-optimizer float32/float32,none/bfloat16 \
  --automoe "$PKG/automoe/bin/automoe" --timeout 60 --out "$OUT/nemotron_h-nano-L4" \
  || echo "compare_hf (nemotron_h) failed or ran out of time (see above)"
AUTOMOE_CUDA_KERNELS=all timeout 60 $PY bench/ops_bench.py --preset nemotron-3-nano --dtype bf16 --device "$DEVICE" \
  --no-layer-refs --reps 2 --json "$OUT/ops-nemotron-3-nano.json" --markdown "$OUT/ops-nemotron-3-nano.md" \
  || echo "ops_bench (nemotron-3-nano: the SSD scan) failed or ran out of time"
step "trainer: examples/chat.yaml on $DEVICE, bf16 compute, the default precision (remainders + 8-bit moments), 60 steps"
# The demo's tiny model and tokenizer, then a short packed chat fine-tune with metrics and export.
$PY - "$OUT/train-model" <<'PYEOF' || echo "trainer model build failed"
import sys
from pathlib import Path
from automoe.demo import build_checkpoint, build_tokenizer
build_checkpoint(Path(sys.argv[1]), build_tokenizer(Path("examples/data/corpus.txt")))
PYEOF
timeout 240 $PY -m automoe.cli train examples/chat.yaml model.path="$OUT/train-model" \
  checkpoint.dir="$OUT/train-run" data.cache_dir="$OUT/train-cache" train.device="$DEVICE" \
  model.dtype=bfloat16 train.max_steps=60 train.micro_batch_size=16 log.every=10 log.progress=lines \
  || echo "automoe train failed or ran out of time (see above)"
$PY -m automoe.cli report "$OUT/train-run" || true
step "memory plan against the measured peak on $DEVICE: cpu-medium, 4 configurations"
# The plan's allocator overhead and runtime on a GPU are assumptions until this runs (docs/recipes.md
# #planning-a-run); the table goes to docs/performance.md#memory-plan.
timeout 150 $PY bench/plan_accuracy.py --preset cpu-medium --cases fp32,bf16,bf16-8bit,bf16-ckpt --seq 1024 \
  --work "$OUT/plan-accuracy" --record "$OUT/plan_accuracy.md" || echo "plan_accuracy failed or ran out of time"
step "done; results under $OUT"
