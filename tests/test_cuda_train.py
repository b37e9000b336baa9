"""The GPU training step on a GPU (`-m cuda`; skipped without CUDA): FlashAttention
against the reference kernel, bf16 loss and gradients against HF LlamaForCausalLM in bf16
on the same weights and batch, fp32 on the GPU against the CPU reference, and CUDA-graph
replay against eager steps."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

LLAMA = "std/models/llama.module"
SMALL = dict(vocab_size=512, d_model=256, n_layers=2, num_heads=8, num_kv_heads=2, d_ff=512,
             max_seq=128, eps=1e-5)
B, T = 2, 128


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _cos(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


# ------------------------------------------------------------------ flash attention
@pytest.mark.parametrize("order", [("flash",), ("cudnn", "flash"), ("cudnn_expand", "flash")])
@pytest.mark.parametrize("hq,hkv,t,d,window", [(8, 2, 128, 64, None), (4, 4, 77, 32, None),
                                               (8, 1, 200, 128, None), (4, 2, 96, 64, 16)])
def test_flash_attention_matches_the_reference(hq, hkv, t, d, window, order):
    """Every backend order (cuDNN falls back to FlashAttention for the sliding window)."""
    from runtime.cuda.attention import FlashAttention
    from runtime.kernels import KERNELS

    g = torch.Generator(device="cuda").manual_seed(t)
    qkv = torch.randn(2, t, hq + 2 * hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([hq, hkv, hkv], dim=2))  # strided views
    attrs = {"causal": True, "softmax_scale": None, "window_size": window}
    out, lse = FlashAttention(order).forward([q, k, v, None], attrs)
    ref_in = [x.float() for x in (q, k, v)]
    ref_out, ref_lse = KERNELS["flash_attention"].forward(ref_in + [None], attrs)
    assert out.shape == ref_out.shape and lse.dtype == torch.float32
    assert _rel(out, ref_out) < 1e-2 and _rel(lse, ref_lse) < 1e-3
    d_out = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    grads = FlashAttention(order).backward([d_out, q, k, v, out, lse, None], attrs)
    ref = KERNELS["flash_attention"].backward([d_out.float()] + ref_in + [ref_out, ref_lse, None],
                                              attrs)
    for got, want in zip(grads, ref):
        assert got.shape == want.shape
        assert _rel(got, want) < 2e-2


def test_cudnns_backward_takes_out_d_out_and_lse_laid_any_way():
    """out, d_out and lse laid otherwise than the first call at these shapes (rows apart in
    a wider buffer, heads outermost) give that call's bits: torch's cuDNN entry keeps its
    graph without their strides (decisions.md "GPU attention"), so the backend hands it
    them laid one way."""
    from runtime.cuda.attention import BACKENDS

    cudnn = BACKENDS["cudnn"]
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(1, 256, 8 + 2 * 2, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([8, 2, 2], dim=2))
    attrs = {"causal": True, "softmax_scale": None, "window_size": None}
    out, lse = cudnn.forward(q, k, v, attrs)
    d_out = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    want = cudnn.backward(d_out.transpose(1, 2).contiguous().transpose(1, 2), q, k, v, out,
                          lse, attrs)

    def apart(t):  # [B, H, T, D] in a [B, T, H * D + 16] buffer's left columns
        wide = torch.zeros(1, 256, 8 * 128 + 16, device="cuda", dtype=t.dtype)
        view = wide[..., :8 * 128].view(1, 256, 8, 128).transpose(1, 2)
        view.copy_(t)
        return view

    lse_apart = torch.zeros(1, 8, 256 + 8, device="cuda")[..., :256]
    lse_apart.copy_(lse)
    d_heads_outer = d_out.contiguous()
    for o, d, stats in ((apart(out), d_out, lse), (out, apart(d_out), lse),
                        (apart(out), apart(d_out), lse_apart), (out, d_heads_outer, lse_apart)):
        for got, expected in zip(cudnn.backward(d, q, k, v, o, stats, attrs), want):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("first", ["fa4", "fa4_bwd"])
@pytest.mark.parametrize("hq,hkv,t,d,window", [(8, 2, 128, 64, None), (8, 1, 200, 128, None),
                                               (4, 2, 96, 64, 16), (4, 4, 77, 32, None)])
def test_fa4_attention_matches_the_reference(hq, hkv, t, d, window, first):
    """FlashAttention-4's kernels where the flash-attn-4 package is installed (an optional
    dependency): `fa4` runs them both ways for head dims 64-128 (windows included),
    `fa4_bwd` cuDNN's forward and FA4's backward at head dim 64 without a window; each
    matches the reference, and what they do not cover goes on to cuDNN / FlashAttention-2."""
    from runtime.cuda.attention import BACKENDS, FA4

    if not FA4.interface():
        pytest.skip(f"flash-attn-4 not importable here: {FA4.unavailable}")
    g = torch.Generator(device="cuda").manual_seed(t)
    qkv = torch.randn(2, t, hq + 2 * hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([hq, hkv, hkv], dim=2))
    attrs = {"causal": True, "softmax_scale": None, "window_size": window}
    covered = d == 64 and window is None if first == "fa4_bwd" else d >= 64
    assert BACKENDS[first].covers(q, k, v, attrs) == covered
    test_flash_attention_matches_the_reference(hq, hkv, t, d, window, (first, "cudnn", "flash"))


# ------------------------------------------------------------------ whole step
def _hf_checkpoint(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=SMALL["vocab_size"], hidden_size=SMALL["d_model"],
                         num_hidden_layers=SMALL["n_layers"],
                         num_attention_heads=SMALL["num_heads"],
                         num_key_value_heads=SMALL["num_kv_heads"],
                         intermediate_size=SMALL["d_ff"],
                         max_position_embeddings=SMALL["max_seq"], rms_norm_eps=SMALL["eps"],
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norm weights off 1, so that their gradients mean something
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


def _step(tmp_path, dtype, **options):
    from runtime.cuda.step import TrainStep
    from runtime.hf_weights import load_hf_weights

    step = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, dtype=dtype, **options)
    weights = load_hf_weights(step.program.weight_schema, tmp_path, dtype=torch.float32,
                              device="cuda")
    return step.load(weights), weights


def _tokens():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, SMALL["vocab_size"], (B, T), generator=g, dtype=torch.int32)


def test_bf16_loss_and_gradients_match_hf_bf16(tmp_path):
    from runtime.hf_weights import export_hf_tensors

    hf = _hf_checkpoint(tmp_path).to("cuda", torch.bfloat16)
    step, weights = _step(tmp_path, torch.bfloat16)
    tokens = _tokens().cuda()
    step.set_batch(tokens)
    loss, grads = step.loss_and_gradients()
    hf_loss = hf(input_ids=tokens.long(), labels=tokens.long()).loss
    hf_loss.backward()
    assert abs(float(loss) - float(hf_loss)) / float(hf_loss) < 1e-2
    ours = export_hf_tensors(step.program.weight_schema, {p: g.float() for p, g in grads.items()},
                             gradients=True, layout=weights.layout)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert ours.keys() == hf_grads.keys()
    worst = min((_cos(ours[n], hf_grads[n]), n) for n in ours)
    assert worst[0] >= 0.999, worst


def test_rope_runs_in_place_inside_the_qkv_projection(tmp_path):
    """Each layer's RoPE rotates q and k inside the QKV projection output
    (modulec/plan/in_place.py): q_rot, k_rot and v are views of one buffer."""
    _hf_checkpoint(tmp_path)
    step, _ = _step(tmp_path, torch.bfloat16)
    step.set_batch(_tokens().cuda())
    run = step.interpreter()
    run.keep_only_saved = False
    (out,), frame = run.forward([step.tokens])
    assert run.in_place_runs == SMALL["n_layers"]
    stack, seen = [frame], 0
    while stack:
        f = stack.pop()
        stack += f.children.values()
        names = {v.name: v.id for v in f.function.values if v.name}
        if {"q_rot", "k_rot", "v"} <= names.keys():
            ptrs = {f.env[names[n]].untyped_storage().data_ptr() for n in ("q_rot", "k_rot", "v")}
            assert len(ptrs) == 1
            seen += 1
    assert seen == SMALL["n_layers"]


def test_fixed_state_lives_in_the_plans_regions(tmp_path):
    """Compute copies in one `weights` allocation, the masters' low halves and the
    moments in one `optimizer_state` allocation, every tensor a view of its region. The
    weights region is the plan's size up to 256-byte alignment; the optimizer state's 10
    bytes a parameter are within the plan's 12 (an fp32 master and the moments)."""
    from modulec.plan.from_graph import plan_step

    _hf_checkpoint(tmp_path)
    step, _ = _step(tmp_path, torch.bfloat16)
    plan = plan_step(step.program.graph)
    padding = 256 * len(step.shapes())
    for name, groups, share in (("weights", [step.compute], 1),
                                ("optimizer_state", [step.lows, step.exp_avg, step.exp_avg_sq],
                                 10 / 12)):
        region = step.regions[name]
        planned = plan.regions[name].arena * share
        assert planned <= region.numel() <= planned + len(groups) * padding, name
        base = region.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for g in groups for t in g.values())


def test_loading_again_does_not_hold_the_old_state(tmp_path):
    """A resume loads the checkpoint over the step's first load: the old weights and
    optimizer state go before the new ones are allocated (not both at once)."""
    _hf_checkpoint(tmp_path)
    step, weights = _step(tmp_path, torch.bfloat16)
    held = sum(r.numel() for r in step.regions.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step.load(weights)
    assert torch.cuda.max_memory_allocated() - before < held // 4
    assert torch.cuda.memory_allocated() <= before


def test_fp32_on_the_gpu_matches_the_cpu_reference(tmp_path):
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import next_token_labels
    from runtime.interpreter import Interpreter

    _hf_checkpoint(tmp_path)
    step, weights = _step(tmp_path, torch.float32)
    tokens = _tokens()
    step.set_batch(tokens.cuda())
    loss, grads = step.loss_and_gradients()
    cpu = {p: w.cpu() for p, w in weights.items()}
    run = Interpreter(step.program.graph, cpu, torch.float32)
    (logits,), frame = run.forward([tokens])
    ref_loss, d_logits = logits_cross_entropy(logits, next_token_labels(tokens))
    _, ref_grads = run.backward(frame, [d_logits])
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-4
    assert grads.keys() == ref_grads.keys()
    for path, ref in ref_grads.items():
        assert _rel(grads[path].float().cpu(), ref) < 1e-4, path


def test_arena_step_matches_the_plain_step(tmp_path):
    """TrainStep(arena=True), the default: activations at the plan's offsets in two
    allocations (the transient and saved regions), the same loss and gradients as the step
    on torch's allocator (arena=False)."""
    from runtime.cuda.step import TrainStep

    _hf_checkpoint(tmp_path)
    plain, weights = _step(tmp_path, torch.bfloat16, arena=False)
    placed = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, dtype=torch.bfloat16,
                                   arena=True).load(weights)
    tokens = _tokens().cuda()
    results = []
    for step in (plain, placed):
        step.set_batch(tokens)
        results.append(step.loss_and_gradients())
    (loss, grads), (arena_loss, arena_grads) = results
    assert abs(float(arena_loss) - float(loss)) <= 1e-3 * abs(float(loss))
    assert grads.keys() == arena_grads.keys()
    worst = min((_cos(arena_grads[p].float(), g.float()), p) for p, g in grads.items())
    assert worst[0] >= 0.9999, worst
    regions = placed.activations.regions
    assert all(r.is_cuda and r.numel() > 0 for r in regions.values())


def test_cuda_graph_replay_matches_eager_steps_and_lowers_the_loss(tmp_path):
    _hf_checkpoint(tmp_path)
    tokens = _tokens().cuda()
    eager, _ = _step(tmp_path, torch.bfloat16)
    graphed, _ = _step(tmp_path, torch.bfloat16)
    for s in (eager, graphed):
        s.adamw.lr = 1e-3  # the fused AdamW reads it at each step (capture included)
    eager_losses = [float(eager(tokens)) for _ in range(8)]
    graphed.set_batch(tokens)
    graphed.capture(warmup=2)  # steps 1 and 2, then the captured one is not run yet
    graphed_losses = [float(graphed(tokens)) for _ in range(6)]
    for a, b in zip(eager_losses[2:], graphed_losses):
        assert abs(a - b) / abs(a) < 2e-3, (eager_losses, graphed_losses)
    assert graphed_losses[-1] < eager_losses[0] * 0.9


@pytest.mark.parametrize("derive_written,update_in_backward",
                         [(False, True), (True, True), (False, False)])
def test_fused_adamw_step_matches_torch_adamw(tmp_path, derive_written, update_in_backward):
    """optimizer='fused' (bf16 gradients, one kernel per tensor, split masters; layers
    updated inside the backward or after it) against torch.optim.AdamW on fp32 copies of
    the gradients. After one step the masters agree to fp32 rounding: both start from the
    same compute copies, the loaded weights having no exact ties (where the split master's
    compute copy rounds away from zero, runtime/cuda/state.py). Later steps differ by
    more: a compute copy one bf16 ulp apart changes the gradients a little, and Adam's
    early steps (about lr * sign(g)) turn that into steps of lr; the losses stay close."""
    from runtime.cuda.step import AdamWConfig, TrainStep
    from runtime.hf_weights import load_hf_weights

    _hf_checkpoint(tmp_path)
    tokens = _tokens().cuda()
    config = AdamWConfig(lr=1e-3, weight_decay=0.1)
    fused = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, adamw=config,
                                  derive_written=derive_written,
                                  update_in_backward=update_in_backward)
    ref = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, adamw=config, optimizer="torch",
                                derive_written=derive_written)
    for s in (fused, ref):
        s.load(_without_ties(load_hf_weights(s.program.weight_schema, tmp_path,
                                             dtype=torch.float32, device="cuda")))
    assert fused.optimizer == "fused" and not any(m.grad is not None
                                                  for m in fused.masters.values())
    assert float(fused(tokens)) == float(ref(tokens))
    for p in fused.names:
        assert _rel(fused.masters[p], ref.masters[p]) < 1e-6, p
        rounded = fused.masters[p].to(torch.bfloat16)  # but exact ties: away from zero
        assert bool((fused.lows[p][fused.compute[p] != rounded] == -2**15).all()), p
    for _ in range(2):
        a, b = float(fused(tokens)), float(ref(tokens))
        assert abs(a - b) / abs(b) < 2e-3


def _without_ties(weights: dict) -> dict:
    """fp32 weights moved one ulp off each exact bf16 rounding tie (low 16 bits 0x8000)."""
    for w in weights.values():
        bits = w.view(torch.int32)
        bits[(bits & 0xFFFF) == 0x8000] += 1
    return weights


@pytest.mark.parametrize("optimizer,arena", [("fused", False), ("torch", False),
                                            ("fused", True)])
def test_gradient_accumulation_matches_the_whole_batch(tmp_path, optimizer, arena):
    """accumulation=2 micro-batches of 1 sample: the same losses and weights as one
    batch of 2, eagerly and as CUDA-graph replays (fp32 gradient sums); on the arena, each
    micro-batch reuses its regions."""
    from runtime.cuda.step import TrainStep
    from runtime.hf_weights import load_hf_weights

    _hf_checkpoint(tmp_path)
    tokens = _tokens().cuda()
    whole = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, optimizer=optimizer)
    micro = TrainStep.from_module(LLAMA, SMALL, batch=1, seq=T, accumulation=B,
                                  optimizer=optimizer, arena=arena)
    for s in (whole, micro):
        s.load(load_hf_weights(s.program.weight_schema, tmp_path, dtype=torch.float32,
                               device="cuda"))
        s.adamw.lr = 1e-3
    for _ in range(3):
        a, b = float(whole(tokens)), float(micro(tokens))
        assert abs(a - b) / abs(a) < 2e-3, (a, b)
    # bf16 gradients rounded per micro-batch, and Adam turns near-zero gradient noise
    # into steps of up to lr (as in the fused-vs-torch test): 5e-3
    for p in whole.names:
        assert _rel(micro.masters[p], whole.masters[p]) < 5e-3, p
    micro.set_batch(tokens)
    micro.capture(warmup=1)  # its warm-up is a step: the whole-batch step takes one too
    whole(tokens)
    for _ in range(3):
        a, b = float(whole(tokens)), float(micro(tokens))
        assert abs(a - b) / abs(a) < 5e-3, (a, b)


def _load_all(steps, tmp_path, tokens) -> None:
    """The checkpoint's weights into each step, lr 1e-3, `tokens` as the batch."""
    from runtime.hf_weights import load_hf_weights

    for s in steps:
        s.load(load_hf_weights(s.program.weight_schema, tmp_path, dtype=torch.float32,
                               device="cuda"))
        s.adamw.lr = 1e-3
        s.set_batch(tokens)


def _budget_between(derive_written: bool, share: float, plan_device="h200-noswap",
                    lora=None) -> int:
    """A GPU budget for SMALL (with `lora`, its LoRA step): `share` of the way from the
    planner's lowest peak to its keep-all peak (both in this step's terms)."""
    from modulec.plan.budget import make_problem, no_recompute, plan_budget
    from modulec.plan.devices import device
    from runtime.cuda.step import TrainStep, planner_budget

    program = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T,
                                    derive_written=derive_written, lora=lora).program
    problem = make_problem(program.graph, None, "full", device(plan_device))
    lowest, peak = plan_budget(problem, 0).minimum_peak, no_recompute(problem).peak_bytes
    return int(lowest + share * (peak - lowest)) - planner_budget(program, 0)


@pytest.mark.parametrize("derive_written,arena", [(True, False), (False, False),
                                                  (True, True), (False, True)])
def test_budgeted_step_matches_the_unbudgeted_step(tmp_path, derive_written, arena):
    """A step built with a memory budget (planner's recompute decisions, early release,
    replays: apply_saved norms, RoPE, SwiGLU, matmuls) gives the unbudgeted step's loss and
    gradients within bf16 noise, eagerly and as CUDA-graph replays; on the arena too, whose
    saved records then hold only what each run keeps."""
    from runtime.cuda.step import TrainStep

    _hf_checkpoint(tmp_path)
    tokens = _tokens().cuda()
    budget = _budget_between(derive_written, 0.2)
    steps = [TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, derive_written=derive_written,
                                   **options)
             for options in ({"arena": False}, {"memory_budget": budget, "arena": arena})]
    plain, budgeted = steps
    assert plain.decisions is None and budgeted.decisions is not None
    _load_all(steps, tmp_path, tokens)
    grads_a, grads_b, _ = _budgeted_matches_plain(steps, tokens, budget, warmup=2)
    assert budgeted.swaps_kept == 0
    assert max(_rel(grads_b[p], grads_a[p]) for p in grads_a) < 3e-2


def _budgeted_matches_plain(steps, tokens, budget: int, warmup: int):
    """(plain step, budgeted step) with their batch set: the budgeted run drops and
    recomputes (its counters count as it runs), loss within 1e-3, every gradient cosine
    >= 0.999, the predicted peak within `budget`, and after capture four replays' losses
    within 5e-3. (plain grads, budgeted grads, each step's replay losses)."""
    (loss_a, grads_a), (loss_b, grads_b) = (s.loss_and_gradients() for s in steps)
    counts = steps[1].decisions.counts
    assert counts["dropped"] > 0 and counts["recomputed"] > 0, counts
    assert abs(float(loss_a) - float(loss_b)) / float(loss_a) < 1e-3
    assert grads_a.keys() == grads_b.keys()
    worst = min((_cos(grads_b[p], grads_a[p]), p) for p in grads_a)
    assert worst[0] >= 0.999, worst
    predicted = steps[1].predicted_peak()
    assert predicted is not None and predicted <= budget
    for s in steps:
        s.capture(warmup=warmup)
    losses = [[float(s(tokens)) for _ in range(4)] for s in steps]
    for a, b in zip(*losses):
        assert abs(a - b) / abs(a) < 5e-3, losses
    return grads_a, grads_b, losses


@pytest.mark.parametrize("share,arena", [(0.2, False), (0.9, False), (0.2, True)])
def test_swapped_step_matches_the_unbudgeted_step(tmp_path, share, arena):
    """A budget planned on the h200 profile (swaps allowed): the planned swaps run on the
    copy stream through pinned host buffers (runtime/cuda/swaps.py), and the loss and
    gradients are the unbudgeted step's, eagerly and as CUDA-graph replays (on the arena
    too)."""
    from runtime.cuda.step import TrainStep

    _hf_checkpoint(tmp_path)
    tokens = _tokens().cuda()
    budget = _budget_between(True, share, "h200")
    steps = [TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, derive_written=True,
                                   **options)
             for options in ({"arena": False}, {"memory_budget": budget, "plan_device": "h200",
                                                "arena": arena})]
    _load_all(steps, tmp_path, tokens)
    (loss_a, grads_a), (loss_b, grads_b) = (s.loss_and_gradients() for s in steps)
    counts = steps[1].decisions.counts
    # a swapped value the backward reads through another view of its storage stays out
    assert 0 < counts["swapped_in"] <= counts["swapped_out"], counts
    assert steps[1].swaps_kept == 0
    assert abs(float(loss_a) - float(loss_b)) / float(loss_a) < 1e-3
    worst = min((_cos(grads_b[p], grads_a[p]), p) for p in grads_a)
    assert worst[0] >= 0.999, worst
    for s in steps:
        s.capture(warmup=2)
    losses = [[float(s(tokens)) for _ in range(4)] for s in steps]
    for a, b in zip(*losses):
        assert abs(a - b) / abs(a) < 5e-3, losses


# ------------------------------------------------------------------ LoRA
LORA = dict(rank=8, alpha=16, targets=["q", "k", "v", "o", "gate", "up", "down"])


def _lora_step(tmp_path):
    """A LoRA step on the small Llama from an HF checkpoint, and the fp32 CPU model with
    the same weights (adapters' B made nonzero, so that A's gradients mean something)."""
    from runtime.cuda.step import TrainStep
    from runtime.model import Model

    _hf_checkpoint(tmp_path)
    model = Model.from_module(LLAMA, settings=SMALL, hf_weights=tmp_path, lora=LORA,
                              dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for p, t in model.params.items():
        if p.endswith("lora_B"):
            t.copy_(0.02 * torch.randn(t.shape, generator=g))
    step = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, lora=LORA)
    return step.load(model.params), model


def test_lora_step_matches_the_cpu_reference_and_keeps_the_base_frozen(tmp_path):
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import next_token_labels
    from runtime.interpreter import Interpreter
    from runtime.lora import adapter_params

    step, model = _lora_step(tmp_path)
    adapters = set(adapter_params(model))
    frozen = set(model.params) - adapters
    assert set(step.masters) == set(step.exp_avg) == set(step.names) == adapters
    _assert_one_gemm_slots_held(step)
    assert set(step.compute) == set(model.params)
    tokens = _tokens()
    step.set_batch(tokens.cuda())
    loss, grads = step.loss_and_gradients()
    run = Interpreter(step.program.graph, model.params, torch.float32)
    (logits,), frame = run.forward([tokens])
    ref_loss, d_logits = logits_cross_entropy(logits, next_token_labels(tokens))
    _, ref = run.backward(frame, [d_logits])
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-2
    assert set(grads) == set(ref) == adapters
    worst = min((_cos(grads[p].float().cpu(), ref[p]), p) for p in ref)
    assert worst[0] >= 0.999, worst
    base = {p: step.compute[p].clone() for p in frozen}
    step.adamw.lr = 1e-3
    losses = [float(step(tokens.cuda())) for _ in range(3)]
    step.capture(warmup=1)
    losses += [float(step(tokens.cuda())) for _ in range(6)]
    assert losses[-1] < 0.95 * losses[0], losses  # H200: 6.29 -> 5.83 (rank 8, lr 1e-3)
    assert all(torch.equal(step.compute[p], base[p]) for p in frozen)  # bit-identical
    assert int(step.step_count.item()) == 10


def test_lora_step_takes_block_diagonal_B_from_its_slot(tmp_path, monkeypatch):
    """The fused projections' block-diagonal B (q/k/v's, gate/up's) is kept in a slot the
    step holds, written at the step's start with the other slots (runtime/cuda/
    stacked_blocks.py `block_slot`): each layer's two are there after the first step, a
    refresh writes block_diag of the parameters into them bit for bit, and the eager and
    captured steps' losses are those of steps that run block_diag
    (MODULEC_BLOCK_SLOTS=0)."""
    from runtime.cuda import slot_refresh

    tokens, losses = _tokens().cuda(), {}
    for on in ("1", "0"):
        monkeypatch.setenv("MODULEC_BLOCK_SLOTS", on)
        step, _ = _lora_step(tmp_path)
        step.adamw.lr = 1e-3
        losses[on] = [float(step(tokens)) for _ in range(2)]
        step.capture(warmup=1)
        losses[on] += [float(step(tokens)) for _ in range(3)]
        blocks = step.sides.get("blocks", {})
        if on == "0":
            assert not blocks
            continue
        assert len(blocks) == 2 * SMALL["n_layers"]
        parts = [step.compute[f"blocks[0].attention.qkv_weight.{p}.lora_B"] for p in "qkv"]
        slot = next(s for key, s in blocks.items() if parts[0].data_ptr() in key)
        slot.zero_()  # a refresh writes the blocks alone: the zeros are made once
        slot_refresh.refresh([slot])
        slot_refresh.finish()
        assert torch.equal(slot, torch.block_diag(*parts))
    for a, b in zip(losses["1"], losses["0"]):
        assert abs(a - b) / abs(a) < 2e-3, losses


@pytest.mark.parametrize("arena", [False, True])
def test_budgeted_lora_step_matches_the_unbudgeted_lora_step(tmp_path, arena):
    """`--memory-budget` with `--lora`: the LoRA step built with a budget (the planner's
    recompute decisions over the adapted projections, the one-GEMM paths beside them)
    gives the unbudgeted LoRA step's loss and adapter gradients within bf16 noise, eagerly
    and as CUDA-graph replays, and its predicted peak is within the budget."""
    from runtime.cuda.step import TrainStep

    plain, model = _lora_step(tmp_path)
    budget = _budget_between(False, 0.2, lora=LORA)
    budgeted = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, lora=LORA,
                                     memory_budget=budget, arena=arena).load(model.params)
    assert plain.decisions is None and budgeted.decisions is not None
    tokens = _tokens().cuda()
    steps = (plain, budgeted)
    for s in steps:
        s.adamw.lr = 1e-3
        s.set_batch(tokens)
    grads, _, losses = _budgeted_matches_plain(steps, tokens, budget, warmup=1)
    assert all("lora_" in p for p in grads)
    assert losses[1][-1] < losses[1][0], losses


def _assert_one_gemm_slots_held(step):
    """Every side slot and tail slot the step laid is still registered (held by the step:
    lora_kcat keeps weak references), a weight with both too (down_proj here, d_ff 2 d)."""
    import runtime.cuda.lora_kcat as kcat

    sides, tails = step.sides["sides"], step.sides["tails"]
    assert sides and tails and set(sides) & set(tails)
    for path, slot in sides.items():
        assert kcat.side_of(step.compute[path], slot.shape[1]) is slot
    for path, slot in tails.items():
        assert kcat._tails[kcat.view_key(step.compute[path])]() is slot


def test_lora_step_holds_less_than_full_training(tmp_path):
    """Peak GPU memory of steps with and without LoRA on the same small model."""
    from runtime.cuda.step import TrainStep

    peaks = {}
    for lora in (None, LORA):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step = TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T, lora=lora).init_random(0)
        for _ in range(2):
            step(_tokens().cuda())
        torch.cuda.synchronize()
        peaks[lora is not None] = torch.cuda.max_memory_allocated() - before
        del step
    assert peaks[True] < peaks[False], peaks


# ====================================================================== hooks on the GPU
def test_hooks_run_in_eager_gpu_steps_and_refuse_capture(tmp_path):
    """observe sees every layer's value on the GPU; a modify hook that zeroes layer 1's MLP
    activation changes the loss; capturing a step with hooks is refused."""
    from runtime.cuda.step import TrainStep
    from runtime.errors import RuntimeUserError

    def fresh():
        return TrainStep.from_module(LLAMA, SMALL, batch=B, seq=T).init_random(0)

    tokens = _tokens().cuda()
    plain = float(fresh()(tokens))
    step, seen = fresh(), []
    step.use_hooks().observe("AfterMLPActivation",
                             lambda t, ctx: seen.append((ctx.layer, t.is_cuda, tuple(t.shape))))
    observed = float(step(tokens))
    assert observed == pytest.approx(plain, rel=1e-6)  # observing changes nothing
    assert [layer for layer, *_ in seen] == [0, 1] and all(cuda for _, cuda, _ in seen)
    with pytest.raises(RuntimeUserError, match="captured CUDA graph"):
        step.capture()
    zeroed = fresh()
    zeroed.use_hooks().modify("AfterMLPActivation", lambda t, ctx: t.zero_(), layers=1)
    assert abs(float(zeroed(tokens)) - plain) > 1e-4
    with pytest.raises(RuntimeUserError, match="no hook point"):
        fresh().use_hooks().observe("AfterMLPActivaton", lambda t, ctx: None)


# ============================================================= Qwen3: fused QK-norm + RoPE
QWEN3 = "std/models/qwen3.module"
QWEN3_SMALL = dict(SMALL, head_dim=64, rope_theta=1000000.0, eps=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_step_runs_qk_norm_rope_as_one_kernel_each_way(monkeypatch, dtype):
    """Each layer's QK-norm + RoPE is one qk_norm_rope launch forward and one backward: the
    custom kernel takes the step's strided q / k and gradients (no reference fallback).
    The step's loss and gradients match the CPU reference (float32: 1e-4; bf16: loss 1e-2,
    every gradient's cosine >= 0.999)."""
    import collections

    from runtime.cuda import kernels as cuda_kernels
    from runtime.cuda.lm_head import logits_cross_entropy
    from runtime.cuda.step import TrainStep, next_token_labels
    from runtime.interpreter import Interpreter

    calls, real = collections.Counter(), cuda_kernels._extension

    class Counting:  # the extension, counting the qk_norm_rope launches
        def __getattr__(self, name):
            fn = getattr(real(), name)
            if not name.startswith("qk_norm_rope"):
                return fn

            def counted(*args):
                calls[name] += 1
                return fn(*args)
            return counted

    monkeypatch.setattr(cuda_kernels, "_extension", Counting)
    step = TrainStep.from_module(QWEN3, QWEN3_SMALL, batch=B, seq=T, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    params = {p: torch.randn(s, generator=g) * 0.05 + (1.0 if len(s) == 1 else 0.0)
              for p, s in step.shapes().items()}  # norm weights (1-D) near 1
    step.load({p: v.cuda() for p, v in params.items()})
    tokens = _tokens()
    step.set_batch(tokens.cuda())
    loss, grads = step.loss_and_gradients()
    layers = QWEN3_SMALL["n_layers"]
    assert calls == {"qk_norm_rope_forward": layers, "qk_norm_rope_backward": layers}
    run = Interpreter(step.program.graph, params, torch.float32)
    (logits,), frame = run.forward([tokens])
    ref_loss, d_logits = logits_cross_entropy(logits, next_token_labels(tokens))
    _, ref_grads = run.backward(frame, [d_logits])
    assert grads.keys() == ref_grads.keys()
    if dtype == torch.float32:
        assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-4
        for path, ref in ref_grads.items():
            assert _rel(grads[path].float().cpu(), ref) < 1e-4, path
    else:
        assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-2
        worst = min((_cos(grads[p].float().cpu(), ref), p) for p, ref in ref_grads.items())
        assert worst[0] >= 0.999, worst
