"""`modulec train`: train a `.module` language model from a HuggingFace checkpoint on a
flat token file, with progress and resumable HF checkpoints (docs/training.md).

    modulec train std/models/llama.module --hf-weights ckpt/ --data tokens.bin \\
        --seq 2048 --batch 4 --steps 1000 --save runs/a --save-every 200
    modulec train std/models/llama.module --data tokens.bin --seq 2048 --batch 4 \\
        --steps 2000 --resume runs/a --save runs/a

The runtime (torch) is imported only when the command runs.
"""

from __future__ import annotations

from pathlib import Path

import click

from modulec.cli.fp8_options import fp8_option_list, fp8_overrides
from modulec.cli.parallel import check_no_tp_overlap, no_tp_overlap_option
from modulec.cli.runtime_call import call_runtime, model_choice_options

TOKEN_DTYPES = ("uint16", "uint32")
SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULES = ("constant", "linear", "cosine", "wsd")  # runtime.train.schedule's KINDS
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")  # and DECAY_SHAPES


def optimizer_options() -> list:
    """The schedule, clipping and AdamW options (docs/training.md, "Optimizer")."""
    return [
        click.option("--lr-schedule", type=click.Choice(SCHEDULES), default="constant",
                     show_default=True,
                     help="The learning rate over --steps: warmup, then constant, linear "
                          "or cosine decay to --min-lr, or wsd (warmup-stable-decay)."),
        click.option("--warmup", type=int, default=0, show_default=True, metavar="W",
                     help="Steps of linear warmup from 0 to --lr (step t takes lr t / W)."),
        click.option("--min-lr", type=float, default=0.0, show_default=True,
                     help="The rate the decay ends at (linear, cosine, wsd)."),
        click.option("--decay-steps", type=int, metavar="D",
                     help="wsd: the last D steps decay (default: --decay-fraction)."),
        click.option("--decay-fraction", type=float, metavar="F",
                     help="wsd: the last round(F x --steps) steps decay (default 0.1)."),
        click.option("--decay-shape", type=click.Choice(DECAY_SHAPES),
                     help="wsd: the decay's shape (default linear)."),
        click.option("--clip-grad", type=float, metavar="MAX",
                     help="Scale the gradients by min(1, MAX / (norm + 1e-6)), norm the "
                          "global L2 norm of all trained gradients."),
        click.option("--beta1", type=float, default=0.9, show_default=True),
        click.option("--beta2", type=float, default=0.95, show_default=True),
        click.option("--eps", type=float, default=1e-8, show_default=True),
        click.option("--decay-all", is_flag=True,
                     help="Weight decay on every parameter, norms, biases and embeddings "
                          "included."),
    ]


def _options(command):
    folder = click.Path(file_okay=False, path_type=Path)
    options = [
        click.option("--hf-weights", type=click.Path(exists=True, file_okay=False,
                                                     path_type=Path),
                     help="The HuggingFace checkpoint to start from (config.json + "
                          "safetensors)."),
        click.option("--data", required=True, type=click.Path(path_type=Path),
                     help="Token ids, a flat little-endian uint16/uint32 file."),
        click.option("--seq", required=True, type=int, metavar="T", help="Tokens per sample."),
        click.option("--batch", required=True, type=int, metavar="B",
                     help="Samples per micro-batch (per step without --grad-accum)."),
        click.option("--grad-accum", type=int, default=1, show_default=True, metavar="K",
                     help="Micro-batches per optimizer step: gradients are averaged over "
                          "K x B samples."),
        click.option("--steps", required=True, type=int, metavar="N",
                     help="Total optimizer steps (a resumed run continues up to N)."),
        click.option("--dtype-tokens", type=click.Choice(TOKEN_DTYPES),
                     help="How ids are stored (default: uint16 if vocab_size <= 65536)."),
        click.option("--lr", type=float, default=1e-4, show_default=True,
                     help="The peak learning rate (the schedule's)."),
        click.option("--weight-decay", type=float, default=0.0, show_default=True,
                     help="AdamW's decoupled weight decay; norm weights, biases and "
                          "embeddings get none unless --decay-all."),
    ] + optimizer_options() + [
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seeds the order of the samples (and --init random's weights)."),
        click.option("--init", type=click.Choice(["random"]),
                     help="random: train from scratch, no --hf-weights (normal(0, 0.02) "
                          "matrices and embeddings, norm scales 1, biases 0; "
                          "docs/training.md)."),
        click.option("--config", type=click.Path(exists=True, dir_okay=False,
                                                  path_type=Path),
                     help="With --init random: a HuggingFace config.json sizing the model "
                          "(else --set and the model's defaults)."),
        click.option("--eval-data", type=click.Path(path_type=Path), metavar="FILE",
                     help="A token file (as --data) for the validation loss, forward only "
                          "(under torchrun: data, tensor and / or pipeline parallel; "
                          "with --pp each batch goes forward through the stages)."),
        click.option("--eval-every", type=int, metavar="K",
                     help="Evaluate every K optimizer steps and after the last."),
        click.option("--eval-batches", type=int, metavar="N",
                     help="Batches of B x T evaluated (default: every whole batch of "
                          "--eval-data)."),
        click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
                     metavar="RUN_DIR",
                     help="Write RUN_DIR/metrics.jsonl (a JSON object per step, or per "
                          "--log-every window) and "
                          "TensorBoard scalars when tensorboard is installed; "
                          "`modulec report RUN_DIR` draws them."),
        click.option("--log-every", type=int, default=1, show_default=True, metavar="K",
                     help="One metrics record (log, TensorBoard, progress line) every K "
                          "steps: the mean loss and gradient norm of the K, as HF "
                          "Trainer's logging_steps; also at the last step and before a "
                          "save. --eval-every must be a multiple of K."),
        click.option("--doc-sep", type=int, metavar="ID",
                     help="Pack documents: ID (the tokenizer's eos, which `modulec data` "
                          "writes after each document) ends a document; tokens attend "
                          "within their document only, positions restart at 0, and the "
                          "target after ID is left out of the loss (one process, data, "
                          "tensor and / or pipeline parallel)."),
        click.option("--ignore-index", type=int, default=-100, show_default=True,
                     metavar="N",
                     help="With --doc-sep: the label value of the targets left out of "
                          "the loss (negative: never a token id)."),
        click.option("--repeat-batch", is_flag=True,
                     help="Train on the first batch at every step (an overfitting check)."),
        click.option("--save", type=folder, help="Write checkpoints under DIR "
                     "(DIR/checkpoint-<step>, DIR/latest)."),
        click.option("--save-every", type=int, metavar="K",
                     help="Also save every K steps (the last step is always saved)."),
        click.option("--save-dtype", type=click.Choice(SAVE_DTYPES), default="auto",
                     show_default=True,
                     help="model.safetensors dtype (auto: the source config's)."),
        click.option("--max-shard-size", "max_shard_text", metavar="SIZE",
                     help="With --save: above SIZE of weights (default 5GB) a checkpoint "
                          "holds HF's sharded form (model-0000i-of-0000N.safetensors and "
                          "model.safetensors.index.json), as save_pretrained's "
                          "max_shard_size."),
        click.option("--resume", type=click.Path(path_type=Path), metavar="DIR",
                     help="Continue from a checkpoint (or a --save folder's latest)."),
        click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda",
                     show_default=True,
                     help="cuda: bf16 compute, one CUDA graph; cpu: float32 reference."),
        click.option("--precision", type=click.Choice(["fp8"]),
                     help="fp8: the std FP8 recipe on the model's matmuls (E4M3 forward, "
                          "E5M2 gradients, delayed scaling, unless --fp8-* change them; "
                          "the LM head in high precision): FP8 GEMMs on cuda, emulated "
                          "on cpu (docs/training.md, \"FP8\")."),
    ] + fp8_option_list() + [
        click.option("--lora", "lora_text", metavar="rank=R,alpha=A,targets=[q,v],dropout=P",
                     is_flag=False, flag_value="", default=None,
                     help="Train LoRA adapters on the `@adapter(lora)` matmuls, base "
                          "weights frozen (on cuda and cpu; with --tp each adapter splits "
                          "as its weight does, with --pp each stage trains its layers' "
                          "adapters; checkpoints hold the whole adapters)."),
        click.option("--zero", type=click.IntRange(0, 3), metavar="S",
                     help="Under torchrun: data parallel over every process, ZeRO stage S "
                          "(0 replicated, 1 optimizer state sharded, 2 + gradients "
                          "reduce-scattered, 3 + weights sharded; default 2). With --pp: "
                          "0 (default) or 1 over the pipelines."),
        click.option("--tp", type=click.IntRange(1), default=None, metavar="M",
                     help="Under torchrun: tensor parallel, M consecutive processes split "
                          "each layer (the model's @shard parameters); the processes / M "
                          "slices are data parallel; --lora adapters split alike. "
                          "Default 1; an IR document's own (built with `modulec build "
                          "--tp M`)."),
        click.option("--sequence-parallel", "--sp", "sp", is_flag=True,
                     help="With --tp: sequence parallel (Megatron-LM's), the norms and "
                          "residual adds on seq / M rows a process."),
        no_tp_overlap_option(),
        click.option("--pp", type=click.IntRange(1), default=1, show_default=True,
                     metavar="P",
                     help="Under torchrun: pipeline parallel, P processes each run one "
                          "stage of the IR's pipeline section (1F1B)."),
        click.option("--microbatches", type=click.IntRange(1), metavar="M",
                     help="With --pp: micro-batches of --batch samples per step (default "
                          "4 x P); the step's gradients are their mean."),
        click.option("--dist-timeout", type=click.IntRange(1), default=600,
                     show_default=True, metavar="SECONDS",
                     help="Under torchrun: a collective that takes longer (a rank died or "
                          "hangs) ends every rank with an error naming it."),
        click.option("--memory-budget", "budget", metavar="SIZE",
                     help="Plan keep/recompute/swap to fit SIZE (20GiB, 512MiB, ...)."),
        click.option("--max-memory", callback=_max_memory, metavar="SIZE",
                     help="Refuse a model whose weights need more host memory than SIZE "
                          "(default: what the machine has available), before loading."),
        click.option("--format", "fmt", type=click.Choice(["human", "json"]),
                     default="human", show_default=True,
                     help="json: a JSON object per step and at the end, on stdout."),
    ] + model_choice_options()
    for option in reversed(options):
        command = option(command)
    return command


def _max_memory(context, parameter, text):
    from modulec.cli.run_cmd import _size

    return _size(context, parameter, text)


def train_command(guarded):
    @click.command("train")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @_options
    @guarded
    def train(file, budget, settings, lora_text, fp8_scaling, fp8_gradient, fp8_history,
              max_shard_text, **options):
        """Train FILE's language model on a token file (next-token cross-entropy, AdamW)."""
        from modulec.cli.build_cmd import _lora, pairs
        from modulec.cli.plan_cmd import _budget

        if file.suffix != ".ir":  # an IR document's own --tp: runtime.train.run
            check_no_tp_overlap(options["tp"], options["no_tp_overlap"])
        overrides = fp8_overrides(options["precision"], fp8_scaling, fp8_gradient,
                                  fp8_history)  # the std recipe's, for the build
        request = dict(options, file=file, memory_budget=_budget(budget),
                       max_shard_size=_shard_size(max_shard_text),
                       settings=pairs(settings, "--set", False), lora=_lora(lora_text),
                       precision_overrides=overrides)
        return _run(request)

    return train


def _shard_size(text: str | None) -> int | None:
    from modulec.cli.build_cmd import parsed_option
    from modulec.plan.budget import parse_size

    return parsed_option(text, parse_size, "--max-shard-size")


def _run(request: dict) -> int:
    return call_runtime("train", "runtime.train.run:train_model", request)
