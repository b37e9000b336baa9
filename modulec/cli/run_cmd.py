"""`modulec run`: run a model on the reference runtime (forward, and with --backward its
gradients), inputs and outputs in safetensors files.

    modulec run std/models/llama.module --hf-weights ckpt/ --inputs in.safetensors \\
        --outputs out.safetensors --backward

IN holds the forward inputs by their declared names (`token_ids`, ...) and, with
--backward, a seed `d_<output>` for each output (`d_logits`). OUT gets every output by
name and, with --backward, `grad.<HF name>` for each tensor of the checkpoint. The runtime
(torch) is imported only when the command runs.
"""

from __future__ import annotations

from pathlib import Path

import click

DTYPES = ("float64", "float32", "bfloat16")


def _model_choice(command):
    from modulec.cli.runtime_call import model_choice_options

    for option in reversed(model_choice_options()):
        command = option(command)
    return command


def _size(context, parameter, text):
    if text is None:
        return None
    from modulec.plan.budget import parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if size < 1:
        raise click.BadParameter("a size of at least 1 byte")
    return size


def run_command(guarded):
    @click.command("run")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--hf-weights", type=click.Path(exists=True, file_okay=False, path_type=Path),
                  help="A HuggingFace checkpoint directory (config.json + safetensors).")
    @click.option("--random-weights", type=int, metavar="SEED",
                  help="Random parameters instead of a checkpoint (for trying a model).")
    @click.option("--inputs", "inputs_path", required=True,
                  type=click.Path(exists=True, dir_okay=False, path_type=Path),
                  help="safetensors with the inputs by name (and d_<output> seeds).")
    @click.option("--outputs", "outputs_path", required=True,
                  type=click.Path(dir_okay=False, path_type=Path),
                  help="Write the outputs (and grad.<HF name> gradients) here.")
    @click.option("--backward", is_flag=True, help="Also run the backward.")
    @click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu",
                  show_default=True)
    @click.option("--dtype", type=click.Choice(DTYPES), default="float64", show_default=True)
    @click.option("--max-memory", callback=_size, metavar="SIZE",
                  help="Refuse a model that needs more (e.g. 8GiB); default: what the "
                       "device has free.")
    @_model_choice
    @guarded
    def run(file, hf_weights, random_weights, inputs_path, outputs_path, backward, device,
            dtype, max_memory, settings, model, search_path):
        """Run FILE's model forward (and backward) on the reference runtime."""
        from modulec.cli.build_cmd import pairs

        request = dict(file=file, hf_weights=hf_weights, random_weights=random_weights,
                       inputs=inputs_path, outputs=outputs_path, backward=backward,
                       device=device, dtype=dtype, settings=pairs(settings, "--set", False),
                       model=model, search_path=search_path, max_memory=max_memory)
        return _run(request)

    return run


def _run(request: dict) -> int:
    from modulec.cli.runtime_call import call_runtime

    return call_runtime("run", "runtime.cli_run:run_model", request)
