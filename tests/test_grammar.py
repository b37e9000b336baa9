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


def test_the_folded_parse_loop_is_larks():
    """modulec.syntax.lalr's loop gives Lark.parse's tree for every std/ and examples/ file
    and raises Lark.parse's error (kind, token, place, expected terminals) on broken
    variants of them (the fuzz run's token edits)."""
    from lark.exceptions import UnexpectedInput

    from modulec.syntax import lalr
    from modulec.syntax.depth import beyond_limits
    from modulec.syntax.indenter import DedentError
    from modulec.syntax.parser import parser
    from tests.fuzz.mutate import mutant, sources

    p = parser()

    def outcome(parse, text):
        p.indenter.start(text)
        p.builder.file = "t.module"
        try:
            tree = parse(text)
            # a tree past the depth limit is compared by its shape only: == on 2,000 nested
            # brackets recurses past Python's limit (the parser reports it, E001)
            return (tree if beyond_limits(tree) is None else "too deep"), p.indenter.problems
        except UnexpectedInput as error:
            return (type(error), getattr(error, "token", None), error.pos_in_stream,
                    error.line, error.column, sorted(getattr(error, "expected", ()) or ()),
                    sorted(getattr(error, "allowed", ()) or ()), getattr(error, "char", None),
                    list(error.interactive_parser.parser_state.state_stack),
                    p.indenter.problems, list(p.indenter.open_brackets),
                    list(p.indenter.recent))
        except DedentError as error:
            return DedentError, error.problem
        except Exception as error:  # noqa: BLE001 - a builder's (a TooDeep chain), as lark's
            return type(error), str(error)

    broken = (mutant(i, 0).text for i in range(150))  # less the 20,000-token repeats
    texts = [text for _, text in sources()] + [t for t in broken if len(t) < 20_000]
    for text in texts:
        text = text if text.endswith("\n") else text + "\n"
        assert outcome(lambda t: lalr.parse(p.lark, t), text) == \
            outcome(p.lark.parse, text), text[:200]
