"""Issue 15, "Misleading words": every hint names a real option or a real line to write,
and a report says what happened (one test per item of the issue's list)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli import run, write

GIB = 1 << 30
LLAMA = "std/models/llama.module"

WRONG_BACKWARD = """\
module Twice(d: int = 3):
  forward:
    in: x: [B, d]
    out: y: [B, d]
    graph:
      x -> scale(2.0) -> y

  backward:
    inputs:
      d_y: [B, d]
    outputs:
      d_x: [B, d]
    graph:
      d_y -> scale(3.0) -> d_x
"""
CHECK_ERROR = """\
module Broken(d: int = 3):
  forward:
    in: x: [B, d]
    out: y: [B, d]
    graph:
      x -> relu() -> z
"""
UNSATISFIABLE = """\
module Odd(n: int):
  let:
    constraint:
      n % 2 == 1 and n > 100, "n must be odd and above 100"
  forward:
    in: x: [B, n]
    out: y: [B, n]
    graph:
      x -> relu() -> y
"""


# ------------------------------------------------------------------ memory budget
def test_budget_hint_names_the_lora_option_of_every_caller():
    result = run("build", "examples/llama.module", "--shape", "B=1", "--shape", "T=8",
                 "--memory-budget", "1KiB")
    assert result.exit_code == 1, result.output
    assert "--training lora" not in result.output
    assert "train LoRA adapters only (`--lora`" in result.output


def test_budget_message_shows_the_budget_the_user_gave():
    """TrainStep.from_module hands the planner its budget plus an offset; the message
    subtracts it again (it said 18.10 GiB for memory_budget=14 GiB)."""
    from modulec.lower.build import BuildRequest, build
    from modulec.lower.build_plan import PlanOptions

    request = BuildRequest(Path("examples/llama.module"), shapes={"B": 1, "T": 8})
    offset = 4 * GIB + 123
    request.planning = PlanOptions(budget=10 * GIB + offset, budget_offset=offset)
    failure = build(request).failure
    assert failure.startswith("the memory budget 10.00 GiB cannot be met"), failure


# ------------------------------------------------------------------ train --help
def test_train_help_does_not_limit_lora_to_the_cpu():
    result = run("train", "--help")
    assert result.exit_code == 0
    assert "cpu for now" not in result.output and "--lora" in result.output


# ------------------------------------------------------------------ --verify-backward report
def test_verify_backward_after_a_check_error_verifies_nothing(tmp_path):
    pytest.importorskip("torch")
    result = run("check", "--verify-backward", write(tmp_path, "broken.module", CHECK_ERROR))
    assert result.exit_code == 1
    assert "all gradients match" not in result.output
    assert "verified no gradients: every file has check errors" in result.output


def test_verify_backward_says_no_problems_only_when_the_gradients_match(tmp_path):
    pytest.importorskip("torch")
    result = run("check", "--verify-backward", write(tmp_path, "twice.module", WRONG_BACKWARD))
    assert result.exit_code == 1, result.output
    assert "no problems found" not in result.output
    assert "FAIL" in result.output and "1 failed" in result.output


def test_verify_backward_sizes_int_parameters_to_fit_the_constraints():
    """SwiGLUMLP(d_model: int, d_ff: int) requires d_ff % 8 == 0: 4 did not build."""
    pytest.importorskip("torch")
    result = run("check", "--verify-backward", "tests/ui/clean/swiglu_mlp.module")
    assert result.exit_code == 0, result.output
    assert "all gradients match" in result.output and "does not build" not in result.output


def test_verify_backward_names_the_parameter_to_size(tmp_path):
    pytest.importorskip("torch")
    result = run("check", "--verify-backward", write(tmp_path, "odd.module", UNSATISFIABLE))
    assert result.exit_code == 1
    assert "`Odd` does not build with `n` at any of the sizes" in result.output
    assert "give `n` sizes that satisfy the constraints in a `verify_backward:`" in result.output


# ------------------------------------------------------------------ hook points
def test_unknown_hook_point_shows_its_help_to_python_callers():
    pytest.importorskip("torch")
    from runtime.errors import RuntimeUserError
    from runtime.hooks import Hooks

    hooks = Hooks(points=["AfterAttnOutProjection", "AfterMLPDownProjection"])
    with pytest.raises(RuntimeUserError) as caught:
        hooks.register("AfterAtnOutProjection", lambda x: x)
    shown = str(caught.value)
    assert "did you mean `AfterAttnOutProjection`?" in shown
    assert "hook points: AfterAttnOutProjection, AfterMLPDownProjection" in shown


# ------------------------------------------------------------------ --shape
def test_shape_of_a_dim_the_model_does_not_have_is_an_error():
    result = run("build", LLAMA, "--set", "max_seq=64", "--shape", "B=1", "--shape", "T=8",
                 "--shape", "X=3")
    assert result.exit_code == 1
    assert "--shape X=3: `Llama`'s inputs have no dim `X` (their dims: B, T)" in result.output


def test_shape_above_max_seq_is_an_error():
    result = run("build", LLAMA, "--set", "max_seq=64", "--shape", "B=1", "--shape", "T=4096")
    assert result.exit_code == 1
    assert "--shape T=4096 is longer than the model's max_seq (64)" in result.output


def test_shape_of_a_parameter_points_to_set():
    result = run("build", LLAMA, "--shape", "B=1", "--shape", "T=8", "--shape", "d_model=64")
    assert result.exit_code == 1
    assert "(use --set d_model=64)" in result.output


# ------------------------------------------------------------------ names
def test_python_true_gets_a_hint_to_write_true(tmp_path):
    path = write(tmp_path, "flag.module", CHECK_ERROR.replace("relu() -> z", "relu() -> y")
                 .replace("module Broken(d: int = 3)", "module Flag(d: int = 3, on: bool = True)"))
    result = run("check", path)
    assert "undefined name `True`" in result.output
    assert "help: write `true`: the DSL's literals are `true`, `false` and `None`" \
        in result.output


def test_missing_import_names_the_import_that_defines_the_name(tmp_path):
    text = CHECK_ERROR.replace("module Broken(d: int = 3):", "module Uses(d: int = 3):\n"
                               "  params:\n    proj: Linear(d, d)").replace(
        "x -> relu() -> z", "x -> proj -> h\n      h -> RMSNormParams(d) -> y")
    result = run("check", write(tmp_path, "uses.module", text))
    assert "undefined module `Linear`" in result.output
    assert "add `import std.modules.linear.Linear`" in result.output
    assert "add `import std.modules.norm.RMSNormParams`" in result.output


# ------------------------------------------------------------------ docs
def test_runtime_page_memory_budget_counts_are_what_the_code_prints(capsys):
    """docs/runtime.md's memory-budget example: its comment is the printed counts."""
    pytest.importorskip("torch")
    import re

    page = Path("docs/runtime.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S)
                 if "memory_budget=" in b)
    expected = re.search(r"^# (\{.*\})$", block, re.M).group(1)
    exec(compile(block, "docs/runtime.md", "exec"), {})
    assert capsys.readouterr().out.strip() == expected


def test_readme_opens_with_setup_test_and_the_way_to_the_command():
    first = Path("README.md").read_text(encoding="utf-8").split("```sh\n", 1)[1].split("```")[0]
    lines = first.splitlines()
    assert lines[0].startswith("make setup") and lines[1].startswith("make test")
    assert "source .venv/bin/activate" in first and "modulec" in lines[2]


def test_readme_listing_is_examples_llama_module():
    """The program README.md shows as `examples/llama.module` is that file's text (less its
    docstring and `verify_backward:` sizes): it had kept the file from before @shard(vocab)."""
    readme = Path("README.md").read_text(encoding="utf-8")
    shown = readme.split("(`examples/llama.module`", 1)[1].split("```\n", 1)[1].split("```")[0]
    source = Path("examples/llama.module").read_text(encoding="utf-8")
    body = source.split('"""\n', 1)[1].split("\n  # `modulec check --verify-backward`")[0]
    assert shown.strip() == body.strip()


@pytest.mark.parametrize("command", ["plan", "graph"])
def test_plan_and_graph_check_shapes_too(command):
    result = run(command, LLAMA, "--set", "max_seq=64", "--shape", "B=1", "--shape", "T=8",
                 "--shape", "Q=2")
    assert result.exit_code == 1
    assert "--shape Q=2: `Llama`'s inputs have no dim `Q`" in result.output
