"""Can memory-bound work on a side stream overlap compute-bound GEMMs that leave k SMs free?

A loop of 40 TinyLlama-sized GEMMs (8192 x 5632 x 2048, bf16, cuBLASLt's first candidate
with `CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET` = SMs - k) beside an AdamW-sized elementwise
update (280M fp32 elements, a ZeRO-2 shard's moments) on another stream: each alone, one
after the other, and at once. The probe behind docs/gpu-lora.md's "leaving multiprocessors
free does not pay" (one H100, session 11: `results_gemm_overlap_h100.txt`).

    python3 benchmarks/kernels/bench_gemm_overlap.py
"""

from __future__ import annotations

import torch

from bench_gemm_algos import CPP as ALGOS_CPP

# bench_gemm_algos.py's cuBLASLt runner, with an SM count target set before a problem is
# described (and part of its key)
CPP = ALGOS_CPP.replace(
    "static void describe(Problem& p,",
    "static int sm_target = 0;\nvoid set_sm_target(int64_t n) { sm_target = n; }\n"
    "static void describe(Problem& p,").replace(
    "  LT_CHECK(cublasLtMatrixLayoutCreate(&p.a,",
    "  if (sm_target > 0) { int32_t n = sm_target; LT_CHECK(cublasLtMatmulDescSetAttribute("
    "p.op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &n, sizeof(n))); }\n"
    "  LT_CHECK(cublasLtMatrixLayoutCreate(&p.a,").replace(
    "key += std::to_string(count);",
    "key += std::to_string(count) + \";\" + std::to_string(sm_target);")
assert "set_sm_target" in CPP and "SM_COUNT_TARGET" in CPP and "sm_target);" in CPP, \
    "bench_gemm_algos.CPP changed: the SM target edits above no longer apply"
UPDATE_ELEMENTS = 280_000_000


def elapsed_ms(fn) -> float:
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop)


def main():
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("overlap_bench", CPP, functions=["run", "set_sm_target"],
                      extra_ldflags=["-lcublasLt"], with_cuda=True)
    workspace = torch.empty(64 << 20, device="cuda", dtype=torch.uint8)
    a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16).t()
    c = torch.empty(8192, 5632, device="cuda", dtype=torch.bfloat16)
    m, v = (torch.zeros(UPDATE_ELEMENTS, device="cuda") for _ in range(2))
    g = torch.randn(UPDATE_ELEMENTS, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def gemms(n: int = 40):
        for _ in range(n):
            ext.run(a, b, c, 1.0, 0.0, workspace, 8, 0)

    def update():  # AdamW's moment traffic: m and v read and written, g read
        torch._foreach_lerp_([m], [g.float()], 0.1)
        v.mul_(0.999).addcmul_(m, m, value=0.001)

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            update()
        gemms()
        torch.cuda.current_stream().wait_stream(side)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; ms, medians of 3")
    for free in (0, 4, 8, 16, 24):
        ext.set_sm_target(sms - free if free else 0)
        gemms(3)
        update()
        runs = [(elapsed_ms(gemms), elapsed_ms(update), elapsed_ms(both)) for _ in range(3)]
        alone, upd, together = (sorted(x)[1] for x in zip(*runs))
        print(f"free SMs {free:2d}: gemms {alone:7.2f} ms  update {upd:6.2f} ms  serial "
              f"{alone + upd:7.2f}  overlapped {together:7.2f}  saved "
              f"{alone + upd - together:6.2f}", flush=True)


if __name__ == "__main__":
    main()
