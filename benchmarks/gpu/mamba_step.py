"""One training step (forward + backward + AdamW) of a mamba-130m-shaped model on one GPU,
std Mamba (std/models/mamba.module) on modulec's GPU step against transformers'
MambaForCausalLM (issue 19 item 3): d_model 768, d_state 16, expand 2, conv 4, dt_rank 48,
vocab 50280, tied head, --layers of mamba-130m's 24 (default 8), B x T = 2 x 2048.

    modulec        runtime/cuda/step.py: bf16 compute, fp32 master, fused AdamW, the scan
                   and conv as csrc/kernels/mamba.cu, the step captured in one CUDA graph
    modulec_eager  the same step run eagerly (no capture)
    hf_eager       MambaForCausalLM, fp32 weights + autocast bf16, torch.optim.AdamW(fused),
                   as benchmarks/train_step.py runs HF
    hf_bf16        bf16 weights and bf16 AdamW

Whether transformers ran its fast kernels or its torch path is printed: in training it
calls mamba_ssm's fused mamba_inner_fn when mamba_ssm imports (with causal_conv1d), else
its torch path (the conv as F.conv1d, the scan as a per-time-step loop). Every variant
starts from the same random weights (an HF checkpoint written once) and trains on the
same batch, each in its own process (clean peak-memory counters).

    python benchmarks/gpu/mamba_step.py [--layers 8 --batch 2 --seq 2048]
                                        [--variants modulec,hf_eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (Column, add_rates, finish, forward_args, header,  # noqa: E402
                                hf_step, launch, progress, random_tokens, table_rows, timed,
                                variant_row, versus_best, write_json)

VARIANTS = ("modulec", "modulec_eager", "hf_eager", "hf_bf16")


def mamba_shape(layers: int) -> dict:
    return dict(vocab_size=50280, d_model=768, n_layers=layers, d_state=16, d_conv=4,
                expand=2, eps=1e-5)


def hf_config(shape: dict):
    from transformers import MambaConfig

    return MambaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["d_model"],
                       num_hidden_layers=shape["n_layers"], state_size=shape["d_state"],
                       conv_kernel=shape["d_conv"], expand=shape["expand"],
                       layer_norm_epsilon=shape["eps"], torch_dtype="float32")


def hf_fast_path() -> dict:
    """What transformers can call instead of its torch path."""
    found = {name: importlib.util.find_spec(name) is not None
             for name in ("mamba_ssm", "causal_conv1d")}
    found["path"] = ("fast: mamba_ssm's mamba_inner_fn in training" if found["mamba_ssm"]
                     else "slow: the torch path (F.conv1d, per-step scan loop)")
    return found


# ------------------------------------------------------------------ one variant (child)
def run_modulec(args, shape, ckpt, variant):
    import torch
    from runtime.cuda.step import TrainStep
    from runtime.hf_weights import load_hf_weights

    step = TrainStep.from_module(ROOT / "std/models/mamba.module", shape, batch=args.batch,
                                 seq=args.seq)
    weights = load_hf_weights(step.program.weight_schema, ckpt, dtype=torch.float32,
                              device="cuda")
    step.load(weights)
    del weights
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"])
    step.set_batch(tokens)
    torch.cuda.reset_peak_memory_stats()
    if variant == "modulec":
        step.capture(warmup=2)
    result = timed(lambda: step(tokens), args.warmup, args.steps)
    result["loss"] = float(step.loss)
    result["captured"] = step.cuda_graph is not None
    return result


def run_hf(args, shape, ckpt, variant):
    import torch
    from transformers import MambaForCausalLM

    bf16 = variant == "hf_bf16"
    model = MambaForCausalLM.from_pretrained(
        ckpt, torch_dtype=torch.bfloat16 if bf16 else torch.float32).cuda()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"], dtype=torch.int64)
    step, box = hf_step(model, opt, tokens, autocast=not bf16, use_cache=False)
    torch.cuda.reset_peak_memory_stats()
    result = timed(step, args.hf_warmup, args.hf_steps)
    result["loss"] = float(box["loss"])
    result["hf_path"] = hf_fast_path()["path"]
    return result


def child(args) -> None:
    shape = mamba_shape(args.layers)
    run = run_modulec if args.only.startswith("modulec") else run_hf
    write_json(args.result, variant_row(lambda: run(args, shape, args.ckpt, args.only)))


# ------------------------------------------------------------------ the run (parent)
def write_checkpoint(shape: dict, directory: Path) -> None:
    import torch
    from transformers import MambaForCausalLM

    torch.manual_seed(0)
    MambaForCausalLM(hf_config(shape)).save_pretrained(directory)


def run_variant(args, variant: str, ckpt: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--only", variant, "--ckpt", str(ckpt), "--result", str(out),
           *forward_args(args, "batch", "seq", "layers", "steps", "warmup", "hf_steps",
                         "hf_warmup")]
    log = Path(f"{args.json}.{variant}.log") if args.json else None
    return launch(cmd, out, args.timeout, log)


COLUMNS = [Column("tokens/s", 10, "tokens_per_s", ".0f"),
           Column("step ms", 10, "step_s", ".1f", 1e3),
           Column("peak GiB", 10, "peak_bytes", ".2f", 2**-30), Column("loss", 8, "loss", ".3f")]


def note(name: str, r: dict) -> str:
    if name.startswith("modulec"):
        return "captured" if r.get("captured") else "eager"
    return r.get("hf_path", "")


def table(rows: dict, args) -> str:
    """The rows' tokens/s added (they go into the JSON too), then the table."""
    add_rates(rows, args.batch * args.seq)
    fast = hf_fast_path()
    return "\n".join([
        f"mamba-130m shape (d 768, d_state 16, expand 2), {args.layers} layers, "
        f"B={args.batch} T={args.seq}, fwd+bwd+AdamW; transformers: {fast['path']} "
        f"(mamba_ssm {fast['mamba_ssm']}, causal_conv1d {fast['causal_conv1d']})",
        header(COLUMNS, 16, notes=True),
        *table_rows(rows, COLUMNS, 16, error_width=100, note=note), *versus_best(rows)])


def parent(args) -> None:
    import torch

    shape = mamba_shape(args.layers)
    rows = {}
    summary = {"batch": args.batch, "seq": args.seq, "layers": args.layers, "shape": shape,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "hf_fast_path": hf_fast_path(), "variants": rows}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        write_checkpoint(shape, ckpt)
        for variant in args.variants.split(","):
            rows[variant] = run_variant(args, variant, ckpt, Path(tmp) / f"{variant}.json")
            progress(variant, rows[variant])
            if args.json:  # after each variant: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(summary, indent=2))
    finish(table(rows, args), summary, args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hf-steps", type=int, default=3, help="transformers' steps (slow)")
    parser.add_argument("--hf-warmup", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    child(args) if args.only else parent(args)


if __name__ == "__main__":
    main()
