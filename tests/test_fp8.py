"""FP8 recipes (issue 19 item 1, decisions.md "FP8 recipes"): the recipe as IR data
(metadata.precision, checked by `ir verify`), the CPU reference's FP8 emulation (rounding
against torch's float8 casts and by hand, saturation, subnormals, NaN; current and delayed
scaling), a tiny Llama training with the std recipe, the amax histories through a
checkpoint, and what the GPU step refuses (its FP8 GEMMs: tests/test_fp8_gemm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from modulec.lower.build import BuildRequest, build  # noqa: E402
from modulec.lower.fp8_recipe import section_problems  # noqa: E402
from runtime.errors import RuntimeUserError  # noqa: E402
from runtime.fp8 import (GPU_REFUSAL, Fp8State, quantize, quantize_blocks,  # noqa: E402
                         refuse_on_gpu, scale_for)
from tests.dist_testing import needs_gpus  # noqa: E402

TINY = {"vocab_size": "64", "d_model": "32", "n_layers": "2", "num_heads": "4",
        "num_kv_heads": "2", "d_ff": "48"}
RECIPE_FILE = """\
recipe Hybrid:
  forward_activation_dtype: fp8_e4m3
  backward_gradient_dtype: fp8_e5m2
  scaling_strategy: delayed
  amax_history_len: 4
{extra}
module Proj(C: int):
  @recipe(Hybrid)
  params:
    w: [C, C]
  forward:
    in: x: [B, C]
    out: y: [B, C]
    graph:
      x -> matmul(w, transpose=NT) -> y

model M(C: int = 4, V: int = 8):
  params:
    p: Proj(C)
    head: [V, C]
  forward:
    in: x: [B, C]
    out: logits: [B, V]
    graph:
      x -> p -> h
      h -> matmul(head, transpose=NT) -> logits
"""


def built(tmp_path, extra=""):
    path = tmp_path / "m.module"
    path.write_text(RECIPE_FILE.format(extra=extra))
    return build(BuildRequest(path, shapes={"B": 2}))


# ====================================================================== the IR
def test_a_recipe_on_a_module_covers_its_matmuls_and_ir_verify_checks_them(tmp_path):
    result = built(tmp_path)
    section = result.document["metadata"]["precision"]
    assert section["recipe"]["scaling"] == {"kind": "delayed", "margin": 0, "history_len": 4}
    assert section["recipe"]["forward"] == "fp8_e4m3"
    assert section["recipe"]["gradient"] == "fp8_e5m2"
    assert section["recipe"]["granularity"] == {"kind": "per_tensor"}
    assert [(m["function"], m["role"], m["operands"]) for m in section["matmuls"]] == [
        ("Proj#1", "forward", ["forward", "forward"]),
        ("Proj#1.backward", "backward", ["gradient", "forward", "forward"])]
    assert section["high_precision"] == []  # the model's head is not under the recipe
    assert section_problems(section, result.graph) == []
    broken = dict(section, matmuls=section["matmuls"] + [{"function": "M#1", "op": "nope"}])
    assert "not a matmul of the graph" in section_problems(broken, result.graph)[0]
    bad = dict(section, recipe=dict(section["recipe"], gradient="bf16"))
    assert section_problems(bad, result.graph) == \
        ["metadata: `precision.recipe`: `gradient` is not an FP8 format"]


def test_a_bad_recipe_setting_is_e008(tmp_path):
    result = built(tmp_path, "  granularity: per_row\n  amax_margn: 1\n")
    messages = [d.message for d in result.diagnostics if d.code == "E008"]
    assert any("`granularity` takes one of per_tensor, per_block" in m for m in messages)
    assert any("unknown setting `amax_margn`" in m for m in messages)
    assert result.document is None


def test_a_recipe_setting_without_effect_yet_is_w006(tmp_path):
    result = built(tmp_path, "  weight_storage_dtype: bf16\n  high_precision: [embedding]\n")
    warned = [d.message for d in result.diagnostics if d.code == "W006"]
    assert "recipe setting `weight_storage_dtype` has no effect yet" in warned
    assert any("embeddings and the loss stay in high precision" in m for m in warned)
    assert result.document["metadata"]["precision"]["recipe"]["high_precision"] == \
        ["embedding"]


def test_per_block_granularity_takes_current_scaling(tmp_path):
    result = built(tmp_path, "  granularity: per_block\n")  # with the delayed strategy
    assert any("per-block scaling takes each block's own amax" in d.message
               for d in result.diagnostics if d.code == "E008")
    path = tmp_path / "m.module"
    path.write_text(RECIPE_FILE.format(extra="  granularity: per_block\n").replace(
        "scaling_strategy: delayed", "scaling_strategy: current"))
    recipe = build(BuildRequest(path, shapes={"B": 2})).document["metadata"]["precision"][
        "recipe"]
    assert recipe["granularity"] == {"kind": "per_block", "activation": [1, 128],
                                     "weight": [128, 128], "gradient": [1, 128]}
    assert recipe["scaling"] == {"kind": "current", "margin": 0}


def test_std_recipe_on_llama_keeps_the_lm_head_in_high_precision():
    result = build(BuildRequest(Path("std/models/llama.module"), settings=TINY,
                                precision="fp8"))
    section = result.document["metadata"]["precision"]
    assert section["recipe"]["name"] == "std.FP8"
    assert [h["why"] for h in section["high_precision"]] == ["lm_head", "lm_head"]
    forward = [m for m in section["matmuls"] if m["role"] == "forward"]
    assert len(forward) == 4  # qkv, o, gate_up, down: one function per block kind
    # std's written backwards recompute no matmul (the MLP recomputes its activation only)
    assert {m["role"] for m in section["matmuls"]} == {"forward", "backward"}
    assert section_problems(section, result.graph) == []


RECOMPUTING = """\
recipe Hybrid:
  forward_activation_dtype: fp8_e4m3
  backward_gradient_dtype: fp8_e5m2

model M(C: int = 16):
  @recipe(Hybrid)
  params:
    w: [C, C]
    v: [C, C]
  forward:
    in: x: [B, C]
    out: y: [B, C]
    graph:
      x -> matmul(w, transpose=NT) -> h
      h -> matmul(v, transpose=NT) -> y
    save: [x]
    recompute: [h]
  backward:
    graph:
      recompute:
        saved.x -> matmul(w, transpose=NT) -> h
      (d_y, v) -> matmul(transpose=NN) -> d_h
      (d_y, h) -> matmul(transpose=TN) -> d_v
      (d_h, w) -> matmul(transpose=NN) -> d_x
      (d_h, saved.x) -> matmul(transpose=TN) -> d_w
"""


def test_a_written_backwards_recomputed_matmul_takes_the_forward_format(tmp_path):
    path = tmp_path / "m.module"
    path.write_text(RECOMPUTING)
    result = build(BuildRequest(path, shapes={"B": 2}))
    section = result.document["metadata"]["precision"]
    recomputed = [m for m in section["matmuls"] if m["role"] == "recompute"]
    assert [m["operands"] for m in recomputed] == [["forward", "forward"]]
    assert section_problems(section, result.graph) == []


# ====================================================================== the rounding
@pytest.mark.parametrize("fmt, dtype", [("fp8_e4m3", torch.float8_e4m3fn),
                                        ("fp8_e5m2", torch.float8_e5m2)])
def test_rounding_matches_torchs_float8_casts_in_range(fmt, dtype):
    top = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[fmt]
    x = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(0)) * s
                   for s in (1e-3, 1.0, 30.0)]).clamp(-top, top)
    assert torch.equal(quantize(x, fmt, 1.0), x.to(dtype).to(torch.float32))


def test_hand_computed_e4m3_and_e5m2_values():
    e4m3 = lambda v: quantize(torch.tensor([v], dtype=torch.float64), "fp8_e4m3", 1.0).item()
    e5m2 = lambda v: quantize(torch.tensor([v], dtype=torch.float64), "fp8_e5m2", 1.0).item()
    # round to nearest even: 1.0625 is between 1.0 (mantissa 000) and 1.125 (001)
    assert e4m3(1.0625) == 1.0 and e4m3(1.1875) == 1.25 and e4m3(1.07) == 1.125
    # subnormals: E4M3's least is 2^-9, E5M2's 2^-16; half of it ties to 0 (even)
    assert e4m3(2 ** -9) == 2 ** -9 and e4m3(2 ** -10) == 0.0 and e4m3(3 * 2 ** -11) == 2 ** -9
    assert e5m2(2 ** -16) == 2 ** -16 and e5m2(2 ** -17) == 0.0 and e5m2(1.125) == 1.0
    # saturation at the largest finite value, infinities included; NaN stays NaN
    assert e4m3(448.0) == 448.0 and e4m3(500.0) == 448.0 and e4m3(-1e9) == -448.0
    assert e4m3(float("inf")) == 448.0 and e5m2(float("-inf")) == -57344.0
    assert e5m2(61440.0) == 57344.0 and e5m2(1e6) == 57344.0
    assert e4m3(float("nan")) != e4m3(float("nan"))
    # why the clamp: torch's E5M2 cast does not saturate (61440 rounds up to inf)
    assert torch.tensor([61440.0]).to(torch.float8_e5m2).float().isinf().item()


def test_scaled_quantize_divides_the_scale_back_out():
    x = torch.tensor([0.001, -0.002, 0.0035], dtype=torch.float64)
    scale = scale_for(0.0035, "fp8_e4m3")
    assert scale == 448.0 / 0.0035
    y = quantize(x, "fp8_e4m3", scale)
    assert y[2].item() == pytest.approx(0.0035, rel=1e-12)  # the amax maps to 448 exactly
    assert torch.allclose(y, x, rtol=2 ** -4)
    assert scale_for(0.0, "fp8_e4m3") == 1.0 and scale_for(float("inf"), "fp8_e5m2") == 1.0
    assert scale_for(2.0, "fp8_e5m2", margin=2) == 57344.0 / 2.0 / 4.0


def test_per_block_scaling_gives_each_tile_its_own_amax():
    x = torch.ones(2, 256, dtype=torch.float64)
    x[0, :128] *= 1e-4  # a tile of small values keeps its precision
    x[0, 5] = 3e-4
    y = quantize_blocks(x, "fp8_e4m3", (1, 128))
    assert y[0, 5].item() == pytest.approx(3e-4, rel=1e-12) and torch.equal(y[1], x[1])
    assert quantize_blocks(torch.randn(3, 200, dtype=torch.float64), "fp8_e4m3",
                           (128, 128)).shape == (3, 200)


# ====================================================================== the scaling state
def state(kind: str, history: int = 2) -> Fp8State:
    scaling = {"kind": kind, "margin": 0} | ({"history_len": history} if kind == "delayed"
                                             else {})
    return Fp8State({"recipe": {"scaling": scaling, "granularity": {"kind": "per_tensor"},
                                "forward": "fp8_e4m3", "gradient": "fp8_e5m2"},
                     "matmuls": []})


def test_delayed_scaling_uses_the_history_and_current_the_tensor():
    small, big = torch.full((4,), 2.0, dtype=torch.float64), \
        torch.full((4,), 100.0, dtype=torch.float64)
    delayed, current = state("delayed"), state("current")
    delayed.fake_quantize(big, "fp8_e4m3", "k", False)  # not recording: not in the history
    delayed.end_step()
    assert delayed.histories == {}
    delayed.recording = current.recording = True
    for s in (delayed, current):  # step 1: no history yet, both use the tensor's amax
        assert torch.equal(s.fake_quantize(small, "fp8_e4m3", "k", False), small)
        s.end_step()
    assert delayed.histories == {"k": [2.0]}
    # step 2: delayed scales by the history's amax 2 -> 100 saturates at 448 / (448 / 2)
    assert delayed.fake_quantize(big, "fp8_e4m3", "k", False).tolist() == [2.0] * 4
    assert current.fake_quantize(big, "fp8_e4m3", "k", False).tolist() == \
        pytest.approx([100.0] * 4, rel=1e-12)  # 100 * (448 / 100) / (448 / 100)
    delayed.end_step()
    assert delayed.histories == {"k": [2.0, 100.0]}
    delayed.fake_quantize(small, "fp8_e4m3", "k", False)  # step 3 scales by max(2, 100)
    delayed.end_step()
    delayed.fake_quantize(small, "fp8_e4m3", "k", False)
    delayed.end_step()
    assert delayed.histories == {"k": [2.0, 2.0]}  # the window keeps history_len steps
    restored = state("delayed")
    restored.load_state_dict(delayed.state_dict())
    assert restored.histories == delayed.histories


# ====================================================================== training
def test_the_gpu_step_takes_the_std_recipe_and_refuses_per_block_scaling():
    """The GPU step runs per-tensor recipes as FP8 GEMMs (tests/test_fp8_gemm.py); what it
    cannot run yet is refused when the program loads, never run in bf16."""
    metadata = build(BuildRequest(Path("std/models/llama.module"), settings=TINY,
                                  precision="fp8")).document["metadata"]
    refuse_on_gpu(metadata)  # the std recipe: per tensor, E4M3 x E4M3 / E5M2 x E4M3
    refuse_on_gpu({})  # without a recipe: nothing to refuse
    recipe = dict(metadata["precision"]["recipe"], granularity={"kind": "per_block"})
    with pytest.raises(RuntimeUserError, match=GPU_REFUSAL):
        refuse_on_gpu({"precision": dict(metadata["precision"], recipe=recipe)})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny HF Llama (vocab 64, d 32, 2 layers) and 2000 tokens."""
    return tiny_llama(tmp_path_factory.mktemp("fp8"))


def tiny_llama(folder, **sizes):
    transformers = pytest.importorskip("transformers")
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 48, "max_position_embeddings": 64,
        **sizes})
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "hf")
    np.random.default_rng(0).integers(0, 64, 2000).astype("<u2").tofile(folder / "tokens.bin")
    return folder


def train(ckpt, *args, weights=True):
    from tests.test_cli import run

    base = ["train", "std/models/llama.module", "--data", ckpt / "tokens.bin", "--seq", "16",
            "--batch", "2", "--device", "cpu", "--lr", "1e-2", "--format", "json"]
    return run(*base, *(["--hf-weights", ckpt / "hf"] if weights else []), *args)


def losses(result) -> list[float]:
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows if r["event"] == "step"]


def test_a_tiny_llama_trains_in_fp8_close_to_fp32(ckpt):
    """10 steps on a repeated batch at lr 1e-2. E4M3 keeps 3 mantissa bits (a rounding
    error of up to 2^-4 of each operand), E5M2 2; at d 32 the dot products average few of
    them and the large lr compounds them over the steps: measured at most 1.1% apart
    (CPU, float32 reference), the bound 3% at every step. The loss must still fall as in
    fp32, and must differ from it (the emulation acts)."""
    fp32 = losses(train(ckpt, "--steps", "10", "--repeat-batch"))
    fp8 = losses(train(ckpt, "--steps", "10", "--repeat-batch", "--precision", "fp8"))
    assert fp8 != fp32
    assert all(abs(a - b) <= 0.03 * b for a, b in zip(fp8, fp32)), (fp8, fp32)
    assert fp8[-1] < 0.5 * fp8[0]


def test_the_amax_histories_go_through_a_checkpoint(ckpt, tmp_path):
    """3 steps + resume + 3 equals 6 steps bit for bit: the delayed scales of steps 4-6
    come from the restored histories (without them the resumed steps would use their own
    amaxes, and differ)."""
    from safetensors import safe_open

    fp8 = ("--precision", "fp8")
    whole = losses(train(ckpt, "--steps", "6", *fp8))
    first = losses(train(ckpt, "--steps", "3", "--save", tmp_path / "b", *fp8))
    with safe_open(str(tmp_path / "b" / "checkpoint-3" / "optimizer.safetensors"),
                   framework="pt") as handle:
        keys = [k for k in handle.keys() if k.startswith("fp8.")]
        histories = [handle.get_tensor(k) for k in keys]
    assert keys and all(h.shape == (3,) and bool((h > 0).all()) for h in histories)
    rest = losses(train(ckpt, "--steps", "6", "--resume", tmp_path / "b", *fp8,
                        weights=False))
    assert first + rest == whole


@needs_gpus(1)
def test_the_gpu_train_step_refuses_per_block_scaling_when_it_loads():
    """On the GPU: TrainStep given a program whose recipe scales per block stops at once."""
    from runtime.cuda.step import TrainStep
    from runtime.inputs import sized_inputs
    from runtime.program import ModuleSource

    source = ModuleSource(Path("std/models/llama.module"), dict(TINY), precision="fp8")
    program = source.program_for(sized_inputs(source.program(planned=False).input_names(),
                                              2, 16))
    section = program.metadata["precision"]
    section["recipe"] = dict(section["recipe"], granularity={"kind": "per_block"})
    with pytest.raises(RuntimeUserError, match=GPU_REFUSAL):
        TrainStep(program, 2, 16)


@needs_gpus(1)
def test_fp8_trains_on_the_gpu_and_its_histories_go_through_a_checkpoint(tmp_path_factory,
                                                                         tmp_path):
    """`modulec train --device cuda --precision fp8` (a tiny Llama of head_dim 32, every
    FP8 GEMM dim a multiple of 16): close to the CPU emulation's losses, the checkpoint
    holds the device amax histories in the CPU trainer's format, and a resume reads them."""
    from safetensors import safe_open

    ckpt = tiny_llama(tmp_path_factory.mktemp("fp8gpu"), hidden_size=64,
                      num_attention_heads=2, num_key_value_heads=2, intermediate_size=128)

    gpu = ("--device", "cuda", "--precision", "fp8")
    first = losses(train(ckpt, "--steps", "3", "--save", tmp_path / "g", *gpu))
    with safe_open(str(tmp_path / "g" / "checkpoint-3" / "optimizer.safetensors"),
                   framework="pt") as handle:
        histories = [handle.get_tensor(k) for k in handle.keys() if k.startswith("fp8.")]
    assert histories and all(h.shape == (3,) and bool((h > 0).all()) for h in histories)
    rest = losses(train(ckpt, "--steps", "5", "--resume", tmp_path / "g", *gpu,
                        weights=False))
    assert len(first) == 3 and len(rest) == 2 and all(x == x for x in first + rest)
    cpu = losses(train(ckpt, "--steps", "3", "--precision", "fp8"))
    assert all(abs(a - b) <= 0.05 * b for a, b in zip(first, cpu)), (first, cpu)


def test_the_interpreter_quantizes_a_covered_matmul_and_its_gradient(tmp_path):
    """y = q4(x) @ q4(w)^T; d_x = q5(d_y) @ q4(w), d_w = q5(d_y)^T @ q4(x) (current scaling,
    float64); the model's own head (an output: the LM head) stays unquantized."""
    from runtime.model import Model

    path = tmp_path / "m.module"
    path.write_text(RECIPE_FILE.format(extra="  scaling_strategy: current\n")
                    .replace("  scaling_strategy: delayed\n", ""))
    model = Model.from_module(path, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    model.params.update({"p.w": torch.randn(4, 4, generator=g, dtype=torch.float64),
                         "head": torch.randn(8, 4, generator=g, dtype=torch.float64)})
    x = torch.randn(2, 4, generator=g, dtype=torch.float64)
    d_logits = torch.randn(2, 8, generator=g, dtype=torch.float64)
    logits = model.forward(x=x)["logits"]
    grads = model.backward(logits=d_logits)

    def q(t, fmt):
        return quantize(t, fmt, scale_for(float(t.abs().max()), fmt))

    w, head = model.params["p.w"], model.params["head"]
    h = q(x, "fp8_e4m3") @ q(w, "fp8_e4m3").T
    assert torch.equal(logits, h @ head.T)
    d_h = q(d_logits @ head, "fp8_e5m2")
    assert torch.allclose(grads.params["p.w"], d_h.T @ q(x, "fp8_e4m3"), rtol=1e-12)
    assert torch.allclose(grads.inputs["x"], d_h @ q(w, "fp8_e4m3"), rtol=1e-12)
    assert model.fp8.histories == {}  # no trainer step closed: nothing pushed yet


def test_per_block_recipes_scale_each_activation_row_in_the_interpreter(tmp_path):
    """1 x 128 activation tiles: each row of x (4 wide) by its own amax; the 4 x 4 weight is
    one 128 x 128 tile (its amax)."""
    from runtime.model import Model

    path = tmp_path / "m.module"
    path.write_text(RECIPE_FILE.format(extra="  granularity: per_block\n").replace(
        "scaling_strategy: delayed", "scaling_strategy: current"))
    model = Model.from_module(path, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    model.params.update({"p.w": torch.randn(4, 4, generator=g, dtype=torch.float64),
                         "head": torch.eye(8, 4, dtype=torch.float64)})
    x = torch.randn(2, 4, generator=g, dtype=torch.float64) * torch.tensor([[1e-3], [10.0]],
                                                                          dtype=torch.float64)
    rows = torch.stack([quantize(r, "fp8_e4m3", scale_for(float(r.abs().max()), "fp8_e4m3"))
                        for r in x])
    w = model.params["p.w"]
    weight = quantize(w, "fp8_e4m3", scale_for(float(w.abs().max()), "fp8_e4m3"))
    logits = model.forward(x=x)["logits"]
    assert torch.allclose(logits[:, :4], rows @ weight.T, rtol=1e-12, atol=0)
