"""The CUDA RoPE kernels (csrc/kernels/rope.cu, qk_norm_rope.cu) with scaled frequencies,
attention scaling, partial rotary and interleaved pairs (issue 18 item 1), against the
reference kernels (runtime/kernels/attention.py, themselves checked against transformers
in tests/test_rope_variants.py), fp32 and bf16: contiguous heads, the strided heads of a
fused QKV projection, in place, and the training registry's backward into the head slots.
CPU-only checks here run everywhere; the rest need a GPU (`-m cuda`)."""

from __future__ import annotations

import pytest

from kernel_testing import assert_close

torch = pytest.importorskip("torch")

from runtime.cuda.kernels import CUDA_KERNELS  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
M = 64
VARIANTS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "default": {},
}


def attrs_of(name, D, partial=1.0, interleaved=False):
    attrs = {"theta": 10000.0, "max_position_embeddings": M, "partial_rotary_factor": partial,
             "interleaved": interleaved, **VARIANTS[name]}
    if name == "longrope":
        n = (int(D * partial) + 1) // 2
        attrs["short_factor"] = [1.0 + 0.1 * i for i in range(n)]
        attrs["long_factor"] = [2.0 + 0.5 * i for i in range(n)]
    return attrs


def rand(*shape, dtype):
    return torch.randn(*shape, device="cuda").to(dtype)


def fused_qkv_case(case, dtype):
    """(attrs, qkv [B, T, Hq + 2 Hk, D], q and k as its transposed head views, position
    ids) for a (B, Hq, Hkv, T, D, variant, partial, interleaved) case."""
    B, Hq, Hk, T, D, name, partial, interleaved = case
    qkv = rand(B, T, Hq + 2 * Hk, D, dtype=dtype)
    q, k, _ = (x.transpose(1, 2) for x in qkv.split([Hq, Hk, Hk], dim=2))
    pos = torch.randint(0, 40, (B, T), device="cuda", dtype=torch.int32)
    return attrs_of(name, D, partial, interleaved), qkv, q, k, pos


# (B, Hq, Hkv, T, D, variant, partial, interleaved). D=128/64 with whole vectors take the
# vector path; D=72 at 0.5 (n = 18: bf16's 8 does not divide it) and D=20 the scalar path;
# partial 0.25 of 64 leaves 48 pass-through channels to copy; interleaved with both.
CASES = [
    (2, 4, 2, 16, 128, "llama3", 1.0, False), (2, 4, 2, 16, 128, "yarn", 1.0, False),
    (1, 8, 8, 9, 64, "dynamic", 1.0, False), (2, 3, 1, 7, 64, "longrope", 1.0, False),
    (2, 4, 2, 16, 64, "default", 0.25, False), (1, 5, 1, 9, 72, "linear", 0.5, False),
    (2, 4, 2, 16, 128, "default", 1.0, True), (2, 4, 4, 8, 64, "yarn", 0.5, True),
    (1, 2, 1, 5, 20, "llama3", 0.5, True), (1, 3, 1, 5, 20, "default", 1.0, True),
]


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_rope_variants_match_the_reference(case, dtype):
    torch.manual_seed(11)
    B, Hq, Hkv, T, D, name, partial, interleaved = case
    attrs = attrs_of(name, D, partial, interleaved)
    for top in (12, 200):  # positions within and past max_position_embeddings
        pos = torch.randint(0, top, (B, T), device="cuda", dtype=torch.int32)
        q, k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype)
        kernel = CUDA_KERNELS["rope"]
        assert kernel.covers_forward([q, k, pos])
        got = kernel.forward([q, k, pos], dict(attrs))
        want = KERNELS["rope"].forward([q, k, pos], dict(attrs))
        assert_close(got, want, TOL[dtype] * (8 if top > M else 1), f"rope {case} {dtype}")
        got_b = kernel.backward([q, k, pos], dict(attrs))
        want_b = KERNELS["rope"].backward([q, k, pos], dict(attrs))
        assert_close(got_b, want_b, TOL[dtype] * (8 if top > M else 1), f"rope bwd {case}")
    got = kernel.forward([q, k, None], dict(attrs))  # positions 0 .. T-1
    assert_close(got, KERNELS["rope"].forward([q, k, None], dict(attrs)), TOL[dtype], "no pos")


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 4, 2, 16, 64, "llama3", 0.5, False),
                                  (1, 6, 2, 9, 64, "yarn", 1.0, True),
                                  (2, 3, 1, 5, 72, "default", 0.5, True)])
def test_rope_variants_on_the_heads_of_a_fused_qkv_and_in_place(case, dtype):
    """q / k as the transposed heads of [B, T, Hq + 2 Hk, D]; out of place (the pass-through
    channels copied), in place (left as they are), and the training registry's backward
    into the head slots of the fused QKV gradient."""
    from runtime.cuda.kernels import _extension, rope_args
    from runtime.cuda.train_kernels import TRAIN_KERNELS

    torch.manual_seed(12)
    B, Hq, Hk, T, D, name, partial, interleaved = case
    attrs, qkv, q, k, pos = fused_qkv_case(case, dtype)
    want = KERNELS["rope"].forward([q, k, pos], dict(attrs))
    got = CUDA_KERNELS["rope"].forward([q, k, pos], dict(attrs))
    assert_close(got, want, TOL[dtype], f"strided rope {case}")
    d_out = rand(B, T, Hq + 2 * Hk, D, dtype=dtype)
    d_q, d_k, _ = (x.transpose(1, 2) for x in d_out.split([Hq, Hk, Hk], dim=2))
    got = TRAIN_KERNELS["rope"].backward([d_q, d_k, pos], dict(attrs))
    assert_close(got, KERNELS["rope"].backward([d_q, d_k, pos], dict(attrs)), TOL[dtype],
                 f"rope backward into heads {case}")
    before = q.clone()
    _extension().rope_inplace(q, pos, *rope_args(attrs, q, pos), False)
    assert_close([q], [want[0]], TOL[dtype], "in place")
    R = 2 * ((int(D * partial) + 1) // 2)
    assert torch.equal(q[..., R:], before[..., R:])


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["llama3", "yarn", "longrope"])
def test_qk_norm_rope_with_scaled_frequencies(name, dtype):
    """The fused kernel (full rotate-half) with llama3 / yarn (cos, sin scaled) / longrope
    frequencies: forward and backward as the reference's."""
    torch.manual_seed(13)
    B, Hq, Hk, T, D = 2, 4, 2, 16, 128
    attrs = dict(attrs_of(name, D), eps=1e-6)
    q, k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hk, T, D, dtype=dtype)
    qw, kw = rand(D, dtype=dtype), rand(D, dtype=dtype)
    pos = torch.randint(0, 40, (B, T), device="cuda", dtype=torch.int32)
    kernel = CUDA_KERNELS["qk_norm_rope"]
    assert kernel.covers_forward([q, k, qw, kw, pos])
    got = kernel.forward([q, k, qw, kw, pos], dict(attrs))
    want = KERNELS["qk_norm_rope"].forward([q, k, qw, kw, pos], dict(attrs))
    assert_close(got, want, TOL[dtype], f"qk_norm_rope {name} {dtype}")
    d_q, d_k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hk, T, D, dtype=dtype)
    inputs = [d_q, d_k, q, k, qw, kw, want[2], want[3], pos]
    assert_close(kernel.backward(inputs, dict(attrs)),
                 KERNELS["qk_norm_rope"].backward(inputs, dict(attrs)), TOL[dtype],
                 f"qk_norm_rope backward {name} {dtype}")


# (B, Hq, Hk, T, D, partial, interleaved): vector path (bf16: n and the pass-through pairs
# whole vectors of 8 at D=128, 0.25 and 0.5), the scalar path (D=72 at 0.5: n = 18; D=20),
# interleaved with and without a pass-through part
QK_CASES = [(2, 4, 2, 16, 128, 0.5, False), (1, 3, 1, 9, 128, 0.25, False),
            (2, 4, 2, 8, 64, 1.0, True), (1, 5, 1, 7, 128, 0.5, True),
            (2, 3, 1, 5, 72, 0.5, False), (1, 2, 1, 5, 20, 0.5, True)]


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", QK_CASES)
def test_qk_norm_rope_partial_and_interleaved(case, dtype):
    """The fused kernel with partial rotary (the pass-through channels normalized, not
    rotated) and interleaved pairs, contiguous and on the heads of a fused QKV; the
    backward bitwise repeatable."""
    from runtime.cuda.train_kernels import TRAIN_KERNELS

    torch.manual_seed(14)
    B, Hq, Hk, T, D, partial, interleaved = case
    attrs = dict(attrs_of("yarn", D, partial, interleaved), eps=1e-6)
    qkv = rand(B, T, Hq + 2 * Hk, D, dtype=dtype)
    q, k, _ = (x.transpose(1, 2) for x in qkv.split([Hq, Hk, Hk], dim=2))
    qw, kw = rand(D, dtype=dtype), rand(D, dtype=dtype)
    pos = torch.randint(0, 40, (B, T), device="cuda", dtype=torch.int32)
    kernel = CUDA_KERNELS["qk_norm_rope"]
    for a, b in ((q, k), (q.contiguous(), k.contiguous())):
        assert kernel.covers_forward([a, b, qw, kw, pos])
        want = KERNELS["qk_norm_rope"].forward([a, b, qw, kw, pos], dict(attrs))
        assert_close(kernel.forward([a, b, qw, kw, pos], dict(attrs)), want, TOL[dtype],
                     f"qk_norm_rope {case} {dtype}")
        d_q, d_k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hk, T, D, dtype=dtype)
        inputs = [d_q, d_k, a, b, qw, kw, want[2], want[3], pos]
        ref = KERNELS["qk_norm_rope"].backward(inputs, dict(attrs))
        first, again = kernel.backward(inputs, dict(attrs)), kernel.backward(inputs, dict(attrs))
        assert all(torch.equal(x, y) for x, y in zip(first, again))
        assert_close(first, ref, TOL[dtype], f"qk_norm_rope backward {case} {dtype}")
        assert_close(TRAIN_KERNELS["qk_norm_rope"].backward(inputs, dict(attrs)), ref,
                     TOL[dtype], f"qk_norm_rope backward into heads {case} {dtype}")


@needs_gpus(1)
def test_length_dependent_frequencies_take_no_host_read_under_capture():
    """dynamic with position_ids: the frequencies are computed on the device, so a CUDA
    graph captures the call and its replay follows new positions."""
    attrs = attrs_of("dynamic", 64)
    q, k = rand(1, 2, 8, 64, dtype=torch.float32), rand(1, 1, 8, 64, dtype=torch.float32)
    pos = torch.arange(8, device="cuda", dtype=torch.int32)[None].contiguous()
    kernel = CUDA_KERNELS["rope"]
    kernel.forward([q, k, pos], dict(attrs))  # warm-up: the tables cached
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.forward([q, k, pos], dict(attrs))
    pos.copy_(torch.arange(8, device="cuda", dtype=torch.int32)[None] * 30)  # past M
    graph.replay()
    assert_close(out, KERNELS["rope"].forward([q, k, pos], dict(attrs)), 1e-4, "replayed")


def test_rope_args_cover_every_variant_on_the_cpu():
    """The wrapper's frequency vector: fp32, n = rotated channels / 2, the scale a float."""
    from runtime.cuda.kernels import rope_args

    x = torch.zeros(1, 1, 5, 64)
    for name in VARIANTS:
        for partial, inter in ((1.0, False), (0.5, True)):
            inv_freq, scale, interleaved = rope_args(attrs_of(name, 64, partial, inter), x, None)
            assert inv_freq.dtype == torch.float32 and inv_freq.shape == (int(64 * partial) // 2,)
            assert isinstance(scale, float) and interleaved is inter


SCALED_MODELS = {  # std models with scaled RoPE: the unfused rope and the fused qk_norm_rope
    "llama_llama3": ("std/models/llama.module",
                     {"rope_type": '"llama3"', "rope_factor": "8.0", "rope_low_freq_factor": "1.0",
                      "rope_high_freq_factor": "4.0", "rope_original_max_seq": "16"}),
    "qwen3_yarn": ("std/models/qwen3.module",
                   {"head_dim": "8", "rope_type": '"yarn"', "rope_factor": "4.0",
                    "rope_original_max_seq": "16"}),
}


@needs_gpus(1)
@pytest.mark.parametrize("name", sorted(SCALED_MODELS))
def test_fp32_step_with_scaled_rope_matches_the_cpu_reference(name):
    """One fp32 training step on the GPU (in-place rope / fused qk_norm_rope with the
    scaled table) against the CPU interpreter on the same weights and batch."""
    from runtime.cuda.step import TrainStep
    from runtime.model import Model
    from runtime_models import DENSE, token_inputs
    from test_cuda_models import _reference, _rel

    path, extra = SCALED_MODELS[name]
    settings = DENSE | extra
    model = Model.from_module(path, settings=settings, dtype=torch.float32).init_random(seed=1)
    tokens = token_inputs(model, batch=2, seq=16)["token_ids"]
    step = TrainStep.from_module(path, settings, batch=2, seq=16, dtype=torch.float32)
    step.load(model.params)
    step.set_batch(tokens.cuda())
    loss, grads = step.loss_and_gradients()
    ref_loss, ref_grads = _reference(step, dict(model.params), tokens)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 1e-4
    worst = max((_rel(grads[p].float().cpu(), g), p) for p, g in ref_grads.items())
    assert worst[0] < 1e-4, worst


HF_SCALED = {  # name: (module, HF config class, model class, HF config, our settings)
    "llama3": ("std/models/llama.module", "LlamaConfig", "LlamaForCausalLM",
               dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=512,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                     "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32}),
               dict(d_model=256, n_layers=2, num_heads=8, num_kv_heads=2, d_ff=512,
                    rope_theta=500000.0, rope_type='"llama3"', rope_factor=8.0,
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_max_seq=32)),
    "qwen3_yarn": ("std/models/qwen3.module", "Qwen3Config", "Qwen3ForCausalLM",
                   dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32, intermediate_size=512,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0,
                                         "factor": 4.0, "original_max_position_embeddings": 32}),
                   dict(d_model=256, n_layers=2, num_heads=8, num_kv_heads=2, head_dim=32,
                        d_ff=512, rope_type='"yarn"', rope_factor=4.0, rope_original_max_seq=32)),
}


@needs_gpus(1)
@pytest.mark.parametrize("name", sorted(HF_SCALED))
def test_bf16_step_with_scaled_rope_matches_transformers(name, tmp_path):
    """One bf16 GPU training step of std Llama (llama3 rope) and Qwen3 (yarn, cos/sin scaled,
    through the fused qk_norm_rope) against transformers in bf16 on the same weights and
    batch: loss within 1e-2 relative, every gradient's cosine >= 0.999."""
    from tests.bf16_parity import cosine, hf_loss_and_gradients, step_gradients
    from tests.bf16_parity import tiny_hf_checkpoint

    path, config_class, model_class, config, settings = HF_SCALED[name]
    B, T, vocab = 2, 128, 512
    hf = tiny_hf_checkpoint(tmp_path, config_class, model_class, vocab_size=vocab,
                            max_position_embeddings=T, **config).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(7),
                           dtype=torch.int32)
    loss, ours = step_gradients(path, dict(settings, vocab_size=vocab, max_seq=T), tmp_path,
                                tokens)
    hf_loss, hf_grads = hf_loss_and_gradients(hf, tokens)
    assert abs(loss - hf_loss) / hf_loss < 1e-2
    assert ours.keys() == hf_grads.keys()
    worst = min((cosine(ours[n], hf_grads[n]), n) for n in ours)
    assert worst[0] >= 0.999, worst


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 4, 2, 16, 64, "default", 1.0, False),
                                  (1, 32, 8, 64, 128, "llama3", 1.0, False),
                                  (2, 6, 2, 8, 64, "yarn", 0.5, True),
                                  (1, 5, 1, 8, 36, "default", 0.5, False)])
def test_q_and_k_in_one_launch_as_each_alone(case, dtype):
    """`rope_pair` (q and k in one launch: the grid's head groups, q's then k's) writes what
    two `rope` calls write, bit for bit: in place over the strided heads of a fused QKV
    projection, and into given outputs (the pass-through channels copied); odd head
    counts (5 and 1: the grid's split between q's and k's head groups), and an unaligned
    head dim (36, the scalar path)."""
    from runtime.cuda.kernels import _extension, rope_args

    torch.manual_seed(14)
    B, Hq, Hk, T, D, name, partial, interleaved = case
    attrs, qkv, q, k, pos = fused_qkv_case(case, dtype)
    ext, args = _extension(), rope_args(attrs, q, pos)
    for inverse in (False, True):
        want = [ext.rope(x, pos, *args, inverse) for x in (q, k)]
        outs = [torch.full_like(w, 7.0) for w in want]
        got = ext.rope_pair(q, k, pos, *args, inverse, outs)
        assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, outs))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (case, inverse)
    before = qkv.clone()
    want = [ext.rope(x, pos, *args, False) for x in (q, k)]
    ext.rope_pair(q, k, pos, *args, False)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    assert torch.equal(qkv[:, :, Hq + Hk:], before[:, :, Hq + Hk:])  # v untouched
