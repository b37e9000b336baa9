#!/usr/bin/env bash
# LoRA on the Llama-3-8B shape on one GPU (issue 18, item 5) in one device call: build the
# CUDA extension, then benchmarks/gpu/lora_peers.py (modulec, HF + PEFT eager / compile /
# Liger-Kernel, each in its own process). peft, liger_kernel and accelerate travel as wheels
# in .whl/ (device_env.sh installs them into /tmp/site). Logs and JSON go to $OUT.
#   bash benchmarks/gpu/lora_peers.sh                          # 8B, B=1, T=2048, all variants
#   VARIANTS=modulec,hf_peft BATCH=2 bash benchmarks/gpu/lora_peers.sh
#   TRAIN=1 bash benchmarks/gpu/lora_peers.sh    # also `modulec train --lora` on the 8B shape
#   BENCH=0 TRAIN=1 bash benchmarks/gpu/lora_peers.sh    # only `modulec train --lora`
#   CHECK=1 ...                  # first the cuda test at the tiny shape (about a minute)
#   SHAPE=tiny DEVICE=cpu bash benchmarks/gpu/lora_peers.sh    # the CPU check of the script
# Other knobs: SEQ, LAYERS, STEPS, WARMUP, ROUNDS (the variants run that many times, every
# other round reversed), BUDGET (modulec GiB), TIMEOUT (s per variant), TRAIN_STEPS.
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"; STAMP_LOG=lora_peers.log
SHAPE=${SHAPE:-llama3-8b}; DEVICE=${DEVICE:-cuda}
TSEQ=${SEQ:-$([ "$SHAPE" = tiny ] && echo 64 || echo 2048)}
python3 -c 'import torch, transformers, peft, accelerate; print("torch", torch.__version__,
"transformers", transformers.__version__, "peft", peft.__version__)' | tee "$OUT/device.txt"
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/device.txt"
  build_extension
fi
if [ "${CHECK:-0}" = 1 ]; then  # the tiny shape on the GPU first (tests/test_lora_peers.py)
  python3 -m pytest -m cuda -x -p no:cacheprovider tests/test_lora_peers.py 2>&1 \
    | tail -5 | tee "$OUT/check.log"
fi
if [ "${BENCH:-1}" = 1 ]; then
  stamp "lora_peers.py $SHAPE"
  python3 benchmarks/gpu/lora_peers.py --shape "$SHAPE" --device "$DEVICE" \
    ${VARIANTS:+--variants "$VARIANTS"} ${BATCH:+--batch "$BATCH"} ${SEQ:+--seq "$SEQ"} \
    ${LAYERS:+--layers "$LAYERS"} ${BUDGET:+--budget "$BUDGET"} --steps "${STEPS:-10}" \
    ${ROUNDS:+--rounds "$ROUNDS"} \
    --warmup "${WARMUP:-3}" --timeout "${TIMEOUT:-300}" --json "$OUT/lora_peers-$SHAPE.json" \
    2> "$OUT/lora_peers-$SHAPE.err" | tee "$OUT/lora_peers-$SHAPE.txt"
  tail -3 "$OUT/lora_peers-$SHAPE.err"
  stamp "lora_peers.py done"
fi
[ "${TRAIN:-0}" = 1 ] || exit 0
# `modulec train --lora` on the same shape from random weights: a config.json sizing the
# model and a uint32 token file of random ids, a few steps on one repeated batch (at 8B,
# --init random draws 8B values on the host, serially: a minute or two before the steps)
WORK=${WORK:-/dev/shm/modulec-lora}; rm -rf "$WORK"; mkdir -p "$WORK"
python3 - "$WORK" "$SHAPE" "$TSEQ" <<'EOF' || exit 1
import sys
from pathlib import Path

import numpy as np
from transformers import LlamaConfig

sys.path.insert(0, "benchmarks/gpu")
from hf_checkpoint import SHAPES

work, shape, seq = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
config = LlamaConfig(**SHAPES[shape])
config.to_json_file(work / "config.json")
ids = np.random.default_rng(0).integers(0, config.vocab_size, 4 * seq + 1, dtype=np.uint32)
ids.tofile(work / "tokens.bin")
EOF
stamp "modulec train --lora ($SHAPE, ${TRAIN_STEPS:-8} steps)"
python3 -m modulec train std/models/llama.module --init random --config "$WORK/config.json" \
  --data "$WORK/tokens.bin" --dtype-tokens uint32 --seq "$TSEQ" --batch "${BATCH:-1}" \
  --steps "${TRAIN_STEPS:-8}" --repeat-batch --device "$DEVICE" --format json \
  --lora 'rank=16,alpha=32,targets=[q,k,v,o,gate,up,down]' \
  2> "$OUT/train-lora-$SHAPE.err" | tee "$OUT/train-lora-$SHAPE.jsonl" | tail -2
tail -3 "$OUT/train-lora-$SHAPE.err"
stamp "modulec train --lora done"
