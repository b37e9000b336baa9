"""The grammar itself: LALR(1) without conflicts, no terminal collisions, fast tables."""

from lark import Lark

from modulec.paths import grammar_file
from modulec.syntax.indenter import Indenter
from modulec.syntax.parser import lark_options, parse_text
from modulec.syntax.printer import print_program


def test_grammar_builds_in_strict_mode():
    # strict: any shift/reduce conflict or regex collision (via interegular) raises
    import interegular  # noqa: F401  (strict mode needs it to check collisions)

    Lark(grammar_file().read_text(encoding="utf-8"), postlex=Indenter(), **lark_options(strict=True))


def roundtrip(text: str):
    result = parse_text(text)
    assert result.ok, result.diagnostics
    printed = print_program(result.program)
    again = parse_text(printed)
    assert again.ok and again.program == result.program, printed
    return result.program


def test_in_and_out_are_tensor_names():
    program = roundtrip("module M():\n  forward:\n    in: [B, C]\n    out: [B, C]\n"
                        "    graph:\n      in -> relu() -> out\n")
    forward = program.decls[0].sections("forward")[0]
    assert [type(item).__name__ for item in forward.body] == ["Entry", "Entry", "Section"]


def test_continuation_lines_and_annotations_on_following_lines():
    program = roundtrip(
        "module M():\n  forward:\n    graph:\n      (a, b, c)\n        -> op() -> y\n"
        "        @hook(P, mode=modify)\n        @adapter(lora, rank=16, targets=[q, v])\n")
    flow = program.decls[0].sections("forward")[0].body[0].body[0]
    assert len(flow.steps) == 3
    assert [a.name for a in flow.destination.annotations] == ["hook", "adapter"]


def test_array_syntaxes_are_one_type():
    forms = ["[n] x Block(d)", "[n] × Block(d)", "Array<n, Block(d)>"]
    values = [roundtrip(f"model M():\n  params:\n    blocks: {form}\n").decls[0].body[0].body[0].value
              for form in forms]
    assert values[0] == values[1] == values[2]


def test_precedence_follows_python():
    text = "module M():\n  let:\n    a = -x ** 2\n    b = not p == q and r\n    c = 1 + 2 * 3 // 4\n"
    body = roundtrip(text).decls[0].body[0].body
    assert body[0].value.op == "-" and body[0].value.operand.op == "**"
    assert body[1].value.op == "and" and body[1].value.left.op == "not"
    assert body[2].value.op == "+" and body[2].value.right.op == "//"


def test_file_without_final_newline_and_comment_lines_anywhere():
    roundtrip("# header\nmodule M():  # trailing\n  # inside\n\n  params:\n    # deep\n    w: [d]")


def test_keywords_are_contextual():
    # `x` is the array operator only after an operand; `model` is a keyword only at top level
    roundtrip("module M():\n  forward:\n    graph:\n      x -> model() -> x2\n")


def test_imports():
    program = roundtrip("import std.modules.{Linear, SwiGLU_MLP as MLP}\n"
                        "import std.primitives.matmul.v1\nfrom a.b import C, D as E\n")
    assert program.items[0].names[1].alias == "MLP"
    assert program.items[1].path[-1] == "v1"
