"""One training step (forward + backward + AdamW) of a Mixtral-shaped MoE model on one
GPU, modulec against transformers' MixtralForCausalLM in one run (issue 19 item 2):
8 experts, top-2, d_model 2048, d_ff 5632, 16 heads (8 K/V) of 128, vocab 32000, a few
layers (--layers, default 4), B x T = 4 x 2048 = 8192 tokens, the load-balancing loss on
(router_aux_loss_coef 0.02) in every variant.

    modulec          runtime/cuda/step.py: bf16 compute, fp32 master, fused AdamW in the
                     backward, the MoE experts as grouped GEMMs without a host read, the
                     whole step captured in one CUDA graph
    modulec_eager    the same step run eagerly (no capture): what the graph saves
    modulec_noarena  captured, activations from torch's allocator (TrainStep(arena=False):
                     the grouped GEMMs' outputs are not copied into planned bytes)
    hf_eager         MixtralForCausalLM (transformers' default experts, `grouped_mm`),
                     sdpa, fp32 weights + autocast bf16, torch.optim.AdamW(fused): as
                     benchmarks/train_step.py runs HF. Its grouped_mm then runs in fp32
                     (transformers casts the input to the weights' dtype; torch's fp32
                     grouped_mm loops over the experts)
    hf_compile       the same under torch.compile
    hf_bf16          bf16 weights and bf16 AdamW (pure bf16 training): transformers'
                     grouped_mm takes torch's bf16 grouped GEMM, as modulec's does
    hf_bf16_compile  the same under torch.compile

Every variant starts from the same random weights (an HF checkpoint written once) and
trains on the same random batch, each in its own process (clean peak-memory counters).
Prints a table, writes JSON:

    python benchmarks/gpu/moe_step.py [--layers 4 --batch 4 --seq 2048 --steps 10]
                                      [--variants modulec,hf_eager,...] [--json out.json]

MFU counts the active parameters (attention, the router, top_k of the experts, the LM
head): tokens/s x (6 N_active + 12 L d T) against 989 TFLOP/s and a measured bf16 GEMM.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (PEAK, Column, add_rates, finish, forward_args,  # noqa: E402
                                gemm_ceiling, header, hf_step, launch, progress, random_tokens,
                                table_rows, timed, variant_row, versus_best, write_json)

VARIANTS = ("modulec", "modulec_eager", "modulec_noarena", "hf_eager", "hf_compile",
            "hf_bf16", "hf_bf16_compile")


def mixtral_shape(layers: int) -> dict:
    return dict(vocab_size=32000, d_model=2048, n_layers=layers, num_heads=16, num_kv_heads=8,
                d_ff=5632, num_experts=8, top_k=2, max_seq=4096, eps=1e-5,
                output_router_logits="true", aux_loss_coef=0.02)


def hf_config(shape: dict):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["d_model"],
        intermediate_size=shape["d_ff"], num_hidden_layers=shape["n_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        num_local_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"],
        max_position_embeddings=shape["max_seq"], rms_norm_eps=shape["eps"],
        output_router_logits=True, router_aux_loss_coef=shape["aux_loss_coef"],
        attn_implementation="sdpa", torch_dtype="float32")


def flops_per_token(shape: dict, seq: int) -> float:
    d, ff, L, V = shape["d_model"], shape["d_ff"], shape["n_layers"], shape["vocab_size"]
    head = d // shape["num_heads"]
    attn = d * (shape["num_heads"] + 2 * shape["num_kv_heads"]) * head + d * d
    active = L * (attn + shape["num_experts"] * d + shape["top_k"] * 3 * d * ff) + V * d
    return 6 * active + 12 * L * d * seq


# ------------------------------------------------------------------ one variant (child)
def run_modulec(args, shape, ckpt, variant):
    import torch
    from runtime.cuda.step import TrainStep
    from runtime.hf_weights import load_hf_weights

    step = TrainStep.from_module(ROOT / "std/models/mixtral.module", shape, batch=args.batch,
                                 seq=args.seq, arena=variant != "modulec_noarena")
    weights = load_hf_weights(step.program.weight_schema, ckpt, dtype=torch.float32,
                              device="cuda")
    step.load(weights)
    del weights
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"])
    step.set_batch(tokens)
    torch.cuda.reset_peak_memory_stats()
    if variant != "modulec_eager":
        step.capture(warmup=2)
    result = timed(lambda: step(tokens), args.warmup, args.steps)
    result["loss"] = float(step.loss)
    result["captured"] = step.cuda_graph is not None
    return result


def run_hf(args, shape, ckpt, variant):
    import torch
    from transformers import MixtralForCausalLM

    bf16 = variant.startswith("hf_bf16")
    model = MixtralForCausalLM.from_pretrained(
        ckpt, torch_dtype=torch.bfloat16 if bf16 else torch.float32,
        attn_implementation="sdpa").cuda()
    model.config.use_cache = False
    model.train()
    forward = torch.compile(model) if variant.endswith("compile") else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"], dtype=torch.int64)
    step, box = hf_step(forward, opt, tokens, autocast=not bf16)
    torch.cuda.reset_peak_memory_stats()
    result = timed(step, args.warmup, args.steps)
    result["loss"] = float(box["loss"])
    result["experts_implementation"] = str(model.config._experts_implementation)
    return result


def child(args) -> None:
    shape = mixtral_shape(args.layers)
    run = run_modulec if args.only.startswith("modulec") else run_hf
    write_json(args.result, variant_row(lambda: run(args, shape, args.ckpt, args.only)))


# ------------------------------------------------------------------ the run (parent)
def write_checkpoint(shape: dict, directory: Path) -> None:
    import torch
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(hf_config(shape)).save_pretrained(directory)


def run_variant(args, variant: str, ckpt: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--only", variant, "--ckpt", str(ckpt), "--result", str(out),
           *forward_args(args, "batch", "seq", "layers", "steps", "warmup")]
    log = Path(f"{args.json}.{variant}.log") if args.json else None
    return launch(cmd, out, args.timeout, log)


COLUMNS = [Column("tokens/s", 10, "tokens_per_s", ".0f"),
           Column("step ms", 9, "step_s", ".1f", 1e3),
           Column("peak GiB", 10, "peak_bytes", ".2f", 2**-30),
           Column("MFU989", 8, "mfu_989", ".1%"), Column("MFUgemm", 9, "mfu_gemm", ".1%"),
           Column("loss", 8, "loss", ".3f")]


def note(name: str, r: dict) -> str:
    if name.startswith("modulec"):
        return "captured" if r.get("captured") else "eager"
    return f"experts={r.get('experts_implementation')}"


def table(rows: dict, args, flops: float, gemm: float) -> str:
    """The rows' tokens/s and MFU added (they go into the JSON too), then the table."""
    add_rates(rows, args.batch * args.seq, flops, gemm)
    return "\n".join([
        f"Mixtral shape (8 experts top-2, d 2048, d_ff 5632), {args.layers} layers, "
        f"B={args.batch} T={args.seq}, fwd+bwd+AdamW; GEMM ceiling {gemm / 1e12:.0f} TFLOP/s",
        header(COLUMNS, 18, notes=True), *table_rows(rows, COLUMNS, 18, note=note),
        *versus_best(rows)])


def parent(args) -> None:
    import torch

    shape = mixtral_shape(args.layers)
    gemm = gemm_ceiling()
    flops = flops_per_token(shape, args.seq)
    rows = {}
    summary = {"batch": args.batch, "seq": args.seq, "layers": args.layers, "shape": shape,
               "flops_per_token": flops, "gemm_flops": gemm, "peak_flops": PEAK,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "variants": rows}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        write_checkpoint(shape, ckpt)
        for variant in args.variants.split(","):
            rows[variant] = run_variant(args, variant, ckpt, Path(tmp) / f"{variant}.json")
            progress(variant, rows[variant])
            if args.json:  # after each variant: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(summary, indent=2))
    finish(table(rows, args, flops, gemm), summary, args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    child(args) if args.only else parent(args)


if __name__ == "__main__":
    main()
