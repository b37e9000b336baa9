#!/usr/bin/env bash
# The GPU pipeline's speed as users launch it, on two GPUs: `torchrun --nproc-per-node 2 -m
# modulec train --pp 2` of the TinyLlama shape (T=2048, random init, the offline corpus) at
# three micro-batch layouts, beside `--zero 2` data parallel on the same two GPUs; each run's
# tokens/s (the median over steps 3+ of its metrics records) and per-GPU peak go to
# $OUT/pipeline_runs.json and a table on stdout.
#   bash benchmarks/gpu/pipeline_runs.sh        # STEPS=8
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/device_env.sh"
RUNS=${RUNS:-/tmp/modulec-runs}; mkdir -p "$RUNS"
python3 -c 'from runtime.cuda.build import load; load()' 2>&1 | tail -1
[ -f "$RUNS/corpus/train.bin" ] || python3 benchmarks/data/make_corpus.py "$RUNS/corpus" 2>&1 | tail -1
TINY=(--set vocab_size=32000 --set d_model=2048 --set n_layers=22 --set num_heads=32
      --set num_kv_heads=4 --set d_ff=5632 --set max_seq=2048)
COMMON=(--data "$RUNS/corpus/train.bin" --seq 2048 --steps "${STEPS:-8}" --lr 3e-4
        --init random --seed 0 --format json)
run() {  # name, modulec train's layout options...
  local name=$1; shift
  timeout 300 torchrun --nproc-per-node 2 --master-port $((29500 + RANDOM % 1000)) \
    -m modulec train std/models/llama.module "${TINY[@]}" "${COMMON[@]}" "$@" \
    > "$OUT/pipeline-$name.jsonl" 2> "$OUT/pipeline-$name.err"
  echo "$name rc $?"
}
run pp2_b1_m8 --pp 2 --batch 1 --microbatches 8
run pp2_b2_m4 --pp 2 --batch 2 --microbatches 4
run pp2_b4_m8 --pp 2 --batch 4 --microbatches 8
run zero2_b4 --zero 2 --batch 4
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out, rows = Path(sys.argv[1]), []
for name in ("pp2_b1_m8", "pp2_b2_m4", "pp2_b4_m8", "zero2_b4"):
    records = [json.loads(l) for l in (out / f"pipeline-{name}.jsonl").read_text().splitlines()
               if l.startswith("{")]
    steps = [r for r in records if r.get("event") == "step"]
    done = next((r for r in records if r.get("event") == "done"), {})
    rate = [r["tokens_per_s"] for r in steps[2:] if r.get("tokens_per_s")]
    rows.append({"run": name, "tokens_per_s": statistics.median(rate) if rate else None,
                 "peak_gib": done.get("peak_bytes", 0) / 2**30, "losses": [r["loss"] for r in steps]})
print("| run | tokens/s | peak GiB/GPU |\n| --- | ---: | ---: |")
for r in rows:
    print(f"| {r['run']} | {r['tokens_per_s'] or 0:,.0f} | {r['peak_gib']:.2f} |")
(out / "pipeline_runs.json").write_text(json.dumps(rows, indent=1) + "\n")
PY
