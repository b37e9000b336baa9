"""The HuggingFace side of the end-to-end full fine-tune (llama8b_e2e.sh): `make` writes a
randomly initialised `LlamaForCausalLM` checkpoint (transformers' own init and
`save_pretrained`, bf16) and a token file; `check` loads a checkpoint that `modulec train
--save` wrote with transformers and prints its loss on the trained rows as one JSON line.

    python3 benchmarks/gpu/hf_checkpoint.py make --out DIR --tokens FILE [--shape llama3-8b]
    python3 benchmarks/gpu/hf_checkpoint.py check --checkpoint DIR --tokens FILE --rows 2
"""

from __future__ import annotations

import argparse
import json
import time

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {
    # Meta-Llama-3-8B's config.json (rope_theta 500000, no rope scaling)
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
}


def make(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    config = LlamaConfig(**SHAPES[args.shape])
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)  # transformers' init, done in bf16 on the GPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(args.out, safe_serialization=True)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    rows = np.random.default_rng(args.seed).integers(
        0, config.vocab_size, size=args.rows * (args.seq + 1), dtype=np.uint32)
    rows.astype(_token_dtype(config.vocab_size)).tofile(args.tokens)  # as `train` reads it
    return {"made": args.out, "parameters": parameters, "tokens": rows.size,
            "seconds": round(time.perf_counter() - started, 1)}


def check(args) -> dict:
    """transformers loads the checkpoint; its mean next-token loss over the first `rows`
    windows of T+1 tokens (what the data-parallel ranks trained on with --repeat-batch)."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint,
                                                 dtype=getattr(torch, args.dtype))
    model.to(device).eval()
    loaded = time.perf_counter() - started
    windows = _trained_windows(args, model.config.vocab_size).to(device)
    losses = []
    with torch.no_grad():
        for window in windows:  # one row at a time: 2048 x 128256 fp32 logits each
            logits = model(input_ids=window[None, :-1]).logits.float()[0]
            losses.append(torch.nn.functional.cross_entropy(logits, window[1:]).item())
    return {"checkpoint": args.checkpoint, "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "hf_loss": sum(losses) / len(losses), "hf_losses": losses,
            "load_seconds": round(loaded, 1)}


def _token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 65536 else np.uint32  # train's default --dtype-tokens


def _trained_windows(args, vocab_size: int) -> torch.Tensor:
    """The [rows, T+1] windows `modulec train --repeat-batch --seed S` trains on (its data
    order: a seeded permutation of the file's windows)."""
    from runtime.train.data import TokenData, default_token_dtype

    data = TokenData(args.tokens, default_token_dtype(vocab_size), args.seq, args.rows,
                     seed=args.seed, vocab_size=vocab_size, repeat_batch=True)
    return data.batch_at(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("make", "check"):
        p = sub.add_parser(name)
        p.add_argument("--tokens", required=True)
        p.add_argument("--seq", type=int, default=2048)
        p.add_argument("--rows", type=int, default=64)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
        p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
        if name == "make":
            p.add_argument("--out", required=True)
        else:
            p.add_argument("--checkpoint", required=True)
    args = parser.parse_args()
    print(json.dumps(make(args) if args.command == "make" else check(args)), flush=True)


if __name__ == "__main__":
    main()
