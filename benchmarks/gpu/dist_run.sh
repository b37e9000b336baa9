#!/usr/bin/env bash
# The multi-GPU training-step benchmark (issue 17, item 8) in one device call on a host with
# two GPUs: build the CUDA extension, then benchmarks/train_step_dist.py (every variant in
# its own torchrun; NCCL_NVLS_ENABLE=0 everywhere). Logs and JSON go to $OUT (./gpu-logs).
#   bash benchmarks/gpu/dist_run.sh                                # TinyLlama, all variants
#   VARIANTS=modulec_1gpu,modulec_zero2,hf_fsdp2_compile STEPS=10 bash benchmarks/gpu/dist_run.sh
#   SHAPE=llama3-8b BUDGET=70 bash benchmarks/gpu/dist_run.sh      # B=1, FSDP2 + AC peer
# Other knobs: BATCH, SEQ, LAYERS, GPUS, WARMUP, PROFILE_STEPS, TIMEOUT (s per variant).
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/device.txt"
/usr/bin/time -f "extension build %e s" python3 -c \
  'from runtime.cuda.build import load; load()' 2>&1 | tail -5 | tee "$OUT/build.log"
SHAPE=${SHAPE:-tinyllama}
python3 benchmarks/train_step_dist.py --shape "$SHAPE" ${VARIANTS:+--variants "$VARIANTS"} \
  ${BATCH:+--batch "$BATCH"} ${LAYERS:+--layers "$LAYERS"} ${BUDGET:+--budget "$BUDGET"} \
  --seq "${SEQ:-2048}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" \
  --profile-steps "${PROFILE_STEPS:-2}" --gpus "${GPUS:-2}" --timeout "${TIMEOUT:-300}" \
  --json "$OUT/train_step_dist-$SHAPE.json" 2> "$OUT/dist-$SHAPE.err" | tee "$OUT/dist-$SHAPE.log"
tail -5 "$OUT/dist-$SHAPE.err"
