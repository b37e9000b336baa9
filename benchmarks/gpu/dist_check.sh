#!/usr/bin/env bash
# One device call on two GPUs: build the extension, the two-GPU cuda tests, then modulec's
# data-parallel step per ZeRO stage beside modulec on one of the GPUs (dist_probe.py).
#   STAGES="build tests probe" ZEROS="1 2 3" bash benchmarks/gpu/dist_check.sh
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
stage_build() { build_extension 3; }
stage_tests() {
  python3 -m pytest -m cuda -x -p no:cacheprovider -W ignore::FutureWarning \
    ${TESTS:-tests/test_cuda_dist.py} 2>&1 | tee "$OUT/tests.log" | tail -15
}
stage_probe() {
  local z
  python3 benchmarks/gpu/dist_probe.py --zero 0 ${PROBE_ARGS:-} 2>>"$OUT/probe.err" | tee -a "$OUT/probe.jsonl"
  for z in ${ZEROS:-1 2 3}; do
    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu/dist_probe.py \
      --zero "$z" ${PROBE_ARGS:-} 2>>"$OUT/probe.err" | tee -a "$OUT/probe.jsonl"
  done
  tail -5 "$OUT/probe.err"
}
run_stages ${STAGES:-build tests probe}
