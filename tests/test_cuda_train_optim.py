"""The trainer's optimizer on the GPU (`-m cuda`; skipped without CUDA): the AdamW kernels'
device learning rate and gradient scale, a schedule's rate changed between replays of one
captured graph (no re-capture), global clipping in the fused step against the torch
optimizer path and with gradient accumulation, and `modulec train --device cuda` with a
schedule and clipping against the CPU reference run (bf16 tolerance)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tests.test_cuda_train import (B, LLAMA, SMALL, T, _hf_checkpoint, _rel,  # noqa: E402
                                   _tokens, _without_ties)
from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)


def test_adamw_kernels_read_the_device_lr_and_gradient_scale():
    """lr=1 x lr_now and grad_scale inside the kernel: bit for bit the update with that
    rate on the gradient scaled beforehand (fp32 products either way)."""
    from runtime.cuda.kernels import _extension

    ext, g = _extension(), torch.Generator(device="cuda").manual_seed(0)
    n = 4099  # a vectorized body and a scalar tail
    master = torch.randn(n, device="cuda", generator=g)
    grad = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    lr_now = torch.tensor([3e-3], device="cuda")
    scale = torch.tensor([0.37], device="cuda")
    step = torch.tensor([3.0], device="cuda")
    results = []
    for device_scalars in (True, False):
        hi, lo = _split(master)
        m = torch.full((n,), 0.01, device="cuda")
        v = torch.full((n,), 0.02, device="cuda")
        if device_scalars:
            ext.adamw_split_step(hi, lo, grad, m, v, step, 1.0, 0.9, 0.95, 1e-8, 0.1,
                                 lr_now, scale)
        else:
            ext.adamw_split_step(hi, lo, grad.float() * scale, m, v, step, 3e-3, 0.9, 0.95,
                                 1e-8, 0.1)
        results.append((hi, lo, m, v))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    p, m, v = master.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    ext.adamw_step(p, grad, m, v, None, step, 0.5, 0.9, 0.95, 1e-8, 0.0, lr_now=lr_now)
    q, m2, v2 = master.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    ext.adamw_step(q, grad, m2, v2, None, step, 1.5e-3, 0.9, 0.95, 1e-8, 0.0)
    assert torch.equal(p, q)  # lr 0.5 x lr_now 3e-3 = 1.5e-3 exactly


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_adamw_split_list_is_the_one_tensor_update_of_each(grad_dtype):
    """adamw_split_list (csrc/bindings_optim.cpp; 16 tensors a launch, so 19 take two):
    each tensor bit for bit what adamw_split_step gives it with its own rate factor and
    weight decay, the device lr and gradient scale shared; sizes with a scalar tail, one
    element, and a tensor off the 4-element alignment (the list then runs unvectorized)."""
    from runtime.cuda.kernels import _extension

    ext, g = _extension(), torch.Generator(device="cuda").manual_seed(1)
    sizes = [4099, 1, 7, 16 * 4096, 300] + [64 * (k + 1) for k in range(14)]
    lr_now, scale = torch.tensor([3e-3], device="cuda"), torch.tensor([0.37], device="cuda")
    step = torch.tensor([3.0], device="cuda")
    for offset in (0, 1):  # 1: every tensor a view one element in (not 16-byte aligned)
        masters = [torch.randn(n, device="cuda", generator=g) for n in sizes]
        grads = [torch.randn(n + offset, device="cuda", generator=g).to(grad_dtype)[offset:]
                 for n in sizes]
        lrs = [0.5 + 0.25 * k for k in range(len(sizes))]
        decays = [0.1 * (k % 3) for k in range(len(sizes))]
        results = []
        for listed in (True, False):
            states = [(*_split(p), torch.full_like(p, 0.01), torch.full_like(p, 0.02))
                      for p in masters]
            if listed:
                his, los, ms, vs = (list(column) for column in zip(*states))
                ext.adamw_split_list(his, los, grads, ms, vs, step, lrs, decays, 0.9, 0.95,
                                     1e-8, lr_now, scale)
            else:
                for (h, lo, m, v), gr, lr, wd in zip(states, grads, lrs, decays):
                    ext.adamw_split_step(h, lo, gr, m, v, step, lr, 0.9, 0.95, 1e-8, wd,
                                         lr_now, scale)
            results.append(states)
        for got, want in zip(*results):
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_adamw_kernels_add_the_gradients_squares_to_norm_sq(grad_dtype):
    """norm_sq (a fp64 device scalar): each form of the AdamW kernel adds its gradients'
    squares (before grad_scale) to it and updates bit for bit as without it; sizes with
    a scalar tail, one element, a large tensor (many blocks), and views off the 4-element
    alignment (unvectorized). The sum matches fp64's within fp32 partial sums' rounding."""
    from runtime.cuda.kernels import _extension

    ext, g = _extension(), torch.Generator(device="cuda").manual_seed(2)
    sizes = [4099, 1, 7, 3 * 1024 * 1024 + 5, 300]
    scale, step = torch.tensor([0.37], device="cuda"), torch.tensor([3.0], device="cuda")
    for offset in (0, 1):
        masters = [torch.randn(n, device="cuda", generator=g) for n in sizes]
        grads = [torch.randn(n + offset, device="cuda", generator=g).to(grad_dtype)[offset:]
                 for n in sizes]
        want = sum(float(gr.double().square().sum()) for gr in grads)
        for form in ("split", "list", "whole"):
            results = []
            for norm in (torch.zeros(1, dtype=torch.float64, device="cuda"), None):
                states = [(*_split(p), torch.full_like(p, 0.01), torch.full_like(p, 0.02),
                           p.clone()) for p in masters]
                if form == "list":
                    his, los, ms, vs, _ = (list(column) for column in zip(*states))
                    ext.adamw_split_list(his, los, grads, ms, vs, step, [1e-3] * len(sizes),
                                         [0.1] * len(sizes), 0.9, 0.95, 1e-8, None, scale,
                                         norm)
                for (h, lo, m, v, p), gr in zip(states, grads):
                    if form == "split":
                        ext.adamw_split_step(h, lo, gr, m, v, step, 1e-3, 0.9, 0.95, 1e-8,
                                             0.1, None, scale, norm)
                    elif form == "whole":
                        ext.adamw_step(p, gr, m, v, None, step, 1e-3, 0.9, 0.95, 1e-8, 0.1,
                                       None, scale, norm)
                results.append((states, norm))
            (got, norm), (plain, _) = results
            assert float(norm) == pytest.approx(want, rel=1e-5), (form, offset)
            for a, b in zip(got, plain):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (form, offset)


@pytest.mark.parametrize("update_in_backward", [True, False])
def test_the_steps_gradient_norm_comes_from_the_update_kernels(tmp_path, update_in_backward):
    """Without clipping the fused step's grad_norm is summed by its AdamW kernels
    (norm_sq); it is the torch-optimizer step's norm of the same gradients, eagerly and
    in replays of the captured step (the sum zeroed at each step's start)."""
    _hf_checkpoint(tmp_path)
    tokens = _tokens().cuda()
    fused, ref = _pair(tmp_path, None, update_in_backward=update_in_backward)
    assert float(fused(tokens)) == float(ref(tokens))
    norm = float(ref.grad_norm)
    assert norm > 0 and float(fused.grad_norm) == pytest.approx(norm, rel=1e-5)
    fused.set_batch(tokens)
    fused.capture(warmup=1)  # step 2 (the warmup); the capture runs none
    replayed, eager = [], []
    for _ in range(2):  # steps 3 and 4
        fused(tokens)
        replayed.append(float(fused.grad_norm))
    for step in (2, 3, 4):
        ref(tokens)
        if step > 2:
            eager.append(float(ref.grad_norm))
    assert replayed == pytest.approx(eager, rel=2e-2)  # later steps: bf16 copies differ


def _split(master):
    from runtime.cuda.state import split_master

    hi = torch.empty(master.shape, dtype=torch.bfloat16, device="cuda")
    lo = torch.empty(master.shape, dtype=torch.int16, device="cuda")
    split_master(master, hi, lo)
    return hi, lo


def _small_step(**options):
    from runtime.cuda.step import TrainStep

    return TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, **options).init_random(0)


def test_the_rate_changes_between_replays_of_one_graph():
    from runtime.cuda.step import AdamWConfig

    step = _small_step(adamw=AdamWConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0))
    tokens = _tokens().cuda()
    step(tokens)
    step.set_batch(tokens)
    step.capture(warmup=1)
    graph = step.cuda_graph
    step.set_lr(0.0)  # no update at all: Adam's step and the decay are both lr x ...
    before = {p: step.masters[p].clone() for p in step.names}
    step(tokens)
    assert all(torch.equal(step.masters[p], before[p]) for p in step.names)
    step.set_lr(2e-3)
    step(tokens)
    moved = sum(float((step.masters[p] - before[p]).abs().max()) for p in step.names)
    assert moved > 0 and step.cuda_graph is graph  # the same graph, never re-captured
    assert float(step.grad_norm) > 0 and torch.isfinite(step.loss)


def _pair(tmp_path, clip, **options):
    """The fused step and the torch-optimizer step on the same weights."""
    from runtime.cuda.step import AdamWConfig, TrainStep
    from runtime.hf_weights import load_hf_weights

    config = AdamWConfig(lr=1e-3, weight_decay=0.1, clip_grad=clip)
    fused = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, adamw=config, **options)
    ref = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, optimizer="torch",
                                adamw=AdamWConfig(lr=1e-3, weight_decay=0.1, clip_grad=clip))
    for s in (fused, ref):
        s.load(_without_ties(load_hf_weights(s.program.weight_schema, tmp_path,
                                             dtype=torch.float32, device="cuda")))
    return fused, ref


@pytest.mark.parametrize("update_in_backward", [True, False])
def test_fused_clipping_matches_the_torch_optimizer(tmp_path, update_in_backward):
    """Step 1 from the same compute copies: the same gradient norm, clipping active, and
    the masters equal to fp32 rounding (the fused kernel scales the bf16 gradient inside
    the update; torch's AdamW gets fp32 copies scaled by _foreach_mul_)."""
    _hf_checkpoint(tmp_path)
    tokens = _tokens().cuda()
    fused, ref = _pair(tmp_path, 0.05, update_in_backward=update_in_backward)
    assert float(fused(tokens)) == float(ref(tokens))
    norm = float(ref.grad_norm)
    assert norm > 0.05 and float(fused.grad_norm) == pytest.approx(norm, rel=1e-5)
    for p in fused.names:
        assert _rel(fused.masters[p], ref.masters[p]) < 1e-5, p


def test_clipping_with_accumulation_and_in_the_graph(tmp_path):
    """accumulation=2 with clipping (the gradient sums held, then scaled) follows the whole
    batch, eagerly and replayed; the decay exclusions hold the norms' decay off."""
    from runtime.cuda.step import AdamWConfig, TrainStep
    from runtime.hf_weights import load_hf_weights

    _hf_checkpoint(tmp_path)
    tokens = _tokens().cuda()
    config = dict(lr=1e-3, weight_decay=0.1, clip_grad=0.05)
    whole = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T,
                                  adamw=AdamWConfig(**config))
    micro = TrainStep.from_module(LLAMA, SMALL, batch=1, seq=T, accumulation=B,
                                  adamw=AdamWConfig(**config))
    for s in (whole, micro):
        s.load(load_hf_weights(s.program.weight_schema, tmp_path, dtype=torch.float32,
                               device="cuda"))
    losses = [(float(whole(tokens)), float(micro(tokens)))]
    for s in (whole, micro):
        s.set_batch(tokens)
        s.capture(warmup=1)
    losses.append((float(whole.loss), float(micro.loss)))
    for _ in range(2):
        losses.append((float(whole(tokens)), float(micro(tokens))))
    for a, b in losses:
        assert abs(a - b) / abs(a) < 2e-3, losses
    assert float(micro.grad_norm) == pytest.approx(float(whole.grad_norm), rel=2e-2)
    for p in whole.names:
        assert _rel(micro.masters[p], whole.masters[p]) < 5e-3, p


def test_train_cli_on_the_gpu_follows_the_cpu_run(tmp_path):
    """modulec train with a cosine schedule, warmup, clipping and weight decay: the GPU's
    losses and gradient norms within bf16 tolerance of the CPU reference, the same
    rates."""
    import numpy as np
    import transformers

    from tests.test_cli import run

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=512, max_position_embeddings=128,
        rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    np.random.default_rng(0).integers(0, 512, 20000).astype("<u2").tofile(
        tmp_path / "tokens.bin")
    records = {}
    for device in ("cpu", "cuda"):
        result = run("train", LLAMA, "--hf-weights", tmp_path / "hf", "--data",
                     tmp_path / "tokens.bin", "--seq", "128", "--batch", "2", "--steps", "6",
                     "--lr", "1e-3", "--lr-schedule", "cosine", "--warmup", "2", "--min-lr",
                     "1e-4", "--clip-grad", "0.5", "--weight-decay", "0.1", "--format",
                     "json", "--device", device)
        assert result.exit_code == 0, result.output
        rows = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
        records[device] = [r for r in rows if r["event"] == "step"]
    cpu, gpu = records["cpu"], records["cuda"]
    assert [r["lr"] for r in gpu] == [r["lr"] for r in cpu]
    assert [r["loss"] for r in gpu] == pytest.approx([r["loss"] for r in cpu], rel=1e-2)
    assert [r["grad_norm"] for r in gpu] == pytest.approx([r["grad_norm"] for r in cpu],
                                                          rel=5e-2)
    assert cpu[0]["grad_norm"] > 0.5  # clipping acted
