"""Device profiles for the cost model (issue 4, budget planning).

Each profile is a datasheet peak times achievable fractions: the planner predicts time
with a roofline (an op takes the longer of its FLOPs at the achievable rate of its kind
of kernel and its bytes at the achievable memory bandwidth of its op), so the fractions
calibrate it (docs/decisions.md, "Cost model calibration", has the per-class table):

- matmul 0.78 (772 TFLOP/s): the bf16 8192^3 GEMM measured beside the TinyLlama step
  (docs/gpu.md; 786 in results-h200-train_step.json, 749-793 across H200s) and Llama-3-8B's
  base GEMMs in a step (~764, results-h200-lora-profile-llama3-8b.txt), in whole waves
  (`gemm_seconds`): a GEMM runs ceil(tiles / SMs) waves of `gemm_tile` (256 x 128, the
  tile of cuBLAS's most used kernel in the step profiles) output tiles, each wave the
  time of one tile's 2 x 256 x 128 x K FLOPs on one SM's share of the rate. The
  TinyLlama step's GEMMs: 71.0 ms predicted, 69.4 measured (results-h200-profile.txt;
  65.9 at 772 TFLOP/s without the last waves' idle SMs). Small GEMMs (few tiles, the
  last wave nearly empty) are far from the ceiling through it.
- attention 0.54 / backward 0.42: causal SDPA at B=1, H=32, T=4096, D=128 (530 TFLOP/s
  forward, the backward 3.25x its time for 2.5x the FLOPs); cost.py scales them by head
  dim and keys a query sees (`attention_scale`, from the two step profiles).
- memory 0.8 of HBM: SwiGLU's kernels, RMSNorm forward, AdamW (3.8-4.0 TB/s on the
  H200: results_adamw_h200.json; in the TinyLlama step 8.3 ms against 8.6 predicted);
  `op_bandwidth` overrides it where a step profile measured less: norm backwards 0.5
  (0.43 TinyLlama, incl. its recompute and column sums; 0.6 8B), RoPE 0.35 (0.27 at
  D=64, 0.47 at D=128).
- launch gaps: none (a CUDA graph replay's wall time is its kernels' sum: 111.1 ms
  against 111.08, results-h200-profile.txt).

Pinned host copies ran at 55 GB/s each way. The H100 shares the H200's compute and host
link; its fractions are the H200's (an 8192^3 GEMM at 798 TFLOP/s and copies at 0.9 of
HBM were seen on one here; TinyLlama's step 116.2 ms against 111.1 on the H200).

| profile | bf16 dense peak | HBM            | host link (each way)   | memory |
| ------- | --------------- | -------------- | ---------------------- | ------ |
| h100    | 989 TFLOP/s     | 3.35 TB/s HBM3 | PCIe 5 x16, 55 GB/s    | 80 GB  |
| h200    | 989 TFLOP/s     | 4.8 TB/s HBM3e | PCIe 5 x16, 55 GB/s    | 141 GB |

`<name>-noswap` (h100-noswap, h200-noswap): the same device for an executor that does not
swap (the CUDA training step, runtime/cuda/step.py, runs recompute only): no host link,
so the scheduler never picks a swap (modulec.plan.mutwo._swap_candidate) and meets the
budget with recompute alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float            # bf16 dense tensor-core FLOP/s (datasheet, no sparsity)
    hbm_bytes_per_s: float       # datasheet HBM bandwidth
    host_bytes_per_s: float      # effective host link bandwidth, per direction
    memory_bytes: int            # HBM capacity (for reports; the budget is given)
    fractions: tuple = (("matmul", 0.78), ("attention", 0.54), ("attention_backward", 0.42),
                        ("memory", 0.8))  # achievable share of the peak, per kind of kernel
    sms: int = 132                  # streaming multiprocessors (H100 / H200 SXM)
    gemm_tile: tuple = (256, 128)   # output rows x columns a GEMM tile (an SM) computes
    op_bandwidth: tuple = (("fused_residual_rmsnorm_backward", 0.5), ("rmsnorm_backward", 0.5),
                           ("rope", 0.35), ("rope_backward", 0.35))  # memory ops' own shares

    def rate(self, kind: str) -> float:
        """Achievable FLOP/s of a kind of kernel (`memory`: bytes/s)."""
        share = dict(self.fractions)[kind]
        return share * (self.hbm_bytes_per_s if kind == "memory" else self.peak_flops)

    def bandwidth(self, op: str = "") -> float:
        """Achievable HBM bytes/s of memory-bound op `op` (its own share, else memory's)."""
        share = dict(self.op_bandwidth).get(op)
        return self.bytes_per_s if share is None else share * self.hbm_bytes_per_s

    def gemm_seconds(self, rows: int, columns: int, depth: float) -> float:
        """One GEMM of a rows x columns output over `depth`, in whole waves of tiles."""
        tile_rows, tile_columns = self.gemm_tile
        tiles = -(-rows // tile_rows) * -(-columns // tile_columns)
        waves = -(-tiles // self.sms)
        return waves * 2.0 * tile_rows * tile_columns * depth * self.sms / self.rate("matmul")

    @property
    def flops_per_s(self) -> float:
        return self.rate("matmul")

    @property
    def bytes_per_s(self) -> float:
        return self.rate("memory")

    def summary(self) -> dict:
        return {"name": self.name, "matmul_tflops": self.flops_per_s / TERA,
                "attention_tflops": self.rate("attention") / TERA,
                "hbm_tb_per_s": self.bytes_per_s / TERA,
                "host_link_gb_per_s": self.host_bytes_per_s / GIGA,
                "memory_bytes": self.memory_bytes}


H100 = Device("h100", 989 * TERA, 3.35 * TERA, 55 * GIGA, 80 * GIGA)
H200 = Device("h200", 989 * TERA, 4.8 * TERA, 55 * GIGA, 141 * GIGA)
DEVICES = {d.name: d for d in (H100, H200)}
DEVICES.update({f"{d.name}-noswap": replace(d, name=f"{d.name}-noswap", host_bytes_per_s=0.0)
                for d in (H100, H200)})


def device(name: str) -> Device:
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device `{name}` (known: {', '.join(DEVICES)})") from None
