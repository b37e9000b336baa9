"""TinyLlama-shape (22 layers) step, B=4 T=2048: full fine-tuning vs LoRA rank 16 on
q,k,v,o,gate,up,down (issue 6 item 4). On the GPU, from the repository root:

    python3 benchmarks/gpu/lora_step.py full
    python3 benchmarks/gpu/lora_step.py lora

Each prints one JSON line: tokens/s (median of 10 CUDA-graph replays), peak memory, fixed
state. Figures measured with it are in docs/gpu.md ("LoRA")."""
import json
import sys

import torch
from runtime.cuda.step import TrainStep, runtime_fixed_bytes

variant = sys.argv[1]
shape = dict(vocab_size=32000, d_model=2048, n_layers=22, num_heads=32, num_kv_heads=4,
             d_ff=5632, max_seq=2048, eps=1e-5)
lora = dict(rank=16, alpha=32, targets=["q", "k", "v", "o", "gate", "up", "down"]) \
    if variant == "lora" else None
B, T = 4, 2048
step = TrainStep.from_module("std/models/llama.module", shape, batch=B, seq=T, lora=lora)
step.init_random(0)
torch.cuda.synchronize()
tokens = torch.randint(0, 32000, (B, T), generator=torch.Generator().manual_seed(1),
                       dtype=torch.int32).cuda()
step.set_batch(tokens)
after_load = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
step.capture(warmup=2)
for _ in range(2):
    step(tokens)
torch.cuda.synchronize()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(11)]
ev[0].record()
losses = []
for i in range(10):
    step(tokens)
    ev[i + 1].record()
torch.cuda.synchronize()
times = sorted(ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(10))
trained = sum(m.numel() for m in step.lows.values())
print(json.dumps({"variant": variant, "step_s": times[5], "tokens_per_s": B * T / times[5],
                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "state_after_load_gib": after_load / 2**30,
                  "fixed_state_gib": runtime_fixed_bytes(step.program) / 2**30,
                  "trained_params": trained, "loss": float(step.loss),
                  "device": torch.cuda.get_device_name()}))
