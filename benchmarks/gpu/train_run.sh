#!/usr/bin/env bash
# `modulec train` on the TinyLlama shape in one device call (issue 6 item 5):
# a random-weight HF checkpoint (bf16), 20 steps on a repeated batch, save, resume for 5
# more, then transformers loads the checkpoint and computes the loss of the batch.
#   bash benchmarks/gpu/train_run.sh        (lark carried as .whl/, see docs/gpu.md)
# Env: BATCH (4) SEQ (2048) LR (2e-4) STAGES ("tests main"; "budget" adds a 10-step run
# per --memory-budget in $BUDGET, default 18GiB).
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/train_run}; mkdir -p "$WORK"
B=${BATCH:-4}; T=${SEQ:-2048}; LR=${LR:-2e-4}
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
/usr/bin/time -f "extension build %e s" python3 -c 'from runtime.cuda.build import load; load()' 2>&1 | tail -2
STAGES=${STAGES:-"tests main"}
if [[ " $STAGES " == *" tests "* ]]; then
  python3 -m pytest -m cuda -x -p no:cacheprovider tests/test_train_cuda.py 2>&1 | tail -5
fi
python3 - "$WORK" <<'PY'
import sys, time, numpy as np, torch
from transformers import LlamaConfig, LlamaForCausalLM
work = sys.argv[1]
t = time.time()
config = LlamaConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632,
                     max_position_embeddings=2048, rms_norm_eps=1e-5, dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(f"{work}/hf")
np.random.default_rng(0).integers(0, 32000, 1 << 20).astype("<u2").tofile(f"{work}/tokens.bin")
print(f"checkpoint + tokens in {time.time() - t:.1f} s")
PY
TRAIN="python3 -m modulec train std/models/llama.module --data $WORK/tokens.bin --seq $T --batch $B --lr $LR --repeat-batch"
if [[ " $STAGES " == *" main "* ]]; then
echo "+ $TRAIN --hf-weights $WORK/hf --steps 20 --save $WORK/run"
/usr/bin/time -f "train+save %e s" $TRAIN --hf-weights $WORK/hf --steps 20 --save $WORK/run 2>&1 | tee "$OUT/train.log"
du -sh $WORK/run/checkpoint-20; ls -l $WORK/run/checkpoint-20
echo "+ $TRAIN --steps 25 --resume $WORK/run"
/usr/bin/time -f "resume %e s" $TRAIN --steps 25 --resume $WORK/run 2>&1 | tee "$OUT/resume.log"
python3 - "$WORK" "$B" "$T" <<'PY'
import sys, torch
from transformers import LlamaForCausalLM
from runtime.train.data import TokenData
work, B, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
window = TokenData(f"{work}/tokens.bin", "uint16", T, B).batch_at(0).cuda()
for name in ("hf", "run/checkpoint-20"):
    model = LlamaForCausalLM.from_pretrained(f"{work}/{name}", dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        logits = model(input_ids=window[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             window[:, 1:].reshape(-1))
    print(f"transformers bf16 loss of the batch, {name}: {float(loss):.4f}")
    del model, logits
PY
fi
if [[ " $STAGES " == *" budget "* ]]; then
  for budget in ${BUDGET:-18GiB}; do  # several: "18GiB 17GiB"
    echo "+ $TRAIN --hf-weights $WORK/hf --steps 10 --memory-budget $budget"
    $TRAIN --hf-weights $WORK/hf --steps 10 --memory-budget $budget 2>&1 | tee -a "$OUT/budget.log"
  done
fi
