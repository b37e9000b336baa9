"""Comparing a bf16 GPU step's gradients with transformers: against transformers' own fp32
run of the same weights and batch, not against its bf16 run alone. A gradient passes when
its cosine with the fp32 one is >= 0.999, or, where transformers' bf16 run is itself
further off (a gradient that is zero in exact arithmetic, as a key bias's: the softmax
does not see a constant added to every key's score; a router whose top-k picks flip
under rounding), when ours is no further from the fp32 gradient than `SLACK` x
transformers' bf16 one. Comparing the two bf16 runs with each other (the tests' first
form) failed on exactly those: two roundings of a zero have a cosine of 0.13."""

from __future__ import annotations

import copy

import torch

COSINE, SLACK = 0.999, 2.0


def cosine(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


def fp32_and_bf16(model):
    """(an fp32 copy on the GPU, the model itself in bf16 on the GPU)."""
    reference = copy.deepcopy(model).to("cuda", torch.float32)
    return reference, model.to("cuda", torch.bfloat16)


def far_gradients(ours: dict, bf16: dict, fp32: dict, slack: float = SLACK) -> list:
    """(name, cosine with fp32, our error / transformers' bf16 error) of each gradient that
    fails both tests; empty when all pass."""
    bad = []
    for name, truth in fp32.items():
        truth = truth.double()
        near = cosine(ours[name], truth)
        if near >= COSINE:
            continue
        mine = float((ours[name].double() - truth).norm())
        theirs = float((bf16[name].double() - truth).norm())
        if mine <= slack * theirs:
            continue
        bad.append((name, round(near, 5), round(mine / max(theirs, 1e-30), 2)))
    return bad


def tiny_hf_checkpoint(folder, config_class: str, model_class: str, perturb=None,
                       attention: str | None = "sdpa", **config):
    """A transformers model (seed 0, eval mode: no dropout, `attention` as its attention
    implementation; None for a model without attention, as Mamba) saved to `folder`, its
    1-d parameters (norm scales, biases) moved off their init by 0.1 N(0, 1) so that a
    mixed-up one shows; `perturb(name, parameter)` changes more."""
    import transformers

    torch.manual_seed(0)
    hf_config = getattr(transformers, config_class)(**config)
    if attention is not None:
        hf_config._attn_implementation = attention
    model = getattr(transformers, model_class)(hf_config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
            if perturb is not None:
                perturb(name, parameter)
    model.save_pretrained(folder)
    return model


def step_gradients(module: str, settings: dict, folder, tokens, dtype=torch.bfloat16):
    """One GPU step of std `module` at `settings` on the checkpoint in `folder` and the
    int32 batch `tokens`: (loss, every parameter gradient in fp32 under the checkpoint's
    names)."""
    from runtime.cuda.step import TrainStep
    from runtime.hf_weights import export_hf_tensors, load_hf_weights

    batch, seq = tokens.shape
    step = TrainStep.from_module(module, settings, batch=batch, seq=seq, dtype=dtype)
    weights = load_hf_weights(step.program.weight_schema, folder, dtype=torch.float32,
                              device="cuda")
    step.load(weights)
    step.set_batch(tokens.cuda())
    loss, grads = step.loss_and_gradients()
    return float(loss), export_hf_tensors(step.program.weight_schema,
                                          {p: g.float() for p, g in grads.items()},
                                          gradients=True, layout=weights.layout)


def hf_loss_and_gradients(model, tokens, rename=lambda name: name):
    """transformers' loss with labels on `tokens` and its gradients by (renamed) name."""
    loss = model(input_ids=tokens.long().cuda(), labels=tokens.long().cuda()).loss
    loss.backward()
    return float(loss), {rename(n): p.grad for n, p in model.named_parameters()}
