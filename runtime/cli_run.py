"""What `modulec run` does, on torch: load the model and its weights, read the inputs,
run forward (and backward), write the outputs. Every user mistake is a RuntimeUserError."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from modulec.files import atomic_write
from runtime.errors import RuntimeUserError
from runtime.model import Model

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def run_model(*, file, hf_weights, random_weights, inputs, outputs, backward, device, dtype,
              settings, model, search_path, max_memory=None) -> str:
    _check_device(device)
    if (hf_weights is None) == (random_weights is None):
        raise RuntimeUserError("give the weights: --hf-weights DIR or --random-weights SEED")
    if Path(file).suffix != ".module":  # an IR document from `modulec build -o`
        instance = Model.from_ir(file, hf_weights=hf_weights, dtype=DTYPES[dtype],
                                 device=device, progress=sys.stderr.isatty(),
                                 max_memory=max_memory)
    else:
        instance = Model.from_module(file, settings=settings, hf_weights=hf_weights,
                                     dtype=DTYPES[dtype], device=device, model=model,
                                     search_path=search_path, progress=sys.stderr.isatty(),
                                     max_memory=max_memory)
    if random_weights is not None:
        instance.init_random(random_weights)
    tensors = _read(inputs)
    names = instance.source.program(planned=False).input_names()
    forward_inputs = {n: tensors.pop(n) for n in names if n in tensors}
    _check_inputs(inputs, forward_inputs, _model_sizes(instance))
    results = instance.forward(**forward_inputs)
    written = {name: value for name, value in results.items()}
    if backward:
        written |= _gradients(instance, tensors, results, hf_weights is not None)
    else:
        _refuse_unknown(inputs, tensors, names, {f"d_{name}" for name in results})
    _write(outputs, written)
    return f"wrote {len(written)} tensors to {outputs}"


def _gradients(instance: Model, seeds: dict, results: dict, hf_names: bool) -> dict:
    wanted = {f"d_{name}" for name in results}
    missing = sorted(wanted - set(seeds))
    if missing:
        raise RuntimeUserError(f"--backward needs a seed for every output: missing "
                               f"{', '.join(missing)}")
    extra = sorted(set(seeds) - wanted)
    if extra:
        raise RuntimeUserError(f"unknown tensors in the inputs: {', '.join(extra)}",
                               help=[f"seeds: {', '.join(sorted(wanted))}"])
    grads = instance.backward(**{name[2:]: seed for name, seed in seeds.items()})
    named = instance.hf_gradients(grads) if hf_names else grads.params
    out = {f"grad.{name}": value for name, value in named.items()}
    return out | {f"grad.{name}": value for name, value in grads.inputs.items()}


def _refuse_unknown(path, tensors: dict, names, seeds: set) -> None:
    """Without --backward, seeds are ignored (with a note); anything else is a mistake."""
    unknown = sorted(set(tensors) - seeds)
    if unknown:
        raise RuntimeUserError(f"{path} has tensors that are not inputs: {', '.join(unknown)}",
                               help=[f"the inputs: {', '.join(names)}; seeds d_<output> "
                                     "are read with --backward"])
    if tensors:
        print(f"note: ignoring {', '.join(sorted(tensors))} (seeds are read with --backward)",
              file=sys.stderr)


def _model_sizes(instance: Model) -> dict[str, int]:
    params = instance.source.program(planned=False).metadata.get("parameters", {})
    return {k: int(params[k]) for k in ("vocab_size", "max_seq")
            if str(params.get(k, "")).isdigit()}


def _check_inputs(path, inputs: dict, sizes: dict) -> None:
    """Refused before the model runs: an empty dimension, float token ids, ids outside
    0 .. vocab-1 and a sequence above max_seq crashed deep in torch (exit 101) or ran."""
    for name, tensor in inputs.items():
        if 0 in tensor.shape:
            raise RuntimeUserError(f"input `{name}` in {path} has shape {list(tensor.shape)}: "
                                   "every dimension must be at least 1")
    ids = inputs.get("token_ids")
    if ids is None:
        return
    if ids.is_floating_point() or ids.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise RuntimeUserError(f"input `token_ids` in {path} is {ids.dtype}: token ids are "
                               "integers", help=["save them as int32 or int64"])
    _check_id_range(path, ids, sizes.get("vocab_size"))
    max_seq = sizes.get("max_seq")
    if max_seq is not None and ids.dim() >= 2 and ids.shape[1] > max_seq:
        raise RuntimeUserError(f"input `token_ids` in {path} has T = {ids.shape[1]}, above the "
                               f"model's max_seq ({max_seq})",
                               help=[f"cut the sequence to {max_seq} tokens or fewer"])


def _check_id_range(path, ids, vocab: int | None) -> None:
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        allowed = f"0 .. {vocab - 1}" if vocab is not None else "0 or more"
        raise RuntimeUserError(f"input `token_ids` in {path} has token id {bad}; ids must be "
                               f"in {allowed}", help=["the ids come from another tokenizer, "
                                                      "or the file holds something else"])


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeUserError("--device cuda: no CUDA device is available here")


def _read(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise RuntimeUserError(f"cannot read {path}: {exc}") from None


def _write(path: Path, tensors: dict) -> None:
    """Atomically (modulec.files): a temp file in the same folder, then rename."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(path, lambda temp: save_file(cpu, temp))
