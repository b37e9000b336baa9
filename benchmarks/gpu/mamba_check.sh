#!/usr/bin/env bash
# Mamba on the GPU (issue 19 item 3) in one device call (one GPU): build the CUDA
# extension, the cuda tests (the scan / conv kernels against the float64 reference loop,
# std Mamba's bf16 step against transformers, the fp32 steps of std Mamba and the Mamba-2
# example against the CPU reference), the kernel benchmark (ours vs the reference
# loop, transformers' torch path and mamba_ssm where installed, at a mamba-130m layer's
# shape) and the step benchmark (std Mamba vs MambaForCausalLM, 4 of mamba-130m's 24
# layers, B 2, T 2048). Logs and JSON go to $OUT. Meant to finish in under 3 minutes.
#   bash benchmarks/gpu/mamba_check.sh
#   STAGES="build tests" bash benchmarks/gpu/mamba_check.sh
# Knobs: STAGES (build tests kernel step), TESTS, VARIANTS, LAYERS, BATCH, SEQ, STEPS.
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
STAGES=${STAGES:-"build tests kernel step"}
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"; STAMP_LOG=mamba_check.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import importlib.util as u, torch, transformers; print("torch", torch.__version__,
"cuda", torch.version.cuda, "transformers", transformers.__version__, "mamba_ssm",
u.find_spec("mamba_ssm") is not None, "causal_conv1d", u.find_spec("causal_conv1d") is not None)' \
  | tee -a "$OUT/device.txt"
stage_build() { build_extension; }
stage_tests() {
  timeout 120 python3 -m pytest -m cuda -p no:cacheprovider -rfs --durations=5 \
    ${TESTS:-tests/test_cuda_mamba.py tests/test_cuda_std_mamba.py \
    "tests/test_cuda_models.py::test_fp32_step_matches_the_cpu_reference[example_mamba]" \
    "tests/test_cuda_models.py::test_fp32_step_matches_the_cpu_reference[mamba]"} \
    2>&1 | tee "$OUT/tests.log" | tail -25
}
stage_kernel() {
  timeout 90 python3 benchmarks/kernels/bench_mamba.py --json "$OUT/bench_mamba.json" \
    2>&1 | tee "$OUT/bench_mamba.txt"
}
stage_step() {
  python3 benchmarks/gpu/mamba_step.py --layers "${LAYERS:-4}" --batch "${BATCH:-2}" \
    --seq "${SEQ:-2048}" --steps "${STEPS:-5}" --warmup 2 --hf-steps 2 --hf-warmup 1 \
    --timeout 75 --variants "${VARIANTS:-modulec,hf_eager}" --json "$OUT/mamba_step.json" \
    > "$OUT/mamba_step.txt" 2> "$OUT/mamba_step.err"
  head -6 "$OUT/mamba_step.txt"
  tail -3 "$OUT/mamba_step.err"
}
run_stages $STAGES
stamp done
