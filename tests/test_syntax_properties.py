"""Property tests of the parser and printer (hypothesis; deterministic: derandomize=True).

a. the corpus (spec examples, std/ and examples/ files) round-trips through the printer;
b. generated programs parse and round-trip, and generated integer expressions evaluate
   as Python evaluates the same text (operator precedence);
c. mutated corpus files never raise: the parser answers with a ParseResult, and a broken
   file gets E001 diagnostics with a span inside the file and a message.
"""

from __future__ import annotations

import operator

from hypothesis import HealthCheck, given, settings

from dsl_strategies import int_expressions, mutants, programs
from modulec.syntax import ast as A
from modulec.syntax.parser import ParseResult, parse_text
from modulec.syntax.printer import print_program
from spec_blocks import ROOT, declaration_blocks


def corpus() -> list[tuple[str, str]]:
    """(name, text) of the spec's complete examples and the repository's .module files."""
    items = [(f"spec:{line}", text) for line, text in declaration_blocks()]
    for folder in ("std", "examples"):
        for path in sorted((ROOT / folder).rglob("*.module")):
            items.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")))
    return items


CORPUS = corpus()
CORPUS_TEXTS = [text for _, text in CORPUS]

PROPERTY = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def parse_ok(text: str, name: str = "<generated>") -> A.Program:
    result = parse_text(text, name)
    assert result.ok and not result.diagnostics, \
        f"{name}: {[d.message for d in result.diagnostics]}\n{text}"
    return result.program


def assert_round_trip(text: str, name: str = "<generated>") -> None:
    tree = parse_ok(text, name)
    printed = print_program(tree)
    # one name for both reads of `printed`: the parser keeps its last results by name and
    # text (parser.RECENT), so the second read is not a second parse of the same text
    printed_name = f"printed {name}"
    assert parse_ok(printed, printed_name) == tree, f"{name} printed as:\n{printed}"
    assert print_program(parse_ok(printed, printed_name)) == printed


# ====================================================================== a. corpus
def test_corpus_round_trips():
    assert len(CORPUS) >= 94
    for name, text in CORPUS:
        assert_round_trip(text, name)


# ====================================================================== b. generated programs
@settings(PROPERTY, max_examples=400)
@given(programs())
def test_generated_programs_round_trip(source):
    assert_round_trip(source)


BINARY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul,
              "/": operator.truediv, "//": operator.floordiv, "%": operator.mod,
              "**": operator.pow}
COMPARE_OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, ">": operator.gt,
               "<=": operator.le, ">=": operator.ge}
UNARY_OPS = {"-": operator.neg, "+": operator.pos, "not": operator.not_}


def evaluate(node):
    """A ConstExpr evaluator with Python's semantics (short-circuits included)."""
    if isinstance(node, A.Number):
        return node.value
    if isinstance(node, A.Unary):
        return UNARY_OPS[node.op](evaluate(node.operand))
    if isinstance(node, A.Binary) and node.op in ("and", "or"):
        left = evaluate(node.left)
        return left if bool(left) == (node.op == "or") else evaluate(node.right)
    if isinstance(node, A.Binary):
        return BINARY_OPS[node.op](evaluate(node.left), evaluate(node.right))
    if isinstance(node, A.Compare):
        return _evaluate_chain(node)
    if isinstance(node, A.IfExp):
        return evaluate(node.body) if evaluate(node.test) else evaluate(node.orelse)
    raise TypeError(f"not a ConstExpr node: {node!r}")


def _evaluate_chain(node: A.Compare):
    left = evaluate(node.first)
    for op, operand in node.rest:
        right = evaluate(operand)
        if not COMPARE_OPS[op](left, right):
            return False
        left = right
    return True


def outcome(compute) -> str:
    """The value's repr, or the exception's type: both sides must agree on either."""
    try:
        return repr(compute())
    except (ZeroDivisionError, OverflowError) as error:
        return type(error).__name__


def parse_expression(source: str) -> A.Expr:
    binding = parse_ok(f"module M:\n  let:\n    v = {source}\n").decls[0].body[0].body[0]
    assert isinstance(binding, A.Binding)
    return binding.value


def printed_expression(node: A.Expr) -> str:
    program = A.Program((A.Decl("module", "M", None, (A.Section(
        A.Name("let"), (A.Binding(A.Name("v"), node),)),)),))
    return print_program(program).splitlines()[-1].strip().removeprefix("v = ")


@settings(PROPERTY, max_examples=600)
@given(int_expressions())
def test_expression_precedence_matches_python(source):
    node = parse_expression(source)
    expected = outcome(lambda: eval(source, {"__builtins__": {}}))
    assert outcome(lambda: evaluate(node)) == expected, f"{source!r} parsed as {node!r}"
    printed = printed_expression(node)
    assert outcome(lambda: eval(printed, {"__builtins__": {}})) == expected, \
        f"{source!r} printed as {printed!r}"
    assert parse_expression(printed) == node


# ====================================================================== c. mutations
def assert_reports_cleanly(text: str) -> None:
    name = "mutant.module"
    result = parse_text(text, name)  # any exception fails the test
    assert isinstance(result, ParseResult)
    if result.ok:
        return
    size = len(text if text.endswith("\n") else text + "\n")
    assert result.diagnostics
    for diagnostic in result.diagnostics:
        assert diagnostic.code == "E001", (diagnostic.code, diagnostic.message)
        assert diagnostic.message.strip()
        span = diagnostic.primary_span
        assert span is not None, diagnostic.message
        assert span.file == name
        assert 0 <= span.start <= span.end <= size, (span, size)
        assert 1 <= span.line <= span.end_line <= text.count("\n") + 2, span


@settings(PROPERTY, max_examples=1000)
@given(mutants(CORPUS_TEXTS))
def test_mutated_files_report_errors_without_raising(text):
    assert_reports_cleanly(text)
