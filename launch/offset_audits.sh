#!/bin/bash
# The shared-offset audit of every kernel this machine runs: the
# key_offset regime and the key_shift and value_shift invariances, FP32
# and BF16 at the smoke shape, one run directory per kernel under OUT
# (docs/findings.md and docs/results.md quote them; the GPU kernels are
# the offsets stage of launch/gpu_session.sh).
#   launch/offset_audits.sh OUT
set -u
out=${1:?usage: launch/offset_audits.sh OUT}
python=${PYTHON:-python}
audits=(
  "pallas pallas" "pallas_stable pallas --config.kernel_precision=stable"
  "pallas_center_kv pallas --config.kernel_options=center_kv=True"
  "pallas_o_lo pallas --config.kernel_precision=bf16-fa2+delta_source=hi_lo --config.precisions=bf16-framework"
  "mosaic_gpu mosaic_gpu --config.precisions=bf16-framework"
  "mosaic_gpu_center_kv mosaic_gpu --config.precisions=bf16-framework --config.kernel_options=center_kv=True"
  "xla xla" "jax_mha jax_mha" "jax_splash jax_splash" "jax_tpu_flash jax_tpu_flash"
  "tokamax_xla tokamax_xla" "tokamax_xla_chunked tokamax_xla_chunked"
  "keras_dpa keras_dpa" "torch_sdpa_math torch_sdpa_math"
  "torch_sdpa_flash torch_sdpa_flash" "torch_flex torch_flex"
)
for audit in "${audits[@]}"; do
  # shellcheck disable=SC2086
  set -- $audit
  name=$1 kernel=$2
  shift 2
  "$python" launch/audit.py --workdir="$out/$name" --restart --config=smoke \
    --config.kernel="$kernel" --config.features=none \
    --config.regimes=key_offset --config.invariances=key_shift,value_shift \
    "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"
done
