#!/usr/bin/env bash
# The MoE step without a host sync (issue 19 item 2) in one device call: build the CUDA
# extension, the cuda tests (grouped GEMM against the loop, the routing and a tiny
# Mixtral / Qwen3-MoE step captured in one CUDA graph, std MoE parity with transformers),
# the grouped-GEMM kernel benchmark, then the Mixtral-shaped step against HF's
# MixtralForCausalLM (benchmarks/gpu/moe_step.py). Logs and JSON go to $OUT.
#   bash benchmarks/gpu/moe_check.sh                      # tests, kernel bench, step bench
#   STAGES="tests" bash benchmarks/gpu/moe_check.sh       # the tests only (about 2 minutes)
#   STAGES="step" VARIANTS=modulec,hf_bf16 LAYERS=4 bash benchmarks/gpu/moe_check.sh
# Knobs: STAGES (build tests kernel step), VARIANTS, LAYERS, BATCH, SEQ, STEPS, TIMEOUT (s per
# step variant), TEST_TIMEOUT, KERNEL_TIMEOUT, STEP_TIMEOUT (s for those stages: a hang
# leaves the logs; the step's JSON is written after each variant), TAG (the step's file
# names: moe_step-$TAG.json). Under the device's 10-minute limit per call, run it as
#   STAGES="build tests kernel" bash benchmarks/gpu/moe_check.sh
#   STAGES=step TAG=a VARIANTS=modulec,modulec_eager,modulec_noarena,hf_eager,hf_bf16 bash ...
#   STAGES=step TAG=b VARIANTS=modulec,hf_compile,hf_bf16_compile bash ...
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
STAGES=${STAGES:-"build tests kernel step"}
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"; STAMP_LOG=moe_check.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "_grouped_mm", hasattr(torch, "_grouped_mm"))' \
  | tee -a "$OUT/device.txt"
stage_build() { build_extension; }
stage_tests() {
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m cuda -p no:cacheprovider -rfs --durations=8 \
    ${TESTS:-tests/test_cuda_grouped_gemm.py tests/test_cuda_std_moe.py \
    "tests/test_cuda_kernels.py::test_moe_permute_and_unpermute_match_the_reference"} 2>&1 | tee "$OUT/tests.log" | tail -30
}
stage_kernel() {
  timeout "${KERNEL_TIMEOUT:-240}" python3 benchmarks/kernels/bench_grouped_gemm.py --json "$OUT/grouped_gemm.json" \
    2>&1 | tee "$OUT/grouped_gemm.txt"
}
stage_step() {
  local name=moe_step${TAG:+-$TAG}
  timeout "${STEP_TIMEOUT:-570}" python3 benchmarks/gpu/moe_step.py --layers "${LAYERS:-4}" \
    --batch "${BATCH:-4}" --seq "${SEQ:-2048}" --steps "${STEPS:-10}" \
    --timeout "${TIMEOUT:-240}" ${VARIANTS:+--variants "$VARIANTS"} \
    --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  head -14 "$OUT/$name.txt"
  grep -v "^\s*$" "$OUT/$name.err" | cut -c1-300 | tail -8
}
run_stages $STAGES
stamp done
