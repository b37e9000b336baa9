"""LoRA on the Llama-3-8B shape on one GPU, side by side with its peers in one run (issue 18
item 5). Random weights, the base frozen in bf16, rank 16 / alpha 32 adapters on q, k, v, o,
gate, up, down, next-token cross-entropy over B x T, AdamW on the adapters alone:

    modulec              TrainStep.from_module(..., lora=...): the whole step (forward,
                         backward, fused AdamW on the adapters) in one CUDA graph
                         (`--budget GiB`: with the budget planner's memory_budget)
    hf_peft              transformers LlamaForCausalLM in bf16 + PEFT LoraConfig(r=16,
                         lora_alpha=32, all 7 projections): the adapters fp32 (PEFT's
                         default), the step under torch.autocast(bf16), as HF's Trainer runs
                         it with bf16=True; AdamW(fused=True) on the adapters; eager
    hf_peft_compile      the same under torch.compile(model) (the whole model)
    hf_peft_compilelayers   the same with each decoder layer compiled (regional; optional)
    hf_peft_liger        the same as hf_peft after liger_kernel's
                         apply_liger_kernel_to_llama() (RMSNorm, SwiGLU, RoPE, fused linear
                         cross-entropy), eager
    ..._ckpt             suffix: gradient checkpointing (non-reentrant, each decoder layer).
                         Not run by default: an HF variant that runs out of memory is run
                         again with it, and the table says so.

Each variant runs in its own process (clean peak-memory counters; a variant that fails is
reported with its error, the others still run). Per variant: warmup steps, then the median
step time of --steps, tokens/s, peak GiB (torch.cuda.max_memory_allocated: reset after the
warmup for HF, whose every step allocates; before the capture for modulec, whose replays
allocate nothing), the first step's loss (random init: about ln(vocab) for all) and the last,
and on a GPU the card's mean power through the timed steps and a step's energy (NVML's
energy counter before and after them: harness.card_power; the card runs these steps at
its power cap, so the energy a step needs is what its time follows).

    python3 benchmarks/gpu/lora_peers.py [--batch 1 --seq 2048 --steps 10 --rounds 1]
        [--variants modulec,hf_peft,...] [--json out.json]

--rounds N runs the variant list N times (every other round reversed): the card's state
moves a variant's median by ~1-2% between runs, so each round's ratio is printed too.
    python3 benchmarks/gpu/lora_peers.py --shape tiny --device cpu --variants hf_peft,modulec
        # the CPU check: HF variants run, modulec builds its program and predicts its peak

MFU: tokens/s x (4 N + 12 L d T) FLOP per token against 989 TFLOP/s (H100 dense bf16): a
frozen weight's backward computes the input's gradient only (N: every multiplied weight
matrix, the LM head included; the adapters' FLOPs are left out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (PEAK, Column, add_rates, best_peer, card_power,  # noqa: E402
                                forward_args, header, hf_step, launch, progress, random_tokens,
                                reset_peak, sync, table_rows, timed, variant_row, with_energy,
                                write_json)

# torch.compile last: its compile time is the longest, the others' rows come first
VARIANTS = ("modulec", "hf_peft", "hf_peft_liger", "hf_peft_compile")
HF_KINDS = ("hf_peft", "hf_peft_compile", "hf_peft_compilelayers", "hf_peft_liger")
SHAPES = {
    # Meta-Llama-3-8B's config.json (no rope scaling, untied head)
    "llama3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, num_heads=32,
                      num_kv_heads=8, d_ff=14336, max_seq=8192, eps=1e-5, rope_theta=500000.0),
    # the CPU check's shape (head dim 32, as the GPU tests use)
    "tiny": dict(vocab_size=512, d_model=128, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=256,
                 max_seq=256, eps=1e-5, rope_theta=500000.0),
}
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shape_of(args) -> dict:
    shape = dict(SHAPES[args.shape])
    return dict(shape, n_layers=args.layers) if args.layers else shape


def flops_per_token(shape: dict, seq: int) -> float:
    d, ff, L, V = shape["d_model"], shape["d_ff"], shape["n_layers"], shape["vocab_size"]
    head = d // shape["num_heads"]
    attn = d * (shape["num_heads"] + 2 * shape["num_kv_heads"]) * head + d * d
    return 4 * (L * (attn + 3 * d * ff) + V * d) + 12 * L * d * seq


# ------------------------------------------------------------------ modulec (child)
def lora_options(args) -> dict:
    return dict(rank=args.rank, alpha=args.alpha, targets=list(TARGETS))


def modulec_prediction(program) -> dict:
    """What the planner predicts for this step without a budget (TrainStep.predicted_peak's
    rule: everything kept, the planner's fixed state replaced by the step's), the step's
    fixed state and the adapters' parameter count; from the program alone (no GPU)."""
    import math

    from modulec.plan.budget import make_problem, no_recompute
    from modulec.plan.devices import device
    from runtime.cuda.step import frozen_paths, planner_budget, runtime_fixed_bytes
    from runtime.model import parameter_shapes

    problem = make_problem(program.graph, None, "full", device("h200-noswap"))
    frozen = frozen_paths(program)
    shapes = parameter_shapes(program.graph)
    return {"predicted_peak_bytes": no_recompute(problem).peak_bytes
            - planner_budget(program, 0, "fused"),
            "fixed_bytes": runtime_fixed_bytes(program, "fused"),
            "trained_params": sum(math.prod(s) for p, s in shapes.items() if p not in frozen)}


def modulec_program(args, shape):
    """The LoRA program TrainStep.from_module builds (without a budget), on any device."""
    from modulec.lower.lora import LoraOptions
    from runtime.inputs import sized_inputs
    from runtime.program import ModuleSource

    source = ModuleSource(ROOT / "std/models/llama.module", {k: str(v) for k, v in shape.items()},
                          lora=LoraOptions.of(lora_options(args)))
    names = source.program(planned=False).input_names()
    return source.program_for(sized_inputs(names, args.batch, args.seq))


def run_modulec(args, shape) -> dict:
    if args.device != "cuda":  # the step needs the GPU: check the build and the prediction
        result = modulec_prediction(modulec_program(args, shape))
        return dict(result, skipped="no CUDA: program built and its peak predicted only")
    import torch
    from runtime.cuda.step import AdamWConfig, TrainStep

    budget = dict(memory_budget=int(args.budget * 2**30)) if args.budget else {}
    started = time.perf_counter()
    step = TrainStep.from_module(ROOT / "std/models/llama.module", shape, batch=args.batch,
                                 seq=args.seq, lora=lora_options(args),
                                 adamw=AdamWConfig(lr=args.lr), **budget)
    step.init_random(0)  # fp32 draw on the GPU (32 GB at 8B), bf16 copies kept
    torch.cuda.empty_cache()
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"], dtype=torch.int64)
    tokens = tokens.to(torch.int32)
    step.set_batch(tokens)
    step(tokens)  # one eager step: the loss at the initial weights
    loss_first = float(step.loss)
    reset_peak("cuda")
    step.capture(warmup=max(args.warmup - 1, 1))
    setup_s = time.perf_counter() - started
    with card_power(args.device) as power:
        result = timed(lambda: step(tokens), 0, args.steps)
    with_energy(result, power, args.steps)
    from runtime.cuda import gated_gemm
    from runtime.cuda.gemm import summary

    print(summary(), file=sys.stderr)  # what the GEMM timing chose (runtime/cuda/gemm.py)
    result.update(modulec_prediction(step.program), loss_first=loss_first,
                  loss_last=float(step.loss), setup_s=setup_s,
                  gated_gemm=gated_gemm.summary())  # SwiGLU's GEMMs (gated_gemm.py)
    if step.decisions is not None:
        result["budget_bytes"] = step.memory_budget
        result["predicted_peak_bytes"] = step.predicted_peak()
    return result


# ------------------------------------------------------------------ HF + PEFT (child)
def hf_options(variant: str) -> dict:
    """hf_peft[_compile|_compilelayers|_liger][_ckpt]."""
    parts = variant.split("_")
    flags = set(parts[2:])
    if parts[:2] != ["hf", "peft"] or flags - {"compile", "compilelayers", "liger", "ckpt"} \
            or {"compile", "compilelayers"} <= flags:
        raise ValueError(f"unknown HF variant {variant!r}")
    compile_ = "whole" if "compile" in flags else "layers" if "compilelayers" in flags else None
    return {"compile": compile_, "liger": "liger" in flags, "ckpt": "ckpt" in flags}


def hf_config(shape: dict):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["d_model"],
                         intermediate_size=shape["d_ff"], num_hidden_layers=shape["n_layers"],
                         num_attention_heads=shape["num_heads"],
                         num_key_value_heads=shape["num_kv_heads"],
                         max_position_embeddings=shape["max_seq"], rms_norm_eps=shape["eps"],
                         rope_theta=shape["rope_theta"], tie_word_embeddings=False,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def rope_theta_of(config) -> float | None:
    """transformers 5 keeps it in rope_parameters, 4 as rope_theta."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def hf_model(args, shape, options: dict):
    """LlamaForCausalLM built on the device in bf16 (transformers' init, no checkpoint),
    then PEFT's LoRA (adapters fp32: get_peft_model's autocast_adapter_dtype default)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    if options["liger"]:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # patches transformers' Llama classes: before building
    torch.manual_seed(0)
    config = hf_config(shape)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if options["ckpt"]:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                      target_modules=list(HF_TARGETS), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    return model, config


def run_hf(args, shape, variant: str) -> dict:
    import torch

    options = hf_options(variant)
    started = time.perf_counter()
    model, config = hf_model(args, shape, options)
    trained = [p for p in model.parameters() if p.requires_grad]
    forward = model
    if options["compile"] == "whole":
        forward = torch.compile(model)
    elif options["compile"] == "layers":
        for layer in model.base_model.model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, fused=args.device == "cuda")
    tokens = random_tokens(args.batch, args.seq, shape["vocab_size"], args.device, torch.int64)
    step, box = hf_step(forward, opt, tokens, args.device)
    step()
    loss_first = float(box["loss"])
    for _ in range(args.warmup - 1):
        step()
    sync(args.device)
    setup_s = time.perf_counter() - started
    reset_peak(args.device)
    with card_power(args.device) as power:
        result = timed(step, 0, args.steps, args.device)
    with_energy(result, power, args.steps)
    result.update(loss_first=loss_first, loss_last=float(box["loss"]), setup_s=setup_s,
                  trained_params=sum(p.numel() for p in trained),
                  adapter_dtype=str(trained[0].dtype).replace("torch.", ""),
                  rope_theta=rope_theta_of(config), compile=options["compile"],
                  gradient_checkpointing=options["ckpt"])
    return result


def child(args) -> None:
    """Every failure is the variant's error row (`oom` says whether it ran out of memory):
    the others still run."""
    shape = shape_of(args)
    row = variant_row(lambda: run_modulec(args, shape) if args.only == "modulec"
                      else run_hf(args, shape, args.only), args.device, all_errors=True)
    if args.device == "cuda" and "error" not in row:
        import torch

        row["device"] = torch.cuda.get_device_name()
    write_json(args.result, row)


# ------------------------------------------------------------------ the run (parent)
def run_variant(args, variant: str, out: Path, round_tag: str = "") -> dict:
    """The variant in its own process (a session of its own: past --timeout the whole
    group is killed, so nothing keeps the GPU's memory); its output in
    `{--json}.{variant}{round_tag}.log`."""
    cmd = [sys.executable, __file__, "--only", variant, "--result", str(out),
           *forward_args(args, "shape", "batch", "seq", "steps", "warmup", "rank", "alpha",
                         "lr", "device")]
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--budget", str(args.budget)] if args.budget else []
    started = time.perf_counter()
    # each process's own output beside the JSON, for the failures
    log = Path(f"{args.json}.{variant}{round_tag}.log") if args.json else None
    result = launch(cmd, out, args.timeout, log)
    result["wall_s"] = time.perf_counter() - started
    return result


def run_all(args, tmp: Path) -> dict:
    """Every variant, `--rounds` times (every other round in reverse order, so that no
    variant always runs on the card as the one before left it); a variant's row is its
    round of median step time, with each round's step time beside it (`step_s_rounds`).
    An HF variant out of memory runs again with gradient checkpointing (its row says so)."""
    rounds = []
    for i in range(args.rounds):
        names = args.variants.split(",")
        rounds.append(run_round(args, tmp, names[::-1] if i % 2 else names, i))
    return combine_rounds(rounds) if len(rounds) > 1 else rounds[0]


def run_round(args, tmp: Path, names: list[str], index: int) -> dict:
    rows, tag = {}, f".round{index + 1}" if args.rounds > 1 else ""
    for variant in names:
        rows[variant] = run_variant(args, variant, tmp / f"{variant}.{index}.json", tag)
        progress(variant, rows[variant], json.dumps)
        if rows[variant].get("oom") and variant.startswith("hf_") and \
                not variant.endswith("_ckpt") and args.ckpt_retry:
            retry = f"{variant}_ckpt"
            rows[retry] = run_variant(args, retry, tmp / f"{retry}.{index}.json", tag)
            rows[retry]["note"] = f"gradient checkpointing: {variant} ran out of memory"
            progress(retry, rows[retry], json.dumps)
    return rows


def combine_rounds(rounds: list[dict]) -> dict:
    """{variant: its round of median step time (a failed round counts where none ran),
    with `step_s_rounds` and, for modulec, `speedup_rounds`: each round's ratio to that
    round's fastest HF variant}."""
    rows = {}
    for name in dict.fromkeys(n for r in rounds for n in r):
        ran = sorted((r[name] for r in rounds if "step_s" in r.get(name, {})),
                     key=lambda row: row["step_s"])
        failed = [r[name] for r in rounds if name in r and "step_s" not in r[name]]
        rows[name] = dict(ran[(len(ran) - 1) // 2]) if ran else failed[0]
        if ran:
            rows[name]["step_s_rounds"] = [r[name].get("step_s") for r in rounds if name in r]
    ratios = [_round_ratio(r) for r in rounds]
    if "modulec" in rows and any(x is not None for x in ratios):
        rows["modulec"]["speedup_rounds"] = ratios
    return rows


def _round_ratio(rows: dict) -> float | None:
    """modulec's tokens/s over the fastest HF variant's in one round (step times: one B x T)."""
    hf = [r["step_s"] for n, r in rows.items() if n.startswith("hf_") and "step_s" in r]
    ours = rows.get("modulec", {}).get("step_s")
    return min(hf) / ours if hf and ours else None


def derive(rows: dict, args, flops: float) -> None:
    add_rates(rows, args.batch * args.seq, flops)
    hf = best_peer(rows, "hf_")
    ours = rows.get("modulec", {})
    if hf and "tokens_per_s" in ours:
        best = rows[hf]
        ours["speedup_vs_best_hf"] = ours["tokens_per_s"] / best["tokens_per_s"]
        ours["peak_vs_best_hf"] = ours["peak_bytes"] / best["peak_bytes"] \
            if best.get("peak_bytes") else None


COLUMNS = [Column("tokens/s", 10, "tokens_per_s", ".0f"),
           Column("step ms", 9, "step_s", ".1f", 1e3),
           Column("peak GiB", 10, "peak_bytes", ".2f", 2**-30),
           Column("MFU989", 8, "mfu_989", ".1%"), Column("loss0", 8, "loss_first", ".3f"),
           Column("lossN", 8, "loss_last", ".3f"), Column("trained", 11, "trained_params", ",d"),
           Column("setup s", 9, "setup_s", ".0f"), Column("W", 6, "power_w", ".0f"),
           Column("J/step", 8, "joules_per_step", ".1f")]


def notes(name: str, r: dict) -> list[str]:
    return [f"{'':<28}  {r[note]}" for note in ("skipped", "note") if r.get(note)]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def table(rows: dict, args, shape: dict) -> str:
    lines = [f"LoRA r={args.rank} alpha={args.alpha} on {','.join(TARGETS)}; {args.shape} shape "
             f"({shape['n_layers']} layers, d {shape['d_model']}, vocab {shape['vocab_size']}), "
             f"B={args.batch} T={args.seq}, bf16 frozen base; median of {args.steps} steps"
             + (f"; of {args.rounds} rounds, the round of median step time" if
                args.rounds > 1 else ""),
             header(COLUMNS, 28), *table_rows(rows, COLUMNS, 28, error_width=110, below=notes)]
    devices = sorted({r["device"] for r in rows.values() if r.get("device")})
    lines.append(f"device: {', '.join(devices) or args.device}; " + ", ".join(
        f"{k} {v}" for k, v in _versions().items() if v))
    ours = rows.get("modulec", {})
    if ours.get("predicted_peak_bytes"):
        lines.append(f"modulec predicted peak {_size(ours['predicted_peak_bytes'])} "
                     f"(fixed state {_size(ours['fixed_bytes'])})")
    if "speedup_vs_best_hf" in ours:
        # three decimals: a target such as 1.3x is not met by a 1.2998 printed as 1.30
        lines.append(f"modulec vs the fastest HF variant: {ours['speedup_vs_best_hf']:.3f}x "
                     f"tokens/s at {ours['peak_vs_best_hf']:.2f}x its peak memory")
    if ours.get("speedup_rounds"):
        lines.append("modulec vs the fastest HF variant, each round: " + ", ".join(
            "failed" if x is None else f"{x:.3f}x" for x in ours["speedup_rounds"]))
    return "\n".join(lines)


def parent(args) -> None:
    import tempfile

    shape = shape_of(args)
    flops = flops_per_token(shape, args.seq)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_all(args, Path(tmp))
    derive(rows, args, flops)
    print(table(rows, args, shape))
    summary = {"shape": args.shape, "model": shape, "batch": args.batch, "seq": args.seq,
               "rank": args.rank, "alpha": args.alpha, "targets": list(TARGETS),
               "lr": args.lr, "steps": args.steps, "warmup": args.warmup,
               "rounds": args.rounds,
               "flops_per_token": flops, "peak_flops": PEAK, "versions": _versions(),
               "variants": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


def _versions() -> dict:
    """The parent touches no GPU (no CUDA context beside the variants' processes)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "peft", "liger_kernel", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def check_variant(name: str) -> None:
    if name != "modulec":
        hf_options(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, help="default 2048 (tiny: 64)")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants this many times, every other round in "
                             "reverse order; each row is its round of median step time")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--budget", type=float, help="modulec: a memory budget in GiB")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-ckpt-retry", dest="ckpt_retry", action="store_false",
                        help="do not rerun an HF variant that ran out of memory with "
                             "gradient checkpointing")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the script's check (HF variants run, modulec predicts)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per variant")
    parser.add_argument("--json")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or (64 if args.shape == "tiny" else 2048)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be at least 1")
    try:
        for name in args.variants.split(","):
            check_variant(name)
    except ValueError as exc:
        parser.error(str(exc))
    child(args) if args.only else parent(args)


if __name__ == "__main__":
    main()
