"""LoRA adapters of a model built with LoRA on (`Model.from_module(..., lora=dict(rank=8,
alpha=16))`, docs/training.md, "LoRA"): their initialization, and their export in PEFT's format.

The `lora` pass (modulec.lower.lora) adds `W.lora_A: [rank, in]` and `W.lora_B: [out, rank]`
(`W.<part>.lora_A` for a part of a fused weight) and records, in the IR's metadata
(`metadata.lora.adapters`), each adapter's path pattern (`blocks[*].attention.qkv_weight.q
.lora_A`), rows of W, rank, alpha and HF module (`model.layers.{i}.self_attn.q_proj`).
PEFT initializes A like nn.Linear (Kaiming-uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in)))
and B = 0, so the adapted model is the base model until B is trained; so do we.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import Tensor

from modulec.lower.lora import IA3_SUFFIX, is_adapter
from runtime.hf_weights.schema import fill

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def init_adapters(model, generator: torch.Generator | None = None,
                  only_missing: bool = False) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0, (IA)^3 vectors 1 for every adapter parameter
    of `model`. A tensor-parallel rank's program (`--tp`) draws each split adapter whole,
    as one process does, and keeps its slice: the ranks' adapters joined are one
    process's."""
    from runtime.tensor_parallel import shard_tensor, sharded_paths

    generator = generator or torch.Generator().manual_seed(0)
    shards = sharded_paths(model.source.program(planned=False))
    for path, shape in model.parameter_shapes().items():
        if not is_adapter(path) or (only_missing and path in model.params):
            continue
        shard = shards.get(path)
        if shard is None:
            value = adapter_value(path, shape, generator, torch.float64)
        else:
            whole = list(shape)
            whole[shard["dim"]] = sum(shard["parts"])
            value = shard_tensor(adapter_value(path, whole, generator, torch.float64), shard,
                                 getattr(model, "tp_rank", 0))
        model.params[path] = value.to(model.dtype).to(model.device)


def adapter_value(path: str, shape, generator: torch.Generator, dtype: torch.dtype,
                  device="cpu") -> Tensor:
    """An adapter parameter's first value as PEFT makes it: lora_A ~ U(-1/sqrt(in),
    1/sqrt(in)) (kaiming_uniform with a = sqrt(5)) drawn from `generator` (on `device`),
    lora_B = 0 (the adapted model starts as the base model), (IA)^3 vectors 1."""
    if path.endswith("lora_A"):
        bound = 1.0 / math.sqrt(shape[1])
        return (torch.rand(shape, generator=generator, dtype=dtype, device=device) * 2 - 1) \
            * bound
    if path.endswith(IA3_SUFFIX):  # (IA)^3: l = 1, the base model (PEFT's init)
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def adapter_params(model) -> dict[str, Tensor]:
    """The adapter parameters by path (`blocks[0].attention.qkv_weight.q.lora_A`)."""
    return {p: t for p, t in model.params.items() if is_adapter(p)}


def lora_metadata(model) -> dict:
    program = model.program or model.source.program(planned=False)
    lora = program.metadata.get("lora")
    if lora is None:
        from runtime.errors import RuntimeUserError

        raise RuntimeUserError("this model was built without LoRA",
                               help=["Model.from_module(..., lora=dict(rank=8, alpha=16))"])
    return lora


def peft_name(path: str, adapters: list[dict]) -> str | None:
    """PEFT's name of adapter parameter `path`
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), or None."""
    for entry in adapters:
        for which in ("lora_A", "lora_B"):
            indices = _match(entry[which], path)
            if indices is None or not entry.get("hf_module"):
                continue
            names = entry.get("placeholders") or []
            if len(names) != len(indices):
                return None
            module = fill(entry["hf_module"], dict(zip(names, map(int, indices))))
            return f"base_model.model.{module}.{which}.weight"
    return None


def _match(pattern: str, path: str) -> list[str] | None:
    regex = re.escape(pattern).replace(r"\[\*\]", r"\[(\d+)\]")
    found = re.fullmatch(regex, path)
    return list(found.groups()) if found else None


def peft_tensors(model, values: dict | None = None) -> dict[str, Tensor]:
    """The adapters (the model's, or `values`' by path) under PEFT names when every one
    has one, else under their paths."""
    adapters = lora_metadata(model)["adapters"]
    tensors = adapter_params(model) if values is None else \
        {p: t for p, t in values.items() if is_adapter(p)}
    names = {p: peft_name(p, adapters) for p in tensors}
    if any(n is None for n in names.values()):
        return tensors
    return {names[p]: t for p, t in tensors.items()}


def peft_config(model) -> dict:
    """adapter_config.json: r, lora_alpha, lora_dropout and target_modules (HF module
    names)."""
    adapters = lora_metadata(model)["adapters"]
    first = adapters[0] if adapters else {"rank": 0, "alpha": 0.0}
    modules = sorted({a["hf_module"].rsplit(".", 1)[-1] for a in adapters if a["hf_module"]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first["rank"],
            "lora_alpha": first["alpha"], "lora_dropout": first.get("dropout", 0.0),
            "bias": "none",
            "target_modules": modules, "fan_in_fan_out": False,
            "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": None,
            "inference_mode": False}


def save_lora(model, directory, values: dict | None = None) -> Path:
    """Write `adapter_model.safetensors` (PEFT names where the weight schema gives HF
    names, else parameter paths) and `adapter_config.json`; returns the safetensors path.
    `values` (by path) replaces the model's adapters: a tensor-parallel run's whole ones,
    its ranks' slices joined (runtime.train.checkpoint)."""
    from safetensors.torch import save_file

    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().to("cpu").contiguous().clone()
               for n, t in sorted(peft_tensors(model, values).items())}
    path = directory / WEIGHTS
    save_file(tensors, str(path), metadata={"format": "pt"})
    text = json.dumps(peft_config(model), indent=2, sort_keys=True) + "\n"
    (directory / CONFIG).write_text(text, encoding="utf-8")
    return path


def load_lora(model, directory) -> None:
    """Read adapters written by `save_lora` (or PEFT, same names) into `model`."""
    from safetensors.torch import load_file

    loaded = load_file(str(Path(directory).expanduser() / WEIGHTS))
    adapters = lora_metadata(model)["adapters"]
    for path in model.parameter_shapes():
        if not is_adapter(path):
            continue
        name = peft_name(path, adapters)
        tensor = loaded.get(name) if name in loaded else loaded.get(path)
        if tensor is not None:
            model.params[path] = tensor.to(model.dtype).to(model.device)


RESUMED = ("r", "lora_alpha", "target_modules")  # what the adapters' shapes and sum read


def check_resume(folder: Path, model) -> None:
    """A resume trains what the checkpoint in `folder` trained: its adapters (PEFT's
    adapter_config.json) with the same rank, alpha and targets when the run trains LoRA
    (`model`: --lora, or an IR document built with it), none when it does not (None). Else a different rank was copied into
    the adapters (exit 101) and a run without --lora dropped them unsaid."""
    from runtime.errors import RuntimeUserError

    saved = Path(folder) / CONFIG
    if model is None:
        if saved.is_file():
            raise RuntimeUserError(f"{folder} holds LoRA adapters "
                                   f"({_described(_read(saved))}); this run has no --lora",
                                   help=["resume with the --lora of the run that saved it, "
                                         "or train the whole model from its weights: "
                                         f"--hf-weights {folder} (the base, no adapters)"])
        return
    now = peft_config(model)
    if not saved.is_file():
        raise RuntimeUserError(f"--lora: {folder} was trained without LoRA (no {CONFIG})",
                               help=[f"start LoRA from its weights: --hf-weights {folder}"])
    then = _read(saved)
    if any(then.get(key) != now[key] for key in RESUMED):
        raise RuntimeUserError(f"--lora gives {_described(now)}, but {folder} was trained "
                               f"with {_described(then)}",
                               help=["resume with the --lora of the run that saved it"])


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        from runtime.errors import RuntimeUserError

        raise RuntimeUserError(f"cannot read {path}: {exc}") from None


def _described(config: dict) -> str:
    targets = ",".join(config.get("target_modules") or []) or "none"
    return f"rank {config.get('r')}, alpha {config.get('lora_alpha')}, targets {targets}"
