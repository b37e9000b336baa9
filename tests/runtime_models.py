"""Tiny instantiations of every std model and example, shared by the runtime tests."""

from __future__ import annotations

import torch

DENSE = dict(n_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, vocab_size=64,
             max_seq=64)

TINY = {
    "llama": ("std/models/llama.module", DENSE),
    "llama_tied": ("std/models/llama.module", DENSE | {"tie_word_embeddings": "true"}),
    "qwen3": ("std/models/qwen3.module", DENSE | {"head_dim": 8}),
    # padding_idx None: tests compare with autograd of the forward, which knows no padding rule
    "gemma": ("std/models/gemma.module", DENSE | {"head_dim": 16, "padding_idx": "None"}),
    "mistral": ("std/models/mistral.module", DENSE | {"window_size": 3}),
    "mixtral": ("std/models/mixtral.module", DENSE | {"num_experts": 4, "top_k": 2}),
    "example_llama": ("examples/llama.module", DENSE),
    "example_gpt2": ("examples/gpt2.module", dict(n_layers=2, d_model=32, num_heads=4,
                                                  vocab_size=64, max_seq=64)),
    "example_mamba": ("examples/mamba.module", dict(n_layers=2, d_model=32, vocab_size=64,
                                                    d_state=8, head_dim=8)),
}

# Models whose ops the CPU tests above already cover through TINY (Qwen2's q/k/v biases:
# the GPT-2 example's; std's GPT-2: the example's block and graph), run only by the GPU
# step tests (tests/test_cuda_models.py), which keep the CPU suite short
GPU_ONLY = {
    "qwen2": ("std/models/qwen2.module", DENSE),
    "gpt2": ("std/models/gpt2.module", dict(n_layers=2, d_model=32, num_heads=4, vocab_size=64,
                                            max_seq=64)),
    # the MoE load-balancing loss on (an auxiliary loss of the step), dense and sparse
    # layers alternating (a nested stack); GPT-NeoX's interleaved QKV and partial rotary;
    # Phi-3's partial rotary (their float64 parity: tests/test_hf_parity_*.py)
    "qwen3_moe": ("std/models/qwen3_moe.module", DENSE | {
        "n_layers": 4, "head_dim": 8, "moe_d_ff": 16, "num_experts": 4, "top_k": 2,
        "sparse_step": 2, "output_router_logits": "true", "aux_loss_coef": 0.5}),
    "gpt_neox": ("std/models/gpt_neox.module", dict(n_layers=2, d_model=32, num_heads=4,
                                                    d_ff=48, vocab_size=64, max_seq=64)),
    "phi3": ("std/models/phi3.module", DENSE | {"partial_rotary_factor": 0.5,
                                                 "padding_idx": "None"}),
    # std Mamba (Mamba-1; the Mamba-2 example is in TINY): the scan and conv kernels in an
    # fp32 step, a chunk_size below the kernel's tile (its float64 parity:
    # tests/test_hf_parity_mamba.py)
    "mamba": ("std/models/mamba.module", dict(n_layers=2, d_model=32, vocab_size=64,
                                              d_state=8, chunk_size=4)),
}


def token_inputs(model, batch: int = 2, seq: int = 8, seed: int = 0) -> dict:
    """Random token ids (and position ids where the model takes them)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = int(model.source.settings.get("vocab_size", 64))
    inputs = {"token_ids": torch.randint(0, vocab, (batch, seq), generator=generator,
                                         dtype=torch.int32)}
    if "position_ids" in model.source.program(planned=False).input_names():
        inputs["position_ids"] = torch.arange(seq, dtype=torch.int32).repeat(batch, 1)
    return inputs
