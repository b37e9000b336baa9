#!/usr/bin/env bash
# FlashAttention-4's kernels in the GPU step (runtime/cuda/attention.py `fa4`, `fa4_bwd`) in
# one device call: install flash-attn-4 from wheels, then its cuda tests, the attention
# kernels beside cuDNN / FlashAttention-2, and the step with and without it. Logs to $OUT.
#
# The device machines have no network: the wheels travel. On a machine with PyPI, once:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#     -d FA4_WHEELS $(grep -v '^#' benchmarks/gpu/fa4_wheels.txt)
# nvidia-cutlass-dsl-libs-cu12 is 92 MB, more than one call carries beside the repository
# (64 MiB): split it (`split -b 50000000`) and copy the parts into FA4_STASH (default
# /tmp/stash) on the device in earlier calls to the same warm machine; this script joins
# them. On a machine with the wheels installed (`pip install flash-attn-4==4.0.0b36`)
# set FA4_SITE="" and nothing is installed.
#   FA4_WHEELS=.fa4c bash benchmarks/gpu/fa4_check.sh                 # all stages
#   STAGES="tests attention" FA4_WHEELS=.fa4c bash benchmarks/gpu/fa4_check.sh
#   GPUS=1 STAGES=step ...     # the one-GPU step only (`dist` needs two GPUs)
# Stages: tests (the fa4 / flash_attention cuda tests), multi (TP, pipeline and DP cuda
# tests with FA4 importable; not in the default list), attention (bench_attention.py at
# head dims 64 and 128), step (train_step.py: the default order against cuDNN both ways
# and FA4 both ways, one GPU), dist (dist_run.sh: one GPU and ZeRO-2 with and without
# FA4's backward beside FSDP2 + compile; REPEAT=N runs it N times and gives the ratios).
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
FA4_SITE=${FA4_SITE-/tmp/fa4}
if [ -n "$FA4_SITE" ]; then
  STASH=${FA4_STASH:-/tmp/stash}
  rm -rf "$FA4_SITE" && mkdir -p "$FA4_SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$FA4_SITE" "${FA4_WHEELS:?the folder of the wheels}"/*.whl || exit 1
  # the split cu12 libraries, where they came in parts: pip --target skips a package
  # folder that exists, so they are unpacked last, by hand
  if ls "$STASH"/cu12part* >/dev/null 2>&1; then
    cat "$STASH"/cu12part* > /tmp/fa4-cu12.whl && python3 -c "import sys, zipfile; \
zipfile.ZipFile('/tmp/fa4-cu12.whl').extractall(sys.argv[1])" "$FA4_SITE" || exit 1
  fi
  # the .pth files of a --target install are not read from PYTHONPATH: their folder by hand
  export EXTRA_PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages
fi
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/stages.sh"; STAMP_LOG=fa4_check.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "from runtime.cuda.attention import FA4; FA4.interface(); \
print('flash-attn-4:', 'imports' if FA4.interface() else FA4.unavailable)" | tee -a "$OUT/device.txt"
build_extension

stage_tests() {
  timeout 300 python3 -m pytest -m cuda -rs -p no:cacheprovider tests/test_cuda_train.py \
    -k "fa4 or flash_attention_matches" 2>&1 | tail -4 | tee "$OUT/fa4_tests.txt"
}

# the multi-GPU cuda tests with flash-attn-4 importable: TP (heads split per rank), the
# captured pipeline stages and data parallel run FA4's backward at head dim 64 there
stage_multi() {
  timeout 420 python3 -m pytest -m cuda -rfEs -p no:cacheprovider -n 2 --dist loadfile \
    tests/test_cuda_dist.py tests/test_cuda_tp_eval.py tests/test_cuda_pipeline.py 2>&1 \
    | tail -6 | tee "$OUT/fa4_multi.txt"
}

stage_attention() {
  local shape
  for shape in "4 32 4 64" "1 32 8 128"; do
    set -- $shape
    python3 benchmarks/kernels/bench_attention.py --batch "$1" --heads "$2" --kv-heads "$3" \
      --head-dim "$4" --json "$OUT/attention_d$4.json" 2>/dev/null | tee "$OUT/attention_d$4.txt"
  done
}

stage_step() {
  python3 benchmarks/train_step.py --variants \
    modulec_norecompute_cudnn,modulec_norecompute,modulec_norecompute_fa4 --steps 10 \
    --json "$OUT/train_step_fa4.json" 2>/dev/null | tail -8
}

# REPEAT runs of the variants (the first with VARIANTS, the others with REPEAT_VARIANTS:
# ZeRO-2 and its peer), then each run's ratio and their median (benchmarks/dist_ratio.py):
# FSDP2 + compile's median step moved by 23 ms between runs on one machine
stage_dist() {
  local k variants
  for k in $(seq 1 "${REPEAT:-1}"); do
    variants=${VARIANTS:-modulec_1gpu_cudnn,modulec_1gpu,modulec_zero2_cudnn,modulec_zero2,hf_fsdp2_compile}
    [ "$k" -gt 1 ] && variants=${REPEAT_VARIANTS:-modulec_zero2,hf_fsdp2_compile}
    OUT=$OUT GPUS=${GPUS:-2} TAG=fa4-r$k STEPS=${STEPS:-8} WARMUP=2 PROFILE_STEPS=0 BATCH=4 \
      SEQ=2048 VARIANTS=$variants TIMEOUT=${TIMEOUT:-130} DEADLINE=${DEADLINE:-300} \
      NO_PACK=1 bash "$(dirname "$0")/dist_run.sh"
  done
  python3 benchmarks/dist_ratio.py "$OUT"/train_step_dist-fa4-r*.json | tee "$OUT/dist_ratio.txt"
}

run_stages ${STAGES:-tests attention step dist}
