"""benchmarks/train_step_dist.py's HF peers: transformers LlamaForCausalLM under DDP or
FSDP2 (the variants `hf_{ddp|fsdp2}[_compile|_compilewhole|_compilelayers][_ckpt][_fp8]`,
described in that file's docstring)."""

from __future__ import annotations

from benchmarks.dist_measure import Ranks, batch_for, measure, reset_peak
from benchmarks.harness import hf_step
from benchmarks.train_step import hf_config


def hf_options(variant: str) -> dict:
    """hf_{ddp|fsdp2}[_compile|_compilewhole|_compilelayers][_ckpt]."""
    parts = variant.split("_")[1:]
    wrap, flags = parts[0], set(parts[1:])
    unknown = flags - {"compile", "compilewhole", "compilelayers", "ckpt", "fp8"}
    if wrap not in ("ddp", "fsdp2") or unknown:
        raise ValueError(f"unknown HF variant {variant!r}")
    compile_ = ("whole" if "compilewhole" in flags else "layers" if "compilelayers" in flags
                else None)
    if "compile" in flags:
        compile_ = "whole" if wrap == "ddp" else "layers"
    return {"wrap": wrap, "compile": compile_, "ckpt": "ckpt" in flags, "fp8": "fp8" in flags}


def hf_model(args, shape):
    """fp32 LlamaForCausalLM on the CPU from the checkpoint; without one (the llama3
    shapes) on the meta device, materialized by `materialize` after sharding."""
    import torch
    from transformers import LlamaForCausalLM

    if args.ckpt:
        model = LlamaForCausalLM.from_pretrained(args.ckpt, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa")
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config(shape)).float()
    model.config.use_cache = False
    return model


def materialize(model, ranks: Ranks) -> None:
    """A meta model's (local shards of) parameters on the device: normal(0, 0.02), the
    norms' weights 1 (speed does not depend on the values); the RoPE tables rebuilt."""
    import torch

    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=ranks.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.fill_(1.0) if name.endswith("norm.weight") else local.normal_(0.0, 0.02)
    rope = model.model.rotary_emb
    with ranks.device:  # transformers' signatures differ: the default device instead
        model.model.rotary_emb = type(rope)(model.config)


def checkpointed(model) -> None:
    """Every decoder layer recomputed in the backward (non-reentrant torch checkpoint);
    transformers 5 renamed gradient_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def wrap_ddp(model, ranks: Ranks, options: dict):
    """DDP on the device; compile the DDP module whole, or each decoder layer before."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    materialize(model, ranks)
    model = model.to(ranks.device)
    if options["ckpt"]:
        checkpointed(model)
    if options["compile"] == "layers":
        for layer in model.model.layers:
            layer.compile()
    ids = [ranks.local] if ranks.kind == "cuda" else None
    ddp = DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    return model, (torch.compile(ddp) if options["compile"] == "whole" else ddp)


def wrap_fsdp2(model, ranks: Ranks, options: dict):
    """fully_shard per decoder layer, then the root; compile per layer before sharding."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ranks.kind, (ranks.world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if options["ckpt"]:
        checkpointed(model)
    for layer in model.model.layers:
        if options["compile"] == "layers":
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # moves the shards to the device
    return model, (torch.compile(model) if options["compile"] == "whole" else model)


def run_hf(args, shape, ranks: Ranks, variant: str) -> dict:
    import torch

    options = hf_options(variant)
    model = hf_model(args, shape)
    model.train()
    if options["fp8"]:
        from benchmarks.train_step import to_float8

        to_float8(model)
    wrap = wrap_ddp if options["wrap"] == "ddp" else wrap_fsdp2
    model, forward = wrap(model, ranks, options)
    materialize(model, ranks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    tokens = batch_for(args, shape["vocab_size"], ranks).long()
    # FSDP2's policy casts the parameters itself
    step, box = hf_step(forward, opt, tokens, ranks.kind, autocast=options["wrap"] == "ddp")
    reset_peak(ranks)
    result = measure(step, lambda: float(box["loss"]), ranks, args)
    result["compile"] = options["compile"]
    return result

