#!/usr/bin/env bash
# One device call (one GPU, sm90) for FP8 on the GPU step (decisions.md, "FP8 on the GPU"):
# build the extension, the FP8 cuda tests, the FP8 GEMM kernel benchmark (bf16 vs fp8 at
# the TinyLlama and Llama-3-8B layer shapes, M = 8192), then train_step.py's variants
# (tokens/s and peak memory, B 4, T 2048, one run a shape) at each of SHAPES (tinyllama,
# llama3-8b-layers: 4 Llama-3-8B layers). Each stage's seconds go to $OUT/stages.txt.
#   STAGES="build tests gemm step" bash benchmarks/gpu/fp8_check.sh      (about 6 minutes)
#   STAGES="build tests step" TESTS=tests/test_fp8_gemm.py STEPS=6 WARMUP=2 \
#     SHAPES="tinyllama llama3-8b-layers" \
#     VARIANTS=modulec_norecompute,modulec_norecompute_fp8,hf_compile,hf_compile_fp8 \
#     bash benchmarks/gpu/fp8_check.sh        (issue 19's two FP8 targets in one call)
#   STAGES="build tests step" TESTS="tests/test_fp8_producers.py tests/test_fp8_gemm.py" \
#     STEPS=6 WARMUP=2 SHAPES="tinyllama llama3-8b-layers" \
#     VARIANTS=modulec_norecompute_fp8,modulec_norecompute_fp8_fusedcast \
#     bash benchmarks/gpu/fp8_check.sh        (the casts in their producers, opt-in, against not)
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"; STAGE_TIMES=stages.txt
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
  | tee -a "$OUT/device.txt"
stage_build() { build_extension 3; }
stage_tests() {
  python3 -m pytest -m cuda -x -p no:cacheprovider -W ignore::FutureWarning \
    ${TESTS:-tests/test_fp8_gemm.py tests/test_fp8_producers.py tests/test_fp8.py} 2>&1 | tee "$OUT/fp8-tests.log" | tail -15
}
stage_gemm() {
  python3 benchmarks/kernels/bench_fp8_gemm.py --json "$OUT/results_fp8_gemm.json" \
    2>&1 | tee "$OUT/fp8-gemm.txt" | grep -v '^{'
}
stage_step() {
  local shape
  for shape in ${SHAPES:-tinyllama}; do
    python3 benchmarks/train_step.py --shape "$shape" \
      --variants ${VARIANTS:-modulec,modulec_fp8} --steps ${STEPS:-10} \
      --warmup ${WARMUP:-3} --json "$OUT/results_train_step_fp8_$shape.json" \
      2>"$OUT/train-step-$shape.err" | grep -v '^[{} ]' | grep -v '^  *"' \
      | tee "$OUT/train-step-$shape.txt"
    tail -3 "$OUT/train-step-$shape.err"
  done
}
run_stages ${STAGES:-build tests gemm step}
