#!/bin/bash
# One GPU session in one command, about 8 minutes, each stage under its own
# time limit and writing its rows as it goes (a stage cut off keeps what it
# measured; stages.jsonl says which stages ended and how):
#   1. tests:   `pytest -m gpu` over what compiles differently from interpret
#               mode: every preset's rounding, the stable presets' and MLA's
#               gradients, NaN padding, split-KV (with key lengths and
#               segments), the FP32 presets at their tiles, and the Hopper
#               path (mosaic_gpu) against its interpret mode;
#   2. hopper:  the Hopper path against cuDNN, jax's mha and attention_mgpu
#               and our Triton path, forward and forward+backward, causal
#               and not, BF16, head dim 128 at 8K, 4K, 16K, with each of
#               FlashAttention-3's forms (Options.hopper_form); then each
#               feature (window, softcap, sink, bias, bottom-right
#               lengths) on both paths and cuDNN at 8K;
#   3. price:   the stable presets against their base presets (and jax's
#               mha and cuDNN in BF16), forward and forward+backward, time
#               and program memory, head dim 128 at 8K, 4K, 16K (the FP32
#               pair at 2K, at its own tiles);
#   5. regimes: the audit of cuDNN, xla, the stable presets and mosaic_gpu
#               at small_logits, poisoned_padding, finite_mask, tied_maxima;
#   6. levers:  one forward per lever (registers, shared memory, base 2,
#               causal skipping) timed, then Nsight Compute's counters, the
#               Hopper path's forward among them;
#   7. drift:   Flash vs Baseline next to BF16 vs FP32 at 20M parameters.
# Usage:
#   launch/gpu_session.sh RECORD_DIR [PACK.tgz]
# RECORD_DIR receives the rows (launch/gpu_report.py reads it on a CPU);
# PACK, if given, is rewritten after every stage with RECORD_DIR packed.
# Stage limits in seconds: TESTS_S HOPPER_S OFFSETS_S PRICE_S REGIMES_S
# LEVERS_S DRIFT_S
# (0 skips a stage). GPU_SESSION_SMALL=1 runs every stage on the CPU path
# (interpret mode, a test's sizes): tests/test_gpu_session.py does.
set -u
record=${1:?usage: launch/gpu_session.sh RECORD_DIR [PACK.tgz]}
pack=${2:-}
small=${GPU_SESSION_SMALL:-0}
tests_s=${TESTS_S:-90}
hopper_s=${HOPPER_S:-90}
offsets_s=${OFFSETS_S:-90}
price_s=${PRICE_S:-100}
regimes_s=${REGIMES_S:-75}
levers_s=${LEVERS_S:-65}
drift_s=${DRIFT_S:-70}
# A stage cut off at its limit gets SIGABRT first: with the fault handler
# on, its log ends in the Python stack where it was.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# Processes of one stage share the card: each takes memory as it needs it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
mkdir -p "$record/audit" "$record/offsets"
: > "$record/stages.jsonl"

"$python" - "$record" "${GPU_SESSION_COMMIT:-}" > "$record/session.log" 2>&1 <<'EOF'
import datetime, json, subprocess, sys
import jax
record, commit = sys.argv[1], sys.argv[2]
session = {
  "device": jax.devices()[0].device_kind,
  "platform": jax.default_backend(),
  "jax": jax.__version__,
  "date": datetime.date.today().isoformat(),
  "commit": commit,
  "script": "launch/gpu_session.sh",
}
try:
  import triton
  session["triton"] = triton.__version__
  session["driver"] = subprocess.run(
    ["nvidia-smi", "--query-gpu=driver_version,memory.total",
     "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except Exception as e:  # a CPU run has neither
  session["driver"] = f"none ({type(e).__name__})"
open(f"{record}/session.json", "w").write(json.dumps(session, indent=2) + "\n")
print(session)
EOF

save() {
  [ -n "$pack" ] && tar czf "$pack" -C "$(dirname "$record")" "$(basename "$record")"
  return 0
}

stage() {  # name seconds command...
  local name=$1 limit=$2
  shift 2
  if [ "$limit" -le 0 ]; then
    echo "{\"stage\": \"$name\", \"skipped\": true}" >> "$record/stages.jsonl"
    return 0
  fi
  local start=$SECONDS
  timeout -s ABRT --kill-after=10 "$limit" "$@" > "$record/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  # timeout's 124, or 134 (SIGABRT) and 137 (SIGKILL) from a stage cut off.
  local cut=false
  { [ $rc -eq 124 ] || [ $rc -eq 134 ] || [ $rc -eq 137 ]; } && cut=true
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $took," \
    "\"limit\": $limit, \"cut_off\": $cut}" >> "$record/stages.jsonl"
  echo "stage $name: rc=$rc, ${took} s of ${limit} s, cut off: $cut"
  save
}

small_flag=()
# At 1024 keys the FP64 golden of five audits side by side took the whole
# stage on the host (H100 session, 2026-11-26): 256 keys, head dim 128.
audit_shape=${AUDIT_SHAPE:-'((1,256,256,4,2,128),)'}
mosaic_audit_shape=$audit_shape
kernels=(cudnn xla mosaic_gpu)
# name kernel [options...] of each key-offset audit.
offset_audits=(
  "cudnn cudnn" "jax_mha jax_mha" "torch_sdpa_flash torch_sdpa_flash"
  "torch_sdpa_efficient torch_sdpa_efficient"
  "torch_sdpa_cudnn torch_sdpa_cudnn" "pallas pallas"
  "pallas_stable pallas --config.kernel_precision=stable"
  "pallas_center_kv pallas --config.kernel_options=center_kv=True"
  "mosaic_gpu mosaic_gpu"
  "mosaic_gpu_stable mosaic_gpu --config.kernel_precision=stable"
  "mosaic_gpu_center_kv mosaic_gpu --config.kernel_options=center_kv=True"
)
drift_config=(
  --config=configs/training_drift.py:gpu
  --config.model.width=512 --config.model.depth=6 --config.model.heads=8
  --config.train.total_steps=400 --config.train.warmup_steps=40
  --config.train.log_every=100 --config.train.checkpoint_every=400
  --config.data.corpus_tokens=4194304
)
if [ "$small" = 1 ]; then
  small_flag=(--small)
  audit_shape='((1,192,192,4,2,32),)'
  # GPU interpret mode took 114 s for the four regimes at that shape (one
  # process, 2 cores), past the stage's limit beside four other audits;
  # 23 s at this one, every regime still judged.
  mosaic_audit_shape='((1,64,64,2,1,64),)'
  kernels=(xla mosaic_gpu)
  offset_audits=("xla xla" "pallas pallas"
    "pallas_center_kv pallas --config.kernel_options=center_kv=True")
  drift_config=(--config=configs/training_drift.py:smoke
    --config.train.total_steps=4 --config.train.log_every=2
    --config.train.checkpoint_every=4 --config.attention.context_parallel=0)
fi

stage tests "$tests_s" "$python" -m pytest -m gpu -n "${TEST_WORKERS:-14}" \
  -v -p no:cacheprovider tests/test_gpu_lowering.py \
  tests/test_gpu_compiled_gradients.py tests/test_triton_gpu_fixes.py \
  tests/test_mosaic_gpu.py tests/test_offsets.py \
  -k "round_like or rounds_like or keeps_nan or split_kv or fp32_presets or matches_interpret"

stage hopper "$hopper_s" "$python" launch/gpu_stage.py --stage=hopper \
  --out="$record/hopper.jsonl" "${small_flag[@]}"

audit_one() {  # STAGE NAME KERNEL [OPTIONS...]: one kernel's audit, in the
  # background of a stage's audits; rows in runs/gpu_session/STAGE_NAME.
  local stage=$1 name=$2 kernel=$3 shape=$audit_shape
  shift 3
  [ "$kernel" = mosaic_gpu ] && shape=$mosaic_audit_shape
  # Two BLAS threads each: six audits' FP64 goldens with 16 threads apiece
  # thrashed the host's 16 cores (H100 session, 2026-11-26: four of six
  # audits were still in their first golden VJP after 130 s).
  OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 \
  "$python" launch/audit.py --workdir="runs/gpu_session/${stage}_$name" \
    --config=smoke --config.kernel="$kernel" "$@" \
    --config.features=none --config.shapes="$shape" \
    > "$record/$stage/$name.log" 2>&1
  echo "$stage $name rc=$?"
}
keep_rows() {  # STAGE: the rows its audits appended, a cut-off one's too
  for run in runs/gpu_session/"$1"_*; do
    [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$record/$1/${run##*/$1_}.jsonl"
  done
  save
}
export -f audit_one
export python audit_shape mosaic_audit_shape record

offsets() {
  rm -rf runs/gpu_session/offsets_*
  for audit in "${offset_audits[@]}"; do
    # shellcheck disable=SC2086
    audit_one offsets $audit --config.precisions=bf16-framework \
      --config.regimes=key_offset --config.invariances=key_shift &
  done
  wait
}
stage offsets "$offsets_s" bash -c "$(declare -f offsets); $(declare -p offset_audits); offsets"
keep_rows offsets

stage price "$price_s" "$python" launch/gpu_stage.py --stage=price \
  --out="$record/price.jsonl" "${small_flag[@]}"

regimes() {
  local four=small_logits,poisoned_padding,finite_mask,tied_maxima
  rm -rf runs/gpu_session/audit_*
  for kernel in "${kernels[@]}"; do
    audit_one audit "$kernel" "$kernel" --config.precisions=bf16-framework \
      --config.regimes="$four" &
  done
  # The stable presets, one process per format.
  for precisions in fp32 bf16-framework fp16-framework; do
    audit_one audit "pallas_stable_${precisions%-framework}" pallas \
      --config.precisions="$precisions" --config.kernel_precision=stable \
      --config.regimes="$four" &
  done
  wait
}
stage regimes "$regimes_s" bash -c "$(declare -f regimes); kernels=(${kernels[*]}); regimes"
keep_rows audit

levers() {
  "$python" launch/gpu_stage.py --stage=levers --out="$record/levers.jsonl" "$@" || return
  if ! command -v ncu > /dev/null; then
    echo "ncu is not on this machine: no counters"
    return 0
  fi
  # The tensor pipe's metric by the name this ncu knows (one unknown name
  # fails the whole pass).
  local metrics=gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__sass_inst_executed_op_local_ld.sum
  ncu --query-metrics --chip gh100 > "$record/ncu_metrics.txt" 2>&1
  local tensor
  tensor=$(awk '{print $1}' "$record/ncu_metrics.txt" | grep -m1 -x -E \
    'sm__pipe_tensor_op_gmma_cycles_active|sm__pipe_tensor_cycles_active|sm__pipe_tensor_op_hmma_cycles_active')
  [ -n "$tensor" ] && metrics="$metrics,$tensor.avg.pct_of_peak_sustained_active"
  ncu --clock-control none -k regex:'flash_forward|mha_forward|mosaic_forward' -c 20 --csv \
    --log-file "$record/ncu.csv" --metrics "$metrics" \
    "$python" launch/gpu_stage.py --stage=ncu_pass --out="$record/ncu_order.json" "$@" || return
  "$python" launch/gpu_stage.py --stage=ncu_rows --ncu_csv="$record/ncu.csv" \
    --order="$record/ncu_order.json" --out="$record/nsight.jsonl"
}
stage levers "$levers_s" bash -c "$(declare -f levers); levers ${small_flag[*]}"

drift() {
  rm -rf runs/gpu_session/drift
  "$python" launch/training_drift.py --workdir=runs/gpu_session/drift \
    "$@" --config.pairs=flash_vs_baseline,bf16_vs_fp32 \
    --config.train.replicates=1 --config.train.grad_error=False
  local rc=$?
  mkdir -p "$record/drift"
  cp runs/gpu_session/drift/{metrics.jsonl,report.md,headline.json,config.json} \
    "$record/drift/" 2>/dev/null
  return $rc
}
stage drift "$drift_s" bash -c "$(declare -f drift); drift ${drift_config[*]}"
# A drift run cut off still leaves the rows it logged.
mkdir -p "$record/drift"
cp runs/gpu_session/drift/metrics.jsonl "$record/drift/" 2>/dev/null
save
cat "$record/stages.jsonl"
