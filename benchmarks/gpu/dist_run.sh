#!/usr/bin/env bash
# The multi-GPU training-step benchmark (issue 17 item 8, issue 20) in one device call on a
# host with GPUS GPUs: build the CUDA extension, then benchmarks/train_step_dist.py (every
# variant in its own torchrun; NVLink multicast off everywhere). Logs and JSON go to $OUT
# (./gpu-logs), named by TAG (default SHAPE[-<LAYERS>l]-<GPUS>gpu).
#   bash benchmarks/gpu/dist_run.sh                                # TinyLlama, all variants
#   VARIANTS=modulec_1gpu,modulec_zero2,hf_fsdp2_compile STEPS=10 bash benchmarks/gpu/dist_run.sh
#   SHAPE=llama3-8b BUDGET=70 bash benchmarks/gpu/dist_run.sh      # B=1, FSDP2 + AC peer
# Other knobs: BATCH (per data-parallel rank), SEQ, LAYERS, GPUS (2), WARMUP,
# PROFILE_STEPS, TIMEOUT (s per variant), DEADLINE (s for the whole benchmark: each
# variant's timeout is cut to what is left; a variant left < 20 s is not started), TAG,
# NO_PACK (set it where a caller reads $OUT afterwards: else more than 8 files there are
# packed into $OUT/logs.tgz at the end, stages.sh `pack_out`).
#
# Issue 20 on 4 GPUs: the three runs in ONE device call (kind nvidia-h100-x4 or
# nvidia-h200-x4, timeout_s 600); the DEADLINEs add up to 510 s, the rest is three
# nvidia-smi / extension checks (the first build up to ~30 s). Each run's order puts the
# row most likely to fail or hang last, so the deadline takes the time from it alone.
# No profiler (PROFILE_STEPS=0): its traces of captured steps do not split the step
# (docs/distributed.md), and exporting them costs seconds a variant. Each row's `wall s`
# says what it took, for planning the next call.
#   export GPUS=4 STEPS=8 WARMUP=2 PROFILE_STEPS=0
#   # 1. TinyLlama DP (ZeRO-2, the best stage on 2 GPUs) vs one GPU and FSDP2 + compile
#   VARIANTS=modulec_1gpu,modulec_zero2,hf_fsdp2_compile BATCH=4 SEQ=2048 TIMEOUT=100 \
#     DEADLINE=150 bash benchmarks/gpu/dist_run.sh
#   # 2. Llama-3-8B: DP 4 ZeRO-3, FSDP2 + AC + compile, DP 2 x TP 2 ZeRO-1 (torchtitan's B=1 x 8192)
#   SHAPE=llama3-8b VARIANTS=modulec_zero3,hf_fsdp2_ckpt_compile,modulec_zero1_tp2 BATCH=1 \
#     SEQ=8192 TIMEOUT=140 DEADLINE=210 bash benchmarks/gpu/dist_run.sh
#   # 3. Llama-3-70B cut to 8 layers: TP 4, and FSDP2 + AC + compile over the same 4 GPUs
#   SHAPE=llama3-70b LAYERS=8 VARIANTS=modulec_zero0_tp4,hf_fsdp2_ckpt_compile BATCH=1 \
#     SEQ=4096 TIMEOUT=110 DEADLINE=150 bash benchmarks/gpu/dist_run.sh
# The cost model's prediction of each modulec row (CPU, any machine; docs/distributed.md):
#   python3 benchmarks/sim_70b.py --layers 8 --tp 4 --dp 1 --pp 1 --zero 0 --batch 1 \
#     --seq 4096 --device h100    # or h200: the card the run's device.txt names
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/device.txt"
build_extension
SHAPE=${SHAPE:-tinyllama}
GPUS=${GPUS:-2}
TAG=${TAG:-$SHAPE${LAYERS:+-${LAYERS}l}-${GPUS}gpu}
python3 benchmarks/train_step_dist.py --shape "$SHAPE" ${VARIANTS:+--variants "$VARIANTS"} \
  ${BATCH:+--batch "$BATCH"} ${LAYERS:+--layers "$LAYERS"} ${BUDGET:+--budget "$BUDGET"} \
  --seq "${SEQ:-2048}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" \
  --profile-steps "${PROFILE_STEPS:-2}" --gpus "$GPUS" --timeout "${TIMEOUT:-300}" \
  ${DEADLINE:+--deadline "$DEADLINE"} \
  --json "$OUT/train_step_dist-$TAG.json" 2> "$OUT/dist-$TAG.err" | tee "$OUT/dist-$TAG.log"
tail -5 "$OUT/dist-$TAG.err"
[ -z "${NO_PACK:-}" ] && pack_out
exit 0
