"""Annotations (spec §7, §5.11): the table, E008 / E013 / E025, and the memory-policy ladder."""

from __future__ import annotations

import re

import pytest

from modulec.check.annotation_table import ANNOTATIONS, FUSION_PATTERNS, HOOK_POINTS
from modulec.check.annotations import check_annotations, closest, primitive_names
from modulec.check.memory_policy import memory_decisions
from modulec.syntax.parser import parse_text
from spec_blocks import SPEC, declaration_blocks, placeholder_blocks

CODES = {"E008", "E013", "E025"}


def program(text: str):
    result = parse_text(text, "t.module")
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def problems(text: str):
    return [d for d in check_annotations(program(text)) if d.code in CODES]


def only(text: str):
    found = problems(text)
    assert len(found) == 1, [d.message for d in found]
    return found[0]


# ====================================================================== the table
def test_the_table_has_every_annotation_of_section_7_and_5_11():
    spec = SPEC.read_text(encoding="utf-8")
    headed = set(re.findall(r"^#### 7\.\d\.\d @(\w+)", spec, flags=re.M))
    assert len(headed) == 21
    assert set(ANNOTATIONS) == headed | {"recipe", "alias", "noalias", "barrier"}
    reserved = spec[spec.index("# Annotation names"):].splitlines()[1]
    assert {name.strip() for name in reserved.split(",")} <= set(ANNOTATIONS)


def test_table_entries_are_complete():
    for spec in ANNOTATIONS.values():
        assert spec.summary and spec.section.startswith("§") and spec.placements and spec.forms
        for param in spec.params:
            assert param.summary and param.kind.describe


def test_fusion_patterns_and_hook_points():
    # residual_layernorm (a6724c8): add + layernorm into fused_residual_layernorm
    assert list(FUSION_PATTERNS) == ["residual_norm", "residual_layernorm", "norm_linear",
                                     "gated_mlp", "attention_softmax", "bias_activation",
                                     "linear_bias_act"]
    assert len(HOOK_POINTS) == 16
    assert {"matmul", "add", "silu", "rmsnorm", "swiglu"} <= primitive_names()


def test_closest():
    assert closest("chekpoint", ANNOTATIONS) == "checkpoint"
    assert closest("None", ["full", "selective", "none"]) == "none"
    assert closest("priority", ANNOTATIONS) is None
    assert closest("save", ["save"]) is None  # an exact match is no suggestion


# ====================================================================== the spec's examples
# Spec blocks whose annotations are meant to be rejected, with the reason. None: the one
# intentionally invalid example (§7.6.0, E025) is commented out in its block; it is
# checked uncommented below.
INTENTIONALLY_INVALID: dict[int, str] = {
    4602: "kernel names no backend has (`cudnn_fmha_v2`, `cutlass_gemm_sm90_fp8`): E008 "
          "(decisions.md, `@kernel(name)`)",
}
BLOCKS = declaration_blocks()


@pytest.mark.parametrize(("line", "text"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_spec_example_annotations_are_valid(line, text):
    found = [f"{d.code} {d.message}" for d in problems(text)]
    assert bool(found) == (line in INTENTIONALLY_INVALID), found


def test_spec_placeholder_blocks_that_parse_have_valid_annotations():
    checked = 0
    for line, text in placeholder_blocks():
        result = parse_text(text, f"spec:{line}")
        if result.program is not None and result.ok:
            checked += 1
            assert not check_annotations(result.program), line
    assert checked >= 1


def spec_block(first_line: str) -> tuple[int, str]:
    return next(block for block in BLOCKS if block[1].lstrip().startswith(first_line)
                or f"\n{first_line}" in block[1])


def test_the_specs_invalid_pipeline_example_gives_e025():
    line, text = spec_block("# Checkpoint boundaries must align with pipeline stages")
    text = text.replace("# x8 -> blocks[8:12]()", "x8 -> blocks[8:12]()") \
        .replace("# x12 -> blocks[12:16]()", "x12 -> blocks[12:16]()") \
        .replace("x8 -> blocks[8:16]() -> x16", "x8 -> blocks[8:16]() -> x16b")
    # the spec lists alternatives: uncommented, its `VALID` line goes back to stage 1
    # after stage 2, which is an E008 of its own (modulec.check.partition)
    found = problems(text)
    assert [(d.code, d.message) for d in found if d.code == "E008"] == [
        ("E008", "stage 1 comes after stage 2: stage 1 would not be one contiguous range")]
    [d] = [d for d in found if d.code == "E025"]
    assert d.message == "`@checkpoint` spans pipeline stages 1 and 2"
    lines = text.splitlines()
    row = next(i for i, l in enumerate(lines, 1) if l.lstrip().startswith("x8 -> blocks[8:12]"))
    assert (d.primary_span.line, d.primary_span.column) == (row, lines[row - 1].index(
        "checkpoint") + 1)
    assert [label.message for label in d.labels[1:]] == ["stage 1",
                                                         "`x12` is read in stage 2 here"]
    assert "one pipeline stage" in d.notes[0]


# ====================================================================== E008 / E013
def out(notes: str) -> str:
    """`notes` after a flow's destination: line 4, `@` at column 21, name at 22."""
    return f"module M():\n  forward:\n    graph:\n      x -> f() -> y {notes}\n"


def par(notes: str) -> str:
    """`notes` after a parameter: line 3, `@` at column 12, name at 13."""
    return f"module M():\n  params:\n    w: [d] {notes}\n"


CASES = [
    # (source, code, message, (line, column), help or note fragment)
    (out("@chekpoint"), "E008", "unknown annotation `@chekpoint`", (4, 22),
     "did you mean `@checkpoint`?"),
    (out("@priority(1)"), "E008", "unknown annotation `@priority`", (4, 22),
     "known annotations: `@memory`, `@checkpoint`"),
    (par("@hook(AfterEmbedding)"), "E008", "`@hook` cannot be used on a parameter", (3, 13),
     "it goes on a flow's output tensor or an operation in a flow"),
    (out("@frozen"), "E008", "`@frozen` cannot be used on a flow's output tensor", (4, 22),
     "`@frozen` marks a parameter as frozen (§7.8.1); it goes on a parameter"),
    ("module M():\n  forward:\n    graph:\n      x -> f() @alias -> y\n", "E008",
     "`@alias` cannot be used on an operation in a flow", (4, 17), "flow's output tensor"),
    ("module M(): @memory(save)\n  params:\n    w: [d]\n", "E008",
     "`@memory` cannot be used on a declaration header", (1, 14), "a parameter"),
    (out("@memory(save, prioirty=1)"), "E008", "`@memory` has no argument `prioirty`", (4, 35),
     "did you mean `priority`?"),
    (out("@memory"), "E008", "`@memory` is missing its `mode` argument", (4, 22),
     "usage: `@memory(mode)` or `@memory(mode, options...)`"),
    (out("@memory"), "E008", "`@memory` is missing its `mode` argument", (4, 22),
     "`mode` is one of: save, recompute, temporary, pin, offload, stream"),
    (out("@memory(save, recompute)"), "E008", "`@memory` takes 1 positional argument", (4, 35),
     "signature: `@memory(mode, priority=0, prefetch=true, async=true)`"),
    (out('@nofuse("why")'), "E008", "`@nofuse` takes no positional arguments", (4, 29),
     "usage: `@nofuse` or `@nofuse(reason=string)`"),
    (out("@memory(priority=1, save)"), "E008",
     "positional argument after keyword argument in `@memory`", (4, 41), "usage: `@memory"),
    (out("@memory(sav)"), "E008", "`sav` is not a valid `mode` for `@memory`", (4, 29),
     "did you mean `save`?"),
    (out("@memory(sav)"), "E008", "`sav` is not a valid `mode` for `@memory`", (4, 29),
     "`mode` is one of: save, recompute, temporary, pin, offload, stream"),
    (par('@shard(column, tp_size="8")'), "E008",
     '`tp_size` of `@shard` must be an integer, found the string `"8"`', (3, 35),
     "write `8` without quotes"),
    (out("@memory(offload, priority=1.5)"), "E008",
     "`priority` of `@memory` must be an integer, found the number `1.5`", (4, 47),
     "offload priority"),
    (out('@precision(policy="bf16")'), "E008",
     "`policy` of `@precision` must be one of fp32, bf16, fp16, fp8_hybrid, fp8_pure, fp4, "
     'found the string `"bf16"`', (4, 39), "write `bf16` without quotes"),
    (out("@checkpoint(granularity=None)"), "E008",
     "`granularity` of `@checkpoint` must be one of full, selective, none, found `None`",
     (4, 45), "did you mean `none`?"),
    (out("@probe(qkv)"), "E008",
     '`name` of `@probe` must be a string (`"..."`), found the name `qkv`', (4, 28),
     'write `"qkv"` (a string)'),
    (out("@dtype(bf61)"), "E008", "`bf61` is not a valid `type` for `@dtype`", (4, 28),
     "did you mean `bf16`?"),
    (out("@trace(level=tensor)"), "E008", "`tensor` is not a valid `level` for `@trace`",
     (4, 34), "did you mean `tensors`?"),
    (out("@scaling(per_block, block_size=(32, 32, 32))"), "E008",
     "`block_size` of `@scaling` must be a pair of integers (`(32, 32)`), found the tuple "
     "`(32, 32, 32)`", (4, 52), "2D block dimensions"),
    (out("@adapter(lora, targets=[q, 1])"), "E008",
     "`targets` of `@adapter` must be a name, found the number `1`", (4, 48), "fused"),
    (out("@adapter(lora, rank=8, rank=16)"), "E008",
     "argument `rank` of `@adapter` is given twice", (4, 44), "give `rank` once"),
    (out("@hook(AfterAtention)"), "E008",
     "`AfterAtention` looks like a misspelling of the standard hook point `AfterAttention`",
     (4, 27), "did you mean `AfterAttention`?"),
    (out("@fuse(residual_nrom)"), "E013", "unknown fusion pattern `residual_nrom`", (4, 27),
     "did you mean `residual_norm`?"),
    (out("@fuse(ops=[matmul, ad])"), "E013",
     "`ad` in `@fuse(ops=[...])` is neither a primitive nor a known operation", (4, 40),
     "did you mean `add`?"),
    (out("@fuse"), "E013", "`@fuse` needs a fusion pattern or `ops=[...]`", (4, 22),
     "usage: `@fuse(pattern_name)` or `@fuse(ops=[op1, op2, ...])` or `@fuse(scope=global)`"),
    (out("@fuse(scope=local)"), "E013", "`@fuse` needs a fusion pattern or `ops=[...]`",
     (4, 22), "`pattern` is one of: residual_norm, residual_layernorm, norm_linear"),
]


@pytest.mark.parametrize("source, code, message, position, hint", CASES,
                         ids=[f"{i}-{c[2][:30]}" for i, c in enumerate(CASES)])
def test_diagnostic(source, code, message, position, hint):
    d = only(source)
    assert (d.code, d.message) == (code, message)
    assert (d.primary_span.line, d.primary_span.column) == position
    assert any(hint in text for text in d.help + d.notes), (d.help, d.notes)


def test_duplicate_points_at_both_arguments():
    d = only(out("@adapter(lora, rank=8, rank=16)"))
    first = d.labels[1]
    assert (first.span.column, first.message) == (36, "first given here")
    assert d.labels[0].message == "given again here"


def test_name_spans_cover_the_name_only():
    d = only(out("@chekpoint(full)"))
    assert (d.primary_span.column, d.primary_span.end_column) == (22, 31)


def test_kernel_names_are_those_of_the_primitive_annotated():
    flow = "module M():\n  params:\n    w: [d, d]\n  forward:\n    graph:\n" \
           "      x -> matmul(w) {op} -> y {flow}\n"
    assert problems(flow.format(op='@kernel("reference", workspace=None)', flow="")) == []
    assert problems(flow.format(op="", flow='@kernel("reference", fallback=false)')) == []
    unknown = only(flow.format(op='@kernel("cublass")', flow=""))
    assert unknown.message == "no kernel `cublass` for `matmul`"
    assert unknown.notes == ("kernels: `matmul`: `reference` (CPU reference, GPU)",)
    called = only(out('@kernel("reference")'))  # `f` is no primitive
    assert called.message == "no kernel `reference` for this flow"
    assert "a kernel implements a primitive operation" in called.notes[0]


@pytest.mark.parametrize("notes", [
    "@hook(MyCustomHook)", "@hook(AfterQKV, mode=observe)", '@hook("AfterAttention")',
    "@fuse(ops=[f, add])", "@fuse(ops=[Helper])", "@fuse(ops=[Linear])",
    "@adapter(lora, rank=r, alpha=a * 2, targets=names)", "@partition(stage)",
    "@memory(offload, priority=-1, prefetch=use_prefetch)",
    "@gradient(scale=0.1)", "@checkpoint(full)", "@checkpoint(granularity=none)",
    "@fuse(scope=global)", "@assert(not has_nan(y) and y.shape[-1] == d)", "@barrier",
    "(a, b @gradient(skip))", "@precision(compute=fp8_e4m3, output=bf16)",
])
def test_valid(notes):
    prefix = "import std.modules.Linear\n" if "Linear" in notes else ""
    helper = "\nmodule Helper():\n  params:\n    v: [d]\n"
    text = prefix + (out(notes) if not notes.startswith("(") else
                     out("").replace("-> y \n", f"-> {notes}\n")) + helper
    assert problems(text) == []


def test_placements_of_entries_elements_and_block_lines():
    text = ("recipe FP8:\n  compute: fp8_e4m3\n"
            "model M():\n  @recipe(FP8) @profile(\"m\")\n  params:\n    w: [d] @frozen @trainable\n"
            "  forward:\n    in: (x: [B], mask: [B] @gradient(skip))\n    graph:\n"
            "      x @assert(x.shape[0] > 0) -> f() @nofuse -> (y, z @gradient(skip))\n"
            "    @trace\n")
    assert problems(text) == []
    bad = "module M():\n  forward:\n    out: (y: [B] @frozen)\n"
    assert only(bad).message == "`@frozen` cannot be used on a flow's output tensor"


def test_several_problems_in_one_annotation_are_all_reported():
    messages = [d.message for d in problems(par('@memory(sav, prioirty=1) @frozen(1)'))]
    assert messages == ["`@memory` has no argument `prioirty`",
                        "`sav` is not a valid `mode` for `@memory`",
                        "`@frozen` takes no positional arguments"]


# ====================================================================== E025
PIPE = "model P():\n  forward:\n    graph:\n"


@pytest.mark.parametrize("flows, stages", [
    ("      x0 -> a() @partition(0) -> b() @partition(1) -> x1 @checkpoint\n", "0 and 1"),
    ("      x0 -> a() -> x1 @partition(0)\n      x1 -> b() -> x2 @partition(1)\n"
     "      x2 -> c() -> x3 @partition(2)\n", None),
    ("      x0 -> a() -> x1 @partition(0) @checkpoint\n"
     "      x1 -> b() -> x2 @partition(1) @checkpoint\n", None),
    ("      x0 -> a() @partition(0) -> x1 @checkpoint(granularity=none)\n"
     "      x1 -> b() -> x2 @partition(1)\n", None),
    ("      x0 -> a() @partition(s) -> x1 @checkpoint\n      x1 -> b() -> x2 @partition(1)\n",
     None),
])
def test_checkpoint_and_stages(flows, stages):
    found = problems(PIPE + flows)
    assert [d.message for d in found] == \
        ([f"`@checkpoint` spans pipeline stages {stages}"] if stages else [])


def test_block_level_checkpoint_over_two_stages():
    text = ("model P():\n  forward:\n    graph:\n      x0 -> a() -> x1 @partition(0)\n"
            "      x1 -> b() -> x2 @partition(1)\n  @checkpoint\n")
    d = only(text)
    assert (d.code, d.primary_span.line, d.primary_span.column) == ("E025", 6, 4)
    assert [label.message for label in d.labels[1:]] == ["stage 0", "stage 1"]


# ====================================================================== memory policy
def spec_decl(name: str, marker: str):
    for _, text in BLOCKS:
        for decl in program(text).decls:
            if decl.name == name and marker in text:
                return decl
    raise LookupError(name)


def decided(decisions) -> dict[str, tuple[str, int]]:
    return {name: (d.policy, d.source) for name, d in decisions.items()}


def test_spec_precedence_example():
    decisions = memory_decisions(spec_decl("PrecedenceExample", "op4"))
    assert decided(decisions) == {"in": ("temporary", 6), "x": ("save", 1), "y": ("save", 4),
                                  "z": ("recompute", 1), "w": ("temporary", 6)}
    assert decisions["y"].reason == \
        "listed in `save:` (module's save: list, priority 4)"
    assert decisions["z"].reason.startswith("`@memory(recompute)` (instance-level @memory")


def test_spec_recompute_frontier_example():
    decisions = memory_decisions(spec_decl("Example", "recompute: [a, c]"))
    assert decided(decisions) == {"in": ("save", 4), "a": ("recompute", 5), "b": ("save", 1),
                                  "c": ("recompute", 1)}
    assert decisions["b"].overrides == (4, 6) and decisions["c"].overrides == (5, 6)


def test_spec_selective_checkpoint_preserves_attn_out():
    decisions = memory_decisions(spec_decl("SelectiveCheckpointBlock", "preserve"))
    assert decisions["attn_out"].policy == "save" and decisions["attn_out"].source == 2


LADDER = """block B(d):
  params:
    w: [d, d] @memory(offload)
    ln1_weight: [d]
  forward:
    graph:
      in -> rmsnorm(ln1_weight) -> (ln1_out, ln1_rstd)
      ln1_out -> f() -> (h, g @memory(pin)) @memory(temporary)
      h -> k() -> ln2_out
      ln2_out -> q() -> out
    save: [ln*_out, *_rstd, ln1_weight, h]
    recompute: [*]
  backward:
    graph:
      (saved.ln1_out, d_out) -> z() -> d_in
"""


def test_ladder_with_wildcards_and_params():
    decisions = memory_decisions(program(LADDER).decls[0])
    assert decided(decisions) == {
        "w": ("offload", 1), "ln1_weight": ("save", 4), "in": ("recompute", 5),
        "ln1_out": ("save", 4), "ln1_rstd": ("save", 4), "h": ("temporary", 1),
        "g": ("pin", 1), "ln2_out": ("save", 4), "out": ("recompute", 5)}
    assert decisions["ln1_rstd"].reason.startswith("matches `*_rstd` in `save:`")
    assert decisions["ln2_out"].reason.startswith("matches `ln*_out` in `save:`")
    assert decisions["h"].overrides == (4, 5, 6)  # save: and recompute: lose to @memory


def test_defaults():
    text = LADDER.replace("    save: [ln*_out, *_rstd, ln1_weight, h]\n    recompute: [*]\n", "")
    decl = program(text).decls[0]
    assert decided(memory_decisions(decl)) == {
        "w": ("offload", 1), "ln1_weight": ("pin", 6), "in": ("temporary", 6),
        "ln1_out": ("save", 6), "ln1_rstd": ("temporary", 6), "h": ("temporary", 1),
        "g": ("pin", 1), "ln2_out": ("temporary", 6), "out": ("temporary", 6)}
    given = memory_decisions(decl, consumed_by_backward={"ln1_rstd"})
    assert given["ln1_rstd"].policy == "save" and given["ln1_out"].policy == "temporary"
    assert given["ln1_rstd"].reason == "consumed by the backward (default policy, priority 6)"


def test_block_level_checkpoint():
    text = ("block B():\n  @checkpoint(preserve=[b])\n  forward:\n    graph:\n"
            "      x -> f() -> a\n      a -> g() -> b\n      b -> h() -> c @memory(save)\n"
            "      c -> k() -> out @checkpoint(preserve=[c])\n    save: [a]\n")
    decisions = memory_decisions(program(text).decls[0])
    assert decided(decisions) == {"x": ("save", 3), "a": ("recompute", 3), "b": ("save", 3),
                                  "c": ("save", 1), "out": ("recompute", 3)}
    assert decisions["a"].overrides == (4, 6) and decisions["c"].overrides == (2, 3, 6)


def test_selective_and_disabled_block_checkpoints_decide_nothing_else():
    for level in ("selective", "none"):
        text = (f"block B():\n  @checkpoint({level})\n  forward:\n    graph:\n"
                "      x -> f() -> a\n")
        assert decided(memory_decisions(program(text).decls[0])) == {
            "x": ("temporary", 6), "a": ("temporary", 6)}


def test_spans_point_at_the_deciding_text():
    decisions = memory_decisions(program(LADDER).decls[0])
    assert (decisions["h"].span.line, decisions["h"].span.column) == (8, 46)  # @memory
    assert (decisions["ln1_rstd"].span.line, decisions["ln1_rstd"].span.column) == (11, 21)


# ====================================================================== @partition stages
@pytest.mark.parametrize("flows, message", [
    ("      x0 -> a() -> x1 @partition(0)\n      x1 -> b() -> x2 @partition(2)\n",
     "`@partition(2)` but no operation is in stage 1"),
    ("      x0 -> a() -> x1 @partition(1)\n      x1 -> b() -> x2 @partition(2)\n",
     "`@partition(1)` but no operation is in stage 0"),
    ("      x0 -> a() -> x1 @partition(0)\n      x1 -> b() -> x2 @partition(1)\n"
     "      x2 -> c() -> x3 @partition(0)\n",
     "stage 0 comes after stage 1: stage 0 would not be one contiguous range"),
    ("      x0 -> a() @partition(1) -> b() @partition(0) -> x1\n",
     "stage 0 comes after stage 1: stage 0 would not be one contiguous range"),
    ("      x0 -> a() -> x1 @partition(-1)\n", "a pipeline stage is numbered from 0"),
    ("      x0 -> a() -> x1 @partition(0)\n      x1 -> b() -> x2 @partition(1)\n"
     "      x2 -> c() -> x3\n      x3 -> d() -> x4 @partition(1)\n", None),
    ("      x0 -> a() @partition(0) -> b() @partition(1) -> x1\n", None),
    ("      x0 -> a() -> x1 @partition(s)\n      x1 -> b() -> x2 @partition(2)\n", None),
])
def test_partition_stages_form_a_pipeline(flows, message):
    found = problems(PIPE + flows)
    assert [d.message for d in found] == ([message] if message else [])
    if message:
        line = next(i for i, l in enumerate((PIPE + flows).splitlines(), 1)
                    if l.strip() and found[0].primary_span.line == i)
        assert found[0].code == "E008" and line >= 4


def test_partition_out_of_order_names_both_lines():
    text = PIPE + ("      x0 -> a() -> x1 @partition(0)\n      x1 -> b() -> x2 @partition(1)\n"
                   "      x2 -> c() -> x3 @partition(0)\n")
    d = only(text)
    assert d.primary_span.line == 6
    assert [(label.span.line, label.message) for label in d.labels[1:]] == [
        (5, "stage 1 starts here")]


# ====================================================================== unknown recipes
RECIPES = "recipe FP8Hybrid:\n  compute: fp8_e4m3\n"


def test_an_unknown_recipe_lists_the_known_ones_with_a_guess():
    d = only(RECIPES + "model M():\n  @recipe(FP8Hybird)\n")
    assert d.message == "unknown recipe `FP8Hybird`"
    assert list(d.notes) == ["known recipes: `FP8Hybrid`"]
    assert list(d.help) == ["did you mean `FP8Hybrid`?"]


@pytest.mark.parametrize("name, message, fix", [
    ("NoSuchRecipe", "`NoSuchRecipe` in `@precision(...)` is neither a precision policy "
                     "nor a recipe", None),
    ("FP8Hybird", "`FP8Hybird` in `@precision(...)` is neither a precision policy nor a "
                  "recipe", "did you mean `@recipe(FP8Hybrid)`"),
    ("bf61", "`bf61` in `@precision(...)` is neither a precision policy nor a recipe",
     "did you mean `@precision(policy=bf16)`?"),
    ("FP8Hybrid", "`@precision` takes no positional arguments", "write `@recipe(FP8Hybrid)`"),
    ("fp8_pure", "`@precision` takes no positional arguments",
     "write `@precision(policy=fp8_pure)`"),
])
def test_a_bare_name_in_precision_says_what_to_write(name, message, fix):
    d = only(RECIPES + out(f"@precision({name})").replace("module M", "model M"))
    assert d.message == message
    if fix is None:  # no guess: the policies and recipes are listed
        assert "precision policies: `bf16`" in d.notes[0]
        assert d.notes[1] == "recipes: `FP8Hybrid`"
        assert not any("did you mean" in h for h in d.help)
    else:
        assert d.help[0].startswith(fix)


def test_dtype_on_a_matrix_warns_for_the_gpu_and_on_a_vector_not():
    def w006(shape: str) -> list[str]:
        text = f"module M():\n  params:\n    w: {shape} @dtype(fp32)\n"
        return [d.message for d in check_annotations(program(text)) if d.code == "W006"]

    assert w006("[d]") == w006("[d, fp32]") == []
    assert w006("[d, e]") == ["`@dtype` on a parameter of 2 or more dims has no effect on "
                              "the GPU backend yet"]


def test_a_very_long_name_is_no_typo_and_costs_no_quadratic_distance():
    """Found by the fuzz run (seed 36: `AfterAttnOutProjection` repeated 20,000 times as a
    hook name): the edit distance to each standard hook point was 440,000 x 20 steps a
    name, a minute in check. Names past 100 characters are never compared: checked by what
    is computed, not by a wall-time bound (flaky on a loaded CI). Past LONGEST the distance
    is the longer length, never the alignment's (1 in each pair below): nothing is walked."""
    from modulec.diagnostics.spelling import LONGEST, edit_distance

    assert edit_distance("x" * LONGEST + "y", "x" * LONGEST) == LONGEST + 1
    assert edit_distance("x" * (LONGEST - 1) + "y", "x" * LONGEST) == 1  # compared
    long = "AfterAttention" * 30_000
    assert edit_distance(long, long + "x") == len(long) + 1
    assert closest(long, HOOK_POINTS) is None
    assert closest("AfterAtention", HOOK_POINTS) == "AfterAttention"
    assert edit_distance("frist", "first") == 1
