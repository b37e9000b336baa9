"""Device profiles for the cost model (issue 4, budget planning).

Each profile is a datasheet peak times achievable fractions: the planner predicts time
with a roofline (an op takes the longer of its FLOPs at the achievable rate of its kind
of kernel and its bytes at the achievable memory bandwidth), so the fractions calibrate
it. They were measured on an H200 here (docs/decisions.md, "Recompute and budget
planning"): bf16 GEMMs of Llama-2-7B's shapes ran at 777-796 TFLOP/s (0.8 of the peak),
causal FlashAttention (PyTorch SDPA, B=1, H=32, T=4096, D=128) at 530 TFLOP/s forward
(0.54) and its backward took 3.25 times the forward's time for 2.5 times the FLOPs
(0.42), an elementwise kernel moved 3.77 TB/s (0.8 of HBM), pinned host copies 55 GB/s
each way. The H100 shares the H200's compute and host link; its fractions are the H200's
(an 8192^3 GEMM at 798 TFLOP/s and copies at 0.9 of HBM were seen on one here).

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
    fractions: tuple = (("matmul", 0.8), ("attention", 0.54), ("attention_backward", 0.42),
                        ("memory", 0.8))  # achievable share of the peak, per kind of kernel

    def rate(self, kind: str) -> float:
        """Achievable FLOP/s of a kind of kernel (`memory`: bytes/s)."""
        share = dict(self.fractions)[kind]
        return share * (self.hbm_bytes_per_s if kind == "memory" else self.peak_flops)

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
