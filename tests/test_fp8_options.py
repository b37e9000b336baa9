"""`--fp8-scaling`, `--fp8-gradient`, `--fp8-history` (modulec/cli/fp8_options.py,
decisions.md "FP8 recipes"): the std recipe as they change it, in the IR of `modulec
build`, in `modulec plan`'s FP8 buffers and in what `modulec train` runs; the IR without
them as before; their misuse a usage error. The GPU step on such a recipe:
tests/test_fp8_gemm.py (RECIPES)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from modulec.lower.fp8_recipe import STD_RECIPE, std_recipe  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402
from tests.test_cli import run  # noqa: E402

LLAMA = "std/models/llama.module"
TINY = ["--set", "vocab_size=64", "--set", "d_model=32", "--set", "n_layers=2",
        "--set", "num_heads=4", "--set", "num_kv_heads=2", "--set", "d_ff=48"]
SHAPES = ["--shape", "B=2", "--shape", "T=16"]


def built(tmp_path, *options) -> tuple[dict, str]:
    out = tmp_path / f"m{len(list(tmp_path.iterdir()))}.ir"
    result = run("build", LLAMA, *TINY, *SHAPES, "-o", out, *options)
    assert result.exit_code == 0, result.output
    text = out.read_text()
    return json.loads(text)["metadata"].get("precision"), text


def test_the_options_change_the_std_recipe_in_the_ir(tmp_path):
    section, _ = built(tmp_path, "--precision", "fp8", "--fp8-scaling", "current",
                       "--fp8-gradient", "e4m3")
    assert section["recipe"] == dict(STD_RECIPE, gradient="fp8_e4m3",
                                     scaling={"kind": "current", "margin": 0})
    section, _ = built(tmp_path, "--precision", "fp8", "--fp8-history", "4")
    assert section["recipe"] == dict(STD_RECIPE, scaling={"kind": "delayed",
                                                          "history_len": 4, "margin": 0})
    # every covered matmul as before: the options change the recipe, not what it covers
    std, _ = built(tmp_path, "--precision", "fp8")
    assert section["matmuls"] == std["matmuls"] and std["recipe"] == STD_RECIPE


def test_without_the_options_the_ir_is_the_std_recipes_byte_for_byte(tmp_path):
    _, plain = built(tmp_path, "--precision", "fp8")
    _, spelled = built(tmp_path, "--precision", "fp8", "--fp8-scaling", "delayed",
                       "--fp8-gradient", "e5m2", "--fp8-history", "16")
    assert plain == spelled
    assert std_recipe(None) is STD_RECIPE and std_recipe({}) is STD_RECIPE


@pytest.mark.parametrize("command", ["build", "plan", "train"])
def test_the_options_without_precision_fp8_are_a_usage_error(command, tmp_path):
    rest = ["--data", tmp_path / "none.bin", "--seq", "16", "--batch", "2", "--steps", "1",
            "--device", "cpu"] if command == "train" else SHAPES
    result = run(command, LLAMA, *TINY, *rest, "--fp8-scaling", "current",
                 "--fp8-gradient", "e4m3")
    assert result.exit_code == 2
    assert "--fp8-scaling, --fp8-gradient set the std FP8 recipe's scaling or format: " \
        "give them with --precision fp8" in result.output
    result = run(command, LLAMA, *TINY, *rest, "--precision", "fp8",
                 "--fp8-scaling", "current", "--fp8-history", "4")
    assert result.exit_code == 2
    assert "--fp8-history is the delayed scaling's amax history" in result.output
    result = run(command, LLAMA, *TINY, *rest, "--precision", "fp8", "--fp8-history", "0")
    assert result.exit_code == 2 and "--fp8-history" in result.output


def test_std_recipe_refuses_what_the_options_cannot_say():
    for bad in ({"scaling": "dynamic"}, {"gradient": "bf16"}, {"history_len": 0},
                {"scaling": "current", "history_len": 4}, {"granularity": "per_block"}):
        with pytest.raises(ValueError, match="the std FP8 recipe's overrides"):
            std_recipe(bad)


def test_plan_counts_the_buffers_of_the_recipe_the_options_give():
    """The amax histories are history_len fp32 a row (current scaling: 1)."""
    def scales(*options):
        result = run("plan", LLAMA, *TINY, *SHAPES, "--precision", "fp8", *options,
                     "--format", "json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["fp8_buffers"]["scales_bytes"]

    std, longer, current = scales(), scales("--fp8-history", "64"), scales(
        "--fp8-scaling", "current")
    assert current < std < longer


# ====================================================================== modulec train


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8opt") / "tokens.bin"
    torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0),
                  dtype=torch.int32).to(torch.int16).numpy().tofile(path)
    return path


def train(tokens, *options, sizes=TINY):
    result = run("train", LLAMA, *sizes, "--data", tokens, "--seq", "16", "--batch", "2",
                 "--device", "cpu", "--init", "random", "--lr", "1e-2", "--format", "json",
                 "--precision", "fp8", *options)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows if r["event"] == "step"]


def test_train_runs_current_scaling_and_e4m3_gradients_on_the_cpu(tokens):
    """Step 1's forward is the std recipe's (E4M3, and delayed scaling's empty history
    scales by the tensor's own amax, as current scaling does); its E4M3 gradients make
    step 2 differ."""
    std = train(tokens, "--steps", "2")
    ours = train(tokens, "--steps", "2", "--fp8-scaling", "current", "--fp8-gradient", "e4m3")
    assert len(ours) == 2 and all(x == x for x in ours)
    assert ours[0] == std[0] and ours[1] != std[1]


def test_train_keeps_fp8_history_amaxes(tokens, tmp_path):
    from safetensors import safe_open

    train(tokens, "--steps", "3", "--fp8-history", "2", "--save", tmp_path / "r")
    with safe_open(str(tmp_path / "r" / "checkpoint-3" / "optimizer.safetensors"),
                   framework="pt") as handle:
        shapes = {handle.get_tensor(k).shape for k in handle.keys() if k.startswith("fp8.")}
    assert shapes == {(2,)}


def test_train_refuses_the_options_with_an_ir(tokens, tmp_path):
    _, _ = built(tmp_path, "--precision", "fp8")
    ir = next(tmp_path.glob("*.ir"))
    result = run("train", ir, "--data", tokens, "--seq", "16", "--batch", "2", "--steps", "1",
                 "--device", "cpu", "--init", "random", "--precision", "fp8",
                 "--fp8-scaling", "current")
    assert result.exit_code == 1
    assert "--precision, --fp8-scaling would change" in result.output


GPU_SIZES = ["--set", "vocab_size=64", "--set", "d_model=64", "--set", "n_layers=2",
             "--set", "num_heads=2", "--set", "num_kv_heads=2",
             "--set", "d_ff=128"]  # head_dim 32: every FP8 GEMM dim a multiple of 16


@needs_gpus(1)
@pytest.mark.parametrize("options", [("--fp8-scaling", "current", "--fp8-gradient", "e4m3"),
                                     ("--fp8-gradient", "e4m3", "--fp8-history", "2")])
def test_train_on_the_gpu_runs_the_recipe_the_options_give(tokens, options):
    """`modulec train --device cuda` (the step in a CUDA graph) with the changed recipe:
    close to the CPU emulation's losses of the same recipe, as the std recipe is
    (tests/test_fp8.py)."""
    gpu = train(tokens, "--steps", "3", "--device", "cuda", *options, sizes=GPU_SIZES)
    cpu = train(tokens, "--steps", "3", *options, sizes=GPU_SIZES)
    assert len(gpu) == 3 and all(x == x for x in gpu)
    assert all(abs(a - b) <= 0.05 * b for a, b in zip(gpu, cpu)), (gpu, cpu)
