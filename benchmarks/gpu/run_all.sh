#!/usr/bin/env bash
# Build, check and time the GPU training step in one device call (issue 6):
#   STAGES="build tests bench sweep budget" VARIANTS=modulec,hf_eager,hf_compile,hf_ckpt \
#     bash benchmarks/gpu/run_all.sh
# Logs go to $OUT (or ./gpu-logs). Needs lark: carried as .whl/ (see docs/gpu.md).
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
STAGES=${STAGES:-"build tests bench"}
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/device.txt"
# bench, sweep, budget: benchmarks/train_step.py with VARIANTS, SWEEP (modulec's memory/speed
# options: train_step.py SWEEP) or BUDGET_VARIANTS (the memory-budget sweep: derived
# backward, the planner decides: BUDGETS); each to $OUT/<name>.json, .log and .err
train_step() {
  local name=$1 json=$2 variants=$3
  python3 benchmarks/train_step.py --variants "$variants" \
    --batch "${BATCH:-4}" --seq "${SEQ:-2048}" --layers "${LAYERS:-22}" \
    --steps "${STEPS:-10}" --json "$OUT/$json.json" 2> "$OUT/$name.err" | tee "$OUT/$name.log"
  tail -5 "$OUT/$name.err"
}
stage_build() { build_extension; }
stage_tests() {
  python3 -m pytest -m cuda -x -p no:cacheprovider ${TESTS:-tests/test_cuda_kernels.py \
    tests/test_cuda_train.py} 2>&1 | tee "$OUT/tests.log" | tail -25
}
stage_profile() { python3 benchmarks/gpu/profile_step.py 2>&1 | tee "$OUT/profile.log" | tail -45; }
stage_bench() {
  train_step bench train_step "${VARIANTS:-modulec,modulec_norecompute,hf_eager,hf_compile,hf_ckpt}"
}
stage_sweep() {
  train_step sweep sweep "${SWEEP:-modulec,modulec_keepgrads,modulec_torchadam,modulec_norecompute,modulec_norecompute_keepgrads,modulec_norecompute_torchadam}"
}
stage_budget() {
  train_step budget budget "${BUDGET_VARIANTS:-modulec_norecompute,modulec_norecompute_budget26,modulec_norecompute_budget24,modulec_norecompute_budget22,modulec_norecompute_budget21,modulec_norecompute_budget20,modulec_norecompute_budget19,modulec_norecompute_budget18.3,hf_ckpt,hf_compile}"
}
run_stages $STAGES
