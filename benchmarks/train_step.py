"""One training step (forward + backward + AdamW, bf16 compute, fp32 master weights) of the
TinyLlama-1.1B shape, side by side in one run on one GPU (issue 6, item 6):

    modulec      runtime/cuda/step.py: the interpreter with TRAIN_KERNELS, fused chunked
                 LM head + CE, keep_only_saved, the whole step in one CUDA graph; the
                 std modules' written backward (what `modulec train` runs: the SwiGLU MLP
                 keeps gate/up and recomputes its activation); fused AdamW on bf16
                 gradients, each layer updated inside the backward
    modulec_norecompute  the same with the derived backward (every written backward
                 ignored; the SwiGLU MLP's derived backward keeps its activation too)
    ..._keepgrads   suffix: fused AdamW after the whole backward (every bf16 gradient
                 alive at once)
    ..._torchadam   suffix: torch.optim.AdamW(fused, capturable) on fp32 .grad buffers
                 (the bf16 gradients copied in), masters copied to the compute weights
    ..._fp8      suffix: the std FP8 recipe (`--precision fp8`): the blocks' matmuls as
                 FP8 GEMMs (torch._scaled_mm, E4M3 forward, E5M2 gradients, delayed
                 scaling; runtime/fp8_gemm.py), the LM head in bf16 (modulec_fp8 vs
                 modulec: tokens/s of FP8 against bf16 in one run)
    ..._budget<GiB> suffix: a memory budget for the whole step; the budget planner
                 decides what to recompute (modulec_norecompute_budget20: the derived
                 backward under 20 GiB); BUDGETS is the sweep
    hf_eager     transformers LlamaForCausalLM, sdpa attention, fp32 weights + autocast bf16
    hf_compile   the same under torch.compile
    hf_compile_fp8  the same with torchao's Float8 training (`convert_to_float8_training`,
                 tensorwise dynamic scaling, every decoder linear, the LM head in bf16):
                 the FP8 peer of modulec_fp8 (torchao must be importable; without it the
                 variant's row is its import error)
    hf_ckpt      the same with gradient checkpointing

All start from the same random weights (an HF checkpoint written once, loaded by each) and
train on the same random batch with fused AdamW. Each variant runs in its own process
(clean peak-memory counters). Prints a table and writes JSON:

    python benchmarks/train_step.py [--batch 4 --seq 2048 --layers 22 --steps 10]
                                    [--variants modulec,hf_eager,...] [--json out.json]
                                    [--shape tinyllama | llama3-8b-layers]

--shape llama3-8b-layers: a stack of Llama-3-8B decoder layers (d 4096, 32 heads, 8 KV
heads, d_ff 14336; 4 layers unless --layers) under a 32,000-token vocabulary (Llama-3's
128,256 would make the bf16 LM head a third of the weights: a measure of the layers,
issue 19's FP8 target on them).

MFU: tokens/s x (6 N + 12 L d T) FLOP per token against 989 TFLOP/s (H100/H200 dense bf16)
and against a bf16 GEMM (8192^3) measured in the same run; N counts every weight matrix
that is multiplied (the LM head included, the embedding table, a gather, not).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (PEAK, Column, add_rates, finish, gemm_ceiling,  # noqa: E402
                                header, hf_step, launch, progress, random_tokens, table_rows,
                                timed, variant_row, write_json)

VARIANTS = ("modulec", "modulec_norecompute", "hf_eager", "hf_compile", "hf_ckpt")
# the memory/speed sweep of modulec's own options (benchmarks/gpu/run_all.sh SWEEP)
SWEEP = ("modulec", "modulec_keepgrads", "modulec_torchadam", "modulec_norecompute",
         "modulec_norecompute_keepgrads", "modulec_norecompute_torchadam")
# the budget sweep (benchmarks/gpu/run_all.sh STAGES=budget): derived backward, planner decides
BUDGETS = tuple(f"modulec_norecompute_budget{b}" for b in ("26", "24", "22", "21", "20", "19",
                                                           "18.3"))


def tiny_llama(layers: int) -> dict:
    return dict(vocab_size=32000, d_model=2048, n_layers=layers, num_heads=32, num_kv_heads=4,
                d_ff=5632, max_seq=2048, eps=1e-5)


def llama3_8b_layers(layers: int) -> dict:
    return dict(vocab_size=32000, d_model=4096, n_layers=layers, num_heads=32, num_kv_heads=8,
                d_ff=14336, max_seq=8192, eps=1e-5)


SHAPES = {"tinyllama": (tiny_llama, 22, "TinyLlama"),
          "llama3-8b-layers": (llama3_8b_layers, 4, "Llama-3-8B layers")}


def model_shape(args) -> dict:
    make, layers, _ = SHAPES[args.shape]
    return make(args.layers or layers)


def hf_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["d_model"],
                       num_hidden_layers=shape["n_layers"], num_attention_heads=shape["num_heads"],
                       num_key_value_heads=shape["num_kv_heads"], intermediate_size=shape["d_ff"],
                       max_position_embeddings=shape["max_seq"], rms_norm_eps=shape["eps"],
                       attn_implementation="sdpa", torch_dtype="float32")


def flops_per_token(shape: dict, seq: int) -> float:
    d, ff, L, V = shape["d_model"], shape["d_ff"], shape["n_layers"], shape["vocab_size"]
    head = d // shape["num_heads"]
    attn = d * (shape["num_heads"] + 2 * shape["num_kv_heads"]) * head + d * d
    n = L * (attn + 3 * d * ff) + V * d
    return 6 * n + 12 * L * d * seq


# ------------------------------------------------------------------ one variant (child)
def attention_order(parts: set) -> tuple:
    """The variant's attention backends (runtime/cuda/attention.py): `flash`
    FlashAttention-2 alone, `cudnn` cuDNN's both ways, `fa4` FlashAttention-4's both ways;
    else the GPU step's default (FA4's backward at head dim 64 where flash-attn-4 is
    installed, cuDNN's otherwise)."""
    from runtime.cuda.attention import DEFAULT_ORDER

    if "flash" in parts:
        return ("flash",)
    if "cudnn" in parts:
        return ("cudnn", "flash")
    return ("fa4", "cudnn", "flash") if "fa4" in parts else DEFAULT_ORDER


def modulec_options(variant: str) -> dict:
    """Options joined by `_` after `modulec`: `norecompute` (the derived backward),
    `keepgrads`, `torchadam`, `flash` (FlashAttention-2 instead of cuDNN first),
    `swap` (with a budget: planned on the h200 profile, so swaps to host memory too),
    `noarena` (activations from torch's caching allocator, not at the plan's offsets:
    TrainStep(arena=False); the arena is the default), `fp8` (the std FP8 recipe,
    TrainStep.from_module(precision="fp8")), `fastaccum` (with fp8: the forward's FP8
    GEMMs with cuBLAS's fast accumulation, runtime.fp8_gemm.FAST_ACCUM; not the recipe's
    fp32 accumulation: a measure of what it is worth), `recast` (with fp8: the wgrad's x^T
    cast again from x in the backward, not kept from the forward's cast:
    runtime.cuda.fp8_step.KEEP_TRANSPOSED off, the path before it), `fusedcast` (with
    fp8: delayed scaling's casts of the norms' and SwiGLU's outputs written by those
    kernels in their own pass, runtime.cuda.fp8_producers.FUSED; opt-in until measured),
    `budget<GiB>` (e.g.
    modulec_norecompute_budget20: build with that memory budget for the whole step,
    TrainStep.from_module(memory_budget=...), the planner deciding what to recompute)."""
    parts = set(variant.split("_")[1:])
    budgets = {p for p in parts if p.startswith("budget")}
    unknown = parts - budgets - {"norecompute", "keepgrads", "torchadam", "flash",
                                  "swap", "noarena", "fp8", "fastaccum", "recast",
                                  "fusedcast", "fa4", "cudnn"}
    if unknown:
        raise ValueError(f"unknown modulec variant option(s) {sorted(unknown)}")
    options = {"derive_written": "norecompute" in parts,
               "optimizer": "torch" if "torchadam" in parts else "fused",
               "update_in_backward": not parts & {"keepgrads", "torchadam"},
               "attention": attention_order(parts),
               "arena": "noarena" not in parts}
    if parts & {"fastaccum", "recast", "fusedcast"} and "fp8" not in parts:
        raise ValueError("the modulec variant options fastaccum, recast and fusedcast need "
                         "fp8")
    if "fp8" in parts:
        options["precision"] = "fp8"
    if budgets:
        options["memory_budget"] = int(float(budgets.pop()[len("budget"):]) * 2**30)
        options["plan_device"] = "h200" if "swap" in parts else "h200-noswap"
    return options


def run_modulec(args, shape, ckpt, variant="modulec"):
    import torch
    from runtime.cuda.step import TrainStep
    from runtime.hf_weights import load_hf_weights

    options = modulec_options(variant)
    if "fastaccum" in variant.split("_"):  # this variant's own process: a module knob
        from runtime import fp8_gemm

        fp8_gemm.FAST_ACCUM["forward"] = True
    if "recast" in variant.split("_"):
        from runtime.cuda import fp8_step

        fp8_step.KEEP_TRANSPOSED = False
    if "fusedcast" in variant.split("_"):
        from runtime.cuda import fp8_producers

        fp8_producers.FUSED = True
    step = TrainStep.from_module(ROOT / "std/models/llama.module", shape, batch=args.batch,
                                 seq=args.seq, **options)
    weights = load_hf_weights(step.program.weight_schema, ckpt, dtype=torch.float32, device="cuda")
    step.load(weights)
    del weights
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"])
    step.set_batch(tokens)
    torch.cuda.reset_peak_memory_stats()
    step.capture(warmup=2)
    result = timed(lambda: step(tokens), args.warmup, args.steps)
    result["loss"] = float(step.loss)
    if step.activations is not None:  # the arena's regions, as the plan sizes them
        result["arena_bytes"] = step.activations.bytes_of()
        result["predicted_peak_bytes"] = step.predicted_peak()
    if step.decisions is not None:
        result["budget_bytes"] = step.memory_budget
        result["predicted_peak_bytes"] = step.predicted_peak()
        result["recomputed_per_step"] = step.decisions.counts["recomputed"] // 3
        result["dropped_per_step"] = step.decisions.counts["dropped"] // 3
        result["swaps_kept"] = step.swaps_kept
        result["swapped_out_per_step"] = step.decisions.counts["swapped_out"] // 3
        swaps = getattr(step, "swaps", None)
        result["swapped_bytes_per_step"] = sum(b.numel() for b in swaps.buffers.values()) \
            if swaps is not None else 0
        result["recompute"] = sorted({f"{f}/{v}" for (f, v), runs in step.decisions.table.items()
                                      if any(k == "recompute" for k, _, _ in runs)})
    return result


def run_hf(args, shape, ckpt, variant):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32,
                                             attn_implementation="sdpa").cuda()
    model.config.use_cache = False
    if variant == "hf_ckpt":
        model.gradient_checkpointing_enable()
    if variant.endswith("_fp8"):
        to_float8(model)
    model.train()
    forward = torch.compile(model) if variant in ("hf_compile", "hf_compile_fp8") else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"], dtype=torch.int64)
    step, box = hf_step(forward, opt, tokens)
    torch.cuda.reset_peak_memory_stats()
    result = timed(step, args.warmup, args.steps)
    result["loss"] = float(box["loss"])
    return result


def to_float8(model) -> None:
    """torchao's Float8 training on the decoder's linears (torchtitan's recipe: tensorwise
    dynamic scaling), the LM head left in bf16 as modulec's std FP8 recipe leaves it."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=lambda module, fqn: fqn != "lm_head")


def child(args) -> None:
    shape = model_shape(args)
    run = run_modulec if args.only.startswith("modulec") else run_hf
    write_json(args.result, variant_row(lambda: run(args, shape, args.ckpt, args.only)))


# ------------------------------------------------------------------ the run (parent)
def write_checkpoint(shape: dict, directory: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(shape)).save_pretrained(directory)


def run_variant(args, variant: str, ckpt: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--only", variant, "--ckpt", str(ckpt), "--result", str(out),
           "--batch", str(args.batch), "--seq", str(args.seq), "--shape", args.shape,
           "--layers", str(model_shape(args)["n_layers"]), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    log = Path(f"{args.json}.{variant}.log") if args.json else None
    return launch(cmd, out, None, log)


COLUMNS = [Column("tokens/s", 10, "tokens_per_s", ".0f"),
           Column("step ms", 9, "step_s", ".1f", 1e3),
           Column("peak GiB", 10, "peak_bytes", ".2f", 2**-30),
           Column("MFU989", 8, "mfu_989", ".1%"), Column("MFUgemm", 9, "mfu_gemm", ".1%"),
           Column("loss", 8, "loss", ".3f"),
           Column("predicted", 10, "predicted_peak_bytes", ".2f", 2**-30, missing="")]


def table(rows: dict, args, flops: float, gemm: float) -> str:
    """The rows' tokens/s and MFU added (they go into the JSON too), then the table."""
    add_rates(rows, args.batch * args.seq, flops, gemm)
    layers = model_shape(args)["n_layers"]
    return "\n".join([
        f"{SHAPES[args.shape][2]} shape, {layers} layers, B={args.batch} T={args.seq}, bf16 "
        f"(fp32 master), fwd+bwd+AdamW; GEMM ceiling {gemm / 1e12:.0f} TFLOP/s",
        header(COLUMNS, 34), *table_rows(rows, COLUMNS, 34)])


def parent(args) -> None:
    shape = model_shape(args)
    gemm = gemm_ceiling()
    flops = flops_per_token(shape, args.seq)
    rows = {}
    summary = {"shape": args.shape, "batch": args.batch, "seq": args.seq,
               "layers": shape["n_layers"],
               "flops_per_token": flops, "gemm_flops": gemm, "peak_flops": PEAK,
               "device": _device(), "variants": rows}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        write_checkpoint(shape, ckpt)
        for variant in args.variants.split(","):
            rows[variant] = run_variant(args, variant, ckpt, Path(tmp) / f"{variant}.json")
            progress(variant, rows[variant])
            if args.json:  # after each variant: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(summary, indent=2))
    finish(table(rows, args, flops, gemm), summary, args.json)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tinyllama")
    parser.add_argument("--layers", type=int, help="the shape's own unless given (22, 4)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    child(args) if args.only else parent(args)


if __name__ == "__main__":
    main()
