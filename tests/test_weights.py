"""Weight mapping (modulec.check.weights): hf_config / hf_mapping / hf_export against a
model's parameter tree (E010), the parameter paths, and the load plan."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from modulec.check import driver
from modulec.check.instance import instantiate
from modulec.check.weights import TRANSFORMS, check_weights, hf_plan, weight_paths
from modulec.check.world import World
from modulec.resolve import Resolver

ROOT = Path(__file__).resolve().parent.parent
STD_MODELS = sorted((ROOT / "std" / "models").glob("*.module"))
UI_WEIGHTS = sorted((ROOT / "tests" / "ui" / "weights").glob("*.module"))


# ============================================================================ helpers
class Checked:
    """A model instance after check_weights: its diagnostics, with the text each primary
    span covers."""

    def __init__(self, path: Path, args: dict | None = None, model: str | None = None):
        resolver = Resolver()
        loaded = resolver.load(path)
        assert not [d for d in loaded.diagnostics if d.is_error], \
            [d.message for d in loaded.diagnostics]
        scopes = driver.scopes_of(resolver) if hasattr(driver, "scopes_of") else {}
        self.world = World(loaded.scope, scopes) if scopes else World(loaded.scope)
        decl = next(d for d in loaded.program.decls
                    if d.kind == "model" and (model is None or d.name == model))
        self.instance = instantiate(self.world, self.world.definition(decl), args)
        before = len(self.world.diagnostics)
        assert not self.world.diagnostics, [d.message for d in self.world.diagnostics]
        check_weights(self.instance)
        self.diagnostics = self.world.diagnostics[before:]
        self.text = path.read_text(encoding="utf-8")

    def spanned(self, diagnostic) -> str:
        span = diagnostic.primary_span
        return self.text[span.start:span.end]

    def errors(self, code: str = "E010") -> list[tuple[str, str]]:
        """(message, spanned text) of each diagnostic with `code`."""
        return [(d.message, self.spanned(d)) for d in self.diagnostics if d.code == code]

    def one(self, fragment: str, code: str = "E010"):
        """The single diagnostic whose message contains `fragment` (and no other diagnostic
        of any code)."""
        assert len(self.diagnostics) == 1, [(d.code, d.message) for d in self.diagnostics]
        found = self.diagnostics[0]
        assert found.code == code and fragment in found.message, (found.code, found.message)
        return found


BASE = '''\
from std.modules.norm import RMSNormParams
from std.modules.moe import MoEExperts
from std.blocks.dense import DenseTransformerBlock

model Tiny(
  vocab: int = 64,
  d_model: int = 16,
  n_layers: int = 2,
  num_heads: int = 2,
  d_ff: int = 32,
  num_experts: int = 4,
  tie: bool = false,
  qk: bool = false
):
  params:
    embedding: [vocab, d_model]
    blocks: [n_layers] x DenseTransformerBlock(d_model, num_heads, num_heads, d_ff, 128, use_qk_norm=qk)
    experts: MoEExperts(num_experts, d_model, d_ff)
    final_norm: RMSNormParams(d_model)
    lm_head: [vocab, d_model] if not tie
    out_head: tied_to(embedding)

  hf_config:
    architecture: "TinyForCausalLM"
    config_class: "TinyConfig"
    param_mapping:
      vocab: vocab_size
      d_model: hidden_size
      n_layers: num_hidden_layers

  hf_mapping:
    embedding: "model.embed_tokens.weight"
    blocks[{i}].ln1.weight: "model.layers.{i}.input_layernorm.weight"
    blocks[{i}].attention.qkv_weight: fuse(
      "model.layers.{i}.self_attn.q_proj.weight",
      "model.layers.{i}.self_attn.k_proj.weight",
      "model.layers.{i}.self_attn.v_proj.weight",
      dim=0
    )
    blocks[{i}].attention.out_weight: "model.layers.{i}.self_attn.o_proj.weight"
    blocks[{i}].attention.q_norm?: "model.layers.{i}.self_attn.q_norm.weight"
    blocks[{i}].attention.k_norm?: "model.layers.{i}.self_attn.k_norm.weight"
    blocks[{i}].ln2.weight: "model.layers.{i}.post_attention_layernorm.weight"
    blocks[{i}].mlp.up_weight: fuse("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight", dim=0)
    blocks[{i}].mlp.down_weight: transform("model.layers.{i}.mlp.c_proj.weight", fn: transpose)
    experts.gate_up_weights: stack_experts(fuse("experts.{e}.w1.weight", "experts.{e}.w3.weight", dim=0), dim=0)
    experts.down_weights: stack_experts("experts.{e}.w2.weight", dim=0)
    final_norm.weight: "model.norm.weight"
    if not tie:
      lm_head: "lm_head.weight"
'''


UNDECIDED_ELSE = ('      lm_head: "lm_head.weight"',
                  '      lm_head: "lm_head.weight"\n    else:\n      lm_head: tied_to(embedding)')


def tiny(tmp_path: Path, *edits: tuple[str, str], args: dict | None = None,
         extra: str = "") -> Checked:
    """BASE with each (old, new) replaced once (old must occur), plus `extra` appended as
    sections of the model."""
    text = BASE
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "tiny.module"
    path.write_text(text + textwrap.indent(textwrap.dedent(extra), "  "), encoding="utf-8")
    return Checked(path, args)


# ============================================================================ std models
# GPT-2's head is always tied (`lm_head: tied_to(wte)`): no tie_word_embeddings parameter
ALWAYS_TIED = {"gpt2"}
TIE_CASES = [(path, tie) for path in STD_MODELS
             for tie in ((True,) if path.stem in ALWAYS_TIED else (False, True))]


@pytest.mark.parametrize("path, tie", TIE_CASES,
                         ids=[f"{p.stem}-{'tied' if t else 'untied'}" for p, t in TIE_CASES])
def test_std_models_map_every_weight(path, tie):
    checked = Checked(path, None if path.stem in ALWAYS_TIED else {"tie_word_embeddings": tie})
    assert checked.diagnostics == []
    plan = hf_plan(checked.instance)
    mapped = {entry["param"] for entry in plan}
    paths = weight_paths(checked.instance)
    weights = {w.path for w in paths}
    assert mapped == weights
    owned = {w.path for w in paths if w.tied_to is None}
    assert ("lm_head" in owned) is not tie


def test_std_model_files_have_the_models():
    assert {"gemma", "gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3"} \
        <= {p.stem for p in STD_MODELS}


@pytest.mark.parametrize("name", ["mamba"])
def test_examples_with_mappings_are_clean(name):
    assert Checked(ROOT / "examples" / f"{name}.module").diagnostics == []


# ============================================================================ weight_paths
def test_weight_paths_of_llama():
    checked = Checked(ROOT / "std" / "models" / "llama.module")
    paths = weight_paths(checked.instance)
    assert [w.path for w in paths] == [
        "embedding",
        "blocks[{i}].ln1.weight",
        "blocks[{i}].attention.qkv_weight",
        "blocks[{i}].attention.out_weight",
        "blocks[{i}].ln2.weight",
        "blocks[{i}].mlp.up_weight",
        "blocks[{i}].mlp.down_weight",
        "final_norm.weight",
        "lm_head",
    ]
    qkv = paths[2]
    assert [str(d) for d in qkv.type.dims] == ["12288", "4096"]
    assert [(level, str(count)) for level, count in qkv.stacks] == [("i", "32")]
    assert paths[0].stacks == () and not any(w.tied_to or w.optional for w in paths)


def test_weight_paths_conditional_and_tied(tmp_path):
    untied = weight_paths(tiny(tmp_path).instance)
    by_path = {w.path: w for w in untied}
    assert by_path["out_head"].tied_to == "embedding"
    assert "lm_head" in by_path and "blocks[{i}].attention.q_norm" not in by_path
    assert by_path["experts.gate_up_weights"].stacks == ()
    with_qk = {w.path for w in weight_paths(tiny(tmp_path, args={"tie": True, "qk": True})
                                            .instance)}
    assert "lm_head" not in with_qk
    assert {"blocks[{i}].attention.q_norm", "blocks[{i}].attention.k_norm"} <= with_qk


def test_weight_paths_of_gpt2_report_the_tied_head():
    paths = {w.path: w for w in weight_paths(Checked(ROOT / "std" / "models" / "gpt2.module")
                                             .instance)}
    assert paths["lm_head"].tied_to == "wte"
    assert paths["blocks[{i}].attn.qkv_bias"].tied_to is None


# ============================================================================ hf_plan
def test_plan_kinds(tmp_path):
    checked = tiny(tmp_path)
    assert checked.diagnostics == []
    plan = {entry["param"]: entry for entry in hf_plan(checked.instance)}
    assert plan["embedding"] == {
        "param": "embedding", "shape": [64, 16], "stacks": [], "optional": False,
        "kind": "direct", "hf": ["model.embed_tokens.weight"], "dim": None, "fn": None}
    qkv = plan["blocks[{i}].attention.qkv_weight"]
    assert qkv["kind"] == "fuse" and qkv["dim"] == 0 and len(qkv["hf"]) == 3
    assert qkv["stacks"] == [{"placeholder": "i", "count": 2}]
    down = plan["blocks[{i}].mlp.down_weight"]
    assert (down["kind"], down["fn"], down["inverse"]) == ("transform", "transpose", "transpose")
    gate_up = plan["experts.gate_up_weights"]
    assert gate_up["kind"] == "stack" and gate_up["expert"] == "e" and gate_up["count"] == 4
    assert gate_up["inner"] == {"kind": "fuse", "dim": 0,
                                "hf": ["experts.{e}.w1.weight", "experts.{e}.w3.weight"]}
    assert plan["experts.down_weights"]["inner"]["kind"] == "direct"
    assert plan["out_head"]["kind"] == "tied" and plan["out_head"]["target"] == "embedding"


def test_plan_uses_canonical_placeholders(tmp_path):
    checked = tiny(tmp_path, (
        'blocks[{i}].ln1.weight: "model.layers.{i}.input_layernorm.weight"',
        'blocks[{layer}].ln1.weight: "model.layers.{layer}.input_layernorm.weight"'))
    assert checked.diagnostics == []
    plan = {entry["param"]: entry for entry in hf_plan(checked.instance)}
    assert plan["blocks[{i}].ln1.weight"]["hf"] == ["model.layers.{i}.input_layernorm.weight"]


def test_plan_reports_nothing_and_marks_undecided_entries(tmp_path):
    # `tie` without a default: the `if` cannot be decided, both branches are kept
    checked = tiny(tmp_path, ("  tie: bool = false,", "  tie: bool,"),
                   UNDECIDED_ELSE)
    assert checked.diagnostics == []
    before = len(checked.world.diagnostics)
    plan = [e for e in hf_plan(checked.instance) if e["param"] == "lm_head"]
    assert [(e["kind"], e["condition"]) for e in plan] == [
        ("direct", "not tie"), ("tied", "not (not tie)")]
    assert len(checked.world.diagnostics) == before


def test_transform_registry_documents_inverses():
    assert {"negate_exp", "exp", "log", "neg", "transpose", "identity"} <= set(TRANSFORMS)
    assert TRANSFORMS["exp"].inverse == "log" and TRANSFORMS["log"].inverse == "exp"
    assert TRANSFORMS["transpose"].min_rank == 2


# ============================================================================ keys
def test_unknown_key_suggests_real_paths(tmp_path):
    checked = tiny(tmp_path, ("blocks[{i}].attention.out_weight:",
                              "blocks[{i}].atention.out_weight:"))
    found = checked.one("unknown parameter `blocks[{i}].atention.out_weight`")
    assert checked.spanned(found) == "blocks[{i}].atention.out_weight"
    assert found.help[0].startswith("did you mean `blocks[{i}].attention.out_weight`")
    assert found.labels[0].message == "`DenseTransformerBlock` has no parameter `atention`"
    # the path it meant is not reported as unmapped on top


def test_unknown_key_suggestions_use_the_keys_placeholder(tmp_path):
    checked = tiny(tmp_path, (
        'blocks[{i}].ln1.weight: "model.layers.{i}.input_layernorm.weight"',
        'blocks[{layer}].ln1.weigth: "model.layers.{layer}.input_layernorm.weight"'))
    found = checked.one("unknown parameter")
    assert "`blocks[{layer}].ln1.weight`" in found.help[0]


def test_key_naming_a_module(tmp_path):
    checked = tiny(tmp_path, ('final_norm.weight: "model.norm.weight"',
                              'final_norm: "model.norm.weight"'))
    found = checked.one("`final_norm` is a module, not a tensor")
    assert checked.spanned(found) == "final_norm"
    assert found.help == ("did you mean `final_norm.weight`?",)


def test_stack_without_index(tmp_path):
    checked = tiny(tmp_path, ('blocks[{i}].ln2.weight: "model.layers.{i}',
                              'blocks.ln2.weight: "model.layers.{i}'))
    errors = checked.errors()
    assert errors[0] == ("`blocks` is a stack of 2 layers: index it with a placeholder",
                         "blocks.ln2.weight")
    assert len(errors) == 1


def test_index_on_a_module_and_a_number_index(tmp_path):
    checked = tiny(tmp_path, ('final_norm.weight: "model.norm.weight"',
                              'final_norm[{i}].weight: "model.norm.{i}.weight"'))
    found = checked.one("`final_norm` is not a stack of layers")
    assert checked.spanned(found) == "i"  # the placeholder's name
    checked = tiny(tmp_path, ('blocks[{i}].ln2.weight: "model.layers.{i}.post',
                              'blocks[0].ln2.weight: "model.layers.0.post'))
    found = checked.one("a stack is indexed with a placeholder")
    assert checked.spanned(found) == "0"


def test_absent_conditional_parameter(tmp_path):
    checked = tiny(tmp_path, ("blocks[{i}].attention.q_norm?:", "blocks[{i}].attention.q_norm:"))
    found = checked.one("`blocks[{i}].attention.q_norm` is absent from this `Tiny`: its guard "
                        "`use_qk_norm` is false")
    assert checked.spanned(found) == "blocks[{i}].attention.q_norm"
    assert found.notes == ("in `CausalSelfAttention`, with use_qk_norm = false",)
    assert "optional" in found.help[0]
    # with `?` it is silent, and present it is mapped
    assert tiny(tmp_path).diagnostics == []
    assert tiny(tmp_path, args={"qk": True}).diagnostics == []


def test_entry_under_false_if_is_skipped(tmp_path):
    assert tiny(tmp_path, args={"tie": True}).diagnostics == []


def test_missing_mapping_at_the_section_header(tmp_path):
    checked = tiny(tmp_path, ('    final_norm.weight: "model.norm.weight"\n', ''))
    found = checked.one("parameter `final_norm.weight` has no `hf_mapping` entry")
    assert checked.spanned(found) == "hf_mapping"
    assert found.help == ('add `final_norm.weight: "<checkpoint tensor name>"` (shape [16])',)
    assert found.notes and "norm.module" in found.notes[0]


def test_missing_mapping_of_a_conditional_parameter(tmp_path):
    checked = tiny(tmp_path, ('    if not tie:\n      lm_head: "lm_head.weight"\n', ''))
    checked.one("parameter `lm_head` has no `hf_mapping` entry")
    assert tiny(tmp_path, ('    if not tie:\n      lm_head: "lm_head.weight"\n', ''),
                args={"tie": True}).diagnostics == []


def test_missing_mapping_uses_the_keys_placeholder_name(tmp_path):
    checked = tiny(tmp_path, (
        'blocks[{i}].ln1.weight: "model.layers.{i}.input_layernorm.weight"',
        'blocks[{layer}].ln1.weight: "model.layers.{layer}.input_layernorm.weight"'),
        ('    blocks[{i}].ln2.weight: "model.layers.{i}.post_attention_layernorm.weight"\n', ''))
    checked.one("parameter `blocks[{layer}].ln2.weight` has no `hf_mapping` entry")


def test_no_hf_mapping_no_coverage(tmp_path):
    text = BASE[:BASE.index("  hf_mapping:")]
    path = tmp_path / "nomap.module"
    path.write_text(text, encoding="utf-8")
    assert Checked(path).diagnostics == []


def test_duplicate_mapping_at_the_second_key(tmp_path):
    checked = tiny(tmp_path, ('    embedding: "model.embed_tokens.weight"\n',
                              '    embedding: "model.embed_tokens.weight"\n'
                              '    embedding?: "model.embed.weight"\n'))
    found = checked.one("`embedding` is mapped twice")
    assert checked.spanned(found) == "embedding"
    assert found.primary_span.line == 33
    assert found.labels[1].message == "first mapped here" and found.labels[1].span.line == 32


def test_exclusive_branches_are_not_duplicates(tmp_path):
    checked = tiny(tmp_path, ("  tie: bool = false,", "  tie: bool,"),
                   UNDECIDED_ELSE)
    assert checked.diagnostics == []


def test_if_guard_with_an_undefined_name(tmp_path):
    checked = tiny(tmp_path, ("    if not tie:", "    if not tied:"))
    assert [(d.code, d.message) for d in checked.diagnostics] == [
        ("E002", "undefined name `tied`")]


def test_key_that_is_not_a_path(tmp_path):
    checked = tiny(tmp_path, ('    embedding: "model.embed_tokens.weight"',
                              '    "embedding": "model.embed_tokens.weight"'))
    found = checked.one("a mapping key must be a parameter path")
    assert checked.spanned(found) == '"embedding"'


# ============================================================================ placeholders
def test_value_placeholder_not_in_key(tmp_path):
    checked = tiny(tmp_path, ('"model.layers.{i}.self_attn.o_proj.weight"',
                              '"model.layers.{j}.self_attn.o_proj.weight"'))
    found = checked.one("`{j}` is not a placeholder of the key")
    assert checked.spanned(found) == '"model.layers.{j}.self_attn.o_proj.weight"'
    assert found.help == ("the key binds `{i}`",)


def test_placeholder_in_a_key_outside_any_stack(tmp_path):
    checked = tiny(tmp_path, ('"model.norm.weight"', '"model.norm.{i}.weight"'))
    found = checked.one("`{i}` is not a placeholder of the key")
    assert "outside any layer stack" in found.help[0]


def test_key_placeholder_missing_from_the_name(tmp_path):
    checked = tiny(tmp_path, ('"model.layers.{i}.self_attn.o_proj.weight"',
                              '"model.layers.self_attn.o_proj.weight"'))
    found = checked.one("the checkpoint name does not use `{i}`")
    assert found.labels[0].message == "every layer would load this same tensor"


NESTED = """
model Nested(n: int = 2):
  params:
    outer: [n] x Inner(n)
  hf_mapping:
    MAPPING

module Inner(n: int):
  params:
    inner: [n] x Leaf()

module Leaf():
  params:
    w: [4]
"""


def nested(tmp_path, mapping: str) -> "Checked":
    """A model with a stack inside a stack, and one `hf_mapping` entry."""
    path = tmp_path / "nested.module"
    path.write_text(NESTED.replace("MAPPING", mapping), encoding="utf-8")
    return Checked(path)


def test_placeholder_used_twice_in_a_key(tmp_path):
    checked = nested(tmp_path, 'outer[{i}].inner[{i}].w: "x.{i}"')
    found = checked.one("placeholder `{i}` is used twice in this key")
    assert checked.spanned(found) == "i" and found.primary_span.column == 23  # the second
    assert [w.path for w in weight_paths(checked.instance)] == ["outer[{i}].inner[{j}].w"]


def test_nested_stacks(tmp_path):
    checked = nested(tmp_path, 'outer[{layer}].inner[{sub}].w: "x.{layer}.y.{sub}"')
    assert checked.diagnostics == []
    assert hf_plan(checked.instance)[0]["hf"] == ["x.{i}.y.{j}"]


# ============================================================================ fuse
def test_fuse_dim_out_of_range(tmp_path):
    checked = tiny(tmp_path, ('"model.layers.{i}.mlp.up_proj.weight", dim=0)',
                              '"model.layers.{i}.mlp.up_proj.weight", dim=2)'))
    found = checked.one("`dim=2` is out of range for `blocks[{i}].mlp.up_weight`")
    assert checked.spanned(found) == "2"
    assert found.labels[0].message == "rank 2: dim is 0 .. 1"


def test_fuse_negative_dim_is_counted_from_the_end(tmp_path):
    checked = tiny(tmp_path, ('"model.layers.{i}.mlp.up_proj.weight", dim=0)',
                              '"model.layers.{i}.mlp.up_proj.weight", dim=-2)'))
    assert checked.diagnostics == []
    plan = {e["param"]: e for e in hf_plan(checked.instance)}
    assert plan["blocks[{i}].mlp.up_weight"]["dim"] == 0


def test_fuse_needs_two_parts(tmp_path):
    checked = tiny(tmp_path, ('fuse("model.layers.{i}.mlp.gate_proj.weight", ', 'fuse('))
    found = checked.one("`fuse` needs at least two checkpoint tensors")
    assert checked.spanned(found) == "fuse"
    assert found.labels[0].message == "1 given"


def test_fuse_needs_dim(tmp_path):
    checked = tiny(tmp_path, ('"model.layers.{i}.mlp.up_proj.weight", dim=0)',
                              '"model.layers.{i}.mlp.up_proj.weight")'))
    found = checked.one("`fuse` needs `dim=`")
    assert checked.spanned(found) == "fuse"


def test_fuse_unknown_argument_and_part_kinds(tmp_path):
    checked = tiny(tmp_path, ('"model.layers.{i}.mlp.up_proj.weight", dim=0)',
                              '"model.layers.{i}.mlp.up_proj.weight", dim=0, axis=1)'))
    found = checked.one("`fuse` has no argument `axis`")
    assert checked.spanned(found) == "axis"
    checked = tiny(tmp_path, ('"model.layers.{i}.mlp.up_proj.weight", dim=0)',
                              'up_proj, dim=0)'))
    found = checked.one("a `fuse` part must be a checkpoint name (a string)")
    assert checked.spanned(found) == "up_proj"


def test_fuse_part_placeholders(tmp_path):
    checked = tiny(tmp_path, ('"model.layers.{i}.self_attn.k_proj.weight"',
                              '"model.layers.self_attn.k_proj.weight"'))
    found = checked.one("the checkpoint name does not use `{i}`")
    assert checked.spanned(found) == '"model.layers.self_attn.k_proj.weight"'


# ============================================================================ transform
def test_unknown_transform(tmp_path):
    checked = tiny(tmp_path, ("fn: transpose", "fn: transpos"))
    found = checked.one("unknown transform `transpos`")
    assert checked.spanned(found) == "transpos"
    assert found.help[0] == "did you mean `transpose`?"


def test_transform_needs_fn_and_one_name(tmp_path):
    checked = tiny(tmp_path, (', fn: transpose)', ')'))
    found = checked.one("`transform` needs `fn:`")
    assert checked.spanned(found) == "transform"
    checked = tiny(tmp_path, ('c_proj.weight", fn: transpose)',
                              'c_proj.weight", "x.{i}", fn: transpose)'))
    found = checked.one("`transform` takes one checkpoint name")
    assert checked.spanned(found) == '"x.{i}"'


def test_transform_string_fn_is_accepted(tmp_path):
    assert tiny(tmp_path, ("fn: transpose", 'fn="transpose"')).diagnostics == []


def test_transpose_needs_rank_two(tmp_path):
    checked = tiny(tmp_path, ('final_norm.weight: "model.norm.weight"',
                              'final_norm.weight: transform("model.norm.weight", fn: transpose)'))
    found = checked.one("`transpose` needs a tensor of rank 2 or more")
    assert checked.spanned(found) == "transpose"


def test_negate_exp(tmp_path):
    checked = tiny(tmp_path, ('final_norm.weight: "model.norm.weight"',
                              'final_norm.weight: transform("model.norm.weight", fn: negate_exp)'))
    assert checked.diagnostics == []


# ============================================================================ tied
def test_tied_to_value_names_a_parameter(tmp_path):
    checked = tiny(tmp_path, ('lm_head: "lm_head.weight"', 'lm_head: tied_to(embeding)'))
    found = checked.one("unknown parameter `embeding`")
    assert checked.spanned(found) == "embeding"
    assert found.help == ("did you mean `embedding`?",)
    assert tiny(tmp_path, ('lm_head: "lm_head.weight"', 'lm_head: tied_to(embedding)')) \
        .diagnostics == []


def test_tied_to_value_shape_must_match(tmp_path):
    checked = tiny(tmp_path, ('lm_head: "lm_head.weight"', 'lm_head: tied_to(final_norm.weight)'))
    found = checked.one("`final_norm.weight` has shape [16], `lm_head` has shape [64, 16]")
    assert checked.spanned(found) == "final_norm.weight"


def test_tied_to_in_a_stack(tmp_path):
    ok = tiny(tmp_path, ('blocks[{i}].ln2.weight: "model.layers.{i}.post_attention_layernorm.'
                         'weight"', "blocks[{i}].ln2.weight: tied_to(blocks[{i}].ln1.weight)"))
    assert ok.diagnostics == []
    bad = tiny(tmp_path, ('final_norm.weight: "model.norm.weight"',
                          "final_norm.weight: tied_to(blocks[{i}].ln1.weight)"))
    found = bad.one("`{i}` is not a placeholder of the key")
    assert bad.spanned(found) == "blocks[{i}].ln1.weight"


def test_declared_tied_parameter_mappings(tmp_path):
    same_name = ('    final_norm.weight:', '    out_head: "model.embed_tokens.weight"\n'
                 '    final_norm.weight:')
    assert tiny(tmp_path, same_name).diagnostics == []
    as_tied = ('    final_norm.weight:', '    out_head: tied_to(embedding)\n    final_norm.weight:')
    assert tiny(tmp_path, as_tied).diagnostics == []
    other = ('    final_norm.weight:', '    out_head: "lm_head.weight"\n    final_norm.weight:')
    checked = tiny(tmp_path, other, ('if not tie:\n      lm_head: "lm_head.weight"',
                                     'if not tie:\n      lm_head: tied_to(embedding)'))
    found = checked.one("`out_head` is tied to `embedding` and cannot load a checkpoint tensor "
                        "of its own")
    assert checked.spanned(found) == '"lm_head.weight"'
    assert found.labels[0].message == '`embedding` loads "model.embed_tokens.weight"'
    wrong = ('    final_norm.weight:', '    out_head: tied_to(lm_head)\n    final_norm.weight:')
    checked = tiny(tmp_path, wrong)
    found = checked.one("`out_head` is declared `tied_to(embedding)`")
    assert checked.spanned(found) == "lm_head"


# ============================================================================ stack_experts
def test_stack_experts_needs_an_expert_placeholder(tmp_path):
    checked = tiny(tmp_path, ('stack_experts("experts.{e}.w2.weight", dim=0)',
                              'stack_experts("experts.w2.weight", dim=0)'))
    found = checked.one("`stack_experts` needs an expert placeholder such as `{e}`")
    assert checked.spanned(found) == "stack_experts"


def test_stack_experts_one_expert_placeholder(tmp_path):
    checked = tiny(tmp_path, ('stack_experts("experts.{e}.w2.weight", dim=0)',
                              'stack_experts("experts.{e}.{x}.w2.weight", dim=0)'))
    checked.one("`stack_experts` takes one expert placeholder, found `{e}` and `{x}`")


def test_stack_experts_needs_an_expert_dimension(tmp_path):
    checked = tiny(tmp_path, ('final_norm.weight: "model.norm.weight"',
                              'final_norm.weight: stack_experts("model.norm.{e}.weight")'))
    found = checked.one("`stack_experts` needs a parameter with an expert dimension")
    assert checked.spanned(found) == "stack_experts"


def test_stack_experts_dims(tmp_path):
    checked = tiny(tmp_path, ('stack_experts("experts.{e}.w2.weight", dim=0)',
                              'stack_experts("experts.{e}.w2.weight", dim=3)'))
    found = checked.one("`dim=3` is out of range for `experts.down_weights`")
    assert checked.spanned(found) == "3"
    # the inner fuse works on one expert's tensor: rank 2, not 3
    checked = tiny(tmp_path, ('"experts.{e}.w3.weight", dim=0)', '"experts.{e}.w3.weight", dim=2)'))
    found = checked.one("`dim=2` is out of range for `experts.gate_up_weights` of one expert")
    assert checked.spanned(found) == "2"


def test_stack_experts_num_experts(tmp_path):
    ok = ('stack_experts("experts.{e}.w2.weight", dim=0)',
          'stack_experts("experts.{e}.w2.weight", dim=0, num_experts=num_experts)')
    assert tiny(tmp_path, ok).diagnostics == []
    bad = ('stack_experts("experts.{e}.w2.weight", dim=0)',
           'stack_experts("experts.{e}.w2.weight", dim=0, num_experts=8)')
    checked = tiny(tmp_path, bad)
    found = checked.one("`num_experts` is 8, but `experts.down_weights` has 4 experts along dim 0")
    assert checked.spanned(found) == "8"


def test_stack_experts_source(tmp_path):
    checked = tiny(tmp_path, ('stack_experts("experts.{e}.w2.weight", dim=0)',
                              'stack_experts(transform("experts.{e}.w2.weight", fn: neg), dim=0)'))
    found = checked.one("the source of `stack_experts` must be a checkpoint name or a `fuse(...)`")
    assert checked.spanned(found) == "transform"


def test_unknown_mapping_function(tmp_path):
    checked = tiny(tmp_path, ('embedding: "model.embed_tokens.weight"',
                              'embedding: fused("model.embed_tokens.weight")'))
    found = checked.one("unknown weight mapping `fused`")
    assert checked.spanned(found) == "fused"
    assert found.help == ("did you mean `fuse`?",)


def test_mapping_value_kinds(tmp_path):
    checked = tiny(tmp_path, ('embedding: "model.embed_tokens.weight"', 'embedding: 3'))
    found = checked.one("a weight mapping must be a checkpoint name or a mapping call")
    assert checked.spanned(found) == "3"


# ============================================================================ hf_config
def test_param_mapping_keys_are_model_parameters(tmp_path):
    checked = tiny(tmp_path, ("      d_model: hidden_size", "      d_modle: hidden_size"))
    found = checked.one("`d_modle` is not a parameter of `Tiny`")
    assert checked.spanned(found) == "d_modle"
    assert found.help == ("did you mean `d_model`?",)


def test_param_mapping_duplicate(tmp_path):
    checked = tiny(tmp_path, ("      d_model: hidden_size",
                              "      d_model: hidden_size\n      d_model: n_embd"))
    found = checked.one("`d_model` is mapped twice in `hf_config`")
    assert found.primary_span.line == 29


def test_architecture_must_be_a_string(tmp_path):
    checked = tiny(tmp_path, ('architecture: "TinyForCausalLM"', "architecture: TinyForCausalLM"))
    found = checked.one("`architecture` must be a string")
    assert checked.spanned(found) == "TinyForCausalLM"
    assert found.help == ('write `architecture: "TinyForCausalLM"`',)
    checked = tiny(tmp_path, ('config_class: "TinyConfig"', "config_class: 3"))
    checked.one("`config_class` must be a string")


def test_hf_config_top_level_entries(tmp_path):
    # `param: field` at the top of hf_config is a parameter mapping (tests/ui/clean)
    assert tiny(tmp_path, ('    config_class: "TinyConfig"\n',
                           '    config_class: "TinyConfig"\n    num_heads: num_attention_heads\n'
                           '    model_type: "tiny"\n')).diagnostics == []
    checked = tiny(tmp_path, ('    config_class: "TinyConfig"\n',
                              '    config_clas: "TinyConfig"\n'))
    found = checked.one("unknown `hf_config` entry `config_clas`")
    assert found.help == ("did you mean `config_class`?",)
    checked = tiny(tmp_path, ("    param_mapping:", "    param_maping:"))
    found = checked.one("unknown `hf_config` section `param_maping`")
    assert found.help == ("did you mean `param_mapping`?",)


# ============================================================================ hf_export
def test_hf_export_keys(tmp_path):
    export = '''
      hf_export:
        blocks[{layer}].attention.qkv_weight -> split(
          "model.layers.{layer}.self_attn.q_proj.weight": [0, 16],
          "model.layers.{layer}.self_attn.k_proj.weight": [16, 32],
          "model.layers.{layer}.self_attn.v_proj.weight": [32, 48],
          dim=0
        )
        embedding: "model.embed_tokens.weight"
        blocks[{layer}].attention.q_norm?: "model.layers.{layer}.self_attn.q_norm.weight"
    '''
    assert tiny(tmp_path, extra=export).diagnostics == []
    checked = tiny(tmp_path, extra=export.replace("embedding:", "embeding:"))
    found = checked.one("unknown parameter `embeding`")
    assert checked.spanned(found) == "embeding"
    checked = tiny(tmp_path, extra=export.replace('"model.layers.{layer}.self_attn.k_proj',
                                                  '"model.layers.{l}.self_attn.k_proj'))
    found = checked.one("`{l}` is not a placeholder of the key")
    assert checked.spanned(found) == '"model.layers.{l}.self_attn.k_proj.weight"'
    checked = tiny(tmp_path, extra=export.replace("q_norm?:", "q_norm:"))
    checked.one("is absent from this `Tiny`")


# ============================================================================ UI tests
@pytest.fixture
def weights_in_driver(monkeypatch):
    """`modulec check` with check_weights run for every model, until the driver calls it."""
    source = Path(driver.__file__).read_text(encoding="utf-8")
    if "check_weights" in source:
        return
    if not hasattr(driver, "check_tree"):
        pytest.skip("the driver has no check_tree to extend")
    original = driver.check_tree

    def check_tree(instance):
        original(instance)
        if instance.definition.kind == "model":
            check_weights(instance)

    monkeypatch.setattr(driver, "check_tree", check_tree)


@pytest.mark.parametrize("path", UI_WEIGHTS, ids=lambda p: p.name)
def test_ui_weights(path, weights_in_driver):
    import ui_harness

    outcome = ui_harness.check_file(path)
    assert outcome.ok, outcome.report()


def test_there_are_ui_weight_tests():
    assert len(UI_WEIGHTS) >= 8
