#!/usr/bin/env bash
# Packed sequences on the GPU step (issue 18 item 3) on one GPU: build
# the CUDA extension, the cuda tests (varlen kernel, the packed step against its documents'
# steps and the CPU reference, replays, `modulec train --device cuda --doc-sep`), the
# attention-level timing, then tokens/s packed against unpacked at the TinyLlama shape;
# `regress`: the unpacked GPU step's cuda tests (the step, attention, rope and the CLI were
# touched). Logs and JSON go to $OUT. All stages may pass 10 minutes: split in two calls
# (the extension build stays on a warm machine):
#   STAGES="build tests regress" bash benchmarks/gpu/packed_check.sh
#   STAGES="varlen step" bash benchmarks/gpu/packed_check.sh
#   STEP_ARGS="--steps 30 --mean-doc 256" STAGES=step bash benchmarks/gpu/packed_check.sh
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
  | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/device.txt"
stage_build() { build_extension 3; }
stage_tests() {
  python3 -m pytest -m cuda -p no:cacheprovider -W ignore::FutureWarning \
    tests/test_cuda_packed.py tests/test_cuda_varlen.py 2>&1 | tee "$OUT/tests.log" | tail -25
  python3 -m pytest -m "not cuda" -p no:cacheprovider tests/test_train_packing.py \
    tests/test_cuda_packed.py 2>&1 | tee "$OUT/tests-cpu.log" | tail -5
}
stage_regress() {
  python3 -m pytest -m cuda -p no:cacheprovider -W ignore::FutureWarning \
    tests/test_cuda_train.py tests/test_cuda_models.py tests/test_train_cuda.py \
    tests/test_cuda_rope_variants.py tests/test_cuda_lm_head.py 2>&1 \
    | tee "$OUT/regress.log" | tail -15
}
stage_varlen() {
  python3 benchmarks/kernels/bench_varlen.py --full-capacity \
    --json "$OUT/bench_varlen.json" 2>&1 | tee "$OUT/bench_varlen.txt"
}
stage_step() {
  python3 benchmarks/gpu/packed_step.py ${STEP_ARGS:-} --json "$OUT/packed_step.json" \
    2>&1 | tee "$OUT/packed_step.txt"
}
run_stages ${STAGES:-build tests regress varlen step}
