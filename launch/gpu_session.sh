#!/bin/bash
# One GPU session's checks in one command, each stage under its own time
# limit so that a slow stage leaves the others their share:
#   1. compiled-kernel correctness: `pytest -m gpu` (the stable presets,
#      compiled against interpret mode bit for bit, included);
#   2. the drift study's `gpu` size (85M parameters, context 1024): Flash
#      vs Baseline against BF16-vs-FP32 training, the drift-scaling fit's
#      prediction checked;
#   3. the stable presets' price: forward and forward+backward time and
#      peak memory against their base presets and cuDNN, lengths 1K-16K.
# Usage: launch/gpu_session.sh OUT_DIR [TESTS_S DRIFT_S BENCH_S STEPS]
# (a stage given 0 seconds is skipped; on an H200 the GPU tests ran 41
# of 68 in 170 s at -n 8; STEPS: the drift run's steps, 400
# in the `gpu` config: about 1 step/s on an H200 with 3 replicates, but
# a logging step did not finish within 120 s there: profile it first).
# Everything a stage writes lands in OUT_DIR (logs, run directories
# packed in runs.tgz); stored under results/gpu/, the reports regenerate
# on a CPU.
set -u
out=${1:?usage: launch/gpu_session.sh OUT_DIR [TESTS_S DRIFT_S BENCH_S STEPS]}
tests_s=${2:-300}
drift_s=${3:-540}
bench_s=${4:-100}
steps=${5:-400}
export PYTHONUNBUFFERED=1
mkdir -p "$out" runs/gpu
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
  > "$out/device.csv" 2>&1
python3 - > "$out/versions.txt" 2>&1 <<'EOF'
import jax, flax, optax, triton
print(jax.__version__, jax.devices(), flax.__version__, optax.__version__,
      triton.__version__)
EOF

stage() {  # name seconds command...
  local name=$1 limit=$2
  shift 2
  [ "$limit" -gt 0 ] || return 0
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$out/stages.txt"
}

# Each test process takes GPU memory as it needs it: preallocating 75% of
# the card in each of 8 processes runs out of memory.
XLA_PYTHON_CLIENT_PREALLOCATE=false \
  stage gpu_tests "$tests_s" python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider --junitxml="$out/gpu_tests.xml" \
  tests/test_gpu_lowering.py
stage drift "$drift_s" python3 launch/training_drift.py \
  --workdir=runs/gpu/drift --config=configs/training_drift.py:gpu \
  --config.pairs=flash_vs_baseline,bf16_vs_fp32 \
  --config.train.replicates=3 --config.train.grad_error=False \
  --config.data.corpus_tokens=8388608 --config.train.total_steps="$steps" \
  --config.train.warmup_steps=$((steps / 10)) \
  --config.train.log_every=$((steps / 4)) --config.train.checkpoint_every="$steps"
stage bench "$bench_s" python3 launch/benchmark.py --workdir=runs/gpu/bench \
  --config.gpu.policies=bf16-fa2,bf16-fa2-stable,fp16-fa2,fp16-fa2-stable,fp32,fp32-stable \
  --config.implementations=pallas,cudnn --config.head_dims=128 \
  --config.causal='(False,)' --config.tile_search=False \
  --config.memory_implementations=pallas --config.mask_settings= \
  --config.gpu.seq_lens=1024,4096,16384 --config.gpu.memory_seq_lens=16384 \
  --config.warmup=1 --config.repeats=5
tar czf "$out/runs.tgz" --exclude='*/checkpoints' runs/gpu
tail -n 3 "$out"/*.log
cat "$out/stages.txt"
