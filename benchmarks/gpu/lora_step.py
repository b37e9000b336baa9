"""TinyLlama-shape (22 layers) step, B=4 T=2048: full fine-tuning vs LoRA rank 16 on
q,k,v,o,gate,up,down (issue 6 item 4). On the GPU, from the repository root:

    python3 benchmarks/gpu/lora_step.py full
    python3 benchmarks/gpu/lora_step.py lora

Each prints one JSON line: tokens/s (median of 10 CUDA-graph replays), peak memory, fixed
state. Figures measured with it are in docs/gpu-lora.md ("The TinyLlama shape")."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import random_tokens, timed  # noqa: E402
from runtime.cuda import gated_gemm  # noqa: E402
from runtime.cuda.step import TrainStep, runtime_fixed_bytes  # noqa: E402

variant = sys.argv[1]
shape = dict(vocab_size=32000, d_model=2048, n_layers=22, num_heads=32, num_kv_heads=4,
             d_ff=5632, max_seq=2048, eps=1e-5)
lora = dict(rank=16, alpha=32, targets=["q", "k", "v", "o", "gate", "up", "down"]) \
    if variant == "lora" else None
B, T = 4, 2048
step = TrainStep.from_module("std/models/llama.module", shape, batch=B, seq=T, lora=lora)
step.init_random(0)
torch.cuda.synchronize()
tokens = random_tokens(B, T, 32000)
step.set_batch(tokens)
after_load = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
step.capture(warmup=2)
step_s = timed(lambda: step(tokens), 2, 10)["step_s"]
trained = sum(m.numel() for m in step.lows.values())
print(json.dumps({"variant": variant, "step_s": step_s, "tokens_per_s": B * T / step_s,
                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "state_after_load_gib": after_load / 2**30,
                  "fixed_state_gib": runtime_fixed_bytes(step.program) / 2**30,
                  "trained_params": trained, "loss": float(step.loss),
                  "gated_gemm": gated_gemm.summary(),  # SwiGLU in the GEMMs' epilogues?
                  "device": torch.cuda.get_device_name()}))
