#!/usr/bin/env bash
# Build, check and time the GPU training step in one device call (issue 6):
#   STAGES="build tests bench sweep budget" VARIANTS=modulec,hf_eager,hf_compile,hf_ckpt \
#     bash benchmarks/gpu/run_all.sh
# Logs go to $OUT (or ./gpu-logs). Needs lark: carried as .whl/ (see docs/gpu.md).
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
STAGES=${STAGES:-"build tests bench"}
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/device.txt"
for stage in $STAGES; do
  case $stage in
    build)
      /usr/bin/time -f "extension build %e s" python3 -c \
        'from runtime.cuda.build import load; load()' 2>&1 | tail -5 | tee "$OUT/build.log" ;;
    tests)
      python3 -m pytest -m cuda -q -x -p no:cacheprovider ${TESTS:-tests/test_cuda_kernels.py \
        tests/test_cuda_train.py} 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    profile)
      python3 benchmarks/gpu/profile_step.py 2>&1 | tee "$OUT/profile.log" | tail -45 ;;
    bench)
      python3 benchmarks/train_step.py --variants "${VARIANTS:-modulec,modulec_norecompute,hf_eager,hf_compile,hf_ckpt}" \
        --batch "${BATCH:-4}" --seq "${SEQ:-2048}" --layers "${LAYERS:-22}" \
        --steps "${STEPS:-10}" --json "$OUT/train_step.json" 2> "$OUT/bench.err" | tee "$OUT/bench.log"
      tail -5 "$OUT/bench.err" ;;
    sweep)  # modulec's memory/speed options (benchmarks/train_step.py SWEEP)
      python3 benchmarks/train_step.py --variants "${SWEEP:-modulec,modulec_keepgrads,modulec_torchadam,modulec_norecompute,modulec_norecompute_keepgrads,modulec_norecompute_torchadam}" \
        --batch "${BATCH:-4}" --seq "${SEQ:-2048}" --layers "${LAYERS:-22}" \
        --steps "${STEPS:-10}" --json "$OUT/sweep.json" 2> "$OUT/sweep.err" | tee "$OUT/sweep.log"
      tail -5 "$OUT/sweep.err" ;;
    budget)  # the memory-budget sweep: derived backward, the planner decides (BUDGETS)
      python3 benchmarks/train_step.py --variants "${BUDGET_VARIANTS:-modulec_norecompute,modulec_norecompute_budget26,modulec_norecompute_budget24,modulec_norecompute_budget22,modulec_norecompute_budget21,modulec_norecompute_budget20,modulec_norecompute_budget19,modulec_norecompute_budget18.3,hf_ckpt,hf_compile}" \
        --batch "${BATCH:-4}" --seq "${SEQ:-2048}" --layers "${LAYERS:-22}" \
        --steps "${STEPS:-10}" --json "$OUT/budget.json" 2> "$OUT/budget.err" | tee "$OUT/budget.log"
      tail -5 "$OUT/budget.err" ;;
  esac
done
