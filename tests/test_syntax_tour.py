"""One snippet per construct of the surface language (issue 2's list), each checked for the
tree it must produce and for a faithful print -> parse round trip."""

import pytest

from modulec.syntax import ast as A
from modulec.syntax.parser import parse_text
from modulec.syntax.printer import print_program


def parse(text: str) -> A.Program:
    result = parse_text(text)
    assert result.ok, [d.message for d in result.diagnostics]
    again = parse_text(print_program(result.program))
    assert again.ok and again.program == result.program, print_program(result.program)
    return result.program


def body(text: str, *path: str):
    """Items of the section at `path` inside the first declaration."""
    items = parse(text).decls[0].body
    for name in path:
        items = next(i for i in items if isinstance(i, A.Section) and i.name == name).body
    return items


def graph(lines: str):
    text = "module M():\n  forward:\n    graph:\n" + "".join(f"      {l}\n" for l in lines.splitlines())
    return body(text, "forward", "graph")


def test_declarations():
    program = parse('"""File doc."""\nabstract module Base(d: int):\n  params:\n    w: [d, d]\n'
                    "module L(d, h) extends Base:\n  params:\n    +extra: [d]\n"
                    "block Blk():\n  params:\n    ln: RMSNormParams(d)\nmodel Mod(\n  v: int = 32_000,\n):\n"
                    "  params:\n    e: [v, 8]\nprimitive p:\n  forward:\n    in: x: [*]\n"
                    "recipe R:\n  accumulation_dtype: fp32\n")
    decls = program.decls
    assert [(d.kind, d.abstract) for d in decls] == [("module", True), ("module", False),
                                                     ("block", False), ("model", False),
                                                     ("primitive", False), ("recipe", False)]
    assert decls[1].extends == A.Name("Base")
    assert decls[1].body[0].body[0].key == A.Unary("+", A.Name("extra"))
    assert decls[3].params[0].default.value == 32000
    assert decls[4].params is None and decls[5].params is None


def test_params_section_forms():
    items = body("module M(d, n, use_bias: bool = true):\n  params:\n"
                 "    bias: [d]? if use_bias\n    blocks: [n] x Block(d)\n    more: Array<n, Block(d)>\n"
                 "    w: [d, d] @shard(column) @dtype(fp8_e4m3)\n    lm_head: tied_to(embedding)\n"
                 "    attn: CausalSelfAttention(d, n)\n", "params")
    bias, blocks, more, w, head, attn = items
    assert isinstance(bias.value, A.IfExp) and bias.value.orelse is None
    assert isinstance(bias.value.body, A.OptionalType)
    assert blocks.value == more.value and isinstance(blocks.value, A.ArrayType)
    assert [a.name for a in w.annotations] == ["shard", "dtype"]
    assert isinstance(head.value, A.Call) and isinstance(attn.value, A.Call)


def test_let_constraints_and_constants():
    items = body("module M(d, h):\n  let:\n    D = d // h\n    constraint:\n"
                 '      d % h == 0, "divisible"\n      D <= 128, "limit"\n  constants:\n    k = 2 ** 10\n',
                 "let")
    binding, constraint = items
    assert binding.value.op == "//"
    assert [c.message.value for c in constraint.body] == ["divisible", "limit"]


def test_forward_and_backward_signatures():
    text = ("module M(d):\n  forward:\n    in: (x: [B, d], mask: [B] @gradient(skip))\n"
            "    out: y: [B, d, bf16]\n    graph:\n      x -> relu() -> y\n    save: [x]\n"
            "    recompute: [ln*_out, *_rstd]\n  backward:\n    inputs:\n      d_y: [B, d]\n"
            "    outputs:\n      d_x: [B, d]\n    graph:\n      (d_y, saved.x) -> relu_backward() -> d_x\n")
    forward = body(text, "forward")
    inputs, output = forward[0].value, forward[1].value
    assert [e.name for e in inputs.items] == ["x", "mask"]
    assert inputs.items[1].annotations[0].name == "gradient"
    assert output == A.NamedValue("y", A.ListExpr((A.Name("B"), A.Name("d"), A.Name("bf16"))))
    wildcards = forward[4].value.items
    assert wildcards[0] == A.Binary("*", A.Name("ln"), A.Name("_out"))
    assert wildcards[1] == A.Star("_rstd")
    assert body(text, "backward", "inputs")[0].key == A.Name("d_y")


def test_primitive_sections():
    items = parse("primitive mm:\n  params:\n    transpose: enum(NN, NT, TN, TT) = NN\n"
                  "    scale: float? = None\n  forward:\n    in: (A: [M, K], B: [K, N])\n"
                  "    out: C: [M, N]\n  backward:\n    d_A = mm(d_C, B, transpose=NT)\n"
                  "    out: d_x = view(d_out, shape)\n  save: [A, B]\n  impl:\n"
                  "    forward: kernels.copy if not contiguous, else no-op\n  invariants:\n"
                  "    - same_shape: [A, B]\n  constraints:\n    - x must be contiguous\n"
                  "  fusion:\n    patterns:\n      - [split, swiglu] -> fused_split_swiglu\n").decls[0].body
    params, _forward, backward, _save, impl, invariants, constraints, fusion = items
    assert params.body[0].default == A.Name("NN")
    assert isinstance(backward.body[0], A.Binding) and backward.body[1].default is not None
    assert impl.entries[0].text == "kernels.copy if not contiguous, else no-op"
    assert isinstance(invariants.body[0].item, A.Entry)
    assert constraints.body[0] == A.Prose(("x", "must", "be", "contiguous"))
    assert isinstance(fusion.body[0].body[0].item, A.Flow)


def test_weight_mapping_sections():
    text = ('model M():\n  hf_config:\n    architecture: "LlamaForCausalLM"\n    param_mapping:\n'
            "      d_model: hidden_size\n  hf_mapping:\n"
            '    blocks[{i}].attention.qkv_weight: fuse(\n      "q.{i}",  # rows\n      "k.{i}",\n'
            '      dim=0\n    )\n    blocks[{i}].bias?: "b.{i}"\n'
            '    blocks[{i}].A_log: transform("a.{i}", fn: negate_exp)\n  hf_export:\n'
            '    blocks[{i}].qkv -> split("q": [0, q_dim], "k": [q_dim, kv], dim=0)\n')
    fuse, optional, transform = body(text, "hf_mapping")
    assert isinstance(fuse.key.value.value, A.Index)
    assert fuse.key.value.value.subscripts == (A.Placeholder("i"),)
    assert isinstance(optional.key, A.OptionalType)
    assert transform.value.args[1] == A.Arg(A.Name("fn"), A.Name("negate_exp"), colon=True)
    (export,) = body(text, "hf_export")
    assert export.destination.expr.args[0].key == A.String('"q"')


@pytest.mark.parametrize("line, steps", [
    ("x -> y", 2),
    ("(a, b) -> add() -> c", 3),
    ("x -> split([1, 2], dim=-1) -> (a, _)", 3),
    ("x -> attn -> y", 3),
    ("x0 -> blocks[0:8]() -> x8 @checkpoint", 3),
    ("(d, saved.h, mlp) -> mlp.backward() -> (dh, dp)", 3),
    ("zeros([B, T, C]) -> r0", 2),
    ("x[:, :n] -> t", 2),
    ("heads -> transpose(1, 2) -> [B, T, H, D]\n-> view([B, T, H * D]) -> out", 5),
    ("in -> router() -> (w, i, aux @gradient(skip))", 3),
])
def test_flows(line, steps):
    (flow,) = graph(line)
    assert isinstance(flow, A.Flow) and len(flow.steps) == steps


def test_if_else_and_recompute_blocks_in_graphs():
    items = graph("if use_bias:\n  (y, b) -> add() -> out\nelse:\n  y -> out\nrecompute:\n"
                  "  saved.x -> relu() -> h")
    branch, recompute = items
    assert isinstance(branch, A.IfBlock) and len(branch.orelse) == 1
    assert recompute.name == "recompute" and isinstance(recompute.body[0], A.Flow)


def test_annotations_on_following_lines():
    (flow,) = graph("ln -> attention -> out\n  @hook(AfterAttn, mode=modify)\n"
                    "  @adapter(lora, rank=16, targets=[q, v])")
    assert [a.name for a in flow.destination.annotations] == ["hook", "adapter"]


def test_expressions_and_literals():
    items = body("module M():\n  let:\n    a = 1_000 + 2.5e-3\n    b = sqrt(d) * ceil_div(x, 8)\n"
                 '    c = min(a, b) if not flag and d >= 2 else "s"\n    e = (1, 2)\n    f = None\n'
                 "    g = true or false\n    h = x % 3 ** 2\n", "let")
    values = [i.value for i in items]
    assert values[0].left.value == 1000 and values[0].right.value == 0.0025
    assert isinstance(values[2], A.IfExp) and values[2].test.op == "and"
    assert values[4] == A.NoneLit() and values[5].op == "or"
    assert values[6].op == "%" and values[6].right.op == "**"


def test_imports_all_forms():
    program = parse("import primitives\nimport std.primitives.matmul.v1\n"
                    "import std.modules.attention.v2 as Attn\nimport std.modules.{Linear, SwiGLU_MLP}\n"
                    "from models.qwen import QwenMLP as MLP, Other\n")
    first, versioned, aliased, braces, from_ = program.items
    assert versioned.path[-1] == "v1" and aliased.alias == "Attn"
    assert [n.name for n in braces.names] == ["Linear", "SwiGLU_MLP"]
    assert [(n.name, n.alias) for n in from_.names] == [("QwenMLP", "MLP"), ("Other", None)]


def test_spans_point_at_the_source():
    text = "module M():\n  params:\n    weight: [d, d]\n"
    entry = parse(text).decls[0].body[0].body[0]
    span = entry.key.span
    assert (span.line, span.column, span.end_line, span.end_column) == (3, 5, 3, 11)
    assert text[span.start:span.end] == "weight"
    assert text[entry.span.start:entry.span.end] == "weight: [d, d]"
