#!/usr/bin/env bash
# Issue 17's full fine-tune end to end, in one device call on two GPUs: a randomly
# initialised HuggingFace Llama-3-8B checkpoint (transformers' init, save_pretrained), then
# `torchrun -m modulec train` with ZeRO-3 and the budget planner choosing recompute, STEPS_A
# steps on a repeated batch with --save, a resumed run up to STEPS_B, and transformers loading
# the consolidated checkpoint (its loss on the trained rows beside modulec's).
#   bash benchmarks/gpu/llama8b_e2e.sh                        # 8B on the GPUs
#   SHAPE=tiny DEVICE=cpu SEQ=64 bash benchmarks/gpu/llama8b_e2e.sh   # the same flow on gloo
# Knobs: SHAPE, SEQ, STEPS_A, STEPS_B, LR, BUDGET, ZERO, GPUS, WORK (HF checkpoint, tokens:
# /dev/shm keeps the disk for the training checkpoint), CKPT.
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/device_env.sh"
SHAPE=${SHAPE:-llama3-8b}; SEQ=${SEQ:-2048}; DEVICE=${DEVICE:-cuda}; GPUS=${GPUS:-2}
WORK=${WORK:-/dev/shm/modulec-e2e}; CKPT=${CKPT:-$PWD/e2e-checkpoints}
rm -rf "$WORK" "$CKPT"; mkdir -p "$WORK"
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
  /usr/bin/time -f "extension build %e s" python3 -c \
    'from runtime.cuda.build import load; load()' 2>&1 | tail -2
fi
stamp() { echo "[$(date +%T)] $*" | tee -a "$OUT/e2e.log"; }
timed() { local t0=$SECONDS; "${@:2}"; local rc=$?; stamp "$1: $((SECONDS - t0)) s (rc $rc)"; return $rc; }
stamp "make the HF checkpoint"
python3 benchmarks/gpu/hf_checkpoint.py make --shape "$SHAPE" --out "$WORK/hf" \
  --tokens "$WORK/tokens.bin" --seq "$SEQ" 2>>"$OUT/e2e.err" | tee -a "$OUT/e2e.jsonl" || exit 1
train() {
  python3 -m torch.distributed.run --nproc-per-node "$GPUS" -m modulec train \
    std/models/llama.module --data "$WORK/tokens.bin" --seq "$SEQ" --batch 1 \
    --zero "${ZERO:-3}" --repeat-batch --lr "${LR:-1e-4}" --device "$DEVICE" --format json \
    ${BUDGET:+--memory-budget "$BUDGET"} ${SAVE_DTYPE:+--save-dtype "$SAVE_DTYPE"} "$@" 2>>"$OUT/e2e.err"
}
stamp "train steps 1..${STEPS_A:-10} from the HF checkpoint, save"
timed "run A" train --hf-weights "$WORK/hf" --steps "${STEPS_A:-10}" \
  --save "$CKPT" | tee "$OUT/run-a.jsonl" | tail -2 || exit 1
du -sh "$CKPT"/* 2>&1 | tee -a "$OUT/e2e.log"
stamp "resume up to ${STEPS_B:-20}"
timed "run B" train --resume "$CKPT" --steps "${STEPS_B:-20}" \
  | tee "$OUT/run-b.jsonl" | tail -2 || exit 1
stamp "transformers loads the checkpoint"
python3 benchmarks/gpu/hf_checkpoint.py check --shape "$SHAPE" --checkpoint "$CKPT/$(cat "$CKPT/latest")" \
  --tokens "$WORK/tokens.bin" --seq "$SEQ" --rows "$GPUS" --dtype "${HF_DTYPE:-bfloat16}" \
  2>>"$OUT/e2e.err" \
  | tee -a "$OUT/e2e.jsonl"
stamp "done"; tail -3 "$OUT/e2e.err"
