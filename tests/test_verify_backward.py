"""`modulec check --verify-backward`: every std declaration passes, written and derived
backward alike, and backward graphs that are well typed but numerically wrong fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.test_cli import run as run_cli  # noqa: E402

SWIGLU = Path("std/modules/mlp.module").read_text(encoding="utf-8")


def _verify(*args):
    return run_cli("check", "--verify-backward", *args)


def _rows(result) -> list[dict]:
    return [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]


def test_std_modules_pass_written_and_derived():
    result = _verify("--format", "json", "std/modules/mlp.module", "std/modules/norm.module")
    rows = _rows(result)
    assert result.exit_code == 0, result.output
    assert {(r["declaration"], r["backward"]) for r in rows} >= {
        ("SwiGLU_MLP", "written"), ("SwiGLU_MLP", "derived"),
        ("RMSNormParams", "written"), ("LayerNormParams", "derived")}
    assert all(r["ok"] and r["max_rel_error"] < 1e-6 for r in rows)


def test_a_model_is_checked_at_its_verify_sizes():
    result = _verify("--format", "json", "std/models/llama.module")
    rows = _rows(result)
    assert result.exit_code == 0, result.output
    names = {r["gradient"] for r in rows}
    assert {"d_embedding", "d_blocks[1].attention.qkv_weight", "d_lm_head"} <= names


def _mutant(tmp_path, old: str, new: str) -> Path:
    assert old in SWIGLU
    path = tmp_path / "mlp.module"
    path.write_text(SWIGLU.replace(old, new, 1), encoding="utf-8")
    return path


@pytest.mark.parametrize("old, new, wrong", [
    ("(d_gate, d_up) -> concat", "(d_up, d_gate) -> concat", "d_up_weight"),  # swapped
    ("(d_out, hidden) -> matmul(transpose=TN)",
     "(d_out, hidden) -> matmul(transpose=TN, alpha=0.5)", "d_down_weight"),  # a wrong scale
])
def test_numerically_wrong_backward_fails_and_names_the_gradient(tmp_path, old, new, wrong):
    result = _verify("--format", "json", str(_mutant(tmp_path, old, new)))
    failed = {(r["declaration"], r["gradient"]) for r in _rows(result) if not r["ok"]}
    assert result.exit_code == 1
    assert ("SwiGLU_MLP", wrong) in failed
    derived = [r for r in _rows(result) if r.get("backward") == "derived"]
    assert derived and all(r["ok"] for r in derived)  # the derived one still passes


def test_a_missing_accumulate_fails(tmp_path):
    source = tmp_path / "tied.module"
    source.write_text(
        "module Tied(d: int = 4):\n  params:\n    w: [d, d]\n  forward:\n    in: x: [B, d]\n"
        "    out: y: [B, d]\n    graph:\n      x -> matmul(w, transpose=NT) -> h\n"
        "      h -> matmul(w, transpose=NT) -> y\n    save: [x, h]\n"
        "  backward:\n    graph:\n"
        "      (d_y, w) -> matmul(transpose=NN) -> d_h\n"
        "      (d_y, saved.h) -> matmul(transpose=TN, accumulate=true) -> d_w\n"
        "      (d_h, w) -> matmul(transpose=NN) -> d_x\n"
        "      (d_h, saved.x) -> matmul(transpose=TN{second}) -> d_w\n", encoding="utf-8")
    right = source.read_text().replace("{second}", ", accumulate=true")
    source.write_text(right, encoding="utf-8")
    assert _verify(str(source)).exit_code == 0
    source.write_text(right.replace("TN, accumulate=true) -> d_w\n      (d_h, w)",
                                    "TN) -> d_w0\n      (d_h, w)"), encoding="utf-8")
    result = _verify("--format", "json", str(source))
    assert result.exit_code == 1, result.output
    assert any(r["gradient"] == "d_w" and not r["ok"] for r in _rows(result))


def test_too_large_declarations_are_refused_with_a_hint(tmp_path):
    source = tmp_path / "big.module"
    source.write_text("module Big(d: int = 8192):\n  params:\n    w: [d, d]\n  forward:\n"
                      "    in: x: [B, d]\n    out: y: [B, d]\n    graph:\n"
                      "      x -> matmul(w, transpose=NT) -> y\n", encoding="utf-8")
    result = _verify(str(source))
    assert result.exit_code == 1
    assert "67,108,864 parameters" in result.output and "verify_backward:" in result.output
    assert _verify(str(source), "--set", "d=8").exit_code == 0


def test_unknown_verify_setting_is_reported(tmp_path):
    source = tmp_path / "m.module"
    source.write_text("module M(d: int = 4):\n  params:\n    w: [d, d]\n  forward:\n"
                      "    in: x: [B, d]\n    out: y: [B, d]\n    graph:\n"
                      "      x -> matmul(w, transpose=NT) -> y\n"
                      "  verify_backward:\n    epsilom: 1e-6\n", encoding="utf-8")
    result = _verify(str(source))
    # `check` reports it now (E001), before --verify-backward reads the section
    assert result.exit_code == 1 and "unknown section `epsilom` in `verify_backward:`" \
        in result.output and "did you mean `epsilon`?" in result.output


def test_a_shape_that_sizes_nothing_is_an_error(tmp_path):
    """`--shape X=3` where no verified declaration's inputs have X was accepted silently."""
    source = tmp_path / "m.module"
    source.write_text("module M(d: int = 4):\n  params:\n    w: [d, d]\n  forward:\n"
                      "    in: x: [B, d]\n    out: y: [B, d]\n    graph:\n"
                      "      x -> matmul(w, transpose=NT) -> y\n", encoding="utf-8")
    result = _verify(str(source), "--shape", "X=3")
    assert result.exit_code == 1
    assert "--shape X=3: no verified declaration's inputs have a dim `X` (their dims: B)" \
        in result.output
    assert _verify(str(source), "--shape", "B=3").exit_code == 0


def test_a_setting_that_sets_nothing_is_an_error(tmp_path):
    """`--set zz=3` where no verified declaration has a parameter `zz` (nor its inputs a dim
    `zz`) was accepted silently."""
    source = tmp_path / "m.module"
    source.write_text("module M(d: int = 4):\n  forward:\n    in: x: [B, d]\n"
                      "    out: y: [B, d]\n    graph:\n      x -> relu() -> y\n",
                      encoding="utf-8")
    result = _verify(str(source), "--set", "zz=3")
    assert result.exit_code == 1
    assert "--set zz=3: no verified declaration has a parameter `zz` (their parameters: d)" \
        in result.output
    assert _verify(str(source), "--set", "d=3", "--set", "B=2").exit_code == 0
    for text in ("²", "2.5"):  # `²` passed str.isdigit and int() refused it: exit 101
        result = _verify(str(source), "--set", f"B={text}")
        assert result.exit_code == 1 and f"--set B={text}: `B` is a dim of the inputs: its " \
            "size is a whole number" in result.output, result.output


def test_sizes_chosen_unlike_where_none_alike_builds(tmp_path):
    """Found by gentle fuzz seed 21 (GPT2Block with use_rope=true): every size alike makes
    the head dim d / h = 1, odd, and verify gave up on a block that checks clean; mixes
    of small sizes come next (d = 4, h = 2)."""
    source = tmp_path / "m.module"
    source.write_text("module Heads(d: int, h: int):\n  let:\n    constraint:\n"
                      "      d % h == 0, \"h divides d\"\n"
                      "      (d // h) % 2 == 0, \"the head dim is even\"\n"
                      "  params:\n    w: [d]\n  forward:\n    in: x: [B, d]\n"
                      "    out: [B, d]\n    graph:\n      (x, w) -> mul() -> out\n",
                      encoding="utf-8")
    result = _verify(str(source))
    assert result.exit_code == 0 and "all gradients match" in result.output, result.output


def test_ids_index_a_table_of_one_row(tmp_path):
    """A vocabulary of one (found by the soundness test's mutant of std Mamba's verify
    sizes, vocab_size 64 -> 1): the random ids were 0 and 1, and id 1 indexed past the
    table, an IndexError (exit 101); ids are only 0 where a parameter has one row."""
    source = tmp_path / "embed.module"
    source.write_text(
        "module Embed(vocab: int = 5, d: int = 4):\n  params:\n    table: [vocab, d]\n"
        "  forward:\n    in: ids: [B, T, int32]\n    out: y: [B, T, d]\n    graph:\n"
        "      (ids, table) -> embedding() -> y\n"
        "  verify_backward:\n    shapes:\n      vocab: 1\n", encoding="utf-8")
    result = _verify("--format", "json", str(source))
    assert result.exit_code == 0, result.output
    assert [(r["gradient"], r["ok"]) for r in _rows(result)] == [("d_table", True)]


def test_a_shapes_line_that_sizes_nothing_is_an_error(tmp_path):
    """Found by the fuzz run (seed 5: examples/gpt2's `T: 6` renamed `graph: 6`): a
    `shapes:` line naming neither a parameter nor a dim of the inputs was stored as a free
    dim nobody read, and the declaration verified at T = 4 (accept and ignore)."""
    source = tmp_path / "embed.module"
    source.write_text(
        "module Embed(vocab: int = 5, d: int = 4):\n  params:\n    table: [vocab, d]\n"
        "  forward:\n    in: ids: [B, T, int32]\n    out: y: [B, T, d]\n    graph:\n"
        "      (ids, table) -> embedding() -> y\n"
        "  verify_backward:\n    shapes:\n      vocab: 3\n      Tt: 6\n", encoding="utf-8")
    result = _verify(str(source))
    assert result.exit_code == 1, result.output
    # `check` reports it now (E002), before --verify-backward reads the section
    assert "error[E002]: `shapes:` sizes `Tt`, which is neither a parameter of `Embed` nor " \
           "a dim of its inputs" in result.output
    assert "did you mean `T`?" in result.output


@pytest.mark.parametrize("args, message", [
    # a graph value past the bound: refused before anything is allocated
    (("std/modules/mlp.module", "--set", "d_model=64", "--shape", "T=1000000"),
     "`MLP` computes `x` of `MLP#1` [2, 1000000, 64]"),
    # the reference attention's [B, H, T, T] scores (a kernel's workspace, no graph value,
    # 1.3 TiB): bounded before anything is allocated too (left to the allocator, it was an
    # error only where the machine refuses the allocation at once, not where it overcommits)
    (("std/blocks/dense.module", "--shape", "T=150000"),
     "computes `flash_attention's scores` of `CausalSelfAttention#1` [2, 4, 150000, 150000]"),
])
def test_sizes_too_large_to_verify_are_an_error_not_a_crash(args, message):
    """Found by a fuzz run (std DenseTransformerBlock's `T: 6` made `T: 100000`, which
    `check` now refuses against `max_seq`): the allocator's error was an internal error,
    exit 101."""
    result = _verify(*args)
    assert result.exit_code == 1, result.output
    assert message in result.output
