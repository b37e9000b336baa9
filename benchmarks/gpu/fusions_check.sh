#!/usr/bin/env bash
# LayerNorm / GELU / softmax kernels (issue 19 item 5) in one device call: build the CUDA
# extension, the cuda tests (the new kernels against the reference; the RMSNorm / SwiGLU /
# GeGLU kernels, whose files now share rows.cuh and activations.cuh; the std GPT-2,
# Gemma, Qwen2, GPT-NeoX and Phi bf16 steps against transformers), the kernel rows (ours
# vs the reference path vs torch eager vs torch.compile), then the GPT-2 small step
# (B 8 x T 1024) before / after the kernels. Logs and JSON go to $OUT.
#   bash benchmarks/gpu/fusions_check.sh                  # everything (under 3 minutes)
#   STAGES="tests" bash benchmarks/gpu/fusions_check.sh   # the tests only
#   NO_COMPILE=1 ...                                      # kernel rows without torch.compile
# Knobs: STAGES (build tests kernel step), TESTS, DIMS, ITERS, NO_COMPILE, KERNEL_TIMEOUT,
# BATCH, SEQ, STEPS, STEP_TIMEOUT.
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
STAGES=${STAGES:-"build tests kernel step"}
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"; STAMP_LOG=fusions_check.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
  | tee -a "$OUT/device.txt"
stage_build() { build_extension; }
stage_tests() {  # test_cuda_kernels: the kernels whose files changed (norms.cu, swiglu.cu)
  python3 -m pytest -m cuda -p no:cacheprovider -rfs --durations=8 \
    ${TESTS:-tests/test_cuda_fusions.py tests/test_cuda_std_models.py \
    tests/test_cuda_std_neox_phi.py tests/test_cuda_kernels.py \
    -k "not test_cuda_kernels or rmsnorm or fused_residual or norms or swiglu or geglu or qk_norm or write"} \
    2>&1 | tee "$OUT/tests.log" | tail -30
}
stage_kernel() {  # GPT-2's width by default (DIMS="768 2560" adds Phi-2's)
  timeout "${KERNEL_TIMEOUT:-150}" python3 benchmarks/kernels/bench_fusions.py \
    --dims ${DIMS:-768} --iters "${ITERS:-10}" ${NO_COMPILE:+--no-compile} \
    --json "$OUT/bench_fusions.json" 2>&1 | tee "$OUT/bench_fusions.txt" | tail -30
}
stage_step() {
  python3 benchmarks/gpu/fusions_step.py --batch "${BATCH:-8}" --seq "${SEQ:-1024}" \
    --steps "${STEPS:-10}" --warmup 2 --timeout "${STEP_TIMEOUT:-120}" \
    --json "$OUT/fusions_step.json" > "$OUT/fusions_step.txt" 2> "$OUT/fusions_step.err"
  cat "$OUT/fusions_step.txt"
  tail -3 "$OUT/fusions_step.err"
}
run_stages $STAGES
stamp done
